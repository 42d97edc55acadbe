"""The decode step's plan (prefix/plan.py, csrc/common/decode_plan.h, the CPU
tpp_decode_plan op): what it contains, what it refuses when it is built, and
that a layer of another shape refuses it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vllm_chunkattn.kernels import ops, torch_fallback
from vllm_chunkattn.prefix.plan import DecodePlan, DecodeShape
from vllm_chunkattn.prefix.query_rows import expand_query_rows
from vllm_chunkattn.prefix.tree import PrefixTreeContext, prefix_tree
from vllm_chunkattn.testing.paged_cases import multi_level, random_forest, shared_prefix
from vllm_chunkattn.kernels.support import CPU, CUDA
from vllm_chunkattn.testing.step_cases import check_planner_steps

NO_NODE = -1


@pytest.fixture
def threads():
    """Set torch's intra-op thread count for a test (the plan balances over it)."""
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


def _shape(num_kv_heads=2, group=2, head_size=64, block_size=16, dtype=torch.float32) -> DecodeShape:
    return DecodeShape(num_heads=num_kv_heads * group, num_kv_heads=num_kv_heads, head_size=head_size,
                       block_size=block_size, dtype=dtype)


def _plan(table, seq_lens, shape, ctx=None) -> DecodePlan:
    ctx = prefix_tree(table, seq_lens, shape.block_size) if ctx is None else ctx
    plan = ops.plan_tpp_decode(shape, table, seq_lens, ctx)
    assert plan.work is not None, "the CPU build has the plan op"
    return plan


def _trees():
    yield random_forest(np.random.default_rng(0), 12, 16)
    yield random_forest(np.random.default_rng(1), 20, 16, max_shared_blocks=8)
    yield multi_level(batch=24, levels=[(1, 128), (3, 64), (2, 32)], private=20, block_size=16)
    yield shared_prefix(batch=6, context=600, shared=512, block_size=16)


@pytest.mark.parametrize("num_threads", [1, 2, 4])
@pytest.mark.parametrize("tree_index", range(4))
def test_items_cover_every_node_head_and_split_once(threads, num_threads, tree_index):
    threads(num_threads)
    table, seq_lens = list(_trees())[tree_index]
    shape = _shape(num_kv_heads=3)
    plan = _plan(table, seq_lens, shape)
    ctx, work = plan.context, plan.work
    assert ctx.num_nodes > 0
    items = work.items.tolist()
    assert items[-1][0] == NO_NODE, "the list ends with an end row"
    items = items[:-1]
    assert len(items) == work.num_items
    # An item covers KV heads [head, head + heads): one for a split node, several for a small one.
    seen = [(node, h, split) for node, head, split, heads in items for h in range(head, head + heads)]
    assert len(seen) == len(set(seen)), "a (node, head, split) appears in two items"
    for node, head, split, heads in items:
        per_item = int(work.node_work[node, 3])
        assert 1 <= heads <= per_item and head % per_item == 0
        assert per_item == 1 or int(work.node_work[node, 1]) == 1
    expected = {
        (k, h, s)
        for k in range(ctx.num_nodes)
        for h in range(shape.num_kv_heads)
        for s in range(int(work.node_work[k, 1]))
    }
    assert set(seen) == expected


def test_small_nodes_take_several_kv_heads_per_item(threads):
    """32 requests with 4 new tokens each on a 2048-token prefix: each request's
    own 4 rows form a node over its private chunk, too small for an item per
    KV head; the prefix node is an item per head (and split)."""
    from vllm_chunkattn.prefix.query_rows import expand_query_rows

    threads(2)
    table, seq_lens = shared_prefix(batch=32, context=2048 + 64 + 4, shared=2048, block_size=64)
    rows = expand_query_rows(table, seq_lens, torch.full((32,), 4))
    ctx = prefix_tree(rows.block_table, rows.unmasked_lens, 64)
    shape = _shape(num_kv_heads=8, group=1, head_size=128, block_size=64)
    plan = ops.plan_tpp_decode(shape, rows.block_table, rows.seq_lens, ctx)
    covered = (ctx.node_end - ctx.node_begin).tolist()
    node_work = plan.work.node_work.tolist()
    big = covered.index(128)
    assert node_work[big][3] == 1
    assert all(node_work[k][3] == 8 for k in range(ctx.num_nodes) if covered[k] == 4)
    assert plan.work.num_items == node_work[big][1] * 8 + 32


