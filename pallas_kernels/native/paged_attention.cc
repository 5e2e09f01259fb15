// Paged attention on the CPU: an XLA FFI custom call (XLA:CPU) over blocks of query tokens.
//
// The jnp reference walks a decode token's pages in a traced loop, and gathers a prefill
// block's K/V into one array before its dots; XLA:CPU runs each loop iteration as ~10 small
// thunks, and 30 layers x (context / 32) iterations of them cost more than the K/V they read
// (docs/performance.md, "CPU attention"). Here a block of up to `bq` consecutive query tokens
// of one request reads each of its pages once: K transposed into a [D, page] tile, the block's
// logits [rows, page] as rank-1 updates (no horizontal sums), an online softmax per query row,
// then P @ V. Blocks x KV heads are split over XLA's intra-op threads.
//
// Inputs (shapes checked by the Python wrapper, pallas_kernels/paged_attention_cpu.py):
//   q          f32[T, Hq, D]            query rows
//   k/v pages  [P, page, Hkv, D]        f32, bf16 (or its u16 bits), int8, or fp8 e4m3 (or u8 bits)
//   k/v scales u16[P, page, Hkv]        f16 bits (quantized kinds only; else any 1-element array)
//   table      i32[S, W]                page table rows
//   meta       i32[4, NB]               per block: request row, first token, end token (exclusive),
//                                       position offset (absolute position = token + offset);
//                                       an empty block (first >= end) gives zeros
//   sinks      f32[Hq] or f32[1]        per-head sink logits (has_sinks)
// Attributes: scale, window (0 = full), soft_cap (0 = none), kv_kind (KvKind), has_sinks, bq.
// Output f32[NB, bq, Hq, D] (rows past a block's end are zeros). Only keys at positions
// [max(0, first position - window + 1), last position] of a block are read: every one of them
// is real (written before the step's attention), so NaN garbage in the null page, unused pages
// and rows past the block never reaches it; per query row the keys outside its own
// [pos - window + 1, pos] get weight 0 through a -inf logit, never a multiply.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum KvKind : int32_t { kF32 = 0, kBf16 = 1, kInt8 = 3, kFp8 = 4 };

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: man * 2^-24
    float f = std::ldexp(static_cast<float>(man), -24);
    return sign ? -f : f;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7f / 0xff are NaN, no inf.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      int sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 7;
      float f;
      if (exp == 0xf && man == 7) {
        f = std::numeric_limits<float>::quiet_NaN();
      } else if (exp == 0) {
        f = std::ldexp(static_cast<float>(man), -9);
      } else {
        f = std::ldexp(1.0f + man / 8.0f, exp - 7);
      }
      v[b] = sign ? -f : f;
    }
  }
};
const Fp8Table kFp8Values;

// exp(x) for x <= 0 (logit - running max), vectorizable: Cephes' expf polynomial on
// x - n ln2, times 2^n built from bits (|rel. error| ~1e-7). x < -87 gives 0 (e^-87 ~ 1e-38,
// below what an f32 softmax weight can hold beside the max's 1); NaN stays NaN.
inline float exp_nonpositive(float x) {
  const float in = x;
  x = x < -87.0f ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  const float two_n = __builtin_bit_cast(float, bits);
  const float out = y * two_n;
  return in < -87.0f ? 0.0f : (in != in ? in : out);
}

#ifdef __AVX2__
// exp_nonpositive on 8 lanes (GCC leaves the scalar one unvectorized: the NaN select).
inline __m256 exp_nonpositive8(__m256 in) {
  const __m256 x = _mm256_max_ps(in, _mm256_set1_ps(-87.0f));  // NaN -> -87, restored below
  const __m256 n = _mm256_floor_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(y, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 out = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  out = _mm256_blendv_ps(out, _mm256_setzero_ps(),
                         _mm256_cmp_ps(in, _mm256_set1_ps(-87.0f), _CMP_LT_OQ));
  return _mm256_blendv_ps(out, in, _mm256_cmp_ps(in, in, _CMP_UNORD_Q));
}
#endif

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const uint16_t* ks;
  const uint16_t* vs;
  const int32_t* table;
  const int32_t* meta;  // [4, nb]
  const float* sinks;
  float* out;
  int64_t num_pages, page, hkv, d, hq, width, nb, bq;
  float scale, soft_cap;
  int32_t window;
};

