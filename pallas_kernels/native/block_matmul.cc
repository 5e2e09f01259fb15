// Block-quantized matmul on the CPU: an XLA FFI custom call (XLA:CPU) for GGUF-style weights.
//
// y f32[M, N] = x f32[M, K] @ W, with W kept as blocks in our [in, out] layout (models/
// block_quant.py): codes int8[K, N], scales f32[K / B, N] and, for Q4_1, mins f32[K / B, N]:
//     W[k, n] = scales[k / B, n] * codes[k, n] (+ mins[k / B, n]).
// XLA:CPU has no such dot: the jnp lowerings either dequantize the whole matrix inside the step
// or run an int8 dot batched over the K / B blocks, which it does well only for a row or two.
// Here a 16-column tile of codes is converted to float in registers, one K row at a time, and
// used for 6 rows of x at once: the codes are read once per 6 rows (a batch-1 decode reads
// 1 byte per weight, not the 4 of a float32 copy). The block scale is applied once per block
// (y += scale * sum(x * code) + min * sum(x)): float32 sums in another order than a dot of the
// dequantized matrix, not a bit-identical product. A tile's K rows are taken ~16 KiB at a time
// (chunk_rows), which stay in L1 across all the passes of rows.
// Float32 / bfloat16 weights take the same path as codes (one block of all K inputs, scale 1,
// dense_matmul_cpu).
// Layout: codes [K, N], or tile-major [N / 16, K, 16] (`tiled`, pallas_kernels/
// block_matmul_cpu.pack_tiles), where a tile's K rows are contiguous: a few-row product then
// streams memory in order (bf16, 1 row: ~35 GB/s against ~10 strided by N), and float32 tiles
// beat XLA:CPU's own dot from 1 to 512 rows. The model re-lays its Linears so on one CPU device.
// Work items of up to 4 column tiles x 96 rows of x are split over XLA's intra-op threads.
// With AVX-512, tile-major float32 weights take two tiles at a time in 512-bit registers
// (Tile2<float>: 12 rows x 32 columns a pass).
//
// Inputs (shapes checked by pallas_kernels/block_matmul_cpu.py): x f32[M, K], codes s8 / f32 /
// bf16 [K, N] or [N / 16, K, 16] (tiled, N a multiple of 16), scales f32[G, N], mins f32[G, N]
// (has_mins) or any f32 array. Attributes: block = K / G, has_mins, tiled, x_bf16 (x's values
// are bfloat16: with AVX512-BF16, tile-major bf16 weights take the bf16 dot product,
// Tile2<bf16>). Output f32[M, N].
// With AMX (or built with TOKENSPEED_AMX_MODEL: the software model of the tiles, for tests),
// bf16 weights on bf16 x with one block of all K (dense_matmul_cpu) take the tile product of
// amx_matmul.h from amx_min_rows() rows of x on.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "amx_matmul.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Which tiles run the bf16 x bf16 products, and from how many rows of x on.
#if defined(TOKENSPEED_AMX_MODEL)
#define TOKENSPEED_AMX_ISA tokenspeed::amx::Model
#define TOKENSPEED_BLOCK_MATMUL_SYMBOL TokenspeedBlockMatmulAmxModel
#elif defined(TOKENSPEED_HAVE_AMX)
#define TOKENSPEED_AMX_ISA tokenspeed::amx::Hw
#endif
#ifndef TOKENSPEED_BLOCK_MATMUL_SYMBOL
#define TOKENSPEED_BLOCK_MATMUL_SYMBOL TokenspeedBlockMatmul
#endif

extern "C" int64_t TokenspeedAmxCalls() { return tokenspeed::amx::calls().load(); }
// Whether x_q8 takes the integer dot products on this build (AVX512-VNNI + VBMI), else float.
extern "C" int32_t TokenspeedHaveQ8() {
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  return 1;
#else
  return 0;
#endif
}

