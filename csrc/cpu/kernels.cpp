// Run-time choice of the tile implementation: the widest ISA the CPU has,
// unless CHUNKATTN_CPU_ISA (amx|avx512bf16|avx512|avx2|scalar) names another (tests use it to
// cover every build on one machine).
#include <torch/all.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/amx.h"
#include "kernel_tables.h"

namespace chunkattn::cpu {

const KernelTable* amx_table(c10::ScalarType, int64_t);
const KernelTable* avx512bf16_table(c10::ScalarType, int64_t);
const KernelTable* avx512_table(c10::ScalarType, int64_t);
const KernelTable* avx2_table(c10::ScalarType, int64_t);
const KernelTable* scalar_table(c10::ScalarType, int64_t);

namespace {

enum class Isa { kScalar, kAvx2, kAvx512, kAvx512Bf16, kAmx };

Isa best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx512bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  if (avx512bf16 && amx_bf16_usable()) return Isa::kAmx;
  if (avx512bf16) return Isa::kAvx512Bf16;
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
  if (std::strcmp(forced, "amx") == 0) want = Isa::kAmx;
  else if (std::strcmp(forced, "avx512bf16") == 0) want = Isa::kAvx512Bf16;
  else if (std::strcmp(forced, "avx512") == 0) want = Isa::kAvx512;
  else if (std::strcmp(forced, "avx2") == 0) want = Isa::kAvx2;
  else if (std::strcmp(forced, "scalar") == 0) want = Isa::kScalar;
  else TORCH_CHECK(false, "CHUNKATTN_CPU_ISA must be amx, avx512bf16, avx512, avx2 or scalar, got '", forced, "'");
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "CHUNKATTN_CPU_ISA=", forced,
              " is not supported by this CPU");
  return want;
}

}  // namespace

namespace {

// The torch name of a dtype of CHUNKATTN_FOR_EACH_DTYPE.
const char* dtype_name(c10::ScalarType dtype) {
#define CHUNKATTN_NAME_DTYPE(T, SCALAR, NAME) \
  if (dtype == c10::ScalarType::SCALAR) return NAME;
  CHUNKATTN_FOR_EACH_DTYPE(CHUNKATTN_NAME_DTYPE)
#undef CHUNKATTN_NAME_DTYPE
  return c10::toString(dtype);
}

// Position of a dtype in CHUNKATTN_FOR_EACH_DTYPE (others after them).
int dtype_rank(c10::ScalarType dtype) {
  int rank = 0;
#define CHUNKATTN_RANK_DTYPE(T, SCALAR, NAME) \
  if (dtype == c10::ScalarType::SCALAR) return rank; \
  ++rank;
  CHUNKATTN_FOR_EACH_DTYPE(CHUNKATTN_RANK_DTYPE)
#undef CHUNKATTN_RANK_DTYPE
  return rank;
}

// Head sizes above this are not probed: no model has one, and no tile fits it.
constexpr int64_t kMaxProbedHeadSize = 1024;

}  // namespace

// Found by asking every ISA's table lookup for every dtype and head size up to
// kMaxProbedHeadSize: the instantiated tables themselves, not the lists they
// are generated from. Every ISA built for this platform must have the same.
const CompiledSupport& compiled_support() {
  static const CompiledSupport support = [] {
    using Lookup = const KernelTable* (*)(c10::ScalarType, int64_t);
    const std::pair<const char*, Lookup> lookups[] = {
        {"scalar", scalar_table}, {"avx2", avx2_table}, {"avx512", avx512_table}, {"avx512bf16", avx512bf16_table},
        {"amx", amx_table}};
    std::vector<std::pair<c10::ScalarType, int64_t>> portable;
    for (const auto& [isa, lookup] : lookups) {
      std::vector<std::pair<c10::ScalarType, int64_t>> found;
      for (int d = 0; d < static_cast<int>(c10::ScalarType::NumOptions); ++d)
        for (int64_t head_size = 1; head_size <= kMaxProbedHeadSize; ++head_size)
          if (lookup(static_cast<c10::ScalarType>(d), head_size) != nullptr)
            found.emplace_back(static_cast<c10::ScalarType>(d), head_size);
      if (portable.empty()) portable = found;  // the scalar build, on every platform
      TORCH_CHECK(found.empty() || found == portable, "chunkattn: the ", isa,
                  " kernel tables cover other head sizes or dtypes than the scalar ones");
    }
    // Dtypes in the order of CHUNKATTN_FOR_EACH_DTYPE, which messages keep.
    std::stable_sort(portable.begin(), portable.end(), [](const auto& a, const auto& b) {
      return dtype_rank(a.first) < dtype_rank(b.first);
    });
    CompiledSupport s;
    for (const auto& [dtype, head_size] : portable) {
      if (std::find(s.dtypes.begin(), s.dtypes.end(), dtype_name(dtype)) == s.dtypes.end())
        s.dtypes.push_back(dtype_name(dtype));
      if (std::find(s.head_sizes.begin(), s.head_sizes.end(), head_size) == s.head_sizes.end())
        s.head_sizes.push_back(head_size);
    }
    TORCH_CHECK(portable.size() == s.dtypes.size() * s.head_sizes.size(),
                "chunkattn: the CPU kernel tables are not every dtype for every head size");
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
    case Isa::kAmx: return "amx";
    case Isa::kAvx512Bf16: return "avx512bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

namespace {
CpuTuning& mutable_tuning() {
  static CpuTuning tuning;
  return tuning;
}
}  // namespace

const CpuTuning& cpu_tuning() { return mutable_tuning(); }

void set_cpu_tuning(const CpuTuning& tuning) {
  for (const CpuTuningField& f : kCpuTuningFields) {
    const int value = tuning.*f.value;
    TORCH_CHECK(value >= f.min && value <= f.max, "chunkattn: CPU tuning ", f.name, " must be in [", f.min, ", ",
                f.max, "], got ", value);
  }
  mutable_tuning() = tuning;
}

const KernelTable& select_kernels(c10::ScalarType kv_dtype, int64_t head_size) {
  TORCH_CHECK(supports_dtype(kv_dtype), "chunkattn: the CPU kernels support KV cache dtypes ", supported_dtypes(),
              "; got ", kv_dtype);
  const KernelTable* table = nullptr;
  switch (current_isa()) {
    case Isa::kAmx: table = amx_table(kv_dtype, head_size); break;
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
