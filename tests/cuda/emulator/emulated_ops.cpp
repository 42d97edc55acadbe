// C entry points of the emulated CUDA kernels, for ctypes (tests/cuda/test_cuda_emulated.py).
// The kernels are csrc/cuda/*.cu compiled as C++ with -DCHUNKATTN_EMULATE
// (simt_emulator.h replaces the CUDA device intrinsics), linked with this file.
// Device memory is host memory here; the workspace is filled with 0xFF bytes
// (NaN floats, -1 ints) so that reading anything the kernels did not write
// shows up in the results.
#include <map>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/attention.cuh"
#include "cuda/launch.h"

namespace {
std::string g_message;

const char* result(const std::exception* e) {
  if (e) {
    g_message = e->what();
  } else if (!emu::g_error.empty()) {
    g_message = emu::g_error;
  } else {
    return nullptr;
  }
  return g_message.c_str();
}

void configure(int num_sms, int blocks_per_sm) {
  emu::g_error.clear();
  emu::g_num_sms = num_sms;
  emu::g_blocks_per_sm = blocks_per_sm;
}
}  // namespace

// The emulated device's id: one per configuration (SMs, blocks per SM, shared
// memory per SM), since the launchers cache per device what they ask of it.
extern "C" cudaError_t cudaGetDevice(int* device) {
  static std::map<std::tuple<int, int, size_t>, int> ids;
  *device = ids.try_emplace({emu::g_num_sms, emu::g_blocks_per_sm, emu::g_smem_per_sm}, static_cast<int>(ids.size()))
                .first->second;
  return cudaSuccess;
}
extern "C" cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  *value = emu::g_num_sms;  // the only attribute the launchers ask for
  return cudaSuccess;
}
extern "C" cudaError_t cudaGetLastError(void) { return emu::g_error.empty() ? cudaSuccess : cudaErrorLaunchFailure; }
extern "C" const char* cudaGetErrorString(cudaError_t) { return emu::g_error.c_str(); }

extern "C" const char* emu_write_kv_cache(const void* key, const void* value, void* kv_cache, const void* slots,
                                          int slot_is_int64, int num_tokens, int num_kv_heads, int head_size,
                                          int block_size, int elem_bytes, const int64_t* strides) {
  configure(4, 2);
  try {
    chunkattn::cuda::KvWriteArgs a{};
    a.key = key;
    a.value = value;
    a.kv_cache = kv_cache;
    a.slot_mapping = slots;
    a.slot_is_int64 = slot_is_int64 != 0;
    a.num_tokens = num_tokens;
    a.num_kv_heads = num_kv_heads;
    a.head_size = head_size;
    a.block_size = block_size;
    a.elem_bytes = elem_bytes;
    a.key_stride_token = strides[0];
    a.key_stride_head = strides[1];
    a.value_stride_token = strides[2];
    a.value_stride_head = strides[3];
    a.cache_stride_block = strides[4];
    a.cache_stride_head = strides[5];
    chunkattn::cuda::launch_write_kv_cache(a, nullptr);
  } catch (const std::exception& e) {
    return result(&e);
  }
  return result(nullptr);
}

