// Row-exact matrix product with a GGUF 4-bit or 8-bit weight, float32 activations and results.
//
// y[m, n] = sum over blocks g of 32 inputs of (d[g, n] * S + mn[g, n] * X), where
// S = sum_{k in g} x[m, k] * q[n, k] (q the block's codes as floats: 0..15 for Q4_0 / Q4_1, the
// int8 for Q8_0) and X = sum_{k in g} x[m, k]; the weight is w = q * d + mn (Q4_1 mn = m, Q4_0
// mn = -8d; Q8_0 has no mn term).  The arithmetic is fixed: S is a float32 fused multiply-add
// chain over k in order from +0, X a float32 chain of additions in order from +0, and the total
// runs over the blocks in order from +0 as fma(d, S, total) then fma(mn, X, total).  So a row's
// result depends only on its own x row: the same bits however many rows share the call (the
// vectorised code takes rows four at a time and converts each code once for them), and in the
// portable loop.  A draft tree verified in one call then equals one-token steps.  Factoring the
// scale and minimum out of each block leaves one multiply-add per weight and row, and one
// conversion per weight and four rows (llama.cpp sums its blocks the same way).
//
// Weight layout (built by dart_core.quant): output columns in blocks of 64 (N padded up to a
// multiple of 64); block b holds, for every k, 32 bytes of 4-bit codes (byte j < 16: column j in
// the low nibble, column 32 + j in the high one; byte 16 + j: columns 16 + j and 48 + j) or 64
// int8 codes; scales and minimums float32 [NB, K/32, 64].
//
// Around a Llama decoder layer's products the same call can first RMS-normalise its rows or take
// silu(gate) · up of gate/up rows side by side (dart_kernels::prepare_rows, shared with qmm-a8), and
// add its product to the output (a residual connection) instead of writing it: see dart_core.decoder.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "qmm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // _mm512_undefined_ps inside GCC's own intrinsics
#define DART_QMM_AVX512 1
#define DART_AVX512 __attribute__((target("avx512f,fma")))
#endif

namespace py = pybind11;

namespace {

using dart_kernels::kBlockN;
using dart_kernels::kGroup;

using Weight = dart_kernels::QWeight;

// Elements from one block of 64 output columns to the next: codes, and scales or minimums.
inline size_t code_stride(const Weight& w) { return static_cast<size_t>(w.k) * (w.q8 ? 64 : 32); }
inline size_t scale_stride(const Weight& w) { return static_cast<size_t>(w.k / kGroup) * kBlockN; }

// X for every row and group: the sums of each row's inputs over each group of 32, [M, K/32] (4-bit
// weights only: Q8_0 has no minimum term).
std::vector<float> block_sums(const float* x, int64_t m_rows, int64_t K) {
  std::vector<float> sums(static_cast<size_t>(m_rows * (K / kGroup)));
  for (int64_t r = 0; r < m_rows; ++r)
    for (int64_t g = 0; g < K / kGroup; ++g) {
      float s = 0.0f;
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) s = s + x[r * K + k];
      sums[r * (K / kGroup) + g] = s;
    }
  return sums;
}

inline float code_at(const Weight& w, const uint8_t* codes, int64_t k, int c) {
  if (w.q8) return static_cast<float>(static_cast<int8_t>(codes[k * 64 + c]));
  const uint8_t byte = codes[k * 32 + (c & 31)];
  return static_cast<float>(c < 32 ? (byte & 15) : (byte >> 4));
}

