// AMX (Intel's tile registers and tile multiply) on x86-64 Linux: what the CPU
// kernels' AMX build (csrc/cpu/kernels_amx.cpp) and the benchmark's AMX peak
// loop (csrc/bench/machine_peak.cpp) both need.
#pragma once

#include <cstdint>

#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <sys/syscall.h>
#include <unistd.h>
#define CHUNKATTN_AMX_OS 1
#endif

namespace chunkattn {

// Whether this process may run AMX's bf16 tile multiply. The CPU must have
// AMX-TILE and AMX-BF16, and Linux must give the process the tile state
// (8 KiB more per thread to save at a context switch), which it does only
// once asked (arch_prctl ARCH_REQ_XCOMP_PERM); a tile instruction before that
// is SIGILL. Asking again is harmless.
inline bool amx_bf16_usable() {
#ifdef CHUNKATTN_AMX_OS
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// The tile configuration ldtilecfg loads: palette 1, and per tile register its
// rows and bytes per row.
struct alignas(64) AmxTileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};
// Every user configures tmm0-7 alike, 16 rows of 64 bytes (16 fp32 or 32
// bf16). In static storage: ldtilecfg reads all 64 bytes, and its intrinsic
// declares only eight.
inline constexpr AmxTileConfig kAmxTiles16x64 = {
    1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

}  // namespace chunkattn
