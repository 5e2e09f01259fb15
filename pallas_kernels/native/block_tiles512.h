// Two 16-column tiles at a time in 512-bit registers (AVX-512): Tile2<float>, Tile2<bf16>
// (AVX512-BF16 dot products on bf16-exact x) and Tile2<int8_t> (block codes), and their row
// passes. Empty without AVX-512.

#ifndef TOKENSPEED_NATIVE_BLOCK_TILES512_H_
#define TOKENSPEED_NATIVE_BLOCK_TILES512_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "block_problem.h"

namespace tokenspeed::blockmm {

#ifdef __AVX512F__
// Two column tiles [n0, n0 + 2 kCols) (tiles n0 / kCols and the next) x NR rows in 512-bit
// registers: Tile2<float> / Tile2<int8_t> (weights widened to float32) and, with AVX512-BF16,
// Tile2<bf16> (bf16 weights on bf16-exact x); the K loops differ, the blocks' scales, Q4_1's
// min term and the store are shared (with block_q8.h's tile_q8 too).
constexpr int kRows2 = 12;  // rows per pass: 24 accumulators of the 32 registers

// acc[r] += part[r] * the scales of block g (NT column tiles from n0: 2, or a lone last tile)
template <int NR, int NT = 2>
inline void fold_block2(const Problem& p, int64_t g, int64_t n0, __m512 (&part)[NR][NT],
                        __m512 (&acc)[NR][NT]) {
  for (int t = 0; t < NT; ++t) {
    const __m512 d = _mm512_loadu_ps(p.scales + g * p.n + n0 + t * kCols);
    for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_fmadd_ps(part[r][t], d, acc[r][t]);
  }
}

// Q4_1's min term of block g: acc[r] += sum(x of row r over the block) * mins (whole blocks
// only: chunk_rows)
template <int NR, int NT = 2>
inline void add_mins2(const Problem& p, int64_t g, int64_t m0, int64_t n0, __m512 (&acc)[NR][NT]) {
  const int64_t groups = p.k / p.block;
  for (int t = 0; t < NT; ++t) {
    const __m512 mv = _mm512_loadu_ps(p.mins + g * p.n + n0 + t * kCols);
    for (int r = 0; r < NR; ++r) {
      acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(p.xsum[(m0 + r) * groups + g]), mv, acc[r][t]);
    }
  }
}

// y rows m0 .. m0 + NR, NT column tiles from n0 = acc (+ y when `add`: a later K chunk)
template <int NR, int NT = 2>
inline void store2(const Problem& p, int64_t m0, int64_t n0, __m512 (&acc)[NR][NT], bool add) {
  for (int r = 0; r < NR; ++r) {
    float* y = p.y + (m0 + r) * p.n + n0;
    for (int t = 0; t < NT; ++t) {
      if (add) acc[r][t] = _mm512_add_ps(acc[r][t], _mm512_loadu_ps(y + t * kCols));
      _mm512_storeu_ps(y + t * kCols, acc[r][t]);
    }
  }
}

template <typename T>
struct Tile2;

// 16 weights of a tile's K row as 16 floats: float32 loaded, int8 codes widened by one
// vpmovsxbd + vcvtdq2ps (the 256-bit tile takes two of each per tile)
inline __m512 widen16(const float* c) { return _mm512_loadu_ps(c); }
inline __m512 widen16(const int8_t* c) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
}

// Float32 weights and int8 codes (Q8_0 / Q4_0 / Q4_1 blocks, per-channel int8): per K row two
// tiles' weights as floats and NR broadcasts feed 2 NR FMAs (the 256-bit tile: NR 16-column
// FMAs), so a few-row product loads / converts half as often per weight. The blocks' scales and
// Q4_1's min term as `tile`: the same float32 operations in the same order per column
// (bit-identical).
template <typename T>
struct Tile2Widened {
  template <int NR, bool MINS>
  static void run(const Problem& p, int64_t m0, int64_t n0, int64_t k0, int64_t k1, bool add,
                  const char* pf) {
    const int64_t pf_lines = pf == nullptr ? 0 : (k1 - k0) * 2 * kCols * sizeof(T) / 64;
    const float* xr[NR];
    for (int r = 0; r < NR; ++r) xr[r] = p.x + (m0 + r) * p.k;
    __m512 acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t step = p.row_step();
    const int64_t span = std::min(p.block, k1 - k0);
    for (int64_t kb = k0; kb < k1; kb += span) {
      __m512 part[NR][2];
      for (int r = 0; r < NR; ++r) part[r][0] = part[r][1] = _mm512_setzero_ps();
      const T* c0 = p.tile_codes<T>(kb, n0);
      const T* c1 = p.tile_codes<T>(kb, n0 + kCols);
      for (int64_t kk = kb; kk < kb + span; ++kk, c0 += step, c1 += step) {
        if constexpr (sizeof(T) == 4) {  // a K row of the pair: two cache lines
          const int64_t i = 2 * (kk - k0);
          if (i < pf_lines) {
            _mm_prefetch(pf + i * 64, _MM_HINT_T0);
            _mm_prefetch(pf + i * 64 + 64, _MM_HINT_T0);
          }
        } else if (kk - k0 < pf_lines) {
          _mm_prefetch(pf + (kk - k0) * 64, _MM_HINT_T0);
        }
        __m512 w0 = widen16(c0), w1 = widen16(c1);
        // float32: in registers, else the compiler folds the loads into every row's FMA
        if constexpr (sizeof(T) == 4) asm volatile("" : "+v"(w0), "+v"(w1));
        for (int r = 0; r < NR; ++r) {
          const __m512 xv = _mm512_set1_ps(xr[r][kk]);
          part[r][0] = _mm512_fmadd_ps(xv, w0, part[r][0]);
          part[r][1] = _mm512_fmadd_ps(xv, w1, part[r][1]);
        }
      }
      fold_block2<NR>(p, kb / p.block, n0, part, acc);
      if constexpr (MINS) add_mins2<NR>(p, kb / p.block, m0, n0, acc);
    }
    store2<NR>(p, m0, n0, acc, add);
  }
};

