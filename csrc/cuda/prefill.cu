// Paged prefill on CUDA: causal attention of each request's new tokens over
// its whole paged context (prefill, chunked prefill, prefill after a
// prefix-cache hit alike). Same semantics as torch_fallback.paged_prefill.
//
// Layouts
//   query, out       [num_tokens, num_heads, head_size] fp16/bf16 (rows 16-byte aligned)
//   kv_cache         [num_blocks, num_kv_heads, block_size, 2 * head_size] (csrc/chunkattn.h)
//   query_start_loc  [num_reqs + 1] int32, starting at 0: request i owns query rows
//                    [qsl[i], qsl[i+1]); its new tokens are the last
//                    qsl[i+1] - qsl[i] of its seq_lens[i] context positions
//   seq_lens [num_reqs] int32; block_table [num_reqs, max_blocks] int32
//
// Launches (grids from shapes only; no host synchronisation):
// 1. plan <<<1, 256>>>: tile_offsets[i] = sum over requests j < i of
//    ceil(new_tokens_j / P), P = 64 / G query tokens per tile (G = GQA group),
//    so that a tile is <= 64 query rows: P tokens x the G heads of one KV head.
// 2. attend <<<(ceil(num_tokens / P) + num_reqs, num_kv_heads), 128, smem>>>:
//    block (x, h) finds its request by binary search over tile_offsets (blocks
//    past the last tile exit), stacks its tokens' G query heads into one tile
//    (row = token * G + head) and runs attention.cuh over positions
//    [0, last token's position] with the causal limit of every row (from the
//    tile's earliest window on, with a sliding window). Normalised output,
//    with the head's sink if any, straight into `out`.
// Workspace: tile_offsets int [num_reqs + 1].
#include <algorithm>

#include "cuda/attention.cuh"

