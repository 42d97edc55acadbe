// Two-phase-partition (TPP) decode attention on CUDA: ChunkAttention
// section 3.2, over the prefix tree recovered from vLLM's block tables
// (vllm_chunkattn/prefix/tree.py). Same semantics as torch_fallback.tpp_decode.
//
// Layouts
//   query, out   [batch, num_heads, head_size]  fp16/bf16, rows 16-byte aligned
//   kv_cache     [num_blocks, num_kv_heads, block_size, 2 * head_size]: per block
//                and KV head a K tile [block_size, head_size] then a V tile
//   block_table  [batch, max_blocks] int32; seq_lens [batch] int32
//   tree arrays  int32, PrefixTreeContext: order [batch]; node_begin/end,
//                node_chunk_begin/end, node_partial_offset [num_nodes];
//                shared_chunks [batch]; row_partial_offsets [batch + 1]; row_partials
//   GQA: query head hq uses KV head hq / G, G = num_heads / num_kv_heads <= 64.
//
// Launches on the caller's stream, all with grids that depend on shapes only
// (never on the tree values), so the sequence is CUDA-graph safe. The plan
// runs once per step (launch_tpp_decode_plan, from the metadata builder, into
// the step's plan buffers: csrc/common/decode_plan.h); every layer then runs attend
// and merge (launch_tpp_decode), which read it.
//
// 1. plan <<<1, 256>>>: for every node k it derives row tiles (64 / G requests,
//    i.e. <= 64 query rows, per tile) and pieces (the node's positions split
//    into `pieces` ranges of whole KV tiles, more pieces when the batch has few
//    node tiles, so that small trees still fill the GPU), then writes the
//    chunk-first work list items (node, row tile, piece) with a block-wide
//    prefix sum, ended by a row with node -1, the fp32 slot of every (node
//    row, piece) partial, and for every partial row of the context where its
//    pieces live.
//
// 2. attend <<<grid1 + S * batch * num_kv_heads, 128, smem>>> (attention.cuh):
//    - blocks [0, grid1): chunk-first phase. grid1 = min(work-list capacity,
//      resident blocks); each block loops over (item, KV head) jobs. A job
//      stacks the queries of the covered requests (x GQA group) into one
//      matrix of <= 64 rows that meets the node's K/V positions of its piece
//      through mma.sync; it writes fp32 partials (o, m, n) per row.
//    - blocks [grid1, ...): sequence-first phase, block (split, request, KV
//      head): the request's private positions [shared_chunks * block_size,
//      seq_len), split flash-decoding style into up to S ranges of whole KV
//      tiles (S: whole waves of resident blocks, at most 16, num_splits_for_waves);
//      rows = the G query heads of the KV head, in attend()'s group layout
//      (two K/V stages where they cost no resident blocks, launch_config).
//      Writes fp32 partials per split.
// 3. merge <<<batch * num_kv_heads, 128>>>: per request and head, the online-
//    softmax merge (paper equation 2) of its node pieces (via row_partials) and
//    its private splits, then its head's sink, if any; writes out = o / n (0 for a
//    request with no context).
//
// Variants (ScoreMod, attention.cuh): soft-capping and ALiBi change the
// logits in both phases alike; a sliding window masks per row and drops the
// positions before every covered row's window: a chunk-first job starts at
// the earliest window of its requests, a request's splits at its own.
//
// Plan (int4 rows, csrc/common/decode_plan.h):
//   node_work int4 [num_nodes] (slot base, pieces, KV tiles per piece, 0)
//   partial_work int4 [num_partial_rows] (first slot, slot stride, pieces, node)
//   items int4 [item capacity + 1] (node, row tile, piece, 0), then (-1, ...)
// Workspace of a layer (one byte buffer from the caller, size
// tpp_decode_workspace_bytes):
//   piece partials: (m, n) float2 and o float [slot capacity][num_heads][(D)]
//   split partials: (m, n) float2 and o float [batch][S][num_heads][(D)]
// m is kept in the log2 domain (scores times scale * log2(e)) throughout.
#include <algorithm>
#include <cmath>

