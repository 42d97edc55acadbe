// Two-phase-partition (TPP) decode attention on CPU (ChunkAttention, section 3.2).
//
// Tensors:
//   query, out   [B, num_heads, D]; rows may be strided, the last dim contiguous.
//   kv_cache     [num_blocks, num_kv_heads, block_size, 2*D]: per (block, kv head)
//                the K tile [block_size, D] and then the V tile (chunkattn.h).
//   block_table  [B, max_blocks] int32, seq_lens [B] int32 (tokens incl. the new one).
//   Prefix-tree context (vllm_chunkattn/prefix/tree.py, all int32): order [B] (tree
//   position -> batch row), per node [N]: node_begin/end (tree positions covered),
//   node_chunk_begin/end (block-table columns shared), node_partial_offset;
//   per batch row: shared_chunks [B], row_partial_offsets [B+1] / row_partials (CSR
//   of the node partial rows the row merges).
//
// Work decomposition (G = num_heads / num_kv_heads):
//   Phase 1, chunk-first: items (node, kv heads, split). The queries of all the
//     node's requests x G form one [rows*G, D] matrix, attended against the
//     node's chunks as matrix-matrix tiles (attend_lanes). A node whose
//     chunks are a large share of the phase is split along its chunks so
//     every thread gets work even for one big shared prefix; each split
//     writes its own fp32 partial (o, m, n). A small node (the rows of one
//     request with a few new tokens over its private chunks) takes several
//     KV heads per item, walked as the sequence-first phase walks them:
//     an item per head would cost more to hand out than to compute.
//   Phase 2, sequence-first: items (batch row, group of kv heads). For each
//     kv head, the row's G query heads attend its private chunks
//     (block_table[row, shared_chunks[row]:]), last one partially filled,
//     with K/V read once for the G heads (attend_direct); the group's heads
//     are walked chunk by chunk, so the reads stream through whole blocks.
//     Then the node partials are merged (equation 2) and the result
//     normalised once and written in the output dtype.
//   Work in the gaps: a phase-1 item of a few rows (a request's own node) and
//     a phase-2 item's private part are memory bound where a phase-1 lanes
//     call is compute bound, and neither waits on anything (the private part
//     needs no phase-1 result). So a lanes call takes such items into its
//     gaps (cpu::GapWork), in handout order and a KV head at a time: the
//     tile's register blocks prefetch the head's lines between their FMAs,
//     and it runs from the caches after the next lane pair's P.V. Heads are
//     claimed one by one (GapClaims): the thread an item is handed out to
//     runs the heads no gap took, and waits at most for the one a gap has in
//     hand; a phase-2 item whose private part was taken only merges. On a
//     Zen 4, fp32 decode of 256 requests with GQA 4 behind a 2048-token
//     prefix (129 private tokens each) took 4 to 6% less time; bf16 tiles,
//     whose S^T blocks take no prefetches, keep their gaps empty.
//   Both phases run in one parallel region on torch's intra-op pool: items are
//   handed out through an atomic counter (parallel_items_with_next), all
//   phase-1 items (costliest first) before the phase-2 ones; a phase-2 item
//   attends its private chunks first and only then waits, on per-node
//   counters, for the phase-1 items whose partials it merges. A thread claims
//   its next phase-2 item before it runs the current one, whose last tiles
//   prefetch the next one's first.
//
// Partial results live in a per-calling-thread scratch:
//   o [num_kv_heads, slots, G, D], m, n [num_kv_heads, slots, G], where node k's
//   split s owns slots first_slot[k] + s*rows_k + (tree position - node_begin);
//   and phase-2 item i's private part, o [rows, D] and m, n [rows], at i.
//
// Plan and run (csrc/common/decode_plan.h): tpp_decode_plan validates the context and
// builds the work items, splits, slots and row order once per step (the
// metadata builder calls it); tpp_decode, once per layer, runs that plan.
#include <ATen/Dispatch.h>

#include <array>
#include <cstring>
#include <memory>
#include <thread>

#include "chunkattn.h"
#include "common/attention_variant_args.h"
#include "common/partial_state.h"
#include "cpu/driver_utils.h"
#include "cpu/kernels.h"
#include "common/decode_plan.h"

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

// Who runs each (item, KV head) of a decode call: the thread the item is
// handed out to, or earlier the gaps of a phase-1 lanes call (GapWorkTaker);
// whichever claims it first. A phase-2 item waits for the heads of its private
// part that another thread claimed to be written.
class GapClaims {
 public:
  // Items of at most max_heads KV heads each.
  GapClaims(int64_t num_items, int64_t max_heads)
      : max_heads_(max_heads), state_(new std::atomic<int8_t>[std::max<int64_t>(num_items * max_heads, 1)]) {
    for (int64_t u = 0; u < num_items * max_heads; ++u) state_[u].store(kFree, std::memory_order_relaxed);
  }
  bool claim(int64_t item, int64_t head) {
    int8_t expected = kFree;
    return unit(item, head).compare_exchange_strong(expected, kClaimed, std::memory_order_acq_rel);
  }
  void written(int64_t item, int64_t head) { unit(item, head).store(kWritten, std::memory_order_release); }
  void wait(int64_t item, int64_t head) {
    while (unit(item, head).load(std::memory_order_acquire) != kWritten) std::this_thread::yield();
  }
  std::atomic<int64_t> next_for_gaps{0};  // the item the gaps try next, in handout order

 private:
  enum : int8_t { kFree, kClaimed, kWritten };
  std::atomic<int8_t>& unit(int64_t item, int64_t head) { return state_[item * max_heads_ + head]; }
  int64_t max_heads_;
  std::unique_ptr<std::atomic<int8_t>[]> state_;
};

// Whether the gaps take an item, pass it over, or take none from it on.
enum class GapFit { kTake, kSkip, kStop };

// The tree context's arrays (PrefixTreeContext), as raw pointers.
struct TreeContextView {
  const int32_t* order;
  const int32_t* node_begin;
  const int32_t* node_end;
  const int32_t* node_chunk_begin;
  const int32_t* node_chunk_end;
  const int32_t* node_partial_offset;
  const int32_t* shared_chunks;
  const int32_t* row_partial_offsets;
  const int32_t* row_partials;
  int64_t num_row_partials;
};

