// Two-phase-partition (TPP) decode attention on CUDA: ChunkAttention
// section 3.2, over the prefix tree recovered from vLLM's block tables
// (vllm_chunkattn/tree.py). Same semantics as torch_kernels.tpp_decode.
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
// Three launches on the caller's stream, all with grids that depend on
// shapes only (never on the tree values), so the sequence is CUDA-graph safe:
//
// 1. plan <<<1, 256>>>: for every node k it derives row tiles (64 / G requests,
//    i.e. <= 64 query rows, per tile) and pieces (the node's positions split
//    into `pieces` ranges of whole KV tiles, more pieces when the batch has few
//    node tiles, so that small trees still fill the GPU), then writes the
//    chunk-first work list items (node, row tile, piece) with a block-wide
//    prefix sum, the fp32 slot of every (node row, piece) partial, and for
//    every partial row of the context where its pieces live.
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
//      tiles (S = ceil(resident blocks / (batch * num_kv_heads)), at most 16);
//      rows = the G query heads of the KV head. Writes fp32 partials per split.
// 3. merge <<<batch * num_kv_heads, 128>>>: per request and head, the online-
//    softmax merge (paper equation 2) of its node pieces (via row_partials) and
//    its private splits; writes out = o / n (0 for a request with no context).
//
// Workspace (one byte buffer from the caller, size tpp_decode_workspace_bytes):
//   node_meta int4 [num_nodes] (slot base, pieces, KV tiles per piece)
//   part_meta int4 [num_partial_rows] (first slot, slot stride, pieces)
//   items int4 [item capacity], item count int
//   piece partials: (m, n) float2 and o float [slot capacity][num_heads][(D)]
//   split partials: (m, n) float2 and o float [batch][S][num_heads][(D)]
// m is kept in the log2 domain (scores times scale * log2(e)) throughout.
#include <algorithm>