// Row `srow` (a page row of one head) of a pool as float: a pointer into a float32 pool, else
// the row converted into `tmp`.
template <int KIND>
inline const float* row_of(const void* pool, const uint16_t* scales, int64_t srow, int64_t d,
                           float* tmp) {
  const int64_t off = srow * d;
  if constexpr (KIND == kF32) {
    return static_cast<const float*>(pool) + off;
  } else if constexpr (KIND == kBf16) {
    const uint16_t* p = static_cast<const uint16_t*>(pool) + off;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) tmp[i] = bf16_to_f32(p[i]);
  } else if constexpr (KIND == kInt8) {
    const int8_t* p = static_cast<const int8_t*>(pool) + off;
    const float s = f16_to_f32(scales[srow]);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) tmp[i] = static_cast<float>(p[i]) * s;
  } else {
    const uint8_t* p = static_cast<const uint8_t*>(pool) + off;
    const float s = f16_to_f32(scales[srow]);
    for (int64_t i = 0; i < d; ++i) tmp[i] = kFp8Values.v[p[i]] * s;
  }
  return tmp;
}

// Scratch of one thread, sized for the problem.
struct Scratch {
  std::vector<float> kt, vrows, row, lg, m, den, acc, zero;
  std::vector<const float*> kptr, vptr;
  Scratch(const Problem& p) {
    vptr.resize(p.page);           // the page's V rows as float
    kptr.resize(p.page + 8);       // the page's K rows as float, then `zero` up to a multiple of 8
    zero.resize(p.d);              // a key of zeros: the decode logits' stand-in past nr
    const int64_t rows = p.bq * (p.hq / p.hkv);
    kt.resize(p.d * p.page);       // K of one page, transposed: [D, page] (decode: its rows)
    vrows.resize(p.page * p.d);    // V of one page (converted kinds)
    row.resize(p.d);               // one converted K row
    lg.resize(rows * (p.page + 8));  // logits, then weights, of one page: [rows, page (+8)]
    m.resize(rows);                // running max
    den.resize(rows);              // denominator
    acc.resize(rows * p.d);        // numerator
  }
};

// Running softmax state of `rows` query rows (row = token * group + g, g the head in the KV
// head's group) starts at the sink, a key with logit `sink` and value 0 seen first, or empty.
inline void init_rows(const Problem& p, int64_t h, int64_t rows, float* m, float* den) {
  const int64_t group = p.hq / p.hkv;
  for (int64_t row = 0; row < rows; ++row) {
    if (p.sinks != nullptr) {
      m[row] = p.sinks[h * group + row % group];
      den[row] = 1.0f;
    } else {
      m[row] = -std::numeric_limits<float>::infinity();
      den[row] = 0.0f;
    }
  }
}

// One page's logits l[0, nr) of one query row (-inf where masked) -> softmax weights in place,
// folding the page into the row's running max `m`, denominator `den` and numerator acc[0, d).
inline void online_softmax(float* l, int64_t nr, float& m, float& den, float* acc, int64_t d) {
  float mx = m;
#pragma omp simd reduction(max : mx)
  for (int64_t r = 0; r < nr; ++r) mx = std::max(mx, l[r]);
  if (mx == -std::numeric_limits<float>::infinity()) {  // nothing visible yet
    for (int64_t r = 0; r < nr; ++r) l[r] = 0.0f;
    return;
  }
  const float corr = std::isfinite(m) ? std::exp(m - mx) : 0.0f;
  m = mx;
  float sum = 0.0f;
  int64_t r0 = 0;
#ifdef __AVX2__
  __m256 vsum = _mm256_setzero_ps();
  const __m256 vmx = _mm256_set1_ps(mx);
  for (; r0 + 8 <= nr; r0 += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(l + r0), vmx));
    _mm256_storeu_ps(l + r0, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vsum);
  for (float f : lanes) sum += f;
#endif
  for (int64_t r = r0; r < nr; ++r) {
    l[r] = exp_nonpositive(l[r] - mx);
    sum += l[r];
  }
  den = den * corr + sum;
  if (corr != 1.0f) {
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) acc[j] *= corr;
  }
}

// out[0, d) = acc / den (zeros for a row that saw no key).
inline void normalize_row(const float* acc, float den, float* out, int64_t d) {
  const float inv = den > 0.0f ? 1.0f / den : 0.0f;
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) out[j] = acc[j] * inv;
}

