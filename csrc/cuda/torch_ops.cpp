// Torch wrappers of the CUDA kernels: check arguments (device, dtype, shape,
// layout), allocate the workspace on the tensors' device (from torch's
// caching allocator, so inside a CUDA-graph capture it comes from the graph's
// pool; its size depends on shapes only), and launch on the current stream.
#include "cuda/torch_ops.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/all.h>

#include <algorithm>
#include <cstring>
#include <exception>

#include "cuda/dispatch.h"
#include "cuda/launch.h"
#include "common/attention_variant_args.h"
#include "common/decode_plan.h"

namespace chunkattn::cuda_ops {

namespace {

using chunkattn::cuda::DType;

DType attention_dtype(at::ScalarType type, const char* op) {
#define CHUNKATTN_CASE_DTYPE(ENUM, T, SCALAR, NAME) \
  if (type == at::ScalarType::SCALAR) return DType::ENUM;
  CHUNKATTN_CUDA_FOR_EACH_DTYPE(CHUNKATTN_CASE_DTYPE)
#undef CHUNKATTN_CASE_DTYPE
  TORCH_CHECK(false, "chunkattn::", op, " on CUDA supports ", chunkattn::cuda::supported_dtypes(), ", got ", type);
}

void check_index(const at::Tensor& t, const char* name, const at::Device& device, int64_t min_numel) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && (t.numel() <= 1 || t.stride(0) == 1), name, " must be a contiguous 1-D tensor");
  TORCH_CHECK(t.numel() >= min_numel, name, " has ", t.numel(), " entries, needs at least ", min_numel);
}

void check_block_table(const at::Tensor& t, const at::Device& device, int64_t rows) {
  TORCH_CHECK(t.device() == device, "block_table must be on ", device);
  TORCH_CHECK(t.scalar_type() == at::kInt, "block_table must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) >= rows && (t.size(1) <= 1 || t.stride(1) == 1),
              "block_table must be [num_seqs, max_blocks] with contiguous rows");
}

bool is_aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// [rows, heads, head_size] with contiguous head_size and every (row, head)
// vector starting at a multiple of `bytes`.
bool vectors_aligned(const at::Tensor& t, int64_t bytes) {
  const int64_t e = t.element_size();
  return t.stride(2) == 1 && is_aligned(t.data_ptr(), bytes) && (t.stride(0) * e) % bytes == 0 &&
         (t.stride(1) * e) % bytes == 0;
}

void check_cache(const at::Tensor& kv_cache, const at::Tensor& query, const char* op) {
  TORCH_CHECK(kv_cache.device() == query.device(), "chunkattn::", op, ": kv_cache and query on different devices");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "chunkattn::", op,
              ": kv_cache dtype must match the query dtype");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(3) == 2 * query.size(2),
              "kv_cache must be [num_blocks, num_kv_heads, block_size, 2 * head_size]");
  const int64_t block_size = kv_cache.size(2);
  TORCH_CHECK(chunkattn::cuda::supports_block_size(static_cast<int>(block_size)), "chunkattn::", op,
              " on CUDA supports block sizes ", chunkattn::cuda::supported_block_sizes(), ", got ", block_size);
  TORCH_CHECK(kv_cache.stride(3) == 1 && kv_cache.stride(2) == kv_cache.size(3),
              "kv_cache: each block and KV head must be a contiguous [block_size, 2 * head_size] tile");
  TORCH_CHECK(is_aligned(kv_cache.data_ptr(), 16) && kv_cache.stride(0) % 8 == 0 && kv_cache.stride(1) % 8 == 0,
              "kv_cache must be 16-byte aligned with block/head strides that are multiples of 8 elements");
}