namespace {

constexpr int64_t kCols = 16;  // columns per tile: two AVX2 vectors
constexpr int64_t kRows = 6;   // rows of x per pass: 12 accumulator vectors of the 16
constexpr int64_t kBlockRows = 16 * kRows;  // rows of x per L2 block (tile_range)

struct Problem {
  const float* x;
  const void* codes;   // int8 codes, or float32 / bfloat16 weights (then one block, scale 1)
  const float* scales;
  const float* mins;   // nullptr without
  const float* xsum;   // f32[M, G]: sum of x over each block (for the mins), or nullptr
  const uint16_t* xb;  // bf16[M, K]: x as bfloat16 (exact: x_bf16), for the bf16 dot products
  float* y;
  int64_t m, k, n, block;
  bool tiled;  // codes in tile-major order [N / kCols, K, kCols] (pack_tiles), not [K, N]
  // x_q8 (tile_q8): x as int8 per 32 K values, llama.cpp's Q8 activations: x ~ dx * xq
  const int8_t* xq = nullptr;    // s8[M, K]
  const float* dx = nullptr;     // f32[M, K / 32]: the scale of each 32 values
  const int32_t* qsum = nullptr; // s32[M, K / 32]: the sum of each 32 xq

  // codes of column tile [n0, n0 + kCols) from K row `kk`, and the step to the next K row
  template <typename T>
  const T* tile_codes(int64_t kk, int64_t n0) const {
    return static_cast<const T*>(codes) + (tiled ? n0 * k + kk * kCols : kk * n + n0);
  }
  int64_t row_step() const { return tiled ? kCols : n; }
};

using bf16 = uint16_t;  // XLA FFI's bfloat16 storage: the high half of a float32

inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float to_float(float v) { return v; }
inline float to_float(bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

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

// K rows per chunk of a tile: ~16 KiB of weights, which stay in L1 across every pass of rows
// (a float32 tile of K = 576 is 36 KiB: re-read from L2 by each pass, 0.6x the speed at 256 rows).
// Whole blocks when blocks are smaller (the mins term is added per whole block); else a part of
// the one block of all K (float / per-channel int8 weights: one scale for all K, no mins).
template <typename T>
int64_t chunk_rows(const Problem& p) {
  int64_t rows = std::max<int64_t>(1, 16384 / (kCols * static_cast<int64_t>(sizeof(T))));
  if (p.block <= rows || p.mins != nullptr) return std::max(p.block, rows / p.block * p.block);
  const int64_t chunks = (p.k + rows - 1) / rows;  // even chunks: 576 = 3 x 192, not 256 + 256 + 64
  const int64_t even = (p.k + chunks - 1) / chunks;
  return p.xq == nullptr ? even : (even + 31) / 32 * 32;  // tile_q8 takes whole 32s of x
}

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

#ifdef __AVX512F__
// Two column tiles [n0, n0 + 2 kCols) (tiles n0 / kCols and the next) x NR rows in 512-bit
// registers: Tile2<float> (float32 weights) and, with AVX512-BF16, Tile2<bf16> (bf16 weights on
// bf16-exact x); the K loop differs, the blocks' scales and the store are shared.
constexpr int kRows2 = 12;  // rows per pass: 24 accumulators of the 32 registers

// acc[r] += part[r] * the scales of block g (columns n0 .. n0 + 2 kCols)
template <int NR>
inline void fold_block2(const Problem& p, int64_t g, int64_t n0, __m512 (&part)[NR][2],
                        __m512 (&acc)[NR][2]) {
  const __m512 d0 = _mm512_loadu_ps(p.scales + g * p.n + n0);
  const __m512 d1 = _mm512_loadu_ps(p.scales + g * p.n + n0 + kCols);
  for (int r = 0; r < NR; ++r) {
    acc[r][0] = _mm512_fmadd_ps(part[r][0], d0, acc[r][0]);
    acc[r][1] = _mm512_fmadd_ps(part[r][1], d1, acc[r][1]);
  }
}

// y rows m0 .. m0 + NR, columns n0 .. n0 + 2 kCols = acc (+ y when `add`: a later K chunk)
template <int NR>
inline void store2(const Problem& p, int64_t m0, int64_t n0, __m512 (&acc)[NR][2], bool add) {
  for (int r = 0; r < NR; ++r) {
    float* y = p.y + (m0 + r) * p.n + n0;
    if (add) {
      acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_loadu_ps(y));
      acc[r][1] = _mm512_add_ps(acc[r][1], _mm512_loadu_ps(y + kCols));
    }
    _mm512_storeu_ps(y, acc[r][0]);
    _mm512_storeu_ps(y + kCols, acc[r][1]);
  }
}

template <typename T>
struct Tile2;

// float32: per K row two weight loads and NR broadcasts feed 2 NR FMAs (the 256-bit tile:
// two loads and NR broadcasts for NR 16-column FMAs). Same order per column as `tile`.
template <>
struct Tile2<float> {
  template <int NR, bool MINS>
  static void run(const Problem& p, int64_t m0, int64_t n0, int64_t k0, int64_t k1, bool add,
                  const char* pf) {
    const int64_t pf_lines = pf == nullptr ? 0 : (k1 - k0) * 2 * kCols * sizeof(float) / 64;
    const float* xr[NR];
    for (int r = 0; r < NR; ++r) xr[r] = p.x + (m0 + r) * p.k;
    __m512 acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t step = p.row_step();
    const int64_t span = std::min(p.block, k1 - k0);
    for (int64_t kb = k0; kb < k1; kb += span) {
      __m512 part[NR][2];
      for (int r = 0; r < NR; ++r) part[r][0] = part[r][1] = _mm512_setzero_ps();
      const float* c0 = p.tile_codes<float>(kb, n0);
      const float* c1 = p.tile_codes<float>(kb, n0 + kCols);
      for (int64_t kk = kb; kk < kb + span; ++kk, c0 += step, c1 += step) {
        const int64_t i = 2 * (kk - k0);
        if (i < pf_lines) {
          _mm_prefetch(pf + i * 64, _MM_HINT_T0);
          _mm_prefetch(pf + i * 64 + 64, _MM_HINT_T0);
        }
        __m512 w0 = _mm512_loadu_ps(c0), w1 = _mm512_loadu_ps(c1);
        asm volatile("" : "+v"(w0), "+v"(w1));
        for (int r = 0; r < NR; ++r) {
          const __m512 xv = _mm512_set1_ps(xr[r][kk]);
          part[r][0] = _mm512_fmadd_ps(xv, w0, part[r][0]);
          part[r][1] = _mm512_fmadd_ps(xv, w1, part[r][1]);
        }
      }
      fold_block2<NR>(p, kb / p.block, n0, part, acc);
    }
    store2<NR>(p, m0, n0, acc, add);
  }
};

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

// int8 codes (Q8_0 / Q4_0 / Q4_1 blocks, per-channel int8): 16 codes widened to 16 floats by
// one vpmovsxbd + vcvtdq2ps per tile and K row (the 256-bit tile takes two of each per tile), so
// a few-row product converts half as often per weight; the blocks' scales and Q4_1's min term
// as `tile`: the same float32 operations in the same order per column (bit-identical).
template <>
struct Tile2<int8_t> {
  template <int NR, bool MINS>
  static void run(const Problem& p, int64_t m0, int64_t n0, int64_t k0, int64_t k1, bool add,
                  const char* pf) {
    const int64_t pf_lines = pf == nullptr ? 0 : (k1 - k0) * 2 * kCols / 64;
    const float* xr[NR];
    for (int r = 0; r < NR; ++r) xr[r] = p.x + (m0 + r) * p.k;
    __m512 acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t groups = p.k / p.block;
    const int64_t step = p.row_step();
    const int64_t span = std::min(p.block, k1 - k0);
    for (int64_t kb = k0; kb < k1; kb += span) {
      const int64_t g = kb / p.block;
      __m512 part[NR][2];
      for (int r = 0; r < NR; ++r) part[r][0] = part[r][1] = _mm512_setzero_ps();
      const int8_t* c0 = p.tile_codes<int8_t>(kb, n0);
      const int8_t* c1 = p.tile_codes<int8_t>(kb, n0 + kCols);
      for (int64_t kk = kb; kk < kb + span; ++kk, c0 += step, c1 += step) {
        if (kk - k0 < pf_lines) _mm_prefetch(pf + (kk - k0) * 64, _MM_HINT_T0);
        __m512 w0 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c0))));
        __m512 w1 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c1))));
        for (int r = 0; r < NR; ++r) {
          const __m512 xv = _mm512_set1_ps(xr[r][kk]);
          part[r][0] = _mm512_fmadd_ps(xv, w0, part[r][0]);
          part[r][1] = _mm512_fmadd_ps(xv, w1, part[r][1]);
        }
      }
      fold_block2<NR>(p, g, n0, part, acc);
      if constexpr (MINS) {  // whole groups only (chunk_rows)
        const __m512 n0v = _mm512_loadu_ps(p.mins + g * p.n + n0);
        const __m512 n1v = _mm512_loadu_ps(p.mins + g * p.n + n0 + kCols);
        for (int r = 0; r < NR; ++r) {
          const __m512 sv = _mm512_set1_ps(p.xsum[(m0 + r) * groups + g]);
          acc[r][0] = _mm512_fmadd_ps(sv, n0v, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(sv, n1v, acc[r][1]);
        }
      }
    }
    store2<NR>(p, m0, n0, acc, add);
  }
};

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
  const int64_t groups = p.k / p.block, q8_groups = p.k / 32;
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
    const int64_t g = kb / p.block;
    for (int t = 0; t < NT; ++t) {
      const __m512 dw = _mm512_loadu_ps(p.scales + g * p.n + n0 + t * kCols);
      for (int r = 0; r < NR; ++r) acc[r][t] = _mm512_fmadd_ps(part[r][t], dw, acc[r][t]);
      if constexpr (MINS) {
        const __m512 mv = _mm512_loadu_ps(p.mins + g * p.n + n0 + t * kCols);
        for (int r = 0; r < NR; ++r) {
          acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(p.xsum[(m0 + r) * groups + g]), mv, acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) {
      float* y = p.y + (m0 + r) * p.n + n0 + t * kCols;
      _mm512_storeu_ps(y, add ? _mm512_add_ps(acc[r][t], _mm512_loadu_ps(y)) : acc[r][t]);
    }
  }
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
#endif

// Tile-major weights: the chunk a thread reads after the current one (tile `next`'s K rows
// [k0, k1), or past the last tile t1 the first tile's next K chunk), prefetched during the
// current one's first pass: a few-row product otherwise waits for memory, then computes from L1
// (0.6x of either alone). nullptr when not tile-major or nothing follows.
template <typename T>
const char* next_chunk(const Problem& p, int64_t next, int64_t t0, int64_t t1, int64_t k0,
                       int64_t k1) {
  if (!p.tiled || (next >= t1 && k1 >= p.k)) return nullptr;
  return reinterpret_cast<const char*>(next < t1 ? p.tile_codes<T>(k0, next * kCols)
                                                 : p.tile_codes<T>(k1, t0 * kCols));
}

// Column tiles [t0, t1) for rows [m0, m1) of x (at most kBlockRows), one K chunk at a time: the
// K chunk of a tile stays in L1 across its row passes, and the block of x the chunk reads stays
// in L2 across the tiles (all M rows would stream from L3 once per tile at large M).
template <typename T, bool MINS>
void tile_range(const Problem& p, int64_t t0, int64_t t1, int64_t m0, int64_t m1) {
  const int64_t rows = chunk_rows<T>(p);
  for (int64_t k0 = 0; k0 < p.k; k0 += rows) {
    const int64_t k1 = std::min(p.k, k0 + rows);
    int64_t t = t0;
#ifdef __AVX512F__
#ifdef TOKENSPEED_HAVE_Q8
    if constexpr (std::is_same_v<T, int8_t>) {
      if (p.xq != nullptr) {  // x_q8 (tile-major, K a multiple of 32: BlockMatmulImpl)
        for (; t + 2 <= t1; t += 2) {
          row_passes_q8<2, MINS>(p, m0, m1, t * kCols, k0, k1,
                                 next_chunk<T>(p, t + 2, t0, t1, k0, k1));
        }
        if (t < t1) {
          row_passes_q8<1, MINS>(p, m0, m1, t * kCols, k0, k1,
                                 next_chunk<T>(p, t + 1, t0, t1, k0, k1));
          ++t;
        }
      }
    }
#endif
    if constexpr (kHasTile2<T> && (!MINS || std::is_same_v<T, int8_t>)) {
      if (p.tiled && (!std::is_same_v<T, bf16> || p.xb != nullptr)) {
        for (; t + 2 <= t1; t += 2) {
          row_passes2<T, MINS>(p, m0, m1, t * kCols, k0, k1,
                               next_chunk<T>(p, t + 2, t0, t1, k0, k1));
        }
      }
    }
#endif
    for (; t < t1; ++t) {
      row_passes<T, MINS>(p, m0, m1, t * kCols, k0, k1, next_chunk<T>(p, t + 1, t0, t1, k0, k1));
    }
  }
}

// The last columns [n0, n) when N is not a multiple of kCols: plain loops.
template <typename T>
void edge_tile(const Problem& p, int64_t n0) {
  const T* codes = static_cast<const T*>(p.codes);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = n0; j < p.n; ++j) {
      float s = 0.0f;
      for (int64_t kk = 0; kk < p.k; ++kk) {
        const int64_t g = kk / p.block;
        float w = p.scales[g * p.n + j] * to_float(codes[kk * p.n + j]);
        if (p.mins != nullptr) w += p.mins[g * p.n + j];
        s += p.x[i * p.k + kk] * w;
      }
      p.y[i * p.n + j] = s;
    }
  }
}

