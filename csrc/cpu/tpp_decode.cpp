// Two-phase-partition (TPP) decode attention on CPU (ChunkAttention, section 3.2).
//
// Tensors:
//   query, out   [B, num_heads, D]; rows may be strided, the last dim contiguous.
//   kv_cache     [num_blocks, num_kv_heads, block_size, 2*D]: per (block, kv head)
//                the K tile [block_size, D] and then the V tile (chunkattn.h).
//   block_table  [B, max_blocks] int32, seq_lens [B] int32 (tokens incl. the new one).
//   Prefix-tree context (vllm_chunkattn/tree.py, all int32): order [B] (tree
//   position -> batch row), per node [N]: node_begin/end (tree positions covered),
//   node_chunk_begin/end (block-table columns shared), node_partial_offset;
//   per batch row: shared_chunks [B], row_partial_offsets [B+1] / row_partials (CSR
//   of the node partial rows the row merges).
//
// Work decomposition (G = num_heads / num_kv_heads):
//   Phase 1, chunk-first: items (node, kv head, split). The queries of all the
//     node's requests x G form one [rows*G, D] matrix, attended against the
//     node's chunks as matrix-matrix tiles (attend_lanes). A node whose
//     chunks are a large share of the phase is split along its chunks so
//     every thread gets work even for one big shared prefix; each split
//     writes its own fp32 partial (o, m, n).
//   Phase 2, sequence-first: items (batch row, group of kv heads). For each
//     kv head, the row's G query heads attend its private chunks
//     (block_table[row, shared_chunks[row]:]), last one partially filled,
//     with K/V read once for the G heads (attend_direct); the group's heads
//     are walked chunk by chunk, so the reads stream through whole blocks.
//     Then the node partials are merged (equation 2) and the result
//     normalised once and written in the output dtype.
//   Both phases run in one parallel region on torch's intra-op pool: items are
//   handed out through an atomic counter (parallel_items), all phase-1 items
//   (costliest first) before the phase-2 ones; a phase-2 item attends its
//   private chunks first and only then waits, on per-node counters, for the
//   phase-1 items whose partials it merges.
//
// Partial results live in a per-calling-thread scratch:
//   o [num_kv_heads, slots, G, D], m, n [num_kv_heads, slots, G], where node k's
//   split s owns slots slot_base[k] + s*rows_k + (tree position - node_begin).
#include <ATen/Dispatch.h>

#include <memory>
#include <thread>

#include "chunkattn.h"
#include "common/partial_state.h"
#include "cpu/driver_utils.h"
#include "cpu/kernels.h"

namespace chunkattn {

namespace {

using cpu::AttnJob;
using cpu::KernelTable;
using cpu::KvView;

// Cost units of one key for one query row, against the fixed cost of reading
// and widening it once per item: balances items with few rows.
constexpr double kKeyReadCost = 16.0;
// Phase-1 items per thread to aim for when splitting nodes.
constexpr int kItemsPerThread = 4;

struct Plan {
  int64_t slots = 0;
  std::vector<int32_t> splits, chunks_per_split, rows;
  std::vector<int64_t> slot_base;
  std::vector<int32_t> partial_node;  // partial row -> node
  struct Item {
    int32_t node, head, split;
    double cost;
  };
  std::vector<Item> items;
};

Plan plan_chunk_first(int64_t num_nodes, const int32_t* node_begin, const int32_t* node_end,
                      const int32_t* node_chunk_begin, const int32_t* node_chunk_end, const int32_t* node_partial_offset,
                      int64_t num_partial_rows, int64_t num_kv_heads, int64_t group, int64_t block_size) {
  Plan plan;
  plan.splits.resize(num_nodes);
  plan.chunks_per_split.resize(num_nodes);
  plan.rows.resize(num_nodes);
  plan.slot_base.resize(num_nodes + 1, 0);
  plan.partial_node.assign(num_partial_rows, -1);

  std::vector<double> cost(num_nodes);
  double total = 0;
  for (int64_t k = 0; k < num_nodes; ++k) {
    const int32_t rows = node_end[k] - node_begin[k];
    const int32_t chunks = node_chunk_end[k] - node_chunk_begin[k];
    TORCH_CHECK(rows >= 1 && chunks >= 1, "chunkattn: node ", k, " covers no request or no chunk");
    TORCH_CHECK(node_partial_offset[k] >= 0 && node_partial_offset[k] + rows <= num_partial_rows,
                "chunkattn: node ", k, " partial rows out of range");
    plan.rows[k] = rows;
    cost[k] = static_cast<double>(chunks) * block_size * (rows * group + kKeyReadCost);
    total += cost[k] * num_kv_heads;
    for (int32_t t = 0; t < rows; ++t) plan.partial_node[node_partial_offset[k] + t] = static_cast<int32_t>(k);
  }
  const int64_t threads = at::get_num_threads();
  const double target = total / static_cast<double>(threads * kItemsPerThread);
  for (int64_t k = 0; k < num_nodes; ++k) {
    const int32_t chunks = node_chunk_end[k] - node_chunk_begin[k];
    int64_t s = threads > 1 ? static_cast<int64_t>(std::ceil(cost[k] / target)) : 1;
    s = std::clamp<int64_t>(s, 1, chunks);
    const int32_t per = static_cast<int32_t>((chunks + s - 1) / s);
    plan.chunks_per_split[k] = per;
    plan.splits[k] = (chunks + per - 1) / per;
    plan.slot_base[k + 1] = plan.slot_base[k] + static_cast<int64_t>(plan.rows[k]) * plan.splits[k];
  }
  plan.slots = plan.slot_base[num_nodes];

  for (int64_t k = 0; k < num_nodes; ++k)
    for (int32_t h = 0; h < num_kv_heads; ++h)
      for (int32_t s = 0; s < plan.splits[k]; ++s)
        plan.items.push_back({static_cast<int32_t>(k), h, s, cost[k] / plan.splits[k]});
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const Plan::Item& a, const Plan::Item& b) { return a.cost > b.cost; });
  return plan;
}

