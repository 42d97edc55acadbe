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
#pragma once

#include <torch/all.h>

namespace chunkattn {

void write_kv_cache(const torch::Tensor& key, const torch::Tensor& value,
                    torch::Tensor& kv_cache, const torch::Tensor& slot_mapping);

}  // namespace chunkattn
