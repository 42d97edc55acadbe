// Head sizes and KV dtypes the compiled tiles are instantiated for, and the
// lookup of one ISA's tables. Used by kernels_<isa>.cpp only.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <type_traits>

#include "kernels.h"

// Head sizes: multiples of 16 (one AVX-512 register) that models use.
#define CHUNKATTN_FOR_EACH_HEAD_SIZE(X) X(64) X(80) X(96) X(112) X(128) X(256)
#define CHUNKATTN_HEAD_SIZES_STR "64, 80, 96, 112, 128, 256"

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
    switch (dtype) {                                                                           \
      case c10::ScalarType::Float: return NS::table_for<float>(head_size);                     \
      case c10::ScalarType::Half: return NS::table_for<c10::Half>(head_size);                  \
      case c10::ScalarType::BFloat16: return NS::table_for<c10::BFloat16>(head_size);          \
      default: return nullptr;                                                                 \
    }                                                                                          \
  }                                                                                            \
  }
