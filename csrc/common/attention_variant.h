// What the attention ops compute beyond softmax(q.k * scale) under the causal
// mask: the ops' variant arguments (chunkattn.h), checked once per call and
// handed to the kernels as one struct.
#pragma once

#include <torch/all.h>

#include <optional>
#include <string>

namespace chunkattn {

struct AttentionVariant {
  float scale;
  int64_t sliding_window = 0;   // 0: none; W: a query at p sees keys p - W + 1 .. p
  float logits_soft_cap = 0.f;  // 0: none; c: each scaled score s becomes c * tanh(s / c)
  const float* sinks = nullptr;         // [num_heads] sink logits, or none
  const float* alibi_slopes = nullptr;  // [num_heads] ALiBi slopes, or none

  bool plain() const { return sliding_window == 0 && logits_soft_cap == 0.f && !sinks && !alibi_slopes; }
};

// A per-head float32 vector argument (sinks, alibi_slopes) on `device`.
inline const float* per_head_vector(const std::optional<torch::Tensor>& t, int64_t num_heads, const c10::Device& device,
                                    const char* name) {
  if (!t) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->numel() == num_heads && t->is_contiguous() &&
                  t->device() == device,
              "chunkattn: ", name, " must be a contiguous float32 vector of one value per query head (", num_heads,
              ") on the query's device; got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  return t->data_ptr<float>();
}

inline AttentionVariant attention_variant(double scale, int64_t sliding_window, double logits_soft_cap,
                                          const std::optional<torch::Tensor>& sinks,
                                          const std::optional<torch::Tensor>& alibi_slopes, const torch::Tensor& query) {
  TORCH_CHECK(sliding_window >= 0, "chunkattn: sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK(logits_soft_cap >= 0, "chunkattn: logits_soft_cap must be >= 0 (0: none), got ", logits_soft_cap);
  const int64_t num_heads = query.size(1);
  return {static_cast<float>(scale), sliding_window, static_cast<float>(logits_soft_cap),
          per_head_vector(sinks, num_heads, query.device(), "sinks"),
          per_head_vector(alibi_slopes, num_heads, query.device(), "alibi_slopes")};
}

}  // namespace chunkattn
