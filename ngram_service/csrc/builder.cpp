#include "builder.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <queue>
#include <stdexcept>

namespace dart_ngram {

namespace {

constexpr size_t kIoBufferBytes = 1 << 20;

// A FILE* with a large buffer that throws on every I/O error.
class File {
 public:
  File(const std::string& path, const char* mode) : path_(path) {
    f_ = std::fopen(path.c_str(), mode);
    if (f_ == nullptr) {
      throw std::runtime_error("cannot open '" + path + "': " + std::strerror(errno));
    }
    buf_.resize(kIoBufferBytes);
    std::setvbuf(f_, buf_.data(), _IOFBF, buf_.size());
  }
  ~File() {
    if (f_ != nullptr) std::fclose(f_);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  void write(const void* data, size_t bytes) {
    if (bytes != 0 && std::fwrite(data, 1, bytes, f_) != bytes) fail("write");
  }
  // Reads up to `bytes`; returns the number read (0 at end of file).
  size_t read(void* data, size_t bytes) {
    size_t n = std::fread(data, 1, bytes, f_);
    if (n != bytes && std::ferror(f_)) fail("read");
    return n;
  }
  void pad_to(uint64_t offset) {
    const long pos = std::ftell(f_);
    static const char zeros[kAlign] = {};
    if (pos < 0 || static_cast<uint64_t>(pos) > offset) fail("seek");
    write(zeros, offset - static_cast<uint64_t>(pos));
  }
  void close() {
    if (f_ != nullptr && std::fclose(f_) != 0) {
      f_ = nullptr;
      fail("close");
    }
    f_ = nullptr;
  }

 private:
  [[noreturn]] void fail(const char* what) {
    throw std::runtime_error(std::string("cannot ") + what + " '" + path_ + "': " + std::strerror(errno));
  }
  std::string path_;
  std::FILE* f_ = nullptr;
  std::vector<char> buf_;
};

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

class TrieBuilderImpl {
 public:
  virtual ~TrieBuilderImpl() = default;
  virtual void add_documents(const token_t* tokens, size_t num_tokens, const int64_t* offsets,
                             size_t num_docs) = 0;
  virtual BuildStats finish(const std::string& path, const std::string& metadata_json,
                            uint64_t min_count) = 0;
};

namespace {

template <int N>
class OrderedBuilder final : public TrieBuilderImpl {
  using Key = std::array<token_t, N>;
  static constexpr size_t kRecordBytes = sizeof(Key) + sizeof(uint64_t);

 public:
  OrderedBuilder(uint32_t vocab_size, std::string tmp_dir, uint64_t memory_bytes)
      : vocab_size_(vocab_size), tmp_dir_(std::move(tmp_dir)) {
    capacity_ = std::max<uint64_t>(1024, memory_bytes / sizeof(Key));
  }

  ~OrderedBuilder() override {
    for (const auto& path : temp_files_) std::remove(path.c_str());
  }

  void add_documents(const token_t* tokens, size_t num_tokens, const int64_t* offsets,
                     size_t num_docs) override {
    if (finished_) throw std::logic_error("TrieBuilder.finish() was already called");
    if (buffer_.capacity() < capacity_) buffer_.reserve(capacity_);  // virtual until touched
    for (size_t d = 0; d < num_docs; ++d) {
      const int64_t b = offsets[d], e = offsets[d + 1];
      if (b < 0 || e < b || static_cast<uint64_t>(e) > num_tokens) {
        throw std::invalid_argument("document offsets must be non-decreasing and within the token array");
      }
      for (int64_t i = b; i < e; ++i) {
        if (tokens[i] >= vocab_size_) {
          throw std::invalid_argument("token id " + std::to_string(tokens[i]) +
                                      " is outside the vocabulary of " + std::to_string(vocab_size_));
        }
      }
      for (int64_t i = b; i < e; ++i) {
        Key key;
        for (int j = 0; j < N; ++j) key[j] = i + j < e ? tokens[i + j] : kPadToken;
        buffer_.push_back(key);
        if (buffer_.size() >= capacity_) spill();
      }
      total_tokens_ += static_cast<uint64_t>(e - b);
    }
  }

