// The qmm-a8 product for other C++ code of dart_core._kernels (the decoder layers in attention.cpp).
#pragma once

#include <cstdint>

namespace dart_kernels {

// A GGUF weight in qmm-a8's layout (see qmm_a8.cpp): codes [ceil(N/64), K/32, 1024 or 2048] uint8,
// scale and minimum [ceil(N/64), K/32, 64] float32 (minimum null for Q8_0).
struct A8Weight {
  const uint8_t* codes;
  const float* scale;
  const float* minimum;
  int64_t n, k;
  bool q8;
};

// y [M, N] (row stride N) = or += the product of x's rows (RMS-normalised by norm [K] and eps, or
// silu(gate) · up of x [M, 2K] when gated, else x [M, K]) with the weight.  Runs with or without the
// GIL; uses OpenMP.  portable: the portable loop instead of the VNNI code (the same bits).
void qmm_a8_run(const float* x, int64_t m_rows, const A8Weight& w, float* y, const float* norm, float eps, bool gated,
                bool accumulate, bool portable = false);

}  // namespace dart_kernels