// The portable version: the same operations, one output at a time.
void qmm_portable(const float* x, int64_t m_rows, const Weight& w, const float* xsum, float* y, int64_t ldy,
                  bool accumulate, dart_kernels::ArgmaxSink* sink) {
  const int64_t G = w.k / kGroup;
  if (sink) accumulate = false;
#pragma omp parallel for schedule(guided) if (m_rows * w.n * w.k >= (1 << 16))
  for (int64_t b = 0; b < w.blocks(); ++b) {
    const uint8_t* codes = w.codes + b * code_stride(w);
    const float* sc = w.scale + b * scale_stride(w);
    const float* mn = w.q8 ? nullptr : w.minimum + b * scale_stride(w);
    const int cols = static_cast<int>(std::min<int64_t>(kBlockN, w.n - b * kBlockN));
    const int t = omp_get_thread_num();
    float* yb = sink ? sink->rows(t) : y + b * kBlockN;  // the block's outputs, row stride ldb
    const int64_t ldb = sink ? dart_kernels::ArgmaxSink::kStride : ldy;
    for (int64_t r = 0; r < m_rows; ++r) {
      for (int c = 0; c < cols; ++c) {
        float total = 0.0f;
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.0f;
          for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) s = std::fma(x[r * w.k + k], code_at(w, codes, k, c), s);
          total = std::fma(sc[g * kBlockN + c], s, total);
          if (!w.q8) total = std::fma(mn[g * kBlockN + c], xsum[r * G + g], total);
        }
        float* out = yb + r * ldb + c;
        *out = accumulate ? *out + total : total;
      }
    }
    if (sink) sink->take(t, b, cols);
  }
}

#ifdef DART_QMM_AVX512

// Row k of a block's codes as floats, four vectors of 16 columns.
template <bool kQ8>
DART_AVX512 inline void codes_at(const uint8_t* p, __m512* q) {
  if (kQ8) {
    for (int c = 0; c < 4; ++c)
      q[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c))));
    return;
  }
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i lo = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes));       // columns 0-15, 32-47
  const __m512i hi = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1));  // columns 16-31, 48-63
  const __m512i mask = _mm512_set1_epi32(15);
  q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(lo, mask));
  q[1] = _mm512_cvtepi32_ps(_mm512_and_si512(hi, mask));
  q[2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(lo, 4));
  q[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(hi, 4));
}

using dart_kernels::store_cols;

// A group of 32 inputs finished for R rows: total = fma(d, S, total), then fma(mn, X, total); S
// restarts from +0.
template <bool kQ8, int R>
DART_AVX512 inline void close_group(__m512 (&total)[R][4], __m512 (&s)[R][4], const float* sc, const float* mins,
                                    const float* xsum, int64_t G, int64_t g) {
  for (int c = 0; c < 4; ++c) {
    const int64_t at = g * kBlockN + 16 * c;
    const __m512 d = _mm512_loadu_ps(sc + at);
    for (int r = 0; r < R; ++r) total[r][c] = _mm512_fmadd_ps(d, s[r][c], total[r][c]);
    if (!kQ8) {
      const __m512 mn = _mm512_loadu_ps(mins + at);
      for (int r = 0; r < R; ++r) total[r][c] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[r * G + g]), total[r][c]);
    }
    for (int r = 0; r < R; ++r) s[r][c] = _mm512_setzero_ps();
  }
}

constexpr int64_t kPrefetchGroups = 2;  // how many blocks of 32 inputs ahead the codes are prefetched

// R rows of x against weight block b, the codes converted in registers.
template <bool kQ8, int R>
DART_AVX512 void direct(const float* x, int64_t ldx, const float* xsum, const Weight& w, int64_t b, float* y,
                        int64_t ldy, int cols, bool accumulate) {
  const int64_t G = w.k / kGroup;
  constexpr int64_t kRowBytes = kQ8 ? 64 : 32;
  __m512 total[R][4], s[R][4], q[4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) total[r][c] = s[r][c] = _mm512_setzero_ps();
  const uint8_t* codes = w.codes + b * code_stride(w);
  const float* sc = w.scale + b * scale_stride(w);
  const float* mins = kQ8 ? nullptr : w.minimum + b * scale_stride(w);
  for (int64_t g = 0; g < G; ++g) {
    if (g + kPrefetchGroups < G)  // a later group's codes, ahead of the hardware prefetcher
      for (int64_t line = 0; line < kGroup * kRowBytes / 64; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(codes + (g + kPrefetchGroups) * kGroup * kRowBytes + 64 * line),
                     _MM_HINT_T0);
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      codes_at<kQ8>(codes + k * kRowBytes, q);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
        for (int c = 0; c < 4; ++c) s[r][c] = _mm512_fmadd_ps(a, q[c], s[r][c]);
      }
    }
    close_group<kQ8, R>(total, s, sc, mins, xsum, G, g);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) store_cols(y + r * ldy, total[r][c], c, cols, accumulate);
}

