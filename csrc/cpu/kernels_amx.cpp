// AVX-512 + AVX512_BF16 + AMX-BF16 build of the attention tiles (see
// attention_tiles.inc): bf16 caches get the lanes tile's two products on AMX
// tiles and otherwise the avx512bf16 build's code; float32 and float16
// caches have nothing to gain from it and use the AVX-512 build. Selected at
// run time by kernels.cpp only on CPUs that report amx-tile and amx-bf16 and
// whose kernel lets the process use AMX's tile state.
#include <algorithm>
#include <utility>
#include <vector>

#include "common/partial_state.h"
#include "kernel_tables.h"
#include "simd.h"

#ifdef CHUNKATTN_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
namespace chunkattn::cpu::amx {
using V = simd::Amx;
constexpr const char* kIsaName = "amx";
#include "attention_tiles.inc"
}  // namespace chunkattn::cpu::amx
#pragma GCC pop_options

CHUNKATTN_DEFINE_BF16_TABLE_LOOKUP(amx, amx_table)
#else
namespace chunkattn::cpu {
const KernelTable* amx_table(c10::ScalarType, int64_t) { return nullptr; }
}
#endif
