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
// Files: block_problem.h (the operands, tile geometry, K chunks), block_tiles256.h (one tile,
// AVX2 or plain loops), block_tiles512.h (tile pairs, AVX-512), block_q8.h (Q8 activations,
// AVX512-VNNI), amx_matmul.h / amx_tiles.h (AMX-BF16, or its software model); here the work
// split over threads and the FFI handler.
//
// Inputs (shapes checked by pallas_kernels/block_matmul_cpu.py): x f32 / bf16 [M, K], codes s8 / f32 /
// bf16 [K, N] or [N / 16, K, 16] (tiled, N a multiple of 16), scales f32[G, N], mins f32[G, N]
// (has_mins) or any f32 array, layer s32[1]. codes_stacked / scales_stacked: codes (scales and
// mins) carry a leading layer axis [L, ...] and the product reads layer `layer` of it in place
// (scan_layers). Attributes: block = K / G, has_mins, tiled, x_bf16 (x's values
// are bfloat16: with AVX512-BF16, tile-major bf16 weights take the bf16 dot product,
// Tile2<bf16>). Output f32 or bf16 [M, N] (bf16: the float32 sums rounded here, so a bf16
// model's product needs no convert of XLA's on either side).
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
#include "block_problem.h"
#include "block_q8.h"
#include "block_tiles256.h"
#include "block_tiles512.h"
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

namespace tokenspeed::blockmm {

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
  const std::vector<uint16_t> xb = bf16_rows(p, mp, kp);
  const int64_t tiles = p.n / kCols;
  if (p.n % kCols) edge_tile<bf16>(p, tiles * kCols);
  tokenspeed::amx::Problem a{xb.data(), mp, kp, static_cast<const uint16_t*>(p.codes),
                             p.tiled ? p.k * kCols : kCols, p.row_step(), p.k, p.scales,
                             p.y, p.m, p.n};
  tokenspeed::amx::matmul<Isa>(pool, a);
}
#endif

// Layer `layer` of a stacked operand [L, ...] (scan_layers: the weights of a run of layers, read
// in place instead of sliced out by XLA, which copies a dynamic slice before a custom call):
// its dimensions without L and its data. `stacked` false: the operand as it is.
struct Operand {
  std::vector<int64_t> dims;
  const void* data;
  bool ok;
};

template <class Buffer>
Operand layer_of(const Buffer& b, bool stacked, int64_t layer) {
  auto d = b.dimensions();
  if (!stacked) return {std::vector<int64_t>(d.begin(), d.end()), b.untyped_data(), true};
  if (d.size() < 1 || layer < 0 || layer >= d[0]) return {{}, nullptr, false};
  const size_t per_layer = b.size_bytes() / static_cast<size_t>(d[0]);
  return {std::vector<int64_t>(d.begin() + 1, d.end()),
          static_cast<const char*>(b.untyped_data()) + per_layer * layer, true};
}

