// int8 codes times Q8 activations (the x_q8 attribute): x quantized per 32 values as llama.cpp
// does, AVX512-VNNI integer dot products. Defines TOKENSPEED_HAVE_Q8 where the build has them.

#ifndef TOKENSPEED_NATIVE_BLOCK_Q8_H_
#define TOKENSPEED_NATIVE_BLOCK_Q8_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#endif

#include "block_problem.h"
#include "block_tiles512.h"

namespace tokenspeed::blockmm {

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define TOKENSPEED_HAVE_Q8 1
// int8 codes times Q8 activations (x_q8: p.xq, p.dx, p.qsum) with the AVX512-VNNI dot product:
// vpdpbusd adds four u8 x s8 products into each int32 lane, 64 multiply-adds an instruction.
// A tile's K rows kk .. kk + 3 are 64 contiguous bytes; one vpermb turns them into 16 columns'
// (kk .. kk + 3) quads, and xor 0x80 makes the codes unsigned (c + 128), corrected by
// 128 * sum(xq) per 32 values. Each 32 values' exact int32 sum is scaled by dx in float32, then
// the weight block's scale folded as in Tile2 (Q4_1's min term on the float sum of x, exact).
// Up to 24 int32 / float accumulators: 4 rows a pass.
constexpr int kRowsQ8 = 4;

// NR rows x NT (1 or 2) column tiles from n0: a lone last tile takes NT = 1, so every column
// of a product gets the same integer arithmetic however the work was split.
template <int NR, int NT, bool MINS>
void tile_q8(const Problem& p, int64_t m0, int64_t n0, int64_t k0, int64_t k1, bool add,
             const char* pf) {
  const int64_t pf_lines = pf == nullptr ? 0 : (k1 - k0) * NT * kCols / 64;
  alignas(64) static const uint8_t kQuads[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21,
      37, 53, 6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58,
      11, 27, 43, 59, 12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
  const __m512i quads = _mm512_load_si512(kQuads);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t q8_groups = p.k / 32;
  __m512 acc[NR][NT];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  const int64_t span = std::min(p.block, k1 - k0);
  for (int64_t kb = k0; kb < k1; kb += span) {
    __m512 part[NR][NT];
    for (int r = 0; r < NR; ++r) {
      for (int t = 0; t < NT; ++t) part[r][t] = _mm512_setzero_ps();
    }
    for (int64_t j = kb; j < kb + span; j += 32) {
      __m512i isum[NR][NT];
      for (int r = 0; r < NR; ++r) {
        for (int t = 0; t < NT; ++t) isum[r][t] = _mm512_setzero_si512();
      }
      const int8_t* c[NT];
      for (int t = 0; t < NT; ++t) c[t] = p.tile_codes<int8_t>(j, n0 + t * kCols);
      for (int64_t kk = j; kk < j + 32; kk += 4) {
        if (kk - k0 < pf_lines) _mm_prefetch(pf + (kk - k0) * 16, _MM_HINT_T0);
        __m512i w[NT];
        for (int t = 0; t < NT; ++t) {
          w[t] = _mm512_xor_si512(
              _mm512_permutexvar_epi8(quads, _mm512_loadu_si512(c[t] + (kk - j) * kCols)), flip);
        }
        for (int r = 0; r < NR; ++r) {
          int32_t four;
          std::memcpy(&four, p.xq + (m0 + r) * p.k + kk, sizeof(four));
          const __m512i xv = _mm512_set1_epi32(four);
          for (int t = 0; t < NT; ++t) isum[r][t] = _mm512_dpbusd_epi32(isum[r][t], w[t], xv);
        }
      }
      for (int r = 0; r < NR; ++r) {
        const int64_t q = (m0 + r) * q8_groups + j / 32;
        const __m512i corr = _mm512_set1_epi32(128 * p.qsum[q]);
        const __m512 d = _mm512_set1_ps(p.dx[q]);
        for (int t = 0; t < NT; ++t) {
          part[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r][t], corr)), d,
                                       part[r][t]);
        }
      }
    }
    fold_block2<NR, NT>(p, kb / p.block, n0, part, acc);
    if constexpr (MINS) add_mins2<NR, NT>(p, kb / p.block, m0, n0, acc);
  }
  store2<NR, NT>(p, m0, n0, acc, add);
}

// Rows [m0, m1) in passes of kRowsQ8, then the 1-3 left over; the first pass prefetches.
template <int NT, bool MINS>
void row_passes_q8(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t k0, int64_t k1,
                   const char* pf) {
  const bool add = k0 > 0;
  for (; m0 + kRowsQ8 <= m1; m0 += kRowsQ8, pf = nullptr) {
    tile_q8<kRowsQ8, NT, MINS>(p, m0, n0, k0, k1, add, pf);
  }
  switch (m1 - m0) {
    case 3: tile_q8<3, NT, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 2: tile_q8<2, NT, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 1: tile_q8<1, NT, MINS>(p, m0, n0, k0, k1, add, pf); break;
    default: break;
  }
}

// x -> Q8 blocks of 32 values, as llama.cpp's quantize_row_q8: d = max|x| / 127, q =
// round-half-even(x * (1 / d)) (0 when d = 0); plus each block's sum of q. The same float32
// operations as pallas_kernels/block_matmul_cpu.quantize_q8_reference, so the same codes.
void quantize_q8(Problem& p, std::vector<int8_t>& xq, std::vector<float>& dx,
                 std::vector<int32_t>& qsum) {
  const int64_t groups = p.k / 32;
  xq.resize(p.m * p.k);
  dx.resize(p.m * groups);
  qsum.resize(p.m * groups);
  for (int64_t i = 0; i < p.m * groups; ++i) {
    const float* x = p.x + i * 32;  // rows are K = 32 * groups long: blocks run on
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int j = 0; j < 32; ++j) {
      const float q = std::clamp(std::nearbyint(x[j] * id), -127.0f, 127.0f);
      xq[i * 32 + j] = static_cast<int8_t>(q);
      sum += static_cast<int32_t>(q);
    }
    dx[i] = d;
    qsum[i] = sum;
  }
  p.xq = xq.data();
  p.dx = dx.data();
  p.qsum = qsum.data();
}
#endif

}  // namespace tokenspeed::blockmm

#endif  // TOKENSPEED_NATIVE_BLOCK_Q8_H_
