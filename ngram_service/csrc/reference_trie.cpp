#include "reference_trie.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <utility>

#include "level_writer.hpp"
#include "mapped_file.hpp"
#include "trie_format.hpp"

namespace dart_ngram {

namespace {

constexpr uint64_t kHeaderBytes = 16;
constexpr uint64_t kRecordHead = 24;  // i32 token, u64 parent, i32 freq, u64 n_children
constexpr uint64_t kChildBytes = 12;  // i32 token, u64 index
constexpr uint64_t kProgressEvery = 1 << 16;

[[noreturn]] void bad(const std::string& what) { throw ReferenceFormatError(what); }

template <typename T>
T load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

struct Record {
  int32_t token;
  uint64_t parent;
  int32_t freq;
  uint64_t n_children;
  const char* children;  // n_children x (i32 token, u64 index)
};

Record record_at(const char* p) {
  return Record{load<int32_t>(p), load<uint64_t>(p + 4), load<int32_t>(p + 12), load<uint64_t>(p + 16),
                p + kRecordHead};
}

}  // namespace

ConvertStats convert_reference_trie(const std::string& src, const std::string& dst, uint32_t vocab_size,
                                    const std::string& metadata_json, const std::string& tmp_dir,
                                    const std::function<void(uint64_t)>& progress) {
  if (vocab_size == 0 || vocab_size >= kPadToken) throw std::invalid_argument("vocab_size must be in 1..2^32-2");
  const MappedFile in(src, "reference trie");
  const char* const data = reinterpret_cast<const char*>(in.data());
  ConvertStats stats;
  stats.source_bytes = in.size();
  if (in.size() < kHeaderBytes) bad("truncated: " + std::to_string(in.size()) + " bytes, shorter than the header");
  const uint64_t order = load<uint64_t>(data);
  const uint64_t n = load<uint64_t>(data + 8);
  if (order < static_cast<uint64_t>(kMinOrder) || order > static_cast<uint64_t>(kMaxOrder)) {
    bad("n-gram order " + std::to_string(order) + " in the header is outside " + std::to_string(kMinOrder) + ".." +
        std::to_string(kMaxOrder) + " (not a reference trie, or a corrupt one)");
  }
  if (n == 0) bad("the header says 0 nodes: a reference trie has at least its root");
  if (n > (in.size() - kHeaderBytes) / kRecordHead) {
    bad("truncated: the header says " + std::to_string(n) + " nodes, the file holds at most " +
        std::to_string((in.size() - kHeaderBytes) / kRecordHead));
  }
  stats.order = static_cast<int>(order);
  stats.source_nodes = n;

  // Pass 1: sequential; every record's offset into a temporary index, its fields checked.
  const std::string index_path = tmp_dir + "/reference-index.u64";
  struct Cleanup {
    std::vector<std::string> paths;
    ~Cleanup() {
      for (const auto& p : paths) std::remove(p.c_str());
    }
  } cleanup;
  cleanup.paths.push_back(index_path);
  in.advise(MADV_SEQUENTIAL);
  {
    File index(index_path, "wb");
    uint64_t off = kHeaderBytes, listed = 0;
    for (uint64_t i = 0; i < n; ++i) {
      if (in.size() - off < kRecordHead) {
        bad("truncated: record " + std::to_string(i) + " of " + std::to_string(n) + " starts at byte " +
            std::to_string(off) + " of " + std::to_string(in.size()));
      }
      const Record r = record_at(data + off);
      if (r.n_children > vocab_size || r.n_children > (in.size() - off - kRecordHead) / kChildBytes) {
        if (r.n_children <= vocab_size) {
          bad("truncated: record " + std::to_string(i) + " lists " + std::to_string(r.n_children) +
              " children past the end of the file");
        }
        bad("node " + std::to_string(i) + " lists " + std::to_string(r.n_children) +
            " children, more than the vocabulary of " + std::to_string(vocab_size));
      }
      if (i == 0 ? r.parent != 0 : r.parent >= i) {
        bad("node " + std::to_string(i) + " names node " + std::to_string(r.parent) +
            " as its parent; a parent always precedes its child");
      }
      if (i > 0 && (r.token < 0 || static_cast<uint64_t>(r.token) >= vocab_size)) {
        bad("node " + std::to_string(i) + " has token " + std::to_string(r.token) + ", outside the vocabulary of " +
            std::to_string(vocab_size));
      }
      for (uint64_t c = 0; c < r.n_children; ++c) {
        const uint64_t child = load<uint64_t>(r.children + c * kChildBytes + 4);
        if (child <= i || child >= n) {
          bad("node " + std::to_string(i) + " lists child index " + std::to_string(child) + ", outside " +
              std::to_string(i + 1) + ".." + std::to_string(n - 1));
        }
      }
      listed += r.n_children;
      index.write(&off, sizeof(off));
      off += kRecordHead + r.n_children * kChildBytes;
      if (progress && (i + 1) % kProgressEvery == 0) progress(i + 1);
    }
    if (off != in.size()) {
      bad(std::to_string(in.size() - off) + " bytes after the last of " + std::to_string(n) +
          " records (a corrupt header or a corrupt file)");
    }
    if (listed != n - 1) {
      bad("the child lists name " + std::to_string(listed) + " nodes, but a tree of " + std::to_string(n) +
          " nodes has " + std::to_string(n - 1) + " (the file is not a tree)");
    }
    index.close();
  }
  if (progress) progress(n);

  // Pass 2: depth-first from the root, children by token: every level comes out in its order.
  const MappedFile index(index_path, "record index");
  in.advise(MADV_RANDOM);
  index.advise(MADV_RANDOM);
  const char* const idx = reinterpret_cast<const char*>(index.data());
  auto rec = [&](uint64_t i) { return record_at(data + load<uint64_t>(idx + i * 8)); };
  const int N = static_cast<int>(order);
  std::vector<LevelSink> sinks(N);
  for (int m = 1; m <= N; ++m) {
    const std::string prefix = tmp_dir + "/reference-level" + std::to_string(m);
    sinks[m - 1].open(prefix, m < N);
    cleanup.paths.push_back(sinks[m - 1].tokens_path);
    cleanup.paths.push_back(sinks[m - 1].counts_path);
    if (m < N) cleanup.paths.push_back(sinks[m - 1].children_path);
  }
  std::vector<uint8_t> seen((n + 7) / 8, 0);
  seen[0] |= 1;
  // stack[m]: the sorted children of the node open at depth m, and the next one to visit
  std::vector<std::vector<std::pair<int32_t, uint64_t>>> kids(N + 1);
  std::vector<size_t> next(N + 1, 0);
  auto load_children = [&](uint64_t node, int depth) {
    const Record r = rec(node);
    auto& v = kids[depth];
    v.clear();
    v.reserve(r.n_children);
    for (uint64_t c = 0; c < r.n_children; ++c) {
      v.emplace_back(load<int32_t>(r.children + c * kChildBytes), load<uint64_t>(r.children + c * kChildBytes + 4));
    }
    std::sort(v.begin(), v.end());
    for (size_t c = 1; c < v.size(); ++c) {
      if (v[c].first == v[c - 1].first) {
        bad("node " + std::to_string(node) + " lists token " + std::to_string(v[c].first) + " twice");
      }
    }
    next[depth] = 0;
  };
  std::vector<int64_t> freq(N + 1, 0);  // freq[m]: the source freq of the node open at depth m
  uint64_t visited = 0, level1_total = 0;
  load_children(0, 0);
  int depth = 0;  // depth of the node whose children are being walked
  while (depth >= 0) {
    if (next[depth] == kids[depth].size()) {  // the node open at `depth` is done
      --depth;
      continue;
    }
    const auto [tok, child] = kids[depth][next[depth]++];
    const Record r = rec(child);
    if (seen[child >> 3] & (1u << (child & 7))) {
      bad("node " + std::to_string(child) + " is listed as a child twice (the file is not a tree)");
    }
    seen[child >> 3] |= static_cast<uint8_t>(1u << (child & 7));
    if (r.token != tok) {
      bad("node " + std::to_string(child) + " has token " + std::to_string(r.token) + " but its parent lists it as " +
          std::to_string(tok));
    }
    const uint64_t parent = depth == 0 ? 0 : kids[depth - 1][next[depth - 1] - 1].second;
    if (r.parent != parent) {
      bad("node " + std::to_string(child) + " names node " + std::to_string(r.parent) + " as its parent, but node " +
          std::to_string(parent) + " lists it");
    }
    const int m = depth + 1;  // the child's level
    if (m == N && r.n_children != 0) {
      bad("node " + std::to_string(child) + " at depth " + std::to_string(m) + " has children: deeper than the order " +
          std::to_string(N));
    }
    if (progress && ++visited % kProgressEvery == 0) progress(n + visited);
    // counts <= 0 and counts above the parent's come only from the reference's reduce() (reference_trie.hpp)
    const uint64_t count = r.freq > 0 ? static_cast<uint64_t>(r.freq) : 0;
    if (count == 0) ++stats.zero_count_nodes;
    if (m > 1 && r.freq > freq[depth]) ++stats.above_parent;
    if (m == 1) level1_total += count;
    sinks[m - 1].emit(static_cast<token_t>(tok), count, m < N ? sinks[m].emitted : 0);
    freq[m] = r.freq;
    if (m < N && r.n_children > 0) {
      load_children(child, m);
    } else {
      kids[m].clear();
      next[m] = 0;
    }
    depth = m;  // closed at once when it has no children
  }
  stats.flags = stats.zero_count_nodes || stats.above_parent ? kFlagReferenceCounts : 0;
  BuildStats written = write_levels(dst, metadata_json, N, vocab_size, level1_total, sinks.data(), stats.flags);
  if (progress) progress(2 * n);
  stats.nodes = written.num_nodes;
  stats.total_tokens = level1_total;
  stats.nodes_per_level = written.nodes_per_level;
  stats.file_bytes = written.file_bytes;
  return stats;
}

}  // namespace dart_ngram