namespace chunkattn::cuda {

namespace {

constexpr int kPlanThreads = 256;

struct PrefillKernelParams {
  void* out;
  const void* query;
  const void* kv_cache;
  const int* query_start_loc;
  const int* seq_lens;
  const int* block_table;
  int num_reqs, num_heads, num_kv_heads, group, block_shift, tokens_per_tile;
  ScoreMod mod;
  const float* sinks;  // [num_heads] or null (natural units)
  int64_t out_stride_row, out_stride_head, query_stride_row, query_stride_head;
  int64_t cache_stride_block, cache_stride_head, block_table_stride;
  int* tile_offsets;
};

__global__ void __launch_bounds__(kPlanThreads) prefill_plan_kernel(PrefillKernelParams p) {
  __shared__ int scratch[33];
  int carry = 0;
  for (int base = 0; base < p.num_reqs; base += blockDim.x) {
    const int i = base + threadIdx.x;
    const int new_tokens = i < p.num_reqs ? p.query_start_loc[i + 1] - p.query_start_loc[i] : 0;
    const int tiles = new_tokens > 0 ? ceil_div(new_tokens, p.tokens_per_tile) : 0;
    int total = 0;
    const int offset = carry + block_exclusive_scan(tiles, scratch, total);
    if (i < p.num_reqs) p.tile_offsets[i] = offset;
    carry += total;
  }
  if (threadIdx.x == 0) p.tile_offsets[p.num_reqs] = carry;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) prefill_attend_kernel(PrefillKernelParams p) {
  char* smem = dynamic_smem();
  const int x = blockIdx.x, h = blockIdx.y;
  if (x >= p.tile_offsets[p.num_reqs]) return;
  // Last request whose first tile is <= x (requests without tiles share the
  // offset of the next one, so the last such request is the one that owns x).
  int lo = 0, hi = p.num_reqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (p.tile_offsets[mid] <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int req = lo;
  const int G = p.group;
  const int q_first = p.query_start_loc[req];
  const int new_tokens = p.query_start_loc[req + 1] - q_first;
  const int context = p.seq_lens[req] - new_tokens;  // positions before the first new token
  const int u0 = (x - p.tile_offsets[req]) * p.tokens_per_tile;
  const int num_tokens = min(p.tokens_per_tile, new_tokens - u0);
  const int t_end = context + u0 + num_tokens;  // one past the last row's position
  const T* query = static_cast<const T*>(p.query);
  T* out = static_cast<T*>(p.out);
  const KvSource<T> kv{static_cast<const T*>(p.kv_cache), p.cache_stride_block, p.cache_stride_head,
                       p.block_table + static_cast<int64_t>(req) * p.block_table_stride, h, p.block_shift};
  const int64_t row0 = static_cast<int64_t>(q_first) + u0;
  // A sliding window: the tile's first token sees the earliest positions.
  const int t_begin = p.mod.window > 0 ? max(0, context + u0 - p.mod.window + 1) : 0;
  attend<T, D, true>(
      smem, num_tokens * G,
      [&](int r) {
        return query + (row0 + r / G) * p.query_stride_row + static_cast<int64_t>(h * G + r % G) * p.query_stride_head;
      },
      kv, t_begin, t_end, [&](int r) { return context + u0 + r / G; }, [&](int r) { return h * G + r % G; }, p.mod,
      [&](int r, int d, float4 o, float m, float n) {
        PartialState state{m, n};
        const float sink_scale = p.sinks ? merge_sink<Log2Exp>(state, p.sinks[h * G + r % G] * kLog2e) : 1.f;
        const float inv = sink_scale * inverse_sum(state.n);
        store4<T>(out + (row0 + r / G) * p.out_stride_row + static_cast<int64_t>(h * G + r % G) * p.out_stride_head + d,
                  o.x * inv, o.y * inv, o.z * inv, o.w * inv);
      });
}

template <typename T, int D>
void run_prefill(const PrefillArgs& a, void* workspace, cudaStream_t stream, size_t* bytes_only) {
  if (bytes_only) {
    *bytes_only = align_up(sizeof(int) * (static_cast<size_t>(std::max(a.num_reqs, 0)) + 1));
    return;
  }
  if (a.num_reqs <= 0 || a.num_tokens <= 0) return;
  const int device = current_device();
  const int smem = SmemLayout<D>::kBytes;
  prepare_kernel<prefill_attend_kernel<T, D>>(smem, kThreads, device);
  PrefillKernelParams p{};
  p.out = a.out;
  p.query = a.query;
  p.kv_cache = a.kv_cache;
  p.query_start_loc = a.query_start_loc;
  p.seq_lens = a.seq_lens;
  p.block_table = a.block_table;
  p.num_reqs = a.num_reqs;
  p.num_heads = a.num_heads;
  p.num_kv_heads = a.num_kv_heads;
  p.group = a.num_heads / a.num_kv_heads;
  p.block_shift = log2_exact(a.block_size);
  p.tokens_per_tile = kMaxRows / p.group > 0 ? kMaxRows / p.group : 1;
  p.mod = score_mod(a.variant);
  p.sinks = a.variant.sinks;
  p.out_stride_row = a.out_stride_row;
  p.out_stride_head = a.out_stride_head;
  p.query_stride_row = a.query_stride_row;
  p.query_stride_head = a.query_stride_head;
  p.cache_stride_block = a.cache_stride_block;
  p.cache_stride_head = a.cache_stride_head;
  p.block_table_stride = a.block_table_stride;
  p.tile_offsets = static_cast<int*>(workspace);

  constexpr auto plan_kernel = prefill_plan_kernel;
  constexpr auto attend_kernel = prefill_attend_kernel<T, D>;
  CHUNKATTN_LAUNCH(plan_kernel, 1, kPlanThreads, 0, stream, p);
  const int64_t tiles = ceil_div(a.num_tokens, p.tokens_per_tile) + static_cast<int64_t>(a.num_reqs);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(a.num_kv_heads));
  CHUNKATTN_LAUNCH(attend_kernel, grid, kThreads, smem, stream, p);
  check_launch("paged_prefill");
}

template <typename T>
void dispatch_head_size(const PrefillArgs& a, void* workspace, cudaStream_t stream, size_t* bytes_only) {
#define CHUNKATTN_CASE_HEAD_SIZE(D) \
  case D:                           \
    return run_prefill<T, D>(a, workspace, stream, bytes_only);
  switch (a.head_size) {
    CHUNKATTN_CUDA_FOR_EACH_HEAD_SIZE(CHUNKATTN_CASE_HEAD_SIZE)
    default:
      throw std::runtime_error("chunkattn CUDA paged_prefill: unsupported head size " + std::to_string(a.head_size) +
                               " (supported: " + supported_head_sizes() + ")");
  }
#undef CHUNKATTN_CASE_HEAD_SIZE
}

void dispatch(const PrefillArgs& a, void* workspace, cudaStream_t stream, size_t* bytes_only) {
#define CHUNKATTN_CASE_DTYPE(ENUM, T, SCALAR, NAME) \
  case DType::ENUM:                                 \
    return dispatch_head_size<T>(a, workspace, stream, bytes_only);
  switch (a.dtype) {
    CHUNKATTN_CUDA_FOR_EACH_DTYPE(CHUNKATTN_CASE_DTYPE)
  }
#undef CHUNKATTN_CASE_DTYPE
  throw std::runtime_error("chunkattn CUDA paged_prefill: unsupported dtype (supported: " + supported_dtypes() + ")");
}

}  // namespace

size_t paged_prefill_workspace_bytes(const PrefillArgs& args) {
  size_t bytes = 0;
  dispatch(args, nullptr, nullptr, &bytes);
  return bytes;
}

void launch_paged_prefill(const PrefillArgs& args, void* workspace, cudaStream_t stream) {
  dispatch(args, workspace, stream, nullptr);
}

}  // namespace chunkattn::cuda
