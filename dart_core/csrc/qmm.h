// dart_core's GGUF-weight products for other C++ code of dart_core._kernels (the decoder layers in
// attention.cpp): qmm (float32 activations, qmm.cpp) and qmm-a8 (8-bit activations, qmm_a8.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace dart_kernels {

constexpr int kBlockN = 64;  // output columns per weight block, in both kernels' layouts
constexpr int kGroup = 32;   // inputs per GGUF block (one scale, one minimum)

// A GGUF weight in one kernel's layout: qmm codes [ceil(N/64), K, 32 or 64], qmm-a8 codes
// [ceil(N/64), K/32, 1024 or 2048] (uint8); scale and minimum [ceil(N/64), K/32, 64] float32 (minimum
// null for Q8_0).
struct QWeight {
  const uint8_t* codes;
  const float* scale;
  const float* minimum;
  int64_t n, k;
  bool q8;
  int64_t blocks() const { return (n + kBlockN - 1) / kBlockN; }  // blocks of 64 output columns
};

#if defined(__x86_64__) && defined(__GNUC__)
// Vector c (16 columns) of a block's 64 outputs, written to y (or added to it with accumulate); only
// the block's first cols columns exist.  For both kernels' AVX-512 code.
__attribute__((target("avx512f"))) inline void store_cols(float* y, const __m512& v, int c, int cols, bool accumulate) {
  const int left = cols - 16 * c;
  if (left <= 0) return;
  const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  const __m512 out = accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y + 16 * c), v) : v;
  _mm512_mask_storeu_ps(y + 16 * c, mask, out);
}
#endif

// Each row's argmax over the outputs, in place of the outputs (an output layer at temperature 0:
// dart_core.quant.Int4Linear.argmax).  Each thread computes a block of 64 outputs for every row into
// its own small buffer (cache-resident) and folds it into, per row, 16 lanes of (best output, its
// index) and the first NaN's index; finish() merges lanes and threads.  The outputs are the
// product's own bits, so the result is torch.argmax's over the written outputs: the first of equal
// maxima, a NaN above every number (the first NaN), column 0 for a row of -inf only.
class ArgmaxSink {
 public:
  static constexpr int kLanes = 16;
  ArgmaxSink(int64_t m_rows, int threads)
      : m_(m_rows), threads_(threads), buf_(static_cast<size_t>(threads * m_rows * kStride)),
        best_(static_cast<size_t>(threads * m_rows * kLanes), -INFINITY),
        index_(static_cast<size_t>(threads * m_rows * kLanes), -1), nan_(static_cast<size_t>(threads * m_rows), -1) {}
  // A buffer row's stride: 64 outputs and 16 floats of padding (with rows 256 bytes apart the stores
  // of four rows aliased the product's loads and slowed the product itself on an AMD EPYC, as
  // measured in the commit that added the fused argmax).
  static constexpr int64_t kStride = kBlockN + 16;
  // Thread t's buffer: [M, 64], row stride kStride.
  float* rows(int t) { return buf_.data() + static_cast<size_t>(t) * m_ * kStride; }
  // Thread t wrote block b's first cols outputs of every row to rows(t).  A thread takes its blocks
  // in increasing order (so a lane keeps the first of its equal maxima with a strict comparison).
  void take(int t, int64_t b, int cols) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (cols == kBlockN && avx512()) return take_avx512(t, b);
#endif
    const float* y = rows(t);
    for (int64_t r = 0; r < m_; ++r) {
      const size_t row = static_cast<size_t>(t) * m_ + r;
      float* best = best_.data() + row * kLanes;
      int32_t* index = index_.data() + row * kLanes;
      for (int c = 0; c < cols; ++c) {
        const float v = y[r * kStride + c];
        const int32_t i = static_cast<int32_t>(b * kBlockN + c);
        if (std::isnan(v)) {
          if (nan_[row] < 0) nan_[row] = i;
        } else if (v > best[c % kLanes]) {
          best[c % kLanes] = v, index[c % kLanes] = i;
        }
      }
    }
  }
  // out [M] int64.
  void finish(int64_t* out) const {
    for (int64_t r = 0; r < m_; ++r) {
      float bv = -INFINITY;
      int64_t bi = -1, first_nan = -1;
      for (int t = 0; t < threads_; ++t) {
        const size_t row = static_cast<size_t>(t) * m_ + r;
        if (nan_[row] >= 0 && (first_nan < 0 || nan_[row] < first_nan)) first_nan = nan_[row];
        for (int l = 0; l < kLanes; ++l) {
          const int64_t i = index_[row * kLanes + l];
          const float v = best_[row * kLanes + l];
          if (i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi))) bv = v, bi = i;
        }
      }
      out[r] = first_nan >= 0 ? first_nan : bi >= 0 ? bi : 0;
    }
  }

 private:
