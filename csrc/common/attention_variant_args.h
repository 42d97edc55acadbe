// The AttentionVariant of an op call (common/attention_variant.h), from the
// op's torch arguments, each checked once per call.
#pragma once

#include <torch/all.h>

#include <optional>

#include "common/attention_variant.h"

namespace chunkattn {

// A per-head float32 vector argument (sinks, alibi_slopes) on the query's device.
inline const float* per_head_vector(const std::optional<torch::Tensor>& t, const torch::Tensor& query,
                                    const char* name) {
  if (!t) return nullptr;
  const int64_t num_heads = query.size(1);
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->numel() == num_heads && t->is_contiguous() &&
                  t->device() == query.device(),
              "chunkattn: ", name, " must be a contiguous float32 vector of one value per query head (", num_heads,
              ") on the query's device; got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  return t->data_ptr<float>();
}

inline AttentionVariant attention_variant(double scale, int64_t sliding_window, double logits_soft_cap,
                                          const std::optional<torch::Tensor>& sinks,
                                          const std::optional<torch::Tensor>& alibi_slopes, const torch::Tensor& query) {
  TORCH_CHECK(sliding_window >= 0 && sliding_window <= INT32_MAX,
              "chunkattn: sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK(logits_soft_cap >= 0, "chunkattn: logits_soft_cap must be >= 0 (0: none), got ", logits_soft_cap);
  return {static_cast<float>(scale), sliding_window, static_cast<float>(logits_soft_cap),
          per_head_vector(sinks, query, "sinks"), per_head_vector(alibi_slopes, query, "alibi_slopes")};
}

}  // namespace chunkattn