TreeContextView context_view(const torch::Tensor& order, const torch::Tensor& node_begin, const torch::Tensor& node_end,
                             const torch::Tensor& node_chunk_begin, const torch::Tensor& node_chunk_end,
                             const torch::Tensor& node_partial_offset, const torch::Tensor& shared_chunks,
                             const torch::Tensor& row_partial_offsets, const torch::Tensor& row_partials) {
  return {order.data_ptr<int32_t>(), node_begin.data_ptr<int32_t>(), node_end.data_ptr<int32_t>(),
          node_chunk_begin.data_ptr<int32_t>(), node_chunk_end.data_ptr<int32_t>(),
          node_partial_offset.data_ptr<int32_t>(), shared_chunks.data_ptr<int32_t>(),
          row_partial_offsets.data_ptr<int32_t>(), row_partials.data_ptr<int32_t>(), row_partials.numel()};
}

void check_context_arrays(int64_t batch, const torch::Tensor& seq_lens, const torch::Tensor& order,
                          const torch::Tensor& node_begin, const torch::Tensor& node_end,
                          const torch::Tensor& node_chunk_begin, const torch::Tensor& node_chunk_end,
                          const torch::Tensor& node_partial_offset, const torch::Tensor& shared_chunks,
                          const torch::Tensor& row_partial_offsets, const torch::Tensor& row_partials) {
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
}

// Every index the kernels follow unchecked: the tree against the batch, the
// block table's width and the sequence lengths.
void validate_context(const TreeContextView& c, int64_t batch, int64_t num_nodes, int64_t num_partial_rows,
                      const int32_t* lens, int64_t table_width, int64_t block_size) {
  for (int64_t k = 0; k < num_nodes; ++k) {
    TORCH_CHECK(0 <= c.node_begin[k] && c.node_begin[k] < c.node_end[k] && c.node_end[k] <= batch, "chunkattn: node ",
                k, " covers tree positions [", c.node_begin[k], ", ", c.node_end[k], ") of a batch of ", batch);
    TORCH_CHECK(0 <= c.node_chunk_begin[k] && c.node_chunk_begin[k] < c.node_chunk_end[k] &&
                    c.node_chunk_end[k] <= table_width,
                "chunkattn: node ", k, " chunk range [", c.node_chunk_begin[k], ", ", c.node_chunk_end[k],
                ") out of a block table of ", table_width, " columns");
    const int64_t rows = c.node_end[k] - c.node_begin[k];
    TORCH_CHECK(c.node_partial_offset[k] >= 0 && c.node_partial_offset[k] + rows <= num_partial_rows,
                "chunkattn: node ", k, " partial rows out of range");
  }
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(0 <= c.order[b] && c.order[b] < batch, "chunkattn: order out of range");
    const int64_t len = lens[b], shared = static_cast<int64_t>(c.shared_chunks[b]) * block_size;
    TORCH_CHECK(len >= 1 && c.shared_chunks[b] >= 0 && shared <= len &&
                    (len + block_size - 1) / block_size <= table_width,
                "chunkattn: row ", b, " has seq_len ", len, " with ", c.shared_chunks[b], " shared chunks of ",
                block_size, " tokens and a block table of ", table_width, " columns");
    TORCH_CHECK(c.row_partial_offsets[b] <= c.row_partial_offsets[b + 1],
                "chunkattn: row_partial_offsets must be non-decreasing");
  }
  TORCH_CHECK(c.row_partial_offsets[0] == 0 && c.row_partial_offsets[batch] == c.num_row_partials,
              "chunkattn: row_partial_offsets do not match row_partials");
  for (int64_t i = 0; i < c.num_row_partials; ++i)
    TORCH_CHECK(0 <= c.row_partials[i] && c.row_partials[i] < num_partial_rows, "chunkattn: row_partials out of range");
}

// Consecutive batch rows that the sequence-first phase attends as one query matrix: the query tokens of
// one request (prefix/query_rows.py), each a key further along the same private chunks. A run's rows
// share their first private chunk and the private block ids up to each row's last key, so the run's
// last (longest) row's chunks, each row under its causal limit, are every row's own.
struct RowRun {
  int32_t first_row, rows;
};

// The batch's runs, the most private tokens (of a run's last row) first. A row with no private key runs
// alone: a run's rows each see at least their own key.
std::vector<RowRun> sequence_first_runs(const TreeContextView& c, const int32_t* lens, const int32_t* table,
                                        int64_t table_stride, int64_t batch, int64_t block_size) {
  auto private_keys = [&](int64_t b) { return lens[b] - static_cast<int64_t>(c.shared_chunks[b]) * block_size; };
  auto continues = [&](int64_t b) {  // row b extends row b - 1's run
    if (lens[b] != lens[b - 1] + 1 || c.shared_chunks[b] != c.shared_chunks[b - 1] || private_keys(b - 1) < 1)
      return false;
    const int32_t* prev = table + (b - 1) * table_stride;
    const int32_t* row = table + b * table_stride;
    for (int64_t col = c.shared_chunks[b]; col * block_size < lens[b - 1]; ++col)
      if (prev[col] != row[col]) return false;
    return true;
  };
  std::vector<RowRun> runs;
  for (int64_t b = 0; b < batch; ++b) {
    if (b > 0 && continues(b)) {
      ++runs.back().rows;
    } else {
      runs.push_back({static_cast<int32_t>(b), 1});
    }
  }
  std::stable_sort(runs.begin(), runs.end(), [&](const RowRun& a, const RowRun& b) {
    return private_keys(a.first_row + a.rows - 1) > private_keys(b.first_row + b.rows - 1);
  });
  return runs;
}

