"""The builder's steps as the engine runs them (prefix/step.py), checked
against the oracle: decode, then rows of several tokens, then decode again,
through one StepPlanner (with the fixed device buffers on CUDA), on any
device the compiled kernels run on. Called by the CPU unit tests and the GPU tests."""

from __future__ import annotations

import numpy as np
import torch

from vllm_chunkattn.kernels import ops
from vllm_chunkattn.prefix.device_buffers import DeviceTreeBuffers
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.prefix.step import StepPlanner
from vllm_chunkattn.testing import reference
from vllm_chunkattn.testing.paged_cases import multi_level, num_blocks_needed, random_kv_cache


def check_planner_steps(device: str, dtype: torch.dtype, group: int, max_query_len: int, tol: float,
                        own_node_min_query_len: int = 2, batch: int = 12, block_size: int = 16,
                        head_size: int = 128, num_kv_heads: int = 2) -> None:
    """Three steps over a two-level tree (a 64-token root, 3 branches of 48,
    40 private tokens each): one row per request (the graph-safe buffers),
    requests of 0 to `max_query_len` new tokens (a context sized to the step;
    the rows of all requests under a node stacked in it), and one row per
    request again, on the same fixed buffers as the first. A request's own
    node is kept exactly when it has at least `own_node_min_query_len` new
    tokens."""
    rng = np.random.default_rng(7)
    gen = torch.Generator().manual_seed(7)
    table, seq_lens = multi_level(batch, levels=[(1, 64), (3, 48)], private=40, block_size=block_size)
    assert max_query_len <= 40 - block_size  # the new tokens stay out of the shared chunks
    kv = random_kv_cache(num_blocks_needed(table), num_kv_heads, block_size, head_size, dtype, generator=gen)
    shape = DecodeShape(num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_size=head_size,
                        block_size=block_size, dtype=dtype)
    # As the builder: device buffers for the CUDA kernels, the host context for the CPU ones.
    on_cuda = torch.device(device).type == "cuda"
    buffers = DeviceTreeBuffers(batch, batch - 1, 4 * batch, device) if on_cuda else None
    planner = StepPlanner(shape, buffers, own_node_min_query_len)
    dev_table, dev_kv = table.to(device), kv.to(device)
    scale = head_size**-0.5

    def run(query_lens: torch.Tensor | None):
        step = planner.plan(dev_table, seq_lens.to(device), seq_lens, query_lens)
        rows = step.plan.batch
        query = torch.randn(rows, shape.num_heads, head_size, generator=gen).to(dtype)
        out = torch.empty_like(query, device=device)
        ops.tpp_decode(query.to(device), dev_kv, step.plan, scale, out)
        qlens = torch.ones(batch, dtype=torch.int32) if query_lens is None else query_lens
        qsl = torch.cat([torch.zeros(1, dtype=torch.int32), qlens.cumsum(0).to(torch.int32)])
        expected = reference.paged_attention(query, kv, qsl, seq_lens, table, scale)
        torch.testing.assert_close(out.float().cpu(), expected.float(), atol=tol, rtol=tol)
        return step

    first = run(None)
    assert first.multi_token_rows == 0 and first.tree.num_nodes > 0
    if on_cuda:  # the fixed plan buffers a CUDA graph replays
        assert first.plan.work is planner.device_work and first.plan.context.order.data_ptr() == buffers.buffer.data_ptr()
    query_lens = torch.tensor(rng.integers(0, max_query_len + 1, batch), dtype=torch.int32)
    query_lens[:3] = max_query_len
    rows = run(query_lens)
    assert rows.multi_token_rows == int(query_lens[query_lens > 1].sum()) > 0
    assert rows.plan.batch == int(query_lens.sum())
    if on_cuda:  # sized to the step, the fixed buffers untouched
        assert rows.plan.work is not planner.device_work and buffers.copies == 1
    # Sharing happened: the root is attended by the stacked rows of every request.
    root = int((rows.tree.node_chunk_begin == 0).nonzero()[0])
    assert int(rows.tree.node_end[root] - rows.tree.node_begin[root]) == rows.plan.batch
    # Own nodes (every private context here is 2 full chunks + the new tokens' chunk) where the rule keeps them.
    request = torch.repeat_interleave(torch.arange(batch), query_lens.long())[rows.tree.order.long()]
    own = {int(request[b]) for b, e in zip(rows.tree.node_begin.tolist(), rows.tree.node_end.tolist())
           if int(request[b]) == int(request[e - 1]) and e - b == int(query_lens[request[b]])}
    assert own == {r for r in range(batch) if int(query_lens[r]) >= max(own_node_min_query_len, 2)}
    last = run(None)
    if on_cuda:
        assert last.plan.work is planner.device_work
        assert last.plan.work.items.data_ptr() == first.plan.work.items.data_ptr()
