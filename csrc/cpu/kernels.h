// Interface between the op drivers (tpp_decode.cpp, prefill.cpp) and the
// per-ISA attention tiles (attention_tiles.inc, built by kernels_<isa>.cpp).
//
// The drivers own the parallel decomposition and the bookkeeping (prefix-tree
// context, partial results, merging, output dtype); the tiles own the inner
// loops. One tile call attends `rows` pre-scaled fp32 query rows of one KV
// head against the first `num_keys` keys of a run of chunks, and returns the
// unnormalised partial result of the paper's equation (1):
//   o[r] = sum_j exp(s_rj - m[r]) v_j,  m[r] = max_j s_rj,  n[r] = sum_j exp(s_rj - m[r])
// A row that sees no key gets m = -inf, n = 0, o = 0. One call may cover
// several KV heads (AttnJob::num_heads).
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/scratch.h"

namespace chunkattn::cpu {

// One layer's KV cache, [num_blocks, num_kv_heads, block_size, 2 * head_size]:
// for (block, head) the K tile [block_size, head_size] and then the V tile (a bf16 one in key pairs, chunkattn.h).
struct KvView {
  const void* data;
  int64_t block_stride;  // elements
  int64_t head_stride;   // elements
  int block_size;
};

// Whether a cache of T keeps its V tile in key pairs (chunkattn.h): bf16's does.
template <typename T>
constexpr bool kValuePairs = std::is_same_v<T, c10::BFloat16>;

// Keys [0, keys) of KV head `head` in cache block `block` (block -1: no tile).
struct TileRef {
  int32_t block = -1;
  int head = 0;
  int keys = 0;
};

// A run of cache lines to prefetch: `lines` lines from p, asked for by a
// register block's loop one every 2^step_shift steps.
struct LineRun {
  const char* p = nullptr;
  int lines = 0;
  int step_shift = 0;
};

// Memory-bound work that a compute-bound `lanes` call takes into its gaps:
// the decode driver's items of a few rows (a request's private chunks or its
// own node, read once for a few rows). Run after the shared nodes, they leave
// the FMAs idle while they wait on memory, and the memory idle while the
// nodes compute; taken in here, their lines are prefetched by the tile's
// register blocks (after the next tile's) and they run from the caches
// between lane pairs.
struct GapWork {
  // The next run of the pending work's lines, at most max_lines; empty when
  // all are asked for or none is pending.
  virtual LineRun next_lines(int max_lines) = 0;
  // At a gap (after a lane pair's P.V): runs the pending work once all its
  // lines are asked for, then takes the next.
  virtual void in_gap() = 0;

 protected:
  ~GapWork() = default;
};

// V^T of cache blocks that several requests of one call read (a shared
// prefix), packed once by the driver (KernelTable::pack_vt) for every job that
// reads them: each request's job would otherwise pack the same blocks again.
// Block `blocks[i]` of KV head h lies at data + (h * num_blocks + i) * block_bytes.
struct PackedVt {
  const int32_t* blocks = nullptr;  // sorted
  int num_blocks = 0;
  const char* data = nullptr;
  int64_t block_bytes = 0;