  BuildStats finish(const std::string& path, const std::string& metadata_json,
                    uint64_t min_count) override {
    if (finished_) throw std::logic_error("TrieBuilder.finish() was already called");
    finished_ = true;
    min_count_ = std::max<uint64_t>(min_count, 1);
    for (int m = 1; m <= N; ++m) {
      sinks_[m].open(temp_path("level" + std::to_string(m)), m < N);
    }
    if (runs_.empty()) {
      std::sort(buffer_.begin(), buffer_.end());
      for_each_counted(buffer_, [&](const Key& k, uint64_t c) { consume(k, c); });
      std::vector<Key>().swap(buffer_);
    } else {
      if (!buffer_.empty()) spill();
      std::vector<Key>().swap(buffer_);
      merge_runs();
    }
    close_from(1);
    return write_file(path, metadata_json);
  }

 private:
  // Calls fn(key, count) for each distinct key of a sorted vector.
  template <typename Fn>
  static void for_each_counted(const std::vector<Key>& keys, Fn&& fn) {
    size_t i = 0;
    while (i < keys.size()) {
      size_t j = i + 1;
      while (j < keys.size() && keys[j] == keys[i]) ++j;
      fn(keys[i], static_cast<uint64_t>(j - i));
      i = j;
    }
  }

  std::string temp_path(const std::string& name) {
    std::string p = tmp_dir_ + "/dart-trie-" + std::to_string(reinterpret_cast<uintptr_t>(this)) + "-" + name;
    temp_files_.push_back(p);
    return p;
  }

  void spill() {
    std::sort(buffer_.begin(), buffer_.end());
    std::string path = temp_path("run" + std::to_string(runs_.size()));
    File f(path, "wb");
    for_each_counted(buffer_, [&](const Key& k, uint64_t c) {
      f.write(k.data(), sizeof(Key));
      f.write(&c, sizeof(c));
    });
    f.close();
    runs_.push_back(path);
    buffer_.clear();
  }

  struct RunReader {
    explicit RunReader(const std::string& path) : file(path, "rb") {}
    bool next() {
      if (pos == len) {
        len = file.read(buf.data(), buf.size()) / kRecordBytes * kRecordBytes;
        pos = 0;
        if (len == 0) return false;
      }
      std::memcpy(key.data(), buf.data() + pos, sizeof(Key));
      std::memcpy(&count, buf.data() + pos + sizeof(Key), sizeof(count));
      pos += kRecordBytes;
      return true;
    }
    File file;
    std::vector<char> buf = std::vector<char>(kRecordBytes * 8192);
    size_t pos = 0, len = 0;
    Key key{};
    uint64_t count = 0;
  };

  void merge_runs() {
    std::vector<std::unique_ptr<RunReader>> readers;
    using Item = std::pair<Key, size_t>;
    std::priority_queue<Item, std::vector<Item>, std::greater<Item>> heap;
    for (const auto& path : runs_) {
      readers.push_back(std::make_unique<RunReader>(path));
      if (readers.back()->next()) heap.emplace(readers.back()->key, readers.size() - 1);
    }
    bool have = false;
    Key cur{};
    uint64_t cur_count = 0;
    while (!heap.empty()) {
      const size_t r = heap.top().second;
      heap.pop();
      RunReader& rd = *readers[r];
      if (have && rd.key == cur) {
        cur_count += rd.count;
      } else {
        if (have) consume(cur, cur_count);
        cur = rd.key;
        cur_count = rd.count;
        have = true;
      }
      if (rd.next()) heap.emplace(rd.key, r);
    }
    if (have) consume(cur, cur_count);
  }

  // Streams one distinct window (sorted order) into the level state.
  void consume(const Key& key, uint64_t count) {
    int len = 0;
    while (len < N && key[len] != kPadToken) ++len;
    int d = 1;
    while (d <= len && open_[d] && tok_[d] == key[d - 1]) ++d;
    close_from(d);
    for (int m = d; m <= len; ++m) {
      open_[m] = true;
      tok_[m] = key[m - 1];
      count_[m] = 0;
      first_child_[m] = m < N ? sinks_[m + 1].emitted : 0;
    }
    for (int m = 1; m <= len; ++m) count_[m] += count;
  }

  // Closes the open nodes of levels N..from, deepest first.
  void close_from(int from) {
    for (int m = N; m >= from; --m) {
      if (!open_[m]) continue;
      open_[m] = false;
      if (count_[m] >= min_count_) sinks_[m].emit(tok_[m], count_[m], first_child_[m]);
    }
  }

