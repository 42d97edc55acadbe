// merge_attn_states on CPU: two attention results over disjoint key sets of
// the same queries, each normalised with its log-sum-exp, into one (vLLM's
// merge_attn_states contract, vllm/v1/attention/ops/merge_attn_states.py).
//
// Tensors:
//   output, prefix_output, suffix_output  [T, H, D], one dtype (float32/16, bfloat16);
//                                         token and head strides free, D contiguous
//   prefix_lse, suffix_lse, output_lse    [H, T] float32, any strides; natural log
//   prefill_tokens_with_context           tokens t >= it take the suffix as is
//
// A normalised result with log-sum-exp lse is the partial state (m = lse,
// n = 1, o = out) of common/partial_state.h, so the merge is that header's.
// An lse of +inf counts as -inf (FlashAttention-2 writes +inf for a row that
// saw no key; vLLM's kernels do the same conversion): a part with lse = -inf
// contributes nothing (its output values, which must be finite, take factor
// 0), and a token whose parts are both empty gets output 0 and lse -inf.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "chunkattn.h"
#include "common/partial_state.h"

namespace chunkattn {

namespace {

// Rows (token, head) per parallel task: a row is only D multiply-adds.
constexpr int64_t kRowsPerTask = 64;

inline float empty_if_inf(float lse) { return std::isinf(lse) ? kPartialNegInf : lse; }

template <typename scalar_t>
void merge_impl(torch::Tensor& output, const torch::Tensor& prefix_output, const torch::Tensor& prefix_lse,
                const torch::Tensor& suffix_output, const torch::Tensor& suffix_lse,
                const std::optional<torch::Tensor>& output_lse, int64_t tokens_with_context) {
  const int64_t num_tokens = output.size(0), num_heads = output.size(1), D = output.size(2);
  scalar_t* out = output.data_ptr<scalar_t>();
  const scalar_t* pre = prefix_output.data_ptr<scalar_t>();
  const scalar_t* suf = suffix_output.data_ptr<scalar_t>();
  const float* pre_lse = prefix_lse.data_ptr<float>();
  const float* suf_lse = suffix_lse.data_ptr<float>();
  float* out_lse = output_lse ? output_lse->data_ptr<float>() : nullptr;
  const int64_t o_t = output.stride(0), o_h = output.stride(1);
  const int64_t p_t = prefix_output.stride(0), p_h = prefix_output.stride(1);
  const int64_t s_t = suffix_output.stride(0), s_h = suffix_output.stride(1);
  const int64_t pl_h = prefix_lse.stride(0), pl_t = prefix_lse.stride(1);
  const int64_t sl_h = suffix_lse.stride(0), sl_t = suffix_lse.stride(1);
  const int64_t ol_h = out_lse ? output_lse->stride(0) : 0, ol_t = out_lse ? output_lse->stride(1) : 0;

  at::parallel_for(0, num_tokens * num_heads, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / num_heads, h = row % num_heads;
      scalar_t* dst = out + t * o_t + h * o_h;
      const scalar_t* b = suf + t * s_t + h * s_h;
      const float lse_b = empty_if_inf(suf_lse[h * sl_h + t * sl_t]);
      if (t >= tokens_with_context) {
        for (int64_t d = 0; d < D; ++d) dst[d] = b[d];
        if (out_lse) out_lse[h * ol_h + t * ol_t] = lse_b;
        continue;
      }
      const scalar_t* a = pre + t * p_t + h * p_h;
      PartialState merged = normalised_state(empty_if_inf(pre_lse[h * pl_h + t * pl_t]));
      const MergeScales scales = merge<NaturalExp>(merged, normalised_state(lse_b));
      const float inv = inverse_sum(merged.n);
      for (int64_t d = 0; d < D; ++d)
        dst[d] = static_cast<scalar_t>(
            combine(static_cast<float>(a[d]), static_cast<float>(b[d]), scales) * inv);
      if (out_lse) out_lse[h * ol_h + t * ol_t] = merged.n > 0.f ? merged.m + std::log(merged.n) : kPartialNegInf;
    }
  });
}

void check_lse(const torch::Tensor& lse, const char* name, int64_t num_heads, int64_t num_tokens) {
  TORCH_CHECK(lse.device().is_cpu() && lse.scalar_type() == at::kFloat && lse.dim() == 2 &&
                  lse.size(0) == num_heads && lse.size(1) == num_tokens,
              "chunkattn::merge_attn_states: ", name, " must be a float32 CPU tensor [num_heads, num_tokens] = [",
              num_heads, ", ", num_tokens, "], got ", lse.scalar_type(), " ", lse.sizes());
}

}  // namespace

void merge_attn_states(torch::Tensor& output, const torch::Tensor& prefix_output, const torch::Tensor& prefix_lse,
                       const torch::Tensor& suffix_output, const torch::Tensor& suffix_lse,
                       const std::optional<torch::Tensor>& output_lse,
                       std::optional<int64_t> prefill_tokens_with_context) {
  TORCH_CHECK(output.dim() == 3, "chunkattn::merge_attn_states: output must be [num_tokens, num_heads, head_size]");
  for (const auto* t : {&prefix_output, &suffix_output}) {
    TORCH_CHECK(t->device().is_cpu() && t->sizes() == output.sizes() && t->scalar_type() == output.scalar_type(),
                "chunkattn::merge_attn_states: prefix_output and suffix_output must be CPU tensors with output's "
                "shape ", output.sizes(), " and dtype ", output.scalar_type());
    TORCH_CHECK(t->stride(2) == 1, "chunkattn::merge_attn_states: head_size elements must be contiguous");
  }
  TORCH_CHECK(output.device().is_cpu() && output.stride(2) == 1,
              "chunkattn::merge_attn_states: output must be a CPU tensor with contiguous head_size elements");
  TORCH_CHECK(output.scalar_type() == at::kFloat || output.scalar_type() == at::kHalf ||
                  output.scalar_type() == at::kBFloat16,
              "chunkattn::merge_attn_states: outputs must be float32, float16 or bfloat16, got ",
              output.scalar_type());
  const int64_t num_tokens = output.size(0), num_heads = output.size(1);
  check_lse(prefix_lse, "prefix_lse", num_heads, num_tokens);
  check_lse(suffix_lse, "suffix_lse", num_heads, num_tokens);
  if (output_lse) check_lse(*output_lse, "output_lse", num_heads, num_tokens);
  const int64_t tokens_with_context = prefill_tokens_with_context.value_or(num_tokens);
  TORCH_CHECK(tokens_with_context >= 0, "chunkattn::merge_attn_states: prefill_tokens_with_context must be >= 0");
  if (num_tokens == 0 || num_heads == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, output.scalar_type(), "chunkattn_merge_attn_states", [&] {
    merge_impl<scalar_t>(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
                         tokens_with_context);
  });
}

}  // namespace chunkattn
