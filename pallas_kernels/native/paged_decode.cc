// Paged attention of single query tokens on the CPU: an XLA FFI custom call (XLA:CPU).
//
// The jnp reference walks a decode token's pages in a traced loop; XLA:CPU runs each iteration
// as ~10 small thunks, and 30 layers x (context / 32) iterations of them cost more than the
// K/V they read (docs/performance.md, "CPU attention"). Here each token reads its own pages
// once, row by row, with an online softmax per page, in plain C++.
//
// Inputs (shapes checked by the Python wrapper, pallas_kernels/paged_attention_cpu.py):
//   q          f32[T, Hq, D]           query rows
//   k/v pages  [P, page, Hkv, D]        f32, bf16 (or its u16 bits), int8, or fp8 e4m3 (or u8 bits)
//   k/v scales u16[P, page, Hkv]        f16 bits (quantized kinds only; else any 1-element array)
//   table      i32[S, W]                page table rows
//   tok        i32[N]                   row of q each token reads
//   seq        i32[N]                   page-table row of each token
//   pos        i32[N]                   absolute position of each token; -1 = padding (zeros)
//   sinks      f32[Hq] or f32[1]        per-head sink logits (has_sinks)
// Attributes: scale, window (0 = full), soft_cap (0 = none), kv_kind (KvKind), has_sinks.
// Output f32[N, Hq, D]. Only rows at positions [max(0, pos - window + 1), pos] are read, so
// NaN garbage in the null page, unused pages and rows past a token's position never reaches it.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

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

struct Problem {
  const float* q;
  const void* k;
  const void* v;
  const uint16_t* ks;
  const uint16_t* vs;
  const int32_t* table;
  const int32_t* tok;
  const int32_t* seq;
  const int32_t* pos;
  const float* sinks;
  float* out;
  int64_t num_pages, page, hkv, d, hq, width;
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

// One token, one KV head: `group` query heads share each K/V row read. `buf` holds
// 2 * d + 2 * group + group * page floats.
template <int KIND>
void attend(const Problem& p, int64_t n, int64_t h, float* buf) {
  const int64_t group = p.hq / p.hkv, d = p.d, ps = p.page;
  float* out = p.out + (n * p.hq + h * group) * d;
  const int32_t position = p.pos[n];
  if (position < 0) {
    std::fill(out, out + group * d, 0.0f);
    return;
  }
  const float* q = p.q + (static_cast<int64_t>(p.tok[n]) * p.hq + h * group) * d;
  float* ktmp = buf;
  float* vtmp = buf + d;
  float* m = buf + 2 * d;  // [group] running max
  float* den = m + group;  // [group] denominator
  float* lg = den + group;  // [group, page] logits, then weights, of one page
  float* acc = out;         // [group, d] numerator, normalised at the end
  std::fill(acc, acc + group * d, 0.0f);
  for (int64_t g = 0; g < group; ++g) {
    if (p.sinks != nullptr) {  // a key with logit `sink` and value 0, seen first
      m[g] = p.sinks[h * group + g];
      den[g] = 1.0f;
    } else {
      m[g] = -std::numeric_limits<float>::infinity();
      den[g] = 0.0f;
    }
  }
  const int64_t first_pos = p.window > 0 ? std::max<int64_t>(0, position - p.window + 1) : 0;
  const int32_t* row = p.table + static_cast<int64_t>(p.seq[n]) * p.width;
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
      float mx = m[g];
      for (int64_t r = 0; r < nr; ++r) mx = std::max(mx, l[r]);
      const float corr = std::isfinite(m[g]) ? std::exp(m[g] - mx) : 0.0f;
      m[g] = mx;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t r = 0; r < nr; ++r) {
        l[r] = exp_nonpositive(l[r] - mx);
        sum += l[r];
      }
      den[g] = den[g] * corr + sum;
      if (corr != 1.0f) {
        float* a = acc + g * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) a[i] *= corr;
      }
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
  for (int64_t g = 0; g < group; ++g) {
    const float inv = den[g] > 0.0f ? 1.0f / den[g] : 0.0f;
    float* a = acc + g * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) a[i] *= inv;
  }
}

