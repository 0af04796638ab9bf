#include "trie.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace dart_ngram {

namespace {

[[noreturn]] void corrupt(const std::string& path, const std::string& why) {
  throw TrieFormatError("n-gram trie '" + path + "' is corrupt or not a trie file: " + why);
}

constexpr uint32_t kDenseUnigramLimit = 1u << 24;

uint64_t read_uint(const uint8_t* base, uint32_t width, uint64_t i) {
  if (width == 4) {
    uint32_t v;
    std::memcpy(&v, base + 4 * i, 4);
    return v;
  }
  uint64_t v;
  std::memcpy(&v, base + 8 * i, 8);
  return v;
}

}  // namespace

MappedTrie::MappedTrie(const std::string& path) : path_(path), file_(path, "n-gram trie", kPopulateMaxBytes) {
  size_ = file_.size();
  if (size_ < sizeof(FileHeader)) {
    corrupt(path, "file is " + std::to_string(size_) + " bytes, shorter than the header");
  }
  base_ = file_.data();
  // searches touch the file at random (no read-ahead on a fault); a cold file would cost a disk read
  // per page a search first touches, milliseconds each, for as long as the traffic keeps reaching new
  // parts of it.  So a file up to kPopulateMaxBytes was read in while mapped, and a larger one is
  // asked into the page cache now, in the background
  file_.advise(MADV_RANDOM);
  if (size_ > kPopulateMaxBytes) file_.advise(MADV_WILLNEED);
  std::memcpy(&header_, base_, sizeof(FileHeader));
  const FileHeader& h = header_;
  if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0) corrupt(path, "bad magic bytes");
  if (h.version != kFormatVersion && h.version != kFormatVersionFlags) {
    corrupt(path, "format version " + std::to_string(h.version) + ", this build reads " +
                      std::to_string(kFormatVersion) + " and " + std::to_string(kFormatVersionFlags));
  }
  if ((h.version == kFormatVersion) != (h.flags == 0) || (h.flags & ~kKnownFlags)) {
    corrupt(path, "flags " + std::to_string(h.flags) + " do not fit format version " + std::to_string(h.version));
  }
  reference_counts_ = (h.flags & kFlagReferenceCounts) != 0;
  if (h.order < kMinOrder || h.order > kMaxOrder) {
    corrupt(path, "n-gram order " + std::to_string(h.order) + " outside 2..6");
  }
  if (h.file_bytes != size_) {
    corrupt(path, "header says " + std::to_string(h.file_bytes) + " bytes, file has " +
                      std::to_string(size_) + " (truncated?)");
  }
  if (h.header_bytes < sizeof(FileHeader) || h.header_bytes > size_ ||
      h.metadata_bytes > h.header_bytes - sizeof(FileHeader)) {
    corrupt(path, "inconsistent header size");
  }
  uint64_t total_nodes = 0;
  for (int m = 1; m <= order(); ++m) {
    const LevelEntry& e = h.levels[m - 1];
    const bool last = m == order();
    if (e.count_width != 4 && e.count_width != 8) corrupt(path, "bad count width");
    if (last ? (e.child_width != 0 || e.children_offset != 0)
             : (e.child_width != 4 && e.child_width != 8)) {
      corrupt(path, "bad child offsets entry");
    }
    if (e.num_nodes > size_) corrupt(path, "level node count larger than the file");
    auto check_array = [&](uint64_t off, uint64_t bytes) {
      if (off < h.header_bytes || off > size_ || bytes > size_ - off) {
        corrupt(path, "level " + std::to_string(m) + " array outside the file");
      }
    };
    check_array(e.tokens_offset, e.num_nodes * 4);
    check_array(e.counts_offset, e.num_nodes * e.count_width);
    if (!last) check_array(e.children_offset, (e.num_nodes + 1) * e.child_width);
    if (e.tokens_offset % 4 || e.counts_offset % 8 || e.children_offset % 8) {
      corrupt(path, "misaligned array");
    }
    Level& lv = levels_[m];
    lv.tokens = reinterpret_cast<const uint32_t*>(base_ + e.tokens_offset);
    lv.counts = base_ + e.counts_offset;
    lv.children = last ? nullptr : base_ + e.children_offset;
    lv.num_nodes = e.num_nodes;
    lv.count_width = e.count_width;
    lv.child_width = e.child_width;
    total_nodes += e.num_nodes;
  }
  if (total_nodes != h.num_nodes) corrupt(path, "level sizes do not add up to the node count");
  if (levels_[1].num_nodes > h.vocab_size) corrupt(path, "more unigrams than the vocabulary");
  for (int m = 1; m < order(); ++m) {
    if (child_offset(m, 0) != 0 || child_offset(m, levels_[m].num_nodes) != levels_[m + 1].num_nodes) {
      corrupt(path, "level " + std::to_string(m) + " child offsets do not span level " +
                        std::to_string(m + 1));
    }
  }
  // Level-1 lookups by direct indexing: O(vocab) once, cheap next to model loading.
  if (h.vocab_size <= kDenseUnigramLimit) {
    unigram_node_.assign(h.vocab_size, -1);
    for (uint64_t i = 0; i < levels_[1].num_nodes; ++i) {
      const token_t t = levels_[1].tokens[i];
      if (t < h.vocab_size) unigram_node_[t] = static_cast<int64_t>(i);
    }
  }
}

