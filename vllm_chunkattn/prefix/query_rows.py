"""The step's tree rows: each query token of the requests that take the tree path is one row.

The two-phase partition (ChunkAttention section 3.2) attends rows of one
query token each. A request with q new tokens after c computed ones (a
decode: q = 1; a speculative decode: 1 + k; a short suffix after a prefix-
cache hit: RelayAttention's prompt phase) becomes q rows, row t for the
token at position c + t:

- the row attends keys [0, c + t], its causal extent: seq_len = c + t + 1;
- every row of the request sees the chunks that lie wholly in [0, c + 1)
  without a mask, so the tree is keyed on those (unmasked_len = c + 1).
  All rows of a request then have the same key: they sit in the same nodes
  (a request's own rows form a node over its private context too), and a
  node's chunks are visible, unmasked, to every row it covers;
- the rest of a row's extent (the partial chunk at c and the new tokens up
  to its own) is the row's private tail, attended in the sequence-first
  phase, which reads only up to seq_len: that is the causal mask.

A request's own node (its rows stacked over its private chunks) pays only
with enough rows; with few, `unstack_own_nodes` leaves those chunks to the
sequence-first phase (the platform's `own_node_min_query_len`).

A block another request of the same step is computing (vLLM registers a
block in the prefix cache when it is scheduled) is context for a request
that hit it and not for the one computing it: it lies wholly before the
first token of the first only, so only the first is keyed on it. The KV of
all new tokens is written before any layer's attention runs, so the hit
request reads it complete.

For a decode row (q = 1) seq_len = unmasked_len = the request's seq_len:
the decode batch of ChunkAttention, unchanged (the builder makes those rows
without expanding anything when every tree request has one token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_chunkattn.prefix.tree import PrefixTreeContext, context_from_nodes


@dataclass(frozen=True)
class TreeRows:
    """One row per query token, in query order. int32 tensors on the block table's device
    (seq_lens, unmasked_lens on the host when the block table is)."""

    block_table: torch.Tensor  # [rows, max_blocks]: the row's request's
    seq_lens: torch.Tensor  # [rows]: keys the row attends, c + t + 1
    unmasked_lens: torch.Tensor  # [rows]: keys every row of its request sees unmasked, c + 1


def expand_query_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, query_lens: torch.Tensor) -> TreeRows:
    """Rows for requests with `query_lens` new tokens each (0 allowed: no row)
    ending their `seq_lens` (the new tokens included)."""
    query_lens = query_lens.to(torch.int64)
    seq_lens = seq_lens.to(torch.int64)
    if bool((query_lens > seq_lens).any()):
        raise ValueError(f"a request has more new tokens than its sequence length: query_lens "
                         f"{query_lens.tolist()}, seq_lens {seq_lens.tolist()}")
    request = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens)
    first_row = torch.cumsum(query_lens, 0) - query_lens
    token = torch.arange(len(request)) - first_row[request]
    computed = (seq_lens - query_lens)[request]
    return TreeRows(
        block_table=block_table[request.to(block_table.device)],
        seq_lens=(computed + token + 1).to(torch.int32),
        unmasked_lens=(computed + 1).to(torch.int32),
    )


def unstack_own_nodes(ctx: PrefixTreeContext, query_lens: torch.Tensor, min_query_len: int) -> PrefixTreeContext:
    """`ctx` without the nodes whose rows all belong to one request with fewer
    than `min_query_len` new tokens: the chunks of such a node are then
    attended row by row in the sequence-first phase (results unchanged). A
    node covering several requests is kept, and with it its ancestors, which
    cover at least those requests. `ctx` itself when nothing is dropped (always
    for min_query_len <= 2: a node covers at least two rows)."""
    if min_query_len <= 2 or ctx.num_nodes == 0:
        return ctx
    request = np.repeat(np.arange(len(query_lens)), query_lens.numpy())[ctx.order.numpy()]  # per tree position
    # The lowest and highest request under each node: reduceat over [begin, end)
    # (every other bound pair is the gap between nodes; the pad keeps the last
    # bound inside the array).
    bounds = np.stack([ctx.node_begin.numpy(), ctx.node_end.numpy()], axis=1).ravel()
    padded = np.append(request, 0)
    lowest = np.minimum.reduceat(padded, bounds)[::2]
    highest = np.maximum.reduceat(padded, bounds)[::2]
    dropped = (lowest == highest) & (query_lens.numpy()[lowest] < min_query_len)
    if not dropped.any():
        return ctx
    nodes = torch.stack([ctx.node_begin, ctx.node_end, ctx.node_chunk_begin, ctx.node_chunk_end], dim=1).numpy()
    return context_from_nodes(ctx.order.numpy(), nodes[~dropped].tolist(), int(ctx.order.numel()))
