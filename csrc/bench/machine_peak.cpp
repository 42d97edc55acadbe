// The machine's own rates, measured for the kernel benchmark's roofline
// (vllm_chunkattn/bench/machine.py): peak arithmetic per ISA from loops that
// touch no memory, and read bandwidth from a streaming sum over a buffer much
// larger than the last-level cache (the best over a few access patterns).
//
// Each peak loop keeps its accumulators in registers (one dependency chain per
// accumulator, more chains than FMA latency x FMA ports on current x86 cores),
// so it runs at the issue rate of the instruction and nothing else. A loop is
// compiled for its ISA with a target attribute and is called only after a
// run-time CPUID check, so a CPU without AVX-512 never executes an AVX-512
// instruction.
#include <immintrin.h>
#include <omp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/amx.h"

namespace py = pybind11;

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---------------------------------------------------------------- peak loops

#define REPEAT12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define REPEAT24(X) REPEAT12(X) X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)

// The sum of a vector's lanes (GCC 12's _mm512_reduce_add_ps warns in its own header).
__attribute__((target("avx512f"))) float horizontal_sum(__m512 v) {
  float lanes[16];
  _mm512_storeu_ps(lanes, v);
  float sum = 0.0f;
  for (float x : lanes) sum += x;
  return sum;
}

// 24 zmm accumulators + 2 operands fit the 32 zmm registers. The operands keep
// every accumulator finite and away from denormals: acc <- acc * (1 - 2^-20) + 2^-20
// converges to 1.
__attribute__((target("avx512f"))) float fma_loop_avx512(uint64_t iterations) {
  const __m512 a = _mm512_set1_ps(1.0f - 0x1p-20f), b = _mm512_set1_ps(0x1p-20f);
#define DECLARE(i) __m512 acc##i = _mm512_set1_ps(0.5f + 0.01f * i);
  REPEAT24(DECLARE)
#undef DECLARE
  for (uint64_t it = 0; it < iterations; ++it) {
#define STEP(i) acc##i = _mm512_fmadd_ps(acc##i, a, b);
    REPEAT24(STEP)
#undef STEP
  }
  __m512 total = _mm512_setzero_ps();
#define SUM(i) total = _mm512_add_ps(total, acc##i);
  REPEAT24(SUM)
#undef SUM
  return horizontal_sum(total);
}

// 12 ymm accumulators + 2 operands fit the 16 ymm registers of AVX2.
__attribute__((target("avx2,fma"))) float fma_loop_avx2(uint64_t iterations) {
  const __m256 a = _mm256_set1_ps(1.0f - 0x1p-20f), b = _mm256_set1_ps(0x1p-20f);
#define DECLARE(i) __m256 acc##i = _mm256_set1_ps(0.5f + 0.01f * i);
  REPEAT12(DECLARE)
#undef DECLARE
  for (uint64_t it = 0; it < iterations; ++it) {
#define STEP(i) acc##i = _mm256_fmadd_ps(acc##i, a, b);
    REPEAT12(STEP)
#undef STEP
  }
  __m256 total = _mm256_setzero_ps();
#define SUM(i) total = _mm256_add_ps(total, acc##i);
  REPEAT12(SUM)
#undef SUM
  float lanes[8];
  _mm256_storeu_ps(lanes, total);
  float sum = 0.0f;
  for (float x : lanes) sum += x;
  return sum;
}

// vdpbf16ps: per fp32 lane, acc += a0 * b0 + a1 * b1 of two bf16 pairs, the
// instruction the bf16 kernels use for S = QK^T. Accumulators grow by 2^-11 per
// iteration and stay far from overflow for any run this file makes.
__attribute__((target("avx512f,avx512bf16"))) float bf16_dot_loop_avx512(uint64_t iterations) {
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0f), _mm512_set1_ps(1.0f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-12f), _mm512_set1_ps(0x1p-12f));
#define DECLARE(i) __m512 acc##i = _mm512_set1_ps(0.01f * i);
  REPEAT24(DECLARE)
#undef DECLARE
  for (uint64_t it = 0; it < iterations; ++it) {
#define STEP(i) acc##i = _mm512_dpbf16_ps(acc##i, a, b);
    REPEAT24(STEP)
#undef STEP
  }
  __m512 total = _mm512_setzero_ps();
