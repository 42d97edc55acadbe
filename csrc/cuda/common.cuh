// Device helpers shared by the CUDA kernels: 16-bit float traits, tensor-core
// MMA (mma.sync m16n8k16, fp32 accumulate), ldmatrix, cp.async, warp/block
// reductions and scans, and host-side launch utilities.
//
// One code path for sm_80 .. sm_90: mma.sync, ldmatrix and cp.async all exist
// from sm_80 on (no wgmma / TMA).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda/launch.h"  // first: under the emulator it defines __host__/__device__ for what follows
#include "common/partial_state.h"

// Kernel launch that the CPU emulator (tests/cuda/emulator, CHUNKATTN_EMULATE) can
// also run; `kernel` must be a single token (use a local alias for templates).
#ifndef CHUNKATTN_EMULATE
#define CHUNKATTN_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#endif

namespace chunkattn::cuda {

#ifndef CHUNKATTN_EMULATE
// The block's dynamic shared memory.
__device__ __forceinline__ char* dynamic_smem() {
  extern __shared__ __align__(16) char chunkattn_dynamic_smem[];
  return chunkattn_dynamic_smem;
}
#endif

constexpr float kNegInf = -__builtin_huge_valf();
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

#ifndef CHUNKATTN_EMULATE  // the emulator provides it (tests/cuda/emulator/simt_emulator.h)
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));  // ex2(-inf) = +0
  return y;
}
#endif

// The exponential of every CUDA kernel's partial states (common/partial_state.h):
// scores are kept in the log2 domain (q.k * scale * log2(e)), so exp2.
struct Log2Exp {
  __host__ __device__ static __forceinline__ float exp(float x) {
#if defined(__CUDA_ARCH__) || defined(CHUNKATTN_EMULATE)
    return fast_exp2(x);
#else
    return exp2f(x);
#endif
  }
};

// combine() of common/partial_state.h on the four columns one thread holds.
__host__ __device__ __forceinline__ float4 combine4(float4 running, float4 part, const MergeScales& s) {
  return make_float4(combine(running.x, part.x, s), combine(running.y, part.y, s), combine(running.z, part.z, s),
                     combine(running.w, part.w, s));
}

// ------------------------------------------------------------ 16-bit types
template <typename T>
struct Float16;

template <>
struct Float16<__half> {
  // Two floats into one 32-bit register, `lo` in the low half (the element
  // with the smaller column index in an MMA fragment).
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  __device__ static __forceinline__ float to_float(__half x) { return __half2float(x); }
};

template <>
struct Float16<__nv_bfloat16> {
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};

#ifndef CHUNKATTN_EMULATE  // the emulator provides these (tests/cuda/emulator/simt_emulator.h)
// ------------------------------------------------------------ tensor cores
// D = A * B + D for A 16x16 (row major), B 16x8 (column major), D 16x8 fp32.
// Fragment layouts (PTX ISA, "mma.m16n8k16"), with g = lane / 4, t = lane % 4:
//   A: a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..2t+1],
//      a[2] = A[g][2t+8..2t+9], a[3] = A[g+8][2t+8..2t+9]
//   B: b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   D: d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1]
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                   uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 16-bit matrices; lanes 8i..8i+7 give the row addresses of matrix i.
// Without .trans, lane l receives row l/4, columns 2(l%4)..+1 of each matrix;
// with .trans, row 2(l%4)..+1 of column l/4 (the transposed matrix).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_ptr)));
}

// ------------------------------------------------------------- cp.async
// 16 bytes global -> shared; when !valid the destination is zero-filled and
// nothing is read (src must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

#endif  // CHUNKATTN_EMULATE

// ------------------------------------------------------------ reductions
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Exclusive prefix sum over the threads of a block (blockDim.x a multiple of
// 32, at most 1024); `scratch` holds 33 ints of shared memory. Returns the
// thread's exclusive prefix and sets `total`. All threads must call it.
__device__ __forceinline__ int block_exclusive_scan(int value, int* scratch, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  int inclusive = value;
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += up;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = lane < num_warps ? scratch[lane] : 0;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, w, offset);
      if (lane >= offset) w += up;
    }
    if (lane < num_warps) scratch[lane] = w;  // inclusive prefix of warp totals
    if (lane == 31) scratch[32] = w;
  }
  __syncthreads();
  const int result = inclusive - value + (warp > 0 ? scratch[warp - 1] : 0);
  total = scratch[32];
  __syncthreads();  // scratch may be reused right after
  return result;
}

__device__ __forceinline__ int block_sum(int value, int* scratch) {
  int total;
  block_exclusive_scan(value, scratch, total);
  return total;
}

// ---------------------------------------------------------------- host side
inline void throw_on_error(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("chunkattn CUDA: ") + what + ": " + cudaGetErrorString(err));
  }
}

inline int current_device() {
  int device = 0;
  throw_on_error(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

inline int num_sms(int device) {
  static int cached[64] = {0};
  if (device < 0 || device >= 64) device = 0;
  if (!cached[device]) {
    int n = 0;
    throw_on_error(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "SM count");
    cached[device] = n > 0 ? n : 1;
  }
  return cached[device];
}

// Opt a kernel into more than 48 KiB of dynamic shared memory and report how
// many of its blocks fit on one SM, once per kernel, device and size (the TPP
// attend kernel's size depends on the GQA group). The opt-in is a property of
// the kernel, so it stays at the largest size asked for on the device.
template <auto kernel>
inline int prepare_kernel(int smem_bytes, int threads, int device) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> blocks_per_sm;  // (device, bytes) -> blocks
  static std::map<int, int> opted_in;                       // device -> bytes
  const std::lock_guard<std::mutex> lock(mutex);
  const auto known = blocks_per_sm.find({device, smem_bytes});
  if (known != blocks_per_sm.end()) return known->second;
  if (smem_bytes > 48 * 1024 && smem_bytes > opted_in[device]) {
    throw_on_error(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
                   "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
    opted_in[device] = smem_bytes;
  }
  int n = 0;
  throw_on_error(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem_bytes), "occupancy");
  return blocks_per_sm[{device, smem_bytes}] = n > 0 ? n : 1;
}

inline size_t align_up(size_t bytes, size_t alignment = 256) { return (bytes + alignment - 1) / alignment * alignment; }

}  // namespace chunkattn::cuda
