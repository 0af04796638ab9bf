// Row-exact matrix product with a GGUF 4-bit or 8-bit weight and 8-bit activations, float32 results
// (the arithmetic llama.cpp's CPU back end uses for these block types: a Q4_0 / Q4_1 / Q8_0 weight
// times activations quantised to 8 bits per block of 32, integer dot products within a block).
//
// Each row of x is quantised per group g of 32 inputs: a = max |x| over the group, dx = a / 127,
// qx = round-to-nearest-even(x · (1 / dx)) (0 where a = 0), an int8 in -127..127, and
// sx = dx · Σ qx.  For output n the group's integer dot product is P = Σ_k qw[n, k] · qx[k], with
// qw the weight's codes: 0..15 for Q4_0 / Q4_1, q + 128 in 0..255 for Q8_0's int8 q (the hardware's
// unsigned-by-signed product), whose offset is taken back exactly: P - 128 · Σ qx.  The group adds
// fma(d · dx, float(P), total), then for 4-bit weights fma(mn, sx, total), where the weight is
// w = qw · d + mn (Q4_1 mn = m, Q4_0 mn = -8d).  Integer sums are exact and the float32 operations
// run in a fixed order from +0 over the groups, so a row's result depends only on its own x row: the
// same bits however many rows share the call, and in the portable loop.  A draft tree verified in
// one call then equals one-token steps (the property dart-serve's greedy losslessness rests on).
//
// Weight layout (built by dart_core.quant.qmm_a8_weight): output columns in blocks of 64 (N padded
// up to a multiple of 64); for block b and group g, 1024 bytes (4-bit) or 2048 bytes (8-bit) in
// the order [16-column slice c (4)][input quad j][column l within the slice (16)][t (4)], the code
// of input k = 32g + 4j + t of column 64b + 16c + l: 4-bit codes hold quads j and j + 4 in one byte
// (j < 4; low nibble quad j), 8-bit codes one quad per byte (j < 8).  Each 64-byte row of that order
// is one vector of 16 columns × 4 inputs, the shape of the AVX-512 VNNI dot product.  Scales and
// minimums float32 [NB, K/32, 64], as the float32-activation kernel (qmm.cpp).
//
// On a CPU with AMX-INT8, calls of many rows sum each group in AMX tiles instead (product_amx):
// the same integer sums, scaled in the same order, so the same bits.  On a CPU with AVX2 but no
// AVX-512 VNNI (an AMD EPYC before Zen 4, say) the AVX2 loop (direct_avx2) forms the same integer
// sums with 8-bit multiply-adds (llama.cpp's AVX2 pattern) and scales them in the same order.
//
// Around a Llama decoder layer's products the same call can first RMS-normalise its rows or take
// silu(gate) · up of gate/up rows side by side, and add its product to the output (a residual
// connection) instead of writing it: see prepare() and dart_core.decoder.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "exp_nonpositive.h"
#include "qmm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // _mm512_undefined_* inside GCC's own intrinsics
#define DART_A8_VNNI 1
#define DART_A8_AVX2 __attribute__((target("avx2,fma")))
#define DART_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))
#if !defined(__clang__) && __GNUC__ >= 11
#define DART_A8_AMX 1
#define DART_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vnni,fma")))
#endif
#endif

