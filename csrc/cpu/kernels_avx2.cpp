// AVX2 + FMA + F16C build of the attention tiles (see attention_tiles.inc).
#include <algorithm>
#include <utility>
#include <vector>

#include "common/partial_state.h"
#include "kernel_tables.h"
#include "simd.h"

#ifdef CHUNKATTN_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace chunkattn::cpu::avx2 {
using V = simd::Avx2;
constexpr const char* kIsaName = "avx2";
#include "attention_tiles.inc"
}  // namespace chunkattn::cpu::avx2
#pragma GCC pop_options

CHUNKATTN_DEFINE_TABLE_LOOKUP(avx2, avx2_table)
#else
namespace chunkattn::cpu {
const KernelTable* avx2_table(c10::ScalarType, int64_t) { return nullptr; }
}
#endif
