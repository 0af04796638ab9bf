#include "builder.hpp"

#include "level_writer.hpp"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <queue>
#include <stdexcept>

namespace dart_ngram {

class TrieBuilderImpl {
 public:
  virtual ~TrieBuilderImpl() = default;
  virtual void add_documents(const token_t* tokens, size_t num_tokens, const int64_t* offsets,
                             size_t num_docs) = 0;
  virtual BuildStats finish(const std::string& path, const std::string& metadata_json,
                            uint64_t min_count) = 0;
  virtual void add_counted(const token_t* keys, const uint64_t* counts, size_t num_windows) = 0;
  virtual BuildStats finish_levels(const std::string& prefix, uint64_t min_count) = 0;
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
    counted_capacity_ = std::max<uint64_t>(1024, memory_bytes / sizeof(Counted));
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

  void add_counted(const token_t* keys, const uint64_t* counts, size_t num_windows) override {
    if (finished_) throw std::logic_error("TrieBuilder.finish() was already called");
    if (counted_.capacity() < counted_capacity_) counted_.reserve(counted_capacity_);
    for (size_t i = 0; i < num_windows; ++i) {
      Key key;
      std::memcpy(key.data(), keys + i * N, sizeof(Key));
      bool padded = false;
      for (int j = 0; j < N; ++j) {
        const bool pad = key[j] == kPadToken;
        if ((pad && j == 0) || (!pad && padded) || (!pad && key[j] >= vocab_size_)) {
          throw std::invalid_argument("counted window " + std::to_string(i) +
                                      " is not a window of this vocabulary (token " + std::to_string(key[j]) +
                                      " at position " + std::to_string(j) + ")");
        }
        padded = padded || pad;
      }
      if (counts[i] == 0) throw std::invalid_argument("counted window " + std::to_string(i) + " has count 0");
      counted_.emplace_back(key, counts[i]);
      total_tokens_ += counts[i];
      if (counted_.size() >= counted_capacity_) spill_counted();
    }
  }

  BuildStats finish(const std::string& path, const std::string& metadata_json,
                    uint64_t min_count) override {
    start_finish(min_count);
    for (int m = 1; m <= N; ++m) {
      sinks_[m].open(temp_path("level" + std::to_string(m)), m < N);
    }
    drain();
    return write_file(path, metadata_json);
  }

  BuildStats finish_levels(const std::string& prefix, uint64_t min_count) override {
    start_finish(min_count);
    for (int m = 1; m <= N; ++m) sinks_[m].open(prefix + "level" + std::to_string(m), m < N);
    drain();
    BuildStats stats;
    stats.total_tokens = total_tokens_;
    stats.num_runs = runs_.size();
    stats.spilled_bytes = spilled_bytes_;
    for (int m = 1; m <= N; ++m) {
      LevelSink& s = sinks_[m];
      s.tokens->close();
      s.counts->close();
      if (s.has_children) s.children->close();
      stats.nodes_per_level.push_back(s.emitted);
      stats.max_count_per_level.push_back(s.max_count);
      stats.num_nodes += s.emitted;
    }
    return stats;
  }

 private:
  using Counted = std::pair<Key, uint64_t>;

  void start_finish(uint64_t min_count) {
    if (finished_) throw std::logic_error("TrieBuilder.finish() was already called");
    finished_ = true;
    min_count_ = std::max<uint64_t>(min_count, 1);
  }

  // Streams every window counted so far, in key order, into the level sinks.
  void drain() {
    if (runs_.empty() && counted_.empty()) {
      std::sort(buffer_.begin(), buffer_.end());
      for_each_counted(buffer_, [&](const Key& k, uint64_t c) { consume(k, c); });
    } else if (runs_.empty() && buffer_.empty()) {
      sort_counted();
      for (const auto& [k, c] : counted_) consume(k, c);
    } else {
      if (!buffer_.empty()) spill();
      if (!counted_.empty()) spill_counted();
      std::vector<Key>().swap(buffer_);
      std::vector<Counted>().swap(counted_);
      merge_runs();
    }
    std::vector<Key>().swap(buffer_);
    std::vector<Counted>().swap(counted_);
    close_from(1);
  }

  // Sorts the counted buffer by key and adds up the counts of equal keys.
  void sort_counted() {
    std::sort(counted_.begin(), counted_.end(), [](const Counted& a, const Counted& b) { return a.first < b.first; });
    size_t out = 0;
    for (size_t i = 0; i < counted_.size(); ++i) {
      if (out > 0 && counted_[out - 1].first == counted_[i].first) {
        counted_[out - 1].second += counted_[i].second;
      } else {
        counted_[out++] = counted_[i];
      }
    }
    counted_.resize(out);
  }