// Fills the plan tensors (csrc/common/decode_plan.h) for the CPU kernel.
void plan_cpu(DecodePlanHeader& h, torch::Tensor& items, torch::Tensor& node_work, torch::Tensor& partial_work,
              torch::Tensor& row_order, const TreeContextView& c, const int32_t* lens, const int32_t* table,
              int64_t table_stride) {
  const int64_t num_nodes = h.num_nodes, group = h.num_heads / h.num_kv_heads, block_size = h.block_size;
  node_work.resize_({num_nodes, kPlanRowInts});
  partial_work.resize_({h.num_partial_rows, kPlanRowInts});
  int32_t* nw = node_work.data_ptr<int32_t>();
  int32_t* pw = partial_work.data_ptr<int32_t>();
  for (int64_t i = 0; i < partial_work.numel(); ++i) pw[i] = i % kPlanRowInts == kPartialNode ? kNoNode : 0;

  // Chunk-first: split the costliest nodes along their chunks so that every
  // thread gets work even for one big shared prefix.
  std::vector<double> cost(num_nodes);
  double total = 0;
  for (int64_t k = 0; k < num_nodes; ++k) {
    const int64_t rows = c.node_end[k] - c.node_begin[k];
    const int64_t chunks = c.node_chunk_end[k] - c.node_chunk_begin[k];
    cost[k] = static_cast<double>(chunks) * block_size * (rows * group + kKeyReadCost);
    total += cost[k] * h.num_kv_heads;
  }
  const double target = total / static_cast<double>(h.num_threads * kItemsPerThread);
  struct Item {
    int32_t node, head, split, heads;
    double cost;
  };
  std::vector<Item> work;
  int64_t slots = 0;
  for (int64_t k = 0; k < num_nodes; ++k) {
    const int32_t rows = c.node_end[k] - c.node_begin[k];
    const int32_t chunks = c.node_chunk_end[k] - c.node_chunk_begin[k];
    int64_t s = h.num_threads > 1 ? static_cast<int64_t>(std::ceil(cost[k] / target)) : 1;
    s = std::clamp<int64_t>(s, 1, chunks);
    const int32_t per = static_cast<int32_t>((chunks + s - 1) / s);
    const int32_t splits = (chunks + per - 1) / per;
    TORCH_CHECK(slots + static_cast<int64_t>(rows) * splits <= std::numeric_limits<int32_t>::max(),
                "chunkattn: decode plan needs more partial slots than int32 indexes");
    int32_t* node = nw + k * kPlanRowInts;
    node[kNodeFirstSlot] = static_cast<int32_t>(slots);
    node[kNodePieces] = splits;
    node[kNodePieceSize] = per;
    for (int32_t t = 0; t < rows; ++t) {
      int32_t* partial = pw + static_cast<int64_t>(c.node_partial_offset[k] + t) * kPlanRowInts;
      partial[kPartialFirstSlot] = static_cast<int32_t>(slots + t);
      partial[kPartialSlotStride] = rows;
      partial[kPartialPieces] = splits;
      partial[kPartialNode] = static_cast<int32_t>(k);
    }
    slots += static_cast<int64_t>(rows) * splits;
    // Heads per item: as many as keep the item within the per-item target (one for a split node).
    const int32_t heads = splits > 1 ? 1
        : static_cast<int32_t>(std::clamp<double>(std::floor(target / std::max(cost[k], 1.0)), 1.0, h.num_kv_heads));
    node[kNodeHeadsPerItem] = heads;
    for (int32_t head = 0; head < h.num_kv_heads; head += heads) {
      const int32_t nh = std::min<int32_t>(heads, h.num_kv_heads - head);
      for (int32_t split = 0; split < splits; ++split)
        work.push_back({static_cast<int32_t>(k), head, split, nh, cost[k] * nh / splits});
    }
  }
  std::stable_sort(work.begin(), work.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  for (int64_t i = 0; i < c.num_row_partials; ++i)
    TORCH_CHECK(pw[static_cast<int64_t>(c.row_partials[i]) * kPlanRowInts + kPartialNode] != kNoNode,
                "chunkattn: partial row ", c.row_partials[i], " belongs to no node");

  const int64_t num_items = static_cast<int64_t>(work.size());
  items.resize_({num_items + 1, kPlanRowInts});
  int32_t* it = items.data_ptr<int32_t>();
  for (int64_t i = 0; i < num_items; ++i)
    std::copy_n(std::array<int32_t, kPlanRowInts>{work[i].node, work[i].head, work[i].split, work[i].heads}.data(),
                kPlanRowInts, it + i * kPlanRowInts);
  std::fill_n(it + num_items * kPlanRowInts, kPlanRowInts, 0);
  it[num_items * kPlanRowInts + kItemNode] = kNoNode;

  // Sequence-first: runs of rows (a request's query tokens) with the most private tokens first; each run's
  // KV heads in groups as large as the thread count allows.
  const int64_t batch = h.batch;
  const std::vector<RowRun> runs = sequence_first_runs(c, lens, table, table_stride, batch, block_size);
  const int64_t num_runs = static_cast<int64_t>(runs.size());
  row_order.resize_({batch + num_runs + 1});
  int32_t* ro = row_order.data_ptr<int32_t>();
  int32_t* run_offsets = ro + batch;
  run_offsets[0] = 0;
  for (int64_t r = 0; r < num_runs; ++r) {
    for (int32_t t = 0; t < runs[r].rows; ++t) ro[run_offsets[r] + t] = runs[r].first_row + t;
    run_offsets[r + 1] = run_offsets[r] + runs[r].rows;
  }
  const int64_t groups_per_run = std::min<int64_t>(
      h.num_kv_heads, (kItemsPerThread * h.num_threads + num_runs - 1) / std::max<int64_t>(num_runs, 1));
  h.heads_per_item = static_cast<int32_t>((h.num_kv_heads + groups_per_run - 1) / std::max<int64_t>(groups_per_run, 1));
  h.num_items = static_cast<int32_t>(num_items);
  h.num_slots = static_cast<int32_t>(slots);
}

// The plan's arrays, as the run reads them.
struct DecodePlanView {
  DecodePlanHeader header;
  const int32_t* items;
  const int32_t* node_work;
  const int32_t* partial_work;
  const int32_t* row_order;    // [batch]: the rows, run by run
  const int32_t* run_offsets;  // [num_runs + 1] into row_order
  int64_t num_runs;
};

// One tpp_decode call: the plan's items of both phases over one layer's
// tensors (the file's comment). The constructor takes the shapes and sets up
// the partials; run() hands out the items.
template <typename qscalar_t>
class DecodeRun {
 public:
  DecodeRun(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& kv_cache,
            const torch::Tensor& block_table, const torch::Tensor& seq_lens, const TreeContextView& ctx,
            const DecodePlanView& plan, const AttentionVariant& variant)
      : ctx_(ctx),
        plan_(plan),
        variant_(variant),
        batch_(query.size(0)),
        D_(query.size(2)),
        num_kv_heads_(kv_cache.size(1)),
        block_size_(kv_cache.size(2)),
        group_(query.size(1) / kv_cache.size(1)),
        kern_(cpu::select_kernels(kv_cache.scalar_type(), query.size(2))),
        lanes_(cpu::cpu_tuning().decode_qk_inline ? kern_.lanes_qk_inline : kern_.lanes),
        kv_{kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), static_cast<int>(block_size_)},
        elem_bytes_(kv_cache.element_size()),
        lens_(seq_lens.data_ptr<int32_t>()),
        table_(block_table.data_ptr<int32_t>()),
        table_stride_(block_table.stride(0)),
        q_data_(query.data_ptr<qscalar_t>()),
        q_s0_(query.stride(0)),
        q_s1_(query.stride(1)),
        out_data_(out.data_ptr<qscalar_t>()),
        o_s0_(out.stride(0)),
        o_s1_(out.stride(1)),
        num_chunk_items_(plan.header.num_items),
        heads_per_item_(plan.header.heads_per_item),
        items_per_run_((num_kv_heads_ + heads_per_item_ - 1) / heads_per_item_),
        num_seq_items_(plan.num_runs * items_per_run_),
        gaps_on_(kern_.runs_direct(group_) && cpu::cpu_tuning().lanes_prefetch_spread > 0),
        part_rows_(static_cast<int64_t>(plan.header.num_slots) * group_),
        pending_(new std::atomic<int32_t>[std::max<int64_t>(plan.header.num_nodes, 1)]),
        claims_(num_chunk_items_ + num_seq_items_, num_kv_heads_) {
    // Partials of phase 1 and the private parts of phase 2: the calling thread's scratch, reused across calls.
    cpu::DriverScratch& caller = cpu::driver_scratch();
    part_o_ = caller.get(4, static_cast<size_t>(num_kv_heads_ * part_rows_ * D_));
    part_m_ = caller.get(5, static_cast<size_t>(2 * num_kv_heads_ * part_rows_));
    part_n_ = part_m_ + num_kv_heads_ * part_rows_;
    const int64_t private_rows = batch_ * num_kv_heads_ * group_;
    private_o_ = caller.get(6, static_cast<size_t>(private_rows * D_));
    private_m_ = caller.get(7, static_cast<size_t>(2 * private_rows));
    private_n_ = private_m_ + private_rows;
    for (int64_t k = 0; k < plan.header.num_nodes; ++k)
      pending_[k].store(static_cast<int32_t>(num_kv_heads_ * node_field(k, kNodePieces)));
  }

  // One parallel region for both phases: phase-1 items first (costliest
  // first), then phase-2 items, which compute their private part before
  // waiting for their partials. A second region would add a second fork/join,
  // whose cost is a scheduler delay whenever another process holds a core.
  // A phase-2 item knows the one its thread runs next, whose first private tile
  // its last tiles prefetch.
  void run() {
    cpu::parallel_items_with_next(
        num_chunk_items_ + num_seq_items_,
        [&](int64_t i, int64_t next) {
          if (i < num_chunk_items_) chunk_first(i);
          else sequence_first(i - num_chunk_items_, next < 0 ? -1 : next - num_chunk_items_);
        },
        num_chunk_items_);
  }

 private:
  class GapWorkTaker;

  int32_t item_field(int64_t i, PlanItemField f) const { return plan_.items[i * kPlanRowInts + f]; }
  int32_t node_field(int64_t k, PlanNodeField f) const { return plan_.node_work[k * kPlanRowInts + f]; }
  int64_t private_keys(int64_t b) const { return lens_[b] - static_cast<int64_t>(ctx_.shared_chunks[b]) * block_size_; }

  // ---- Phase 1: chunk-first, one item per (node, kv heads, split).

  int64_t node_rows(int64_t i) const {
    const int32_t k = item_field(i, kItemNode);
    return static_cast<int64_t>(ctx_.node_end[k] - ctx_.node_begin[k]) * group_;
  }
  // The first partial row of head h of node k's split s: slots of the split, in part_o's [kv head, slot, G] order.
  int64_t partial_row(int32_t k, int32_t split, int32_t rows, int64_t h) const {
    return h * part_rows_ + (node_field(k, kNodeFirstSlot) + static_cast<int64_t>(split) * rows) * group_;
  }
  // The block-table columns [begin, end) that split `split` of node k covers.
  struct ChunkRange {
    int32_t begin, end;
  };
  ChunkRange split_chunks(int32_t k, int32_t split) const {
    const int32_t per_split = node_field(k, kNodePieceSize);
    const int32_t begin = ctx_.node_chunk_begin[k] + split * per_split;
    return {begin, std::min(ctx_.node_chunk_end[k], begin + per_split)};
  }
  // The item's (split, KV head) pairs [first, first + count) are written: phase-2 items may merge them.
  void node_heads_done(int64_t i, int32_t count) {
    pending_[item_field(i, kItemNode)].fetch_sub(count, std::memory_order_release);
  }

  // Heads [first, first + count) of phase-1 item i (relative to its first) into the split's partials, with
  // the query rows and arguments in `scr`; a lanes call takes `gap` work into its gaps.
  void node_part(int64_t i, int32_t first, int32_t count, cpu::DriverScratch& scr, cpu::GapWork* gap) {
    const int32_t k = item_field(i, kItemNode), h0 = item_field(i, kItemHeadOrTile) + first;
    const int32_t split = item_field(i, kItemPiece), nh = count;
    const int32_t* covered = ctx_.order + ctx_.node_begin[k];  // the node's batch rows
    const int32_t rows = ctx_.node_end[k] - ctx_.node_begin[k];
    const int64_t M = static_cast<int64_t>(rows) * group_, D = D_;
    float* q = scr.get(0, nh * M * D);  // [nh, M, D]
    for (int32_t hh = 0; hh < nh; ++hh)
      for (int32_t t = 0; t < rows; ++t)
        for (int64_t g = 0; g < group_; ++g)
          cpu::load_scaled(q_data_ + covered[t] * q_s0_ + ((h0 + hh) * group_ + g) * q_s1_, D, variant_.scale,
                           q + ((hh * rows + t) * group_ + g) * D);
    const auto [c0, c1] = split_chunks(k, split);
    const int64_t row0 = partial_row(k, split, rows, h0);
    AttnJob job{q, static_cast<int>(M), table_ + covered[0] * table_stride_ + c0,
                static_cast<int>((c1 - c0) * block_size_), h0, nullptr,
                part_o_ + row0 * D, part_m_ + row0, part_n_ + row0};
    job.q_scale = variant_.scale;
    job.num_heads = nh;
    job.softcap = variant_.logits_soft_cap;
    // Per row, relative to the split's first key: its window's first key, its
    // position (for ALiBi; every key of a node lies before it) and its slopes.
    const int64_t window = variant_.sliding_window;
    const float* alibi = variant_.alibi_slopes;
    float* row_args = scr.get(3, (2 + nh) * M);
    float* first_key = row_args;
    float* q_pos = alibi ? row_args + M : nullptr;
    for (int32_t t = 0; (window > 0 || q_pos) && t < rows; ++t) {  // nothing to fill for a plain layer
      const int64_t len = lens_[covered[t]] - static_cast<int64_t>(c0) * block_size_;
      if (window > 0) std::fill_n(first_key + t * group_, group_, static_cast<float>(len - window));
      if (q_pos) std::fill_n(q_pos + t * group_, group_, static_cast<float>(len - 1));
    }
    if (alibi) {
      float* slopes = row_args + 2 * M;
      for (int32_t hh = 0; hh < nh; ++hh)
        for (int64_t r = 0; r < M; ++r) slopes[hh * M + r] = alibi[(h0 + hh) * group_ + r % group_];
      job.q_pos = q_pos;
      job.alibi_slopes = slopes;
    }
    if (window > 0 && !cpu::trim_to_window(job, first_key, q_pos, static_cast<int>(block_size_))) {
      for (int32_t hh = 0; hh < nh; ++hh) {
        const int64_t row = partial_row(k, split, rows, h0 + hh);
        std::fill_n(part_o_ + row * D, M * D, 0.f);
        std::fill_n(part_m_ + row, M, -std::numeric_limits<float>::infinity());
        std::fill_n(part_n_ + row, M, 0.f);
      }
      return;
    }
    if (nh > 1) {  // the tiles write [nh, M] rows into scratch; each head's partials are part_rows apart
      float* mn = scr.get(2, 2 * nh * M);
      job.o = scr.get(1, nh * M * D), job.m = mn, job.n = mn + nh * M;
    }
    if (kern_.runs_direct(M)) {
      kern_.direct(kv_, job);
    } else {
      job.gap = gap;
      lanes_(kv_, job);
    }
    for (int32_t hh = 0; nh > 1 && hh < nh; ++hh) {
      const int64_t row = partial_row(k, split, rows, h0 + hh);
      std::copy_n(job.o + hh * M * D, M * D, part_o_ + row * D);
      std::copy_n(job.m + hh * M, M, part_m_ + row);
      std::copy_n(job.n + hh * M, M, part_n_ + row);
    }
  }

  void chunk_first(int64_t i);

  // ---- Phase 2: sequence-first, one item per (run of rows, group of kv heads);
  // runs with the most private tokens first. A run is a request's query tokens
  // (the plan's RowRun), attended as one query matrix under the causal mask; a
  // decode row runs alone. A group walks each private chunk's heads back to
  // back: they are adjacent tiles of the block, so reads stream through whole
  // blocks. Groups are as large as the thread count allows.
  // An item's private part (its rows against its private chunks) needs no
  // phase-1 result: it runs either in its item or earlier, in the gaps of a
  // phase-1 lanes call (GapWorkTaker), into per-item buffers that the item then
  // merges its node partials into.

  int64_t item_run(int64_t i) const { return i / items_per_run_; }
  int32_t item_head(int64_t i) const { return static_cast<int32_t>((i % items_per_run_) * heads_per_item_); }
  int64_t item_heads(int64_t i) const { return std::min<int64_t>(heads_per_item_, num_kv_heads_ - item_head(i)); }
  int64_t run_rows(int64_t r) const { return plan_.run_offsets[r + 1] - plan_.run_offsets[r]; }
  int64_t run_row(int64_t r, int64_t t) const { return plan_.row_order[plan_.run_offsets[r] + t]; }
  // The run's last row: it has the most keys, and its private chunks are every row's of the run.
  int64_t item_last_row(int64_t i) const { return run_row(item_run(i), run_rows(item_run(i)) - 1); }
  // Query rows per KV head of item i: the run's tokens, each with its G query heads.
  int64_t item_head_rows(int64_t i) const { return run_rows(item_run(i)) * group_; }
  // Phase 2 takes `direct` for a few rows per KV head, else the lanes tile (not in a gap: it would share the
  // tile's scratch).
  bool item_direct(int64_t i) const { return kern_.runs_direct(item_head_rows(i)); }
  // Item i's first private row for its head `first` (relative to its first): a run owns the rows of its
  // batch rows' query heads, [KV head, token, G] within.
  int64_t private_row(int64_t i, int64_t first) const {
    const int64_t r = item_run(i);
    return plan_.run_offsets[r] * num_kv_heads_ * group_ + (item_head(i) + first) * run_rows(r) * group_;
  }

  // Heads [first, first + count) of item i (relative to its first) against the run's private chunks, into
  // the item's private rows, with the query rows and arguments in `scr`; `next`: the item its thread runs
  // after this one (its first tile is prefetched), or -1.
  void private_part(int64_t i, int64_t first, int64_t count, cpu::DriverScratch& scr, int64_t next) {
    const int64_t r = item_run(i), tokens = run_rows(r), b = item_last_row(i), D = D_;
    const int32_t h0 = static_cast<int32_t>(item_head(i) + first);
    const int64_t head_rows = tokens * group_;
    const int64_t rows = count * head_rows;  // [count, tokens, G]
    float* q = scr.get(0, rows * D);
    const int64_t p0 = private_row(i, first);
    float* o = private_o_ + p0 * D;
    float* m = private_m_ + p0;
    float* n = private_n_ + p0;
    for (int64_t hh = 0; hh < count; ++hh)
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t g = 0; g < group_; ++g)
          cpu::load_scaled(q_data_ + run_row(r, t) * q_s0_ + ((h0 + hh) * group_ + g) * q_s1_, D, variant_.scale,
                           q + ((hh * tokens + t) * group_ + g) * D);
    const int32_t shared_chunks = ctx_.shared_chunks[b];
    const int64_t shared = static_cast<int64_t>(shared_chunks) * block_size_;
    const int num_private = static_cast<int>(private_keys(b));
    AttnJob job{q, static_cast<int>(head_rows), table_ + b * table_stride_ + shared_chunks, num_private, h0, nullptr,
                o, m, n, static_cast<int>(count), variant_.scale};
    job.softcap = variant_.logits_soft_cap;
    const int64_t window = variant_.sliding_window;
    const float* alibi = variant_.alibi_slopes;
    if (next >= 0 && window <= 0) {  // a window may drop the next item's first chunks
      const int64_t next_b = item_last_row(next);
      const int64_t next_keys = private_keys(next_b);
      if (next_keys > 0)
        job.after = {table_[next_b * table_stride_ + ctx_.shared_chunks[next_b]], item_head(next),
                     static_cast<int>(std::min<int64_t>(next_keys, block_size_))};
    }
    // Per row, relative to the first private key: its window's first key, its position (the causal limit
    // of a run's rows; for ALiBi) and its slope.
    float* row_args = scr.get(1, (2 + count) * head_rows);
    float* first_key = row_args;
    float* q_pos = alibi || tokens > 1 ? row_args + head_rows : nullptr;
    for (int64_t t = 0; (window > 0 || q_pos) && t < tokens; ++t) {
      const int64_t len = lens_[run_row(r, t)] - shared;
      if (window > 0) std::fill_n(first_key + t * group_, group_, static_cast<float>(len - window));
      if (q_pos) std::fill_n(q_pos + t * group_, group_, static_cast<float>(len - 1));
    }
    job.q_pos = q_pos;
    if (alibi) {
      float* slopes = row_args + 2 * head_rows;
      for (int64_t hh = 0; hh < count; ++hh)
        for (int64_t row = 0; row < head_rows; ++row)
          slopes[hh * head_rows + row] = alibi[(h0 + hh) * group_ + row % group_];
      job.alibi_slopes = slopes;
    }
    bool any_key = num_private > 0;
    if (any_key && window > 0) any_key = cpu::trim_to_window(job, first_key, q_pos, static_cast<int>(block_size_));
    if (any_key) {
      (item_direct(i) ? kern_.direct : lanes_)(kv_, job);
    } else {
      std::fill(o, o + rows * D, 0.f);
      std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
      std::fill(n, n + rows, 0.f);
    }
  }

  void sequence_first(int64_t i, int64_t next);

  // ---- Memory-bound work in the gaps of the compute-bound lanes calls (the
  // file's comment): items g of both phases in handout order, g < num_chunk_items_
  // a phase-1 item, else phase-2 item g - num_chunk_items_; claimed and run a KV
  // head at a time, so that a thread that needs an item waits at most for the
  // one head a gap has in hand.

  int64_t gap_heads(int64_t g) const {
    return g < num_chunk_items_ ? static_cast<int64_t>(item_field(g, kItemHeads)) : item_heads(g - num_chunk_items_);
  }
  // Phase-1 items that run `direct` (few rows: memory bound) and phase-2 private parts of a chunk or more;
  // phase-2 items come longest first, so the first shorter one ends the gaps' share.
  GapFit gap_fit(int64_t g) const {
    if (g < num_chunk_items_) return kern_.runs_direct(node_rows(g)) ? GapFit::kTake : GapFit::kSkip;
    const int64_t i = g - num_chunk_items_;
    if (private_keys(item_last_row(i)) < block_size_) return GapFit::kStop;
    return item_direct(i) ? GapFit::kTake : GapFit::kSkip;
  }
  // The cache lines of head `first` of item g: per chunk, its K rows and V rows (the live keys).
  void gap_lines(int64_t g, int64_t first, std::vector<cpu::LineRun>& runs) const {
    runs.clear();
    auto add_chunk = [&](int64_t block, int64_t head, int64_t keys) {
      const char* k = static_cast<const char*>(kv_.data) + (block * kv_.block_stride + head * kv_.head_stride) * elem_bytes_;
      const int lines = static_cast<int>((keys * D_ * elem_bytes_ + 63) / 64);
      runs.push_back({k, lines});
      runs.push_back({k + block_size_ * D_ * elem_bytes_, lines});
    };
    if (g < num_chunk_items_) {
      const int32_t k = item_field(g, kItemNode);
      const auto [c0, c1] = split_chunks(k, item_field(g, kItemPiece));
      const int32_t* blocks = table_ + ctx_.order[ctx_.node_begin[k]] * table_stride_;
      for (int32_t c = c0; c < c1; ++c) add_chunk(blocks[c], item_field(g, kItemHeadOrTile) + first, block_size_);
      return;
    }
    const int64_t i = g - num_chunk_items_, b = item_last_row(i), num_private = private_keys(b);
    const int32_t* blocks = table_ + b * table_stride_ + ctx_.shared_chunks[b];
    for (int64_t c = 0; c * block_size_ < num_private; ++c)
      add_chunk(blocks[c], item_head(i) + first, std::min<int64_t>(block_size_, num_private - c * block_size_));
  }
  // Heads [first, first + count) of item g, by the thread that claimed them (scr: the query rows' scratch);
  // `next`: the phase-2 item this thread runs next, or -1.
  void run_heads(int64_t g, int64_t first, int64_t count, cpu::DriverScratch& scr, int64_t next) {
    if (g < num_chunk_items_) {
      node_part(g, static_cast<int32_t>(first), static_cast<int32_t>(count), scr, nullptr);
      node_heads_done(g, static_cast<int32_t>(count));
    } else {
      private_part(g - num_chunk_items_, first, count, scr, next);
    }
    for (int64_t h = first; h < first + count; ++h) claims_.written(g, h);
  }
  // Runs the heads of item g that this thread claims, in runs of adjacent heads (one `direct` call walks a
  // chunk's heads back to back); returns whether another thread had claimed any.
  bool run_claimed_heads(int64_t g, cpu::DriverScratch& scr, int64_t next) {
    bool others = false;
    for (int64_t h = 0, heads = gap_heads(g); h < heads;) {
      if (!claims_.claim(g, h)) {
        others = true, ++h;
        continue;
      }
      int64_t end = h + 1;
      while (end < heads && claims_.claim(g, end)) ++end;
      run_heads(g, h, end - h, scr, next);
      h = end;
    }
    return others;
  }

  // The call's tensors and plan.
  const TreeContextView& ctx_;
  const DecodePlanView& plan_;
  const AttentionVariant& variant_;
  const int64_t batch_, D_, num_kv_heads_, block_size_, group_;
  const KernelTable& kern_;
  const cpu::AttnFn lanes_;
  const KvView kv_;
  const int64_t elem_bytes_;
  const int32_t* lens_;
  const int32_t* table_;
  const int64_t table_stride_;
  const qscalar_t* q_data_;
  const int64_t q_s0_, q_s1_;
  qscalar_t* out_data_;
  const int64_t o_s0_, o_s1_;
  // The work: phase-1 items, then phase-2 items of heads_per_item_ KV heads each.
  const int64_t num_chunk_items_, heads_per_item_, items_per_run_, num_seq_items_;
  // Gaps only where the work they take runs `direct` (`lanes` would share the tile's scratch: a decode row's
  // G rows are few enough, gap_fit skips longer runs) and a lanes tile can prefetch for it.
  const bool gaps_on_;
  // Phase-1 partials: o [num_kv_heads, slots, G, D], m and n [num_kv_heads, slots, G]; phase-2 private parts.
  const int64_t part_rows_;  // per KV head
  float* part_o_ = nullptr;
  float* part_m_ = nullptr;
  float* part_n_ = nullptr;
  float* private_o_ = nullptr;  // [batch rows' query heads, D], a run's at private_row
  float* private_m_ = nullptr;
  float* private_n_ = nullptr;
  // Unfinished (split, KV head) pairs of each node's phase-1 items; phase-2 items wait on them before merging.
  std::unique_ptr<std::atomic<int32_t>[]> pending_;
  GapClaims claims_;
};

