// Writing a trie file (trie_format.hpp) from levels streamed in order: shared by
// the corpus builder (builder.cpp) and the reference-format converter
// (reference_trie.cpp).  Each level's tokens, counts and first-child offsets go
// to temporary files as they come; write_levels() then lays them out, with
// count and offset widths chosen per level (4 bytes when the values fit).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "builder.hpp"
#include "trie_format.hpp"

namespace dart_ngram {

inline constexpr size_t kIoBufferBytes = 1 << 20;

// A FILE* with a large buffer that throws std::runtime_error on every I/O error.
class File {
 public:
  File(const std::string& path, const char* mode);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  void write(const void* data, size_t bytes);
  // Reads up to `bytes`; returns the number read (0 at end of file).
  size_t read(void* data, size_t bytes);
  void pad_to(uint64_t offset);
  void close();

 private:
  [[noreturn]] void fail(const char* what);
  std::string path_;
  std::FILE* f_ = nullptr;
  std::vector<char> buf_;
};

// One level's nodes, in the level's order (lexicographic by m-gram).
struct LevelSink {
  void open(const std::string& prefix, bool has_children);
  // Takes over level files written earlier (prefix.tokens/.counts/.children, the last
  // without its sentinel) holding `emitted` nodes whose largest count is `max_count`.
  void reopen(const std::string& prefix, bool has_children, uint64_t emitted, uint64_t max_count);
  // first_child: how many nodes the next level held when this node was emitted.
  void emit(token_t tok, uint64_t count, uint64_t first_child) {
    tokens->write(&tok, sizeof(tok));
    counts->write(&count, sizeof(count));
    if (has_children) children->write(&first_child, sizeof(first_child));
    if (count > max_count) max_count = count;
    ++emitted;
  }
  // The same in two parts, for a writer that knows a node's count only after its subtree
  // (nodes of one level must get their counts in the order of their keys).
  void emit_key(token_t tok, uint64_t first_child) {
    tokens->write(&tok, sizeof(tok));
    if (has_children) children->write(&first_child, sizeof(first_child));
    ++emitted;
  }
  void emit_count(uint64_t count) {
    counts->write(&count, sizeof(count));
    if (count > max_count) max_count = count;
  }
  void open_files(const std::string& prefix, bool has_children, const char* mode);  // "wb" or "ab"
  bool has_children = false;
  std::string tokens_path, counts_path, children_path;
  std::unique_ptr<File> tokens, counts, children;
  uint64_t emitted = 0;
  uint64_t max_count = 0;
};

// Writes the file from levels[0 .. order-1] (level 1 first); closes the sinks.
// Checksums are left zero for the caller (the Python layer writes them).
// flags: header flags (trie_format.hpp); a file with any set is version 2.
BuildStats write_levels(const std::string& path, const std::string& metadata_json, int order, uint32_t vocab_size,
                        uint64_t total_tokens, LevelSink* levels, uint32_t flags = 0);

// write_levels() from level files already on disk (LevelSink::reopen), e.g. the
// key-range partitions of a distributed build put end to end.
BuildStats write_levels_from_files(const std::string& path, const std::string& metadata_json, int order,
                                   uint32_t vocab_size, uint64_t total_tokens,
                                   const std::vector<std::string>& prefixes,
                                   const std::vector<uint64_t>& nodes_per_level,
                                   const std::vector<uint64_t>& max_count_per_level);

}  // namespace dart_ngram