#include "cuda/attention.cuh"

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
  float scale_log2;
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
  // workspace
  int4* node_meta;
  int4* part_meta;
  int4* items;
  int* item_count;
  float2* piece_ml;
  float* piece_o;
  float2* split_ml;
  float* split_o;
};

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
      p.node_meta[k] = make_int4(slot_offset, pieces, tiles_per_piece, 0);
      for (int i = 0; i < tiles * pieces; ++i) {
        if (item_offset + i < p.item_capacity) p.items[item_offset + i] = make_int4(k, i / pieces, i % pieces, 0);
      }
      const int first = p.node_partial_offset[k];
      for (int r = 0; r < rows; ++r) {
        const int row = first + r;
        if (row >= 0 && row < p.num_partial_rows) p.part_meta[row] = make_int4(slot_offset + r, rows, pieces, 0);
      }
    }
    item_carry += items_total;
    slot_carry += slots_total;
  }
  if (threadIdx.x == 0) *p.item_count = min(item_carry, p.item_capacity);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) tpp_attend_kernel(DecodeKernelParams p) {
  char* smem = dynamic_smem();
  constexpr int kTile = TileConfig<D>::kKvTile;
  const T* query = static_cast<const T*>(p.query);
  const T* cache = static_cast<const T*>(p.kv_cache);
  const int G = p.group;
  const float scale_log2 = p.scale_log2;
  auto no_limit = [](int) { return INT_MAX; };

  if (static_cast<int>(blockIdx.x) < p.grid_chunk_first) {
    // ---------------- chunk-first: (node, row tile, piece) x KV head jobs
    const int jobs = *p.item_count * p.num_kv_heads;
    for (int job = blockIdx.x; job < jobs; job += p.grid_chunk_first) {
      const int h = job % p.num_kv_heads;
      const int4 item = p.items[job / p.num_kv_heads];
      const int node = item.x, tile = item.y, piece = item.z;
      const int4 meta = p.node_meta[node];
      const int begin = p.node_begin[node];
      const int rows = p.node_end[node] - begin;
      const int first = begin + tile * p.rows_per_tile;  // first tree position of the tile
      const int num_requests = min(p.rows_per_tile, begin + rows - first);
      const int node_t_end = p.node_chunk_end[node] * p.block_size;
      const int t_begin = p.node_chunk_begin[node] * p.block_size + piece * meta.z * kTile;
      const int t_end = min(node_t_end, t_begin + meta.z * kTile);
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
          kv, t_begin, t_end, no_limit, scale_log2,
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

  // ---------------- sequence-first: (split, request, KV head)
  const int index = blockIdx.x - p.grid_chunk_first;
  const int split = index % p.num_splits;
  const int h = (index / p.num_splits) % p.num_kv_heads;
  const int b = index / p.num_splits / p.num_kv_heads;
  if (b >= p.batch) return;
  const int seq_len = p.seq_lens[b];
  const int start = p.shared_chunks[b] * p.block_size;
  int tiles_per_split;
  const int splits = private_splits(seq_len - start, kTile, p.num_splits, tiles_per_split);
  if (split >= splits) return;  // block-uniform
  const int t_begin = start + split * tiles_per_split * kTile;
  const int t_end = min(seq_len, t_begin + tiles_per_split * kTile);
  const KvSource<T> kv{cache, p.cache_stride_block, p.cache_stride_head,
                       p.block_table + static_cast<int64_t>(b) * p.block_table_stride, h, p.block_shift};
  const T* q = query + static_cast<int64_t>(b) * p.query_stride_row;
  attend<T, D, false>(
      smem, G, [&](int r) { return q + static_cast<int64_t>(h * G + r) * p.query_stride_head; }, kv, t_begin,
      t_end, no_limit, scale_log2, [&](int r, int d, float4 o, float m, float n) {
        const int64_t idx = (static_cast<int64_t>(b) * p.num_splits + split) * p.num_heads + h * G + r;
        *reinterpret_cast<float4*>(p.split_o + idx * D + d) = o;
        if (d == 0) p.split_ml[idx] = make_float2(m, n);
      });
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
  const int splits =
      private_splits(p.seq_lens[b] - p.shared_chunks[b] * p.block_size, kTile, p.num_splits, tiles_per_split);
  const int e_begin = p.row_partial_offsets[b], e_end = p.row_partial_offsets[b + 1];
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(b) * p.out_stride_row;
  for (int i = threadIdx.x; i < G * (D / 4); i += blockDim.x) {
    const int hq = h * G + i / (D / 4), d = (i % (D / 4)) * 4;
    PartialState state;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int e = e_begin; e < e_end; ++e) {
      const int row = p.row_partials[e];
      if (row < 0 || row >= p.num_partial_rows) continue;
      const int4 meta = p.part_meta[row];
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
    const float inv = inverse_sum(state.n);
    store4<T>(out + static_cast<int64_t>(hq) * p.out_stride_head + d, o.x * inv, o.y * inv, o.z * inv, o.w * inv);
  }
}

// Shape-only launch plan (identical at CUDA-graph capture and replay).
struct DecodePlan {
  int group, rows_per_tile, kv_tile, target_blocks, item_capacity, piece_row_capacity;
  int grid_chunk_first, num_splits, smem_bytes;
  size_t off_node_meta, off_part_meta, off_items, off_item_count, off_piece_ml, off_piece_o, off_split_ml,
      off_split_o, total_bytes;
};

template <typename T, int D>
DecodePlan make_plan(const DecodeArgs& a) {
  DecodePlan plan{};
  const int device = current_device();
  plan.smem_bytes = SmemLayout<D>::kBytes;
  const int per_sm = prepare_kernel<tpp_attend_kernel<T, D>>(plan.smem_bytes, kThreads, device);
  plan.target_blocks = num_sms(device) * per_sm;
  plan.group = a.num_heads / a.num_kv_heads;
  plan.rows_per_tile = std::max(1, kMaxRows / plan.group);
  plan.kv_tile = TileConfig<D>::kKvTile;
  const int nodes = std::max(a.num_nodes, 0), partial_rows = std::max(a.num_partial_rows, 0);
  plan.item_capacity = kMaxPieces * (ceil_div(partial_rows, plan.rows_per_tile) + nodes);
  plan.piece_row_capacity =
      partial_rows == 0 ? 0 : std::min(partial_rows * kMaxPieces, std::max(partial_rows, kMinPieceRows));
  const int64_t jobs_capacity = static_cast<int64_t>(plan.item_capacity) * a.num_kv_heads;
  plan.grid_chunk_first = static_cast<int>(std::min<int64_t>(jobs_capacity, plan.target_blocks));
  const int64_t seq_blocks = static_cast<int64_t>(std::max(a.batch, 1)) * a.num_kv_heads;
  plan.num_splits = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(kMaxSplits, (plan.target_blocks + seq_blocks - 1) / seq_blocks)));

  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += align_up(bytes);
    return at;
  };
  const size_t heads = static_cast<size_t>(a.num_heads);
  plan.off_node_meta = take(sizeof(int4) * nodes);
  plan.off_part_meta = take(sizeof(int4) * partial_rows);
  plan.off_items = take(sizeof(int4) * plan.item_capacity);
  plan.off_item_count = take(sizeof(int));
  plan.off_piece_ml = take(sizeof(float2) * plan.piece_row_capacity * heads);
  plan.off_piece_o = take(sizeof(float) * plan.piece_row_capacity * heads * D);
  const size_t split_rows = static_cast<size_t>(std::max(a.batch, 0)) * plan.num_splits * heads;
  plan.off_split_ml = take(sizeof(float2) * split_rows);
  plan.off_split_o = take(sizeof(float) * split_rows * D);
  plan.total_bytes = off;
  return plan;
}