// A phase-1 lanes call's taker: items in handout order, a KV head at a time; the head's lines go to the
// tile's prefetches, and it runs at the first gap after the last of them, from the caches.
template <typename qscalar_t>
class DecodeRun<qscalar_t>::GapWorkTaker final : public cpu::GapWork {
 public:
  GapWorkTaker(DecodeRun& run, std::vector<cpu::LineRun>& runs) : run_(run), runs_(runs) {}

  cpu::LineRun next_lines(int max_lines) override {
    if (item_ < 0 || run_index_ >= runs_.size()) return {};
    const cpu::LineRun& r = runs_[run_index_];
    const cpu::LineRun piece{r.p + int64_t{line_} * 64, std::min(max_lines, r.lines - line_)};
    line_ += piece.lines;
    if (line_ >= r.lines) line_ = 0, ++run_index_;
    return piece;
  }
  void in_gap() override {
    if (item_ >= 0) {
      if (run_index_ < runs_.size()) return;  // lines still to ask for
      run_claimed_head();
      ++head_;
    }
    // The next head this taker claims: of this item, else of the next item it fits.
    for (;;) {
      if (item_ >= 0) {
        while (head_ < run_.gap_heads(item_) && !run_.claims_.claim(item_, head_)) ++head_;
        if (head_ < run_.gap_heads(item_)) break;
      }
      item_ = run_.claims_.next_for_gaps.fetch_add(1, std::memory_order_relaxed), head_ = 0;
      const GapFit fit = item_ < run_.num_chunk_items_ + run_.num_seq_items_ ? run_.gap_fit(item_) : GapFit::kStop;
      if (fit == GapFit::kStop) {
        item_ = -1;
        return;
      }
      if (fit == GapFit::kSkip) item_ = -1;
    }
    run_.gap_lines(item_, head_, runs_);
    run_index_ = 0, line_ = 0;
  }
  // Runs the claimed head, if any.
  void finish() {
    if (item_ >= 0 && head_ < run_.gap_heads(item_)) run_claimed_head();
    item_ = -1;
  }