namespace {

using dart_kernels::kBlockN;
using dart_kernels::kGroup;

using Weight = dart_kernels::QWeight;

// Bytes of one group of 32 inputs of a block of 64 output columns (the layout above).
inline int64_t group_bytes(const Weight& w) { return w.q8 ? 2048 : 1024; }

// The activations quantised per row and group of 32.
struct Quantised {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> dx;      // [M, G] the group's scale
  std::vector<float> sx;      // [M, G] dx · Σ qx (the minimum's factor)
  std::vector<int32_t> qsum;  // [M, G] Σ qx
};

// One group's scale and inverse, as both versions compute them.
inline void group_scale(float amax, float& d, float& inv) {
  d = amax / 127.0f;
  inv = d != 0.0f ? 1.0f / d : 0.0f;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DART_A8_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DART_A8_CLONES
#endif

// What a layer multiplies, from the rows it is given (one function for both versions of the product,
// its element-wise loops vectorised by the compiler in the same order on every build):
// - norm: RMS normalisation, h = norm · (x · r) with r = 1 / sqrt(Σ x² / K + eps), the sum of
//   squares in 16 fixed lanes added pairwise (transformers' LlamaRMSNorm, summed in another order);
// - gated: x is [M, 2K], h = silu(x[:, :K]) · x[:, K:] with silu(g) = g · sigmoid(g), sigmoid from
//   e^-|g| (the gated MLP's SiLU-and-multiply).
DART_A8_CLONES
void prepare(const float* x, int64_t m_rows, int64_t K, const float* norm, float eps, bool gated, float* h) {
  for (int64_t r = 0; r < m_rows; ++r) {
    float* out = h + r * K;
    if (gated) {
      const float* g = x + r * 2 * K;
      const float* u = g + K;
      for (int64_t d = 0; d < K; ++d) {
        const float a = g[d] < 0.0f ? g[d] : -g[d];  // -|g|
        const float e = dart_kernels::exp_nonpositive(a);
        const float sig = g[d] >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
        out[d] = (g[d] * sig) * u[d];
      }
      continue;
    }
    const float* row = x + r * K;
    float acc[16] = {};
    for (int64_t d = 0; d < K; d += 16)  // K is a multiple of 32
      for (int j = 0; j < 16; ++j) acc[j] += row[d + j] * row[d + j];
    float s8[8], s4[4];
    for (int j = 0; j < 8; ++j) s8[j] = acc[j] + acc[j + 8];
    for (int j = 0; j < 4; ++j) s4[j] = s8[j] + s8[j + 4];
    const float sum = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(K) + eps);
    for (int64_t d = 0; d < K; ++d) out[d] = norm[d] * (row[d] * scale);
  }
}

void quantise_portable(const float* x, int64_t m_rows, int64_t K, Quantised& out) {
  const int64_t G = K / kGroup;
  for (int64_t r = 0; r < m_rows; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + r * K + g * kGroup;
      float amax = 0.0f;
      for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xg[i]));
      float d, inv;
      group_scale(amax, d, inv);
      int32_t sum = 0;
      for (int i = 0; i < kGroup; ++i) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xg[i] * inv));  // default mode: nearest even
        out.q[r * K + g * kGroup + i] = static_cast<int8_t>(v);
        sum += v;
      }
      out.dx[r * G + g] = d;
      out.qsum[r * G + g] = sum;
      out.sx[r * G + g] = d * static_cast<float>(sum);
    }
}

inline int code_at(const Weight& w, const uint8_t* group, int c, int64_t k_in_group) {
  const int j = static_cast<int>(k_in_group / 4), t = static_cast<int>(k_in_group % 4);
  const int slice = c / 16, lane = c % 16;
  if (w.q8) return group[((slice * 8 + j) * 16 + lane) * 4 + t];
  const uint8_t byte = group[((slice * 4 + (j & 3)) * 16 + lane) * 4 + t];
  return j < 4 ? (byte & 15) : (byte >> 4);
}

void qmm_a8_portable(const Quantised& xq, int64_t m_rows, const Weight& w, float* y, int64_t ldy, bool accumulate,
                     dart_kernels::ArgmaxSink* sink) {
  const int64_t G = w.k / kGroup;
  if (sink) accumulate = false;
#pragma omp parallel for schedule(guided) if (m_rows * w.n * w.k >= (1 << 16))
  for (int64_t b = 0; b < w.blocks(); ++b) {
    const int cols = static_cast<int>(std::min<int64_t>(kBlockN, w.n - b * kBlockN));
    const int t = omp_get_thread_num();
    float* yb = sink ? sink->rows(t) : y + b * kBlockN;  // the block's outputs, row stride ldb
    const int64_t ldb = sink ? dart_kernels::ArgmaxSink::kStride : ldy;
    for (int64_t r = 0; r < m_rows; ++r)
      for (int c = 0; c < cols; ++c) {
        float total = 0.0f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* group = w.codes + (b * G + g) * group_bytes(w);
          int32_t p = 0;
          for (int64_t i = 0; i < kGroup; ++i) p += code_at(w, group, c, i) * xq.q[r * w.k + g * kGroup + i];
          if (w.q8) p -= 128 * xq.qsum[r * G + g];
          const int64_t at = (b * G + g) * kBlockN + c;
          total = std::fma(w.scale[at] * xq.dx[r * G + g], static_cast<float>(p), total);
          if (!w.q8) total = std::fma(w.minimum[at], xq.sx[r * G + g], total);
        }
        float* out = yb + r * ldb + c;
        *out = accumulate ? *out + total : total;
      }
    if (sink) sink->take(t, b, cols);
  }
}