template <typename T>
void run(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t tiles = p.n / kCols;
  if (p.n % kCols) edge_tile<T>(p, tiles * kCols);
  // a thread per ~4 x 1024 K rows of tile passes (a 576 x 576 layer on one row takes two);
  // work items of up to 4 tiles x kBlockRows rows, at least 4 items a thread (with few rows:
  // 36 tiles in 9 chunks of 4 left one of 2 threads 5 chunks against 4)
  const int64_t passes = tiles * ((p.m + kRows - 1) / kRows) * p.k / 1024;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), passes / 4));
  const int64_t blocks = (p.m + kBlockRows - 1) / kBlockRows;
  const int64_t chunk = std::clamp<int64_t>(tiles * blocks / (4 * threads), 1, 4);
  const int64_t chunks = (tiles + chunk - 1) / chunk;
  tokenspeed::parallel_chunks(pool, chunks * blocks, 1, threads, [p, tiles, chunk, chunks] {
    return [p, tiles, chunk, chunks](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {  // consecutive items share a block of x
        const int64_t t0 = i % chunks * chunk, t1 = std::min(tiles, t0 + chunk);
        const int64_t m0 = i / chunks * kBlockRows, m1 = std::min(p.m, m0 + kBlockRows);
        if (p.mins != nullptr) {
          tile_range<T, true>(p, t0, t1, m0, m1);
        } else {
          tile_range<T, false>(p, t0, t1, m0, m1);
        }
      }
    };
  });
}

