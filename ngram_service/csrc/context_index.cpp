#include "context_index.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace dart_ngram {

namespace {

constexpr int kMaxContext = 8;

inline uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// hash of a suffix grown one token to the left: the same for insertion and lookup
inline uint64_t extend(uint64_t h, int64_t token) { return mix(h ^ (static_cast<uint64_t>(token) + 1)); }
inline uint64_t with_next(uint64_t h, int64_t next) { return mix(h + 0x632be59bd9b4e019ULL * (next + 2)); }

}  // namespace

ContextIndex::ContextIndex(int max_context, size_t max_tokens, int min_context)
    : max_context_(max_context), min_context_(min_context), max_tokens_(max_tokens) {
  if (max_context < 1 || max_context > kMaxContext) {
    throw std::invalid_argument("max_context must be in 1.." + std::to_string(kMaxContext) + ", got " +
                                std::to_string(max_context));
  }
  if (min_context < 1 || min_context > max_context) {
    throw std::invalid_argument("min_context must be in 1..max_context (" + std::to_string(max_context) +
                                "), got " + std::to_string(min_context));
  }
  contexts_.resize(max_context);
  follows_.resize(max_context);
  if (max_tokens < static_cast<size_t>(2 * max_context + 2) || max_tokens > (1ULL << 31)) {
    throw std::invalid_argument("max_tokens must be in " + std::to_string(2 * max_context + 2) + "..2^31");
  }
}

void ContextIndex::suffix_hashes(const std::vector<int64_t>& seq, size_t end, uint64_t* out, int* count) const {
  uint64_t h = 0;
  int m = 0;
  for (; m < max_context_ && static_cast<size_t>(m) < end; ++m) {
    h = extend(h, seq[end - 1 - m]);
    out[m] = h;
  }
  *count = m;
}

void ContextIndex::index_position(size_t i) {
  uint64_t hashes[kMaxContext];
  int n = 0;
  suffix_hashes(tokens_, i, hashes, &n);
  const int64_t next = tokens_[i];
  for (int m = min_context_ - 1; m < n; ++m) {
    Seen& s = contexts_[m][hashes[m]];
    if (m == max_context_ - 1) earlier_[i] = s.count ? s.next_pos : kNoPosition;  // the occurrence before this one
    ++s.count;
    s.next_pos = static_cast<uint32_t>(i);
    ++follows_[m][with_next(hashes[m], next)];
  }
}

void ContextIndex::rebuild() {
  tokens_.erase(tokens_.begin(), tokens_.end() - static_cast<std::ptrdiff_t>(max_tokens_ / 2));
  for (auto& c : contexts_) c.clear();
  for (auto& f : follows_) f.clear();
  earlier_.assign(tokens_.size(), kNoPosition);
  for (size_t i = 1; i < tokens_.size(); ++i) index_position(i);
}

void ContextIndex::append(const int64_t* tokens, size_t n) {
  for (size_t j = 0; j < n; ++j) {
    if (tokens[j] < 0) throw std::invalid_argument("token ids must be >= 0");
  }
  for (size_t j = 0; j < n; ++j) {
    tokens_.push_back(tokens[j]);
    earlier_.push_back(kNoPosition);
    if (tokens_.size() > max_tokens_) {
      rebuild();
    } else {
      index_position(tokens_.size() - 1);
    }
  }
}

double ContextIndex::probability(const int64_t* extra, size_t n_extra, int64_t tok) const {
  // the last max_context tokens of tokens_ + extra
  std::vector<int64_t> tail;
  tail.reserve(max_context_);
  const size_t from_extra = std::min<size_t>(n_extra, max_context_);
  const size_t from_seq = std::min<size_t>(tokens_.size(), max_context_ - from_extra);
  tail.insert(tail.end(), tokens_.end() - static_cast<std::ptrdiff_t>(from_seq), tokens_.end());
  tail.insert(tail.end(), extra + (n_extra - from_extra), extra + n_extra);
  return probability_tail(tail, tok);
}

double ContextIndex::probability_tail(const std::vector<int64_t>& tail, int64_t tok) const {
  uint64_t hashes[kMaxContext];
  int n = 0;
  suffix_hashes(tail, tail.size(), hashes, &n);
  for (int m = n - 1; m >= min_context_ - 1; --m) {
    const auto c = contexts_[m].find(hashes[m]);
    if (c == contexts_[m].end()) continue;
    const auto f = follows_[m].find(with_next(hashes[m], tok));
    if (f == follows_[m].end()) continue;
    // evidence grows with the length of the matched context: a copy after one shared token is
    // right far less often than after max_context (README, "Context in the tree")
    return (static_cast<double>(m + 1) / static_cast<double>(max_context_)) *
           (static_cast<double>(f->second) / static_cast<double>(c->second.count));
  }
  return 0.0;
}