#ifdef DART_A8_VNNI

DART_VNNI void quantise_avx512(const float* x, int64_t m_rows, int64_t K, Quantised& out) {
  const int64_t G = K / kGroup;
  for (int64_t r = 0; r < m_rows; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + r * K + g * kGroup;
      const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      float d, inv;
      group_scale(amax, d, inv);
      const __m512 vinv = _mm512_set1_ps(inv);
      const __m512i qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i qb = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      int8_t* dst = out.q.data() + r * K + g * kGroup;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
      out.dx[r * G + g] = d;
      out.qsum[r * G + g] = sum;
      out.sx[r * G + g] = d * static_cast<float>(sum);
    }
}

using dart_kernels::store_cols;

inline int32_t quad(const int8_t* q, int64_t at) {  // four int8 inputs as one 32-bit lane
  int32_t v;
  __builtin_memcpy(&v, q + at, 4);
  return v;
}

constexpr int64_t kPrefetchGroups = 2;  // how many groups of 32 inputs ahead the codes are prefetched

// The codes of a group ahead (gb bytes from p) into the first-level cache.
inline void prefetch_group(const uint8_t* p, int64_t gb) {
  for (int64_t line = 0; line < gb / 64; ++line) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * line), _MM_HINT_T0);
}

// One group's share of 16 outputs of one row (row_scale: the row's factors for group rg = row · G + g):
// total + (d · dx) · P, then + mn · sx for a 4-bit weight, with P the group's integer dot products (less Q8_0's offset, 128 · Σ qx).  Every version
// of the product scales in this one order, which is why they give the same bits.
struct RowScale {
  __m512 dx;    // the row's group scale
  __m512 sx;    // dx · Σ qx (4-bit weights' minimum factor)
  __m512i off;  // 128 · Σ qx (Q8_0's code offset)
};

template <bool kQ8>
DART_VNNI inline __attribute__((always_inline)) RowScale row_scale(const Quantised& xq, int64_t rg) {
  const __m512 dx = _mm512_set1_ps(xq.dx[rg]);
  return {dx, kQ8 ? dx : _mm512_set1_ps(xq.sx[rg]), _mm512_set1_epi32(128 * xq.qsum[rg])};
}

template <bool kQ8>
DART_VNNI inline __attribute__((always_inline)) __m512 scale_group(__m512 total, __m512i acc, __m512 scale,
                                                                   __m512 minimum, const RowScale& rs) {
  const __m512i p = kQ8 ? _mm512_sub_epi32(acc, rs.off) : acc;
  total = _mm512_fmadd_ps(_mm512_mul_ps(scale, rs.dx), _mm512_cvtepi32_ps(p), total);
  return kQ8 ? total : _mm512_fmadd_ps(minimum, rs.sx, total);
}

// R rows of the quantised x against weight block b: for each group, the integer dot products of
// all 64 columns (each row's input quads broadcast once), then the group's scales.  yb: the block's
// outputs (row r0 + r at yb + (r0 + r) · ldy).
template <bool kQ8, int R>
DART_VNNI void direct(const Quantised& xq, int64_t r0, const Weight& w, int64_t b, float* yb, int64_t ldy, int cols,
                      bool accumulate) {
  const int64_t K = w.k, G = K / kGroup;
  const int64_t gb = group_bytes(w);
  __m512 total[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) total[r][c] = _mm512_setzero_ps();
  const uint8_t* codes = w.codes + b * G * gb;
  const float* sc = w.scale + b * G * kBlockN;
  const float* mins = kQ8 ? nullptr : w.minimum + b * G * kBlockN;
  const int8_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = xq.q.data() + (r0 + r) * K;
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* cg = codes + g * gb;
    if (g + kPrefetchGroups < G) prefetch_group(cg + kPrefetchGroups * gb, gb);
    const int64_t k0 = g * kGroup;
    __m512i acc[R][4];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_si512();
    if (kQ8) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m512i xj[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) xj[r] = _mm512_set1_epi32(quad(xr[r], k0 + 4 * j));
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m512i wv = _mm512_loadu_si512(cg + (c * 8 + j) * 64);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv, xj[r]);
        }
      }
    } else {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i xlo[R], xhi[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          xlo[r] = _mm512_set1_epi32(quad(xr[r], k0 + 4 * j));
          xhi[r] = _mm512_set1_epi32(quad(xr[r], k0 + 16 + 4 * j));
        }
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const __m512i wv = _mm512_loadu_si512(cg + (c * 4 + j) * 64);
          const __m512i lo = _mm512_and_si512(wv, low);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], lo, xlo[r]);
            acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], hi, xhi[r]);
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const RowScale rs = row_scale<kQ8>(xq, (r0 + r) * G + g);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const int64_t at = g * kBlockN + 16 * c;
        total[r][c] = scale_group<kQ8>(total[r][c], acc[r][c], _mm512_loadu_ps(sc + at),
                                       kQ8 ? _mm512_setzero_ps() : _mm512_loadu_ps(mins + at), rs);
      }
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) store_cols(yb + (r0 + r) * ldy, total[r][c], c, cols, accumulate);
}