#include "cuda/attention.cuh"
#include "common/decode_plan.h"

namespace chunkattn::cuda {

namespace {

constexpr int kMaxPieces = 16;  // pieces per node, chunk-first
constexpr int kMaxSplits = 16;  // splits per request, sequence-first
constexpr int kMinPieceRows = 512;
constexpr int kPlanThreads = 256;

struct DecodeKernelParams {
  void* out;
  const void* query;
  const void* kv_cache;
  const int* block_table;
  const int* seq_lens;
  const int* order;
  const int* node_begin;
  const int* node_end;
  const int* node_chunk_begin;
  const int* node_chunk_end;
  const int* node_partial_offset;
  const int* shared_chunks;
  const int* row_partial_offsets;
  const int* row_partials;
  int batch, num_heads, num_kv_heads, group, block_size, block_shift;
  int num_nodes, num_partial_rows;
  ScoreMod mod;
  const float* sinks;  // [num_heads] or null (natural units)
  int64_t out_stride_row, out_stride_head, query_stride_row, query_stride_head;
  int64_t cache_stride_block, cache_stride_head, block_table_stride;
  // plan
  int rows_per_tile;  // requests per chunk-first row tile
  int kv_tile;        // positions per KV tile (TileConfig<D>::kKvTile)
  int target_blocks;  // resident blocks of the attend kernel on this GPU
  int item_capacity;
  int piece_row_capacity;
  int grid_chunk_first;
  int num_splits;
  int group_stages;  // K/V stages of the sequence-first phase (1 or 2)
  // plan
  int4* node_work;
  int4* partial_work;
  int4* items;
  // workspace
  float2* piece_ml;
  float* piece_o;
  float2* split_ml;
  float* split_o;
};

// The first private position of request b that its window reaches (all of
// them without a window): where its sequence-first splits start.
__device__ __forceinline__ int visible_private_start(const DecodeKernelParams& p, int b) {
  const int start = p.shared_chunks[b] * p.block_size;
  return p.mod.window > 0 ? max(start, p.seq_lens[b] - p.mod.window) : start;
}

// How request b's private positions are split: returns the number of splits
// (0 when it has none) and the KV tiles per split. Used by the attend and the
// merge kernels alike.
__device__ __forceinline__ int private_splits(int private_tokens, int kv_tile, int max_splits,
                                              int& tiles_per_split) {
  tiles_per_split = 0;
  if (private_tokens <= 0) return 0;
  const int tiles = ceil_div(private_tokens, kv_tile);
  const int splits = min(max_splits, tiles);
  tiles_per_split = ceil_div(tiles, splits);
  return ceil_div(tiles, tiles_per_split);
}

__global__ void __launch_bounds__(kPlanThreads) tpp_plan_kernel(DecodeKernelParams p) {
  __shared__ int scratch[33];
  int my_tiles = 0, my_rows = 0;
  for (int k = threadIdx.x; k < p.num_nodes; k += blockDim.x) {
    const int rows = p.node_end[k] - p.node_begin[k];
    const int chunks = p.node_chunk_end[k] - p.node_chunk_begin[k];
    if (rows > 0 && chunks > 0) {
      my_tiles += ceil_div(rows, p.rows_per_tile);
      my_rows += rows;
    }
  }
  const int total_tiles = block_sum(my_tiles, scratch);
  const int total_rows = block_sum(my_rows, scratch);
  // Pieces per node: enough jobs to fill the GPU, within the slot capacity.
  int desired = total_tiles > 0 ? ceil_div(p.target_blocks, total_tiles * p.num_kv_heads) : 1;
  desired = max(1, min(desired, kMaxPieces));
  if (total_rows > 0) desired = max(1, min(desired, p.piece_row_capacity / total_rows));

  int item_carry = 0, slot_carry = 0;
  for (int base = 0; base < p.num_nodes; base += blockDim.x) {
    const int k = base + threadIdx.x;
    int rows = 0, tiles = 0, pieces = 0, tiles_per_piece = 0;
    if (k < p.num_nodes) {
      const int r = p.node_end[k] - p.node_begin[k];
      const int chunks = p.node_chunk_end[k] - p.node_chunk_begin[k];
      if (r > 0 && chunks > 0) {
        rows = r;
        tiles = ceil_div(rows, p.rows_per_tile);
        const int kv_tiles = ceil_div(chunks * p.block_size, p.kv_tile);
        pieces = min(desired, kv_tiles);
        tiles_per_piece = ceil_div(kv_tiles, pieces);
        pieces = ceil_div(kv_tiles, tiles_per_piece);  // no empty piece
      }
    }
    int items_total = 0, slots_total = 0;
    const int item_offset = item_carry + block_exclusive_scan(tiles * pieces, scratch, items_total);
    const int slot_offset = slot_carry + block_exclusive_scan(rows * pieces, scratch, slots_total);
    if (k < p.num_nodes) {
      p.node_work[k] = make_int4(slot_offset, pieces, tiles_per_piece, 0);
      for (int i = 0; i < tiles * pieces; ++i) {
        if (item_offset + i < p.item_capacity) p.items[item_offset + i] = make_int4(k, i / pieces, i % pieces, 0);
      }
      const int first = p.node_partial_offset[k];
      for (int r = 0; r < rows; ++r) {
        const int row = first + r;
        if (row >= 0 && row < p.num_partial_rows) p.partial_work[row] = make_int4(slot_offset + r, rows, pieces, k);
      }
    }
    item_carry += items_total;
    slot_carry += slots_total;
  }
  // Every row after the last item is an end row: a block striding through the
  // list may step over the first one.
  for (int i = min(item_carry, p.item_capacity) + threadIdx.x; i <= p.item_capacity; i += blockDim.x)
    p.items[i] = make_int4(kNoNode, 0, 0, 0);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) tpp_attend_kernel(DecodeKernelParams p) {
  char* smem = dynamic_smem();
  constexpr int kTile = TileConfig<D>::kKvTile;
  const T* query = static_cast<const T*>(p.query);
  const T* cache = static_cast<const T*>(p.kv_cache);
  const int G = p.group;

  if (static_cast<int>(blockIdx.x) < p.grid_chunk_first) {
    // ---------------- chunk-first: (node, row tile, piece) x KV head jobs
    // Items up to an end row (node -1); row item_capacity always is one.
    for (int job = blockIdx.x;; job += p.grid_chunk_first) {
      const int h = job % p.num_kv_heads;
      const int4 item = p.items[min(job / p.num_kv_heads, p.item_capacity)];
      if (item.x < 0) break;  // block-uniform
      const int node = item.x, tile = item.y, piece = item.z;
      const int4 meta = p.node_work[node];
      const int begin = p.node_begin[node];
      const int rows = p.node_end[node] - begin;
      const int first = begin + tile * p.rows_per_tile;  // first tree position of the tile
      const int num_requests = min(p.rows_per_tile, begin + rows - first);
      const int node_t_end = p.node_chunk_end[node] * p.block_size;
      int t_begin = p.node_chunk_begin[node] * p.block_size + piece * meta.z * kTile;
      const int t_end = min(node_t_end, t_begin + meta.z * kTile);
      if (p.mod.window > 0) {  // skip the positions before every covered request's window
        int first_seen = INT_MAX;
        for (int i = 0; i < num_requests; ++i)
          first_seen = min(first_seen, p.seq_lens[p.order[first + i]] - p.mod.window);
        t_begin = max(t_begin, first_seen);
      }
      const KvSource<T> kv{cache, p.cache_stride_block, p.cache_stride_head,
                           p.block_table + static_cast<int64_t>(p.order[begin]) * p.block_table_stride, h,
                           p.block_shift};
      const int slot0 = meta.x + piece * rows + (first - begin);
      attend<T, D, false>(
          smem, num_requests * G,
          [&](int r) {
            return query + static_cast<int64_t>(p.order[first + r / G]) * p.query_stride_row +
                   static_cast<int64_t>(h * G + r % G) * p.query_stride_head;
          },
          kv, t_begin, t_end, [&](int r) { return p.seq_lens[p.order[first + r / G]] - 1; },
          [&](int r) { return h * G + r % G; }, p.mod,
          [&](int r, int d, float4 o, float m, float n) {
            const int slot = slot0 + r / G;
            if (slot >= p.piece_row_capacity) return;
            const int64_t idx = static_cast<int64_t>(slot) * p.num_heads + h * G + r % G;
            *reinterpret_cast<float4*>(p.piece_o + idx * D + d) = o;
            if (d == 0) p.piece_ml[idx] = make_float2(m, n);
          });
    }
    return;
  }

  // ---------------- sequence-first: (split, request, KV head), attend()'s
  // group layout
  const int index = blockIdx.x - p.grid_chunk_first;
  const int split = index % p.num_splits;
  const int h = (index / p.num_splits) % p.num_kv_heads;
  const int b = index / p.num_splits / p.num_kv_heads;
  if (b >= p.batch) return;
  const int seq_len = p.seq_lens[b];
  const int start = visible_private_start(p, b);
  int tiles_per_split;
  const int splits = private_splits(seq_len - start, kTile, p.num_splits, tiles_per_split);
  if (split >= splits) return;  // block-uniform
  const int t_begin = start + split * tiles_per_split * kTile;
  const int t_end = min(seq_len, t_begin + tiles_per_split * kTile);
  const KvSource<T> kv{cache, p.cache_stride_block, p.cache_stride_head,
                       p.block_table + static_cast<int64_t>(b) * p.block_table_stride, h, p.block_shift};
  const T* q = query + static_cast<int64_t>(b) * p.query_stride_row;
  attend<T, D, false, RowLayout::kGroup>(
      smem, G, [&](int r) { return q + static_cast<int64_t>(h * G + r) * p.query_stride_head; }, kv, t_begin,
      t_end, [&](int) { return seq_len - 1; }, [&](int r) { return h * G + r; }, p.mod,
      [&](int r, int d, float4 o, float m, float n) {
        const int64_t idx = (static_cast<int64_t>(b) * p.num_splits + split) * p.num_heads + h * G + r;
        *reinterpret_cast<float4*>(p.split_o + idx * D + d) = o;
        if (d == 0) p.split_ml[idx] = make_float2(m, n);
      },
      p.group_stages);
}

// One part (m, n) = ml, o = po into the running state (paper equation (2), log2 domain).
__device__ __forceinline__ void merge_part(PartialState& state, float4& o, float2 ml, float4 po) {
  o = combine4(o, po, merge<Log2Exp>(state, PartialState{ml.x, ml.y}));
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) tpp_merge_kernel(DecodeKernelParams p) {
  constexpr int kTile = TileConfig<D>::kKvTile;
  const int h = blockIdx.x % p.num_kv_heads, b = blockIdx.x / p.num_kv_heads;
  if (b >= p.batch) return;
  const int G = p.group;
  int tiles_per_split;
  const int splits = private_splits(p.seq_lens[b] - visible_private_start(p, b), kTile, p.num_splits, tiles_per_split);
  const int e_begin = p.row_partial_offsets[b], e_end = p.row_partial_offsets[b + 1];
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(b) * p.out_stride_row;
  for (int i = threadIdx.x; i < G * (D / 4); i += blockDim.x) {
    const int hq = h * G + i / (D / 4), d = (i % (D / 4)) * 4;
    PartialState state;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int e = e_begin; e < e_end; ++e) {
      const int row = p.row_partials[e];
      if (row < 0 || row >= p.num_partial_rows) continue;
      const int4 meta = p.partial_work[row];
      for (int j = 0; j < meta.z; ++j) {
        const int slot = meta.x + j * meta.y;
        if (slot < 0 || slot >= p.piece_row_capacity) continue;
        const int64_t idx = static_cast<int64_t>(slot) * p.num_heads + hq;
        merge_part(state, o, p.piece_ml[idx], *reinterpret_cast<const float4*>(p.piece_o + idx * D + d));
      }
    }
    for (int s = 0; s < splits; ++s) {
      const int64_t idx = (static_cast<int64_t>(b) * p.num_splits + s) * p.num_heads + hq;
      merge_part(state, o, p.split_ml[idx], *reinterpret_cast<const float4*>(p.split_o + idx * D + d));
    }
    // The sink joins once, after every part (common/partial_state.h merge_sink).
    const float sink_scale = p.sinks ? merge_sink<Log2Exp>(state, p.sinks[hq] * kLog2e) : 1.f;
    const float inv = sink_scale * inverse_sum(state.n);
    store4<T>(out + static_cast<int64_t>(hq) * p.out_stride_head + d, o.x * inv, o.y * inv, o.z * inv, o.w * inv);
  }
}

// Shape-only launch configuration (identical at CUDA-graph capture and replay,
// and for the plan and every layer's run of one step).
struct LaunchConfig {
  int group, rows_per_tile, kv_tile, target_blocks, item_capacity, piece_row_capacity;
  int grid_chunk_first, num_splits, group_stages, smem_bytes;
  size_t off_piece_ml, off_piece_o, off_split_ml, off_split_o, workspace_bytes;
};

// Splits per request of the sequence-first phase, from shapes only. A decode
// step is memory bound, so the (split, request, KV head) blocks should fill
// whole waves of the GPU: a last wave that is mostly empty leaves HBM idle
// (b = 32 with 8 KV heads on 132 SMs x 3 blocks: 2 splits make 1.3 waves).
// Each split also costs a partial to write and merge, so: the fewest splits
// whose wave efficiency (waves / whole waves) is within 10% of the best.
inline int num_splits_for_waves(int64_t seq_blocks, int target_blocks) {
  double efficiency[kMaxSplits + 1] = {};
  double best = 0.0;
  for (int s = 1; s <= kMaxSplits; ++s) {
    const double waves = static_cast<double>(s * seq_blocks) / std::max(target_blocks, 1);
    efficiency[s] = waves / std::ceil(waves);
    best = std::max(best, efficiency[s]);
  }
  for (int s = 1; s <= kMaxSplits; ++s)
    if (efficiency[s] >= 0.9 * best) return s;
  return 1;
}

template <typename T, int D>
LaunchConfig launch_config(const DecodeArgs& a) {
  LaunchConfig c{};
  const int device = current_device();
  c.group = a.num_heads / a.num_kv_heads;
  // The sequence-first phase's second K/V stage, where it costs no resident
  // blocks: an H100 or H200 SM fits 3 blocks of 72 KiB (D = 128, G <= 16) as
  // it fits 3 of the stacked layout's 51 KiB; an A100's would fit 2, so one
  // stage there. Shapes and device only, so identical at capture and replay.
  c.group_stages = SmemLayout<D, RowLayout::kGroup>::kStages;
  c.smem_bytes = tpp_attend_smem_bytes<D>(c.group, c.group_stages);
  int per_sm = prepare_kernel<tpp_attend_kernel<T, D>>(c.smem_bytes, kThreads, device);
  const int one_stage_bytes = tpp_attend_smem_bytes<D>(c.group, 1);
  if (one_stage_bytes < c.smem_bytes) {
    const int one_stage_per_sm = prepare_kernel<tpp_attend_kernel<T, D>>(one_stage_bytes, kThreads, device);
    if (one_stage_per_sm > per_sm) {
      c.group_stages = 1;
      c.smem_bytes = one_stage_bytes;
      per_sm = one_stage_per_sm;
    }
  }
  c.target_blocks = num_sms(device) * per_sm;
  c.rows_per_tile = std::max(1, kMaxRows / c.group);
  c.kv_tile = TileConfig<D>::kKvTile;
  const int nodes = std::max(a.num_nodes, 0), partial_rows = std::max(a.num_partial_rows, 0);
  c.item_capacity = kMaxPieces * (ceil_div(partial_rows, c.rows_per_tile) + nodes);
  c.piece_row_capacity =
      partial_rows == 0 ? 0 : std::min(partial_rows * kMaxPieces, std::max(partial_rows, kMinPieceRows));
  const int64_t jobs_capacity = static_cast<int64_t>(c.item_capacity) * a.num_kv_heads;
  c.grid_chunk_first = static_cast<int>(std::min<int64_t>(jobs_capacity, c.target_blocks));
  c.num_splits = num_splits_for_waves(static_cast<int64_t>(std::max(a.batch, 1)) * a.num_kv_heads, c.target_blocks);

  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align_up(bytes);
    return at;
  };
  const size_t heads = static_cast<size_t>(a.num_heads);
  c.off_piece_ml = take(sizeof(float2) * c.piece_row_capacity * heads);
  c.off_piece_o = take(sizeof(float) * c.piece_row_capacity * heads * D);
  const size_t split_rows = static_cast<size_t>(std::max(a.batch, 0)) * c.num_splits * heads;
  c.off_split_ml = take(sizeof(float2) * split_rows);
  c.off_split_o = take(sizeof(float) * split_rows * D);
  c.workspace_bytes = off;
  return c;
}