template <typename qscalar_t>
void tpp_decode_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& kv_cache,
                     const torch::Tensor& block_table, const torch::Tensor& seq_lens, const torch::Tensor& order,
                     const torch::Tensor& node_begin, const torch::Tensor& node_end,
                     const torch::Tensor& node_chunk_begin, const torch::Tensor& node_chunk_end,
                     const torch::Tensor& node_partial_offset, const torch::Tensor& shared_chunks,
                     const torch::Tensor& row_partial_offsets, const torch::Tensor& row_partials,
                     int64_t num_partial_rows, float scale) {
  const int64_t batch = query.size(0), num_heads = query.size(1), D = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t num_nodes = node_begin.numel();
  const KernelTable& kern = cpu::select_kernels(kv_cache.scalar_type(), D);
  const KvView kv{kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), static_cast<int>(block_size)};

  const int32_t* ord = order.data_ptr<int32_t>();
  const int32_t* nb = node_begin.data_ptr<int32_t>();
  const int32_t* ne = node_end.data_ptr<int32_t>();
  const int32_t* ncb = node_chunk_begin.data_ptr<int32_t>();
  const int32_t* nce = node_chunk_end.data_ptr<int32_t>();
  const int32_t* npo = node_partial_offset.data_ptr<int32_t>();
  const int32_t* shc = shared_chunks.data_ptr<int32_t>();
  const int32_t* rpo = row_partial_offsets.data_ptr<int32_t>();
  const int32_t* rp = row_partials.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t table_stride = block_table.stride(0), table_width = block_table.size(1);
  const qscalar_t* q_data = query.data_ptr<qscalar_t>();
  qscalar_t* out_data = out.data_ptr<qscalar_t>();
  const int64_t q_s0 = query.stride(0), q_s1 = query.stride(1);
  const int64_t o_s0 = out.stride(0), o_s1 = out.stride(1);

  // Validate the context up front: the kernels index with it unchecked.
  for (int64_t k = 0; k < num_nodes; ++k) {
    TORCH_CHECK(0 <= nb[k] && nb[k] < ne[k] && ne[k] <= batch, "chunkattn: node ", k, " covers tree positions [",
                nb[k], ", ", ne[k], ") of a batch of ", batch);
    TORCH_CHECK(0 <= ncb[k] && ncb[k] < nce[k] && nce[k] <= table_width, "chunkattn: node ", k,
                " chunk range out of the block table");
  }
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(0 <= ord[b] && ord[b] < batch, "chunkattn: order out of range");
    const int64_t len = lens[b], shared = static_cast<int64_t>(shc[b]) * block_size;
    TORCH_CHECK(len >= 1 && shared <= len && (len + block_size - 1) / block_size <= table_width,
                "chunkattn: row ", b, " has seq_len ", len, " with ", shc[b], " shared chunks of ", block_size,
                " tokens and a block table of ", table_width, " columns");
    TORCH_CHECK(rpo[b] <= rpo[b + 1], "chunkattn: row_partial_offsets must be non-decreasing");
  }
  TORCH_CHECK(rpo[0] == 0 && rpo[batch] == row_partials.numel(), "chunkattn: row_partial_offsets do not match row_partials");
  for (int64_t i = 0; i < row_partials.numel(); ++i)
    TORCH_CHECK(0 <= rp[i] && rp[i] < num_partial_rows, "chunkattn: row_partials out of range");

  const Plan plan = plan_chunk_first(num_nodes, nb, ne, ncb, nce, npo, num_partial_rows, num_kv_heads, group, block_size);
  for (int64_t i = 0; i < row_partials.numel(); ++i)
    TORCH_CHECK(plan.partial_node[rp[i]] >= 0, "chunkattn: partial row ", rp[i], " belongs to no node");

  // Partials of phase 1, owned by the calling thread, reused across calls.
  cpu::DriverScratch& caller = cpu::driver_scratch();
  const int64_t part_rows = plan.slots * group;  // per kv head
  float* part_o = caller.get(4, static_cast<size_t>(num_kv_heads * part_rows * D));
  float* part_mn = caller.get(5, static_cast<size_t>(2 * num_kv_heads * part_rows));
  float* part_m = part_mn;
  float* part_n = part_mn + num_kv_heads * part_rows;

  // Unfinished phase-1 items per node; phase-2 items wait on them before merging.
  std::unique_ptr<std::atomic<int32_t>[]> pending(new std::atomic<int32_t>[std::max<int64_t>(num_nodes, 1)]);
  for (int64_t k = 0; k < num_nodes; ++k) pending[k].store(static_cast<int32_t>(num_kv_heads * plan.splits[k]));

  // ---- Phase 1: chunk-first, one item per (node, kv head, split).
  auto chunk_first = [&](int64_t i) {
    const Plan::Item& item = plan.items[i];
    const int32_t k = item.node, h = item.head, s = item.split;
    const int32_t rows = plan.rows[k];
    const int64_t M = static_cast<int64_t>(rows) * group;
    float* q = cpu::driver_scratch().get(0, M * D);
    for (int32_t t = 0; t < rows; ++t) {
      const int64_t b = ord[nb[k] + t];
      for (int64_t g = 0; g < group; ++g)
        cpu::load_scaled(q_data + b * q_s0 + (h * group + g) * q_s1, D, scale, q + (t * group + g) * D);
    }
    const int32_t c0 = ncb[k] + s * plan.chunks_per_split[k];
    const int32_t c1 = std::min(nce[k], c0 + plan.chunks_per_split[k]);
    const int64_t row0 = h * part_rows + (plan.slot_base[k] + static_cast<int64_t>(s) * rows) * group;
    AttnJob job{q, static_cast<int>(M), table + ord[nb[k]] * table_stride + c0,
                static_cast<int>((c1 - c0) * block_size), h, nullptr,
                part_o + row0 * D, part_m + row0, part_n + row0};
    job.q_scale = scale;
    (M <= kern.direct_max_rows ? kern.direct : kern.lanes)(kv, job);
    pending[k].fetch_sub(1, std::memory_order_release);
  };

  // ---- Phase 2: sequence-first, one item per (batch row, group of kv heads);
  // rows with the most private tokens first. A group walks each private chunk's
  // heads back to back: they are adjacent tiles of the block, so reads stream
  // through whole blocks. Groups are as large as the thread count allows.
  std::vector<int32_t> rows_by_cost(batch);
  for (int64_t b = 0; b < batch; ++b) rows_by_cost[b] = static_cast<int32_t>(b);
  std::stable_sort(rows_by_cost.begin(), rows_by_cost.end(), [&](int32_t a, int32_t b) {
    return lens[a] - shc[a] * block_size > lens[b] - shc[b] * block_size;
  });
  const int64_t threads = at::get_num_threads();
  const int64_t groups_per_row = std::min<int64_t>(
      num_kv_heads, (kItemsPerThread * threads + batch - 1) / batch);
  const int64_t heads_per_item = (num_kv_heads + groups_per_row - 1) / groups_per_row;
  const int64_t items_per_row = (num_kv_heads + heads_per_item - 1) / heads_per_item;
  const bool seq_direct = group <= kern.direct_max_rows;
  auto sequence_first = [&](int64_t i) {
    const int64_t b = rows_by_cost[i / items_per_row];
    const int32_t h0 = static_cast<int32_t>((i % items_per_row) * heads_per_item);
    const int64_t nh = std::min<int64_t>(heads_per_item, num_kv_heads - h0);
    const int64_t rows = nh * group;  // q heads h0*group .. (h0+nh)*group, in order
    cpu::DriverScratch& scr = cpu::driver_scratch();
    float* q = scr.get(0, rows * D);
    float* o = scr.get(1, rows * D);
    float* mn = scr.get(2, 2 * rows);
    float* m = mn;
    float* n = mn + rows;
    for (int64_t r = 0; r < rows; ++r)
      cpu::load_scaled(q_data + b * q_s0 + (h0 * group + r) * q_s1, D, scale, q + r * D);
    const int64_t shared = static_cast<int64_t>(shc[b]) * block_size;
    const int num_private = static_cast<int>(lens[b] - shared);
    if (num_private > 0) {
      AttnJob job{q, static_cast<int>(group), table + b * table_stride + shc[b], num_private, h0, nullptr, o, m, n,
                  static_cast<int>(nh), scale};
      (seq_direct ? kern.direct : kern.lanes)(kv, job);
    } else {
      std::fill(o, o + rows * D, 0.f);
      std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
      std::fill(n, n + rows, 0.f);
    }

    // The row's node partials: all phase-1 items were handed out before this
    // item, so at most the ones still running on other threads are waited for.
    for (int32_t e = rpo[b]; e < rpo[b + 1]; ++e) {
      const std::atomic<int32_t>& left = pending[plan.partial_node[rp[e]]];
      while (left.load(std::memory_order_acquire) > 0) std::this_thread::yield();
    }

    // Merge (equation 2): each node partial into the row's own part, in place; normalise once.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t h = h0 + r / group, g = r % group;
      PartialState total{m[r], n[r]};
      float* acc = o + r * D;
      for (int32_t e = rpo[b]; e < rpo[b + 1]; ++e) {
        const int32_t p = rp[e];
        const int32_t k = plan.partial_node[p];
        const int64_t t = p - npo[k];
        for (int32_t s = 0; s < plan.splits[k]; ++s) {
          const int64_t row = h * part_rows + (plan.slot_base[k] + static_cast<int64_t>(s) * plan.rows[k] + t) * group + g;
          const MergeScales scales = merge<NaturalExp>(total, PartialState{part_m[row], part_n[row]});
          const float* po = part_o + row * D;
          for (int64_t d = 0; d < D; ++d) acc[d] = combine(acc[d], po[d], scales);
        }
      }
      cpu::store_row(acc, D, out_data + b * o_s0 + (h0 * group + r) * o_s1, inverse_sum(total.n));
    }
  };

  // One parallel region for both phases: phase-1 items first (costliest
  // first), then phase-2 items, which compute their private part before
  // waiting for their partials. A second region would add a second fork/join,
  // whose cost is a scheduler delay whenever another process holds a core.
  const int64_t num_chunk_items = static_cast<int64_t>(plan.items.size());
  cpu::parallel_items(num_chunk_items + batch * items_per_row, [&](int64_t i) {
    if (i < num_chunk_items) chunk_first(i);
    else sequence_first(i - num_chunk_items);
  });
}

}  // namespace

