// merge_attn_states on CUDA: two normalised attention results of the same
// queries over disjoint key sets, merged by their log-sum-exps into one. The
// contract (layouts, -inf/+inf, prefill_tokens_with_context) is vLLM's and is
// stated in csrc/cpu/merge_attn_states.cpp; launch.h has the arguments.
//
// A normalised result with log-sum-exp lse is the partial state (m = lse, n = 1,
// o = out); the merge is common/partial_state.h's in the log2 domain of every
// CUDA kernel (m = lse * log2(e)).
//
// Launch: <<<ceil(num_tokens * num_heads / 4), 128>>>: one warp per (token,
// head), its lanes over the head's columns.
#include "cuda/common.cuh"

namespace chunkattn::cuda {

namespace {

constexpr int kMergeThreads = 128;
constexpr int kRowsPerBlock = kMergeThreads / 32;

// +inf (a row that saw no key, as FlashAttention-2 writes it) and -inf both mean empty.
__device__ __forceinline__ float empty_if_inf(float lse) { return lse == kNegInf || lse == -kNegInf ? kNegInf : lse; }

template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_attn_states_kernel(MergeArgs a) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  if (row >= static_cast<int64_t>(a.num_tokens) * a.num_heads) return;  // warp-uniform
  const int lane = threadIdx.x & 31;
  const int t = static_cast<int>(row / a.num_heads), h = static_cast<int>(row % a.num_heads);
  T* out = static_cast<T*>(a.output) + t * a.output_stride_token + h * a.output_stride_head;
  const T* suffix = static_cast<const T*>(a.suffix_output) + t * a.suffix_stride_token + h * a.suffix_stride_head;
  const float suffix_lse = empty_if_inf(a.suffix_lse[h * a.suffix_lse_stride_head + t * a.suffix_lse_stride_token]);
  float* out_lse = a.output_lse ? a.output_lse + h * a.output_lse_stride_head + t * a.output_lse_stride_token : nullptr;

  if (t >= a.tokens_with_context) {
    for (int d = lane; d < a.head_size; d += 32) out[d] = suffix[d];
    if (out_lse && lane == 0) *out_lse = suffix_lse;
    return;
  }
  const T* prefix = static_cast<const T*>(a.prefix_output) + t * a.prefix_stride_token + h * a.prefix_stride_head;
  const float prefix_lse = empty_if_inf(a.prefix_lse[h * a.prefix_lse_stride_head + t * a.prefix_lse_stride_token]);
  PartialState merged = normalised_state(prefix_lse * kLog2e);
  const MergeScales scales = merge<Log2Exp>(merged, normalised_state(suffix_lse * kLog2e));
  const float inv = inverse_sum(merged.n);
  for (int d = lane; d < a.head_size; d += 32) {
    const float o = combine(Float16<T>::to_float(prefix[d]), Float16<T>::to_float(suffix[d]), scales);
    out[d] = Float16<T>::from_float(o * inv);
  }
  if (out_lse && lane == 0) *out_lse = merged.n > 0.f ? (merged.m + log2f(merged.n)) * kLn2 : kNegInf;
}

}  // namespace

void launch_merge_attn_states(const MergeArgs& a, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(a.num_tokens) * a.num_heads;
  if (rows <= 0 || a.head_size <= 0) return;
  const unsigned grid = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
#define CHUNKATTN_CASE_DTYPE(ENUM, T, SCALAR, NAME)                                 \
  case DType::ENUM: {                                                               \
    constexpr auto kernel = merge_attn_states_kernel<T>;                            \
    CHUNKATTN_LAUNCH(kernel, grid, kMergeThreads, 0, stream, a);                    \
    check_launch("merge_attn_states");                                              \
    return;                                                                         \
  }
  switch (a.dtype) {
    CHUNKATTN_CUDA_FOR_EACH_DTYPE(CHUNKATTN_CASE_DTYPE)
  }
#undef CHUNKATTN_CASE_DTYPE
  throw std::runtime_error("chunkattn CUDA merge_attn_states: unsupported dtype (supported: " + supported_dtypes() +
                           ")");
}

}  // namespace chunkattn::cuda