DecodeKernelParams kernel_params(const DecodeArgs& a, const LaunchConfig& c, const DecodePlanBuffers& plan) {
  DecodeKernelParams p{};
  p.out = a.out;
  p.query = a.query;
  p.kv_cache = a.kv_cache;
  p.block_table = a.block_table;
  p.seq_lens = a.seq_lens;
  p.order = a.order;
  p.node_begin = a.node_begin;
  p.node_end = a.node_end;
  p.node_chunk_begin = a.node_chunk_begin;
  p.node_chunk_end = a.node_chunk_end;
  p.node_partial_offset = a.node_partial_offset;
  p.shared_chunks = a.shared_chunks;
  p.row_partial_offsets = a.row_partial_offsets;
  p.row_partials = a.row_partials;
  p.batch = a.batch;
  p.num_heads = a.num_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.group = c.group;
  p.block_size = a.block_size;
  p.block_shift = log2_exact(a.block_size);
  p.num_nodes = a.num_nodes;
  p.num_partial_rows = a.num_partial_rows;
  p.mod = score_mod(a.variant);
  p.sinks = a.variant.sinks;
  p.out_stride_row = a.out_stride_row;
  p.out_stride_head = a.out_stride_head;
  p.query_stride_row = a.query_stride_row;
  p.query_stride_head = a.query_stride_head;
  p.cache_stride_block = a.cache_stride_block;
  p.cache_stride_head = a.cache_stride_head;
  p.block_table_stride = a.block_table_stride;
  p.rows_per_tile = c.rows_per_tile;
  p.kv_tile = c.kv_tile;
  p.target_blocks = c.target_blocks;
  p.item_capacity = c.item_capacity;
  p.piece_row_capacity = c.piece_row_capacity;
  p.grid_chunk_first = c.grid_chunk_first;
  p.num_splits = c.num_splits;
  p.group_stages = c.group_stages;
  p.node_work = reinterpret_cast<int4*>(plan.node_work);
  p.partial_work = reinterpret_cast<int4*>(plan.partial_work);
  p.items = reinterpret_cast<int4*>(plan.items);
  return p;
}

