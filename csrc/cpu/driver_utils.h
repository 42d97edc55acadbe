// Helpers shared by the CPU op drivers (tpp_decode.cpp, prefill.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <torch/all.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace chunkattn::cpu {

// Runs fn(i) for i in [0, num_items) on torch's intra-op pool, handing items
// out one at a time through an atomic counter. at::parallel_for alone splits
// its range into equal contiguous parts, which balances badly when items
// differ in cost; here callers order items costliest first and the threads
// take the next one whenever they are free.
template <class F>
void parallel_items(int64_t num_items, const F& fn) {
  if (num_items <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_items);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < num_items; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < num_items;
         i = next.fetch_add(1, std::memory_order_relaxed))
      fn(i);
  });
}

// Per-thread float buffers for the drivers, grown on demand, kept across calls.
struct DriverScratch {
  std::vector<float> buf[6];
  float* get(int slot, size_t n) {
    if (buf[slot].size() < n) buf[slot].resize(n);
    return buf[slot].data();
  }
};
inline DriverScratch& driver_scratch() {
  static thread_local DriverScratch s;
  return s;
}

template <typename T>
inline void load_scaled(const T* src, int64_t n, float scale, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

template <typename T>
inline void store_row(const float* src, int64_t n, T* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

inline void check_int32_vector(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(), "chunkattn: ",
              name, " must be a contiguous 1-D int32 CPU tensor");
}

}  // namespace chunkattn::cpu