template <bool kQ8>
DART_AVX512 void qmm_avx512(const float* x, int64_t m_rows, const Weight& w, const float* xsum, float* y,
                            int64_t ldy, bool accumulate, dart_kernels::ArgmaxSink* sink) {
  const int64_t K = w.k, G = K / kGroup;
  if (sink) accumulate = false;
// guided, not static: each thread still streams contiguous runs of blocks (dynamic's one-block
// turns broke the weights' sequential stream and measured slower: bench/results/served_schedule), and when another process
// takes a core mid-kernel (a served replica shares its cores) the other thread takes over the tail
// of the preempted one's share instead of waiting for it at the barrier.  A thread's blocks still
// come in increasing order, as ArgmaxSink needs.
#pragma omp parallel for schedule(guided) if (w.blocks() > 1)
  for (int64_t b = 0; b < w.blocks(); ++b) {
    const int cols = static_cast<int>(std::min<int64_t>(kBlockN, w.n - b * kBlockN));
    const int t = omp_get_thread_num();
    float* yb = sink ? sink->rows(t) : y + b * kBlockN;  // the block's outputs, row stride ldb
    const int64_t ldb = sink ? dart_kernels::ArgmaxSink::kStride : ldy;
    for (int64_t r0 = 0; r0 < m_rows; r0 += 4) {  // four rows share each conversion of the codes
      const float* xr = x + r0 * K;
      const float* sr = kQ8 ? nullptr : xsum + r0 * G;  // Q8_0: no block sums
      float* yr = yb + r0 * ldb;
      switch (std::min<int64_t>(4, m_rows - r0)) {
        case 4: direct<kQ8, 4>(xr, K, sr, w, b, yr, ldb, cols, accumulate); break;
        case 3: direct<kQ8, 3>(xr, K, sr, w, b, yr, ldb, cols, accumulate); break;
        case 2: direct<kQ8, 2>(xr, K, sr, w, b, yr, ldb, cols, accumulate); break;
        default: direct<kQ8, 1>(xr, K, sr, w, b, yr, ldb, cols, accumulate); break;
      }
    }
    if (sink) sink->take(t, b, cols);
  }
}

bool cpu_has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma"); }
#else
bool cpu_has_avx512() { return false; }
#endif

using F32 = py::array_t<float, 0>;
using U8 = py::array_t<uint8_t, 0>;