void check_query(const at::Tensor& query, const at::Tensor& out, const at::Tensor& kv_cache, const char* op) {
  TORCH_CHECK(query.is_cuda(), "chunkattn::", op, ": query must be a CUDA tensor");
  TORCH_CHECK(query.dim() == 3, "query must be [tokens, num_heads, head_size]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() &&
                  out.device() == query.device(),
              "chunkattn::", op, ": out must have the query's shape, dtype and device");
  const int64_t head_size = query.size(2);
  TORCH_CHECK(chunkattn::cuda::supports_head_size(static_cast<int>(head_size)), "chunkattn::", op,
              " on CUDA supports head sizes ", chunkattn::cuda::supported_head_sizes(), ", got ", head_size);
  check_cache(kv_cache, query, op);
  const int64_t heads = query.size(1), kv_heads = kv_cache.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads <= 64, "chunkattn::", op, ": ", heads,
              " query heads over ", kv_heads, " KV heads (need a GQA group of 1..64)");
}

// Query rows must be 16-byte aligned (cp.async); outputs are written 8 bytes
// at a time. Where a caller's tensor is not, work on a contiguous copy.
at::Tensor aligned_query(const at::Tensor& query) {
  return vectors_aligned(query, 16) ? query : query.contiguous();
}

template <typename Launch>
void run(const char* op, Launch&& launch) {
  try {
    launch();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "chunkattn::", op, ": ", e.what());
  }
}

}  // namespace

void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.is_cuda(), "chunkattn::write_kv_cache: kv_cache must be a CUDA tensor");
  TORCH_CHECK(key.device() == kv_cache.device() && value.device() == kv_cache.device() &&
                  slot_mapping.device() == kv_cache.device(),
              "chunkattn::write_kv_cache: all tensors must be on ", kv_cache.device());
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(3) == 2 * key.size(2),
              "kv_cache must be [num_blocks, num_kv_heads, block_size, 2*head_size]");
  TORCH_CHECK(kv_cache.stride(3) == 1 && kv_cache.stride(2) == kv_cache.size(3),
              "kv_cache: each block and KV head must be a contiguous [block_size, 2 * head_size] tile");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value must be [tokens, heads, dim]");
  TORCH_CHECK(key.size(1) == kv_cache.size(1), "key has ", key.size(1), " heads, kv_cache ", kv_cache.size(1));
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "key/value rows must be contiguous");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "key/value dtype must match the kv cache dtype");
  TORCH_CHECK(kv_cache.element_size() == 2 || kv_cache.element_size() == 4,
              "chunkattn::write_kv_cache on CUDA supports 16- and 32-bit dtypes");
  TORCH_CHECK(slot_mapping.dim() == 1 && (slot_mapping.numel() <= 1 || slot_mapping.stride(0) == 1),
              "slot_mapping must be a contiguous 1-D tensor");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong || slot_mapping.scalar_type() == at::kInt,
              "slot_mapping must be int32 or int64");
  TORCH_CHECK(slot_mapping.size(0) <= key.size(0), "more slots than tokens");
  if (slot_mapping.numel() == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(kv_cache.device());
  chunkattn::cuda::KvWriteArgs a{};
  a.key = key.data_ptr();
  a.value = value.data_ptr();
  a.kv_cache = kv_cache.data_ptr();
  a.slot_mapping = slot_mapping.data_ptr();
  a.slot_is_int64 = slot_mapping.scalar_type() == at::kLong;
  a.num_tokens = static_cast<int>(slot_mapping.size(0));
  a.num_kv_heads = static_cast<int>(kv_cache.size(1));
  a.head_size = static_cast<int>(key.size(2));
  a.block_size = static_cast<int>(kv_cache.size(2));
  a.elem_bytes = static_cast<int>(kv_cache.element_size());
  a.key_stride_token = key.stride(0);
  a.key_stride_head = key.stride(1);
  a.value_stride_token = value.stride(0);
  a.value_stride_head = value.stride(1);
  a.cache_stride_block = kv_cache.stride(0);
  a.cache_stride_head = kv_cache.stride(1);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(kv_cache.device().index());
  run("write_kv_cache", [&] { chunkattn::cuda::launch_write_kv_cache(a, stream); });
}

