// y f32[M, N] = x bf16[M, K] @ w bf16[K, N] (times a per-column scale) on AMX tiles, written
// once against amx_tiles.h's interface: `Isa` is the hardware (amx::Hw) or the software model
// (amx::Model, which tests run on any CPU).
//
// A TDPBF16PS multiplies a 16 x 32 bf16 A tile by a 32 x 16 bf16 B tile into a 16 x 16 float32
// C tile: 16 x 16 x 32 products an instruction, ~8x the AVX512-BF16 dot product's rate. Here a
// pass keeps a 32 x 32 block of y in four C tiles (0-3) for the whole K, with two A tiles (4, 5:
// rows m .. m + 32 of x, 32 K values each) and two B tiles (6, 7: columns n .. n + 32) per
// 32-wide K step: 8 tile loads per 4 products.
// B tiles want the VNNI layout: row j holds the (2j, 2j + 1) K pairs of 16 columns. Our weights
// are a 16-column tile's K rows one after another (pack_tiles), so a work item first re-lays its
// two column tiles into a panel [K / 2, 16, 2] (zeros past K), then runs every row block of its
// item over that panel: the re-lay is paid once per (item, weight byte), not per row pass.
// x comes padded (block_matmul.cc): rows to a multiple of 16, K to a multiple of 32, with zeros,
// so a tile load never reads past it and padded K pairs add 0 * 0.

#ifndef TOKENSPEED_NATIVE_AMX_MATMUL_H_
#define TOKENSPEED_NATIVE_AMX_MATMUL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace tokenspeed::amx {

constexpr int64_t kCols = 16;        // columns per weight tile (block_matmul.cc kCols)
constexpr int64_t kItemRows = 256;   // rows of x per work item (its panel re-lay amortized over them)

struct Problem {
  const uint16_t* xb;  // bf16 [mp, kp], zero padded
  int64_t mp, kp;      // mp a multiple of kTileRows, kp of kPairK
  const uint16_t* w;   // bf16 weights: column tile t's K row kk at w + t * tile_step + kk * row_step
  int64_t tile_step, row_step;
  int64_t k;           // K rows of w (kp - k padded rows read as zeros)
  const float* scale;  // f32[N]: y[:, n] = scale[n] * (x @ w)[:, n]
  float* y;            // f32[m, n]
  int64_t m, n;
};

// Calls that ran on the tiles, for tests to tell the AMX path ran (TokenspeedAmxCalls).
inline std::atomic<int64_t>& calls() {
  static std::atomic<int64_t> n{0};
  return n;
}

// Column tiles [t, t + nt) -> panel [nt][kp / 2][16][2] (the B tiles' VNNI layout). With
// AVX-512 a K pair of a tile is one 64-byte load (tile-major: rows kk, kk + 1 are contiguous) or
// two 32-byte ones ([K, N]) and one vpermw; the scalar loop took ~2/3 of a 32-row product.
inline void relay_panel(const Problem& p, int64_t t, int nt, uint16_t* panel) {
  const int64_t full = p.k / 2;  // pairs with both rows inside K
  for (int i = 0; i < nt; ++i) {
    const uint16_t* src = p.w + (t + i) * p.tile_step;
    uint16_t* dst = panel + i * p.kp * kCols;
    int64_t j = 0;
#if defined(__AVX512BW__)
    alignas(64) static const uint16_t kPairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                                    6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27,
                                                    12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i pairs = _mm512_load_si512(kPairs);
    if (p.row_step == kCols) {
      for (; j < full; ++j) {
        const __m512i rows = _mm512_loadu_si512(src + 2 * j * kCols);
        _mm512_storeu_si512(dst + j * kCols * 2, _mm512_permutexvar_epi16(pairs, rows));
      }
    } else {
      for (; j < full; ++j) {
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * j * p.row_step));
        const __m256i r1 =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (2 * j + 1) * p.row_step));
        const __m512i rows = _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1);
        _mm512_storeu_si512(dst + j * kCols * 2, _mm512_permutexvar_epi16(pairs, rows));
      }
    }
#endif
    for (; j < p.kp / 2; ++j) {
      const int64_t k0 = 2 * j, k1 = 2 * j + 1;
      for (int64_t c = 0; c < kCols; ++c) {
        dst[(j * kCols + c) * 2] = k0 < p.k ? src[k0 * p.row_step + c] : 0;
        dst[(j * kCols + c) * 2 + 1] = k1 < p.k ? src[k1 * p.row_step + c] : 0;
      }
    }
  }
}

