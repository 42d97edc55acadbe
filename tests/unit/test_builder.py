"""build() on synthetic vLLM batch metadata (CPU): the decode/prefill split,
the prefill query start locations rebased to 0, the prefill rows, and the
prefix tree over exactly the decode requests; what it records for the log."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_chunkattn.backend import ChunkAttentionMetadataBuilder
from vllm_chunkattn.backend.stats import (DecodeTotals, format_run_summary, parse_run_summaries, parse_step_trees,
                                          with_run_summary_time)
from vllm_chunkattn.kernels import ops
from vllm_chunkattn.kernels.support import CPU
from vllm_chunkattn.testing import reference
from vllm_chunkattn.testing.models import ensure_model

BLOCK_SIZE = 32
PADDING_ROWS = 2  # vLLM's block table tensor may have rows past the batch


@dataclass
class Req:
    blocks: list[int]
    seq_len: int
    query_len: int  # new tokens this step: 1 for a decode


# Decode requests: rows 0 and 1 share their first two chunks (blocks 1, 2),
# row 2 shares only the first (block 1); each ends in a private partial chunk.
DECODES = [Req([1, 2, 3], 70, 1), Req([1, 2, 4], 80, 1), Req([1, 5], 40, 1)]
# The tree over DECODES as (batch rows covered, first chunk, one past the last chunk).
DECODE_NODES = {(frozenset({0, 1, 2}), 0, 1), (frozenset({0, 1}), 1, 2)}
# Prefill requests: a chunk of a longer prompt and a whole prompt. Their first
# chunk is block 1 too, which must not put them into the decode tree.
PREFILLS = [Req([1, 6], 50, 20), Req([7, 8], 64, 64)]


@pytest.fixture(autouse=True)
def built_in_cpu_tuning(monkeypatch):
    """The built-in tree reach (CPU.tree_max_rows_per_kv_head) rather than the one this CPU measures: the
    tests say which requests take the tree path."""
    from vllm_chunkattn.kernels import cpu_tuning

    monkeypatch.setenv(cpu_tuning.ENV_VAR, "default")


def make_builder(enable_prefix_caching: bool = True) -> ChunkAttentionMetadataBuilder:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float32)
    # The embedded test model: 4 query heads of 64 over 2 KV heads, as in the spec.
    config = VllmConfig(model_config=ModelConfig(model=ensure_model("tiny")),
                        cache_config=CacheConfig(enable_prefix_caching=enable_prefix_caching))
    return ChunkAttentionMetadataBuilder(spec, ["layer.0"], config, torch.device("cpu"))


def batch_metadata(reqs: list[Req]) -> CommonAttentionMetadata:
    """What vLLM's CPU model runner passes for this batch (decodes first)."""
    width = max(len(r.blocks) for r in reqs) + 1
    table = torch.zeros(len(reqs) + PADDING_ROWS, width, dtype=torch.int32)
    for i, r in enumerate(reqs):
        table[i, : len(r.blocks)] = torch.tensor(r.blocks)
    query_lens = torch.tensor([r.query_len for r in reqs])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).to(torch.int32)])
    num_tokens = int(query_lens.sum())
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=torch.tensor([r.seq_len for r in reqs], dtype=torch.int32),
        num_reqs=len(reqs),
        num_actual_tokens=num_tokens,
        max_query_len=int(query_lens.max()),
        max_seq_len=max(r.seq_len for r in reqs),
        block_table_tensor=table,
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
    )


def tree_nodes(tree) -> set[tuple[frozenset[int], int, int]]:
    """Each node as (batch rows it covers, chunk range)."""
    order = tree.order.tolist()
    return {
        (frozenset(order[b:e]), cb, ce)
        for b, e, cb, ce in zip(tree.node_begin.tolist(), tree.node_end.tolist(), tree.node_chunk_begin.tolist(),
                                tree.node_chunk_end.tolist())
    }


