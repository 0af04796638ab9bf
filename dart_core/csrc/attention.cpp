// dart_core._kernels: row-exact attention, and the rotary embedding fused with the KV-cache append, for
// CPU targets (pybind11, numpy views of torch tensors).
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
// Exact IEEE arithmetic (-ffp-contract=off, no fast-math) and an exp written out here: every build
// (AVX-512, AVX2, baseline) does the same operations in the same order.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "exp_nonpositive.h"
#include "qmm.h"

namespace py = pybind11;

namespace {

using dart_kernels::exp_nonpositive;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DART_ISA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DART_ISA_CLONES  // one version, for the compiler's target
#endif

using F32 = py::array_t<float, 0>;  // no forcecast: a float32 view of the caller's tensor, never a copy

constexpr int kLanes = 16;     // the q·k sum's lanes (vectorised by the compiler; the order is fixed)
constexpr int kMaxGroup = 16;  // query heads per key/value head handled together (more: in several passes)

template <int kD>  // kD > 0: the head size known at compile time; 0: read from n
inline __attribute__((always_inline)) float dot(const float* a, const float* b, int64_t n) {
  const int64_t size = kD > 0 ? kD : n;
  float acc[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= size; d += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[d + j] * b[d + j];
  for (int j = 0; d + j < size; ++j) acc[j] += a[d + j] * b[d + j];
  float s8[8], s4[4];  // the lanes summed pairwise, written out so that the compiler keeps them in registers
  for (int j = 0; j < 8; ++j) s8[j] = acc[j] + acc[j + 8];
  for (int j = 0; j < 4; ++j) s4[j] = s8[j] + s8[j + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// The query rows of one (sequence, key/value head, query position): the G heads that share the
// key/value head (G <= kMaxGroup).  Each row is computed exactly as it would be alone: the mask
// is the same for all of them, so they visit the same keys; sharing the visit only saves loads.
// With GCC on x86-64, compiled for AVX-512, AVX2 and baseline x86-64, and the CPU's best runs
// (every version does the same operations in the same order: a row's bits do not depend on it).
// kG > 0: the group size known at compile time (its loops unrolled, the value sums held in
// registers, the same operations in the same order: the same bits as kG = 0); 0: read from g_rows.
template <int kD, int kG>
DART_ISA_CLONES
void attend_group(const float* const* qrows, int g_rows, const float* mrow, int64_t mstride, const float* kbase,
                  int64_t kstride, const float* vbase, int64_t vstride, int64_t T, int64_t n_dim, float scale,
                  float* scores, int64_t* kept, float* acc_buffer, float* const* orows) {
  const int64_t D = kD > 0 ? kD : n_dim;
  const int G = kG > 0 ? kG : g_rows;
  float acc_local[kG > 0 && kD > 0 ? kG * kD : 1];
  float* const acc = kG > 0 && kD > 0 ? acc_local : acc_buffer;
  const float lowest = std::numeric_limits<float>::lowest();
  float best[kMaxGroup];
  for (int g = 0; g < G; ++g) best[g] = -std::numeric_limits<float>::infinity();
  int64_t n = 0;
  for (int64_t t = 0; t < T; ++t) {  // scores [G][T]: row g's scores at g * T
    const float add = mrow ? mrow[t * mstride] : 0.0f;
    if (add <= lowest) continue;  // masked out: not visited at all
    const float* krow = kbase + t * kstride;
    for (int g = 0; g < G; ++g) {
      const float s = dot<kD>(qrows[g], krow, D) * scale + add;
      scores[g * T + n] = s;
      if (s > best[g]) best[g] = s;
    }
    kept[n++] = t;
  }
  for (int g = 0; g < G; ++g) {
    float* row = scores + g * T;
    for (int64_t j = 0; j < n; ++j) row[j] = exp_nonpositive(row[j] - best[g]);
  }
  for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.0f;
  float sum[kMaxGroup] = {};
  for (int64_t j = 0; j < n; ++j) {
    const float* vrow = vbase + kept[j] * vstride;
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * T + j];
      sum[g] += p;
      float* a = acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] += p * vrow[d];
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = n ? 1.0f / sum[g] : 0.0f;  // a row that attends to nothing gets zeros
    for (int64_t d = 0; d < D; ++d) orows[g][d] = acc[g * D + d] * inv;
  }
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

// The attention proper (no Python objects: runs with the GIL released).  q [B, H, Q, D], k/v
// [B, Hkv, T, D] (strided), m [B, 1, Q, >=T] or null, out [B, Q, H, D] contiguous.
void attend_views(const Strided4& q, const Strided4& k, const Strided4& v, const Strided4* m, float scale, float* out,
                  int64_t parallel_work) {
  const int64_t B = q.shape[0], H = q.shape[1], Q = q.shape[2], D = q.shape[3];
  const int64_t Hkv = k.shape[1], T = k.shape[2];
  const int64_t groups = H / Hkv;
  const int64_t passes = (groups + kMaxGroup - 1) / kMaxGroup;  // head groups of at most kMaxGroup
  const int64_t units = B * Hkv * passes * Q;
  const bool parallel = units > 1 && B * H * Q * T * D >= parallel_work;

#pragma omp parallel if (parallel)
  {
    const int64_t per_pass = std::min<int64_t>(groups, kMaxGroup);
    std::vector<float> scores(static_cast<size_t>(per_pass * T));
    std::vector<int64_t> kept(static_cast<size_t>(T));
    std::vector<float> acc(static_cast<size_t>(per_pass * D));
#pragma omp for schedule(guided)  // as qmm's blocks: a preempted thread's tail is taken over
    for (int64_t u = 0; u < units; ++u) {
      const int64_t i = u % Q, pass = (u / Q) % passes, hk = (u / (Q * passes)) % Hkv, b = u / (Q * passes * Hkv);
      const int64_t h0 = hk * groups + pass * kMaxGroup;
      const int G = static_cast<int>(std::min<int64_t>(kMaxGroup, hk * groups + groups - h0));
      const float* qrows[kMaxGroup];
      float* orows[kMaxGroup];
      for (int g = 0; g < G; ++g) {
        qrows[g] = q.data + b * q.stride[0] + (h0 + g) * q.stride[1] + i * q.stride[2];
        orows[g] = out + ((b * Q + i) * H + h0 + g) * D;
      }
      const float* mrow = m ? m->data + b * m->stride[0] + i * m->stride[2] : nullptr;
      const float* kb = k.data + b * k.stride[0] + hk * k.stride[1];
      const float* vb = v.data + b * v.stride[0] + hk * v.stride[1];
      const int64_t ms = m ? m->stride[3] : 0;
      // head size 64 with 1 to 4 query heads per key/value head (SmolLM2: 3) unrolled; others generic
      const auto run = [&](auto group) {
        constexpr int kG = decltype(group)::value;
        attend_group<64, kG>(qrows, G, mrow, ms, kb, k.stride[2], vb, v.stride[2], T, D,
                             scale, scores.data(), kept.data(), acc.data(), orows);
      };
      if (D != 64) attend_group<0, 0>(qrows, G, mrow, ms, kb, k.stride[2], vb, v.stride[2], T, D, scale,
                                      scores.data(), kept.data(), acc.data(), orows);
      else if (G == 1) run(std::integral_constant<int, 1>());
      else if (G == 2) run(std::integral_constant<int, 2>());
      else if (G == 3) run(std::integral_constant<int, 3>());
      else if (G == 4) run(std::integral_constant<int, 4>());
      else run(std::integral_constant<int, 0>());
    }
  }
}

// The mask argument: None (a null view) or a float32 [B, 1, Q, >= T] array, which ``holder`` keeps alive.
Strided4 mask_view(const py::object& mask_obj, int64_t B, int64_t Q, int64_t T, F32& holder) {
  if (mask_obj.is_none()) return Strided4{nullptr, {}, {}};
  holder = mask_obj.cast<F32>();
  const Strided4 m = view4(holder, "mask");
  if (m.shape[0] != B || m.shape[1] != 1 || m.shape[2] != Q || m.shape[3] < T)
    throw std::invalid_argument("mask must be [B, 1, Q, >=T]");
  return m;
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
  F32 mask_arr;
  const Strided4 m = mask_view(mask_obj, B, Q, T, mask_arr);
  if (out_arr.ndim() != 4 || out_arr.shape(0) != B || out_arr.shape(1) != Q || out_arr.shape(2) != H ||
      out_arr.shape(3) != D || !(out_arr.flags() & py::array::c_style) || !out_arr.writeable())
    throw std::invalid_argument("out must be a writeable contiguous float32 [B, Q, H, D]");
  float* out = out_arr.mutable_data();
  py::gil_scoped_release release;
  attend_views(q, k, v, m.data ? &m : nullptr, scale, out, parallel_work);
}

// Rotary embedding of q and k and the KV-cache append, for one layer of a forward: qkv [M, N] (M = B·Q
// rows, N = (H + 2·Hkv)·D: q heads, k heads, v heads side by side), cos/sin [M, D]; writes the rotated
// q to query [B, Q, H, D] (contiguous) and the rotated k and the v to positions t .. t+Q-1 of the
// key/value buffers [B, Hkv, capacity, D].  Rotation as transformers' apply_rotary_pos_emb:
// x·cos + rotate_half(x)·sin, each product and the sum rounded to float32 (no contraction), so the
// values equal PyTorch's operator-by-operator result bit for bit.
struct RopeArgs {
  const float *qkv, *cos, *sin;
  int64_t qkv_stride, cos_stride, sin_stride;
  int64_t B, Q, H, Hkv, D, t;
  float *key, *value;
  int64_t ks[3], vs[3];
};

RopeArgs rope_args(const F32& qkv, const F32& cos, const F32& sin, int64_t B, int64_t Q, int64_t H, int64_t Hkv,
                   py::array_t<float, 0>& key, py::array_t<float, 0>& value, int64_t t) {
  if (qkv.ndim() != 2 || cos.ndim() != 2 || sin.ndim() != 2 || key.ndim() != 4 || value.ndim() != 4)
    throw std::invalid_argument("rope: qkv, cos and sin are 2-dimensional, the cache buffers 4-dimensional");
  const auto fs = static_cast<py::ssize_t>(sizeof(float));
  const int64_t M = B * Q, D = key.shape(3);
  if (qkv.shape(0) != M || qkv.shape(1) != (H + 2 * Hkv) * D || qkv.strides(1) != fs || cos.shape(0) != M ||
      cos.shape(1) != D || cos.strides(1) != fs || sin.shape(0) != M || sin.shape(1) != D || sin.strides(1) != fs ||
      D % 2 != 0 || Hkv == 0 || H % Hkv != 0)
    throw std::invalid_argument("rope: qkv [B*Q, (H+2*Hkv)*D] and cos/sin [B*Q, D] do not match "
                                "(D even, H a multiple of Hkv, last dimensions contiguous)");
  for (const auto* buf : {&key, &value})
    if (buf->shape(0) != B || buf->shape(1) != Hkv || buf->shape(2) < t + Q || buf->shape(3) != D ||
        buf->strides(3) != fs || !buf->writeable())
      throw std::invalid_argument("rope: the cache buffers must be writeable [B, Hkv, >= t+Q, D]");
  RopeArgs a{qkv.data(), cos.data(), sin.data(), qkv.strides(0) / fs, cos.strides(0) / fs, sin.strides(0) / fs,
             B, Q, H, Hkv, D, t, key.mutable_data(), value.mutable_data(), {}, {}};
  for (int i = 0; i < 3; ++i) {
    a.ks[i] = key.strides(i) / fs;
    a.vs[i] = value.strides(i) / fs;
  }
  return a;
}

void rope_core(const RopeArgs& a, float* query) {
  const int64_t D = a.D, H = a.H, Hkv = a.Hkv, half = D / 2;
  for (int64_t m = 0; m < a.B * a.Q; ++m) {
    const int64_t b = m / a.Q, i = m % a.Q;
    const float* row = a.qkv + m * a.qkv_stride;
    const float* c = a.cos + m * a.cos_stride;
    const float* s = a.sin + m * a.sin_stride;
    for (int64_t h = 0; h < H + Hkv; ++h) {
      const float* x = row + h * D;
      float* out = h < H ? query + (m * H + h) * D : a.key + b * a.ks[0] + (h - H) * a.ks[1] + (a.t + i) * a.ks[2];
      for (int64_t d = 0; d < half; ++d) {
        const float p = x[d] * c[d], r = -x[d + half] * s[d];
        out[d] = p + r;
      }
      for (int64_t d = half; d < D; ++d) {
        const float p = x[d] * c[d], r = x[d - half] * s[d];
        out[d] = p + r;
      }
    }
    for (int64_t g = 0; g < Hkv; ++g)
      std::memcpy(a.value + b * a.vs[0] + g * a.vs[1] + (a.t + i) * a.vs[2], row + (H + Hkv + g) * D,
                  static_cast<size_t>(D) * sizeof(float));
  }
}

void rope_append(const F32& qkv, const F32& cos, const F32& sin, int64_t H, int64_t Hkv, py::array_t<float, 0> query,
                 py::array_t<float, 0> key, py::array_t<float, 0> value, int64_t t) {
  if (query.ndim() != 4 || query.shape(2) != H || !(query.flags() & py::array::c_style) || !query.writeable())
    throw std::invalid_argument("rope: query must be a writeable contiguous [B, Q, H, D]");
  const RopeArgs a = rope_args(qkv, cos, sin, query.shape(0), query.shape(1), H, Hkv, key, value, t);
  if (query.shape(3) != a.D) throw std::invalid_argument("rope: query [B, Q, H, D] and the cache's D do not match");
  float* q = query.mutable_data();
  py::gil_scoped_release release;
  rope_core(a, q);
}

// rope_append, then the row-exact attention of the rotated queries over the cache's first t + Q
// positions (mask [B, 1, Q, >= t+Q] or None): one call for a layer's attention block.  out [B, Q, H, D].
void rope_attend(const F32& qkv, const F32& cos, const F32& sin, int64_t H, int64_t Hkv, py::array_t<float, 0> key,
                 py::array_t<float, 0> value, int64_t t, const py::object& mask_obj, float scale,
                 py::array_t<float, 0> out_arr, int64_t parallel_work) {
  if (out_arr.ndim() != 4 || out_arr.shape(2) != H || !(out_arr.flags() & py::array::c_style) || !out_arr.writeable())
    throw std::invalid_argument("rope: out must be a writeable contiguous [B, Q, H, D]");
  const int64_t B = out_arr.shape(0), Q = out_arr.shape(1);
  const RopeArgs a = rope_args(qkv, cos, sin, B, Q, H, Hkv, key, value, t);
  const int64_t D = a.D, T = t + Q;
  if (out_arr.shape(3) != D) throw std::invalid_argument("rope: out [B, Q, H, D] and the cache's D do not match");
  F32 mask_arr;
  const Strided4 m = mask_view(mask_obj, B, Q, T, mask_arr);
  float* out = out_arr.mutable_data();
  py::gil_scoped_release release;
  std::vector<float> query(static_cast<size_t>(B * Q * H * D));
  rope_core(a, query.data());
  const Strided4 qv{query.data(), {B, H, Q, D}, {Q * H * D, D, H * D, 1}};
  const Strided4 kv{a.key, {B, Hkv, T, D}, {a.ks[0], a.ks[1], a.ks[2], 1}};
  const Strided4 vv{a.value, {B, Hkv, T, D}, {a.vs[0], a.vs[1], a.vs[2], 1}};
  attend_views(qv, kv, vv, m.data ? &m : nullptr, scale, out, parallel_work);
}

// A linear layer on one of dart-serve's GGUF kernels, as Int4Linear.kernel_args() gives it: (codes, scale,
// minimum or None, out_features, q8, a8), checked against its kernel's layout; ``keep`` holds the arrays.
struct Product {
  dart_kernels::QWeight w;
  bool a8;  // the qmm-a8 kernel (else qmm)
};

Product parse_product(const py::handle& h, std::vector<py::object>& keep, const char* who) {
  const std::string name(who);
  const auto t = h.cast<py::tuple>();
  if (t.size() != 6) throw std::invalid_argument(name + ": a product is (codes, scale, minimum, n, q8, a8)");
  auto codes = t[0].cast<py::array_t<uint8_t, 0>>();
  auto scale = t[1].cast<F32>();
  const int64_t n = t[3].cast<int64_t>();
  const bool q8 = t[4].cast<bool>(), a8 = t[5].cast<bool>();
  // qmm-a8: codes [NB, K/32, 1024 | 2048]; qmm: [NB, K, 32 | 64]
  const int64_t groups = a8 ? codes.shape(1) : codes.shape(1) / 32;
  const int64_t row_bytes = a8 ? (q8 ? 2048 : 1024) : (q8 ? 64 : 32);
  if (codes.ndim() != 3 || scale.ndim() != 3 || !(codes.flags() & py::array::c_style) ||
      !(scale.flags() & py::array::c_style) || codes.shape(2) != row_bytes || scale.shape(0) != codes.shape(0) ||
      scale.shape(1) != groups || scale.shape(2) != 64 || codes.shape(0) * 64 < n || (codes.shape(0) - 1) * 64 >= n ||
      (!a8 && codes.shape(1) % 32))
    throw std::invalid_argument(name + ": a product's arrays are not in its kernel's layout");
  const float* minimum = nullptr;
  if (!q8) {
    auto mins = t[2].cast<F32>();
    if (mins.ndim() != 3 || mins.shape(0) != scale.shape(0) || mins.shape(1) != scale.shape(1) ||
        mins.shape(2) != 64 || !(mins.flags() & py::array::c_style))
      throw std::invalid_argument(name + ": 4-bit weights need minimums in their kernel's layout");
    minimum = mins.data();
    keep.push_back(mins);
  }
  keep.push_back(codes);
  keep.push_back(scale);
  return {{codes.data(), scale.data(), minimum, n, groups * 32, q8}, a8};
}

void run_product(const Product& p, const float* x, int64_t m, float* y, const float* norm, float eps, bool gated,
                 bool accumulate) {
  if (p.a8) dart_kernels::qmm_a8_run(x, m, p.w, y, norm, eps, gated, accumulate);
  else dart_kernels::qmm_run(x, m, p.w, y, norm, eps, gated, accumulate);
}

const float* norm_vector(const py::handle& h, int64_t size, std::vector<py::object>& keep, const char* who) {
  auto a = h.cast<F32>();
  if (a.ndim() != 1 || a.shape(0) != size || !(a.flags() & py::array::c_style))
    throw std::invalid_argument(std::string(who) + ": a norm weight must be a contiguous float32 [H]");
  keep.push_back(a);
  return a.data();
}

// The decoder layers of a Llama-family target whose linear layers all run one of dart-serve's GGUF
// kernels (qmm or qmm-a8), in one call (dart_core.decoder.LlamaDecoder): per layer, RMS norm + q/k/v
// product, rotation + KV-cache append + row-exact attention, o product added to the residual, RMS
// norm + gate/up product, SiLU-and-multiply + down product added to the residual: the same kernel
// calls, in the same order, as the decoder's Python loop over Int4Linear.fused_into, so the same bits.
class GGUFLayers {
 public:
  struct Layer {
    Product qkv, o, gate_up, down;
    const float *ln1, *ln2;
    float eps1, eps2;
  };

  // layers: per layer a tuple (qkv, o, gate_up, down, ln1, eps1, ln2, eps2), each product a tuple
  // (codes, scale, minimum or None, out_features, q8, a8) as Int4Linear holds it.
  GGUFLayers(const py::list& layers, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale) {
    for (const auto& item : layers) {
      const auto t = item.cast<py::tuple>();
      if (t.size() != 8) throw std::invalid_argument("GGUFLayers: a layer is (qkv, o, gate_up, down, ln1, eps1, ln2, eps2)");
      Layer l{weight(t[0]), weight(t[1]), weight(t[2]), weight(t[3]), nullptr, nullptr, t[5].cast<float>(),
              t[7].cast<float>()};
      const int64_t hidden = l.qkv.w.k;
      l.ln1 = vector(t[4], hidden);
      l.ln2 = vector(t[6], hidden);
      if (l.qkv.w.n != (heads + 2 * kv_heads) * head_dim || l.o.w.k != heads * head_dim || l.o.w.n != hidden ||
          l.gate_up.w.k != hidden || l.gate_up.w.n % 2 || l.down.w.k != l.gate_up.w.n / 2 || l.down.w.n != hidden ||
          (!layers_.empty() && hidden != layers_.front().qkv.w.k))
        throw std::invalid_argument("GGUFLayers: the layers' shapes do not form a Llama decoder layer");
      layers_.push_back(l);
    }
    if (layers_.empty()) throw std::invalid_argument("GGUFLayers: no layers");
  }

  // x [B·Q, H] float32, updated in place to the last layer's output; cos/sin [B·Q, D]; keys/values:
  // per layer the cache buffers [B, Hkv, >= t+Q, D], written at t .. t+Q-1; mask [B, 1, Q, >= t+Q] or
  // None; taps [B·Q, len(tap_layers)·H], written with each tap layer's input.
  void forward(py::array_t<float, 0> x_arr, const F32& cos, const F32& sin, const py::list& keys,
               const py::list& values, int64_t t, int64_t B, int64_t Q, const py::object& mask_obj,
               const py::list& tap_list, py::array_t<float, 0> taps_arr, int64_t parallel_work) {
    std::vector<int64_t> tap_layers;
    for (const auto& i : tap_list) tap_layers.push_back(i.cast<int64_t>());
    const int64_t M = B * Q, hidden = layers_[0].qkv.w.k;
    const int64_t L = static_cast<int64_t>(layers_.size());
    if (x_arr.ndim() != 2 || x_arr.shape(0) != M || x_arr.shape(1) != hidden || !(x_arr.flags() & py::array::c_style) ||
        !x_arr.writeable())
      throw std::invalid_argument("GGUFLayers: x must be a writeable C-contiguous [B*Q, H] float32 array");
    const int64_t n_taps = static_cast<int64_t>(tap_layers.size());
    if (taps_arr.ndim() != 2 || taps_arr.shape(0) != M || taps_arr.shape(1) != n_taps * hidden ||
        !(taps_arr.flags() & py::array::c_style) || !taps_arr.writeable())
      throw std::invalid_argument("GGUFLayers: taps must be a writeable C-contiguous [B*Q, taps*H] float32 array");
    if (static_cast<int64_t>(keys.size()) != L || static_cast<int64_t>(values.size()) != L)
      throw std::invalid_argument("GGUFLayers: one key and one value buffer per layer");
    std::vector<py::array_t<float, 0>> kbufs, vbufs;
    std::vector<RopeArgs> ropes;
    for (int64_t i = 0; i < L; ++i) {
      kbufs.push_back(keys[i].cast<py::array_t<float, 0>>());
      vbufs.push_back(values[i].cast<py::array_t<float, 0>>());
    }
    // each layer's q/k/v rows go to one buffer before their rotation: the rotations' arguments point at it
    py::array_t<float, 0> qkv_arr({M, layers_[0].qkv.w.n});
    for (int64_t i = 0; i < L; ++i)
      ropes.push_back(rope_args(qkv_arr, cos, sin, B, Q, heads_, kv_heads_, kbufs[i], vbufs[i], t));
    float* qkv = qkv_arr.mutable_data();
    F32 mask_holder;
    const Strided4 m = mask_view(mask_obj, B, Q, t + Q, mask_holder);
    float* x = x_arr.mutable_data();
    float* taps = taps_arr.mutable_data();
    py::gil_scoped_release release;
    std::vector<float> query(static_cast<size_t>(M * heads_ * head_dim_)), attn(query.size());
    std::vector<float> gate_up(static_cast<size_t>(M * layers_[0].gate_up.w.n));
    const int64_t D = head_dim_, T = t + Q;
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers_[i];
      for (int64_t j = 0; j < n_taps; ++j)
        if (tap_layers[j] == i)
          for (int64_t r = 0; r < M; ++r)
            std::memcpy(taps + (r * n_taps + j) * hidden, x + r * hidden, static_cast<size_t>(hidden) * sizeof(float));
      run_product(l.qkv, x, M, qkv, l.ln1, l.eps1, false, false);
      const RopeArgs& a = ropes[i];
      rope_core(a, query.data());
      const Strided4 qv{query.data(), {B, heads_, Q, D}, {Q * heads_ * D, D, heads_ * D, 1}};
      const Strided4 kv{a.key, {B, kv_heads_, T, D}, {a.ks[0], a.ks[1], a.ks[2], 1}};
      const Strided4 vv{a.value, {B, kv_heads_, T, D}, {a.vs[0], a.vs[1], a.vs[2], 1}};
      attend_views(qv, kv, vv, m.data ? &m : nullptr, scale_, attn.data(), parallel_work);
      run_product(l.o, attn.data(), M, x, nullptr, 0.0f, false, true);
      run_product(l.gate_up, x, M, gate_up.data(), l.ln2, l.eps2, false, false);
      run_product(l.down, gate_up.data(), M, x, nullptr, 0.0f, true, true);
    }
  }

 private:
  Product weight(const py::handle& h) { return parse_product(h, keep_, "GGUFLayers"); }

  const float* vector(const py::handle& h, int64_t size) { return norm_vector(h, size, keep_, "GGUFLayers"); }

  int64_t heads_, kv_heads_, head_dim_;
  float scale_;
  std::vector<Layer> layers_;
  std::vector<py::object> keep_;  // the arrays the pointers read
};


// The DART draft head's layer for one sequence (dart_core.draft_head.DartDraftHead: one decoder layer fed
// by the target's hidden-state taps, paper §3), every product on a qmm kernel, in one call: what
// DartDraftHead._forward_static_row computes with a dozen tensor operators and kernel calls, followed by
// the top-k of each drafted level and its softmax (DartDraftHead.top_k).  Per call, for the n new real
// positions and S mask slots (rows R = n + S):
//   g = fc(taps) [n, H]; x = [input_norm(embeds) | hidden_norm(g)] for the real rows, mask_rep for the
//   slots [R, 2H]; qkv = x·W_qkv; rotation and KV-cache append at start .. start + R - 1; attention of
//   the last real row and the slots (Q = S + 1 queries; row r sees the cache up to start + r); h = the
//   residual (g of those rows, mask_rep's first half for the slots) + o(attn); h += down(silu(gate)·up)
//   of post_norm(h); logits = lm_head(final_norm(h)) [Q, V_draft] (final_norm applied twice with
//   final_norm_twice); per query row the k largest logits (high to low, ties to the lower index), their
//   softmax, and their target ids (index + d2t[index]).
class DraftRow {
 public:
  // products: (fc, qkv, o, gate_up, down, lm_head), each as parse_product takes it; norms: (input_norm,
  // hidden_norm, post_norm, final_norm) float32 [H] with their eps; mask_rep float32 [2H]; d2t int64 [V_draft].
  DraftRow(const py::tuple& products, const py::tuple& norms, const py::tuple& eps, const F32& mask_rep,
           const py::array_t<int64_t, 0>& d2t, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
           bool final_norm_twice)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale), twice_(final_norm_twice) {
    if (products.size() != 6 || norms.size() != 4 || eps.size() != 4)
      throw std::invalid_argument("DraftRow: products (fc, qkv, o, gate_up, down, lm_head), four norms and their eps");
    for (int i = 0; i < 6; ++i) p_[i] = parse_product(products[i], keep_, "DraftRow");
    const int64_t H = p_[0].w.n;  // fc: [3·H_target] -> [H]
    for (int i = 0; i < 4; ++i) {
      norm_[i] = norm_vector(norms[i], H, keep_, "DraftRow");
      eps_[i] = eps[i].cast<float>();
    }
    const auto &qkv = p_[1].w, &o = p_[2].w, &gu = p_[3].w, &down = p_[4].w, &lm = p_[5].w;
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || head_dim <= 0 || head_dim % 2 || qkv.k != 2 * H ||
        qkv.n != (heads + 2 * kv_heads) * head_dim || o.k != heads * head_dim || o.n != H || gu.k != H ||
        gu.n % 2 || down.k != gu.n / 2 || down.n != H || lm.k != H)
      throw std::invalid_argument("DraftRow: the products' shapes do not form the draft head's layer");
    if (mask_rep.ndim() != 1 || mask_rep.shape(0) != 2 * H || !(mask_rep.flags() & py::array::c_style))
      throw std::invalid_argument("DraftRow: mask_rep must be a contiguous float32 [2H]");
    if (d2t.ndim() != 1 || d2t.shape(0) != lm.n || !(d2t.flags() & py::array::c_style))
      throw std::invalid_argument("DraftRow: d2t must be a contiguous int64 [V_draft]");
    keep_.push_back(mask_rep);
    keep_.push_back(d2t);
    mask_rep_ = mask_rep.data();
    d2t_ = d2t.data();
    hidden_ = H;
  }