// The Python face of both kernels (qmm, and qmm-a8 with a8): checks the arrays against the kernel's
// layout, then runs it without the GIL, writing out [M, N] (float32) or, with argmax, each row's
// argmax to out [M] (int64).
void call(bool a8, const F32& x, const U8& codes, const F32& scale, const py::object& minimum_obj, int64_t n, bool q8,
          py::array out, bool portable, const py::object& norm_obj, float eps, bool gated, bool accumulate,
          bool argmax) {
  const std::string name = std::string(a8 ? "qmm_a8" : "qmm") + (argmax ? "_argmax: " : ": ");
  auto fail = [&](const std::string& what) { throw std::invalid_argument(name + what); };
  if (x.ndim() != 2 || !(x.flags() & py::array::c_style)) fail("x must be a C-contiguous [M, K] float32 array");
  const int64_t m_rows = x.shape(0), K = gated ? x.shape(1) / 2 : x.shape(1);
  const int64_t blocks = (n + kBlockN - 1) / kBlockN, G = K / kGroup;
  if (n <= 0 || K <= 0 || K % kGroup || (gated && x.shape(1) != 2 * K))
    fail("N must be positive and K a positive multiple of 32 (x [M, 2K] when gated)");
  const int64_t rows = a8 ? G : K, row_bytes = a8 ? (q8 ? 2048 : 1024) : (q8 ? 64 : 32);
  if (codes.ndim() != 3 || codes.shape(0) != blocks || codes.shape(1) != rows || codes.shape(2) != row_bytes ||
      !(codes.flags() & py::array::c_style))
    fail(a8 ? "codes must be C-contiguous [ceil(N/64), K/32, 1024 (4-bit) or 2048 (8-bit)] uint8"
            : "codes must be C-contiguous [ceil(N/64), K, 32 (4-bit) or 64 (8-bit)] uint8");
  auto block_params = [&](const F32& a, const char* what) {
    if (a.ndim() != 3 || a.shape(0) != blocks || a.shape(1) != G || a.shape(2) != kBlockN ||
        !(a.flags() & py::array::c_style))
      fail(std::string(what) + " must be C-contiguous [ceil(N/64), K/32, 64] float32");
  };
  block_params(scale, "scale");
  const float* minimum = nullptr;
  F32 minimum_arr;
  if (!q8) {
    if (minimum_obj.is_none()) fail("4-bit weights need their minimums");
    minimum_arr = minimum_obj.cast<F32>();
    block_params(minimum_arr, "minimum");
    minimum = minimum_arr.data();
  }
  F32 norm_arr;
  const float* norm = nullptr;
  if (!norm_obj.is_none()) {
    norm_arr = norm_obj.cast<F32>();
    if (norm_arr.ndim() != 1 || norm_arr.shape(0) != K || gated)
      fail("norm must be a float32 [K] array (and not combined with gated)");
    norm = norm_arr.data();
  }
  const bool right_type = argmax ? py::isinstance<py::array_t<int64_t>>(out) : py::isinstance<py::array_t<float>>(out);
  if (!right_type || out.ndim() != (argmax ? 1 : 2) || out.shape(0) != m_rows || (!argmax && out.shape(1) != n) ||
      !(out.flags() & py::array::c_style) || !out.writeable())
    fail(argmax ? "out must be a writeable C-contiguous [M] int64 array"
                : "out must be a writeable C-contiguous [M, N] float32 array");
  const dart_kernels::QWeight w{codes.data(), scale.data(), minimum, n, K, q8};
  const float* xp = x.data();
  void* op = out.mutable_data();
  py::gil_scoped_release release;
  if (!argmax) {
    float* yp = static_cast<float*>(op);
    if (a8) dart_kernels::qmm_a8_run(xp, m_rows, w, yp, norm, eps, gated, accumulate, portable);
    else dart_kernels::qmm_run(xp, m_rows, w, yp, norm, eps, gated, accumulate, portable);
    return;
  }
  dart_kernels::ArgmaxSink sink(m_rows, omp_get_max_threads());
  if (a8) dart_kernels::qmm_a8_run(xp, m_rows, w, nullptr, norm, eps, gated, false, portable, &sink);
  else dart_kernels::qmm_run(xp, m_rows, w, nullptr, norm, eps, gated, false, portable, &sink);
  sink.finish(static_cast<int64_t*>(op));
}

}  // namespace

void dart_kernels::qmm_run(const float* x, int64_t m_rows, const QWeight& w, float* y, const float* norm, float eps,
                           bool gated, bool accumulate, bool portable, ArgmaxSink* sink) {
  const int64_t K = w.k, n = w.n;
  std::vector<float> h;
  x = prepare_rows(x, m_rows, K, norm, eps, gated, h);
  const std::vector<float> xsum = w.q8 ? std::vector<float>() : block_sums(x, m_rows, K);
#ifdef DART_QMM_AVX512
  if (!portable && cpu_has_avx512()) {
    if (w.q8) qmm_avx512<true>(x, m_rows, w, xsum.data(), y, n, accumulate, sink);
    else qmm_avx512<false>(x, m_rows, w, xsum.data(), y, n, accumulate, sink);
    return;
  }
#endif
  qmm_portable(x, m_rows, w, xsum.data(), y, n, accumulate, sink);
}

