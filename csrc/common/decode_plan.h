// The work plan of one decode step: built once per step by the
// tpp_decode_plan op (the metadata builder calls it), run by every layer's
// tpp_decode, which keeps only O(1) checks of its arguments against it.
// Plain C++ (no torch): the CPU op, the CUDA torch wrappers and the CUDA
// kernels all read it.
//
// A plan is five int32 tensors (vllm_chunkattn/prefix/plan.py, DecodeWork):
//   header        [kDecodePlanHeaderInts] on the host: DecodePlanHeader below.
//   items         [num_items + 1, 4] chunk-first work list, ended by a row
//                 whose node is -1 (kNoNode). CPU: (node, first kv head, split,
//                 kv heads), costliest first: a node too small to pay for an
//                 item per head takes several heads per item. CUDA: (node, row tile, piece, 0), every KV
//                 head of an item run by one block; the list has a fixed
//                 capacity (shapes only), so the end row moves, not the size.
//   node_work     [num_nodes, 4] per node: (first slot, pieces, piece size,
//                 CPU: kv heads per item; CUDA: 0):
//                 the node's chunks are cut into `pieces` pieces of `piece size`
//                 (CPU: chunks; CUDA: KV tiles); each piece writes the node's
//                 rows' partials at slots first + piece * rows + row.
//   partial_work  [num_partial_rows, 4] per partial row of the context: (first
//                 slot, slot stride, pieces, node): the slots of its pieces'
//                 partials are first + j * stride for j < pieces.
//   row_order     CPU [batch + num_runs + 1]: the batch rows in runs (a request's
//                 query tokens, attended as one query matrix in the sequence-first
//                 phase; a decode row is a run of one), runs with the most private
//                 tokens first, then the runs' offsets into the rows (0 .. batch).
//                 CUDA: empty (one block per (split, row, head)).
#pragma once

#include <cstdint>

namespace chunkattn {

constexpr int32_t kNoNode = -1;
constexpr int kPlanRowInts = 4;  // ints per row of items / node_work / partial_work

// Fields of the rows above (index within a row).
enum PlanItemField : int { kItemNode = 0, kItemHeadOrTile = 1, kItemPiece = 2, kItemHeads = 3 /* CPU */ };
enum PlanNodeField : int { kNodeFirstSlot = 0, kNodePieces = 1, kNodePieceSize = 2, kNodeHeadsPerItem = 3 /* CPU */ };
enum PlanPartialField : int { kPartialFirstSlot = 0, kPartialSlotStride = 1, kPartialPieces = 2, kPartialNode = 3 };

// The shapes a plan was built for, and the sizes its run needs. int32 fields
// only, so that the header tensor's data is this struct.
struct DecodePlanHeader {
  int32_t batch;             // decode rows
  int32_t num_nodes;         // tree nodes (CUDA: the context buffers' capacity)
  int32_t num_partial_rows;  // partial rows of the context (CUDA: capacity)
  int32_t num_heads;         // query heads
  int32_t num_kv_heads;
  int32_t head_size;
  int32_t block_size;
  int32_t table_width;     // block-table columns the context was checked against (CPU; CUDA 0)
  int32_t num_items;       // chunk-first items (CUDA: the list's capacity)
  int32_t num_slots;       // partial slots per KV head (CUDA: capacity)
  int32_t heads_per_item;  // CPU: KV heads per sequence-first item; CUDA 0
  int32_t num_threads;     // CPU: intra-op threads the plan balances its items over (a run on
                           // another count stays exact, only less balanced); CUDA 0
};
constexpr int kDecodePlanHeaderInts = sizeof(DecodePlanHeader) / sizeof(int32_t);
static_assert(sizeof(DecodePlanHeader) == kDecodePlanHeaderInts * sizeof(int32_t));

}  // namespace chunkattn