#define SUM(i) total = _mm512_add_ps(total, acc##i);
  REPEAT24(SUM)
#undef SUM
  return horizontal_sum(total);
}

// tdpbf16ps: a 16 x 32 bf16 tile times a 32 x 16 one into 16 x 16 fp32 sums,
// the instruction of the AMX build's products. Four accumulator tiles in turn
// (tmm0-3) over two A and two B tiles that stay loaded, as in the kernels'
// register blocks. A is 1 and B 2^-12: each step adds 2^-7 to every sum.
__attribute__((target("amx-tile,amx-bf16"))) float amx_bf16_loop(uint64_t iterations) {
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  std::fill(a, a + 16 * 32, uint16_t{0x3f80});  // bf16 1.0
  std::fill(b, b + 16 * 32, uint16_t{0x3980});  // bf16 2^-12
  _tile_loadconfig(&chunkattn::kAmxTiles16x64);
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, b, 64);
  _tile_loadd(7, b, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (uint64_t it = 0; it < iterations; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float sums[16 * 16];
  _tile_stored(0, sums, 64);
  _tile_release();
  return sums[0];
}

struct PeakLoop {
  const char* name;
  const char* instruction;
  float (*run)(uint64_t iterations);
  double flops_per_iteration;  // accumulators x lanes x 2 (a multiply and an add per product)
  bool (*supported)();
};

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}
bool has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
bool has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

bool has_amx_bf16() { return chunkattn::amx_bf16_usable(); }

const PeakLoop kLoops[] = {
    {"avx512_fma", "vfmadd...ps zmm (fp32)", fma_loop_avx512, 24 * 16 * 2, has_avx512},
    {"avx2_fma", "vfmadd...ps ymm (fp32)", fma_loop_avx2, 12 * 8 * 2, has_avx2_fma},
    {"avx512_bf16_dot", "vdpbf16ps zmm (bf16 products, fp32 sums)", bf16_dot_loop_avx512, 24 * 16 * 2 * 2,
     has_avx512_bf16},
    {"amx_bf16", "tdpbf16ps (bf16 products, fp32 sums)", amx_bf16_loop, 4 * 16 * 16 * 32 * 2, has_amx_bf16},
};

const PeakLoop& find_loop(const std::string& name) {
  for (const PeakLoop& loop : kLoops)
    if (name == loop.name) return loop;
  throw std::invalid_argument("unknown peak loop '" + name + "'");
}

// Seconds for every one of `threads` threads to run `iterations` of the loop,
// from a common start (a barrier) to the last thread's end.
double timed_parallel_run(const PeakLoop& loop, uint64_t iterations, int threads) {
  double start = 0.0, end = 0.0;
  float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
#pragma omp barrier
#pragma omp master
    start = now_seconds();
    sink += loop.run(iterations);
#pragma omp barrier
#pragma omp master
    end = now_seconds();
  }
  // The sum is returned through a volatile so that no loop is dead code.
  volatile float keep = sink;
  (void)keep;
  return end - start;
}

py::dict peak_gflops(const std::string& name, int threads, double seconds_per_run, int runs) {
  const PeakLoop& loop = find_loop(name);
  if (!loop.supported())
    throw std::runtime_error(std::string("peak loop ") + loop.name + " needs an instruction this CPU lacks");
  if (threads < 1 || runs < 1 || seconds_per_run <= 0) throw std::invalid_argument("threads, runs, seconds > 0");
  std::vector<double> gflops;
  {
    py::gil_scoped_release released;
    uint64_t iterations = 1 << 12;
    double elapsed = timed_parallel_run(loop, iterations, threads);  // also starts the threads
    while (elapsed < seconds_per_run / 8) {
      iterations *= 2;
      elapsed = timed_parallel_run(loop, iterations, threads);
    }
    iterations = std::max<uint64_t>(1, static_cast<uint64_t>(iterations * seconds_per_run / elapsed));
    for (int r = 0; r < runs; ++r) {
      elapsed = timed_parallel_run(loop, iterations, threads);
      gflops.push_back(loop.flops_per_iteration * iterations * threads / elapsed / 1e9);
    }
  }
  py::dict result;
  result["loop"] = loop.name;
  result["instruction"] = loop.instruction;
  result["threads"] = threads;
  result["gflops_runs"] = gflops;
  result["gflops"] = *std::max_element(gflops.begin(), gflops.end());
  return result;
}