  // The packed V^T of (block, head), or nullptr when it is not packed.
  const void* find(int32_t block, int head) const {
    const int32_t* it = std::lower_bound(blocks, blocks + num_blocks, block);
    if (it == blocks + num_blocks || *it != block) return nullptr;
    return data + (int64_t{head} * num_blocks + (it - blocks)) * block_bytes;
  }
};

struct AttnJob {
  const float* q;         // [rows, head_size], already multiplied by the softmax scale
  int rows;
  const int32_t* blocks;  // block ids of consecutive chunks; key k lives in blocks[k / block_size]
  int num_keys;
  int head;               // KV head
  const float* q_pos;     // optional causal limit: key k is masked for row r when k > q_pos[r]
  float* o;               // [rows, head_size] out
  float* m;               // [rows] out
  float* n;               // [rows] out
  // Heads head .. head + num_heads - 1 of the same keys in one call: q, o are
  // then [num_heads, rows, head_size] and m, n [num_heads, rows]. `direct`
  // walks each chunk's heads back to back, which in the cache are adjacent
  // tiles of one block: long sequential reads instead of one tile per block.
  int num_heads = 1;
  // The softmax scale q was multiplied by. Tiles that round q to bf16 divide
  // it out first, which gives back a bf16 model's query exactly.
  float q_scale = 1.f;
  // Optional sliding-window start: key k is masked for row r when k < q_lo[r].
  // The drivers drop the chunks no row sees first (trim_to_window), so the
  // tiles only mask within the first chunks.
  const float* q_lo = nullptr;
  // Logits soft-capping (Gemma 2): > 0, each score s (of the scaled query)
  // becomes softcap * tanh(s / softcap) before the softmax.
  float softcap = 0.f;
  // ALiBi: [num_heads, rows] slopes, one per row's query head. The score of
  // key k for row r gains slope * (k - q_pos[r]), after soft-capping; q_pos
  // must then be set (a row's position, also when it masks nothing). The
  // bias is relative to the row's own position, as vLLM's, so that it stays
  // small where the softmax weights are large whatever the context length.
  const float* alibi_slopes = nullptr;
  // The first tile of the job its thread runs next, if the driver knows it:
  // `direct` prefetches it as it would its own next tile, so a job of a few
  // tiles (a request's short private context) does not start on a cold one.
  TileRef after;
  // `lanes` only: work for its gaps (GapWork), or none.
  GapWork* gap = nullptr;
  // `lanes` only, where takes_packed_vt: V^T the driver packed for some of
  // the job's blocks, or none.
  const PackedVt* packed_vt = nullptr;
};

using AttnFn = void (*)(const KvView&, const AttnJob&);
// Packs V^T of (block, head), all block_size keys, into dst (packed_vt_bytes, 64-byte aligned).
using PackVtFn = void (*)(const KvView&, int32_t block, int head, void* dst);

// Sliding window: row r sees keys from first_key[r] on (relative to the job's
// key 0; 0 or less: all). Drops the job's leading whole chunks that no row
// sees, shifting first_key and q_pos (the job's causal limits, if any: the
// same array as job.q_pos) with them, and points job.q_lo at first_key when a
// row still masks keys. Returns false when no key is left.
inline bool trim_to_window(AttnJob& job, float* first_key, float* q_pos, int block_size) {
  float lowest = first_key[0], highest = first_key[0];
  for (int r = 1; r < job.rows; ++r) lowest = std::min(lowest, first_key[r]), highest = std::max(highest, first_key[r]);
  const int skip = std::max(0, static_cast<int>(lowest)) / block_size;
  if (skip * block_size >= job.num_keys) return false;
  const float shift = static_cast<float>(skip * block_size);
  job.blocks += skip;
  job.num_keys -= skip * block_size;
  for (int r = 0; r < job.rows; ++r) {
    first_key[r] -= shift;
    if (q_pos) q_pos[r] -= shift;
  }
  if (highest > shift) job.q_lo = first_key;
  return true;
}

struct KernelTable {
  const char* isa;
  int lane_width;       // W: floats per vector register
  int direct_max_rows;  // `direct` handles 1..direct_max_rows rows
  // Few rows (a request's GQA group): per-row dot products, K/V read once
  // for all rows, no packing.
  AttnFn direct;
  // Many rows (a shared node's batch of queries, a prefill tile): queries in
  // vector lanes, a register-blocked matrix-matrix product against the
  // chunk's K and V; each K/V element loaded once serves a whole register
  // tile of queries.
  AttnFn lanes;
  // `lanes` with the bf16 Q.K register block inlined (the same function where
  // that block does not run); decode takes it when CpuTuning::decode_qk_inline.
  AttnFn lanes_qk_inline;
  // The AMX lanes tile's V^T packing for a driver that packs shared blocks
  // once (PackedVt); nullptr where `lanes` packs nothing or packs otherwise.
  PackVtFn pack_vt;