@pytest.mark.parametrize("num_threads", [1, 2, 8])
def test_splits_cover_each_nodes_chunks(threads, num_threads):
    threads(num_threads)
    table, seq_lens = multi_level(batch=24, levels=[(1, 256), (3, 64)], private=20, block_size=16)
    plan = _plan(table, seq_lens, _shape())
    ctx = plan.context
    for k, (first_slot, pieces, piece_chunks, _) in enumerate(plan.work.node_work.tolist()):
        chunks = int(ctx.node_chunk_end[k] - ctx.node_chunk_begin[k])
        assert pieces >= 1 and piece_chunks >= 1
        assert (pieces - 1) * piece_chunks < chunks <= pieces * piece_chunks, "no empty split, no chunk left out"
    if num_threads == 1:
        assert (plan.work.node_work[:, 1] == 1).all(), "one thread: nothing to balance, no node is split"
    else:
        assert int(plan.work.node_work[0, 1]) > 1, "the 256-token root is split over the threads"


def test_partial_rows_point_at_their_nodes_slots(threads):
    threads(4)
    table, seq_lens = multi_level(batch=24, levels=[(1, 256), (3, 64)], private=20, block_size=16)
    plan = _plan(table, seq_lens, _shape())
    ctx, work = plan.context, plan.work
    slots = []
    for k in range(ctx.num_nodes):
        first, pieces, _, _ = work.node_work[k].tolist()
        rows = int(ctx.node_end[k] - ctx.node_begin[k])
        for t in range(rows):
            p = int(ctx.node_partial_offset[k]) + t
            assert work.partial_work[p].tolist() == [first + t, rows, pieces, k]
            slots += [first + t + s * rows for s in range(pieces)]
    assert sorted(slots) == list(range(len(slots))), "slots are disjoint and leave no gap"


def _runs(plan, batch: int) -> list[list[int]]:
    """The plan's sequence-first runs, each as its batch rows (decode_plan.h: row_order)."""
    row_order = plan.work.row_order.tolist()
    rows, offsets = row_order[:batch], row_order[batch:]
    assert offsets[0] == 0 and offsets[-1] == batch and offsets == sorted(offsets)
    return [rows[a:b] for a, b in zip(offsets, offsets[1:])]


def test_row_order_puts_the_most_private_tokens_first():
    table, seq_lens = random_forest(np.random.default_rng(3), 16, 16, max_private_blocks=6)
    plan = _plan(table, seq_lens, _shape())
    runs = _runs(plan, 16)
    assert all(len(run) == 1 for run in runs), "decode rows of distinct requests run alone"
    order = [run[0] for run in runs]
    assert sorted(order) == list(range(16))
    private = (seq_lens - plan.context.shared_chunks * 16).tolist()
    assert [private[b] for b in order] == sorted(private, reverse=True)


def test_a_requests_query_tokens_are_one_sequence_first_run():
    """Rows of several tokens (prefix/query_rows.py) over a shared prefix: each request's rows are one run,
    in token order, runs with the most private tokens first; a decode row runs alone, and so does a token
    with no private key (its computed context ends on a chunk boundary: every key of it is in nodes)."""
    block_size = 16
    table, seq_lens = shared_prefix(batch=4, context=100, shared=64, block_size=block_size)
    seq_lens = seq_lens.clone()
    seq_lens[3] = 99  # 4 new tokens after 95 computed: its first row ends on the 6th chunk's last key
    query_lens = torch.tensor([6, 1, 3, 4])  # the second request a decode
    rows = expand_query_rows(table, seq_lens, query_lens)
    ctx = prefix_tree(rows.block_table, rows.unmasked_lens, block_size)
    plan = _plan(rows.block_table, rows.seq_lens, _shape(block_size=block_size), ctx)
    private = (rows.seq_lens - ctx.shared_chunks * block_size).tolist()
    assert private == [15, 16, 17, 18, 19, 20, 36, 2, 3, 4, 0, 1, 2, 3]
    assert _runs(plan, len(private)) == [[6], [0, 1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13], [10]]