namespace {

// Checks the tree context's arrays and puts them, with the shapes, into `a`.
void decode_context_args(chunkattn::cuda::DecodeArgs& a, const at::Device& device, int64_t batch,
                         const at::Tensor& block_table, const at::Tensor& seq_lens, const at::Tensor& order,
                         const at::Tensor& node_begin, const at::Tensor& node_end,
                         const at::Tensor& node_chunk_begin, const at::Tensor& node_chunk_end,
                         const at::Tensor& node_partial_offset, const at::Tensor& shared_chunks,
                         const at::Tensor& row_partial_offsets, const at::Tensor& row_partials) {
  check_block_table(block_table, device, batch);
  check_index(seq_lens, "seq_lens", device, batch);
  check_index(order, "order", device, batch);
  const int64_t nodes = node_begin.numel();
  for (const auto* t : {&node_begin, &node_end, &node_chunk_begin, &node_chunk_end, &node_partial_offset}) {
    check_index(*t, "node arrays", device, nodes);
    TORCH_CHECK(t->numel() == nodes, "node arrays must have the same length");
  }
  check_index(shared_chunks, "shared_chunks", device, batch);
  check_index(row_partial_offsets, "row_partial_offsets", device, batch + 1);
  check_index(row_partials, "row_partials", device, 0);
  a.block_table = block_table.data_ptr<int>();
  a.seq_lens = seq_lens.data_ptr<int>();
  a.order = order.data_ptr<int>();
  a.node_begin = node_begin.data_ptr<int>();
  a.node_end = node_end.data_ptr<int>();
  a.node_chunk_begin = node_chunk_begin.data_ptr<int>();
  a.node_chunk_end = node_chunk_end.data_ptr<int>();
  a.node_partial_offset = node_partial_offset.data_ptr<int>();
  a.shared_chunks = shared_chunks.data_ptr<int>();
  a.row_partial_offsets = row_partial_offsets.data_ptr<int>();
  a.row_partials = row_partials.data_ptr<int>();
  a.batch = static_cast<int>(batch);
  a.num_nodes = static_cast<int>(nodes);
  a.block_table_stride = block_table.stride(0);
}

void check_plan_rows(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.device() == device && t.scalar_type() == at::kInt && t.is_contiguous(), "chunkattn: plan ", name,
              " must be contiguous int32 on ", device);
}

// A plan tensor of `rows` x 4: sized at the first plan (so that a CUDA graph
// captured after it keeps reading the same memory), never resized after.
void size_plan_rows(at::Tensor& t, const char* name, int64_t rows) {
  if (t.numel() == 0 && rows > 0) t.resize_({rows, chunkattn::kPlanRowInts});
  TORCH_CHECK(t.numel() == rows * chunkattn::kPlanRowInts, "chunkattn::tpp_decode_plan: plan ", name, " holds ",
              t.numel() / chunkattn::kPlanRowInts, " rows, this step's shapes need ", rows,
              ": one plan's buffers serve one set of shapes (batch capacity, tree capacity, heads)");
  if (t.dim() != 2) t.resize_({rows, chunkattn::kPlanRowInts});
}

chunkattn::cuda::DecodePlanBuffers plan_buffers(const at::Tensor& items, const at::Tensor& node_work,
                                                const at::Tensor& partial_work) {
  return {items.data_ptr<int>(), node_work.numel() ? node_work.data_ptr<int>() : nullptr,
          partial_work.numel() ? partial_work.data_ptr<int>() : nullptr};
}

}  // namespace

