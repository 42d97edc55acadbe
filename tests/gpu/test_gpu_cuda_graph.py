"""The decode path under CUDA-graph capture and replay: KV write + TPP decode
captured once, then replayed for batches whose prefix trees, block tables,
lengths and queries all differ from the capture, refreshed only by in-place
copies into the same buffers and the step's plan kernel writing into the same
plan buffers, outside the graph (as the backend's builder does)."""

from __future__ import annotations

import numpy as np
import torch
from gpu_helpers import TOL, requires_gpu

from vllm_chunkattn.kernels import ops
from vllm_chunkattn.testing import reference
from vllm_chunkattn.prefix.device_buffers import DeviceTreeBuffers
from vllm_chunkattn.testing.paged_cases import multi_level, random_forest, shared_prefix
from vllm_chunkattn.prefix.plan import DecodeShape, DecodeWork
from vllm_chunkattn.prefix.tree import prefix_tree

pytestmark = requires_gpu


def test_decode_graph_replays_new_trees():
    torch.manual_seed(0)
    batch, kv_heads, group, head_size, block_size, width = 16, 2, 4, 128, 16, 64
    dtype = torch.bfloat16
    num_blocks = 2048
    kv = torch.randn(num_blocks, kv_heads, block_size, 2 * head_size, device="cuda").to(dtype)
    # persistent inputs, as vLLM keeps them
    query = torch.zeros(batch, kv_heads * group, head_size, device="cuda", dtype=dtype)
    key = torch.zeros(batch, kv_heads, head_size, device="cuda", dtype=dtype)
    value = torch.zeros_like(key)
    slots = torch.full((batch,), -1, dtype=torch.int64, device="cuda")
    table = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    out = torch.zeros_like(query)
    tree = DeviceTreeBuffers(max_batch=batch, max_nodes=batch - 1, max_partial_rows=4 * batch, device="cuda")
    work = DecodeWork.empty("cuda")
    shape = DecodeShape.of_layer(query, kv)

    def stage(host_table, host_lens, seed):
        """Host-side refresh before a replay: in-place copies only."""
        gen = torch.Generator().manual_seed(seed)
        rows = host_table.shape[0]
        host_table = torch.cat([host_table, torch.zeros(batch - rows, host_table.shape[1], dtype=torch.int32)])
        host_lens = torch.cat([host_lens, torch.zeros(batch - rows, dtype=torch.int32)])
        table.zero_()
        table[:, : host_table.shape[1]].copy_(host_table)
        seq_lens.copy_(host_lens)
        query.copy_(torch.randn(query.shape, generator=gen).to(dtype))
        key.copy_(torch.randn(key.shape, generator=gen).to(dtype))
        value.copy_(torch.randn(value.shape, generator=gen).to(dtype))
        last = host_lens.long() - 1  # the new token's slot: last position of each request
        host_slots = host_table.long().gather(1, (last.clamp(min=0) // block_size)[:, None])[:, 0] * block_size + (
            last.clamp(min=0) % block_size
        )
        slots.copy_(torch.where(host_lens > 0, host_slots, -1))
        ctx = tree.load(prefix_tree(host_table, host_lens, block_size), batch)
        plan = ops.plan_tpp_decode(shape, table, seq_lens, ctx, work)
        return host_table, host_lens, plan

    def step(plan):
        ops.write_kv_cache(key, value, kv, slots)
        ops.tpp_decode(query, kv, plan, 0.0884, out)

    rng = np.random.default_rng(1)
    t0, l0 = random_forest(rng, batch, block_size, max_shared_blocks=8, max_private_blocks=8)
    _, _, captured = stage(t0, l0, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (kernel attributes, allocator)
        step(captured)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(captured)

    cases = [
        random_forest(np.random.default_rng(2), batch, block_size, max_shared_blocks=10, max_private_blocks=3),
        shared_prefix(batch=batch, context=700, shared=512, block_size=block_size, first_block=1),
        multi_level(batch=12, levels=[(1, 128), (3, 64)], private=50, block_size=block_size),  # + 4 padding rows
        shared_prefix(batch=9, context=300, shared=0, block_size=block_size),  # no sharing at all
    ]
    for seed, (host_table, host_lens) in enumerate(cases, start=10):
        assert host_table.shape[1] <= width and int(host_table.max()) < num_blocks
        host_table, host_lens, plan = stage(host_table, host_lens, seed)
        assert plan.context.order.data_ptr() == captured.context.order.data_ptr()  # same buffers as captured
        assert plan.work.items.data_ptr() == captured.work.items.data_ptr()
        graph.replay()
        torch.cuda.synchronize()
        rows = int((host_lens > 0).sum())
        expected = reference.paged_attention(
            query[:rows].cpu(), kv.cpu(), torch.arange(rows + 1), host_lens[:rows], host_table[:rows], 0.0884
        )
        got = out[:rows].float().cpu()
        torch.testing.assert_close(got, expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
        assert int(out[rows:].abs().sum()) == 0
    assert tree.copies == 1 + len(cases)
