// dart_core's GGUF-weight products for other C++ code of dart_core._kernels (the decoder layers in
// attention.cpp): qmm (float32 activations, qmm.cpp) and qmm-a8 (8-bit activations, qmm_a8.cpp).
#pragma once

#include <cstdint>
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

// The rows a layer multiplies (qmm_a8.cpp), for either kernel: x itself without norm or gated, else
// x [M, K] RMS-normalised by norm [K] and eps, or silu(gate) · up of x [M, 2K] when gated, written to
// h (resized to [M, K]) and returned.
const float* prepare_rows(const float* x, int64_t m_rows, int64_t K, const float* norm, float eps, bool gated,
                          std::vector<float>& h);

// y [M, N] (row stride N) = or += the product of x's rows (prepared as prepare_rows says when norm or
// gated, else x [M, K] as it is) with the weight.  Run with or without the GIL; use OpenMP.
// portable: the portable loop instead of the vectorised code (the same bits).
void qmm_run(const float* x, int64_t m_rows, const QWeight& w, float* y, const float* norm, float eps, bool gated,
             bool accumulate, bool portable = false);
void qmm_a8_run(const float* x, int64_t m_rows, const QWeight& w, float* y, const float* norm, float eps, bool gated,
                bool accumulate, bool portable = false);

// Whether qmm_a8_run runs its AVX-512 VNNI version on this CPU (else its portable loop).
bool qmm_a8_vectorised();

}  // namespace dart_kernels
