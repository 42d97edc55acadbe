// Run-time choice of the tile implementation: the widest ISA the CPU has,
// unless CHUNKATTN_CPU_ISA (avx512bf16|avx512|avx2|scalar) names another (tests use it to
// cover every build on one machine).
#include <torch/all.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "kernel_tables.h"

namespace chunkattn::cpu {

const KernelTable* avx512bf16_table(c10::ScalarType, int64_t);
const KernelTable* avx512_table(c10::ScalarType, int64_t);
const KernelTable* avx2_table(c10::ScalarType, int64_t);
const KernelTable* scalar_table(c10::ScalarType, int64_t);

namespace {

enum class Isa { kScalar, kAvx2, kAvx512, kAvx512Bf16 };

Isa best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512bf16"))
    return Isa::kAvx512Bf16;
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx2;
#endif
  return Isa::kScalar;
}

Isa current_isa() {
  static const Isa best = best_isa();
  // Read on every call (a getenv is cheap next to a kernel) so tests can switch.
  const char* forced = std::getenv("CHUNKATTN_CPU_ISA");
  if (forced == nullptr || *forced == '\0') return best;
  Isa want;
  if (std::strcmp(forced, "avx512bf16") == 0) want = Isa::kAvx512Bf16;
  else if (std::strcmp(forced, "avx512") == 0) want = Isa::kAvx512;
  else if (std::strcmp(forced, "avx2") == 0) want = Isa::kAvx2;
  else if (std::strcmp(forced, "scalar") == 0) want = Isa::kScalar;
  else TORCH_CHECK(false, "CHUNKATTN_CPU_ISA must be avx512bf16, avx512, avx2 or scalar, got '", forced, "'");
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "CHUNKATTN_CPU_ISA=", forced,
              " is not supported by this CPU");
  return want;
}

}  // namespace

const CompiledSupport& compiled_support() {
  static const CompiledSupport support = [] {
    CompiledSupport s;
#define CHUNKATTN_ADD_HEAD_SIZE(D) s.head_sizes.push_back(D);
#define CHUNKATTN_ADD_DTYPE(T, SCALAR, NAME) s.dtypes.push_back(NAME);
    CHUNKATTN_FOR_EACH_HEAD_SIZE(CHUNKATTN_ADD_HEAD_SIZE)
    CHUNKATTN_FOR_EACH_DTYPE(CHUNKATTN_ADD_DTYPE)
#undef CHUNKATTN_ADD_HEAD_SIZE
#undef CHUNKATTN_ADD_DTYPE
    return s;
  }();
  return support;
}

bool supports_dtype(c10::ScalarType dtype) {
#define CHUNKATTN_IS_DTYPE(T, SCALAR, NAME) dtype == c10::ScalarType::SCALAR ||
  return CHUNKATTN_FOR_EACH_DTYPE(CHUNKATTN_IS_DTYPE) false;
#undef CHUNKATTN_IS_DTYPE
}

namespace {
template <typename Items>
std::string join(const Items& items) {
  std::string text;
  for (const auto& item : items) {
    if (!text.empty()) text += ", ";
    if constexpr (std::is_arithmetic_v<typename Items::value_type>) text += std::to_string(item);
    else text += item;
  }
  return text;
}
}  // namespace

std::string supported_head_sizes() { return join(compiled_support().head_sizes); }
std::string supported_dtypes() { return join(compiled_support().dtypes); }

const char* active_isa() {
  switch (current_isa()) {
    case Isa::kAvx512Bf16: return "avx512bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

const KernelTable& select_kernels(c10::ScalarType kv_dtype, int64_t head_size) {
  TORCH_CHECK(supports_dtype(kv_dtype), "chunkattn: the CPU kernels support KV cache dtypes ", supported_dtypes(),
              "; got ", kv_dtype);
  const KernelTable* table = nullptr;
  switch (current_isa()) {
    case Isa::kAvx512Bf16: table = avx512bf16_table(kv_dtype, head_size); break;
    case Isa::kAvx512: table = avx512_table(kv_dtype, head_size); break;
    case Isa::kAvx2: table = avx2_table(kv_dtype, head_size); break;
    default: table = scalar_table(kv_dtype, head_size); break;
  }
  TORCH_CHECK(table != nullptr, "chunkattn: head size ", head_size, " is not supported by the CPU kernels (supported: ",
              supported_head_sizes(), ")");
  return *table;
}

}  // namespace chunkattn::cpu
