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

#include "cpu/kernels.h"
#include "cpu/scratch.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace chunkattn::cpu {

// Runs fn(i, next) for i in [0, num_items) on torch's intra-op pool, handing
// items out through an atomic counter. at::parallel_for alone splits its range
// into equal contiguous parts, which balances badly when items differ in cost;
// here callers order items costliest first and the threads take the next one
// whenever they are free. From item `first_with_next` on, each thread claims
// its next item before it runs the current one: fn(i, next) knows the item it
// runs after i (next = -1 for its last, and for every item before
// first_with_next), so it can prefetch that item's inputs while computing this
// one. A claimed item does not start until its thread finishes the current
// one, so an item may only wait on items numbered before first_with_next
// (tpp_decode's phase-2 items wait for phase-1 items, which come first and are
// claimed one at a time: claimed in pairs, one thread would take two of a big
// node's splits, which are made one per thread).
template <class F>
void parallel_items_with_next(int64_t num_items, const F& fn, int64_t first_with_next = 0) {
  if (num_items <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_items);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < num_items; ++i) fn(i, i >= first_with_next && i + 1 < num_items ? i + 1 : -1);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t i = next.fetch_add(1, std::memory_order_relaxed);
    while (i < num_items) {
      if (i < first_with_next) {
        fn(i, -1);
        i = next.fetch_add(1, std::memory_order_relaxed);
        continue;
      }
      const int64_t after = next.fetch_add(1, std::memory_order_relaxed);
      fn(i, after < num_items ? after : -1);
      i = after;
    }
  });
}

// The drivers' per-thread scratch (scratch.h).
using DriverScratch = ScratchBuffers<8>;
inline DriverScratch& driver_scratch() {
  static thread_local DriverScratch s;
  return s;
}

#if defined(__x86_64__)
// The drivers are compiled for any x86-64 (the tiles per ISA), where
// c10::Half converts one value at a time in software: a prefill's query and
// output rows, D values each way per row, took 16% of an fp16 prefill on a
// Zen 4 that way (fp32: 3%). Every CPU with AVX has F16C but a few early
// ones; the conversion rounds to nearest even, as c10's does.
inline bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("f16c");
  return yes;
}

__attribute__((target("avx,f16c"))) inline void load_scaled_f16c(const c10::Half* src, int64_t n, float scale,
                                                                   float* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i,
                     _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), s));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

__attribute__((target("avx,f16c"))) inline void store_row_f16c(const float* src, int64_t n, c10::Half* dst,
                                                                 float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(src + i), s), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i] * scale);
}

// bf16 rows, 8 values at a time on AVX2 (every x86 CPU these kernels tune for): compiled one value at a
// time for any x86-64, a bf16 prefill's output rows took 18% of 8 x 512 new tokens of 32 heads on an
// Intel Xeon with AMX. Rounding to nearest even with NaN as 0x7FC0, as c10::BFloat16 does.
inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

__attribute__((target("avx2"))) inline void load_scaled_bf16_avx2(const c10::BFloat16* src, int64_t n, float scale,
                                                                   float* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)), s));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

// 8 floats as bf16 in the low 16 bits of each 32-bit lane.
__attribute__((target("avx2"))) inline __m256i bf16_bits_avx2(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

// `stream`: streaming stores, for rows on 32-byte boundaries.
__attribute__((target("avx2"))) inline void store_row_bf16_avx2(const float* src, int64_t n, c10::BFloat16* dst,
                                                                  float scale, bool stream) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = bf16_bits_avx2(_mm256_mul_ps(_mm256_loadu_ps(src + i), s));
    const __m256i b = bf16_bits_avx2(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8), s));
    // packus interleaves the 128-bit halves: a0-3 b0-3 a4-7 b4-7; the permute restores a, then b.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), packed);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
    }
  }
  for (; i < n; ++i) dst[i] = static_cast<c10::BFloat16>(src[i] * scale);
}
#endif

template <typename T>
inline void load_scaled(const T* src, int64_t n, float scale, float* dst) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, c10::Half>) {
    if (has_f16c()) return load_scaled_f16c(src, n, scale, dst);
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (has_avx2()) return load_scaled_bf16_avx2(src, n, scale, dst);
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

template <typename T>
inline void store_row(const float* src, int64_t n, T* dst, float scale = 1.f) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, c10::Half>) {
    if (has_f16c()) return store_row_f16c(src, n, dst, scale);
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (has_avx2()) return store_row_bf16_avx2(src, n, dst, scale, false);
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * scale);
}

// store_row for a row this op writes once and does not read back: streaming
// stores, which do not read the destination lines into the caches first (a
// long prefill's output is far larger than the caches), for fp32 rows on
// 16-byte boundaries of whole 4-value groups and, with AVX2, bf16 rows on
// 32-byte boundaries of whole 16-value groups; other rows take store_row. The
// caller issues stream_fence() before its writes are consumed.
template <typename T>
inline void stream_row(const float* src, int64_t n, T* dst, float scale) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, float>) {
    if (reinterpret_cast<uintptr_t>(dst) % 16 == 0 && n % 4 == 0) {
      const __m128 s = _mm_set1_ps(scale);
      for (int64_t i = 0; i < n; i += 4) _mm_stream_ps(dst + i, _mm_mul_ps(_mm_loadu_ps(src + i), s));
      return;
    }
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (has_avx2() && reinterpret_cast<uintptr_t>(dst) % 32 == 0 && n % 16 == 0)
      return store_row_bf16_avx2(src, n, dst, scale, true);
  }
#endif
  store_row(src, n, dst, scale);
}
inline void stream_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// The drivers' contract for query/out ([rows, num_heads, head_size], `rows` naming what a row is) and the
// cache (csrc/chunkattn.h's layout).
inline void check_query_out_cache(const torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& kv_cache,
                                  const char* rows) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && out.sizes() == query.sizes(), "chunkattn: query and out must be [",
              rows, ", num_heads, head_size] of the same shape");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "chunkattn: query/out rows must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "chunkattn: out dtype must match query dtype");
  TORCH_CHECK(supports_dtype(query.scalar_type()), "chunkattn: the CPU kernels support query dtypes ",
              supported_dtypes(), "; got ", query.scalar_type());
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous() && kv_cache.size(3) == 2 * query.size(2),
              "chunkattn: kv_cache must be contiguous [num_blocks, num_kv_heads, block_size, 2*head_size]");
}

inline void check_int32_vector(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(), "chunkattn: ",
              name, " must be a contiguous 1-D int32 CPU tensor");
}

}  // namespace chunkattn::cpu