void tpp_decode_plan(at::Tensor& plan_header, at::Tensor& plan_items, at::Tensor& plan_node_work,
                     at::Tensor& plan_partial_work, at::Tensor& plan_row_order, const at::Tensor& block_table,
                     const at::Tensor& seq_lens, const at::Tensor& order, const at::Tensor& node_begin,
                     const at::Tensor& node_end, const at::Tensor& node_chunk_begin, const at::Tensor& node_chunk_end,
                     const at::Tensor& node_partial_offset, const at::Tensor& shared_chunks,
                     const at::Tensor& row_partial_offsets, const at::Tensor& row_partials, int64_t num_partial_rows,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size,
                     at::ScalarType dtype) {
  const at::Device device = block_table.device();
  TORCH_CHECK(device.is_cuda(), "chunkattn::tpp_decode_plan: block_table must be a CUDA tensor");
  const DType attention = attention_dtype(dtype, "tpp_decode_plan");
  TORCH_CHECK(chunkattn::cuda::supports_head_size(static_cast<int>(head_size)),
              "chunkattn::tpp_decode_plan on CUDA supports head sizes ", chunkattn::cuda::supported_head_sizes(),
              ", got ", head_size);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= 64,
              "chunkattn::tpp_decode_plan: ", num_heads, " query heads over ", num_kv_heads,
              " KV heads (need a GQA group of 1..64)");
  TORCH_CHECK(chunkattn::cuda::supports_block_size(static_cast<int>(block_size)),
              "chunkattn::tpp_decode_plan on CUDA supports block sizes ", chunkattn::cuda::supported_block_sizes(),
              ", got ", block_size);
  TORCH_CHECK(num_partial_rows >= 0, "num_partial_rows must be >= 0");
  TORCH_CHECK(plan_header.device().is_cpu() && plan_header.scalar_type() == at::kInt,
              "chunkattn: plan header must be int32 on the CPU");
  check_plan_rows(plan_items, "items", device);
  check_plan_rows(plan_node_work, "node_work", device);
  check_plan_rows(plan_partial_work, "partial_work", device);
  check_plan_rows(plan_row_order, "row_order", device);
  const int64_t batch = order.numel();
  const c10::cuda::OptionalCUDAGuard guard(device);
  chunkattn::cuda::DecodeArgs a{};
  a.dtype = attention;
  decode_context_args(a, device, batch, block_table, seq_lens, order, node_begin, node_end, node_chunk_begin,
                      node_chunk_end, node_partial_offset, shared_chunks, row_partial_offsets, row_partials);
  a.num_heads = static_cast<int>(num_heads);
  a.num_kv_heads = static_cast<int>(num_kv_heads);
  a.head_size = static_cast<int>(head_size);
  a.block_size = static_cast<int>(block_size);
  a.num_partial_rows = static_cast<int>(num_partial_rows);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index());
  run("tpp_decode_plan", [&] {
    const chunkattn::cuda::DecodeSizes sizes = chunkattn::cuda::tpp_decode_sizes(a);
    size_plan_rows(plan_items, "items", static_cast<int64_t>(sizes.item_capacity) + 1);
    size_plan_rows(plan_node_work, "node_work", a.num_nodes);
    size_plan_rows(plan_partial_work, "partial_work", a.num_partial_rows);
    TORCH_CHECK(plan_row_order.numel() == 0, "chunkattn: the CUDA plan has no row order (pass an empty tensor)");
    chunkattn::DecodePlanHeader h{};
    h.batch = a.batch;
    h.num_nodes = a.num_nodes;
    h.num_partial_rows = a.num_partial_rows;
    h.num_heads = a.num_heads;
    h.num_kv_heads = a.num_kv_heads;
    h.head_size = a.head_size;
    h.block_size = a.block_size;
    h.num_items = sizes.item_capacity;
    h.num_slots = sizes.piece_row_capacity;
    plan_header.resize_({chunkattn::kDecodePlanHeaderInts});
    std::memcpy(plan_header.data_ptr<int32_t>(), &h, sizeof(h));
    chunkattn::cuda::launch_tpp_decode_plan(a, plan_buffers(plan_items, plan_node_work, plan_partial_work), stream);
  });
}