MappedTrie::~MappedTrie() = default;

std::string MappedTrie::metadata_json() const {
  return std::string(reinterpret_cast<const char*>(base_ + sizeof(FileHeader)), header_.metadata_bytes);
}

uint64_t MappedTrie::child_offset(int level, uint64_t i) const {
  const Level& lv = levels_[level];
  return read_uint(lv.children, lv.child_width, i);
}

uint64_t MappedTrie::count(NodeRef node) const {
  if (node.level == 0) return header_.total_tokens;
  const Level& lv = levels_[node.level];
  return read_uint(lv.counts, lv.count_width, node.index);
}

token_t MappedTrie::token(NodeRef node) const { return levels_[node.level].tokens[node.index]; }

void MappedTrie::children_range(NodeRef node, uint64_t* begin, uint64_t* end) const {
  if (node.level == 0) {
    *begin = 0;
    *end = levels_[1].num_nodes;
    return;
  }
  *begin = child_offset(node.level, node.index);
  *end = child_offset(node.level, node.index + 1);
  if (*begin > *end || *end > levels_[node.level + 1].num_nodes) {
    corrupt(path_, "child range of a level-" + std::to_string(node.level) + " node out of bounds");
  }
}

bool MappedTrie::find_child(NodeRef node, token_t tok, NodeRef* child) const {
  if (node.level >= order()) return false;
  if (node.level == 0 && !unigram_node_.empty()) {
    if (tok >= unigram_node_.size() || unigram_node_[tok] < 0) return false;
    *child = {1, static_cast<uint64_t>(unigram_node_[tok])};
    return true;
  }
  uint64_t lo, hi;
  children_range(node, &lo, &hi);
  const uint32_t* toks = levels_[node.level + 1].tokens;
  const uint32_t* it = std::lower_bound(toks + lo, toks + hi, tok);
  if (it == toks + hi || *it != tok) return false;
  child->level = node.level + 1;
  child->index = static_cast<uint64_t>(it - toks);
  return true;
}

bool MappedTrie::find(const token_t* ngram, size_t len, NodeRef* node) const {
  NodeRef cur{};
  for (size_t i = 0; i < len; ++i) {
    if (!find_child(cur, ngram[i], &cur)) return false;
  }
  *node = cur;
  return true;
}

