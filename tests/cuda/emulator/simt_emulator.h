// A small CPU emulator of the part of CUDA that csrc/cuda uses, so that the
// exact kernel source runs on a machine without a GPU (tests/cuda/test_cuda_emulated.py).
//
// Each thread block runs as cooperative fibers (ucontext), one per CUDA
// thread, on one OS thread. A fiber runs until it reaches a block barrier
// (__syncthreads) or a warp-collective operation (shuffles, reductions,
// ldmatrix, mma.sync), where it yields; the scheduler releases a warp when
// all 32 lanes reached the collective and the block when every live thread
// reached the barrier, and reports a deadlock (divergent barrier, a warp
// collective with missing lanes) as an error.
//
// Warp collectives follow the PTX ISA fragment layouts:
//   mma.sync.m16n8k16 (f16/bf16 inputs, f32 accumulate), ldmatrix.x4 with and
//   without .trans, shfl.xor / shfl.up, redux.max.
// cp.async copies are captured at issue and land in shared memory when a
// cp.async.wait_group retires their group (CHUNKATTN_EMU_CP_ASYNC=late, the
// default: a read before the wait sees stale data) or at issue
// (CHUNKATTN_EMU_CP_ASYNC=early: a write into a buffer other warps still read
// shows up). Shared-memory accesses by ldmatrix / cp.async are bounds-checked.
//
// Not emulated: memory-model subtleties beyond barriers, timing, occupancy
// (reported by cudaOccupancy... as a fixed value), and anything the kernels
// do not use.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <ucontext.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>

// The CUDA headers define these as attributes for host compilers; here they
// are plain C++.
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)

inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
  return a < b ? a : b;
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
  return a < b ? b : a;
}

namespace emu {

enum State { kReady, kBlockWait, kWarpWait, kDone };

struct Copy {
  void* dst;
  unsigned char data[16];
};

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  State state = kReady;
  std::vector<Copy> pending;                 // issued, not committed
  std::deque<std::vector<Copy>> committed;  // committed groups, oldest first
};

struct Block {
  int threads = 0;
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = 0;
  std::function<void()> body;
  std::vector<unsigned char> exchange;  // [thread][64 bytes] for warp collectives
};

inline Block* g_block = nullptr;
inline std::vector<unsigned char> g_smem;  // dynamic shared memory of the running block
inline std::string g_error;
inline bool g_cp_async_early = [] {
  const char* mode = std::getenv("CHUNKATTN_EMU_CP_ASYNC");
  return mode && std::string(mode) == "early";
}();
// Scheduling policy. 0: lockstep (all waiting warps released together,
// threads run in index order). 1: only the lowest-numbered waiting warp is
// released, so one warp runs ahead until it blocks on __syncthreads. 2: the
// highest warp first, and threads run in reverse index order. 3: a seeded
// random thread order each round and one random warp released at a time.
// 1-3 expose missing block barriers (a thread overwriting shared memory that
// others still read, or reading what others have not written yet).
inline int g_schedule = 0;
inline uint64_t g_rng = 0x9E3779B97F4A7C15ull;
inline uint64_t next_random() {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}
inline int g_num_sms = 4;
inline int g_blocks_per_sm = 2;
// Dynamic shared memory a kernel may take beyond 48 KiB, per (kernel, device),
// as cudaFuncSetAttribute(MaxDynamicSharedMemorySize) set it; a launch over it
// fails as on a GPU ("invalid argument").
constexpr size_t kDefaultDynamicSmem = 48 * 1024;
inline std::map<std::pair<const void*, int>, size_t> g_dynamic_smem_opt_in;
inline size_t g_smem_per_sm = 0;          // 0: the occupancy query reports g_blocks_per_sm
inline size_t g_largest_launch_smem = 0;  // the most dynamic shared memory a launch took

inline void fail(const std::string& message) {
  if (g_error.empty()) g_error = message;
  if (g_block) {
    Fiber& f = g_block->fibers[g_block->current];
    f.state = kDone;
    swapcontext(&f.ctx, &g_block->scheduler);  // never resumed
  }
  std::fprintf(stderr, "emulator: %s\n", message.c_str());
  std::abort();
}