def _context_with(ctx: PrefixTreeContext, **changes) -> PrefixTreeContext:
    return dataclasses.replace(ctx, **{k: torch.tensor(v, dtype=torch.int32) for k, v in changes.items()})


def test_bad_contexts_are_refused_when_the_plan_is_built():
    table, seq_lens = shared_prefix(batch=4, context=100, shared=64, block_size=16)
    shape = _shape()
    ctx = prefix_tree(table, seq_lens, 16)
    assert ctx.num_nodes == 1 and int(ctx.node_chunk_end[0]) == 4
    bad = {
        "chunk range": _context_with(ctx, node_chunk_end=[table.shape[1] + 1]),
        "covers tree positions": _context_with(ctx, node_end=[5]),
        "order out of range": _context_with(ctx, order=[0, 1, 2, 7]),
        "row_partials out of range": _context_with(ctx, row_partials=[0, 1, 2, 9]),
    }
    for message, context in bad.items():
        with pytest.raises(RuntimeError, match=message):
            ops.plan_tpp_decode(shape, table, seq_lens, context)
    short = seq_lens.clone()
    short[2] = 40  # fewer tokens than its 4 shared chunks hold
    with pytest.raises(RuntimeError, match="row 2 has seq_len 40 with 4 shared chunks"):
        ops.plan_tpp_decode(shape, table, short, ctx)


def test_one_plan_runs_every_layer_of_its_shape():
    table, seq_lens = multi_level(batch=10, levels=[(1, 64), (2, 32)], private=20, block_size=16)
    shape = _shape(num_kv_heads=2, group=4, head_size=64)
    plan = _plan(table, seq_lens, shape)
    gen = torch.Generator().manual_seed(0)
    num_blocks = int(table.max()) + 1
    for layer in range(3):
        kv = torch.randn(num_blocks, 2, 16, 128, generator=gen)
        query = torch.randn(10, 8, 64, generator=gen)
        out = ops.tpp_decode(query, kv, plan, 0.125, torch.empty_like(query))
        expected = torch_fallback.tpp_decode(query, kv, table, seq_lens, plan.context, 0.125)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4, msg=f"layer {layer}")


@pytest.mark.parametrize(
    "layer_change",
    [dict(num_kv_heads=4, group=1), dict(group=1), dict(head_size=128), dict(block_size=32)],
    ids=["kv heads", "group", "head size", "block size"],
)
def test_a_layer_of_another_shape_refuses_the_plan(layer_change):
    table, seq_lens = shared_prefix(batch=4, context=100, shared=64, block_size=16)
    plan = _plan(table, seq_lens, _shape(num_kv_heads=2, group=2, head_size=64, block_size=16))
    layer = {**dict(num_kv_heads=2, group=2, head_size=64, block_size=16), **layer_change}
    query = torch.randn(4, layer["num_kv_heads"] * layer["group"], layer["head_size"])
    kv = torch.randn(int(table.max()) + 1, layer["num_kv_heads"], layer["block_size"], 2 * layer["head_size"])
    with pytest.raises(ValueError, match="decode plan built for 4 requests x 4 query heads over 2 KV heads"):
        ops.tpp_decode(query, kv, plan, 0.1, torch.empty_like(query))
    # The compiled op checks the plan's header too, for callers that bypass ops.py.
    work, ctx = plan.work, plan.context
    with pytest.raises(RuntimeError, match="decode plan built for 4 rows x 4 heads of 64 over 2 KV heads"):
        torch.ops.chunkattn.tpp_decode(
            torch.empty_like(query), query, kv, table, seq_lens, ctx.order, ctx.node_begin, ctx.node_end,
            ctx.node_chunk_begin, ctx.node_chunk_end, ctx.node_partial_offset, ctx.shared_chunks,
            ctx.row_partial_offsets, ctx.row_partials, work.header, work.items, work.node_work, work.partial_work,
            work.row_order, 0.1,
        )


