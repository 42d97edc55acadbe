// Portable build of the attention tiles (see attention_tiles.inc), for CPUs
// without AVX2/FMA/F16C and as a cross-check of the vector builds.
#include <algorithm>
#include <utility>
#include <vector>

#include "common/partial_state.h"
#include "kernel_tables.h"
#include "simd.h"

namespace chunkattn::cpu::scalar {
using V = simd::Scalar;
constexpr const char* kIsaName = "scalar";
#include "attention_tiles.inc"
}  // namespace chunkattn::cpu::scalar

CHUNKATTN_DEFINE_TABLE_LOOKUP(scalar, scalar_table)