inline void yield(State state) {
  Fiber& f = g_block->fibers[g_block->current];
  f.state = state;
  swapcontext(&f.ctx, &g_block->scheduler);
}

inline int lane_id() { return static_cast<int>(threadIdx.x) & 31; }
inline int warp_id() { return static_cast<int>(threadIdx.x) >> 5; }

inline void fiber_entry() {
  g_block->body();
  g_block->fibers[g_block->current].state = kDone;
}

// Runs one thread block to completion; returns false on error (g_error).
inline bool run_block(int threads, const std::function<void()>& body) {
  Block block;
  block.threads = threads;
  block.body = body;
  block.fibers.resize(threads);
  block.exchange.assign(static_cast<size_t>(threads) * 64, 0);
  g_block = &block;
  for (int i = 0; i < threads; ++i) {
    Fiber& f = block.fibers[i];
    f.stack.resize(256 * 1024);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &block.scheduler;
    makecontext(&f.ctx, fiber_entry, 0);
  }
  bool ok = true;
  std::vector<int> run_order(threads);
  while (ok) {
    for (int i = 0; i < threads; ++i) run_order[i] = g_schedule == 2 ? threads - 1 - i : i;
    if (g_schedule == 3) {
      for (int i = threads - 1; i > 0; --i) std::swap(run_order[i], run_order[next_random() % (i + 1)]);
    }
    for (int i : run_order) {
      if (block.fibers[i].state != kReady) continue;
      block.current = i;
      threadIdx = make_uint3(i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y));
      swapcontext(&block.scheduler, &block.fibers[i].ctx);
      if (!g_error.empty()) {
        ok = false;
        break;
      }
    }
    if (!ok) break;
    int done = 0, ready = 0;
    for (auto& f : block.fibers) done += f.state == kDone;
    if (done == threads) break;
    // Release warps whose 32 lanes all reached a collective.
    const int num_warps = (threads + 31) / 32;
    const int first = g_schedule == 3 ? static_cast<int>(next_random() % num_warps) : 0;
    for (int i = 0; i < num_warps; ++i) {
      const int w = g_schedule == 2 ? num_warps - 1 - i : (first + i) % num_warps;
      int waiting = 0, exited = 0;
      for (int l = 0; l < 32 && w * 32 + l < threads; ++l) {
        waiting += block.fibers[w * 32 + l].state == kWarpWait;
        exited += block.fibers[w * 32 + l].state == kDone;
      }
      if (waiting == 32) {
        for (int l = 0; l < 32; ++l) block.fibers[w * 32 + l].state = kReady;
        ready += 32;
        if (g_schedule != 0) break;
      } else if (waiting > 0 && exited > 0) {
        g_error = "warp collective with exited lanes in warp " + std::to_string(w);
        ok = false;
      }
    }
    if (!ok || ready) continue;
    // Release the block barrier when every live thread reached it.
    bool all_at_barrier = true;
    for (auto& f : block.fibers) all_at_barrier = all_at_barrier && (f.state == kBlockWait || f.state == kDone);
    if (all_at_barrier) {
      for (auto& f : block.fibers)
        if (f.state == kBlockWait) f.state = kReady;
      continue;
    }
    std::string states;
    for (auto& f : block.fibers) states += "RBWD"[f.state];
    g_error = "deadlock (R=ready B=__syncthreads W=warp collective D=done): " + states;
    ok = false;
  }
  g_block = nullptr;
  return ok;
}

