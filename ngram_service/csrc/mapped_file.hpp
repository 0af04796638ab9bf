// A whole file mapped read-only (MAP_SHARED: every process on the host shares the
// page cache's copy); unmapped on destruction.  Used by the trie reader and the
// reference-format converter.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dart_ngram {

class MappedFile {
 public:
  // label names the file in errors ("n-gram trie", "reference trie").  An empty file
  // maps to data() == nullptr.  Throws std::runtime_error when it cannot be opened,
  // stat'ed or mapped (the descriptor is closed either way).
  MappedFile(const std::string& path, const std::string& label);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  void advise(int advice) const;  // madvise over the whole mapping

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace dart_ngram