void tpp_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                const at::Tensor& seq_lens, const at::Tensor& order, const at::Tensor& node_begin,
                const at::Tensor& node_end, const at::Tensor& node_chunk_begin, const at::Tensor& node_chunk_end,
                const at::Tensor& node_partial_offset, const at::Tensor& shared_chunks,
                const at::Tensor& row_partial_offsets, const at::Tensor& row_partials, const at::Tensor& plan_header,
                const at::Tensor& plan_items, const at::Tensor& plan_node_work, const at::Tensor& plan_partial_work,
                const at::Tensor& plan_row_order, double scale, int64_t sliding_window,
                double logits_soft_cap, const std::optional<at::Tensor>& sinks,
                const std::optional<at::Tensor>& alibi_slopes) {
  check_query(query, out, kv_cache, "tpp_decode");
  const AttentionVariant variant =
      attention_variant(scale, sliding_window, logits_soft_cap, sinks, alibi_slopes, query);
  const DType dtype = attention_dtype(query.scalar_type(), "tpp_decode");
  const at::Device device = query.device();
  const int64_t batch = query.size(0);
  chunkattn::cuda::DecodeArgs a{};
  a.dtype = dtype;
  decode_context_args(a, device, batch, block_table, seq_lens, order, node_begin, node_end, node_chunk_begin,
                      node_chunk_end, node_partial_offset, shared_chunks, row_partial_offsets, row_partials);
  a.num_heads = static_cast<int>(query.size(1));
  a.num_kv_heads = static_cast<int>(kv_cache.size(1));
  a.head_size = static_cast<int>(query.size(2));
  a.block_size = static_cast<int>(kv_cache.size(2));

  // O(1) checks of this layer against the step's plan (csrc/common/decode_plan.h).
  TORCH_CHECK(plan_header.device().is_cpu() && plan_header.scalar_type() == at::kInt && plan_header.is_contiguous() &&
                  plan_header.numel() == chunkattn::kDecodePlanHeaderInts,
              "chunkattn: plan header must be ", chunkattn::kDecodePlanHeaderInts,
              " int32 on the CPU (made by tpp_decode_plan)");
  chunkattn::DecodePlanHeader h;
  std::memcpy(&h, plan_header.data_ptr<int32_t>(), sizeof(h));
  TORCH_CHECK(h.batch == a.batch && h.num_heads == a.num_heads && h.head_size == a.head_size &&
                  h.num_kv_heads == a.num_kv_heads && h.block_size == a.block_size && h.num_nodes == a.num_nodes,
              "chunkattn: decode plan built for ", h.batch, " rows x ", h.num_heads, " heads of ", h.head_size,
              " over ", h.num_kv_heads, " KV heads, block size ", h.block_size, ", ", h.num_nodes,
              " nodes; this layer has ", a.batch, " rows x ", a.num_heads, " heads of ", a.head_size, " over ",
              a.num_kv_heads, " KV heads, block size ", a.block_size, ", ", a.num_nodes, " nodes");
  for (const auto* t : {&plan_items, &plan_node_work, &plan_partial_work}) check_plan_rows(*t, "arrays", device);
  TORCH_CHECK(plan_items.numel() == (static_cast<int64_t>(h.num_items) + 1) * chunkattn::kPlanRowInts &&
                  plan_node_work.numel() == static_cast<int64_t>(h.num_nodes) * chunkattn::kPlanRowInts &&
                  plan_partial_work.numel() == static_cast<int64_t>(h.num_partial_rows) * chunkattn::kPlanRowInts,
              "chunkattn: plan tensors do not match the plan header");
  (void)plan_row_order;  // the CUDA kernels order sequence-first work by block index
  a.num_partial_rows = h.num_partial_rows;
  if (batch == 0) return;

  const c10::cuda::OptionalCUDAGuard guard(device);
  const at::Tensor q = aligned_query(query);
  const bool out_ok = vectors_aligned(out, 8);
  at::Tensor dst = out_ok ? out : at::empty(out.sizes(), out.options());
  a.out = dst.data_ptr();
  a.query = q.data_ptr();
  a.kv_cache = kv_cache.data_ptr();
  a.variant = variant;
  a.out_stride_row = dst.stride(0);
  a.out_stride_head = dst.stride(1);
  a.query_stride_row = q.stride(0);
  a.query_stride_head = q.stride(1);
  a.cache_stride_block = kv_cache.stride(0);
  a.cache_stride_head = kv_cache.stride(1);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index());
  run("tpp_decode", [&] {
    const chunkattn::cuda::DecodeSizes sizes = chunkattn::cuda::tpp_decode_sizes(a);
    TORCH_CHECK(sizes.item_capacity == h.num_items && sizes.piece_row_capacity == h.num_slots,
                "chunkattn: this layer's launch sizes differ from the plan's");
    at::Tensor workspace = at::empty({static_cast<int64_t>(sizes.workspace_bytes)}, query.options().dtype(at::kByte));
    chunkattn::cuda::launch_tpp_decode(a, plan_buffers(plan_items, plan_node_work, plan_partial_work),
                                       workspace.data_ptr(), stream);
  });
  if (!out_ok) out.copy_(dst);
}