template <class... KernelArgs, class... Args>
void launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes, Args&&... args) {
  if (!g_error.empty()) return;
  int device = 0;
  cudaGetDevice(&device);
  const auto opt_in = g_dynamic_smem_opt_in.find({reinterpret_cast<const void*>(kernel), device});
  const size_t smem_limit = opt_in == g_dynamic_smem_opt_in.end() ? kDefaultDynamicSmem : opt_in->second;
  if (smem_bytes > std::max(smem_limit, kDefaultDynamicSmem)) {
    g_error = "invalid argument: " + std::to_string(smem_bytes) + " bytes of dynamic shared memory, the kernel is opted in to " +
              std::to_string(smem_limit);
    return;
  }
  g_largest_launch_smem = std::max(g_largest_launch_smem, smem_bytes);
  std::tuple<std::decay_t<KernelArgs>...> packed(std::forward<Args>(args)...);
  gridDim = grid;
  blockDim = block;
  const int threads = static_cast<int>(block.x * block.y * block.z);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = make_uint3(x, y, z);
        // Fresh garbage in shared memory for every block: nothing may rely on it.
        g_smem.assign(smem_bytes, 0xA5);
        if (!run_block(threads, [&] { std::apply(kernel, packed); })) return;
      }
}

// ---- warp collectives
template <class In, class F>
auto warp_collective(const In& in, F&& f) {
  static_assert(sizeof(In) <= 64, "exchange slot");
  unsigned char* slots = g_block->exchange.data() + static_cast<size_t>(warp_id()) * 32 * 64;
  std::memcpy(slots + lane_id() * 64, &in, sizeof(In));
  yield(kWarpWait);
  In all[32];
  for (int l = 0; l < 32; ++l) std::memcpy(&all[l], slots + l * 64, sizeof(In));
  auto result = f(all);
  yield(kWarpWait);  // nobody overwrites its slot before all lanes read
  return result;
}

inline void check_smem(const void* p, size_t bytes, const char* what) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < g_smem.data() || c + bytes > g_smem.data() + g_smem.size()) {
    fail(std::string(what) + ": address outside the block's dynamic shared memory");
  }
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) fail(std::string(what) + ": address not 16-byte aligned");
}

template <class T>
float to_float(uint16_t bits) {
  T x;
  std::memcpy(&x, &bits, 2);
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else {
    return __bfloat162float(x);
  }
}

inline void ldmatrix(uint32_t (&r)[4], const void* row_ptr, bool trans) {
  check_smem(row_ptr, 16, "ldmatrix");
  struct Out {
    uint32_t r[4];
  };
  const Out out = warp_collective(row_ptr, [&](const void* const* rows) {
    Out o;
    const int l = lane_id();
    for (int i = 0; i < 4; ++i) {
      uint16_t lo, hi;
      if (!trans) {
        const auto* row = static_cast<const uint16_t*>(rows[8 * i + l / 4]);
        lo = row[2 * (l % 4)];
        hi = row[2 * (l % 4) + 1];
      } else {
        lo = static_cast<const uint16_t*>(rows[8 * i + 2 * (l % 4)])[l / 4];
        hi = static_cast<const uint16_t*>(rows[8 * i + 2 * (l % 4) + 1])[l / 4];
      }
      o.r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    return o;
  });
  for (int i = 0; i < 4; ++i) r[i] = out.r[i];
}

template <class T>
void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  struct In {
    uint32_t a[4], b[2];
    float c[4];
  };
  struct Out {
    float d[4];
  };
  In in;
  for (int i = 0; i < 4; ++i) in.a[i] = a[i], in.c[i] = d[i];
  in.b[0] = b0;
  in.b[1] = b1;
  const Out out = warp_collective(in, [&](const In* all) {
    float A[16][16], B[16][8], C[16][8];
    auto lo = [](uint32_t x) { return to_float<T>(static_cast<uint16_t>(x & 0xffff)); };
    auto hi = [](uint32_t x) { return to_float<T>(static_cast<uint16_t>(x >> 16)); };
    for (int L = 0; L < 32; ++L) {
      const int g = L / 4, t = L % 4;
      const In& x = all[L];
      A[g][2 * t] = lo(x.a[0]), A[g][2 * t + 1] = hi(x.a[0]);
      A[g + 8][2 * t] = lo(x.a[1]), A[g + 8][2 * t + 1] = hi(x.a[1]);
      A[g][2 * t + 8] = lo(x.a[2]), A[g][2 * t + 9] = hi(x.a[2]);
      A[g + 8][2 * t + 8] = lo(x.a[3]), A[g + 8][2 * t + 9] = hi(x.a[3]);
      B[2 * t][g] = lo(x.b[0]), B[2 * t + 1][g] = hi(x.b[0]);
      B[2 * t + 8][g] = lo(x.b[1]), B[2 * t + 9][g] = hi(x.b[1]);
      C[g][2 * t] = x.c[0], C[g][2 * t + 1] = x.c[1];
      C[g + 8][2 * t] = x.c[2], C[g + 8][2 * t + 1] = x.c[3];
    }
    const int g = lane_id() / 4, t = lane_id() % 4;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    Out o;
    for (int e = 0; e < 4; ++e) {
      float acc = C[rows[e]][cols[e]];
      for (int k = 0; k < 16; ++k) acc += A[rows[e]][k] * B[k][cols[e]];
      o.d[e] = acc;
    }
    return o;
  });
  for (int i = 0; i < 4; ++i) d[i] = out.d[i];
}

}  // namespace emu

