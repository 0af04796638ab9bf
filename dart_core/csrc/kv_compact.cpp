// KV-cache compaction of every layer in one call (dart_core.kv_cache.compact_layers).
//
// After a verification forward, each sequence keeps the cache entries of its accepted path: entry
// src[i] of row rows[i] moves to position dst[i], in every head of every layer's keys and values.
// PyTorch does this with two advanced-indexing writes per layer, tens of microseconds each on a CPU;
// here it is one memmove of a head's D values per (cache, move, head), the caches shared among
// OpenMP threads (each cache's moves stay in order within one thread).
//
// The moves are applied in the order given.  A KV compaction plan lists each row's moves by
// increasing destination, and every destination is at or before its source, before every later
// source of its row (dst = length + j <= offset + path[j] < offset + path[k] for j < k, the path
// increasing): so no move overwrites an entry that a later move still reads, and in-order copies
// equal a gather followed by a scatter.  The caller (dart_core.kv_cache) checks dst <= src.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using Index = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

struct CacheView {
  char* base;
  py::ssize_t s0, s1, s2;   // byte strides of batch, head, position
  py::ssize_t rows, heads, length;
  size_t entry_bytes;       // one head's D values
};

void compact_cache(const py::list& caches, const Index& rows, const Index& dst, const Index& src) {
  const py::ssize_t m = rows.size();
  if (dst.size() != m || src.size() != m)
    throw std::invalid_argument("compact_cache: rows, dst and src must have the same length");
  std::vector<CacheView> views;
  views.reserve(caches.size());
  std::vector<py::array> keep;  // the arrays stay referenced while the GIL is released
  for (const py::handle& h : caches) {
    if (!py::isinstance<py::array>(h)) throw std::invalid_argument("compact_cache: every cache must be an array");
    auto a = py::reinterpret_borrow<py::array>(h);
    if (a.ndim() != 4) throw std::invalid_argument("compact_cache: a cache must be [B, H_kv, T, D]");
    if (!a.writeable()) throw std::invalid_argument("compact_cache: a cache array is read-only");
    if (a.strides(3) != a.itemsize()) throw std::invalid_argument("compact_cache: D must be contiguous");
    views.push_back({static_cast<char*>(a.mutable_data()), a.strides(0), a.strides(1), a.strides(2), a.shape(0),
                     a.shape(1), a.shape(2), static_cast<size_t>(a.shape(3) * a.itemsize())});
    keep.push_back(a);
  }
  const int64_t* r = rows.data();
  const int64_t* d = dst.data();
  const int64_t* s = src.data();
  for (const CacheView& v : views)
    for (py::ssize_t i = 0; i < m; ++i)
      if (r[i] < 0 || r[i] >= v.rows || d[i] < 0 || d[i] >= v.length || s[i] < 0 || s[i] >= v.length)
        throw std::out_of_range("compact_cache: move " + std::to_string(i) + " is outside a cache of " +
                                std::to_string(v.rows) + " rows and " + std::to_string(v.length) + " positions");
  py::gil_scoped_release release;
  const py::ssize_t n_views = static_cast<py::ssize_t>(views.size());
#pragma omp parallel for schedule(static) if (n_views > 1 && m * n_views >= 64)
  for (py::ssize_t c = 0; c < n_views; ++c) {  // the caches are apart: one thread each
    const CacheView& v = views[c];
    for (py::ssize_t i = 0; i < m; ++i) {
      char* row = v.base + r[i] * v.s0;
      for (py::ssize_t h = 0; h < v.heads; ++h)
        std::memmove(row + h * v.s1 + d[i] * v.s2, row + h * v.s1 + s[i] * v.s2, v.entry_bytes);
    }
  }
}

// The moves of a step's accepted paths, made and applied in one call: row r keeps entry offset + p_j
// for the j-th of its counts[r] path entries p_j, moved to lengths[r] + j.  Each row's path must
// increase (an accepted path in a depth-ordered tree does) and no destination may be after its
// source (lengths[r] <= offset does it): then in-order copies are exact (the opening comment).
void compact_paths(const py::list& caches, const Index& lengths, int64_t offset, const Index& paths,
                   const Index& counts) {
  const py::ssize_t b = lengths.size();
  if (counts.size() != b) throw std::invalid_argument("compact_paths: lengths and counts must have one entry per row");
  std::vector<int64_t> rows, dst, src;
  const int64_t* len = lengths.data();
  const int64_t* path = paths.data();
  const int64_t* cnt = counts.data();
  py::ssize_t at = 0;
  for (py::ssize_t r = 0; r < b; ++r) {
    if (cnt[r] < 0 || at + cnt[r] > paths.size())
      throw std::invalid_argument("compact_paths: counts do not match the paths' entries");
    for (int64_t j = 0; j < cnt[r]; ++j, ++at) {
      const int64_t s = offset + path[at], d = len[r] + j;
      if (j > 0 && path[at] <= path[at - 1])
        throw std::invalid_argument("compact_paths: row " + std::to_string(r) + "'s path does not increase");
      if (d > s)
        throw std::invalid_argument("compact_paths: row " + std::to_string(r) + " would move an entry forwards");
      if (s != d) rows.push_back(r), dst.push_back(d), src.push_back(s);
    }
  }
  if (at != paths.size()) throw std::invalid_argument("compact_paths: counts do not match the paths' entries");
  if (rows.empty()) return;
  const auto m = static_cast<py::ssize_t>(rows.size());
  compact_cache(caches, Index(m, rows.data()), Index(m, dst.data()), Index(m, src.data()));
}

}  // namespace

void register_kv_compact(py::module_& mod) {
  mod.def("compact_cache", &compact_cache, py::arg("caches"), py::arg("rows"), py::arg("dst"), py::arg("src"),
          "moves entry src[i] of row rows[i] to position dst[i] in every head of every [B, H_kv, T, D] "
          "array, in order (see dart_core.kv_cache.compact_layers)");
  mod.def("compact_paths", &compact_paths, py::arg("caches"), py::arg("lengths"), py::arg("offset"), py::arg("paths"),
          py::arg("counts"),
          "keeps, for row r, entries offset + p of its accepted path (paths: every row's increasing path, "
          "concatenated; counts: entries per row) at lengths[r] + j, in every [B, H_kv, T, D] array "
          "(see dart_core.kv_cache.compact_buffered)");
}