// A one-token block (decodes, short drafts), one KV head: each visible K row is read once and
// dotted with the group's query heads (cheaper for a few rows than transposing a tile).
template <int KIND>
void attend_token(const Problem& p, int64_t n, int64_t h, Scratch& s) {
  const int64_t group = p.hq / p.hkv, d = p.d, ps = p.page;
  float* out = p.out + (n * p.bq * p.hq + h * group) * d;
  const int32_t q0 = p.meta[p.nb + n];
  if (q0 >= p.meta[2 * p.nb + n]) {
    std::fill(out, out + group * d, 0.0f);
    return;
  }
  const int64_t position = static_cast<int64_t>(q0) + p.meta[3 * p.nb + n];
  const int64_t seq = p.meta[n];
  const float* q = p.q + (static_cast<int64_t>(q0) * p.hq + h * group) * d;
  float* ktmp = s.row.data();
  float* vtmp = s.vrows.data();
  float* m = s.m.data();  // [group] running max
  float* den = s.den.data();  // [group] denominator
  float* lg = s.lg.data();  // [group, page] logits, then weights, of one page
  float* acc = out;         // [group, d] numerator, normalised at the end
  std::fill(acc, acc + group * d, 0.0f);
  init_rows(p, h, group, m, den);
  const int64_t first_pos = p.window > 0 ? std::max<int64_t>(0, position - p.window + 1) : 0;
  const int32_t* row = p.table + seq * p.width;
  const int64_t last_col = std::min<int64_t>(position / ps, p.width - 1);
  for (int64_t col = first_pos / ps; col <= last_col; ++col) {
    const int64_t page = row[col];
    if (page < 0 || page >= p.num_pages) continue;  // never: the host hands valid ids
    const int64_t r0 = std::max<int64_t>(0, first_pos - col * ps);
    const int64_t r1 = std::min<int64_t>(ps, position - col * ps + 1);
    const int64_t nr = r1 - r0;
    if (nr <= 0) continue;
    for (int64_t r = 0; r < nr; ++r) {
      const float* k = row_of<KIND>(p.k, p.ks, (page * ps + r0 + r) * p.hkv + h, d, ktmp);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * d;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < d; ++i) s += qg[i] * k[i];
        lg[g * ps + r] = s * p.scale;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* l = lg + g * ps;
      if (p.soft_cap > 0.0f) {
        for (int64_t r = 0; r < nr; ++r) l[r] = p.soft_cap * std::tanh(l[r] / p.soft_cap);
      }
      online_softmax(l, nr, m[g], den[g], acc + g * d, d);
    }
    for (int64_t r = 0; r < nr; ++r) {
      const float* v = row_of<KIND>(p.v, p.vs, (page * ps + r0 + r) * p.hkv + h, d, vtmp);
      for (int64_t g = 0; g < group; ++g) {
        const float e = lg[g * ps + r];
        float* a = acc + g * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) a[i] += e * v[i];
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) normalize_row(acc + g * d, den[g], acc + g * d, d);
}

constexpr int64_t kRowBlock = 6;  // query rows per logits tile

// l[k, 0:ps] = qr[k] . kt[:, 0:ps] for k < n (kt is K transposed, [d, ps]). With PS (the
// page size) known the kRowBlock x PS partial sums fit in vector registers across the d loop.
template <int PS>
inline void logits_tile(const float* const* qr, const float* kt, int64_t d, int64_t ps, float* l,
                        int64_t n) {
  if constexpr (PS > 0) {
    float t[kRowBlock][PS] = {};
    for (int64_t j = 0; j < d; ++j) {
      const float* kj = kt + j * PS;
      for (int64_t k = 0; k < kRowBlock; ++k) {
        const float qj = qr[k][j];
#pragma omp simd
        for (int64_t r = 0; r < PS; ++r) t[k][r] += qj * kj[r];
      }
    }
    for (int64_t k = 0; k < n; ++k) std::memcpy(l + k * PS, t[k], sizeof(t[k]));
  } else {
    for (int64_t k = 0; k < n; ++k) {
      float* lk = l + k * ps;
      std::fill_n(lk, ps, 0.0f);
      for (int64_t j = 0; j < d; ++j) {
        const float qj = qr[k][j];
        const float* kj = kt + j * ps;
#pragma omp simd
        for (int64_t r = 0; r < ps; ++r) lk[r] += qj * kj[r];
      }
    }
  }
}

