// e^x for x <= 0, shared by dart_core's kernels (attention's softmax, the gated MLP's SiLU).
#pragma once

#include <cstdint>
#include <cstring>

namespace dart_kernels {

// e^x for x <= 0 (a score minus the row's maximum, or -|x| in SiLU), within about one unit in the last
// place; e^-87 for x below -87 (under 2^-125: invisible next to the maximum's 1).  Written out
// instead of calling the C library, whose expf may differ between builds and does not vectorise: the
// same operations on every build, and the compiler applies them to many values at once.
inline __attribute__((always_inline)) float exp_nonpositive(float x) {
  const float clamped = x > -87.0f ? x : -87.0f;
  const float y = clamped * 1.44269504088896341f;             // x / ln 2
  const int n = static_cast<int>(y - 0.5f);                   // y - 0.5 rounded toward 0: |x - n ln 2| <= ln 2 / 2
  const float fn = static_cast<float>(n);
  const float r = (clamped - fn * 0.693145751953125f) - fn * 1.428606765330187e-06f;  // Cody-Waite ln 2
  float p = 1.0f / 5040.0f;                                   // e^r by its Taylor series to r^7
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(n + 127) << 23;  // 2^n, n >= -126
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

}  // namespace dart_kernels
