// AVX-512 + AVX512_BF16 build of the attention tiles (see attention_tiles.inc):
// bf16 caches get the pair-dot-product lanes tiles (vdpbf16ps); float32 and
// float16 caches have nothing to gain from it and use the AVX-512 build.
// Selected at run time by kernels.cpp only on CPUs that report avx512bf16.
#include <algorithm>
#include <utility>
#include <vector>

#include "common/partial_state.h"
#include "kernel_tables.h"
#include "simd.h"

#ifdef CHUNKATTN_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")
namespace chunkattn::cpu::avx512bf16 {
using V = simd::Avx512Bf16;
constexpr const char* kIsaName = "avx512bf16";
#include "attention_tiles.inc"
}  // namespace chunkattn::cpu::avx512bf16
#pragma GCC pop_options

CHUNKATTN_DEFINE_BF16_TABLE_LOOKUP(avx512bf16, avx512bf16_table)
#else
namespace chunkattn::cpu {
const KernelTable* avx512bf16_table(c10::ScalarType, int64_t) { return nullptr; }
}
#endif