void paged_prefill(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                   const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_table,
                   double scale, int64_t sliding_window, double logits_soft_cap,
                   const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi_slopes) {
  check_query(query, out, kv_cache, "paged_prefill");
  const AttentionVariant variant =
      attention_variant(scale, sliding_window, logits_soft_cap, sinks, alibi_slopes, query);
  const DType dtype = attention_dtype(query.scalar_type(), "paged_prefill");
  const at::Device device = query.device();
  const int64_t num_reqs = seq_lens.numel();
  check_index(seq_lens, "seq_lens", device, num_reqs);
  check_index(query_start_loc, "query_start_loc", device, num_reqs + 1);
  check_block_table(block_table, device, num_reqs);
  if (num_reqs == 0 || query.size(0) == 0) return;

  const c10::cuda::OptionalCUDAGuard guard(device);
  const at::Tensor q = aligned_query(query);
  const bool out_ok = vectors_aligned(out, 8);
  at::Tensor dst = out_ok ? out : at::empty(out.sizes(), out.options());

  chunkattn::cuda::PrefillArgs a{};
  a.dtype = dtype;
  a.out = dst.data_ptr();
  a.query = q.data_ptr();
  a.kv_cache = kv_cache.data_ptr();
  a.query_start_loc = query_start_loc.data_ptr<int>();
  a.seq_lens = seq_lens.data_ptr<int>();
  a.block_table = block_table.data_ptr<int>();
  a.num_tokens = static_cast<int>(query.size(0));
  a.num_reqs = static_cast<int>(num_reqs);
  a.num_heads = static_cast<int>(query.size(1));
  a.num_kv_heads = static_cast<int>(kv_cache.size(1));
  a.head_size = static_cast<int>(query.size(2));
  a.block_size = static_cast<int>(kv_cache.size(2));
  a.variant = variant;
  a.out_stride_row = dst.stride(0);
  a.out_stride_head = dst.stride(1);
  a.query_stride_row = q.stride(0);
  a.query_stride_head = q.stride(1);
  a.cache_stride_block = kv_cache.stride(0);
  a.cache_stride_head = kv_cache.stride(1);
  a.block_table_stride = block_table.stride(0);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index());
  run("paged_prefill", [&] {
    const size_t bytes = chunkattn::cuda::paged_prefill_workspace_bytes(a);
    at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, query.options().dtype(at::kByte));
    chunkattn::cuda::launch_paged_prefill(a, workspace.data_ptr(), stream);
  });
  if (!out_ok) out.copy_(dst);
}

