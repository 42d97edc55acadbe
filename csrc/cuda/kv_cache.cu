// KV-cache write on CUDA: key/value rows of the new tokens into their slots of
// the backend's paged layout. Same semantics as torch_fallback.write_kv_cache.
//
// Layouts
//   key, value    [num_tokens, num_kv_heads, head_size] (token/head strides free,
//                 head_size elements contiguous)
//   kv_cache      [num_blocks, num_kv_heads, block_size, 2 * head_size]: per block
//                 and KV head a K tile [block_size, head_size], then a V tile
//   slot_mapping  [num_tokens] int32 or int64; slot s is block s / block_size,
//                 row s % block_size; a negative slot is padding (skipped)
//
// Launch: <<<num_tokens, 128>>>, block t copies token t's num_kv_heads K and V
// rows with the widest vector (16, 8, 4 or 2 bytes) that every address and
// stride allows. The copy is dtype-agnostic (fp16, bf16, fp32 alike). The grid
// is the slot_mapping length, so a CUDA graph captured with padded slots (-1)
// replays correctly.
#include "cuda/common.cuh"

namespace chunkattn::cuda {

namespace {

template <typename Vec, typename Slot>
__global__ void __launch_bounds__(128) write_kv_kernel(KvWriteArgs a) {
  const int t = blockIdx.x;
  const int64_t slot = static_cast<int64_t>(static_cast<const Slot*>(a.slot_mapping)[t]);
  if (slot < 0) return;
  const int64_t block = slot / a.block_size, row = slot % a.block_size;
  const int row_bytes = a.head_size * a.elem_bytes;
  const int vecs = row_bytes / static_cast<int>(sizeof(Vec));
  const char* key = static_cast<const char*>(a.key);
  const char* value = static_cast<const char*>(a.value);
  char* cache = static_cast<char*>(a.kv_cache);
  for (int i = threadIdx.x; i < a.num_kv_heads * vecs; i += blockDim.x) {
    const int h = i / vecs, c = i % vecs;
    char* k_dst = cache + (block * a.cache_stride_block + h * a.cache_stride_head + row * a.head_size) * a.elem_bytes;
    char* v_dst = k_dst + static_cast<int64_t>(a.block_size) * row_bytes;
    const char* k_src = key + (t * a.key_stride_token + h * a.key_stride_head) * a.elem_bytes;
    const char* v_src = value + (t * a.value_stride_token + h * a.value_stride_head) * a.elem_bytes;
    reinterpret_cast<Vec*>(k_dst)[c] = reinterpret_cast<const Vec*>(k_src)[c];
    reinterpret_cast<Vec*>(v_dst)[c] = reinterpret_cast<const Vec*>(v_src)[c];
  }
}

template <typename Vec>
void launch_vec(const KvWriteArgs& a, cudaStream_t stream) {
  constexpr auto kernel64 = write_kv_kernel<Vec, int64_t>;
  constexpr auto kernel32 = write_kv_kernel<Vec, int32_t>;
  if (a.slot_is_int64) {
    CHUNKATTN_LAUNCH(kernel64, a.num_tokens, 128, 0, stream, a);
  } else {
    CHUNKATTN_LAUNCH(kernel32, a.num_tokens, 128, 0, stream, a);
  }
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

void check_launch(const char* what) { throw_on_error(cudaGetLastError(), what); }

void launch_write_kv_cache(const KvWriteArgs& a, cudaStream_t stream) {
  if (a.num_tokens <= 0) return;
  // Widest vector dividing every byte address and stride involved.
  auto fits = [&](int64_t v) {
    const int64_t e = a.elem_bytes;
    return (a.head_size * e) % v == 0 && aligned(a.key, v) && aligned(a.value, v) && aligned(a.kv_cache, v) &&
           (a.key_stride_token * e) % v == 0 && (a.key_stride_head * e) % v == 0 &&
           (a.value_stride_token * e) % v == 0 && (a.value_stride_head * e) % v == 0 &&
           (a.cache_stride_block * e) % v == 0 && (a.cache_stride_head * e) % v == 0;
  };
  if (fits(16)) {
    launch_vec<uint4>(a, stream);
  } else if (fits(8)) {
    launch_vec<uint2>(a, stream);
  } else if (fits(4)) {
    launch_vec<uint32_t>(a, stream);
  } else {
    launch_vec<uint16_t>(a, stream);
  }
  check_launch("write_kv_cache");
}

}  // namespace chunkattn::cuda
