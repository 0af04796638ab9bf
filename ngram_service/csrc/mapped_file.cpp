#include "mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace dart_ngram {

MappedFile::MappedFile(const std::string& path, const std::string& label, size_t populate_max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + label + " '" + path + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error("cannot stat " + label + " '" + path + "': " + std::strerror(err));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ == 0) {
    ::close(fd);
    return;
  }
  const int flags = MAP_SHARED | (size_ <= populate_max_bytes ? MAP_POPULATE : 0);
  void* mem = ::mmap(nullptr, size_, PROT_READ, flags, fd, 0);
  const int err = errno;
  ::close(fd);
  if (mem == MAP_FAILED) throw std::runtime_error("cannot mmap " + label + " '" + path + "': " + std::strerror(err));
  data_ = static_cast<const uint8_t*>(mem);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

void MappedFile::advise(int advice) const {
  if (data_ != nullptr) ::madvise(const_cast<uint8_t*>(data_), size_, advice);
}

}  // namespace dart_ngram
