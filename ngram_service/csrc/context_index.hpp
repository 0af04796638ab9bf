// Per-request context index: n-gram statistics of one sequence (its prompt and
// the tokens accepted so far), updated as the sequence grows, for drafting from
// the request's own context (docs/design.md §2, "Context in the tree").
//
// For every context length m = 1..max_context it keeps, keyed by a 64-bit hash
// of the m tokens:
//   - count(s): how many times the m-gram s occurred *followed by a token*;
//   - the position of the token that followed its most recent occurrence;
// and, keyed by a hash of (s, next), count(s·next).  Appending n tokens costs
// O(n · max_context) hash-map updates; memory is bounded by `max_tokens`: past
// it, the index keeps the newest max_tokens / 2 tokens and rebuilds (amortised
// O(max_context) per token).
//
// Lookups follow the corpus trie's back-off rule, discounted by the length of
// the match: q(tok | seq) = (|s| / max_context) · count(s·tok) / count(s) for
// the longest suffix s of the sequence (at most max_context tokens) such that
// count(s·tok) > 0; 0 when no suffix predicts tok.  The discount is what the
// tuning split measured: a copy after a 1-token match was right 21 % of the
// time, after 2, 3 and 4 tokens 53 %, 63 % and 85 % (max_context 4).
// The continuation copies what followed the most recent earlier occurrence of
// the longest suffix that occurred before (prompt-lookup decoding's rule, with
// the longest match), extended periodically when it runs into the present.
//
// The same index serves as the n-gram service's live corpus: documents (finished sequences) are
// appended each followed by kBoundary, and continuation_after() matches an outside query (a
// request's last tokens) instead of the index's own suffix, stopping at a document's end.  There a
// short match in other requests' text says little about this one, so the index can keep only the
// lengths min_context..max_context (memory and inserts O(max_context - min_context + 1) per token):
// a shorter suffix is never looked up, and matches nothing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace dart_ngram {

class ContextIndex {
 public:
  // max_context: longest suffix looked up (1..8); max_tokens: tokens kept (>= 2 * max_context + 2);
  // min_context: shortest suffix kept and looked up (1..max_context).
  ContextIndex(int max_context, size_t max_tokens, int min_context = 1);

  // a token id no tokenizer uses: appended after each document of a live corpus; never matched by a query,
  // and a continuation stops before it
  static constexpr int64_t kBoundary = INT64_MAX;

  void append(const int64_t* tokens, size_t n);
  size_t size() const { return tokens_.size(); }  // tokens currently indexed
  const std::vector<int64_t>& tokens() const { return tokens_; }  // the tokens indexed, oldest first
  int max_context() const { return max_context_; }
  int min_context() const { return min_context_; }

  // q(tok | the indexed tokens followed by extra[0..n_extra)), as above.
  double probability(const int64_t* extra, size_t n_extra, int64_t tok) const;

  struct Continuation {
    std::vector<int64_t> tokens;  // what followed the match, in order
    std::vector<double> probs;    // probability() of each token given the ones before it
    int match_length = 0;         // tokens of the matched suffix (0: no match)
  };
  Continuation continuation(size_t max_len) const;
  // What followed the most recent occurrence of the longest suffix of query[0..n) (at most max_context
  // tokens) in the index that did not end its document, up to max_len tokens and never past a
  // kBoundary; probs under the query followed by the continuation's earlier tokens.  match_length is
  // how far back from that occurrence the query and the index agree (up to n tokens, within one
  // document): more than max_context where a longer query repeats earlier text (suffix decoding's
  // evidence: a longer match, a likelier continuation).  With such a query, a full-length suffix
  // that occurred several times continues from the occurrence that agrees furthest back (of its
  // latest kMaxOccurrences; the most recent on a tie).
  Continuation continuation_after(const int64_t* query, size_t n, size_t max_len) const;
  // bytes held by the token store and the hash maps (an estimate from their sizes and bucket counts)
  size_t memory_bytes() const;

 private:
  struct Seen {
    uint32_t count;     // occurrences followed by a token
    uint32_t next_pos;  // index of the token after the most recent occurrence
  };
  void index_position(size_t i);  // tokens_[i] as the follower of each context ending at i - 1
  void rebuild();
  // q(tok | tail): tail's last max_context tokens matched against the index
  double probability_tail(const std::vector<int64_t>& tail, int64_t tok) const;
  // hashes of the suffixes of length 1..max_context ending just before `end` in seq
  void suffix_hashes(const std::vector<int64_t>& seq, size_t end, uint64_t* out, int* count) const;

  static constexpr uint32_t kNoPosition = UINT32_MAX;
  static constexpr int kMaxOccurrences = 64;  // occurrences of a suffix continuation_after compares, latest first

  int max_context_;
  int min_context_;
  size_t max_tokens_;
  std::vector<int64_t> tokens_;
  // [i]: for the max_context tokens before tokens_[i], where the token after their previous occurrence sits
  // (kNoPosition: none), so that every occurrence of a full-length suffix can be visited, latest first
  std::vector<uint32_t> earlier_;
  std::vector<std::unordered_map<uint64_t, Seen>> contexts_;      // [m - 1], empty below min_context
  std::vector<std::unordered_map<uint64_t, uint32_t>> follows_;  // [m - 1], empty below min_context
};

}  // namespace dart_ngram
