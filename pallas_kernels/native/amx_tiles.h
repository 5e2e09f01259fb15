// AMX tile instructions behind one interface, with a software model of the same instructions.
//
// `Hw` is the real thing (Intel AMX-TILE + AMX-BF16: Sapphire Rapids and later Xeons), built only
// when the compiler targets it (-march=native on such a CPU defines __AMX_TILE__ / __AMX_BF16__).
// `Model` runs the same instructions in plain C++ on any CPU, from the Intel SDM's pseudocode:
// eight tile registers of 16 rows x 64 bytes, a palette-1 configuration, TDPBF16PS's pair-wise
// float32 accumulation. The kernel in block_matmul.cc is written once against this interface
// (template <class Isa>): built with TOKENSPEED_AMX_MODEL it runs on the model, so its packing,
// VNNI pairs, padding and edges are checked against a float64 oracle on machines without AMX
// (CI's), and the real build runs the same source on the tiles.
//
// Tile numbers are template arguments because the hardware instructions encode them as
// immediates.

#ifndef TOKENSPEED_NATIVE_AMX_TILES_H_
#define TOKENSPEED_NATIVE_AMX_TILES_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TOKENSPEED_HAVE_AMX 1
#endif

namespace tokenspeed::amx {

constexpr int kTiles = 8;         // tile registers
constexpr int kTileRows = 16;     // rows per tile
constexpr int kTileBytes = 64;    // bytes per tile row
constexpr int kPairK = 32;        // bf16 K values per A-tile row (one TDPBF16PS step)

// LDTILECFG's 64-byte memory operand (palette 1).
struct alignas(64) Config {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of tile i
  uint8_t rows[16] = {};    // rows of tile i
};
static_assert(sizeof(Config) == 64, "LDTILECFG reads 64 bytes");

// Every tile 16 rows x 64 bytes: A tiles 16 x 32 bf16, B tiles 16 K pairs x 16 columns x 2 bf16
// (the VNNI layout), C tiles 16 x 16 float32.
inline Config full_tiles() {
  Config c;
  for (int t = 0; t < kTiles; ++t) {
    c.colsb[t] = kTileBytes;
    c.rows[t] = kTileRows;
  }
  return c;
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The software model: the tile registers are this thread's memory (tile state is per thread on
// the hardware too).
struct Model {
  static constexpr const char* kName = "model";
  struct State {
    alignas(64) uint8_t tile[kTiles][kTileRows][kTileBytes];
    Config cfg;
    bool configured = false;
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static bool usable() { return true; }
  static void configure(const Config& c) {
    state().cfg = c;
    state().configured = true;
    std::memset(state().tile, 0, sizeof(state().tile));  // LDTILECFG zeroes the tiles
  }
  static void release() { state().configured = false; }
  template <int T>
  static void zero() {
    std::memset(state().tile[T], 0, sizeof(state().tile[T]));
  }
  // TILELOADD: rows of colsb bytes, `stride` bytes apart
  template <int T>
  static void load(const void* base, int64_t stride) {
    State& s = state();
    const auto* src = static_cast<const uint8_t*>(base);
    std::memset(s.tile[T], 0, sizeof(s.tile[T]));
    for (int r = 0; r < s.cfg.rows[T]; ++r) std::memcpy(s.tile[T][r], src + r * stride, s.cfg.colsb[T]);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    State& s = state();
    auto* dst = static_cast<uint8_t*>(base);
    for (int r = 0; r < s.cfg.rows[T]; ++r) std::memcpy(dst + r * stride, s.tile[T][r], s.cfg.colsb[T]);
  }
  // TDPBF16PS C += A . B: for each row m of C and float32 column n, over the K pairs k of A's
  // row: C[m][n] += A[m][2k] * B[k][2n] + A[m][2k + 1] * B[k][2n + 1], each product and sum in
  // float32, pairs in K order (the SDM's loop; DAZ / FTZ aside).
  template <int C, int A, int B>
  static void dpbf16() {
    State& s = state();
    const int rows = s.cfg.rows[C], cols = s.cfg.colsb[C] / 4, pairs = s.cfg.colsb[A] / 4;
    for (int m = 0; m < rows; ++m) {
      float acc[kTileBytes / 4];
      std::memcpy(acc, s.tile[C][m], sizeof(acc));
      uint16_t a[kTileBytes / 2];
      std::memcpy(a, s.tile[A][m], sizeof(a));
      for (int k = 0; k < pairs; ++k) {
        uint16_t b[kTileBytes / 2];
        std::memcpy(b, s.tile[B][k], sizeof(b));
        const float a0 = bf16_to_float(a[2 * k]), a1 = bf16_to_float(a[2 * k + 1]);
        for (int n = 0; n < cols; ++n) {
          acc[n] += a0 * bf16_to_float(b[2 * n]);
          acc[n] += a1 * bf16_to_float(b[2 * n + 1]);
        }
      }
      std::memcpy(s.tile[C][m], acc, sizeof(acc));
    }
  }
};

#ifdef TOKENSPEED_HAVE_AMX
// The hardware. Linux hands a process the tile data state only on request
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); `usable()` asks once, and the kernel
// falls back to the AVX-512 path when the kernel says no (or TOKENSPEED_JAX_AMX=0).
struct Hw {
  static constexpr const char* kName = "hw";
  static bool usable() {
    static const bool granted = [] {
      constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
      constexpr long kXtiledata = 18;         // XFEATURE_XTILEDATA
      return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
    }();
    // read per call (a product costs far more): benchmarks compare both paths in one process
    const char* env = std::getenv("TOKENSPEED_JAX_AMX");
    return granted && (env == nullptr || std::strcmp(env, "0") != 0);
  }
  static void configure(const Config& c) { _tile_loadconfig(&c); }
  static void release() { _tile_release(); }
  // GCC's tile intrinsics paste their tile argument into the instruction's text (%%tmm##T), so
  // each tile number is spelled out.
#define TOKENSPEED_TILE_CASES(OP)         \
  if constexpr (T == 0) {                 \
    OP(0);                                \
  } else if constexpr (T == 1) {          \
    OP(1);                                \
  } else if constexpr (T == 2) {          \
    OP(2);                                \
  } else if constexpr (T == 3) {          \
    OP(3);                                \
  } else if constexpr (T == 4) {          \
    OP(4);                                \
  } else if constexpr (T == 5) {          \
    OP(5);                                \
  } else if constexpr (T == 6) {          \
    OP(6);                                \
  } else {                                \
    static_assert(T == 7, "tiles 0-7");   \
    OP(7);                                \
  }
  template <int T>
  static void zero() {
#define TOKENSPEED_OP(t) _tile_zero(t)
    TOKENSPEED_TILE_CASES(TOKENSPEED_OP)
#undef TOKENSPEED_OP
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
#define TOKENSPEED_OP(t) _tile_loadd(t, base, stride)
    TOKENSPEED_TILE_CASES(TOKENSPEED_OP)
#undef TOKENSPEED_OP
  }
  template <int T>
  static void store(void* base, int64_t stride) {
#define TOKENSPEED_OP(t) _tile_stored(t, base, stride)
    TOKENSPEED_TILE_CASES(TOKENSPEED_OP)
#undef TOKENSPEED_OP
  }
#undef TOKENSPEED_TILE_CASES
  // the four products of amx_matmul.h's 2 x 2 block of C tiles
  template <int C, int A, int B>
  static void dpbf16() {
    if constexpr (C == 0 && A == 4 && B == 6) {
      _tile_dpbf16ps(0, 4, 6);
    } else if constexpr (C == 1 && A == 4 && B == 7) {
      _tile_dpbf16ps(1, 4, 7);
    } else if constexpr (C == 2 && A == 5 && B == 6) {
      _tile_dpbf16ps(2, 5, 6);
    } else {
      static_assert(C == 3 && A == 5 && B == 7, "add the tile triple here");
      _tile_dpbf16ps(3, 5, 7);
    }
  }
};
#endif

}  // namespace tokenspeed::amx

#endif  // TOKENSPEED_NATIVE_AMX_TILES_H_
