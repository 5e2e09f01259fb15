// What one block matmul call computes (block_matmul.cc): the operands, the tile geometry and how
// a tile's K rows are cut into L1-sized chunks. Shared by the 256-bit, 512-bit and Q8 tiles.

#ifndef TOKENSPEED_NATIVE_BLOCK_PROBLEM_H_
#define TOKENSPEED_NATIVE_BLOCK_PROBLEM_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"

namespace tokenspeed::blockmm {

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
  const uint16_t* x16 = nullptr; // bf16[M, K]: x as the caller gave it (bf16), or nullptr

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

// x's values as bf16 (x_bf16: exact, the low halves are zero) in mp rows of kp, zero padded
// past [m, k): the bf16 dot products' and the AMX tiles' operand. From x16 when the caller gave
// bf16 rows.
inline std::vector<uint16_t> bf16_rows(const Problem& p, int64_t mp, int64_t kp) {
  std::vector<uint16_t> xb(mp * kp, 0);
  for (int64_t i = 0; i < p.m; ++i) {
    if (p.x16 != nullptr) {
      std::memcpy(xb.data() + i * kp, p.x16 + i * p.k, p.k * sizeof(uint16_t));
      continue;
    }
    for (int64_t kk = 0; kk < p.k; ++kk) {
      uint32_t u;
      std::memcpy(&u, p.x + i * p.k + kk, sizeof(u));
      xb[i * kp + kk] = static_cast<uint16_t>(u >> 16);
    }
  }
  return xb;
}

// bf16 -> float32 (exact).
inline void from_bf16(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// float32 -> bf16, rounded to nearest even as XLA's convert does (NaN stays a quiet NaN).
inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// y's n floats -> bf16 over the pool's threads (a [512, 3072] output is ~0.4 ms on one).
inline void to_bf16(xla::ffi::ThreadPool& pool, const float* src, uint16_t* dst, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t items = (n + kChunk - 1) / kChunk;
  const int64_t threads = std::min<int64_t>(items, pool.num_threads());
  parallel_chunks(pool, items, 1, threads, [src, dst, n] {
    return [src, dst, n](int64_t b, int64_t e) {
      const int64_t end = std::min(n, e * kChunk);
      for (int64_t i = b * kChunk; i < end; ++i) dst[i] = round_bf16(src[i]);
    };
  });
}

}  // namespace tokenspeed::blockmm

#endif  // TOKENSPEED_NATIVE_BLOCK_PROBLEM_H_