// strides: out row, out head, query row, query head, cache block, cache head, block table row.
// The variant arguments are the ops' (common/attention_variant.h): 0 / null for none.
// Plans once, then runs the plan `layers` times (as the layers of one step do),
// each run with a fresh workspace of NaN bytes.
extern "C" const char* emu_tpp_decode(int bf16, void* out, const void* query, const void* kv_cache,
                                      const int* block_table, const int* seq_lens, const int* order,
                                      const int* node_begin, const int* node_end, const int* node_chunk_begin,
                                      const int* node_chunk_end, const int* node_partial_offset,
                                      const int* shared_chunks, const int* row_partial_offsets,
                                      const int* row_partials, int batch, int num_heads, int num_kv_heads,
                                      int head_size, int block_size, int num_nodes, int num_partial_rows,
                                      float scale, int sliding_window, float logits_soft_cap,
                                      const float* sinks, const float* alibi_slopes, const int64_t* strides,
                                      int num_sms, int blocks_per_sm, int layers) {
  configure(num_sms, blocks_per_sm);
  try {
    chunkattn::cuda::DecodeArgs a{};
    a.dtype = bf16 ? chunkattn::cuda::DType::kBFloat16 : chunkattn::cuda::DType::kHalf;
    a.out = out;
    a.query = query;
    a.kv_cache = kv_cache;
    a.block_table = block_table;
    a.seq_lens = seq_lens;
    a.order = order;
    a.node_begin = node_begin;
    a.node_end = node_end;
    a.node_chunk_begin = node_chunk_begin;
    a.node_chunk_end = node_chunk_end;
    a.node_partial_offset = node_partial_offset;
    a.shared_chunks = shared_chunks;
    a.row_partial_offsets = row_partial_offsets;
    a.row_partials = row_partials;
    a.batch = batch;
    a.num_heads = num_heads;
    a.num_kv_heads = num_kv_heads;
    a.head_size = head_size;
    a.block_size = block_size;
    a.num_nodes = num_nodes;
    a.num_partial_rows = num_partial_rows;
    a.variant = chunkattn::AttentionVariant{scale, sliding_window, logits_soft_cap, sinks, alibi_slopes};
    a.out_stride_row = strides[0];
    a.out_stride_head = strides[1];
    a.query_stride_row = strides[2];
    a.query_stride_head = strides[3];
    a.cache_stride_block = strides[4];
    a.cache_stride_head = strides[5];
    a.block_table_stride = strides[6];
    const chunkattn::cuda::DecodeSizes sizes = chunkattn::cuda::tpp_decode_sizes(a);
    // Plan rows start as huge indices: reading a row the plan kernel did not
    // write goes far out of bounds (AddressSanitizer builds report it).
    constexpr int kGarbage = 0x7F7F7F7F;
    std::vector<int> items((static_cast<size_t>(sizes.item_capacity) + 1) * 4, kGarbage);
    std::vector<int> node_work(static_cast<size_t>(num_nodes) * 4, kGarbage);
    std::vector<int> partial_work(static_cast<size_t>(num_partial_rows) * 4, kGarbage);
    const chunkattn::cuda::DecodePlanBuffers plan{items.data(), node_work.data(), partial_work.data()};
    chunkattn::cuda::launch_tpp_decode_plan(a, plan, nullptr);
    for (int layer = 0; layer < layers; ++layer) {
      std::vector<unsigned char> workspace(sizes.workspace_bytes, 0xFF);
      chunkattn::cuda::launch_tpp_decode(a, plan, workspace.data(), nullptr);
    }
  } catch (const std::exception& e) {
    return result(&e);
  }
  return result(nullptr);
}

extern "C" const char* emu_paged_prefill(int bf16, void* out, const void* query, const void* kv_cache,
                                         const int* query_start_loc, const int* seq_lens, const int* block_table,
                                         int num_tokens, int num_reqs, int num_heads, int num_kv_heads,
                                         int head_size, int block_size, float scale, int sliding_window,
                                         float logits_soft_cap, const float* sinks, const float* alibi_slopes,
                                         const int64_t* strides, int num_sms, int blocks_per_sm) {
  configure(num_sms, blocks_per_sm);
  try {
    chunkattn::cuda::PrefillArgs a{};
    a.dtype = bf16 ? chunkattn::cuda::DType::kBFloat16 : chunkattn::cuda::DType::kHalf;
    a.out = out;
    a.query = query;
    a.kv_cache = kv_cache;
    a.query_start_loc = query_start_loc;
    a.seq_lens = seq_lens;
    a.block_table = block_table;
    a.num_tokens = num_tokens;
    a.num_reqs = num_reqs;
    a.num_heads = num_heads;
    a.num_kv_heads = num_kv_heads;
    a.head_size = head_size;
    a.block_size = block_size;
    a.variant = chunkattn::AttentionVariant{scale, sliding_window, logits_soft_cap, sinks, alibi_slopes};
    a.out_stride_row = strides[0];
    a.out_stride_head = strides[1];
    a.query_stride_row = strides[2];
    a.query_stride_head = strides[3];
    a.cache_stride_block = strides[4];
    a.cache_stride_head = strides[5];
    a.block_table_stride = strides[6];
    std::vector<unsigned char> workspace(chunkattn::cuda::paged_prefill_workspace_bytes(a), 0xFF);
    chunkattn::cuda::launch_paged_prefill(a, workspace.data(), nullptr);
  } catch (const std::exception& e) {
    return result(&e);
  }
  return result(nullptr);
}