using AttendFn = void (*)(const Problem&, int64_t, int64_t, float*);

AttendFn attend_for(int32_t kind) {
  switch (kind) {
    case kF32: return attend<kF32>;
    case kBf16: return attend<kBf16>;
    case kInt8: return attend<kInt8>;
    case kFp8: return attend<kFp8>;
    default: return nullptr;
  }
}

// Work shared by the calling thread and the intra-op pool's tasks: (token, head) items claimed
// in chunks. The caller claims chunks too and returns once every item is done, so it never
// waits on a task the pool has not started (another step may hold the pool's threads); a task
// that starts after that finds nothing left and only drops its reference.
struct Shared {
  Problem p;
  AttendFn attend = nullptr;
  int64_t items = 0, chunk = 1;
  std::atomic<int64_t> next{0}, done{0};
};

void work(Shared& s) {
  const int64_t group = s.p.hq / s.p.hkv;
  std::vector<float> buf(2 * s.p.d + 2 * group + group * s.p.page);
  for (;;) {
    const int64_t b = s.next.fetch_add(s.chunk, std::memory_order_relaxed);
    if (b >= s.items) return;
    const int64_t e = std::min(s.items, b + s.chunk);
    for (int64_t item = b; item < e; ++item) {
      s.attend(s.p, item / s.p.hkv, item % s.p.hkv, buf.data());
    }
    s.done.fetch_add(e - b, std::memory_order_release);
  }
}

ffi::Error PagedDecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                           ffi::AnyBuffer v_pages, ffi::AnyBuffer k_scales,
                           ffi::AnyBuffer v_scales, ffi::Buffer<ffi::S32> table,
                           ffi::Buffer<ffi::S32> tok, ffi::Buffer<ffi::S32> seq,
                           ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::F32> sinks, float scale,
                           int32_t window, float soft_cap, int32_t kv_kind, bool has_sinks,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto td = table.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2) {
    return ffi::Error::InvalidArgument("paged_decode: q must be 3-D, pages 4-D, table 2-D");
  }
  Problem p;
  p.q = q.typed_data();
  p.k = k_pages.untyped_data();
  p.v = v_pages.untyped_data();
  p.ks = static_cast<const uint16_t*>(k_scales.untyped_data());
  p.vs = static_cast<const uint16_t*>(v_scales.untyped_data());
  p.table = table.typed_data();
  p.tok = tok.typed_data();
  p.seq = seq.typed_data();
  p.pos = pos.typed_data();
  p.sinks = has_sinks ? sinks.typed_data() : nullptr;
  p.out = out->typed_data();
  p.num_pages = kd[0];
  p.page = kd[1];
  p.hkv = kd[2];
  p.d = kd[3];
  p.hq = qd[1];
  p.width = td[1];
  p.scale = scale;
  p.soft_cap = soft_cap;
  p.window = window;
  auto shared = std::make_shared<Shared>();
  shared->p = p;
  shared->attend = attend_for(kv_kind);
  if (shared->attend == nullptr) return ffi::Error::InvalidArgument("paged_decode: bad kv_kind");
  shared->items = tok.element_count() * p.hkv;
  shared->chunk = p.hkv;  // one token's heads: its query rows and page-table row stay hot
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), shared->items / (8 * p.hkv)));
  for (int64_t t = 1; t < threads; ++t) {
    pool.Schedule([shared] { work(*shared); });
  }
  work(*shared);
  while (shared->done.load(std::memory_order_acquire) < shared->items) {
    std::this_thread::yield();  // a task is finishing the chunk it claimed
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenspeedPagedDecode, PagedDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::AnyBuffer>()         // k_scales
                                  .Arg<ffi::AnyBuffer>()         // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // tok
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sinks
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("kv_kind")
                                  .Attr<bool>("has_sinks")
                                  .Ret<ffi::Buffer<ffi::F32>>());