#ifdef __AVX2__
// acc[NR, d] += w[NR, 0:nr] @ V[0:nr, d] (w rows `ps` apart, V rows vr[r], d a multiple of 16):
// 16 columns of NR rows accumulate in registers over all nr keys, so each accumulator is loaded
// and stored once per page, not once per key pair (the loop was load/store bound).
template <int NR>
inline void pv_rows(const float* w, int64_t ps, const float* const* vr, int64_t nr, float* acc,
                    int64_t d) {
  for (int64_t c = 0; c < d; c += 16) {
    __m256 a[NR][2];
    for (int k = 0; k < NR; ++k) {
      a[k][0] = _mm256_loadu_ps(acc + k * d + c);
      a[k][1] = _mm256_loadu_ps(acc + k * d + c + 8);
    }
    for (int64_t r = 0; r < nr; ++r) {
      const __m256 v0 = _mm256_loadu_ps(vr[r] + c), v1 = _mm256_loadu_ps(vr[r] + c + 8);
      for (int k = 0; k < NR; ++k) {
        const __m256 e = _mm256_broadcast_ss(w + k * ps + r);
        a[k][0] = _mm256_fmadd_ps(e, v0, a[k][0]);
        a[k][1] = _mm256_fmadd_ps(e, v1, a[k][1]);
      }
    }
    for (int k = 0; k < NR; ++k) {
      _mm256_storeu_ps(acc + k * d + c, a[k][0]);
      _mm256_storeu_ps(acc + k * d + c + 8, a[k][1]);
    }
  }
}

// pv_rows over all `rows` rows (weights `ps` apart): passes of 6, then the 1-5 left over.
inline void pv_all_rows(const float* w, int64_t ps, const float* const* vr, int64_t nr, float* acc,
                        int64_t rows, int64_t d) {
  int64_t row0 = 0;
  for (; row0 + 6 <= rows; row0 += 6) pv_rows<6>(w + row0 * ps, ps, vr, nr, acc + row0 * d, d);
  switch (rows - row0) {
    case 5: pv_rows<5>(w + row0 * ps, ps, vr, nr, acc + row0 * d, d); break;
    case 4: pv_rows<4>(w + row0 * ps, ps, vr, nr, acc + row0 * d, d); break;
    case 3: pv_rows<3>(w + row0 * ps, ps, vr, nr, acc + row0 * d, d); break;
    case 2: pv_rows<2>(w + row0 * ps, ps, vr, nr, acc + row0 * d, d); break;
    case 1: pv_rows<1>(w + row0 * ps, ps, vr, nr, acc + row0 * d, d); break;
    default: break;
  }
}
#endif