int MappedTrie::suffix_nodes(const token_t* context, size_t len, NodeRef* out) const {
  const size_t max_len = std::min<size_t>(len, static_cast<size_t>(order() - 1));
  int n = 0;
  for (size_t m = max_len; m >= 1; --m) {
    if (find(context + len - m, m, &out[n])) ++n;
  }
  return n;
}

bool MappedTrie::ratio(uint64_t context_count, uint64_t child_count, double* p) const {
  if (context_count == 0 || child_count == 0 || child_count > context_count) {
    if (!reference_counts_) corrupt(path_, "a zero count, or a child count above its context's");
    if (context_count == 0 || child_count == 0) return false;  // no evidence: back off
    *p = 1.0;
    return true;
  }
  *p = static_cast<double>(child_count) / static_cast<double>(context_count);
  return true;
}

double MappedTrie::probability(const NodeRef* suffixes, int num_suffixes, token_t tok) const {
  for (int i = 0; i < num_suffixes; ++i) {
    NodeRef child;
    if (find_child(suffixes[i], tok, &child)) {
      double p;
      if (ratio(count(suffixes[i]), count(child), &p)) return p;
    }
  }
  return 0.0;
}

void MappedTrie::probabilities(const NodeRef* suffixes, int num_suffixes, const token_t* tokens,
                               const int* order, int num_tokens, double* out) const {
  for (int i = 0; i < num_tokens; ++i) out[i] = -1.0;  // -1: not predicted yet
  int unresolved = num_tokens;
  for (int s = 0; s < num_suffixes && unresolved > 0; ++s) {
    const NodeRef ctx = suffixes[s];
    if (ctx.level >= this->order()) continue;
    uint64_t lo, hi;
    children_range(ctx, &lo, &hi);
    const uint32_t* toks = levels_[ctx.level + 1].tokens;
    const uint64_t denom = count(ctx);
    if (denom == 0 && reference_counts_) continue;  // no evidence in this context: back off
    for (int r = 0; r < num_tokens && lo < hi; ++r) {
      const int i = order[r];
      if (out[i] >= 0.0) continue;
      // Gallop: every child before lo is smaller than the token; probe
      // lo, lo+1, lo+3, lo+7, ... until a child >= token, then bisect.
      uint64_t probe = lo, step = 1;
      while (probe < hi && toks[probe] < tokens[i]) {
        lo = probe + 1;
        probe = std::min(hi, probe + step);
        step *= 2;
      }
      const uint32_t* it = std::lower_bound(toks + lo, toks + probe, tokens[i]);
      lo = static_cast<uint64_t>(it - toks);
      if (lo < hi && *it == tokens[i]) {
        if (ratio(denom, count({ctx.level + 1, lo}), &out[i])) --unresolved;
      }
    }
  }
  for (int i = 0; i < num_tokens; ++i) {
    if (out[i] < 0.0) out[i] = 0.0;
  }
}

void MappedTrie::check_structure() const {
  for (int m = 1; m <= order(); ++m) {
    const Level& lv = levels_[m];
    const uint64_t parents = m == 1 ? 1 : levels_[m - 1].num_nodes;
    for (uint64_t p = 0; p < parents; ++p) {
      NodeRef parent{m - 1, m == 1 ? 0 : p};
      uint64_t lo, hi;
      children_range(parent, &lo, &hi);
      uint64_t sum = 0;
      for (uint64_t i = lo; i < hi; ++i) {
        if (i > lo && lv.tokens[i] <= lv.tokens[i - 1]) corrupt(path_, "children not sorted by token");
        if (lv.tokens[i] >= header_.vocab_size) corrupt(path_, "token id outside the vocabulary");
        const uint64_t c = count({m, i});
        if (c == 0 && !reference_counts_) corrupt(path_, "zero count");
        sum += c;
      }
      if (sum > count(parent) && !reference_counts_) corrupt(path_, "children counts exceed their parent's");
    }
  }
}

}  // namespace dart_ngram