ContextIndex::Continuation ContextIndex::continuation(size_t max_len) const {
  Continuation out;
  uint64_t hashes[kMaxContext];
  int n = 0;
  suffix_hashes(tokens_, tokens_.size(), hashes, &n);
  for (int m = n - 1; m >= min_context_ - 1; --m) {
    const auto c = contexts_[m].find(hashes[m]);
    if (c == contexts_[m].end()) continue;
    out.match_length = m + 1;
    size_t pos = c->second.next_pos;
    for (size_t l = 0; l < max_len; ++l, ++pos) {  // past the end, the copy continues from itself
      const int64_t tok = pos < tokens_.size() ? tokens_[pos] : out.tokens[pos - tokens_.size()];
      out.probs.push_back(probability(out.tokens.data(), out.tokens.size(), tok));
      out.tokens.push_back(tok);
    }
    break;
  }
  return out;
}

ContextIndex::Continuation ContextIndex::continuation_after(const int64_t* query, size_t n, size_t max_len) const {
  Continuation out;
  const size_t take = std::min<size_t>(n, max_context_);
  std::vector<int64_t> tail(query + (n - take), query + n);
  uint64_t hashes[kMaxContext];
  int count = 0;
  suffix_hashes(tail, tail.size(), hashes, &count);
  for (int m = count - 1; m >= min_context_ - 1 && max_len > 0; --m) {
    const auto c = contexts_[m].find(hashes[m]);
    // a suffix whose most recent occurrence ended its document proposes nothing: a shorter one may
    if (c == contexts_[m].end() || tokens_[c->second.next_pos] == kBoundary) continue;
    // the match's true length: the hashes see at most max_context tokens, so compare further back while the
    // query is longer (a repeat of an earlier document matches far past max_context); never across a boundary
    const auto agree = [&](size_t end) {  // the matched suffix is tokens_[end - len, end)
      size_t len = static_cast<size_t>(m) + 1;
      while (len < n && len < end && tokens_[end - 1 - len] == query[n - 1 - len] && tokens_[end - 1 - len] != kBoundary)
        ++len;
      return len;
    };
    size_t from = c->second.next_pos, len = agree(from);
    // a full-length suffix seen more than once: the occurrence that agrees furthest back (the most recent on
    // a tie) among the latest kMaxOccurrences, so that a repeat of a text that repeats itself follows its own
    // place in it, not the latest place its last max_context tokens occurred
    if (m == max_context_ - 1 && n > take) {
      size_t pos = earlier_[from];
      for (int k = 1; k < kMaxOccurrences && pos != kNoPosition && len < n; ++k, pos = earlier_[pos]) {
        if (tokens_[pos] == kBoundary) continue;
        const size_t l = agree(pos);
        if (l > len) from = pos, len = l;
      }
    }
    out.match_length = static_cast<int>(len);
    std::vector<int64_t> t = tail;
    for (size_t pos = from; out.tokens.size() < max_len && pos < tokens_.size(); ++pos) {
      const int64_t tok = tokens_[pos];
      if (tok == kBoundary) break;
      out.probs.push_back(probability_tail(t, tok));
      out.tokens.push_back(tok);
      t.push_back(tok);
      if (t.size() > static_cast<size_t>(max_context_)) t.erase(t.begin());
    }
    break;
  }
  return out;
}

size_t ContextIndex::memory_bytes() const {
  size_t bytes = tokens_.capacity() * sizeof(int64_t) + earlier_.capacity() * sizeof(uint32_t);
  // a node of an unordered_map: the key, the value and the next pointer (libstdc++ caches no hash for
  // integer keys), plus one bucket pointer per bucket
  for (const auto& c : contexts_) {
    bytes += c.bucket_count() * sizeof(void*) + c.size() * (sizeof(uint64_t) + sizeof(Seen) + sizeof(void*));
  }
  for (const auto& f : follows_) {
    bytes += f.bucket_count() * sizeof(void*) + f.size() * (sizeof(uint64_t) + sizeof(uint32_t) + sizeof(void*));
  }
  return bytes;
}

}  // namespace dart_ngram
