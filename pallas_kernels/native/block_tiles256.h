// One 16-column tile x up to kRows rows of x a pass (AVX2, or plain loops without it): the
// block matmul's path for every weight type, and the fallback of the 512-bit pairs.

#ifndef TOKENSPEED_NATIVE_BLOCK_TILES256_H_
#define TOKENSPEED_NATIVE_BLOCK_TILES256_H_

#include <algorithm>
#include <cstdint>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "block_problem.h"

namespace tokenspeed::blockmm {

// Rows [m0, m0 + NR) x columns [n0, n0 + kCols) (all in range). The block scale is factored
// out of the inner loop: y += scale * sum_k x[k] * code[k] (+ min * sum_k x[k]), so a weight
// costs one int8 -> float conversion per NR rows and no per-weight dequantization.
#ifdef __AVX2__
// 16 consecutive weights as two float vectors
inline void load16(const int8_t* c, __m256& w0, __m256& w1) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
inline void load16(const float* c, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(c);
  w1 = _mm256_loadu_ps(c + 8);
  // in registers: else the compiler folds the loads into every row's FMA, 6x the loads of a
  // K row, which made float32 weights 1.5x slower than bf16 ones (load-port bound)
  asm volatile("" : "+x"(w0), "+x"(w1));
}
inline void load16(const bf16* c, __m256& w0, __m256& w1) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
  w1 = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
}

template <typename T, int NR, bool MINS>
void tile(const Problem& p, int64_t m0, int64_t n0, int64_t k0, int64_t k1, bool add,
          const char* pf) {
  // `pf`: the weights this thread reads next (nullptr: none known), one cache line asked for
  // per K row here, so memory streams them in while this pass computes
  const int64_t pf_lines = pf == nullptr ? 0 : (k1 - k0) * kCols * sizeof(T) / 64;
  const float* xr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = p.x + (m0 + r) * p.k;
  __m256 acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t groups = p.k / p.block;
  const int64_t step = p.row_step();
  // [k0, k1) is whole groups, or a part of one (chunk_rows)
  const int64_t span = std::min(p.block, k1 - k0);
  for (int64_t kb = k0; kb < k1; kb += span) {
    const int64_t g = kb / p.block;
    __m256 part[NR][2];
    for (int r = 0; r < NR; ++r) part[r][0] = part[r][1] = _mm256_setzero_ps();
    const T* c = p.tile_codes<T>(kb, n0);
    for (int64_t kk = kb; kk < kb + span; ++kk, c += step) {
      if (kk - k0 < pf_lines) _mm_prefetch(pf + (kk - k0) * 64, _MM_HINT_T0);
      __m256 w0, w1;
      load16(c, w0, w1);
      for (int r = 0; r < NR; ++r) {
        const __m256 xv = _mm256_broadcast_ss(xr[r] + kk);
        part[r][0] = _mm256_fmadd_ps(xv, w0, part[r][0]);
        part[r][1] = _mm256_fmadd_ps(xv, w1, part[r][1]);
      }
    }
    const __m256 d0 = _mm256_loadu_ps(p.scales + g * p.n + n0);
    const __m256 d1 = _mm256_loadu_ps(p.scales + g * p.n + n0 + 8);
    for (int r = 0; r < NR; ++r) {
      acc[r][0] = _mm256_fmadd_ps(part[r][0], d0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(part[r][1], d1, acc[r][1]);
    }
    if constexpr (MINS) {  // whole groups only (chunk_rows)
      const __m256 n0v = _mm256_loadu_ps(p.mins + g * p.n + n0);
      const __m256 n1v = _mm256_loadu_ps(p.mins + g * p.n + n0 + 8);
      for (int r = 0; r < NR; ++r) {
        const __m256 s = _mm256_broadcast_ss(p.xsum + (m0 + r) * groups + g);
        acc[r][0] = _mm256_fmadd_ps(s, n0v, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(s, n1v, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    float* y = p.y + (m0 + r) * p.n + n0;
    if (add) {
      acc[r][0] = _mm256_add_ps(acc[r][0], _mm256_loadu_ps(y));
      acc[r][1] = _mm256_add_ps(acc[r][1], _mm256_loadu_ps(y + 8));
    }
    _mm256_storeu_ps(y, acc[r][0]);
    _mm256_storeu_ps(y + 8, acc[r][1]);
  }
}
#else
template <typename T, int NR, bool MINS>
void tile(const Problem& p, int64_t m0, int64_t n0, int64_t k0, int64_t k1, bool add,
          const char* /*pf*/) {
  const int64_t groups = p.k / p.block;
  float acc[NR][kCols] = {};
  const int64_t span = std::min(p.block, k1 - k0);
  for (int64_t kb = k0; kb < k1; kb += span) {
    const int64_t g = kb / p.block;
    float part[NR][kCols] = {};
    for (int64_t kk = kb; kk < kb + span; ++kk) {
      const T* c = p.tile_codes<T>(kk, n0);
      float w[kCols];
      for (int64_t j = 0; j < kCols; ++j) w[j] = to_float(c[j]);
      for (int r = 0; r < NR; ++r) {
        const float xv = p.x[(m0 + r) * p.k + kk];
#pragma omp simd
        for (int64_t j = 0; j < kCols; ++j) part[r][j] += xv * w[j];
      }
    }
    for (int r = 0; r < NR; ++r) {
      const float s = MINS ? p.xsum[(m0 + r) * groups + g] : 0.0f;
      for (int64_t j = 0; j < kCols; ++j) {
        acc[r][j] += part[r][j] * p.scales[g * p.n + n0 + j];
        if constexpr (MINS) acc[r][j] += s * p.mins[g * p.n + n0 + j];
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    float* y = p.y + (m0 + r) * p.n + n0;
    for (int64_t j = 0; j < kCols; ++j) y[j] = add ? y[j] + acc[r][j] : acc[r][j];
  }
}
#endif

// Rows [m0, m1) of x for columns [n0, n0 + kCols) and K rows [k0, k1): passes of kRows rows,
// then the 1-5 left over.
// The first pass prefetches `pf` (what comes after this chunk; the later passes find this
// chunk in L1).
template <typename T, bool MINS>
void row_passes(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t k0, int64_t k1,
                const char* pf) {
  const bool add = k0 > 0;
  for (; m0 + kRows <= m1; m0 += kRows, pf = nullptr) {
    tile<T, kRows, MINS>(p, m0, n0, k0, k1, add, pf);
  }
  switch (m1 - m0) {
    case 5: tile<T, 5, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 4: tile<T, 4, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 3: tile<T, 3, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 2: tile<T, 2, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 1: tile<T, 1, MINS>(p, m0, n0, k0, k1, add, pf); break;
    default: break;
  }
}

}  // namespace tokenspeed::blockmm

#endif  // TOKENSPEED_NATIVE_BLOCK_TILES256_H_
