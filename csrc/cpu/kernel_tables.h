// Head sizes and KV dtypes the compiled tiles are instantiated for, and the
// lookup of one ISA's tables. The lists are the CPU build's single statement
// of what it supports: select_kernels' checks and messages and the
// `kernel_support()` function of the _C module are generated from them, and
// tests/kernels/test_kernel_support.py holds them to
// vllm_chunkattn/kernels/support.py (CPU).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <type_traits>

#include "kernels.h"

// Head sizes: multiples of 16 (one AVX-512 register) that models use.
#define CHUNKATTN_FOR_EACH_HEAD_SIZE(X) X(64) X(128) X(256)
// KV cache (and query) dtypes: X(C++ element type, c10::ScalarType enumerator, torch name).
#define CHUNKATTN_FOR_EACH_DTYPE(X) \
  X(float, Float, "float32") X(c10::Half, Half, "float16") X(c10::BFloat16, BFloat16, "bfloat16")

// Defines `const KernelTable* FN(ScalarType, int64_t)` returning &NS::kTable<T, D>,
// or nullptr when (dtype, head size) is not instantiated. Must be expanded
// outside any `#pragma GCC target` region: it only takes addresses.
#define CHUNKATTN_CASE_HEAD_SIZE(D) \
  case D: return &kTable<scalar_t, D>;
#define CHUNKATTN_DEFINE_TABLE_LOOKUP(NS, FN)                                                  \
  namespace chunkattn::cpu {                                                                   \
  namespace NS {                                                                               \
  template <typename scalar_t>                                                                 \
  const KernelTable* table_for(int64_t head_size) {                                            \
    switch (head_size) {                                                                       \
      CHUNKATTN_FOR_EACH_HEAD_SIZE(CHUNKATTN_CASE_HEAD_SIZE)                                   \
      default: return nullptr;                                                                 \
    }                                                                                          \
  }                                                                                            \
  }                                                                                            \
  const KernelTable* FN(c10::ScalarType dtype, int64_t head_size) {                           \
    using NS::table_for;                                                                       \
    switch (dtype) {                                                                           \
      CHUNKATTN_FOR_EACH_DTYPE(CHUNKATTN_CASE_TABLE_DTYPE)                                     \
      default: return nullptr;                                                                 \
    }                                                                                          \
  }                                                                                            \
  }
#define CHUNKATTN_CASE_TABLE_DTYPE(T, SCALAR, NAME) \
  case c10::ScalarType::SCALAR: return table_for<T>(head_size);

// Defines `const KernelTable* FN(ScalarType, int64_t)` for a build whose own
// tiles serve bf16 caches only (avx512bf16, amx): &NS::kTable<BFloat16, D> for
// bf16, the AVX-512 build's table for every other dtype. Expanded, like the
// lookup above, outside any `#pragma GCC target` region.
#define CHUNKATTN_CASE_BF16_HEAD_SIZE(D) \
  case D: return &kTable<c10::BFloat16, D>;
#define CHUNKATTN_DEFINE_BF16_TABLE_LOOKUP(NS, FN)                                                        \
  namespace chunkattn::cpu {                                                                              \
  const KernelTable* avx512_table(c10::ScalarType, int64_t);                                              \
  namespace NS {                                                                                          \
  inline const KernelTable* bf16_table(int64_t head_size) {                                               \
    switch (head_size) {                                                                                  \
      CHUNKATTN_FOR_EACH_HEAD_SIZE(CHUNKATTN_CASE_BF16_HEAD_SIZE)                                         \
      default: return nullptr;                                                                            \
    }                                                                                                     \
  }                                                                                                       \
  }                                                                                                       \
  const KernelTable* FN(c10::ScalarType dtype, int64_t head_size) {                                      \
    return dtype == c10::ScalarType::BFloat16 ? NS::bf16_table(head_size) : avx512_table(dtype, head_size); \
  }                                                                                                       \
  }