#ifdef __AVX2__
// The horizontal sums of a[0..8), in order, as one vector.
inline __m256 hsum8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // s0123 = [a0..a3 over lanes 0-3 | a0..a3 over lanes 4-7], s4567 likewise
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// A one-token block on AVX2 (d a multiple of 16), one KV head: per page, the group's logits
// as dot products of 8 keys at a time (partial sums in registers, one horizontal-sum tree per
// 8 keys, not one per key), then P @ V with the accumulators in registers (pv_rows). The
// scalar attend_token reduced every dot on its own and streamed its accumulators through L1
// once per key: it took a quarter of a served SmolLM2 run's CPU (docs/performance.md).
template <int KIND>
void attend_token_avx2(const Problem& p, int64_t n, int64_t h, Scratch& s) {
  const int64_t group = p.hq / p.hkv, d = p.d, ps = p.page;
  const int64_t lps = (ps + 7) / 8 * 8;  // logits row stride: whole vectors of 8 keys
  float* out = p.out + (n * p.bq * p.hq + h * group) * d;
  const int32_t q0 = p.meta[p.nb + n];
  if (q0 >= p.meta[2 * p.nb + n]) {
    std::fill(out, out + group * d, 0.0f);
    return;
  }
  const int64_t position = static_cast<int64_t>(q0) + p.meta[3 * p.nb + n];
  const int64_t seq = p.meta[n];
  const float* q = p.q + (static_cast<int64_t>(q0) * p.hq + h * group) * d;
  float* m = s.m.data();
  float* den = s.den.data();
  float* lg = s.lg.data();  // [group, lps]
  float* acc = out;         // [group, d] numerator, normalised at the end
  const float** kr = s.kptr.data();
  const float** vr = s.vptr.data();
  std::fill(acc, acc + group * d, 0.0f);
  init_rows(p, h, group, m, den);
  const int64_t first_pos = p.window > 0 ? std::max<int64_t>(0, position - p.window + 1) : 0;
  const int32_t* row = p.table + seq * p.width;
  const int64_t last_col = std::min<int64_t>(position / ps, p.width - 1);
  for (int64_t col = first_pos / ps; col <= last_col; ++col) {
    const int64_t page = row[col];
    if (page < 0 || page >= p.num_pages) continue;  // never: the host hands valid ids
    const int64_t r0 = std::max<int64_t>(0, first_pos - col * ps);
    const int64_t r1 = std::min<int64_t>(ps, position - col * ps + 1);
    const int64_t nr = r1 - r0;
    if (nr <= 0) continue;
    for (int64_t r = 0; r < nr; ++r) {
      kr[r] = row_of<KIND>(p.k, p.ks, (page * ps + r0 + r) * p.hkv + h, d, s.kt.data() + r * d);
    }
    const int64_t nr8 = (nr + 7) / 8 * 8;
    for (int64_t r = nr; r < nr8; ++r) kr[r] = s.zero.data();
    const __m256 vscale = _mm256_set1_ps(p.scale);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      for (int64_t r8 = 0; r8 < nr8; r8 += 8) {
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; c += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + c);
          for (int i = 0; i < 8; ++i) {
            a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[r8 + i] + c), a[i]);
          }
        }
        _mm256_storeu_ps(lg + g * lps + r8, _mm256_mul_ps(hsum8(a), vscale));
      }
      float* l = lg + g * lps;
      if (p.soft_cap > 0.0f) {
        for (int64_t r = 0; r < nr; ++r) l[r] = p.soft_cap * std::tanh(l[r] / p.soft_cap);
      }
      online_softmax(l, nr, m[g], den[g], acc + g * d, d);
    }
    for (int64_t r = 0; r < nr; ++r) {
      vr[r] = row_of<KIND>(p.v, p.vs, (page * ps + r0 + r) * p.hkv + h, d, s.vrows.data() + r * d);
    }
    pv_all_rows(lg, lps, vr, nr, acc, group, d);
  }
  for (int64_t g = 0; g < group; ++g) normalize_row(acc + g * d, den[g], acc + g * d, d);
}
#endif

