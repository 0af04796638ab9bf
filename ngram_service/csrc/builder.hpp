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

 private:
  std::unique_ptr<TrieBuilderImpl> impl_;
};

}  // namespace dart_ngram
