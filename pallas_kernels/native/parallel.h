// Work sharing over XLA:CPU's intra-op thread pool, for the native kernels' FFI handlers.
//
// `parallel_chunks` splits `items` into chunks claimed from a shared atomic counter by the calling
// thread and by up to `threads - 1` pool tasks. The caller claims chunks too and returns once every
// item is done, so it never waits on a task the pool has not started (another step may hold the
// pool's threads); a task that starts after that finds nothing left and only drops its reference.

#ifndef TOKENSPEED_NATIVE_PARALLEL_H_
#define TOKENSPEED_NATIVE_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace tokenspeed {

// `make()` is called once per thread that claims work and returns that thread's body,
// `body(begin, end)` over items [begin, end). Both must own (copy) what they use.
template <typename Make>
void parallel_chunks(xla::ffi::ThreadPool& pool, int64_t items, int64_t chunk, int64_t threads,
                     Make make) {
  struct Shared {
    Make make;
    int64_t items, chunk;
    std::atomic<int64_t> next{0}, done{0};
    Shared(Make m, int64_t n, int64_t c) : make(std::move(m)), items(n), chunk(c) {}
  };
  auto shared = std::make_shared<Shared>(std::move(make), items, std::max<int64_t>(1, chunk));
  auto work = [](Shared& s) {
    int64_t b = s.next.fetch_add(s.chunk, std::memory_order_relaxed);
    if (b >= s.items) return;
    auto body = s.make();
    for (; b < s.items; b = s.next.fetch_add(s.chunk, std::memory_order_relaxed)) {
      const int64_t e = std::min(s.items, b + s.chunk);
      body(b, e);
      s.done.fetch_add(e - b, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) {
    pool.Schedule([shared, work] { work(*shared); });
  }
  work(*shared);
  while (shared->done.load(std::memory_order_acquire) < shared->items) {
    std::this_thread::yield();  // a task is finishing the chunk it claimed
  }
}

}  // namespace tokenspeed

#endif  // TOKENSPEED_NATIVE_PARALLEL_H_