// Block `b` (tokens meta[1][b] .. meta[2][b] - 1 of request meta[0][b]), KV head `h`: its
// `group` query heads x tokens share every K/V row read. PS = the page size when it is a
// compile-time constant (16: fixed-width tile loops), else 0.
template <int KIND, int PS>
void attend_block(const Problem& p, int64_t b, int64_t h, Scratch& s) {
  const int64_t group = p.hq / p.hkv, d = p.d;
  const int64_t ps = PS > 0 ? PS : p.page;
  const int32_t seq = p.meta[b], q0 = p.meta[p.nb + b], q1 = p.meta[2 * p.nb + b];
  const int32_t pos_off = p.meta[3 * p.nb + b];
  const int64_t nq = std::max<int64_t>(0, std::min<int64_t>(q1 - q0, p.bq));
  for (int64_t i = 0; i < p.bq; ++i) {  // rows past the block's end: zeros
    if (i < nq) continue;
    std::fill_n(p.out + ((b * p.bq + i) * p.hq + h * group) * d, group * d, 0.0f);
  }
  if (nq == 0) return;
  const int64_t rows = nq * group;  // row = i * group + g
  float* lg = s.lg.data();
  float* m = s.m.data();
  float* den = s.den.data();
  float* acc = s.acc.data();
  float* kt = s.kt.data();
  // query row `row` (token row / group, head h * group + row % group)
  auto q_row = [&](int64_t row) {
    return p.q + ((static_cast<int64_t>(q0) + row / group) * p.hq + h * group + row % group) * d;
  };
  std::fill_n(acc, rows * d, 0.0f);
  init_rows(p, h, rows, m, den);
  const int64_t pos_first = static_cast<int64_t>(q0) + pos_off;
  const int64_t pos_last = pos_first + nq - 1;
  const int64_t lo = p.window > 0 ? std::max<int64_t>(0, pos_first - p.window + 1) : 0;
  const int32_t* trow = p.table + static_cast<int64_t>(seq) * p.width;
  const int64_t last_col = std::min<int64_t>(pos_last / ps, p.width - 1);
  for (int64_t col = lo / ps; col <= last_col; ++col) {
    const int64_t page = trow[col];
    if (page < 0 || page >= p.num_pages) continue;  // never: the host hands valid ids
    const int64_t r0 = std::max<int64_t>(0, lo - col * ps);
    const int64_t r1 = std::min<int64_t>(ps, pos_last - col * ps + 1);
    const int64_t nr = r1 - r0;
    if (nr <= 0) continue;
    // K rows [r0, r1) -> tile columns [0, nr) of kt [D, ps]; the other columns are zeros (their
    // logits are masked below), so the tile loops run the full fixed width
    for (int64_t r = nr; r < ps; ++r) {
      for (int64_t j = 0; j < d; ++j) kt[j * ps + r] = 0.0f;
    }
    for (int64_t r = 0; r < nr; ++r) {
      const float* k = row_of<KIND>(p.k, p.ks, (page * ps + r0 + r) * p.hkv + h, d, s.row.data());
      for (int64_t j = 0; j < d; ++j) kt[j * ps + r] = k[j];
    }
    // logits [rows, ps] = q rows @ kt, kRowBlock rows at a time (PS > 0: their partial sums stay
    // in registers and share each K tile row's loads)
    const int64_t key0 = col * ps + r0;  // absolute position of the tile's first key
    for (int64_t row0 = 0; row0 < rows; row0 += kRowBlock) {
      const int64_t n = std::min<int64_t>(kRowBlock, rows - row0);
      const float* qr[kRowBlock];
      for (int64_t k = 0; k < kRowBlock; ++k) qr[k] = q_row(std::min(row0 + k, rows - 1));
      logits_tile<PS>(qr, kt, d, ps, lg + row0 * ps, n);
    }
    // every row sees every key of the tile (below the block's first position, inside every
    // row's window): no mask, and without a soft cap only the scale (vectorized)
    const bool open = key0 + nr - 1 <= pos_first && (p.window <= 0 || key0 > pos_last - p.window);
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t pos = pos_first + row / group;
      float* l = lg + row * ps;
      if (open && p.soft_cap <= 0.0f) {
        const float scale = p.scale;
#pragma omp simd
        for (int64_t r = 0; r < nr; ++r) l[r] *= scale;
      } else {
        for (int64_t r = 0; r < nr; ++r) {
          float x = l[r] * p.scale;
          if (p.soft_cap > 0.0f) x = p.soft_cap * std::tanh(x / p.soft_cap);
          const int64_t kp = key0 + r;
          const bool keep = kp <= pos && (p.window <= 0 || kp > pos - p.window);
          l[r] = keep ? x : -std::numeric_limits<float>::infinity();
        }
      }
      online_softmax(l, nr, m[row], den[row], acc + row * d, d);
    }
    const float** vr = s.vptr.data();
    for (int64_t r = 0; r < nr; ++r) {
      vr[r] = row_of<KIND>(p.v, p.vs, (page * ps + r0 + r) * p.hkv + h, d, s.vrows.data() + r * d);
    }
#ifdef __AVX2__
    if (d % 16 == 0) {  // acc [rows, d] += weights [rows, nr] @ V [nr, d], 6 x 16 at a time
      pv_all_rows(lg, ps, vr, nr, acc, rows, d);
      continue;
    }
#endif
    // acc rows += weights @ V rows, two V rows at a time: they stay in registers while each
    // accumulator row streams through L1 once per pair
    int64_t r = 0;
    for (; r + 2 <= nr; r += 2) {
      const float* v0 = vr[r];
      const float* v1 = vr[r + 1];
      for (int64_t row = 0; row < rows; ++row) {
        const float e0 = lg[row * ps + r], e1 = lg[row * ps + r + 1];
        if (e0 == 0.0f && e1 == 0.0f) continue;  // masked: skip the work
        float* a = acc + row * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) a[j] += e0 * v0[j] + e1 * v1[j];
      }
    }
    for (; r < nr; ++r) {
      const float* v = vr[r];
      for (int64_t row = 0; row < rows; ++row) {
        const float e = lg[row * ps + r];
        if (e == 0.0f) continue;
        float* a = acc + row * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) a[j] += e * v[j];
      }
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t i = row / group, g = row % group;
    normalize_row(acc + row * d, den[row], p.out + ((b * p.bq + i) * p.hq + h * group + g) * d, d);
  }
}