  // The one dispatch rule between the two tiles: `direct` up to direct_max_rows rows per KV head.
  bool runs_direct(int64_t rows) const { return rows <= direct_max_rows; }
};

// Keys of one P.V step of the AMX tile: the V^T it reads at a time, which
// must not straddle blocks for a block's packed V^T to stand alone.
inline constexpr int kPackedVtStepKeys = 32;
// Whether `lanes` takes V^T packed by pack_vt for caches of this block size.
inline bool takes_packed_vt(const KernelTable& kern, int64_t block_size) {
  return kern.pack_vt != nullptr && block_size % kPackedVtStepKeys == 0;
}
// Bytes of one block's packed V^T (bf16, the AMX tile's operand).
inline int64_t packed_vt_bytes(int64_t head_size, int64_t block_size) { return head_size * block_size * 2; }

// Kernels for the KV dtype and head size on the best ISA of this CPU, or the
// one named by the CHUNKATTN_CPU_ISA environment variable (amx|avx512bf16|avx512|avx2|scalar).
// Throws (TORCH_CHECK) for an unsupported head size or dtype.
const KernelTable& select_kernels(c10::ScalarType kv_dtype, int64_t head_size);

// What the tiles are instantiated for (kernel_tables.h), on every ISA alike.
struct CompiledSupport {
  std::vector<int64_t> head_sizes;
  std::vector<std::string> dtypes;  // torch names: "float32", "float16", "bfloat16"
};
const CompiledSupport& compiled_support();
bool supports_dtype(c10::ScalarType dtype);

// "64, 128, 256" and "float32, float16, bfloat16": what error messages name.
std::string supported_head_sizes();
std::string supported_dtypes();

// Name of the ISA select_kernels would use now.
const char* active_isa();

// Run-time tile parameters. Which values are fastest depends on the CPU
// (cache sizes, load ports, vector width), so they are measured rather than
// fixed: vllm_chunkattn/kernels/cpu_tuning.py times candidates on the CPU at
// engine start (the result cached on disk per CPU and kernel build) and sets
// them here, before any kernel runs. The defaults are the values the kernels
// were written around.
struct CpuTuning {
  int prefill_tile_rows = 64;   // query rows (new tokens x G) per prefill work item
  int lanes_tile_keys = 128;    // keys per attend_lanes tile, rounded down to whole chunks (at least one)
  int prefetch_distance = 1;    // attend_direct: KV tiles ahead of the one computed that are prefetched (0: none)
  int decode_qk_inline = 0;     // 1: decode's lanes tiles inline the bf16 Q.K block (KernelTable::lanes_qk_inline)
  int lanes_prefetch_spread = 1;  // attend_lanes: each register block prefetches a line of the next tile every
                                  // spread steps of its loop, rounded down to a power of 2 (0: no prefetching)
};
// Every parameter once: its name (the Python side's), its field and its
// allowed range [min, max]. set_cpu_tuning checks against it, and the _C
// module's cpu_tuning* functions are generated from it.
struct CpuTuningField {
  const char* name;
  int CpuTuning::*value;
  int min, max;
};
inline constexpr CpuTuningField kCpuTuningFields[] = {
    {"prefill_tile_rows", &CpuTuning::prefill_tile_rows, 8, 512},
    {"lanes_tile_keys", &CpuTuning::lanes_tile_keys, 16, 2048},
    {"prefetch_distance", &CpuTuning::prefetch_distance, 0, 4},
    {"decode_qk_inline", &CpuTuning::decode_qk_inline, 0, 1},
    {"lanes_prefetch_spread", &CpuTuning::lanes_prefetch_spread, 0, 16},
};
const CpuTuning& cpu_tuning();
void set_cpu_tuning(const CpuTuning& tuning);  // TORCH_CHECKs each field against its range in kCpuTuningFields

// Prefetches [p, p + bytes) into L2, for the tiles (the next K/V tile) and the
// drivers (the next item's query rows). L2, not L1: an fp32 tile is larger
// than L1, and prefetching it there evicts the tile being computed.
inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 2);
}

}  // namespace chunkattn::cpu
