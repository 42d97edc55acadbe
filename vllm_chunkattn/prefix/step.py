"""One step's prefix tree and plan from its tree requests: the metadata
builder's core (backend/builder.py), without vLLM, so that the GPU tests run
it as the engine does.

Each query token of a tree request is one row (prefix/query_rows.py). The
tree is derived on the host from the rows' block tables and the lengths every
row sees unmasked (prefix/tree.py, cached across steps), then planned once
for every layer (prefix/plan.py). On CUDA there are two kinds of step:

- one row per request (decodes): the context goes into fixed-capacity device
  buffers and the plan into fixed plan buffers (prefix/device_buffers.py,
  DecodeWork), so that vLLM can replay the step in a full CUDA graph;
- rows of several tokens (speculative decodes, short suffixes): the context
  and plan are sized to the step's tree. vLLM never replays such a step in a
  full graph: the backend declares UNIFORM_SINGLE_TOKEN_DECODE, and with
  speculative decoding vLLM captures attention piecewise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from vllm_chunkattn.kernels import ops
from vllm_chunkattn.prefix.device_buffers import DeviceTreeBuffers
from vllm_chunkattn.prefix.plan import DecodePlan, DecodeShape, DecodeWork
from vllm_chunkattn.prefix.query_rows import TreeRows, expand_query_rows, unstack_own_nodes
from vllm_chunkattn.prefix.tree import PrefixTreeCache, PrefixTreeContext


@dataclass(frozen=True)
class PlannedStep:
    plan: DecodePlan
    tree: PrefixTreeContext  # on the host, as planned (before any cut to the device buffers' capacity)
    host_seq_lens: torch.Tensor  # [rows] keys each row attends
    multi_token_rows: int  # rows of requests with several new tokens
    plan_seconds: float  # tree + plan, the block table's copy to the host excluded


class StepPlanner:
    def __init__(self, shape: DecodeShape, device_tree: DeviceTreeBuffers | None = None,
                 own_node_min_query_len: int = 2) -> None:
        """own_node_min_query_len: the platform's (kernels/support.py): the
        fewest new tokens for which a request's own rows stay stacked."""
        self.shape = shape
        self.device_tree = device_tree
        self.own_node_min_query_len = own_node_min_query_len
        self.device_work = DecodeWork.empty(device_tree.device) if device_tree is not None else None
        self.tree_cache = PrefixTreeCache()

    def plan(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        host_seq_lens: torch.Tensor,
        query_lens: torch.Tensor | None = None,
    ) -> PlannedStep:
        """The step of the tree requests with `block_table` [requests, max_blocks]
        and `seq_lens` [requests] on the kernels' device, `host_seq_lens` their
        host copy (exact where `query_lens` is given), `query_lens` [requests]
        on the host: new tokens per request, None when every request has one
        (seq_lens may then hold padding requests of length 0 on CUDA)."""
        if query_lens is None:
            rows = TreeRows(block_table, seq_lens, seq_lens)
            host_rows = TreeRows(block_table, host_seq_lens, host_seq_lens)
            multi_token_rows = 0
        else:
            rows = host_rows = expand_query_rows(block_table, host_seq_lens, query_lens)
            multi_token_rows = int(query_lens[query_lens > 1].sum())
        if rows.block_table.device.type == "cpu":
            host_table = rows.block_table
        else:
            # The tree needs the block ids on the host, and vLLM keeps its host
            # copy of the block table (the runner's BlockTable) out of the
            # builder's reach: CommonAttentionMetadata carries only the device
            # tensor. So this is the step's one device-to-host copy, cut to the
            # columns of full chunks, the only ones the tree reads.
            full_chunks = int(host_rows.unmasked_lens.max()) // self.shape.block_size
            host_table = rows.block_table[:, :full_chunks].cpu()
        start = time.perf_counter()
        tree = self.tree_cache.get(host_table, host_rows.unmasked_lens, self.shape.block_size)
        if query_lens is not None:
            tree = unstack_own_nodes(tree, query_lens, self.own_node_min_query_len)
        if self.device_tree is not None and not multi_token_rows:
            # The tree copied into the fixed buffers only when it changed; the
            # plan kernel writes the fixed DecodeWork.
            context = self.device_tree.load(tree, len(host_rows.seq_lens))
            plan = ops.plan_tpp_decode(self.shape, rows.block_table, rows.seq_lens, context, self.device_work)
        else:
            # A host context: the op copies it to a CUDA block table's device.
            plan = ops.plan_tpp_decode(self.shape, rows.block_table, rows.seq_lens, tree)
        return PlannedStep(plan=plan, tree=tree, host_seq_lens=host_rows.seq_lens, multi_token_rows=multi_token_rows,
                           plan_seconds=time.perf_counter() - start)