#ifdef DART_A8_AMX
// The same product with Intel AMX (Sapphire Rapids and later) for calls of many rows: each group's
// integer dot products of up to 16 rows against the block's 64 columns are four tile products
// (TDPBSUD: signed 8-bit activations by unsigned codes, exact int32 sums, the same P as the VNNI
// loop's), stored and then scaled in the VNNI loop's float32 order, so every row keeps its bits.
// The Q8_0 layout's 16-column slice is already a B tile (8 rows of 4 inputs × 16 columns); a 4-bit
// slice is unpacked to one first (low nibbles: its rows 0-3, high: rows 4-7).  A verification of a
// draft tree then pays per extra row a tile product and the float32 scaling, not the 32 VNNI dot
// products per group that direct() issues for each row.

constexpr int kAmxRows = 16;  // rows per tile

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Per-thread buffers of one AMX block product (64-byte aligned, cache-resident).
struct alignas(64) AmxScratch {
  int32_t p[kAmxRows * kBlockN];  // the group's integer dot products, [row][64 columns]
  float total[kAmxRows * kBlockN];  // the running float32 sums, [row][64 columns]
  uint8_t unpacked[4 * 8 * 64];   // a 4-bit group's B tiles, [slice (4)][8 rows][64 bytes]
};

// Tiles 0-3: the four slices' products (m rows × 16 int32); 4: the activations (m rows × 32 bytes);
// 5, 6: B tiles (8 rows × 64 bytes), taken in turn.
DART_AMX void configure_tiles(int m) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(m);
    cfg.colsb[t] = 64;
  }
  cfg.rows[4] = static_cast<uint8_t>(m);
  cfg.colsb[4] = kGroup;
  for (int t = 5; t < 7; ++t) {
    cfg.rows[t] = kGroup / 4;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Rows r0 .. r0 + m - 1 (m <= 16, the tiles configured for m) of the quantised x against weight
// block b, as direct() computes them.
template <bool kQ8>
DART_AMX void direct_amx(const Quantised& xq, int64_t r0, int m, const Weight& w, int64_t b, float* yb, int64_t ldy,
                         int cols, bool accumulate, AmxScratch& s) {
  const int64_t K = w.k, G = K / kGroup;
  const int64_t gb = group_bytes(w);
  const uint8_t* codes = w.codes + b * G * gb;
  const float* sc = w.scale + b * G * kBlockN;
  const float* mins = kQ8 ? nullptr : w.minimum + b * G * kBlockN;
  const int8_t* x0 = xq.q.data() + r0 * K;
  const __m512 zero = _mm512_setzero_ps();
  for (int r = 0; r < m; ++r)
    for (int c = 0; c < 4; ++c) _mm512_store_ps(s.total + r * kBlockN + 16 * c, zero);
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* cg = codes + g * gb;
    if (g + kPrefetchGroups < G) prefetch_group(cg + kPrefetchGroups * gb, gb);
    const uint8_t* bt = cg;  // slice c's B tile at bt + 512 c
    if (!kQ8) {
      for (int c = 0; c < 4; ++c)
        for (int j = 0; j < 4; ++j) {
          const __m512i wv = _mm512_loadu_si512(cg + (c * 4 + j) * 64);
          _mm512_store_si512(s.unpacked + c * 512 + j * 64, _mm512_and_si512(wv, low));
          _mm512_store_si512(s.unpacked + c * 512 + (j + 4) * 64, _mm512_and_si512(_mm512_srli_epi16(wv, 4), low));
        }
      bt = s.unpacked;
    }
    _tile_loadd(4, x0 + g * kGroup, K);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(5, bt, 64);
    _tile_loadd(6, bt + 512, 64);
    _tile_dpbsud(0, 4, 5);
    _tile_dpbsud(1, 4, 6);
    _tile_loadd(5, bt + 1024, 64);
    _tile_loadd(6, bt + 1536, 64);
    _tile_dpbsud(2, 4, 5);
    _tile_dpbsud(3, 4, 6);
    _tile_stored(0, s.p, kBlockN * 4);
    _tile_stored(1, s.p + 16, kBlockN * 4);
    _tile_stored(2, s.p + 32, kBlockN * 4);
    _tile_stored(3, s.p + 48, kBlockN * 4);
    __m512 scv[4], mnv[4];
    for (int c = 0; c < 4; ++c) {
      scv[c] = _mm512_loadu_ps(sc + g * kBlockN + 16 * c);
      mnv[c] = kQ8 ? zero : _mm512_loadu_ps(mins + g * kBlockN + 16 * c);
    }
    for (int r = 0; r < m; ++r) {
      const RowScale rs = row_scale<kQ8>(xq, (r0 + r) * G + g);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        float* tp = s.total + r * kBlockN + 16 * c;
        _mm512_store_ps(tp, scale_group<kQ8>(_mm512_load_ps(tp), _mm512_load_si512(s.p + r * kBlockN + 16 * c),
                                             scv[c], mnv[c], rs));
      }
    }
  }
  for (int r = 0; r < m; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      store_cols(yb + (r0 + r) * ldy, _mm512_load_ps(s.total + r * kBlockN + 16 * c), c, cols, accumulate);
}

