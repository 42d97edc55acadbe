// Host-side interface between the torch wrappers (torch_ops.cpp, compiled by
// the host compiler against the torch headers) and the CUDA kernels (*.cu,
// compiled by nvcc WITHOUT torch headers: raw pointers, element strides and
// sizes only). Keeping torch out of the .cu files keeps nvcc fast and makes
// the kernels compile-checkable with a CPU-only torch.
//
// KV cache layout (csrc/chunkattn.h): kv_cache [num_blocks, num_kv_heads,
// block_size, 2 * head_size]; per block and KV head a key tile
// [block_size, head_size] followed by a value tile, both row-major. The
// kernels need the inner [block_size, 2 * head_size] to be contiguous;
// block and head strides are free (multiples of 8 elements).
#pragma once

#ifdef CHUNKATTN_EMULATE
#include "simt_emulator.h"  // tests/cuda/emulator: run the kernels on the CPU
#else
#include <cuda_runtime.h>
#endif

#include <cstddef>
#include <cstdint>

#include "common/attention_variant.h"
#include "cuda/dispatch.h"

namespace chunkattn::cuda {

// The attention dtypes of dispatch.h.
#define CHUNKATTN_DTYPE_ENUMERATOR(ENUM, T, SCALAR, NAME) ENUM,
enum class DType : int { CHUNKATTN_CUDA_FOR_EACH_DTYPE(CHUNKATTN_DTYPE_ENUMERATOR) };
#undef CHUNKATTN_DTYPE_ENUMERATOR

// ---------------------------------------------------------------- KV write
struct KvWriteArgs {
  const void* key;    // [num_tokens, num_kv_heads, head_size]
  const void* value;  // same shape
  void* kv_cache;
  const void* slot_mapping;  // [num_tokens] int32 or int64; negative = padding
  bool slot_is_int64;
  int num_tokens;
  int num_kv_heads;
  int head_size;
  int block_size;
  int elem_bytes;  // 2 (fp16/bf16) or 4 (fp32)
  int64_t key_stride_token, key_stride_head;  // elements
  int64_t value_stride_token, value_stride_head;
  int64_t cache_stride_block, cache_stride_head;
};
void launch_write_kv_cache(const KvWriteArgs& args, cudaStream_t stream);

// -------------------------------------------------------------- TPP decode
// Arrays are int32 on the device, with the meaning of PrefixTreeContext
// (vllm_chunkattn/prefix/tree.py). Under CUDA graphs the node arrays may be padded
// with empty nodes (node_begin == node_end) and num_partial_rows may be a
// capacity larger than the rows in use; nothing below depends on the values.
struct DecodeArgs {
  DType dtype;
  void* out;          // [batch, num_heads, head_size]
  const void* query;  // [batch, num_heads, head_size]
  const void* kv_cache;
  const int* block_table;  // [batch, max_blocks]
  const int* seq_lens;     // [batch]
  const int* order;        // [batch]
  const int* node_begin;   // [num_nodes]
  const int* node_end;
  const int* node_chunk_begin;
  const int* node_chunk_end;
  const int* node_partial_offset;
  const int* shared_chunks;        // [batch]
  const int* row_partial_offsets;  // [batch + 1]
  const int* row_partials;         // [row_partial_offsets[batch]]
  int batch, num_heads, num_kv_heads, head_size, block_size;
  int num_nodes, num_partial_rows;
  AttentionVariant variant;  // scale, window, soft-cap; sinks and ALiBi slopes on the device
  int64_t out_stride_row, out_stride_head;      // elements
  int64_t query_stride_row, query_stride_head;  // elements
  int64_t cache_stride_block, cache_stride_head;
  int64_t block_table_stride;
};
// The step's work plan on the device (csrc/common/decode_plan.h): int32 rows of 4.
struct DecodePlanBuffers {
  int* items;         // [DecodeSizes::item_capacity + 1][4]
  int* node_work;     // [num_nodes][4]
  int* partial_work;  // [num_partial_rows][4]
};
// Sizes that depend only on shapes, never on the values in the tree arrays,
// so they are the same at CUDA-graph capture and at every replay.
struct DecodeSizes {
  int item_capacity;       // chunk-first items a plan holds (its items have one more row: an end row)
  int piece_row_capacity;  // fp32 partial slots of the chunk-first phase
  size_t workspace_bytes;  // scratch memory of one layer's launch_tpp_decode
};
DecodeSizes tpp_decode_sizes(const DecodeArgs& args);
// Once per step: fills `plan` from the tree context (reads only the context
// arrays and the shapes of `args`).
void launch_tpp_decode_plan(const DecodeArgs& args, const DecodePlanBuffers& plan, cudaStream_t stream);
// Per layer: attends and merges following the step's plan.
void launch_tpp_decode(const DecodeArgs& args, const DecodePlanBuffers& plan, void* workspace, cudaStream_t stream);

// ---------------------------------------------------------- paged prefill
struct PrefillArgs {
  DType dtype;
  void* out;          // [num_tokens, num_heads, head_size]
  const void* query;  // [num_tokens, num_heads, head_size]
  const void* kv_cache;
  const int* query_start_loc;  // [num_reqs + 1], starting at 0
  const int* seq_lens;         // [num_reqs]
  const int* block_table;      // [num_reqs, max_blocks]
  int num_tokens, num_reqs, num_heads, num_kv_heads, head_size, block_size;
  AttentionVariant variant;  // scale, window, soft-cap; sinks and ALiBi slopes on the device
  int64_t out_stride_row, out_stride_head;
  int64_t query_stride_row, query_stride_head;
  int64_t cache_stride_block, cache_stride_head;
  int64_t block_table_stride;
};
size_t paged_prefill_workspace_bytes(const PrefillArgs& args);
void launch_paged_prefill(const PrefillArgs& args, void* workspace, cudaStream_t stream);

// ------------------------------------------------------ merge_attn_states
// vLLM's merge_attn_states (csrc/cpu/merge_attn_states.cpp states the contract).
struct MergeArgs {
  DType dtype;
  void* output;               // [num_tokens, num_heads, head_size]
  const void* prefix_output;  // same shape and dtype
  const void* suffix_output;
  const float* prefix_lse;  // [num_heads, num_tokens]
  const float* suffix_lse;
  float* output_lse;  // optional (nullptr)
  int num_tokens, num_heads, head_size;
  int tokens_with_context;  // tokens from here on take the suffix as is
  int64_t output_stride_token, output_stride_head;  // elements
  int64_t prefix_stride_token, prefix_stride_head;
  int64_t suffix_stride_token, suffix_stride_head;
  int64_t prefix_lse_stride_head, prefix_lse_stride_token;
  int64_t suffix_lse_stride_head, suffix_lse_stride_token;
  int64_t output_lse_stride_head, output_lse_stride_token;
};
void launch_merge_attn_states(const MergeArgs& args, cudaStream_t stream);

// Throws std::runtime_error on a CUDA launch error (the torch wrapper turns it
// into a Python RuntimeError).
void check_launch(const char* what);

}  // namespace chunkattn::cuda