void tpp_decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& kv_cache,
                const torch::Tensor& block_table, const torch::Tensor& seq_lens, const torch::Tensor& order,
                const torch::Tensor& node_begin, const torch::Tensor& node_end, const torch::Tensor& node_chunk_begin,
                const torch::Tensor& node_chunk_end, const torch::Tensor& node_partial_offset,
                const torch::Tensor& shared_chunks, const torch::Tensor& row_partial_offsets,
                const torch::Tensor& row_partials, int64_t num_partial_rows, double scale) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && out.sizes() == query.sizes(),
              "chunkattn: query and out must be [batch, num_heads, head_size] of the same shape");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "chunkattn: query/out rows must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "chunkattn: out dtype must match query dtype");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous() && kv_cache.size(3) == 2 * query.size(2),
              "chunkattn: kv_cache must be contiguous [num_blocks, num_kv_heads, block_size, 2*head_size]");
  TORCH_CHECK(query.size(1) % kv_cache.size(1) == 0, "chunkattn: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.stride(1) == 1 &&
                  block_table.size(0) >= query.size(0),
              "chunkattn: block_table must be int32 [batch, max_blocks] with contiguous rows");
  const int64_t batch = query.size(0);
  cpu::check_int32_vector(seq_lens, "seq_lens");
  cpu::check_int32_vector(order, "order");
  cpu::check_int32_vector(shared_chunks, "shared_chunks");
  cpu::check_int32_vector(row_partial_offsets, "row_partial_offsets");
  cpu::check_int32_vector(row_partials, "row_partials");
  for (const auto* t : {&node_begin, &node_end, &node_chunk_begin, &node_chunk_end, &node_partial_offset}) {
    cpu::check_int32_vector(*t, "node arrays");
    TORCH_CHECK(t->numel() == node_begin.numel(), "chunkattn: node arrays must have the same length");
  }
  TORCH_CHECK(seq_lens.numel() >= batch && order.numel() == batch && shared_chunks.numel() == batch &&
                  row_partial_offsets.numel() == batch + 1,
              "chunkattn: per-row context arrays do not match the batch size ", batch);
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kHalf ||
                  query.scalar_type() == at::kBFloat16,
              "chunkattn: query dtype must be float32, float16 or bfloat16");
  if (batch == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "chunkattn_tpp_decode", [&] {
    tpp_decode_impl<scalar_t>(out, query, kv_cache, block_table, seq_lens, order, node_begin, node_end,
                              node_chunk_begin, node_chunk_end, node_partial_offset, shared_chunks,
                              row_partial_offsets, row_partials, num_partial_rows, static_cast<float>(scale));
  });
}

}  // namespace chunkattn