 private:
  // Gap work keeps its query rows and arguments apart from the driver scratch that the lanes call's are in.
  void run_claimed_head() {
    static thread_local cpu::DriverScratch scratch;
    run_.run_heads(item_, head_, 1, scratch, -1);
  }

  DecodeRun& run_;
  std::vector<cpu::LineRun>& runs_;  // of the claimed head
  int64_t item_ = -1, head_ = 0;     // the item being taken, and its claimed head
  size_t run_index_ = 0;
  int line_ = 0;  // into runs_[run_index_]
};

template <typename qscalar_t>
void DecodeRun<qscalar_t>::chunk_first(int64_t i) {
  if (gaps_on_ && gap_fit(i) == GapFit::kTake) {  // a lanes call's gaps may have taken some of its heads
    run_claimed_heads(i, cpu::driver_scratch(), -1);
    return;
  }
  static thread_local std::vector<cpu::LineRun> gap_runs;
  GapWorkTaker gaps(*this, gap_runs);
  const int32_t heads = item_field(i, kItemHeads);
  node_part(i, 0, heads, cpu::driver_scratch(), gaps_on_ ? &gaps : nullptr);
  gaps.finish();
  node_heads_done(i, heads);
}

template <typename qscalar_t>
void DecodeRun<qscalar_t>::sequence_first(int64_t i, int64_t next) {
  const int64_t r = item_run(i), tokens = run_rows(r), heads = item_heads(i), D = D_;
  const int32_t h0 = item_head(i);
  const int64_t g = num_chunk_items_ + i;  // in handout order
  if (run_claimed_heads(g, cpu::driver_scratch(), next))
    for (int64_t h = 0; h < heads; ++h) claims_.wait(g, h);
  const int64_t p0 = private_row(i, 0);

  // The rows' node partials: all phase-1 items were handed out before this
  // item, so at most the ones still running on other threads are waited for.
  const int32_t* partials = ctx_.row_partials;
  auto partial_field = [&](int32_t e, PlanPartialField f) {
    return plan_.partial_work[static_cast<int64_t>(partials[e]) * kPlanRowInts + f];
  };
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t b = run_row(r, t);
    for (int32_t e = ctx_.row_partial_offsets[b]; e < ctx_.row_partial_offsets[b + 1]; ++e) {
      const std::atomic<int32_t>& left = pending_[partial_field(e, kPartialNode)];
      while (left.load(std::memory_order_acquire) > 0) std::this_thread::yield();
    }
  }

  // Merge (equation 2): each node partial into the row's own part, in place;
  // then the sink, if any; normalise once.
  for (int64_t hh = 0; hh < heads; ++hh) {
    const int64_t h = h0 + hh;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t b = run_row(r, t);
      for (int64_t in_group = 0; in_group < group_; ++in_group) {
        const int64_t p = p0 + (hh * tokens + t) * group_ + in_group;
        PartialState total{private_m_[p], private_n_[p]};
        float* acc = private_o_ + p * D;
        for (int32_t e = ctx_.row_partial_offsets[b]; e < ctx_.row_partial_offsets[b + 1]; ++e) {
          for (int32_t s = 0; s < partial_field(e, kPartialPieces); ++s) {
            const int64_t slot =
                partial_field(e, kPartialFirstSlot) + static_cast<int64_t>(s) * partial_field(e, kPartialSlotStride);
            const int64_t row = h * part_rows_ + slot * group_ + in_group;
            const MergeScales scales = merge<NaturalExp>(total, PartialState{part_m_[row], part_n_[row]});
            const float* po = part_o_ + row * D;
            for (int64_t d = 0; d < D; ++d) acc[d] = combine(acc[d], po[d], scales);
          }
        }
        const int64_t q_head = h * group_ + in_group;
        const float sink_scale = variant_.sinks ? merge_sink<NaturalExp>(total, variant_.sinks[q_head]) : 1.f;
        cpu::store_row(acc, D, out_data_ + b * o_s0_ + q_head * o_s1_, sink_scale * inverse_sum(total.n));
      }
    }
  }
}

}  // namespace