inline void __syncthreads() { emu::yield(emu::kBlockWait); }

inline float __shfl_xor_sync(unsigned, float v, int mask) {
  return emu::warp_collective(v, [&](const float* all) { return all[emu::lane_id() ^ mask]; });
}
inline int __shfl_up_sync(unsigned, int v, unsigned delta) {
  return emu::warp_collective(v, [&](const int* all) {
    const int l = emu::lane_id();
    return l >= static_cast<int>(delta) ? all[l - delta] : all[l];
  });
}
inline int __reduce_max_sync(unsigned, int v) {
  return emu::warp_collective(v, [&](const int* all) {
    int m = all[0];
    for (int l = 1; l < 32; ++l) m = all[l] > m ? all[l] : m;
    return m;
  });
}

// ---- the device helpers of csrc/cuda/common.cuh and attention.cuh
namespace chunkattn::cuda {

inline char* dynamic_smem() { return reinterpret_cast<char*>(emu::g_smem.data()); }

template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu::mma_16816<T>(d, a, b0, b1);
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* row_ptr) { emu::ldmatrix(r, row_ptr, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row_ptr) { emu::ldmatrix(r, row_ptr, true); }

inline void cp_async_16(void* smem, const void* gmem, bool valid) {
  emu::check_smem(smem, 16, "cp.async");
  emu::Copy c;
  c.dst = smem;
  if (valid) {
    std::memcpy(c.data, gmem, 16);
  } else {
    std::memset(c.data, 0, 16);
  }
  if (emu::g_cp_async_early) {
    std::memcpy(c.dst, c.data, 16);
  } else {
    emu::g_block->fibers[emu::g_block->current].pending.push_back(c);
  }
}
inline void cp_async_commit() {
  auto& f = emu::g_block->fibers[emu::g_block->current];
  f.committed.push_back(std::move(f.pending));
  f.pending.clear();
}
template <int N>
inline void cp_async_wait() {
  auto& f = emu::g_block->fibers[emu::g_block->current];
  while (static_cast<int>(f.committed.size()) > N) {
    for (auto& c : f.committed.front()) std::memcpy(c.dst, c.data, 16);
    f.committed.pop_front();
  }
}

inline float fast_exp2(float x) { return std::exp2(x); }

}  // namespace chunkattn::cuda

// ---- the runtime API calls of the launchers
template <class Kernel>
inline cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute attribute, int value) {
  int device = 0;
  cudaGetDevice(&device);
  if (attribute == cudaFuncAttributeMaxDynamicSharedMemorySize)
    emu::g_dynamic_smem_opt_in[{reinterpret_cast<const void*>(kernel), device}] = static_cast<size_t>(value);
  return cudaSuccess;
}
template <class Kernel>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, Kernel*, int, size_t smem_bytes) {
  *n = emu::g_blocks_per_sm;
  if (emu::g_smem_per_sm > 0) *n = std::min<int>(*n, static_cast<int>(emu::g_smem_per_sm / std::max<size_t>(smem_bytes, 1)));
  return cudaSuccess;
}

#define CHUNKATTN_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::emu::launch(kernel, dim3(grid), dim3(block), (smem), __VA_ARGS__)