  struct LevelSink {
    void open(const std::string& prefix, bool has_children_) {
      has_children = has_children_;
      tokens_path = prefix + ".tokens";
      counts_path = prefix + ".counts";
      children_path = prefix + ".children";
      tokens = std::make_unique<File>(tokens_path, "wb");
      counts = std::make_unique<File>(counts_path, "wb");
      if (has_children) children = std::make_unique<File>(children_path, "wb");
    }
    void emit(token_t tok, uint64_t count, uint64_t first_child) {
      tokens->write(&tok, sizeof(tok));
      counts->write(&count, sizeof(count));
      if (has_children) children->write(&first_child, sizeof(first_child));
      max_count = std::max(max_count, count);
      ++emitted;
    }
    bool has_children = false;
    std::string tokens_path, counts_path, children_path;
    std::unique_ptr<File> tokens, counts, children;
    uint64_t emitted = 0;
    uint64_t max_count = 0;
  };

  BuildStats write_file(const std::string& path, const std::string& metadata_json) {
    FileHeader h{};
    std::memcpy(h.magic, kMagic, sizeof(kMagic));
    h.version = kFormatVersion;
    h.order = N;
    h.vocab_size = vocab_size_;
    h.total_tokens = total_tokens_;
    h.metadata_bytes = static_cast<uint32_t>(metadata_json.size());
    h.header_bytes = static_cast<uint32_t>(align_up(sizeof(FileHeader) + metadata_json.size()));
    uint64_t offset = h.header_bytes;
    BuildStats stats;
    stats.total_tokens = total_tokens_;
    stats.num_runs = runs_.size();
    for (int m = 1; m <= N; ++m) {
      LevelSink& s = sinks_[m];
      if (s.has_children) {
        const uint64_t sentinel = sinks_[m + 1].emitted;
        s.children->write(&sentinel, sizeof(sentinel));
        s.children->close();
      }
      s.tokens->close();
      s.counts->close();
      LevelEntry& e = h.levels[m - 1];
      e.num_nodes = s.emitted;
      e.count_width = s.max_count >> 32 ? 8 : 4;
      e.child_width = s.has_children ? (sinks_[m + 1].emitted >> 32 ? 8 : 4) : 0;
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
    for (int m = 1; m <= N; ++m) {
      LevelSink& s = sinks_[m];
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

  uint32_t vocab_size_;
  std::string tmp_dir_;
  uint64_t capacity_;
  std::vector<Key> buffer_;
  std::vector<std::string> runs_;
  std::vector<std::string> temp_files_;
  uint64_t total_tokens_ = 0;
  uint64_t min_count_ = 1;
  bool finished_ = false;
  // Streaming state per level (1-based).
  bool open_[N + 1] = {};
  token_t tok_[N + 1] = {};
  uint64_t count_[N + 1] = {};
  uint64_t first_child_[N + 1] = {};
  LevelSink sinks_[N + 1];
};

}  // namespace

TrieBuilder::TrieBuilder(int order, uint32_t vocab_size, std::string tmp_dir, uint64_t memory_bytes) {
  if (vocab_size == 0 || vocab_size >= kPadToken) throw std::invalid_argument("vocab_size must be in 1..2^32-2");
  switch (order) {
    case 2: impl_ = std::make_unique<OrderedBuilder<2>>(vocab_size, std::move(tmp_dir), memory_bytes); break;
    case 3: impl_ = std::make_unique<OrderedBuilder<3>>(vocab_size, std::move(tmp_dir), memory_bytes); break;
    case 4: impl_ = std::make_unique<OrderedBuilder<4>>(vocab_size, std::move(tmp_dir), memory_bytes); break;
    case 5: impl_ = std::make_unique<OrderedBuilder<5>>(vocab_size, std::move(tmp_dir), memory_bytes); break;
    case 6: impl_ = std::make_unique<OrderedBuilder<6>>(vocab_size, std::move(tmp_dir), memory_bytes); break;
    default: throw std::invalid_argument("n-gram order must be in 2..6, got " + std::to_string(order));
  }
}

TrieBuilder::~TrieBuilder() = default;

void TrieBuilder::add_documents(const token_t* tokens, size_t num_tokens, const int64_t* offsets,
                                size_t num_docs) {
  impl_->add_documents(tokens, num_tokens, offsets, num_docs);
}

BuildStats TrieBuilder::finish(const std::string& path, const std::string& metadata_json, uint64_t min_count) {
  return impl_->finish(path, metadata_json, min_count);
}

}  // namespace dart_ngram