#ifdef TOKENSPEED_AMX_ISA
// Rows of x from which the tiles take a product: the model takes every product (tests); the
// hardware pads x to 16 rows a tile, so a few-row decode stays on the AVX-512 path unless
// TOKENSPEED_JAX_AMX_MIN_ROWS says otherwise (to measure both on an AMX machine).
int64_t amx_min_rows() {
#if defined(TOKENSPEED_AMX_MODEL)
  return 1;
#else
  static const int64_t rows = [] {
    const char* env = std::getenv("TOKENSPEED_JAX_AMX_MIN_ROWS");
    return env != nullptr ? std::max<int64_t>(1, std::atoll(env)) : int64_t{16};
  }();
  return rows;
#endif
}

// bf16 weights, bf16-exact x, no block scales (one block of all K: float weights) and a full
// column tile: what the tile product computes.
bool amx_eligible(const Problem& p, ffi::DataType dtype, bool x_bf16, bool has_mins) {
  return x_bf16 && dtype == ffi::DataType::BF16 && !has_mins && p.block == p.k &&
         p.n >= kCols && p.m >= amx_min_rows();
}

// x as bf16, zero padded to whole tiles (rows to 16, K to 32); columns past the last full tile
// by edge_tile.
template <class Isa>
void run_amx(ffi::ThreadPool& pool, const Problem& p) {
  using tokenspeed::amx::kPairK;
  using tokenspeed::amx::kTileRows;
  const int64_t mp = (p.m + kTileRows - 1) / kTileRows * kTileRows;
  const int64_t kp = (p.k + kPairK - 1) / kPairK * kPairK;
  std::vector<uint16_t> xb(mp * kp, 0);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t kk = 0; kk < p.k; ++kk) {
      uint32_t u;
      std::memcpy(&u, p.x + i * p.k + kk, sizeof(u));
      xb[i * kp + kk] = static_cast<uint16_t>(u >> 16);  // exact: the low half is zero
    }
  }
  const int64_t tiles = p.n / kCols;
  if (p.n % kCols) edge_tile<bf16>(p, tiles * kCols);
  tokenspeed::amx::Problem a{xb.data(), mp, kp, static_cast<const uint16_t*>(p.codes),
                             p.tiled ? p.k * kCols : kCols, p.row_step(), p.k, p.scales,
                             p.y, p.m, p.n};
  tokenspeed::amx::matmul<Isa>(pool, a);
}
#endif