// cp.async landing: 0 = when its group is waited for (default), 1 = at issue.
extern "C" void emu_set_cp_async_early(int early) { emu::g_cp_async_early = early != 0; }

// Warp scheduling policy of the emulator (simt_emulator.h, g_schedule).
extern "C" void emu_set_schedule(int policy) { emu::g_schedule = policy; }

// Shared memory per SM of the emulated device (0: no limit), which bounds the
// resident blocks the occupancy query reports; and the most dynamic shared
// memory a launch took since the last call of emu_take_largest_launch_smem.
extern "C" void emu_set_smem_per_sm(int bytes) { emu::g_smem_per_sm = static_cast<size_t>(bytes); }
extern "C" int emu_take_largest_launch_smem() {
  const size_t largest = emu::g_largest_launch_smem;
  emu::g_largest_launch_smem = 0;
  return static_cast<int>(largest);
}

// Dynamic shared memory of the attention kernels: the TPP attend kernel's
// for GQA group `group` with two K/V stages (tpp_attend_smem_bytes<D>), or with group 0 the
// prefill kernel's (SmemLayout<D>::kBytes), so tests can hold
// scripts/check_cuda_compile.py's formula to the compiled values.
extern "C" int emu_attention_smem_bytes(int head_size, int group) {
#define CHUNKATTN_CASE_HEAD_SIZE(D)                                                        \
  case D:                                                                                  \
    return group > 0 ? chunkattn::cuda::tpp_attend_smem_bytes<D>(group, 2) : chunkattn::cuda::SmemLayout<D>::kBytes;
  switch (head_size) {
    CHUNKATTN_CUDA_FOR_EACH_HEAD_SIZE(CHUNKATTN_CASE_HEAD_SIZE)
    default:
      return -1;
  }
#undef CHUNKATTN_CASE_HEAD_SIZE
}

// strides: output token, head; prefix token, head; suffix token, head;
// prefix_lse head, token; suffix_lse head, token; output_lse head, token.
extern "C" const char* emu_merge_attn_states(int bf16, void* output, const void* prefix_output,
                                             const float* prefix_lse, const void* suffix_output,
                                             const float* suffix_lse, float* output_lse, int num_tokens,
                                             int num_heads, int head_size, int tokens_with_context,
                                             const int64_t* strides) {
  configure(4, 2);
  try {
    chunkattn::cuda::MergeArgs a{};
    a.dtype = bf16 ? chunkattn::cuda::DType::kBFloat16 : chunkattn::cuda::DType::kHalf;
    a.output = output;
    a.prefix_output = prefix_output;
    a.suffix_output = suffix_output;
    a.prefix_lse = prefix_lse;
    a.suffix_lse = suffix_lse;
    a.output_lse = output_lse;
    a.num_tokens = num_tokens;
    a.num_heads = num_heads;
    a.head_size = head_size;
    a.tokens_with_context = tokens_with_context;
    a.output_stride_token = strides[0];
    a.output_stride_head = strides[1];
    a.prefix_stride_token = strides[2];
    a.prefix_stride_head = strides[3];
    a.suffix_stride_token = strides[4];
    a.suffix_stride_head = strides[5];
    a.prefix_lse_stride_head = strides[6];
    a.prefix_lse_stride_token = strides[7];
    a.suffix_lse_stride_head = strides[8];
    a.suffix_lse_stride_token = strides[9];
    a.output_lse_stride_head = strides[10];
    a.output_lse_stride_token = strides[11];
    chunkattn::cuda::launch_merge_attn_states(a, nullptr);
  } catch (const std::exception& e) {
    return result(&e);
  }
  return result(nullptr);
}