template <bool kQ8>
DART_AMX void product_amx(const Quantised& xq, int64_t m_rows, const Weight& w, float* y, int64_t ldy, bool accumulate,
                         dart_kernels::ArgmaxSink* sink) {
  if (sink) accumulate = false;
  // the schedule as over_blocks' (guided: see there); each thread configures its tiles for the
  // chunk size it meets and releases them at the end
#pragma omp parallel if (w.blocks() > 1)
  {
    AmxScratch scratch;
    int configured = 0;
#pragma omp for schedule(guided)
    for (int64_t b = 0; b < w.blocks(); ++b) {
      const int cols = static_cast<int>(std::min<int64_t>(kBlockN, w.n - b * kBlockN));
      const int t = omp_get_thread_num();
      float* yb = sink ? sink->rows(t) : y + b * kBlockN;
      const int64_t ldb = sink ? dart_kernels::ArgmaxSink::kStride : ldy;
      for (int64_t r0 = 0; r0 < m_rows; r0 += kAmxRows) {
        const int m = static_cast<int>(std::min<int64_t>(kAmxRows, m_rows - r0));
        if (m != configured) {
          configure_tiles(m);
          configured = m;
        }
        direct_amx<kQ8>(xq, r0, m, w, b, yb, ldb, cols, accumulate, scratch);
      }
      if (sink) sink->take(t, b, cols);
    }
    if (configured) _tile_release();
  }
}

// Whether this CPU has AMX-INT8 and Linux lets this process use its tile registers (asked once:
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
bool amx_usable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return false;  // AMX-TILE, AMX-INT8
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

// Whether calls of enough rows take the AMX product (set_qmm_a8_amx; on by default where usable), and
// how many: below about 12 rows of a 4-bit weight and 6 of an 8-bit one the tiles' fixed cost per
// group (a 4-bit slice's unpacking, the tile loads and stores) outweighs the dot products they save
// (bench/results/xeon_amx/kernel_amx.txt).
std::atomic<bool> amx_enabled{true};
std::atomic<int64_t> amx_min_rows_4bit{12}, amx_min_rows_8bit{6};
#endif