#ifdef TOKENSPEED_HAVE_Q8
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

ffi::Error BlockMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                           ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> mins,
                           int32_t block, bool has_mins, bool tiled, bool x_bf16, bool x_q8,
                           ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto cd = codes.dimensions();
  auto sd = scales.dimensions();
  // codes [K, N], or tile-major [N / kCols, K, kCols]
  const bool rank_ok = tiled ? cd.size() == 3 && cd[2] == kCols : cd.size() == 2;
  const int64_t ck = rank_ok ? (tiled ? cd[1] : cd[0]) : -1;
  const int64_t cn = rank_ok ? (tiled ? cd[0] * kCols : cd[1]) : -1;
  if (!rank_ok || xd.size() != 2 || sd.size() != 2 || block < 1 || xd[1] != ck ||
      ck != sd[0] * block || cn != sd[1] ||
      (has_mins && mins.element_count() != scales.element_count()) ||
      y->element_count() != xd[0] * cn) {
    return ffi::Error::InvalidArgument(
        "block_matmul: x [M, K], codes [K, N] (tiled: [N / 16, K, 16]), scales (and mins) "
        "[K / block, N], y [M, N]");
  }
  const ffi::DataType dtype = codes.element_type();
  if (dtype != ffi::DataType::S8 && dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("block_matmul: codes must be int8, float32 or bfloat16");
  }
  Problem p{x.typed_data(), codes.untyped_data(), scales.typed_data(),
            has_mins ? mins.typed_data() : nullptr, nullptr, nullptr, y->typed_data(),
            xd[0], ck, cn, block, tiled};
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  std::vector<float> xsum;  // outlives every claimed chunk: parallel_chunks returns when all are done
  if (has_mins) {
    const int64_t groups = p.k / p.block;
    xsum.assign(p.m * groups, 0.0f);
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t kk = 0; kk < p.k; ++kk) xsum[i * groups + kk / p.block] += p.x[i * p.k + kk];
    }
    p.xsum = xsum.data();
  }
