// What the attention kernels compute beyond softmax(q.k * scale) under the
// causal mask: the ops' variant arguments (csrc/chunkattn.h says what each
// computes), as one plain struct that the CPU drivers and the CUDA kernels
// take alike. common/attention_variant_args.h builds it from the op's arguments.
#pragma once

#include <cstdint>

namespace chunkattn {

struct AttentionVariant {
  float scale;
  int64_t sliding_window = 0;           // 0: none; W: a query at p sees keys p - W + 1 .. p
  float logits_soft_cap = 0.f;          // 0: none; c: each scaled score s becomes c * tanh(s / c)
  const float* sinks = nullptr;         // [num_heads] sink logits (scaled-score units), or none
  const float* alibi_slopes = nullptr;  // [num_heads] ALiBi slopes, or none

  bool plain() const { return sliding_window == 0 && logits_soft_cap == 0.f && !sinks && !alibi_slopes; }
};

}  // namespace chunkattn
