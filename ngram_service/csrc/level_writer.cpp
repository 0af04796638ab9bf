#include "level_writer.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace dart_ngram {

File::File(const std::string& path, const char* mode) : path_(path) {
  f_ = std::fopen(path.c_str(), mode);
  if (f_ == nullptr) {
    throw std::runtime_error("cannot open '" + path + "': " + std::strerror(errno));
  }
  buf_.resize(kIoBufferBytes);
  std::setvbuf(f_, buf_.data(), _IOFBF, buf_.size());
}

File::~File() {
  if (f_ != nullptr) std::fclose(f_);
}

void File::write(const void* data, size_t bytes) {
  if (bytes != 0 && std::fwrite(data, 1, bytes, f_) != bytes) fail("write");
}

size_t File::read(void* data, size_t bytes) {
  size_t n = std::fread(data, 1, bytes, f_);
  if (n != bytes && std::ferror(f_)) fail("read");
  return n;
}

void File::pad_to(uint64_t offset) {
  const long pos = std::ftell(f_);
  static const char zeros[kAlign] = {};
  if (pos < 0 || static_cast<uint64_t>(pos) > offset) fail("seek");
  write(zeros, offset - static_cast<uint64_t>(pos));
}

void File::close() {
  if (f_ != nullptr && std::fclose(f_) != 0) {
    f_ = nullptr;
    fail("close");
  }
  f_ = nullptr;
}

void File::fail(const char* what) {
  throw std::runtime_error(std::string("cannot ") + what + " '" + path_ + "': " + std::strerror(errno));
}

namespace {

// Copies `count` little-endian u64 values from `src` to `dst` as `width`-byte integers.
void copy_narrowed(File& src, File& dst, uint64_t count, uint32_t width) {
  std::vector<uint64_t> chunk(1 << 16);
  std::vector<uint32_t> narrow(chunk.size());
  while (count > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(count, chunk.size()));
    if (src.read(chunk.data(), n * 8) != n * 8) throw std::runtime_error("temporary level file is short");
    if (width == 8) {
      dst.write(chunk.data(), n * 8);
    } else {
      for (size_t i = 0; i < n; ++i) narrow[i] = static_cast<uint32_t>(chunk[i]);
      dst.write(narrow.data(), n * 4);
    }
    count -= n;
  }
}

void copy_bytes(File& src, File& dst, uint64_t bytes) {
  std::vector<char> chunk(kIoBufferBytes);
  while (bytes > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(bytes, chunk.size()));
    if (src.read(chunk.data(), n) != n) throw std::runtime_error("temporary level file is short");
    dst.write(chunk.data(), n);
    bytes -= n;
  }
}


}  // namespace

void LevelSink::open_files(const std::string& prefix, bool has_children_, const char* mode) {
  has_children = has_children_;
  tokens_path = prefix + ".tokens";
  counts_path = prefix + ".counts";
  children_path = prefix + ".children";
  tokens = std::make_unique<File>(tokens_path, mode);
  counts = std::make_unique<File>(counts_path, mode);
  if (has_children) children = std::make_unique<File>(children_path, mode);
}

void LevelSink::open(const std::string& prefix, bool has_children_) { open_files(prefix, has_children_, "wb"); }

void LevelSink::reopen(const std::string& prefix, bool has_children_, uint64_t emitted_, uint64_t max_count_) {
  open_files(prefix, has_children_, "ab");
  emitted = emitted_;
  max_count = max_count_;
}

BuildStats write_levels_from_files(const std::string& path, const std::string& metadata_json, int order,
                                   uint32_t vocab_size, uint64_t total_tokens,
                                   const std::vector<std::string>& prefixes,
                                   const std::vector<uint64_t>& nodes_per_level,
                                   const std::vector<uint64_t>& max_count_per_level) {
  const auto n = static_cast<size_t>(order);
  if (order < kMinOrder || order > kMaxOrder || prefixes.size() != n || nodes_per_level.size() != n ||
      max_count_per_level.size() != n) {
    throw std::invalid_argument("write_levels_from_files: one prefix, node count and largest count per level");
  }
  std::vector<LevelSink> levels(n);
  for (size_t m = 0; m < n; ++m) {
    levels[m].reopen(prefixes[m], m + 1 < n, nodes_per_level[m], max_count_per_level[m]);
  }
  return write_levels(path, metadata_json, order, vocab_size, total_tokens, levels.data());
}

BuildStats write_levels(const std::string& path, const std::string& metadata_json, int order, uint32_t vocab_size,
                        uint64_t total_tokens, LevelSink* levels, uint32_t flags) {
  FileHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = flags ? kFormatVersionFlags : kFormatVersion;
  h.flags = flags;
  h.order = static_cast<uint32_t>(order);
  h.vocab_size = vocab_size;
  h.total_tokens = total_tokens;
  h.metadata_bytes = static_cast<uint32_t>(metadata_json.size());
  h.header_bytes = static_cast<uint32_t>(align_up(sizeof(FileHeader) + metadata_json.size()));
  uint64_t offset = h.header_bytes;
  BuildStats stats;
  stats.total_tokens = total_tokens;
  for (int m = 1; m <= order; ++m) {
    LevelSink& s = levels[m - 1];
    if (s.has_children) {
      const uint64_t sentinel = levels[m].emitted;
      s.children->write(&sentinel, sizeof(sentinel));
      s.children->close();
    }
    s.tokens->close();
    s.counts->close();
    LevelEntry& e = h.levels[m - 1];
    e.num_nodes = s.emitted;
    e.count_width = s.max_count >> 32 ? 8 : 4;
    e.child_width = s.has_children ? (levels[m].emitted >> 32 ? 8 : 4) : 0;
    e.tokens_offset = offset;
    offset = align_up(offset + e.num_nodes * 4);
    e.counts_offset = offset;
    offset = align_up(offset + e.num_nodes * e.count_width);
    if (s.has_children) {
      e.children_offset = offset;
      offset = align_up(offset + (e.num_nodes + 1) * e.child_width);
    }
    h.num_nodes += s.emitted;
    stats.nodes_per_level.push_back(s.emitted);
  }
  h.file_bytes = offset;
  stats.num_nodes = h.num_nodes;
  stats.file_bytes = offset;

  File out(path, "wb");
  out.write(&h, sizeof(h));
  out.write(metadata_json.data(), metadata_json.size());
  for (int m = 1; m <= order; ++m) {
    LevelSink& s = levels[m - 1];
    const LevelEntry& e = h.levels[m - 1];
    out.pad_to(e.tokens_offset);
    File tokens(s.tokens_path, "rb");
    copy_bytes(tokens, out, e.num_nodes * 4);
    out.pad_to(e.counts_offset);
    File counts(s.counts_path, "rb");
    copy_narrowed(counts, out, e.num_nodes, e.count_width);
    if (s.has_children) {
      out.pad_to(e.children_offset);
      File children(s.children_path, "rb");
      copy_narrowed(children, out, e.num_nodes + 1, e.child_width);
    }
  }
  out.pad_to(h.file_bytes);
  out.close();
  return stats;
}

}  // namespace dart_ngram