#ifdef TOKENSPEED_AMX_ISA
  if (amx_eligible(p, dtype, x_bf16, has_mins) && TOKENSPEED_AMX_ISA::usable()) {
    run_amx<TOKENSPEED_AMX_ISA>(pool, p);
    return ffi::Error::Success();
  }
#endif
  std::vector<int8_t> xq;  // x_q8: x as Q8 blocks (tile_q8)
  std::vector<float> dx;
  std::vector<int32_t> qsum;
#ifdef TOKENSPEED_HAVE_Q8
  if (x_q8 && tiled && dtype == ffi::DataType::S8 && p.k % 32 == 0) {
    quantize_q8(p, xq, dx, qsum);
  }
#endif
  (void)x_q8;
  std::vector<uint16_t> xb;  // x as bf16 pairs' halves (x_bf16: its values are bf16 already)
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x_bf16 && tiled && dtype == ffi::DataType::BF16 && !has_mins && p.n >= 2 * kCols) {
    xb.resize(p.m * p.k);
    for (int64_t i = 0; i < p.m * p.k; ++i) {
      uint32_t u;
      std::memcpy(&u, p.x + i, sizeof(u));
      xb[i] = static_cast<uint16_t>(u >> 16);  // exact: the low half is zero
    }
    p.xb = xb.data();
  }
#endif
  (void)x_bf16;
  if (dtype == ffi::DataType::S8) {
    run<int8_t>(pool, p);
  } else if (dtype == ffi::DataType::F32) {
    run<float>(pool, p);
  } else {
    run<bf16>(pool, p);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TOKENSPEED_BLOCK_MATMUL_SYMBOL, BlockMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::AnyBuffer>()         // codes: s8, f32 or bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mins
                                  .Attr<int32_t>("block")
                                  .Attr<bool>("has_mins")
                                  .Attr<bool>("tiled")
                                  .Attr<bool>("x_bf16")
                                  .Attr<bool>("x_q8")
                                  .Ret<ffi::Buffer<ffi::F32>>());
