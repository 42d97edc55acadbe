// KV-cache write for the CPU backend.
//
// Layouts (see csrc/chunkattn.h):
//   key, value:    [num_tokens, num_kv_heads, head_size] (rows may be strided)
//   kv_cache:      [num_blocks, num_kv_heads, block_size, 2 * head_size];
//                  a bfloat16 cache's V tile in key pairs (cpu::kValuePairs)
//   slot_mapping:  [num_tokens] int64 (or int32); a negative slot means padding
#include "chunkattn.h"
#include "cpu/kernels.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace chunkattn {

namespace {

template <typename scalar_t, typename slot_t>
void write_kv_cache_impl(const torch::Tensor& key, const torch::Tensor& value,
                         torch::Tensor& kv_cache, const torch::Tensor& slot_mapping) {
  const int64_t num_tokens = slot_mapping.size(0);
  const int64_t num_kv_heads = kv_cache.size(1);
  const int64_t block_size = kv_cache.size(2);
  const int64_t head_size = key.size(2);
  const int64_t tile = block_size * head_size;  // one K (or V) tile of a head

  const slot_t* slots = slot_mapping.data_ptr<slot_t>();
  scalar_t* cache = kv_cache.data_ptr<scalar_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  const int64_t k_tok = key.stride(0), k_head = key.stride(1);
  const int64_t v_tok = value.stride(0), v_head = value.stride(1);
  const int64_t cache_block = kv_cache.stride(0), cache_head = kv_cache.stride(1);

  at::parallel_for(0, num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = static_cast<int64_t>(slots[t]);
      if (slot < 0) continue;
      const int64_t block = slot / block_size, row = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        scalar_t* dst = cache + block * cache_block + h * cache_head + row * head_size;
        std::memcpy(dst, k + t * k_tok + h * k_head, head_size * sizeof(scalar_t));
        const scalar_t* src = v + t * v_tok + h * v_head;
        if constexpr (cpu::kValuePairs<scalar_t>) {
          scalar_t* pair = dst - row * head_size + tile + (row / 2) * 2 * head_size + row % 2;
          for (int64_t d = 0; d < head_size; ++d) pair[2 * d] = src[d];
        } else {
          std::memcpy(dst + tile, src, head_size * sizeof(scalar_t));
        }
      }
    }
  });
}

}  // namespace

void write_kv_cache(const torch::Tensor& key, const torch::Tensor& value,
                    torch::Tensor& kv_cache, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(3) == 2 * key.size(2),
              "kv_cache must be [num_blocks, num_kv_heads, block_size, 2*head_size]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [tokens, heads, dim]");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value rows must be contiguous");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "key/value dtype must match the kv cache dtype");
  TORCH_CHECK(slot_mapping.size(0) <= key.size(0), "more slots than tokens");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv_cache.scalar_type(), "write_kv_cache", [&] {
    if (slot_mapping.scalar_type() == at::kLong) {
      write_kv_cache_impl<scalar_t, int64_t>(key, value, kv_cache, slot_mapping);
    } else {
      TORCH_CHECK(slot_mapping.scalar_type() == at::kInt, "slot_mapping must be int32 or int64");
      write_kv_cache_impl<scalar_t, int32_t>(key, value, kv_cache, slot_mapping);
    }
  });
}

}  // namespace chunkattn
