// Shared declarations of the vllm-chunkattn kernels.
//
// KV cache layout (one tensor per attention layer, owned by the backend):
//   kv_cache: [num_blocks, num_kv_heads, block_size, 2 * head_size]
//   This is the 4-D per-layer view vLLM hands to the backend. We read it as
//   [num_blocks, num_kv_heads, 2, block_size, head_size]: for one block (chunk)
//   and one KV head, the block_size x head_size key tile comes first, then the
//   value tile, both row-major and contiguous. A chunk of one head is therefore
//   two dense matrices, which is what the chunk-first phase multiplies.
//   A token in slot s lives in block s / block_size at row s % block_size.
//   On CPUs a bfloat16 cache keeps its value tile in key pairs: rows 2p and 2p + 1
//   interleaved, value (row r, head dim d) at [r / 2][2 d + r % 2] of the tile read
//   as [block_size / 2, 2 * head_size] (cpu::kValuePairs). That is the B operand of
//   AMX's bf16 product for O += P V, so the AMX tile multiplies V where it lies;
//   the other CPU kernels split a pair row into its two keys' values with a shift
//   and a mask (load_pairs). float32 and float16 caches, and every GPU cache, keep
//   the value tile row-major. vllm_chunkattn/kernels/layout.py states the same.
//
// Sliding window (the attention ops' `sliding_window`, vLLM's): 0 for none;
// W > 0: a query at position p sees keys p - W + 1 .. p only, as FlashAttention's
// window (W - 1, 0). The kernels read no chunk that lies wholly before every
// window of the rows an item covers.
//
// Logits soft-capping (the ops' `logits_soft_cap`, Gemma 2's): 0 for none;
// cap > 0: each scaled score s becomes cap * tanh(s / cap) before the softmax.
//
// ALiBi (the ops' `alibi_slopes`, BLOOM's, MPT's): none, or float32 [num_heads];
// the score of key position k for a query at position p gains slope * (k - p),
// after soft-capping.
//
// Attention sinks (the ops' `sinks`, gpt-oss's): none, or float32 [num_heads]
// logits in the scaled scores' units; each joins its head's softmax
// denominator once per query, as a key of value 0 would.
// All variants are checked and carried as one AttentionVariant (common/attention_variant.h).
#pragma once

#include <torch/all.h>

namespace chunkattn {

void write_kv_cache(const torch::Tensor& key, const torch::Tensor& value,
                    torch::Tensor& kv_cache, const torch::Tensor& slot_mapping);

// Two-phase-partition decode (csrc/cpu/tpp_decode.cpp): the plan of one step
// (csrc/common/decode_plan.h), built once, then run by every layer.
void tpp_decode_plan(torch::Tensor& header, torch::Tensor& items, torch::Tensor& node_work,
                     torch::Tensor& partial_work, torch::Tensor& row_order, const torch::Tensor& block_table,
                     const torch::Tensor& seq_lens, const torch::Tensor& order, const torch::Tensor& node_begin,
                     const torch::Tensor& node_end, const torch::Tensor& node_chunk_begin,
                     const torch::Tensor& node_chunk_end, const torch::Tensor& node_partial_offset,
                     const torch::Tensor& shared_chunks, const torch::Tensor& row_partial_offsets,
                     const torch::Tensor& row_partials, int64_t num_partial_rows, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_size, int64_t block_size, at::ScalarType dtype);
void tpp_decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& kv_cache,
                const torch::Tensor& block_table, const torch::Tensor& seq_lens, const torch::Tensor& order,
                const torch::Tensor& node_begin, const torch::Tensor& node_end, const torch::Tensor& node_chunk_begin,
                const torch::Tensor& node_chunk_end, const torch::Tensor& node_partial_offset,
                const torch::Tensor& shared_chunks, const torch::Tensor& row_partial_offsets,
                const torch::Tensor& row_partials, const torch::Tensor& plan_header, const torch::Tensor& plan_items,
                const torch::Tensor& plan_node_work, const torch::Tensor& plan_partial_work,
                const torch::Tensor& plan_row_order, double scale, int64_t sliding_window,
                double logits_soft_cap, const std::optional<torch::Tensor>& sinks,
                const std::optional<torch::Tensor>& alibi_slopes);

// Causal attention of new tokens over the paged cache (csrc/cpu/prefill.cpp).
void paged_prefill(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& kv_cache,
                   const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                   const torch::Tensor& block_table, double scale, int64_t sliding_window,
                   double logits_soft_cap, const std::optional<torch::Tensor>& sinks,
                   const std::optional<torch::Tensor>& alibi_slopes);

// Merge of two normalised attention results by their log-sum-exps (csrc/cpu/merge_attn_states.cpp).
void merge_attn_states(torch::Tensor& output, const torch::Tensor& prefix_output, const torch::Tensor& prefix_lse,
                       const torch::Tensor& suffix_output, const torch::Tensor& suffix_lse,
                       const std::optional<torch::Tensor>& output_lse,
                       std::optional<int64_t> prefill_tokens_with_context);

}  // namespace chunkattn