def test_a_batch_of_another_size_refuses_the_plan():
    table, seq_lens = shared_prefix(batch=4, context=100, shared=64, block_size=16)
    plan = _plan(table, seq_lens, _shape())
    query = torch.randn(3, 4, 64)
    kv = torch.randn(int(table.max()) + 1, 2, 16, 128)
    with pytest.raises(ValueError, match="this layer has 3 requests"):
        ops.tpp_decode(query, kv, plan, 0.1, torch.empty_like(query))


def test_the_builder_plans_once_per_step_and_the_layers_only_run_it(monkeypatch):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_chunkattn.backend import ChunkAttentionMetadataBuilder
    from vllm_chunkattn.backend.impl import ChunkAttentionImpl
    from vllm_chunkattn.bench.step_overhead import StepShape, builder_config, decode_metadata

    step = StepShape(layers=3, heads=8, kv_heads=2, head_size=64, block_size=32, batch=6, context=90, dtype="fp32")
    table, seq_lens = shared_prefix(batch=6, context=90, shared=64, block_size=32)
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    builder = ChunkAttentionMetadataBuilder(spec, ["a", "b", "c"], builder_config(step), torch.device("cpu"))
    impl = ChunkAttentionImpl(8, 64, 0.125, 2, None, None, "auto")
    plans = []
    plan_tpp_decode = ops.plan_tpp_decode
    monkeypatch.setattr(ops, "plan_tpp_decode", lambda *a, **k: plans.append(plan_tpp_decode(*a, **k)) or plans[-1])

    metadata = builder.build(0, decode_metadata(table, seq_lens, 32))
    assert len(plans) == 1 and metadata.decode_plan is plans[0]
    assert metadata.decode_plan.shape == _shape(num_kv_heads=2, group=4, head_size=64, block_size=32)
    gen = torch.Generator().manual_seed(0)
    for _ in range(step.layers):
        kv = torch.randn(int(table.max()) + 1, 2, 32, 128, generator=gen)
        query = torch.randn(6, 8, 64, generator=gen)
        out = impl.forward(None, query, query[:, :2], query[:, :2], kv, metadata, torch.empty_like(query))
        expected = torch_fallback.tpp_decode(query, kv, table, seq_lens, metadata.decode_plan.context, 0.125)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    assert len(plans) == 1, "the layers planned again"


def test_host_sequence_lengths_come_from_vllms_cpu_copy():
    """On a device, build() reads vLLM's CPU-side seq_lens_cpu_upper_bound, not a
    device-to-host copy (a meta tensor stands for the device one: .cpu() of it fails)."""
    from vllm_chunkattn.backend.builder import _host_seq_lens
    from vllm_chunkattn.bench.step_overhead import decode_metadata

    table, seq_lens = shared_prefix(batch=4, context=90, shared=64, block_size=16)
    cm = decode_metadata(table, seq_lens, 16)
    cm.seq_lens = seq_lens.to("meta")
    assert torch.equal(_host_seq_lens(cm, 3), seq_lens[:3])


@pytest.mark.parametrize("own_node_min_query_len", [CPU.own_node_min_query_len, CUDA.own_node_min_query_len])
@pytest.mark.parametrize("group", [1, 4])
def test_planner_steps_decode_rows_decode(group, own_node_min_query_len):
    """The builder's steps (prefix/step.py) on the CPU kernels: a decode step,
    one with rows of up to 8 tokens, another decode step, each against the
    oracle, with requests' own nodes stacked always (CPU's rule) or from 5
    new tokens on (CUDA's); tests/gpu runs the same on CUDA."""
    check_planner_steps("cpu", torch.float32, group, max_query_len=8, tol=1e-4,
                        own_node_min_query_len=own_node_min_query_len)