// The blocks of 64 output columns of a product shared among the threads, each block's rows in passes
// of four that share each load of its codes (fewer in the last pass): pass(r0, rows, b, yb, ldb,
// cols) with rows a std::integral_constant<int, R> (R <= 4), yb the block's outputs, row stride ldb.
// guided, not static: each thread still streams contiguous runs of blocks (dynamic's one-block
// turns broke the weights' sequential stream and measured slower: bench/results/served_schedule), and when another process
// takes a core mid-kernel (a served replica shares its cores) the other thread takes over the tail
// of the preempted one's share instead of waiting for it at the barrier.  A thread's blocks still
// come in increasing order, as ArgmaxSink needs.
template <typename Pass>
void over_blocks(int64_t m_rows, const Weight& w, float* y, int64_t ldy, dart_kernels::ArgmaxSink* sink,
                 const Pass& pass) {
#pragma omp parallel for schedule(guided) if (w.blocks() > 1)
  for (int64_t b = 0; b < w.blocks(); ++b) {
    const int cols = static_cast<int>(std::min<int64_t>(kBlockN, w.n - b * kBlockN));
    const int t = omp_get_thread_num();
    float* yb = sink ? sink->rows(t) : y + b * kBlockN;
    const int64_t ldb = sink ? dart_kernels::ArgmaxSink::kStride : ldy;
    for (int64_t r0 = 0; r0 < m_rows; r0 += 4) {
      switch (std::min<int64_t>(4, m_rows - r0)) {
        case 4: pass(r0, std::integral_constant<int, 4>{}, b, yb, ldb, cols); break;
        case 3: pass(r0, std::integral_constant<int, 3>{}, b, yb, ldb, cols); break;
        case 2: pass(r0, std::integral_constant<int, 2>{}, b, yb, ldb, cols); break;
        default: pass(r0, std::integral_constant<int, 1>{}, b, yb, ldb, cols); break;
      }
    }
    if (sink) sink->take(t, b, cols);
  }
}

// ---- The AVX2 version (no AVX-512): the same quantisation, integer sums and float32 order ----

DART_A8_AVX2 void quantise_avx2(const float* x, int64_t m_rows, int64_t K, Quantised& out) {
  const int64_t G = K / kGroup;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < m_rows; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + r * K + g * kGroup;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xg + 8 * i);
      const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                     _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      float d, inv;
      group_scale(_mm_cvtss_f32(h), d, inv);
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i q[4];  // round to nearest even (the default MXCSR mode, as nearbyint in the portable loop)
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vinv));
      // int32 -> int8 (every value is within -127..127): the packs interleave 128-bit lanes, the
      // permutation puts the four-value runs back in order
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + r * K + g * kGroup), bytes);
      const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      const int32_t sum = _mm_cvtsi128_si32(s4);
      out.dx[r * G + g] = d;
      out.qsum[r * G + g] = sum;
      out.sx[r * G + g] = d * static_cast<float>(sum);
    }
}

// Eight columns of a block's outputs (columns 8c .. 8c + 7), written to y or added to it; only the
// block's first cols columns exist.
DART_A8_AVX2 inline void store_cols8(float* y, __m256 v, int c, int cols, bool accumulate) {
  const int left = cols - 8 * c;
  if (left <= 0) return;
  if (left >= 8) {
    _mm256_storeu_ps(y + 8 * c, accumulate ? _mm256_add_ps(_mm256_loadu_ps(y + 8 * c), v) : v);
    return;
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, v);
  for (int i = 0; i < left; ++i) y[8 * c + i] = accumulate ? y[8 * c + i] + part[i] : part[i];
}

// R rows of the quantised x against weight block b, as direct() computes them, with 256-bit
// vectors: each 64-byte row of the layout is two vectors of 8 columns × 4 inputs.  A column's
// integer dot product P: _mm256_maddubs_epi16 multiplies unsigned bytes by signed ones and adds
// neighbouring pairs into int16, _mm256_madd_epi16 by ones adds those pairs into the int32 lane of
// the column's four inputs.  No int16 sum can saturate: a 4-bit group adds its eight multiply-adds
// (16 products of at most 15 · 127 each, 30,480 in all) before widening; a Q8_0 code is taken as
// its signed value q (code - 128) and multiplies-adds |q| by qx with q's sign (at most 2 · 128 · 127
// per pair), widening every step, which gives Σ q · qx, the VNNI loop's P after its offset is taken
// back.  The float32 scaling is scale_group's: total = fma(d · dx, P, total), then fma(mn, sx, total).
template <bool kQ8, int R>
DART_A8_AVX2 void direct_avx2(const Quantised& xq, int64_t r0, const Weight& w, int64_t b, float* yb, int64_t ldy,
                              int cols, bool accumulate) {
  const int64_t K = w.k, G = K / kGroup;
  const int64_t gb = group_bytes(w);
  alignas(32) float total[R][kBlockN];  // the running float32 sums (cache-resident)
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kBlockN; c += 8) _mm256_store_ps(total[r] + c, _mm256_setzero_ps());
  // each row's eight input quads of the group, broadcast once per group and read from here as
  // memory operands (held in registers across the slices they crowded out the accumulators)
  alignas(32) __m256i xv[R][8];
  const uint8_t* codes = w.codes + b * G * gb;
  const float* sc = w.scale + b * G * kBlockN;
  const float* mins = kQ8 ? nullptr : w.minimum + b * G * kBlockN;
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(-128);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* cg = codes + g * gb;
    if (g + kPrefetchGroups < G) prefetch_group(cg + kPrefetchGroups * gb, gb);
    __m256 dx[R], sx[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = xq.q.data() + (r0 + r) * K + g * kGroup;
      for (int j = 0; j < 8; ++j) _mm256_store_si256(&xv[r][j], _mm256_set1_epi32(quad(xg, 4 * j)));
      dx[r] = _mm256_set1_ps(xq.dx[(r0 + r) * G + g]);
      sx[r] = _mm256_set1_ps(xq.sx[(r0 + r) * G + g]);
    }