#if defined(__x86_64__) && defined(__GNUC__)
  static bool avx512() {
    static const bool yes = __builtin_cpu_supports("avx512f");
    return yes;
  }
  __attribute__((target("avx512f"))) void take_avx512(int t, int64_t b) {
    const float* y = rows(t);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t r = 0; r < m_; ++r) {
      const size_t row = static_cast<size_t>(t) * m_ + r;
      __m512 best = _mm512_loadu_ps(best_.data() + row * kLanes);
      __m512i index = _mm512_loadu_si512(index_.data() + row * kLanes);
      __mmask16 nan = 0;
      int nan_at = -1;
      for (int c = 0; c < kBlockN / kLanes; ++c) {
        const __m512 v = _mm512_loadu_ps(y + r * kStride + c * kLanes);
        const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, gt, v);
        index = _mm512_mask_mov_epi32(
            index, gt, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(b * kBlockN + c * kLanes))));
        const __mmask16 un = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        if (un && !nan) nan = un, nan_at = c * kLanes + __builtin_ctz(un);
      }
      _mm512_storeu_ps(best_.data() + row * kLanes, best);
      _mm512_storeu_si512(index_.data() + row * kLanes, index);
      if (nan && nan_[row] < 0) nan_[row] = static_cast<int32_t>(b * kBlockN + nan_at);
    }
  }
#endif
  int64_t m_;
  int threads_;
  std::vector<float> buf_;
  std::vector<float> best_;     // [threads, M, 16]
  std::vector<int32_t> index_;  // [threads, M, 16], -1: nothing above -inf yet
  std::vector<int32_t> nan_;    // [threads, M], the first NaN's column or -1
};

// The rows a layer multiplies (qmm_a8.cpp), for either kernel: x itself without norm or gated, else
// x [M, K] RMS-normalised by norm [K] and eps, or silu(gate) · up of x [M, 2K] when gated, written to
// h (resized to [M, K]) and returned.
const float* prepare_rows(const float* x, int64_t m_rows, int64_t K, const float* norm, float eps, bool gated,
                          std::vector<float>& h);

// y [M, N] (row stride N) = or += the product of x's rows (prepared as prepare_rows says when norm or
// gated, else x [M, K] as it is) with the weight.  Run with or without the GIL; use OpenMP.
// portable: the portable loop instead of the vectorised code (the same bits).  With a sink
// (ArgmaxSink for M rows and omp_get_max_threads() threads) the outputs go to it instead (y unused,
// accumulate ignored).
void qmm_run(const float* x, int64_t m_rows, const QWeight& w, float* y, const float* norm, float eps, bool gated,
             bool accumulate, bool portable = false, ArgmaxSink* sink = nullptr);
void qmm_a8_run(const float* x, int64_t m_rows, const QWeight& w, float* y, const float* norm, float eps, bool gated,
                bool accumulate, bool portable = false, ArgmaxSink* sink = nullptr);

// Whether qmm_a8_run runs a vectorised version on this CPU (AVX-512 VNNI or AVX2; else its portable loop).
bool qmm_a8_vectorised();
// The version qmm_a8_run takes for a few rows: "avx512-vnni", "avx2" or "portable" (all the same bits).
std::string qmm_a8_isa();
// Lets the AVX-512 VNNI version (and AMX) run where the CPU has them, or not, for the whole process
// (tests and measurements turn it off to run the AVX2 version on such a CPU); returns qmm_a8_isa().
std::string set_qmm_a8_avx512(bool enabled);
// Whether qmm_a8_run takes its AMX version for calls of several rows (a CPU with AMX-INT8 whose
// kernel grants this process the tile registers, and not turned off): the same bits as the VNNI one.
bool qmm_a8_amx();
// Turns the AMX version on or off for the whole process (tests compare the two) and sets the fewest
// rows of a 4-bit / 8-bit weight that take it (the defaults: where it measured faster); returns qmm_a8_amx().
bool set_qmm_a8_amx(bool enabled, int64_t min_rows_4bit = 12, int64_t min_rows_8bit = 6);

}  // namespace dart_kernels