enum class Stage { kSizes, kPlan, kRun };

template <typename T, int D>
void decode_stage(Stage stage, const DecodeArgs& a, const DecodePlanBuffers* plan, void* workspace,
                  cudaStream_t stream, DecodeSizes* sizes) {
  const LaunchConfig c = launch_config<T, D>(a);
  if (stage == Stage::kSizes) {
    *sizes = DecodeSizes{c.item_capacity, c.piece_row_capacity, c.workspace_bytes};
    return;
  }
  DecodeKernelParams p = kernel_params(a, c, *plan);
  if (stage == Stage::kPlan) {
    // Also for an empty batch: the end rows keep a later layer's attend, or a
    // graph captured for a larger batch, off stale items.
    constexpr auto plan_kernel = tpp_plan_kernel;
    CHUNKATTN_LAUNCH(plan_kernel, 1, kPlanThreads, 0, stream, p);
    check_launch("tpp_decode_plan");
    return;
  }
  if (a.batch <= 0) return;
  char* ws = static_cast<char*>(workspace);
  p.piece_ml = reinterpret_cast<float2*>(ws + c.off_piece_ml);
  p.piece_o = reinterpret_cast<float*>(ws + c.off_piece_o);
  p.split_ml = reinterpret_cast<float2*>(ws + c.off_split_ml);
  p.split_o = reinterpret_cast<float*>(ws + c.off_split_o);
  constexpr auto attend_kernel = tpp_attend_kernel<T, D>;
  constexpr auto merge_kernel = tpp_merge_kernel<T, D>;
  const int64_t grid = static_cast<int64_t>(c.grid_chunk_first) +
                       static_cast<int64_t>(c.num_splits) * a.batch * a.num_kv_heads;
  CHUNKATTN_LAUNCH(attend_kernel, static_cast<unsigned>(grid), kThreads, c.smem_bytes, stream, p);
  CHUNKATTN_LAUNCH(merge_kernel, a.batch * a.num_kv_heads, kThreads, 0, stream, p);
  check_launch("tpp_decode");
}

