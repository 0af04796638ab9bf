// dart_core._kernels: row-exact attention for CPU targets (pybind11, numpy views of torch tensors).
//
// softmax(scale · q·kᵀ + mask)·v where every query row is computed on its own by the same
// code: the keys a row attends to are visited in cache order, masked keys are skipped, the
// softmax's sum and the value accumulation run key after key in that order, and each q·k
// product sums the head dimension in fixed lanes.  So a row's result depends only on its query
// and on the sequence of keys/values it attends to, never on how many other rows share the call,
// how long the padded cache is or where the attended keys sit in it.  A tree verification then
// computes each node exactly as a one-token step over the same prefix would (a tree's node
// attends to the prefix and its ancestors, in that order, as the one-token step does).
//
// Exact IEEE arithmetic (-ffp-contract=off, no fast-math): the same bits on every x86-64 build.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using F32 = py::array_t<float, 0>;  // no forcecast: a float32 view of the caller's tensor, never a copy

constexpr int kLanes = 16;  // the q·k sum's lanes (vectorised by the compiler; the order is fixed)

inline __attribute__((always_inline)) float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[d + j] * b[d + j];
  for (int j = 0; d + j < n; ++j) acc[j] += a[d + j] * b[d + j];
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

// One query row (see the file comment); compiled for AVX-512, AVX2 and baseline x86-64, the best
// that the CPU runs chosen at load time (every version does the same operations in the same order).
__attribute__((target_clones("avx512f", "avx2", "default")))
void attend_row(const float* qrow, const float* mrow, int64_t mstride, const float* kbase, int64_t kstride,
                const float* vbase, int64_t vstride, int64_t T, int64_t D, float scale, float* scores,
                int64_t* kept, float* acc, float* orow) {
  const float lowest = std::numeric_limits<float>::lowest();
  int64_t n = 0;
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < T; ++t) {
    const float add = mrow ? mrow[t * mstride] : 0.0f;
    if (add <= lowest) continue;  // masked out: not visited at all
    const float s = dot(qrow, kbase + t * kstride, D) * scale + add;
    scores[n] = s;
    kept[n++] = t;
    if (s > best) best = s;
  }
  for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float p = std::exp(scores[j] - best);
    sum += p;
    const float* vrow = vbase + kept[j] * vstride;
    for (int64_t d = 0; d < D; ++d) acc[d] += p * vrow[d];
  }
  const float inv = n ? 1.0f / sum : 0.0f;  // a row that attends to nothing gets zeros
  for (int64_t d = 0; d < D; ++d) orow[d] = acc[d] * inv;
}

struct Strided4 {  // a 4D float32 array's data and element strides
  const float* data;
  int64_t shape[4];
  int64_t stride[4];
};

Strided4 view4(const F32& a, const char* name) {
  if (a.ndim() != 4) throw std::invalid_argument(std::string(name) + " must be 4-dimensional");
  Strided4 v{a.data(), {}, {}};
  for (int i = 0; i < 4; ++i) {
    v.shape[i] = a.shape(i);
    if (a.strides(i) % static_cast<py::ssize_t>(sizeof(float)) != 0)
      throw std::invalid_argument(std::string(name) + " has unaligned strides");
    v.stride[i] = a.strides(i) / static_cast<py::ssize_t>(sizeof(float));
  }
  if (v.shape[3] > 1 && v.stride[3] != 1)
    throw std::invalid_argument(std::string(name) + ": the last dimension must be contiguous");
  return v;
}

// query [B, H, Q, D], key/value [B, Hkv, T, D], mask [B, 1, Q, >=T] additive (entries at or below
// float32's lowest, -inf included, are masked out) or None; out [B, Q, H, D] contiguous, written.
void attention(const F32& query, const F32& key, const F32& value, const py::object& mask_obj, float scale,
               py::array_t<float, 0> out_arr, int64_t parallel_work) {
  const Strided4 q = view4(query, "query"), k = view4(key, "key"), v = view4(value, "value");
  const int64_t B = q.shape[0], H = q.shape[1], Q = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], T = k.shape[2];
  if (k.shape[0] != B || v.shape[0] != B || v.shape[1] != Hkv || v.shape[2] != T || k.shape[3] != D ||
      v.shape[3] != D || Hkv == 0 || H % Hkv != 0)
    throw std::invalid_argument("query [B, H, Q, D] and key/value [B, Hkv, T, D] do not match (H a multiple of Hkv)");
  const bool has_mask = !mask_obj.is_none();
  F32 mask_arr;
  Strided4 m{nullptr, {}, {}};
  if (has_mask) {
    mask_arr = mask_obj.cast<F32>();
    m = view4(mask_arr, "mask");
    if (m.shape[0] != B || m.shape[1] != 1 || m.shape[2] != Q || m.shape[3] < T)
      throw std::invalid_argument("mask must be [B, 1, Q, >=T]");
  }
  if (out_arr.ndim() != 4 || out_arr.shape(0) != B || out_arr.shape(1) != Q || out_arr.shape(2) != H ||
      out_arr.shape(3) != D || !(out_arr.flags() & py::array::c_style) || !out_arr.writeable())
    throw std::invalid_argument("out must be a writeable contiguous float32 [B, Q, H, D]");
  float* out = out_arr.mutable_data();
  const int64_t groups = H / Hkv;
  const int64_t rows = B * H * Q;
  const bool parallel = rows > 1 && rows * T * D >= parallel_work;

  py::gil_scoped_release release;
#pragma omp parallel if (parallel)
  {
    std::vector<float> scores(static_cast<size_t>(T));
    std::vector<int64_t> kept(static_cast<size_t>(T));
    std::vector<float> acc(static_cast<size_t>(D));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = r / (H * Q), h = (r / Q) % H, i = r % Q, g = h / groups;
      attend_row(q.data + b * q.stride[0] + h * q.stride[1] + i * q.stride[2],
                 has_mask ? m.data + b * m.stride[0] + i * m.stride[2] : nullptr, m.stride[3],
                 k.data + b * k.stride[0] + g * k.stride[1], k.stride[2],
                 v.data + b * v.stride[0] + g * v.stride[1], v.stride[2], T, D, scale, scores.data(),
                 kept.data(), acc.data(), out + ((b * Q + i) * H + h) * D);
    }
  }
}

}  // namespace

PYBIND11_MODULE(_kernels, mod) {
  mod.doc() = "dart_core's CPU kernels (see dart_core/kernels.py)";
  mod.def("row_exact_attention", &attention, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("mask"),
          py::arg("scale"), py::arg("out"), py::arg("parallel_work"),
          "softmax(scale * q.k^T + mask).v, each query row on its own (see dart_core.kernels)");
  mod.def("omp_max_threads", []() { return omp_get_max_threads(); });
}