template <>
struct Tile2<float> : Tile2Widened<float> {};
template <>
struct Tile2<int8_t> : Tile2Widened<int8_t> {};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bfloat16 weights and bfloat16-exact x (a bf16 model's activations, p.xb) with the AVX512-BF16
// dot product, which multiplies two K rows' bf16 pairs and adds them into float32 lanes (32
// products an instruction, twice a float32 FMA's). A tile's K rows kk and kk + 1 are 64
// contiguous bytes; one vpermw interleaves them into the (kk, kk + 1) pairs of its 16 columns,
// and x's pair is one broadcast 32-bit load. An odd last K row pairs with zeros. Accumulates in
// float32 in another order than `tile` (pairs first): not bit-identical.
template <>
struct Tile2<bf16> {
  template <int NR, bool MINS>
  static void run(const Problem& p, int64_t m0, int64_t n0, int64_t k0, int64_t k1, bool add,
                  const char* pf) {
    const int64_t pf_lines = pf == nullptr ? 0 : (k1 - k0) * 2 * kCols * sizeof(bf16) / 64;
    alignas(64) static const uint16_t kPairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                                    6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27,
                                                    12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i pairs = _mm512_load_si512(kPairs);
    const uint16_t* xr[NR];
    for (int r = 0; r < NR; ++r) xr[r] = p.xb + (m0 + r) * p.k;
    __m512 acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t step = p.row_step();
    const int64_t span = std::min(p.block, k1 - k0);
    for (int64_t kb = k0; kb < k1; kb += span) {
      const int64_t ke = kb + span;
      __m512 part[NR][2];
      for (int r = 0; r < NR; ++r) part[r][0] = part[r][1] = _mm512_setzero_ps();
      const bf16* c0 = p.tile_codes<bf16>(kb, n0);
      const bf16* c1 = p.tile_codes<bf16>(kb, n0 + kCols);
      int64_t kk = kb;
      for (; kk + 2 <= ke; kk += 2, c0 += 2 * step, c1 += 2 * step) {
        const int64_t i = kk - k0;
        if (i < pf_lines) {
          _mm_prefetch(pf + i * 64, _MM_HINT_T0);
          _mm_prefetch(pf + i * 64 + 64, _MM_HINT_T0);
        }
        const __m512i w0 = _mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(c0));
        const __m512i w1 = _mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(c1));
        for (int r = 0; r < NR; ++r) {
          int32_t both;
          std::memcpy(&both, xr[r] + kk, sizeof(both));
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(both);
          part[r][0] = _mm512_dpbf16_ps(part[r][0], xv, (__m512bh)w0);
          part[r][1] = _mm512_dpbf16_ps(part[r][1], xv, (__m512bh)w1);
        }
      }
      if (kk < ke) {  // an odd last row: (row, 0) pairs (the zero upper half of the load)
        const __m512i w0 = _mm512_permutexvar_epi16(
            pairs, _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c0))));
        const __m512i w1 = _mm512_permutexvar_epi16(
            pairs, _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c1))));
        for (int r = 0; r < NR; ++r) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(xr[r][kk]));
          part[r][0] = _mm512_dpbf16_ps(part[r][0], xv, (__m512bh)w0);
          part[r][1] = _mm512_dpbf16_ps(part[r][1], xv, (__m512bh)w1);
        }
      }
      fold_block2<NR>(p, kb / p.block, n0, part, acc);
    }
    store2<NR>(p, m0, n0, acc, add);
  }
};
#endif

// Which weight types have a Tile2 on this build.
template <typename T>
constexpr bool kHasTile2 = std::is_same_v<T, float> || std::is_same_v<T, int8_t>
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
                           || std::is_same_v<T, bf16>
#endif
    ;

// Rows [m0, m1) in passes of kRows2 rows, then the 1-11 left over; the first pass prefetches.
template <typename T, bool MINS>
void row_passes2(const Problem& p, int64_t m0, int64_t m1, int64_t n0, int64_t k0, int64_t k1,
                 const char* pf) {
  const bool add = k0 > 0;
  for (; m0 + kRows2 <= m1; m0 += kRows2, pf = nullptr) {
    Tile2<T>::template run<kRows2, MINS>(p, m0, n0, k0, k1, add, pf);
  }
  switch (m1 - m0) {
    case 11: Tile2<T>::template run<11, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 10: Tile2<T>::template run<10, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 9: Tile2<T>::template run<9, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 8: Tile2<T>::template run<8, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 7: Tile2<T>::template run<7, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 6: Tile2<T>::template run<6, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 5: Tile2<T>::template run<5, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 4: Tile2<T>::template run<4, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 3: Tile2<T>::template run<3, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 2: Tile2<T>::template run<2, MINS>(p, m0, n0, k0, k1, add, pf); break;
    case 1: Tile2<T>::template run<1, MINS>(p, m0, n0, k0, k1, add, pf); break;
    default: break;
  }
}
#endif  // __AVX512F__

}  // namespace tokenspeed::blockmm

#endif  // TOKENSPEED_NATIVE_BLOCK_TILES512_H_