void register_qmm(py::module_& mod) {
  for (const bool a8 : {false, true}) {
    const auto run = [a8](const F32& x, const U8& codes, const F32& scale, const py::object& minimum, int64_t n,
                          bool q8, py::array out, bool portable, const py::object& norm, float eps, bool gated,
                          bool accumulate) {  // out unconverted: a copy would take the writes
      call(a8, x, codes, scale, minimum, n, q8, out, portable, norm, eps, gated, accumulate, false);
    };
    mod.def(a8 ? "qmm_a8" : "qmm", run, py::arg("x"), py::arg("codes"), py::arg("scale"), py::arg("minimum"),
            py::arg("n"), py::arg("q8"), py::arg("out"), py::arg("portable") = false, py::arg("norm") = py::none(),
            py::arg("eps") = 0.0f, py::arg("gated") = false, py::arg("accumulate") = false,
            a8 ? "x [M, K] (RMS-normalised with norm, or silu(x[:, :K]) * x[:, K:] when gated) quantised to 8 bits per "
                 "group of 32, times a GGUF 4-bit or 8-bit weight's transpose, each row on its own, written to out or "
                 "added to it (accumulate; see dart_core.quant)"
               : "x [M, K] (RMS-normalised with norm, or silu(x[:, :K]) * x[:, K:] when gated) times a GGUF 4-bit or "
                 "8-bit weight's transpose, each row on its own, written to out or added to it (accumulate; see "
                 "dart_core.quant)");
    const auto arg = [a8](const F32& x, const U8& codes, const F32& scale, const py::object& minimum, int64_t n,
                          bool q8, py::array out, bool portable, const py::object& norm, float eps) {
      call(a8, x, codes, scale, minimum, n, q8, out, portable, norm, eps, false, false, true);
    };
    mod.def(a8 ? "qmm_a8_argmax" : "qmm_argmax", arg, py::arg("x"), py::arg("codes"), py::arg("scale"),
            py::arg("minimum"), py::arg("n"), py::arg("q8"), py::arg("out"), py::arg("portable") = false,
            py::arg("norm") = py::none(), py::arg("eps") = 0.0f,
            "out [M] int64 = each row's argmax over the outputs the product without argmax would write (the "
            "first of equal maxima, a NaN above every number, as torch.argmax), computed block by block without "
            "writing the [M, N] outputs");
  }
  mod.def("qmm_vectorised", &cpu_has_avx512, "whether qmm runs its AVX-512 version on this CPU");
  mod.def("qmm_a8_vectorised", &dart_kernels::qmm_a8_vectorised,
          "whether qmm_a8 runs a vectorised version on this CPU (AVX-512 VNNI or AVX2)");
  mod.def("qmm_a8_isa", &dart_kernels::qmm_a8_isa,
          "the version qmm_a8 takes for a few rows on this CPU: 'avx512-vnni', 'avx2' or 'portable' (the same bits)");
  mod.def("set_qmm_a8_avx512", &dart_kernels::set_qmm_a8_avx512, py::arg("enabled"),
          "lets qmm_a8's AVX-512 VNNI version (and AMX) run where the CPU has them, or runs its AVX2 version "
          "instead, for this process; returns qmm_a8_isa()");
  mod.def("qmm_a8_amx", &dart_kernels::qmm_a8_amx,
          "whether qmm_a8 takes its AMX version (Intel AMX-INT8 tiles, the same bits) for calls of several rows");
  mod.def("set_qmm_a8_amx", &dart_kernels::set_qmm_a8_amx, py::arg("enabled"), py::arg("min_rows_4bit") = 12,
          py::arg("min_rows_8bit") = 6,
          "turns qmm_a8's AMX version on or off for this process and sets the fewest rows of a 4-bit / 8-bit "
          "weight that take it (the defaults: where it measured faster); returns qmm_a8_amx()");
}