void merge_attn_states(at::Tensor& output, const at::Tensor& prefix_output, const at::Tensor& prefix_lse,
                       const at::Tensor& suffix_output, const at::Tensor& suffix_lse,
                       const std::optional<at::Tensor>& output_lse, std::optional<int64_t> prefill_tokens_with_context) {
  TORCH_CHECK(output.is_cuda() && output.dim() == 3 && output.stride(2) == 1,
              "chunkattn::merge_attn_states: output must be a CUDA tensor [num_tokens, num_heads, head_size] with "
              "contiguous head_size elements");
  const DType dtype = attention_dtype(output.scalar_type(), "merge_attn_states");
  const at::Device device = output.device();
  for (const auto* t : {&prefix_output, &suffix_output}) {
    TORCH_CHECK(t->device() == device && t->sizes() == output.sizes() && t->scalar_type() == output.scalar_type() &&
                    t->stride(2) == 1,
                "chunkattn::merge_attn_states: prefix_output and suffix_output must have output's device, shape ",
                output.sizes(), " and dtype, with contiguous head_size elements");
  }
  const int64_t num_tokens = output.size(0), num_heads = output.size(1);
  auto check_lse = [&](const at::Tensor& lse, const char* name) {
    TORCH_CHECK(lse.device() == device && lse.scalar_type() == at::kFloat && lse.dim() == 2 &&
                    lse.size(0) == num_heads && lse.size(1) == num_tokens,
                "chunkattn::merge_attn_states: ", name, " must be float32 [num_heads, num_tokens] = [", num_heads,
                ", ", num_tokens, "] on ", device);
  };
  check_lse(prefix_lse, "prefix_lse");
  check_lse(suffix_lse, "suffix_lse");
  if (output_lse) check_lse(*output_lse, "output_lse");
  const int64_t tokens_with_context = prefill_tokens_with_context.value_or(num_tokens);
  TORCH_CHECK(tokens_with_context >= 0, "chunkattn::merge_attn_states: prefill_tokens_with_context must be >= 0");
  if (num_tokens == 0 || num_heads == 0) return;

  const c10::cuda::OptionalCUDAGuard guard(device);
  chunkattn::cuda::MergeArgs a{};
  a.dtype = dtype;
  a.output = output.data_ptr();
  a.prefix_output = prefix_output.data_ptr();
  a.suffix_output = suffix_output.data_ptr();
  a.prefix_lse = prefix_lse.data_ptr<float>();
  a.suffix_lse = suffix_lse.data_ptr<float>();
  a.output_lse = output_lse ? output_lse->data_ptr<float>() : nullptr;
  a.num_tokens = static_cast<int>(num_tokens);
  a.num_heads = static_cast<int>(num_heads);
  a.head_size = static_cast<int>(output.size(2));
  a.tokens_with_context = static_cast<int>(std::min(tokens_with_context, num_tokens));
  a.output_stride_token = output.stride(0);
  a.output_stride_head = output.stride(1);
  a.prefix_stride_token = prefix_output.stride(0);
  a.prefix_stride_head = prefix_output.stride(1);
  a.suffix_stride_token = suffix_output.stride(0);
  a.suffix_stride_head = suffix_output.stride(1);
  a.prefix_lse_stride_head = prefix_lse.stride(0);
  a.prefix_lse_stride_token = prefix_lse.stride(1);
  a.suffix_lse_stride_head = suffix_lse.stride(0);
  a.suffix_lse_stride_token = suffix_lse.stride(1);
  a.output_lse_stride_head = output_lse ? output_lse->stride(0) : 0;
  a.output_lse_stride_token = output_lse ? output_lse->stride(1) : 0;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index());
  run("merge_attn_states", [&] { chunkattn::cuda::launch_merge_attn_states(a, stream); });
}

}  // namespace chunkattn::cuda_ops
