// Read-only, memory-mapped n-gram trie (format in trie_format.hpp).
//
// Opening validates the header and the array bounds in O(1); lookups check
// every child range they follow, so a corrupt file raises TrieFormatError
// instead of reading out of bounds.  All methods are const and thread-safe.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "mapped_file.hpp"
#include "trie_format.hpp"

namespace dart_ngram {

class TrieFormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A node on one level; level 0 is the root (the empty context).
struct NodeRef {
  int level = 0;
  uint64_t index = 0;
};

// Tries up to this size are read into the page cache when opened (the default trie: well under a
// second from a cold disk); larger ones are asked in, in the background (MADV_WILLNEED).
inline constexpr size_t kPopulateMaxBytes = size_t{1} << 30;

class MappedTrie {
 public:
  explicit MappedTrie(const std::string& path);
  ~MappedTrie();
  MappedTrie(const MappedTrie&) = delete;
  MappedTrie& operator=(const MappedTrie&) = delete;

  const FileHeader& header() const { return header_; }
  int order() const { return static_cast<int>(header_.order); }
  const std::string& path() const { return path_; }
  std::string metadata_json() const;

  uint64_t count(NodeRef node) const;
  token_t token(NodeRef node) const;
  // Child of `node` carrying `tok`; false when absent.
  bool find_child(NodeRef node, token_t tok, NodeRef* child) const;
  // Node of the m-gram ctx[0..len); false when the m-gram is not stored.
  bool find(const token_t* ngram, size_t len, NodeRef* node) const;

  // Nodes of the stored suffixes of `context`, longest first, at most
  // order-1 tokens long, the empty suffix excluded.  Returns how many were
  // written to `out` (capacity kMaxOrder).
  int suffix_nodes(const token_t* context, size_t len, NodeRef* out) const;

  // DART back-off probability (docs/design.md §2): count(s.tok) / count(s) for the
  // longest stored suffix s of the context that has `tok` as a child; 0 when
  // no non-empty suffix predicts tok.  `suffixes` comes from suffix_nodes.
  // In a file with kFlagReferenceCounts a context or child of count 0 is passed
  // over (backed off from) and a ratio above 1 is clamped to 1.
  double probability(const NodeRef* suffixes, int num_suffixes, token_t tok) const;

  // The same for many tokens at once: tokens[order[0]] <= tokens[order[1]] <= ...
  // (ascending), so each suffix's children are scanned once, left to right,
  // with galloping searches.  out[i] is the probability of tokens[i].
  void probabilities(const NodeRef* suffixes, int num_suffixes, const token_t* tokens, const int* order,
                     int num_tokens, double* out) const;

  // Full structural check, O(size): offsets monotone, children sorted,
  // counts consistent.  Throws TrieFormatError on the first violation.
  void check_structure() const;

 private:
  struct Level {
    const uint32_t* tokens = nullptr;
    const uint8_t* counts = nullptr;
    const uint8_t* children = nullptr;
    uint64_t num_nodes = 0;
    uint32_t count_width = 0;
    uint32_t child_width = 0;
  };
  uint64_t child_offset(int level, uint64_t i) const;
  // count(child) / count(context) into *p; false when either is 0 (back off).  Without
  // kFlagReferenceCounts a zero count or a ratio above 1 is a corrupt file; with it
  // the ratio is clamped to 1.
  bool ratio(uint64_t context_count, uint64_t child_count, double* p) const;
  void children_range(NodeRef node, uint64_t* begin, uint64_t* end) const;

  std::string path_;
  FileHeader header_{};
  bool reference_counts_ = false;  // header flag kFlagReferenceCounts
  std::vector<int64_t> unigram_node_;  // token -> level-1 node, -1 if absent (small vocabularies)
  MappedFile file_;
  const uint8_t* base_ = nullptr;  // file_.data()
  size_t size_ = 0;                // file_.size()
  Level levels_[kMaxOrder + 1];  // 1-based; levels_[0] unused
};

}  // namespace dart_ngram