void tpp_decode_plan(torch::Tensor& header, torch::Tensor& items, torch::Tensor& node_work,
                     torch::Tensor& partial_work, torch::Tensor& row_order, const torch::Tensor& block_table,
                     const torch::Tensor& seq_lens, const torch::Tensor& order, const torch::Tensor& node_begin,
                     const torch::Tensor& node_end, const torch::Tensor& node_chunk_begin,
                     const torch::Tensor& node_chunk_end, const torch::Tensor& node_partial_offset,
                     const torch::Tensor& shared_chunks, const torch::Tensor& row_partial_offsets,
                     const torch::Tensor& row_partials, int64_t num_partial_rows, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_size, int64_t block_size, at::ScalarType dtype) {
  (void)dtype;  // the CPU plan is the same for every dtype
  for (const auto* t : {&header, &items, &node_work, &partial_work, &row_order})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kInt, "chunkattn: plan tensors must be int32 on the CPU");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "chunkattn: block_table must be int32 [batch, max_blocks] with contiguous rows");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "chunkattn: num_heads must be a multiple of num_kv_heads, got ", num_heads, " over ", num_kv_heads);
  TORCH_CHECK(block_size > 0 && head_size > 0, "chunkattn: block_size and head_size must be positive");
  TORCH_CHECK(num_partial_rows >= 0, "chunkattn: num_partial_rows must be >= 0");
  const int64_t batch = order.numel();
  check_context_arrays(batch, seq_lens, order, node_begin, node_end, node_chunk_begin, node_chunk_end,
                       node_partial_offset, shared_chunks, row_partial_offsets, row_partials);
  TORCH_CHECK(block_table.size(0) >= batch, "chunkattn: block_table has ", block_table.size(0), " rows for a batch of ",
              batch);
  const TreeContextView ctx = context_view(order, node_begin, node_end, node_chunk_begin, node_chunk_end,
                                           node_partial_offset, shared_chunks, row_partial_offsets, row_partials);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  validate_context(ctx, batch, node_begin.numel(), num_partial_rows, lens, block_table.size(1), block_size);

  header.resize_({kDecodePlanHeaderInts});
  DecodePlanHeader h{};
  h.batch = static_cast<int32_t>(batch);
  h.num_nodes = static_cast<int32_t>(node_begin.numel());
  h.num_partial_rows = static_cast<int32_t>(num_partial_rows);
  h.num_heads = static_cast<int32_t>(num_heads);
  h.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  h.head_size = static_cast<int32_t>(head_size);
  h.block_size = static_cast<int32_t>(block_size);
  h.table_width = static_cast<int32_t>(block_table.size(1));
  h.num_threads = static_cast<int32_t>(at::get_num_threads());
  plan_cpu(h, items, node_work, partial_work, row_order, ctx, lens, block_table.data_ptr<int32_t>(),
           block_table.stride(0));
  std::memcpy(header.data_ptr<int32_t>(), &h, sizeof(h));
}