  // taps [n, 3·H_target], embeds [n, H] (the target's embeddings of each position's next token), cos/sin
  // [n + S, D] (rotary tables at the rows' positions), key/value buffers [1, Hkv, >= start + n + S, D]
  // written at start .., ids [S + 1, k] int64 and probs [S + 1, k] float32 written.
  void forward(const F32& taps, const F32& embeds, const F32& cos, const F32& sin, py::array_t<float, 0> key,
               py::array_t<float, 0> value, int64_t start, int64_t slots, py::array_t<int64_t, 0> ids_arr,
               py::array_t<float, 0> probs_arr, int64_t parallel_work) {
    const int64_t H = hidden_, D = head_dim_, n = taps.ndim() == 2 ? taps.shape(0) : -1;
    const int64_t rows = n + slots, queries = slots + 1, vocab = p_[5].w.n;
    if (n < 1 || slots < 0 || start < 0 || taps.shape(1) != p_[0].w.k || !(taps.flags() & py::array::c_style) ||
        embeds.ndim() != 2 || embeds.shape(0) != n || embeds.shape(1) != H || !(embeds.flags() & py::array::c_style))
      throw std::invalid_argument("DraftRow: taps [n >= 1, 3·H_target] and embeds [n, H], contiguous, slots >= 0");
    const int64_t k = ids_arr.ndim() == 2 ? ids_arr.shape(1) : -1;
    if (ids_arr.ndim() != 2 || ids_arr.shape(0) != queries || k < 1 || k > vocab || probs_arr.ndim() != 2 ||
        probs_arr.shape(0) != queries || probs_arr.shape(1) != k || !(ids_arr.flags() & py::array::c_style) ||
        !(probs_arr.flags() & py::array::c_style) || !ids_arr.writeable() || !probs_arr.writeable())
      throw std::invalid_argument("DraftRow: ids and probs must be writeable contiguous [slots + 1, k], 1 <= k <= V_draft");
    py::array_t<float, 0> qkv_arr({rows, p_[1].w.n});
    const RopeArgs a = rope_args(qkv_arr, cos, sin, 1, rows, heads_, kv_heads_, key, value, start);
    const float *tp = taps.data(), *ep = embeds.data();
    float* qkv = qkv_arr.mutable_data();
    int64_t* ids = ids_arr.mutable_data();
    float* probs = probs_arr.mutable_data();
    py::gil_scoped_release release;
    std::vector<float> g(static_cast<size_t>(n * H)), x(static_cast<size_t>(rows * 2 * H)), normed;
    run_product(p_[0], tp, n, g.data(), nullptr, 0.0f, false, false);
    const float* ne = dart_kernels::prepare_rows(ep, n, H, norm_[0], eps_[0], false, normed);
    for (int64_t r = 0; r < n; ++r) std::memcpy(x.data() + r * 2 * H, ne + r * H, H * sizeof(float));
    const float* ng = dart_kernels::prepare_rows(g.data(), n, H, norm_[1], eps_[1], false, normed);
    for (int64_t r = 0; r < n; ++r) std::memcpy(x.data() + r * 2 * H + H, ng + r * H, H * sizeof(float));
    for (int64_t r = n; r < rows; ++r) std::memcpy(x.data() + r * 2 * H, mask_rep_, 2 * H * sizeof(float));
    run_product(p_[1], x.data(), rows, qkv, nullptr, 0.0f, false, false);
    std::vector<float> query(static_cast<size_t>(rows * heads_ * D)), attn(static_cast<size_t>(queries * heads_ * D));
    rope_core(a, query.data());
    // the queries: the last real row and the slots; query i sees the cache up to start + n - 1 + i
    const int64_t T = start + rows;
    std::vector<float> mask(static_cast<size_t>(queries * T), 0.0f);
    for (int64_t i = 0; i < queries; ++i)
      std::fill(mask.begin() + i * T + start + n + i, mask.begin() + (i + 1) * T, std::numeric_limits<float>::lowest());
    const Strided4 qv{query.data() + (n - 1) * heads_ * D, {1, heads_, queries, D}, {queries * heads_ * D, D, heads_ * D, 1}};
    const Strided4 kv{a.key, {1, kv_heads_, T, D}, {a.ks[0], a.ks[1], a.ks[2], 1}};
    const Strided4 vv{a.value, {1, kv_heads_, T, D}, {a.vs[0], a.vs[1], a.vs[2], 1}};
    const Strided4 mv{mask.data(), {1, 1, queries, T}, {queries * T, queries * T, T, 1}};
    attend_views(qv, kv, vv, &mv, scale_, attn.data(), parallel_work);
    std::vector<float> h(static_cast<size_t>(queries * H)), gate_up(static_cast<size_t>(queries * p_[3].w.n));
    std::memcpy(h.data(), g.data() + (n - 1) * H, H * sizeof(float));
    for (int64_t i = 1; i < queries; ++i) std::memcpy(h.data() + i * H, mask_rep_, H * sizeof(float));
    run_product(p_[2], attn.data(), queries, h.data(), nullptr, 0.0f, false, true);
    run_product(p_[3], h.data(), queries, gate_up.data(), norm_[2], eps_[2], false, false);
    run_product(p_[4], gate_up.data(), queries, h.data(), nullptr, 0.0f, true, true);
    const float* hf = h.data();
    if (twice_) hf = dart_kernels::prepare_rows(h.data(), queries, H, norm_[3], eps_[3], false, normed);
    std::vector<float> logits(static_cast<size_t>(queries * vocab));
    run_product(p_[5], hf, queries, logits.data(), norm_[3], eps_[3], false, false);
    std::vector<int32_t> order(static_cast<size_t>(vocab));
    for (int64_t i = 0; i < queries; ++i) {
      const float* l = logits.data() + i * vocab;
      for (int32_t j = 0; j < vocab; ++j) order[j] = j;
      const auto key_of = [l](int32_t j) { return std::isnan(l[j]) ? -std::numeric_limits<float>::infinity() : l[j]; };
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t u, int32_t v) {
        const float a_ = key_of(u), b_ = key_of(v);
        return a_ > b_ || (a_ == b_ && u < v);
      });
      const float top = key_of(order[0]);
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const float e = std::isinf(top) ? (j == 0 ? 1.0f : 0.0f) : std::exp(key_of(order[j]) - top);
        probs[i * k + j] = e;
        sum += e;
      }
      for (int64_t j = 0; j < k; ++j) {
        probs[i * k + j] /= sum;
        ids[i * k + j] = order[j] + d2t_[order[j]];
      }
    }
  }

 private:
  int64_t heads_, kv_heads_, head_dim_, hidden_ = 0;
  float scale_;
  bool twice_;
  Product p_[6];
  const float* norm_[4];
  float eps_[4];
  const float* mask_rep_ = nullptr;
  const int64_t* d2t_ = nullptr;
  std::vector<py::object> keep_;
};

}  // namespace

