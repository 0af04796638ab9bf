// External-memory builder for the n-gram trie (trie_format.hpp).
//
// Every position i of a document contributes one window tokens[i..i+n)
// (shorter at the end of the document, padded with kPadToken), so the count
// of an m-gram equals the number of windows that start with it and one pass
// over the sorted windows yields every level.  Windows are buffered, sorted
// and run-length encoded into sorted runs on disk when the memory budget is
// full; finish() merges the runs (k-way) and streams the levels into per-level
// temporary files, then lays them out in the final file.  Memory use is the
// budget plus O(runs * read buffer), independent of the corpus size.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "trie_format.hpp"

namespace dart_ngram {

struct BuildStats {
  uint64_t total_tokens = 0;
  uint64_t num_nodes = 0;
  std::vector<uint64_t> nodes_per_level;
  uint64_t file_bytes = 0;
  uint64_t num_runs = 0;  // sorted runs spilled to disk
  uint64_t spilled_bytes = 0;  // bytes of those runs
  std::vector<uint64_t> max_count_per_level;  // finish_levels() only
};

class TrieBuilderImpl;

class TrieBuilder {
 public:
  // memory_bytes: budget for buffered windows before a run is spilled to
  // tmp_dir.  vocab_size: every token must be < vocab_size.
  TrieBuilder(int order, uint32_t vocab_size, std::string tmp_dir, uint64_t memory_bytes);
  ~TrieBuilder();

  // Adds documents: tokens[offsets[d] .. offsets[d+1]) is document d.
  // N-grams never cross document boundaries.  Throws std::invalid_argument
  // on a token id >= vocab_size.
  void add_documents(const token_t* tokens, size_t num_tokens, const int64_t* offsets, size_t num_docs);

  // Merges everything and writes the trie to `path` (checksums left zero for
  // the caller).  Nodes whose count is below min_count are dropped (their
  // descendants then are too: a child never outnumbers its parent).
  BuildStats finish(const std::string& path, const std::string& metadata_json, uint64_t min_count);

  // Adds windows already counted (a mapper's sorted run, or any order):
  // keys[i*order .. (i+1)*order) is window i, shorter windows padded with
  // kPadToken at the end, counts[i] its occurrences.  Buffered and spilled like
  // add_documents(); the result is the same as adding the documents the windows
  // came from.  Throws std::invalid_argument on a malformed window or a zero count.
  void add_counted(const token_t* keys, const uint64_t* counts, size_t num_windows);

  // finish() without the file: writes each level's stream to
  // `prefix`level<m>.tokens (u32), .counts (u64) and, below the last level,
  // .children (u64 CSR offsets into the next level of these files, without the
  // closing sentinel), for a caller that stitches key-range partitions
  // (level_writer.hpp: write_levels_from_files).  Fills max_count_per_level.
  BuildStats finish_levels(const std::string& prefix, uint64_t min_count);

 private:
  std::unique_ptr<TrieBuilderImpl> impl_;
};

// A mapper's half of a key-range partitioned build: every window of the
// documents (as add_documents()), sorted and counted, cut by first token at
// `boundaries` (ascending; partition p holds first tokens in
// [boundaries[p-1], boundaries[p]) ).  keys: [num_windows * order],
// counts: [num_windows], starts: [num_partitions + 1] offsets into both.
struct WindowRuns {
  std::vector<token_t> keys;
  std::vector<uint32_t> counts;
  std::vector<uint64_t> starts;
};
WindowRuns count_windows(int order, uint32_t vocab_size, const token_t* tokens, size_t num_tokens,
                         const int64_t* offsets, size_t num_docs, const token_t* boundaries,
                         size_t num_boundaries);

}  // namespace dart_ngram
