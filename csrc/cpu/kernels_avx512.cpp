// AVX-512 build of the attention tiles (see attention_tiles.inc). Selected at
// run time by kernels.cpp only on CPUs that report avx512f.
#include <algorithm>
#include <utility>
#include <vector>

#include "common/partial_state.h"
#include "kernel_tables.h"
#include "simd.h"

#ifdef CHUNKATTN_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace chunkattn::cpu::avx512 {
using V = simd::Avx512;
constexpr const char* kIsaName = "avx512";
#include "attention_tiles.inc"
}  // namespace chunkattn::cpu::avx512
#pragma GCC pop_options

CHUNKATTN_DEFINE_TABLE_LOOKUP(avx512, avx512_table)
#else
namespace chunkattn::cpu {
const KernelTable* avx512_table(c10::ScalarType, int64_t) { return nullptr; }
}
#endif