void tpp_decode(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& kv_cache,
                const torch::Tensor& block_table, const torch::Tensor& seq_lens, const torch::Tensor& order,
                const torch::Tensor& node_begin, const torch::Tensor& node_end, const torch::Tensor& node_chunk_begin,
                const torch::Tensor& node_chunk_end, const torch::Tensor& node_partial_offset,
                const torch::Tensor& shared_chunks, const torch::Tensor& row_partial_offsets,
                const torch::Tensor& row_partials, const torch::Tensor& plan_header, const torch::Tensor& plan_items,
                const torch::Tensor& plan_node_work, const torch::Tensor& plan_partial_work,
                const torch::Tensor& plan_row_order, double scale, int64_t sliding_window,
                double logits_soft_cap, const std::optional<torch::Tensor>& sinks,
                const std::optional<torch::Tensor>& alibi_slopes) {
  cpu::check_query_out_cache(out, query, kv_cache, "batch");

  // O(1) checks of this layer's tensors against the plan, which validated
  // the context's values when it was built.
  TORCH_CHECK(plan_header.device().is_cpu() && plan_header.scalar_type() == at::kInt && plan_header.is_contiguous() &&
                  plan_header.numel() == kDecodePlanHeaderInts,
              "chunkattn: plan header must be ", kDecodePlanHeaderInts, " int32 on the CPU (made by tpp_decode_plan)");
  DecodePlanHeader h;
  std::memcpy(&h, plan_header.data_ptr<int32_t>(), sizeof(h));
  const int64_t batch = query.size(0);
  TORCH_CHECK(h.batch == batch && h.num_heads == query.size(1) && h.head_size == query.size(2) &&
                  h.num_kv_heads == kv_cache.size(1) && h.block_size == kv_cache.size(2),
              "chunkattn: decode plan built for ", h.batch, " rows x ", h.num_heads, " heads of ", h.head_size, " over ",
              h.num_kv_heads, " KV heads, block size ", h.block_size, "; this layer has ", batch, " rows x ",
              query.size(1), " heads of ", query.size(2), " over ", kv_cache.size(1), " KV heads, block size ",
              kv_cache.size(2));
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.stride(1) == 1 &&
                  block_table.size(0) >= batch && block_table.size(1) >= h.table_width,
              "chunkattn: block_table must be int32 [batch, max_blocks] with contiguous rows and at least the ",
              h.table_width, " columns the plan was built for");
  check_context_arrays(batch, seq_lens, order, node_begin, node_end, node_chunk_begin, node_chunk_end,
                       node_partial_offset, shared_chunks, row_partial_offsets, row_partials);
  TORCH_CHECK(node_begin.numel() == h.num_nodes, "chunkattn: the plan was built for ", h.num_nodes,
              " tree nodes, the context has ", node_begin.numel());
  for (const auto* t : {&plan_items, &plan_node_work, &plan_partial_work})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kInt && t->is_contiguous() && t->dim() == 2 &&
                    t->size(1) == kPlanRowInts,
                "chunkattn: plan items/node_work/partial_work must be contiguous int32 [n, ", kPlanRowInts, "]");
  cpu::check_int32_vector(plan_row_order, "plan row_order");
  TORCH_CHECK(plan_items.size(0) == static_cast<int64_t>(h.num_items) + 1 && plan_node_work.size(0) == h.num_nodes &&
                  plan_partial_work.size(0) == h.num_partial_rows && plan_row_order.numel() > batch &&
                  h.num_slots >= 0 && h.heads_per_item >= 1 && h.heads_per_item <= h.num_kv_heads,
              "chunkattn: plan tensors do not match the plan header (not a CPU plan from tpp_decode_plan?)");
  if (batch == 0) return;
  const TreeContextView ctx = context_view(order, node_begin, node_end, node_chunk_begin, node_chunk_end,
                                           node_partial_offset, shared_chunks, row_partial_offsets, row_partials);
  const int32_t* row_order = plan_row_order.data_ptr<int32_t>();
  const int64_t num_runs = plan_row_order.numel() - batch - 1;
  TORCH_CHECK(row_order[batch] == 0 && row_order[batch + num_runs] == batch,
              "chunkattn: the plan's row runs do not cover its ", batch, " rows");
  const DecodePlanView plan{h, plan_items.data_ptr<int32_t>(), plan_node_work.data_ptr<int32_t>(),
                            plan_partial_work.data_ptr<int32_t>(), row_order, row_order + batch, num_runs};
  const AttentionVariant variant =
      attention_variant(scale, sliding_window, logits_soft_cap, sinks, alibi_slopes, query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "chunkattn_tpp_decode", [&] {
    DecodeRun<scalar_t>(out, query, kv_cache, block_table, seq_lens, ctx, plan, variant).run();
  });
}

}  // namespace chunkattn