#pragma GCC unroll 1
    for (int s = 0; s < 4; ++s) {  // the layout's 16-column slices
      __m256i p[R][2];
      if (kQ8) {
        for (int r = 0; r < R; ++r) p[r][0] = p[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const uint8_t* at = cg + (s * 8 + j) * 64;
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const __m256i q = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h)), flip);
            const __m256i aq = _mm256_abs_epi8(q);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              const __m256i xs = _mm256_sign_epi8(_mm256_load_si256(&xv[r][j]), q);
              p[r][h] = _mm256_add_epi32(p[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aq, xs), ones));
            }
          }
        }
      } else {
        __m256i s16[R][2];
        for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) {
          const uint8_t* at = cg + (s * 4 + j) * 64;
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h));
            const __m256i lo = _mm256_and_si256(wv, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_maddubs_epi16(lo, _mm256_load_si256(&xv[r][j])));
              s16[r][h] = _mm256_add_epi16(s16[r][h], _mm256_maddubs_epi16(hi, _mm256_load_si256(&xv[r][4 + j])));
            }
          }
        }
        for (int r = 0; r < R; ++r)
          for (int h = 0; h < 2; ++h) p[r][h] = _mm256_madd_epi16(s16[r][h], ones);
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const int64_t at = g * kBlockN + 16 * s + 8 * h;
        const __m256 scale = _mm256_loadu_ps(sc + at);
        const __m256 minimum = kQ8 ? _mm256_setzero_ps() : _mm256_loadu_ps(mins + at);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          float* tp = total[r] + 16 * s + 8 * h;
          __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(scale, dx[r]), _mm256_cvtepi32_ps(p[r][h]), _mm256_load_ps(tp));
          if (!kQ8) t = _mm256_fmadd_ps(minimum, sx[r], t);
          _mm256_store_ps(tp, t);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 8; ++c) store_cols8(yb + (r0 + r) * ldy, _mm256_load_ps(total[r] + 8 * c), c, cols, accumulate);
}

// The product on the VNNI loop (direct) or the AVX2 one (direct_avx2), whichever this CPU runs.
template <bool kQ8, bool kAvx2>
void product_vectorised(const Quantised& xq, int64_t m_rows, const Weight& w, float* y, int64_t ldy, bool accumulate,
                       dart_kernels::ArgmaxSink* sink) {
  if (sink) accumulate = false;
  over_blocks(m_rows, w, y, ldy, sink, [&](int64_t r0, auto rows, int64_t b, float* yb, int64_t ldb, int cols) {
    if constexpr (kAvx2) direct_avx2<kQ8, decltype(rows)::value>(xq, r0, w, b, yb, ldb, cols, accumulate);
    else direct<kQ8, decltype(rows)::value>(xq, r0, w, b, yb, ldb, cols, accumulate);
  });
}

bool cpu_has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// Whether the AVX-512 VNNI loop (and AMX) may run where the CPU has it (set_qmm_a8_avx512; tests and
// measurements turn it off to run the AVX2 loop on such a CPU).
std::atomic<bool> avx512_enabled{true};

bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
}

enum class Loop { kVnni, kAvx2, kPortable };