using AttendFn = void (*)(const Problem&, int64_t, int64_t, Scratch&);

template <int KIND>
AttendFn attend_of(int64_t bq, int64_t page, int64_t d) {
#ifdef __AVX2__
  if (bq == 1 && d % 16 == 0) return attend_token_avx2<KIND>;
#endif
  if (bq == 1) return attend_token<KIND>;
  return page == 16 ? attend_block<KIND, 16> : attend_block<KIND, 0>;
}

AttendFn attend_for(int32_t kind, int64_t bq, int64_t page, int64_t d) {
  switch (kind) {
    case kF32: return attend_of<kF32>(bq, page, d);
    case kBf16: return attend_of<kBf16>(bq, page, d);
    case kInt8: return attend_of<kInt8>(bq, page, d);
    case kFp8: return attend_of<kFp8>(bq, page, d);
    default: return nullptr;
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                              ffi::AnyBuffer k_scales, ffi::AnyBuffer v_scales,
                              ffi::Buffer<ffi::S32> table, ffi::Buffer<ffi::S32> meta,
                              ffi::Buffer<ffi::F32> sinks, float scale, int32_t window,
                              float soft_cap, int32_t kv_kind, bool has_sinks, int32_t bq,
                              ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = table.dimensions();
  auto md = meta.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || md.size() != 2 || md[0] != 4 ||
      bq < 1 || out->element_count() != md[1] * bq * qd[1] * qd[2]) {
    return ffi::Error::InvalidArgument(
        "paged_attention: q must be 3-D, pages 4-D, table 2-D, meta [4, NB], out [NB, bq, Hq, D]");
  }
  Problem p;
  p.q = q.typed_data();
  p.k = k_pages.untyped_data();
  p.v = v_pages.untyped_data();
  p.ks = static_cast<const uint16_t*>(k_scales.untyped_data());
  p.vs = static_cast<const uint16_t*>(v_scales.untyped_data());
  p.table = table.typed_data();
  p.meta = meta.typed_data();
  p.sinks = has_sinks ? sinks.typed_data() : nullptr;
  p.out = out->typed_data();
  p.num_pages = kd[0];
  p.page = kd[1];
  p.hkv = kd[2];
  p.d = kd[3];
  p.hq = qd[1];
  p.width = td[1];
  p.nb = md[1];
  p.bq = bq;
  p.scale = scale;
  p.soft_cap = soft_cap;
  p.window = window;
  const AttendFn attend = attend_for(kv_kind, p.bq, p.page, p.d);
  if (attend == nullptr) return ffi::Error::InvalidArgument("paged_attention: kv_kind");
  // real blocks come first (block_metadata): the items end at the last non-empty block
  int64_t real = p.nb;
  while (real > 0 && p.meta[p.nb + real - 1] >= p.meta[2 * p.nb + real - 1]) --real;
  if (real < p.nb) {
    std::fill_n(p.out + real * p.bq * p.hq * p.d, (p.nb - real) * p.bq * p.hq * p.d, 0.0f);
  }
  // a thread per ~8 blocks' worth of work (a decode block is one token, a prefill block bq);
  // chunks of one block's heads: its page-table row and query rows stay hot
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), real * p.bq / 8));
  tokenspeed::parallel_chunks(pool, real * p.hkv, p.hkv, threads, [p, attend] {
    return [p, attend, scratch = std::make_shared<Scratch>(p)](int64_t b, int64_t e) {
      for (int64_t item = b; item < e; ++item) attend(p, item / p.hkv, item % p.hkv, *scratch);
    };
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenspeedPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::AnyBuffer>()         // k_scales
                                  .Arg<ffi::AnyBuffer>()         // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // meta
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("kv_kind")
                                  .Attr<bool>("has_sinks")
                                  .Attr<int32_t>("bq")
                                  .Ret<ffi::Buffer<ffi::F32>>());