template <typename T, int D>
void run_decode(const DecodeArgs& a, void* workspace, cudaStream_t stream, size_t* bytes_only) {
  const DecodePlan plan = make_plan<T, D>(a);
  if (bytes_only) {
    *bytes_only = plan.total_bytes;
    return;
  }
  if (a.batch <= 0) return;
  char* ws = static_cast<char*>(workspace);
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
  p.group = plan.group;
  p.block_size = a.block_size;
  p.block_shift = log2_exact(a.block_size);
  p.num_nodes = a.num_nodes;
  p.num_partial_rows = a.num_partial_rows;
  p.scale_log2 = a.scale * kLog2e;
  p.out_stride_row = a.out_stride_row;
  p.out_stride_head = a.out_stride_head;
  p.query_stride_row = a.query_stride_row;
  p.query_stride_head = a.query_stride_head;
  p.cache_stride_block = a.cache_stride_block;
  p.cache_stride_head = a.cache_stride_head;
  p.block_table_stride = a.block_table_stride;
  p.rows_per_tile = plan.rows_per_tile;
  p.kv_tile = plan.kv_tile;
  p.target_blocks = plan.target_blocks;
  p.item_capacity = plan.item_capacity;
  p.piece_row_capacity = plan.piece_row_capacity;
  p.grid_chunk_first = plan.grid_chunk_first;
  p.num_splits = plan.num_splits;
  p.node_meta = reinterpret_cast<int4*>(ws + plan.off_node_meta);
  p.part_meta = reinterpret_cast<int4*>(ws + plan.off_part_meta);
  p.items = reinterpret_cast<int4*>(ws + plan.off_items);
  p.item_count = reinterpret_cast<int*>(ws + plan.off_item_count);
  p.piece_ml = reinterpret_cast<float2*>(ws + plan.off_piece_ml);
  p.piece_o = reinterpret_cast<float*>(ws + plan.off_piece_o);
  p.split_ml = reinterpret_cast<float2*>(ws + plan.off_split_ml);
  p.split_o = reinterpret_cast<float*>(ws + plan.off_split_o);

  constexpr auto plan_kernel = tpp_plan_kernel;
  constexpr auto attend_kernel = tpp_attend_kernel<T, D>;
  constexpr auto merge_kernel = tpp_merge_kernel<T, D>;
  const int64_t grid = static_cast<int64_t>(plan.grid_chunk_first) +
                       static_cast<int64_t>(plan.num_splits) * a.batch * a.num_kv_heads;
  CHUNKATTN_LAUNCH(plan_kernel, 1, kPlanThreads, 0, stream, p);
  CHUNKATTN_LAUNCH(attend_kernel, static_cast<unsigned>(grid), kThreads, plan.smem_bytes, stream, p);
  CHUNKATTN_LAUNCH(merge_kernel, a.batch * a.num_kv_heads, kThreads, 0, stream, p);
  check_launch("tpp_decode");
}

template <typename T>
void dispatch_head_size(const DecodeArgs& a, void* workspace, cudaStream_t stream, size_t* bytes_only) {
#define CHUNKATTN_CASE_HEAD_SIZE(D) \
  case D:                           \
    return run_decode<T, D>(a, workspace, stream, bytes_only);
  switch (a.head_size) {
    CHUNKATTN_CUDA_FOR_EACH_HEAD_SIZE(CHUNKATTN_CASE_HEAD_SIZE)
    default:
      throw std::runtime_error("chunkattn CUDA tpp_decode: unsupported head size " + std::to_string(a.head_size) +
                               " (supported: " + supported_head_sizes() + ")");
  }
#undef CHUNKATTN_CASE_HEAD_SIZE
}

void dispatch(const DecodeArgs& a, void* workspace, cudaStream_t stream, size_t* bytes_only) {
#define CHUNKATTN_CASE_DTYPE(ENUM, T, SCALAR, NAME) \
  case DType::ENUM:                                 \
    return dispatch_head_size<T>(a, workspace, stream, bytes_only);
  switch (a.dtype) {
    CHUNKATTN_CUDA_FOR_EACH_DTYPE(CHUNKATTN_CASE_DTYPE)
  }
#undef CHUNKATTN_CASE_DTYPE
  throw std::runtime_error("chunkattn CUDA tpp_decode: unsupported dtype (supported: " + supported_dtypes() + ")");
}

}  // namespace

size_t tpp_decode_workspace_bytes(const DecodeArgs& args) {
  size_t bytes = 0;
  dispatch(args, nullptr, nullptr, &bytes);
  return bytes;
}

void launch_tpp_decode(const DecodeArgs& args, void* workspace, cudaStream_t stream) {
  dispatch(args, workspace, stream, nullptr);
}

}  // namespace chunkattn::cuda