  void spill_counted() {
    sort_counted();
    std::string path = temp_path("run" + std::to_string(runs_.size()));
    File f(path, "wb");
    for (const auto& [k, c] : counted_) {
      f.write(k.data(), sizeof(Key));
      f.write(&c, sizeof(c));
    }
    f.close();
    spilled_bytes_ += counted_.size() * kRecordBytes;
    runs_.push_back(path);
    counted_.clear();
  }

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
      spilled_bytes_ += kRecordBytes;
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

  BuildStats write_file(const std::string& path, const std::string& metadata_json) {
    BuildStats stats = write_levels(path, metadata_json, N, vocab_size_, total_tokens_, sinks_ + 1);
    stats.num_runs = runs_.size();
    stats.spilled_bytes = spilled_bytes_;
    return stats;
  }

  uint32_t vocab_size_;
  std::string tmp_dir_;
  uint64_t capacity_;
  uint64_t counted_capacity_;
  std::vector<Key> buffer_;
  std::vector<Counted> counted_;  // add_counted()
  uint64_t spilled_bytes_ = 0;
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

template <int N>
WindowRuns count_windows_n(uint32_t vocab_size, const token_t* tokens, size_t num_tokens, const int64_t* offsets,
                           size_t num_docs, const token_t* boundaries, size_t num_boundaries) {
  using Key = std::array<token_t, N>;
  if (num_tokens >= (uint64_t{1} << 32)) throw std::invalid_argument("a mapper's shard must hold under 2^32 tokens");
  for (size_t b = 1; b < num_boundaries; ++b) {
    if (boundaries[b] < boundaries[b - 1]) throw std::invalid_argument("partition boundaries must be ascending");
  }
  std::vector<Key> windows;
  windows.reserve(num_tokens);
  for (size_t d = 0; d < num_docs; ++d) {
    const int64_t b = offsets[d], e = offsets[d + 1];
    if (b < 0 || e < b || static_cast<uint64_t>(e) > num_tokens) {
      throw std::invalid_argument("document offsets must be non-decreasing and within the token array");
    }
    for (int64_t i = b; i < e; ++i) {
      if (tokens[i] >= vocab_size) {
        throw std::invalid_argument("token id " + std::to_string(tokens[i]) + " is outside the vocabulary of " +
                                    std::to_string(vocab_size));
      }
      Key key;
      for (int j = 0; j < N; ++j) key[j] = i + j < e ? tokens[i + j] : kPadToken;
      windows.push_back(key);
    }
  }
  std::sort(windows.begin(), windows.end());
  WindowRuns out;
  size_t i = 0;
  size_t next_boundary = 0;
  out.starts.push_back(0);
  while (i < windows.size()) {
    size_t j = i + 1;
    while (j < windows.size() && windows[j] == windows[i]) ++j;
    while (next_boundary < num_boundaries && windows[i][0] >= boundaries[next_boundary]) {
      out.starts.push_back(out.counts.size());
      ++next_boundary;
    }
    out.keys.insert(out.keys.end(), windows[i].begin(), windows[i].end());
    out.counts.push_back(static_cast<uint32_t>(j - i));
    i = j;
  }
  while (out.starts.size() < num_boundaries + 2) out.starts.push_back(out.counts.size());
  return out;
}

}  // namespace

WindowRuns count_windows(int order, uint32_t vocab_size, const token_t* tokens, size_t num_tokens,
                         const int64_t* offsets, size_t num_docs, const token_t* boundaries, size_t num_boundaries) {
  switch (order) {
    case 2: return count_windows_n<2>(vocab_size, tokens, num_tokens, offsets, num_docs, boundaries, num_boundaries);
    case 3: return count_windows_n<3>(vocab_size, tokens, num_tokens, offsets, num_docs, boundaries, num_boundaries);
    case 4: return count_windows_n<4>(vocab_size, tokens, num_tokens, offsets, num_docs, boundaries, num_boundaries);
    case 5: return count_windows_n<5>(vocab_size, tokens, num_tokens, offsets, num_docs, boundaries, num_boundaries);
    case 6: return count_windows_n<6>(vocab_size, tokens, num_tokens, offsets, num_docs, boundaries, num_boundaries);
    default: throw std::invalid_argument("n-gram order must be in 2..6, got " + std::to_string(order));
  }
}

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

void TrieBuilder::add_counted(const token_t* keys, const uint64_t* counts, size_t num_windows) {
  impl_->add_counted(keys, counts, num_windows);
}

BuildStats TrieBuilder::finish_levels(const std::string& prefix, uint64_t min_count) {
  return impl_->finish_levels(prefix, min_count);
}

}  // namespace dart_ngram