template <typename T>
void dispatch_head_size(Stage stage, const DecodeArgs& a, const DecodePlanBuffers* plan, void* workspace,
                        cudaStream_t stream, DecodeSizes* sizes) {
#define CHUNKATTN_CASE_HEAD_SIZE(D) \
  case D:                           \
    return decode_stage<T, D>(stage, a, plan, workspace, stream, sizes);
  switch (a.head_size) {
    CHUNKATTN_CUDA_FOR_EACH_HEAD_SIZE(CHUNKATTN_CASE_HEAD_SIZE)
    default:
      throw std::runtime_error("chunkattn CUDA tpp_decode: unsupported head size " + std::to_string(a.head_size) +
                               " (supported: " + supported_head_sizes() + ")");
  }
#undef CHUNKATTN_CASE_HEAD_SIZE
}

void dispatch(Stage stage, const DecodeArgs& a, const DecodePlanBuffers* plan, void* workspace, cudaStream_t stream,
              DecodeSizes* sizes) {
#define CHUNKATTN_CASE_DTYPE(ENUM, T, SCALAR, NAME) \
  case DType::ENUM:                                 \
    return dispatch_head_size<T>(stage, a, plan, workspace, stream, sizes);
  switch (a.dtype) {
    CHUNKATTN_CUDA_FOR_EACH_DTYPE(CHUNKATTN_CASE_DTYPE)
  }
#undef CHUNKATTN_CASE_DTYPE
  throw std::runtime_error("chunkattn CUDA tpp_decode: unsupported dtype (supported: " + supported_dtypes() + ")");
}

}  // namespace

DecodeSizes tpp_decode_sizes(const DecodeArgs& args) {
  DecodeSizes sizes{};
  dispatch(Stage::kSizes, args, nullptr, nullptr, nullptr, &sizes);
  return sizes;
}

void launch_tpp_decode_plan(const DecodeArgs& args, const DecodePlanBuffers& plan, cudaStream_t stream) {
  dispatch(Stage::kPlan, args, &plan, nullptr, stream, nullptr);
}

void launch_tpp_decode(const DecodeArgs& args, const DecodePlanBuffers& plan, void* workspace, cudaStream_t stream) {
  dispatch(Stage::kRun, args, &plan, workspace, stream, nullptr);
}

}  // namespace chunkattn::cuda