// The loop a call takes on this CPU (the VNNI one only while set_qmm_a8_avx512 allows it).
Loop vectorised_loop() {
  if (cpu_has_vnni() && avx512_enabled.load(std::memory_order_relaxed)) return Loop::kVnni;
  return cpu_has_avx2() ? Loop::kAvx2 : Loop::kPortable;
}
#endif

}  // namespace

const float* dart_kernels::prepare_rows(const float* x, int64_t m_rows, int64_t K, const float* norm, float eps,
                                        bool gated, std::vector<float>& h) {
  if (!norm && !gated) return x;
  h.resize(static_cast<size_t>(m_rows * K));
  prepare(x, m_rows, K, norm, eps, gated, h.data());
  return h.data();
}

void dart_kernels::qmm_a8_run(const float* x, int64_t m_rows, const QWeight& w, float* y, const float* norm,
                              float eps, bool gated, bool accumulate, bool portable, ArgmaxSink* sink) {
  const int64_t K = w.k, G = K / kGroup, n = w.n;
  std::vector<float> h;
  x = dart_kernels::prepare_rows(x, m_rows, K, norm, eps, gated, h);
  Quantised xq{std::vector<int8_t>(static_cast<size_t>(m_rows * K)), std::vector<float>(static_cast<size_t>(m_rows * G)),
               std::vector<float>(static_cast<size_t>(m_rows * G)), std::vector<int32_t>(static_cast<size_t>(m_rows * G))};
#ifdef DART_A8_VNNI
  const Loop loop = portable ? Loop::kPortable : vectorised_loop();
  if (loop == Loop::kVnni) {
    quantise_avx512(x, m_rows, K, xq);
#ifdef DART_A8_AMX
    const int64_t min_rows = (w.q8 ? amx_min_rows_8bit : amx_min_rows_4bit).load(std::memory_order_relaxed);
    if (m_rows >= min_rows && amx_enabled.load(std::memory_order_relaxed) && amx_usable()) {
      if (w.q8) product_amx<true>(xq, m_rows, w, y, n, accumulate, sink);
      else product_amx<false>(xq, m_rows, w, y, n, accumulate, sink);
      return;
    }
#endif
    if (w.q8) product_vectorised<true, false>(xq, m_rows, w, y, n, accumulate, sink);
    else product_vectorised<false, false>(xq, m_rows, w, y, n, accumulate, sink);
    return;
  }
  if (loop == Loop::kAvx2) {
    quantise_avx2(x, m_rows, K, xq);
    if (w.q8) product_vectorised<true, true>(xq, m_rows, w, y, n, accumulate, sink);
    else product_vectorised<false, true>(xq, m_rows, w, y, n, accumulate, sink);
    return;
  }
#endif
  quantise_portable(x, m_rows, K, xq);
  qmm_a8_portable(xq, m_rows, w, y, n, accumulate, sink);
}

#ifdef DART_A8_VNNI
bool dart_kernels::qmm_a8_vectorised() { return cpu_has_vnni() || cpu_has_avx2(); }

std::string dart_kernels::qmm_a8_isa() {
  switch (vectorised_loop()) {
    case Loop::kVnni: return "avx512-vnni";
    case Loop::kAvx2: return "avx2";
    default: return "portable";
  }
}
#else
bool dart_kernels::qmm_a8_vectorised() { return false; }

std::string dart_kernels::qmm_a8_isa() { return "portable"; }
#endif

std::string dart_kernels::set_qmm_a8_avx512(bool enabled) {
#ifdef DART_A8_VNNI
  avx512_enabled.store(enabled);
#else
  (void)enabled;
#endif
  return qmm_a8_isa();
}

#ifdef DART_A8_AMX
bool dart_kernels::qmm_a8_amx() { return vectorised_loop() == Loop::kVnni && amx_usable() && amx_enabled.load(); }

bool dart_kernels::set_qmm_a8_amx(bool enabled, int64_t min_rows_4bit, int64_t min_rows_8bit) {
  amx_enabled.store(enabled);
  amx_min_rows_4bit.store(std::max<int64_t>(1, min_rows_4bit));
  amx_min_rows_8bit.store(std::max<int64_t>(1, min_rows_8bit));
  return qmm_a8_amx();
}
#else
bool dart_kernels::qmm_a8_amx() { return false; }

bool dart_kernels::set_qmm_a8_amx(bool, int64_t, int64_t) { return false; }
#endif