void register_qmm(py::module_& mod);  // qmm.cpp: qmm and qmm_a8
void register_kv_compact(py::module_& mod);  // kv_compact.cpp: compact_cache
void register_accept(py::module_& mod);  // accept.cpp: accept_greedy

PYBIND11_MODULE(_kernels, mod) {
  mod.doc() = "dart_core's CPU kernels (see dart_core/kernels.py)";
  register_qmm(mod);
  register_kv_compact(mod);
  register_accept(mod);
  py::class_<GGUFLayers>(mod, "GGUFLayers",
                         "the decoder layers of a Llama target on the qmm or qmm-a8 kernel (dart_core.decoder)")
      .def(py::init<const py::list&, int64_t, int64_t, int64_t, float>(), py::arg("layers"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("scale"))
      .def("forward", &GGUFLayers::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("keys"),
           py::arg("values"), py::arg("t"), py::arg("batch"), py::arg("query_len"), py::arg("mask"),
           py::arg("tap_layers"), py::arg("taps"), py::arg("parallel_work"));
  py::class_<DraftRow>(mod, "DraftRow", "the draft head's layer and top-k for one sequence (dart_core.draft_head)")
      .def(py::init<const py::tuple&, const py::tuple&, const py::tuple&, const F32&, const py::array_t<int64_t, 0>&,
                    int64_t, int64_t, int64_t, float, bool>(),
           py::arg("products"), py::arg("norms"), py::arg("eps"), py::arg("mask_rep"), py::arg("d2t"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("final_norm_twice"))
      .def("forward", &DraftRow::forward, py::arg("taps"), py::arg("embeds"), py::arg("cos"), py::arg("sin"),
           py::arg("key_buffer"), py::arg("value_buffer"), py::arg("start"), py::arg("slots"), py::arg("ids"),
           py::arg("probs"), py::arg("parallel_work"));
  mod.def("row_exact_attention", &attention, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("mask"),
          py::arg("scale"), py::arg("out"), py::arg("parallel_work"),
          "softmax(scale * q.k^T + mask).v, each query row on its own (see dart_core.kernels)");
  mod.def("rope_append", &rope_append, py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("heads"),
          py::arg("kv_heads"), py::arg("query"), py::arg("key_buffer"), py::arg("value_buffer"), py::arg("t"),
          "rotary embedding of q and k, and the KV-cache append of k and v (see dart_core.kernels)");
  mod.def("rope_attend", &rope_attend, py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("heads"),
          py::arg("kv_heads"), py::arg("key_buffer"), py::arg("value_buffer"), py::arg("t"), py::arg("mask"),
          py::arg("scale"), py::arg("out"), py::arg("parallel_work"),
          "rope_append, then the row-exact attention over the cache (see dart_core.kernels)");
}
