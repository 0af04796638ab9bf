// Converter from the DART reference implementation's n-gram trie file (its
// TrieNgram::save: a raw dump of nodes with unsorted child lists) to the
// sorted, memory-mapped trie of trie_format.hpp.
//
// Reference format (x86-64 little-endian, no padding, no magic, no checksum):
//   u64 order | u64 node_count | node_count records, node 0 the root:
//   i32 token | u64 parent | i32 freq | u64 n_children | n_children x (i32 token, u64 node index)
// A node's freq counts the windows doc[i:i+order] that start with its path.
//
// Conversion: one sequential pass validates every record and writes a
// temporary index of record offsets; a depth-first walk from the root, each
// node's children sorted by token, then emits every level in lexicographic
// order straight into the level writer.  Memory: the walk's stack (<= order
// child lists), one visited bit per node, and the OS page cache over the
// source and the index (both read through mmap: clean, reclaimable pages).
//
// Rule for pruned files.  The reference's reduce() subtracts the counts of every
// pruned subtree from each kept ancestor, so a kept node's count can be 0 or
// negative, and below a kept child's.  The reference then divides as it is:
// 0/0 gives NaN, x/0 infinity, x/negative a negative "probability", a ratio can
// exceed 1, and a child of count 0 answers 0 without backing off.  Converted:
//   * every node is kept (the tree is unchanged, so every context the reference
//     finds is found), and a count <= 0 is stored as 0;
//   * the file gets kFlagReferenceCounts (trie_format.hpp) when any count was
//     <= 0 or above its parent's; its reader treats a count of 0 as no evidence,
//     backing off past such a context or child, and clamps a ratio above 1 to 1.
// So every probability the reference computes in (0, 1] comes out the same, and
// every query gets a finite probability in [0, 1].  The root's freq is not used
// (negative in pruned files); total_tokens is the sum of the level-1 counts.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace dart_ngram {

// A reference file that is truncated, inconsistent or otherwise cannot be right.
class ReferenceFormatError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ConvertStats {
  int order = 0;
  uint64_t source_nodes = 0;   // records in the source, the root included
  uint64_t source_bytes = 0;
  uint64_t nodes = 0;             // nodes written (the root excluded)
  uint64_t zero_count_nodes = 0;  // of those, freq <= 0 in the source (pruned files), stored as 0
  uint64_t above_parent = 0;      // nodes whose freq exceeds their parent's (pruned files)
  uint32_t flags = 0;             // header flags written (trie_format.hpp)
  uint64_t total_tokens = 0;
  std::vector<uint64_t> nodes_per_level;
  uint64_t file_bytes = 0;
};

// Converts `src` into a trie file at `dst` (checksums left zero for the caller).
// Temporary files go to tmp_dir.  progress(n) is called with records done so far
// (pass 1 counts 0 .. node_count, the walk node_count .. 2 * node_count).
// Throws ReferenceFormatError for a bad source, std::runtime_error for I/O.
ConvertStats convert_reference_trie(const std::string& src, const std::string& dst, uint32_t vocab_size,
                                    const std::string& metadata_json, const std::string& tmp_dir,
                                    const std::function<void(uint64_t)>& progress);

}  // namespace dart_ngram