def assert_prefills(meta, cm: CommonAttentionMetadata, prefills: list[Req], num_decodes: int) -> None:
    expected_qsl = [0]
    for r in prefills:
        expected_qsl.append(expected_qsl[-1] + r.query_len)
    assert meta.prefill_query_start_loc.tolist() == expected_qsl
    assert meta.prefill_query_start_loc.dtype == torch.int32
    assert meta.prefill_seq_lens.tolist() == [r.seq_len for r in prefills]
    assert torch.equal(meta.prefill_block_table, cm.block_table_tensor[num_decodes : num_decodes + len(prefills)])


def test_mixed_batch_splits_decodes_from_prefills():
    builder = make_builder()
    cm = batch_metadata(DECODES + PREFILLS)
    meta = builder.build(0, cm)
    assert meta.num_decodes == 3 and meta.num_decode_tokens == 3
    assert meta.num_actual_tokens == 3 + 20 + 64
    assert torch.equal(meta.slot_mapping, cm.slot_mapping)
    plan = meta.decode_plan
    assert torch.equal(plan.block_table, cm.block_table_tensor[:3])
    assert plan.seq_lens.tolist() == [70, 80, 40]
    # The prefill queries start right after the decode tokens; rebased to 0.
    assert_prefills(meta, cm, PREFILLS, num_decodes=3)
    # The tree covers exactly the decode requests.
    assert sorted(plan.context.order.tolist()) == [0, 1, 2]
    assert tree_nodes(plan.context) == DECODE_NODES
    assert plan.context.shared_chunks.tolist() == [2, 2, 1]


def test_pure_decode_batch():
    builder = make_builder()
    cm = batch_metadata(DECODES)
    meta = builder.build(0, cm)
    assert meta.num_decodes == 3 and meta.num_decode_tokens == 3
    assert meta.decode_plan.seq_lens.tolist() == [70, 80, 40]
    assert tree_nodes(meta.decode_plan.context) == DECODE_NODES
    assert_prefills(meta, cm, [], num_decodes=3)


@pytest.mark.parametrize("leading_query_len", [CPU.tree_max_query_len(group=2) + 1, 64])
def test_pure_prefill_batch(leading_query_len):
    builder = make_builder()
    prefills = [Req([9, 10], 60, leading_query_len)] + PREFILLS
    cm = batch_metadata(prefills)
    meta = builder.build(0, cm)
    assert meta.num_decodes == 0 and meta.num_decode_tokens == 0
    assert meta.decode_plan is None
    assert_prefills(meta, cm, prefills, num_decodes=0)
    assert builder.stats.run.steps == 0  # no decode step to report


def test_requests_with_few_new_tokens_take_the_tree_path():
    """A speculative decode (1 + 3 tokens) and a short suffix after a prefix hit
    become one plan row per query token, in query order, each attending up to
    its own token; the rows of both requests share the prefix's chunks."""
    builder = make_builder()
    assert builder.decode_shape.group == 2 and builder.reorder_batch_threshold == CPU.tree_max_query_len(2) == 8
    spec = Req([1, 2, 3], 80, 4)  # context 76: chunks 0, 1 full and unmasked
    suffix = Req([1, 2, 11], 70, 6)  # context 64: chunks 0, 1
    cm = batch_metadata([DECODES[0], spec, suffix] + PREFILLS)
    meta = builder.build(0, cm)
    assert meta.num_decodes == 3 and meta.num_decode_tokens == 1 + 4 + 6
    plan = meta.decode_plan
    assert plan.batch == 11
    assert plan.seq_lens.tolist() == [70, 77, 78, 79, 80, 65, 66, 67, 68, 69, 70]
    assert plan.block_table[:, :3].tolist() == [[1, 2, 3]] * 5 + [[1, 2, 11]] * 6
    assert (0, 2) in {(cb, ce) for cb, ce in zip(plan.context.node_chunk_begin.tolist(),
                                                 plan.context.node_chunk_end.tolist())}
    assert plan.context.shared_chunks.tolist() == [2] * 11
    run = builder.stats.run
    assert (run.requests, run.rows, run.multi_token_rows) == (3, 11, 10)
    assert_prefills(meta, cm, PREFILLS, num_decodes=3)


