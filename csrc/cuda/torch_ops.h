// Torch-facing CUDA ops of the `chunkattn` library (torch_ops.cpp): argument
// checks, workspace allocation and the current stream around the launchers of
// launch.h. Signatures follow the schemas of csrc/cpu/registration.cpp.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <optional>

namespace chunkattn::cuda_ops {

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping);

void tpp_decode_plan(at::Tensor& plan_header, at::Tensor& plan_items, at::Tensor& plan_node_work,
                     at::Tensor& plan_partial_work, at::Tensor& plan_row_order, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& order, const at::Tensor& node_begin,
                     const at::Tensor& node_end, const at::Tensor& node_chunk_begin, const at::Tensor& node_chunk_end,
                     const at::Tensor& node_partial_offset, const at::Tensor& shared_chunks,
                     const at::Tensor& row_partial_offsets, const at::Tensor& row_partials, int64_t num_partial_rows,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size,
                     at::ScalarType dtype);

void tpp_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                const at::Tensor& seq_lens, const at::Tensor& order, const at::Tensor& node_begin,
                const at::Tensor& node_end, const at::Tensor& node_chunk_begin, const at::Tensor& node_chunk_end,
                const at::Tensor& node_partial_offset, const at::Tensor& shared_chunks,
                const at::Tensor& row_partial_offsets, const at::Tensor& row_partials, const at::Tensor& plan_header,
                const at::Tensor& plan_items, const at::Tensor& plan_node_work, const at::Tensor& plan_partial_work,
                const at::Tensor& plan_row_order, double scale, int64_t sliding_window,
                double logits_soft_cap, const std::optional<at::Tensor>& sinks,
                const std::optional<at::Tensor>& alibi_slopes);

void paged_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                   double scale, int64_t sliding_window, double logits_soft_cap,
                   const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi_slopes);

void merge_attn_states(at::Tensor& output, const at::Tensor& prefix_output, const at::Tensor& prefix_lse,
                       const at::Tensor& suffix_output, const at::Tensor& suffix_lse,
                       const std::optional<at::Tensor>& output_lse, std::optional<int64_t> prefill_tokens_with_context);

}  // namespace chunkattn::cuda_ops
