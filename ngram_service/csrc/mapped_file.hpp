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
  // populate_max_bytes: a file no larger is read into the page cache while it is mapped
  // (MAP_POPULATE: the constructor returns once it is resident); 0 never.
  MappedFile(const std::string& path, const std::string& label, size_t populate_max_bytes = 0);
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