// Rows [m0, m0 + 16 MT) x columns [n0, n0 + 16 NT) of y over the whole K: C tile 2 mi + ni holds
// rows mi, columns ni; A tiles 4 + mi, B tiles 6 + ni.
template <class Isa, int MT, int NT>
void block(const Problem& p, const uint16_t* panel, int64_t m0, int64_t n0) {
  Isa::template zero<0>();
  if constexpr (NT > 1) Isa::template zero<1>();
  if constexpr (MT > 1) Isa::template zero<2>();
  if constexpr (MT > 1 && NT > 1) Isa::template zero<3>();
  const int64_t a_stride = p.kp * 2;  // bytes between rows of x
  const uint16_t* a = p.xb + m0 * p.kp;
  for (int64_t k = 0; k < p.kp; k += kPairK) {
    Isa::template load<4>(a + k, a_stride);
    if constexpr (MT > 1) Isa::template load<5>(a + kTileRows * p.kp + k, a_stride);
    // K values k .. k + 32 are pairs k / 2 .. k / 2 + 16: 16 rows of 64 bytes
    Isa::template load<6>(panel + k * kCols, kTileBytes);
    if constexpr (NT > 1) Isa::template load<7>(panel + p.kp * kCols + k * kCols, kTileBytes);
    Isa::template dpbf16<0, 4, 6>();
    if constexpr (NT > 1) Isa::template dpbf16<1, 4, 7>();
    if constexpr (MT > 1) Isa::template dpbf16<2, 5, 6>();
    if constexpr (MT > 1 && NT > 1) Isa::template dpbf16<3, 5, 7>();
  }
  alignas(64) float out[2 * kTileRows][2 * kCols];
  constexpr int64_t row_bytes = sizeof(out[0]);
  Isa::template store<0>(&out[0][0], row_bytes);
  if constexpr (NT > 1) Isa::template store<1>(&out[0][kCols], row_bytes);
  if constexpr (MT > 1) Isa::template store<2>(&out[kTileRows][0], row_bytes);
  if constexpr (MT > 1 && NT > 1) Isa::template store<3>(&out[kTileRows][kCols], row_bytes);
  const int64_t rows = std::min<int64_t>(MT * kTileRows, p.m - m0);
  for (int64_t r = 0; r < rows; ++r) {
    float* y = p.y + (m0 + r) * p.n + n0;
    for (int64_t c = 0; c < NT * kCols; ++c) y[c] = out[r][c] * p.scale[n0 + c];
  }
}

// Rows [m0, m1) (m1 - m0 a multiple of 16, or up to mp) for the columns of one panel.
template <class Isa, int NT>
void rows(const Problem& p, const uint16_t* panel, int64_t m0, int64_t m1, int64_t n0) {
  for (; m0 + 2 * kTileRows <= m1; m0 += 2 * kTileRows) block<Isa, 2, NT>(p, panel, m0, n0);
  if (m0 < m1) block<Isa, 1, NT>(p, panel, m0, n0);
}

// The product over full column tiles [0, n / 16): work items of (two column tiles, up to
// kItemRows rows) over XLA's intra-op threads; each thread configures its own tiles.
template <class Isa>
void matmul(xla::ffi::ThreadPool& pool, const Problem& p) {
  calls().fetch_add(1, std::memory_order_relaxed);
  const int64_t tiles = p.n / kCols;
  const int64_t pairs = (tiles + 1) / 2;
  const int64_t blocks = (p.mp + kItemRows - 1) / kItemRows;
  const int64_t items = pairs * blocks;  // pair-major: a thread's consecutive items share a panel
  // a thread per ~2^22 multiply-adds (a 16-row x 576 x 576 product stays on one)
  const int64_t work = p.mp * p.kp * tiles * kCols;
  const int64_t threads = std::clamp<int64_t>(work >> 22, 1, std::min<int64_t>(pool.num_threads(), items));
  // whole pairs per claim when there are enough of them: one re-lay per pair
  const int64_t chunk = pairs >= 2 * threads ? blocks : 1;
  parallel_chunks(pool, items, chunk, threads, [p, blocks, tiles] {
    return [p, blocks, tiles](int64_t b, int64_t e) {
      Isa::configure(full_tiles());
      std::vector<uint16_t> panel(2 * p.kp * kCols);
      int64_t have = -1;  // the pair whose panel is laid out
      for (int64_t i = b; i < e; ++i) {
        const int64_t pair = i / blocks, m0 = i % blocks * kItemRows;
        const int64_t m1 = std::min(p.mp, m0 + kItemRows);
        const int nt = 2 * pair + 1 < tiles ? 2 : 1;
        if (have != pair) {
          relay_panel(p, 2 * pair, nt, panel.data());
          have = pair;
        }
        if (nt == 2) {
          rows<Isa, 2>(p, panel.data(), m0, m1, 2 * pair * kCols);
        } else {
          rows<Isa, 1>(p, panel.data(), m0, m1, 2 * pair * kCols);
        }
      }
      Isa::release();
    };
  });
}

}  // namespace tokenspeed::amx

#endif  // TOKENSPEED_NATIVE_AMX_MATMUL_H_