std::vector<std::string> supported_peak_loops() {
  std::vector<std::string> names;
  for (const PeakLoop& loop : kLoops)
    if (loop.supported()) names.push_back(loop.name);
  return names;
}

// ---------------------------------------------------------------- read bandwidth

// Each thread sums its own contiguous slice, read as `streams` sub-slices at
// once (one cache line of each in turn): how many concurrent streams a core's
// prefetchers serve best differs between CPUs, so the probe tries several and
// keeps the fastest. Eight accumulators per line keep the adds off the
// critical path; loads are the limit, and DRAM is slower than any of them.
uint64_t sum_slice(const uint64_t* data, int64_t count, int streams) {
  constexpr int64_t kLine = 8;  // uint64 per 64-byte cache line
  const int64_t lines_per_stream = count / kLine / streams;
  uint64_t acc[kLine] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t line = 0; line < lines_per_stream; ++line)
    for (int s = 0; s < streams; ++s) {
      const uint64_t* p = data + (s * lines_per_stream + line) * kLine;
      for (int k = 0; k < kLine; ++k) acc[k] += p[k];
    }
  for (int64_t i = lines_per_stream * streams * kLine; i < count; ++i) acc[0] += data[i];
  uint64_t total = 0;
  for (uint64_t a : acc) total += a;
  return total;
}

constexpr int kStreamCounts[] = {1, 2, 4, 8, 16};

py::dict read_bandwidth(int64_t bytes, int threads, int runs) {
  if (threads < 1 || runs < 1 || bytes < (1 << 20)) throw std::invalid_argument("threads, runs > 0, bytes >= 1 MiB");
  const int64_t count = bytes / static_cast<int64_t>(sizeof(uint64_t));
  std::vector<double> gbps;
  std::vector<int> streams_of_run;
  {
    py::gil_scoped_release released;
    auto* data = static_cast<uint64_t*>(std::aligned_alloc(4096, count * sizeof(uint64_t)));
    if (data == nullptr) throw std::bad_alloc();
    // First touch by the thread that reads the slice later (NUMA placement).
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < count; ++i) data[i] = static_cast<uint64_t>(i);
    uint64_t sink = 0;
    for (int streams : kStreamCounts) {
      for (int r = 0; r < runs + 1; ++r) {  // the first pass is untimed: page tables, frequency
        const double start = now_seconds();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
          const int t = omp_get_thread_num(), n = omp_get_num_threads();
          const int64_t begin = count * t / n, end = count * (t + 1) / n;
          sink += sum_slice(data + begin, end - begin, streams);
        }
        const double elapsed = now_seconds() - start;
        if (r > 0) {
          gbps.push_back(count * sizeof(uint64_t) / elapsed / 1e9);
          streams_of_run.push_back(streams);
        }
      }
    }
    volatile uint64_t keep = sink;
    (void)keep;
    std::free(data);
  }
  const auto best = std::max_element(gbps.begin(), gbps.end());
  py::dict result;
  result["threads"] = threads;
  result["bytes"] = count * static_cast<int64_t>(sizeof(uint64_t));
  result["gbps_runs"] = gbps;
  result["streams_of_runs"] = streams_of_run;
  result["gbps"] = *best;
  result["streams"] = streams_of_run[best - gbps.begin()];
  return result;
}

}  // namespace

PYBIND11_MODULE(_machine, m) {
  m.doc() = "Peak FMA rates per ISA and read bandwidth of this machine (for the kernel benchmark's roofline).";
  m.def("supported_peak_loops", &supported_peak_loops,
        "Names of the peak loops this CPU can run (checked with CPUID at run time).");
  m.def("peak_gflops", &peak_gflops, py::arg("loop"), py::arg("threads"), py::arg("seconds_per_run") = 0.05,
        py::arg("runs") = 5,
        "GFLOP/s of a register-only loop of one instruction on `threads` threads: the best of `runs` runs.");
  m.def("read_bandwidth", &read_bandwidth, py::arg("bytes"), py::arg("threads"), py::arg("runs") = 5,
        "GB/s of a streaming sum over `bytes` on `threads` threads: the best of `runs` passes for each "
        "number of concurrent streams per thread tried (1, 2, 4, 8, 16).");
}