ffi::Error BlockMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer codes_in,
                           ffi::Buffer<ffi::F32> scales_in, ffi::Buffer<ffi::F32> mins_in,
                           ffi::Buffer<ffi::S32> layer_in, int32_t block, bool has_mins,
                           bool tiled, bool x_bf16, bool x_q8, bool codes_stacked,
                           bool scales_stacked, ffi::Result<ffi::AnyBuffer> y) {
  const int64_t layer = layer_in.element_count() > 0 ? layer_in.typed_data()[0] : 0;
  const Operand codes = layer_of(codes_in, codes_stacked, layer);
  const Operand scales = layer_of(scales_in, scales_stacked, layer);
  const Operand mins = layer_of(mins_in, scales_stacked && has_mins, layer);
  if (!codes.ok || !scales.ok || !mins.ok) {
    return ffi::Error::InvalidArgument("block_matmul: stacked operand without layer `layer`");
  }
  auto xd = x.dimensions();
  const std::vector<int64_t>& cd = codes.dims;
  const std::vector<int64_t>& sd = scales.dims;
  int64_t scale_count = 1, min_count = 1;
  for (int64_t v : sd) scale_count *= v;
  for (int64_t v : mins.dims) min_count *= v;
  // codes [K, N], or tile-major [N / kCols, K, kCols]
  const bool rank_ok = tiled ? cd.size() == 3 && cd[2] == kCols : cd.size() == 2;
  const int64_t ck = rank_ok ? (tiled ? cd[1] : cd[0]) : -1;
  const int64_t cn = rank_ok ? (tiled ? cd[0] * kCols : cd[1]) : -1;
  if (!rank_ok || xd.size() != 2 || sd.size() != 2 || block < 1 || xd[1] != ck ||
      ck != sd[0] * block || cn != sd[1] ||
      (has_mins && min_count != scale_count) ||
      y->element_count() != xd[0] * cn) {
    return ffi::Error::InvalidArgument(
        "block_matmul: x [M, K], codes [K, N] (tiled: [N / 16, K, 16]), scales (and mins) "
        "[K / block, N], y [M, N]");
  }
  const ffi::DataType dtype = codes_in.element_type();
  if (dtype != ffi::DataType::S8 && dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("block_matmul: codes must be int8, float32 or bfloat16");
  }
  const bool x16 = x.element_type() == ffi::DataType::BF16;
  const bool y16 = y->element_type() == ffi::DataType::BF16;
  if ((!x16 && x.element_type() != ffi::DataType::F32) ||
      (!y16 && y->element_type() != ffi::DataType::F32)) {
    return ffi::Error::InvalidArgument("block_matmul: x and y must be float32 or bfloat16");
  }
  // A bf16 x / y is converted here (vectorized, no pass of XLA's over the activations): the
  // kernel's paths read float32 x (or bf16 rows, x16_rows) and write float32 y.
  std::vector<float> xf, yf;
  const uint16_t* x16_rows = x16 ? static_cast<const uint16_t*>(x.untyped_data()) : nullptr;
  if (y16) yf.resize(xd[0] * cn);
  Problem p{x16 ? nullptr : static_cast<const float*>(x.untyped_data()), codes.data,
            static_cast<const float*>(scales.data),
            has_mins ? static_cast<const float*>(mins.data) : nullptr, nullptr, nullptr,
            y16 ? yf.data() : static_cast<float*>(y->untyped_data()), xd[0], ck, cn, block, tiled};
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  p.x16 = x16_rows;
  const auto finish = [&] {
    if (y16) to_bf16(pool, yf.data(), static_cast<uint16_t*>(y->untyped_data()), p.m * p.n);
    return ffi::Error::Success();
  };
  bool amx = false;
#ifdef TOKENSPEED_AMX_ISA
  amx = amx_eligible(p, dtype, x_bf16 || x16, has_mins) && TOKENSPEED_AMX_ISA::usable();
#endif
  if (x16 && (!amx || p.n % kCols != 0)) {  // every other path (and edge_tile) reads float32 x
    xf.resize(p.m * p.k);
    from_bf16(x16_rows, xf.data(), p.m * p.k);
    p.x = xf.data();
    x_bf16 = dtype == ffi::DataType::BF16;
  }
#ifdef TOKENSPEED_AMX_ISA
  if (amx) {
    run_amx<TOKENSPEED_AMX_ISA>(pool, p);  // the tiles read x16 rows directly
    return finish();
  }
#endif
  std::vector<float> xsum;  // outlives every claimed chunk: parallel_chunks returns when all are done
  if (has_mins) {
    const int64_t groups = p.k / p.block;
    xsum.assign(p.m * groups, 0.0f);
    for (int64_t i = 0; i < p.m; ++i) {
      for (int64_t kk = 0; kk < p.k; ++kk) xsum[i * groups + kk / p.block] += p.x[i * p.k + kk];
    }
    p.xsum = xsum.data();
  }
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
    if (p.x16 == nullptr) xb = bf16_rows(p, p.m, p.k);
    p.xb = p.x16 != nullptr ? p.x16 : xb.data();
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
  return finish();
}

}  // namespace tokenspeed::blockmm

XLA_FFI_DEFINE_HANDLER_SYMBOL(TOKENSPEED_BLOCK_MATMUL_SYMBOL, tokenspeed::blockmm::BlockMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()         // x: f32 or bf16
                                  .Arg<ffi::AnyBuffer>()         // codes: s8, f32 or bf16
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mins
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer: s32[1]
                                  .Attr<int32_t>("block")
                                  .Attr<bool>("has_mins")
                                  .Attr<bool>("tiled")
                                  .Attr<bool>("x_bf16")
                                  .Attr<bool>("x_q8")
                                  .Attr<bool>("codes_stacked")
                                  .Attr<bool>("scales_stacked")
                                  .Ret<ffi::AnyBuffer>());  // y: f32 or bf16