def test_a_block_computed_in_this_step_is_context_only_for_the_request_that_hit_it():
    """Request A computes its third chunk (block 3) in this step; vLLM already
    registered the block, and request B hit it. Block 3 is context for B and not
    for A: no node may serve it to A's rows (they must not see its later
    tokens). The step's attention matches the causal reference."""
    builder = make_builder()
    a = Req([1, 2, 3], 3 * BLOCK_SIZE, 8)  # tokens 88..95 new: block 3 fills in this step
    b = Req([1, 2, 3, 4], 3 * BLOCK_SIZE + 4, 4)  # context 96 = blocks 1, 2, 3
    cm = batch_metadata([a, b])
    meta = builder.build(0, cm)
    plan = meta.decode_plan
    nodes = tree_nodes(plan.context)
    a_rows, b_rows = frozenset(range(8)), frozenset(range(8, 12))
    assert (a_rows | b_rows, 0, 2) in nodes
    assert all(not (rows & a_rows) for rows, _, end in nodes if end > 2)
    assert (b_rows, 2, 3) in nodes
    assert plan.context.shared_chunks.tolist() == [2] * 8 + [3] * 4

    gen = torch.Generator().manual_seed(0)
    spec = builder.kv_cache_spec
    kv = torch.randn(5, spec.num_kv_heads, BLOCK_SIZE, 2 * spec.head_size, generator=gen)
    query = torch.randn(12, builder.decode_shape.num_heads, spec.head_size, generator=gen)
    out = ops.tpp_decode(query, kv, plan, 0.125, torch.empty_like(query))
    ref = reference.paged_attention(query, kv, cm.query_start_loc_cpu, cm.seq_lens, cm.block_table_tensor, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_decode_steps_are_recorded_for_the_log():
    builder = make_builder()
    builder.build(0, batch_metadata(DECODES + PREFILLS))
    builder.build(0, batch_metadata(DECODES))
    run = builder.stats.run
    assert (run.steps, run.requests, run.rows, run.multi_token_rows, run.nodes) == (2, 6, 6, 0, 4)
    assert run.context_tokens == 2 * (70 + 80 + 40)
    # Per step: chunk 0 read once for 3 requests, chunk 1 once for 2.
    assert run.saved_tokens == 2 * (2 + 1) * BLOCK_SIZE
    # The tree is unchanged between the steps: built once, looked up twice.
    assert (run.tree_builds, run.tree_lookups) == (1, 2)


def test_run_summary_reads_back():
    totals = DecodeTotals(steps=7, requests=20, rows=31, multi_token_rows=13, nodes=9, context_tokens=5000,
                          saved_tokens=1234, tree_builds=3, tree_lookups=7)
    line = "(Worker pid=1) INFO 11-23 07:19:51 [stats.py:102] " + format_run_summary(totals)
    [summary] = parse_run_summaries("earlier line\n" + line + "\nlater line\n")
    assert (summary.steps, summary.saved_tokens, summary.context_tokens) == (7, 1234, 5000)
    assert (summary.rows, summary.multi_token_rows) == (31, 13)
    assert summary.mean_batch == pytest.approx(20 / 7, abs=0.05)
    assert summary.mean_nodes == pytest.approx(9 / 7, abs=0.005)
    assert summary.served_once_share == pytest.approx(1234 / 5000)
    assert parse_run_summaries("CHUNK prefix tree: 5 decode steps, mean batch 2.0, ...") == []  # the periodic line


def test_engines_started_to_read_the_run_summary_give_their_workers_time_to_log_it(monkeypatch):
    """vLLM kills a worker 5 s after shutdown begins unless VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS says
    otherwise, and the whole-run line is logged as the worker exits."""
    from vllm_chunkattn.testing.server import VllmServer

    key = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
    monkeypatch.delenv(key, raising=False)
    assert int(with_run_summary_time({})[key]) > 5
    assert with_run_summary_time({key: "7"})[key] == "7"  # the user's own value wins
    assert int(VllmServer("model").env[key]) > 5
    monkeypatch.setenv(key, "9")
    assert VllmServer("model").env[key] == "9"


def test_step_trees_are_logged_at_debug_level_and_read_back(caplog):
    import logging

    builder = make_builder()
    with caplog.at_level(logging.DEBUG, logger="vllm.chunkattn.backend"):
        builder.build(0, batch_metadata(DECODES + PREFILLS))
    [step] = parse_step_trees(caplog.text)
    assert (step.requests, step.rows) == (3, 3)
    # DECODE_NODES, as (rows covered, chunk range): the tree positions of a node are contiguous.
    assert {(n.row_end - n.row_begin, n.chunk_begin, n.chunk_end) for n in step.nodes} == {
        (len(rows), begin, end) for rows, begin, end in DECODE_NODES}
    assert len(step.nodes) == 2 and all(0 <= n.row_begin < n.row_end <= 3 for n in step.nodes)
    caplog.clear()
    builder.build(0, batch_metadata(DECODES))  # at INFO, no step line
    assert parse_step_trees(caplog.text) == []


@pytest.mark.parametrize("reach,max_query_len", [(8, 4), (2, 1), (5, 2)])
def test_the_builder_applies_the_cpu_tuning_of_its_shape(monkeypatch, reach, max_query_len):
    """At engine start the CPU kernels get the tile parameters tuned for the layer shape, and requests
    take the tree path up to the query length the tuning measured for it (kernels/cpu_tuning.py)."""
    from vllm_chunkattn.kernels import cpu_tuning

    asked = []
    tiles = cpu_tuning.CpuTuning(prefill_tile_rows=32, lanes_tile_keys=256, prefetch_distance=2)
    tuned = cpu_tuning.ShapeTuning(tiles, tree_max_rows_per_kv_head=reach)

    def ensure_tuned(shape):
        asked.append(shape)
        tiles.apply()
        return tuned

    before = cpu_tuning.current()
    monkeypatch.setattr(cpu_tuning, "ensure_tuned", ensure_tuned)
    try:
        builder = make_builder()
        assert asked == [builder.decode_shape]
        assert (builder.decode_shape.num_heads, builder.decode_shape.num_kv_heads) == (4, 2)
        assert cpu_tuning.current() == tiles
        assert builder.reorder_batch_threshold == max_query_len
    finally:
        before.apply()


def test_on_cuda_the_builder_takes_the_reach_its_gpu_measured(monkeypatch):
    """With the CUDA kernels, requests take the tree path up to the query length timed on the GPU for the
    layer shape at start (kernels/tree_reach.py); the device buffers are host stand-ins here."""
    from types import SimpleNamespace

    from vllm_chunkattn.backend import builder as builder_module
    from vllm_chunkattn.kernels import tree_reach

    asked = []
    monkeypatch.setattr(ops, "cuda_kernels_available", lambda: True)
    monkeypatch.setattr(builder_module, "DeviceTreeBuffers", lambda **capacity: SimpleNamespace(
        **{**capacity, "device": torch.device("cpu")}))
    monkeypatch.setattr(tree_reach, "cuda_reach", lambda shape, device: asked.append((shape, device)) or 8)
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float16)
    config = VllmConfig(model_config=ModelConfig(model=ensure_model("tiny")), cache_config=CacheConfig())
    gpu = torch.device("cuda", 0)
    builder = ChunkAttentionMetadataBuilder(spec, ["layer.0"], config, gpu)
    assert asked == [(builder.decode_shape, gpu)]
    assert builder.decode_shape.group == 2 and builder.reorder_batch_threshold == 8 // 2


def test_prefix_caching_off_is_reported_once_per_process():
    """Without prefix caching no request shares a block: the builder of every
    KV-cache group (and the ones built after) says so once, not once each."""
    import logging

    from vllm_chunkattn import BACKEND_NAME
    from vllm_chunkattn.backend.stats import logger

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        make_builder(enable_prefix_caching=False)
        make_builder(enable_prefix_caching=False)
        make_builder(enable_prefix_caching=True)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records if "prefix caching disabled" in r.getMessage()] == [
        f"{BACKEND_NAME} attention with prefix caching disabled: requests share no KV blocks, so nothing is shared and "
        "decode runs as plain paged attention. Enable prefix caching to benefit."
    ]
