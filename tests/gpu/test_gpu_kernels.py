"""The CUDA kernels against the float64 reference on random prefix trees, on a GPU.

Covers head sizes 64/128/256, block sizes 16/32/64/128, fp16/bf16 and GQA
groups 1..8 (decode, rows of several tokens per request, and prefill; decode also 20 and 64), the paper's shapes with long shared and
private parts (several pieces per node and splits per request), the
fixed-capacity (CUDA-graph) context with padding rows, strided inputs, and
the KV write."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from gpu_helpers import TOL, requires_gpu

from vllm_chunkattn.kernels import ops
from vllm_chunkattn.testing import reference
from vllm_chunkattn.kernels import torch_fallback
from vllm_chunkattn.prefix.device_buffers import DeviceTreeBuffers
from vllm_chunkattn.testing.paged_cases import (
    KERNEL_VARIANTS,
    attention_variant,
    multi_level,
    num_blocks_needed,
    prefill_split,
    random_forest,
    random_kv_cache,
    shared_prefix,
)
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.prefix.query_rows import expand_query_rows
from vllm_chunkattn.prefix.tree import prefix_tree
from vllm_chunkattn.kernels.support import CUDA
from vllm_chunkattn.testing.step_cases import check_planner_steps

pytestmark = requires_gpu

DTYPES = [torch.float16, torch.bfloat16]
HEAD_SIZES = [64, 128, 256]
BLOCK_SIZES = [16, 32, 64, 128]
GROUPS = [1, 2, 3, 4, 8]
# Decode also over 16 query heads per KV head: the sequence-first phase's group
# layout then stages 32 and 64 Q rows (csrc/cuda/attention.cuh).
DECODE_GROUPS = GROUPS + [20, 64]


def _inputs(table, seq_lens, block_size, head_size, group, dtype, num_kv_heads=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv = random_kv_cache(num_blocks_needed(table), num_kv_heads, block_size, head_size, dtype, generator=gen)
    query = torch.randn(table.shape[0], num_kv_heads * group, head_size, generator=gen).to(dtype)
    return query, kv


def _decode(query, kv, table, seq_lens, ctx, scale, out):
    """Plan the step (as the builder does), then run it as one layer."""
    plan = ops.plan_tpp_decode(DecodeShape.of_layer(query, kv), table, seq_lens, ctx)
    assert plan.work is not None and plan.work.items.is_cuda
    return ops.tpp_decode(query, kv, plan, scale, out)


def _check(out, expected, dtype):
    out = out.float().cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_cuda_kernels_are_the_ones_running():
    cuda = torch.device("cuda")
    for name in ("write_kv_cache", "tpp_decode_plan", "tpp_decode", "paged_prefill"):
        assert ops._compiled(name, cuda) is not None, name


@pytest.mark.parametrize("dtype,head_size,block_size", list(itertools.product(DTYPES, HEAD_SIZES, BLOCK_SIZES)))
def test_decode_random_trees(dtype, head_size, block_size):
    for seed, group in enumerate(DECODE_GROUPS):
        rng = np.random.default_rng(seed)
        table, seq_lens = random_forest(rng, 24, block_size, max_shared_blocks=6, max_private_blocks=6)
        query, kv = _inputs(table, seq_lens, block_size, head_size, group, dtype, seed=seed)
        ctx = prefix_tree(table, seq_lens, block_size)
        scale = 1 / math.sqrt(head_size)
        out = torch.empty_like(query, device="cuda")
        _decode(query.cuda(), kv.cuda(), table.cuda(), seq_lens.cuda(), ctx, scale, out)
        expected = reference.paged_attention(query, kv, torch.arange(len(seq_lens) + 1), seq_lens, table, scale)
        _check(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [0, 1024, 2048])
def test_decode_paper_shape(dtype, shared):
    """Table 3 shape (reduced heads): 32 requests, 2048 + 1 context tokens."""
    table, seq_lens = shared_prefix(batch=32, context=2049, shared=shared, block_size=64)
    query, kv = _inputs(table, seq_lens, 64, 128, 1, dtype, num_kv_heads=4)
    ctx = prefix_tree(table, seq_lens, 64)
    out = torch.empty_like(query, device="cuda")
    _decode(query.cuda(), kv.cuda(), table.cuda(), seq_lens.cuda(), ctx, 0.0884, out)
    expected = torch_fallback.tpp_decode(query.cuda().float(), kv.cuda().float(), table.cuda(), seq_lens.cuda(),
                                        ctx, 0.0884)
    _check(out, expected.cpu(), dtype)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_multi_level_tree_in_graph_buffers(group):
    table, seq_lens = multi_level(batch=48, levels=[(1, 512), (4, 256), (3, 64)], private=100, block_size=32)
    pad = 16  # CUDA-graph padding requests: length 0, null block
    table = torch.cat([table, torch.zeros(pad, table.shape[1], dtype=torch.int32)])
    seq_lens = torch.cat([seq_lens, torch.zeros(pad, dtype=torch.int32)])
    query, kv = _inputs(table, seq_lens, 32, 128, group, torch.bfloat16)
    buffers = DeviceTreeBuffers(max_batch=96, max_nodes=95, max_partial_rows=4 * 96, device="cuda")
    ctx = buffers.load(prefix_tree(table, seq_lens, 32), batch=table.shape[0])
    out = torch.full_like(query, float("nan"), device="cuda")
    _decode(query.cuda(), kv.cuda(), table.cuda(), seq_lens.cuda(), ctx, 0.1, out)
    expected = reference.paged_attention(query[:48], kv, torch.arange(49), seq_lens[:48], table[:48], 0.1)
    _check(out[:48], expected, torch.bfloat16)
    assert int(out[48:].abs().sum()) == 0


def test_decode_strided_query_and_output():
    table, seq_lens = random_forest(np.random.default_rng(5), 16, 16)
    query, kv = _inputs(table, seq_lens, 16, 128, 4, torch.float16)
    qkv = torch.randn(query.shape[0], query.shape[1] + 4, 128, dtype=torch.float16, device="cuda")
    qkv[:, : query.shape[1]] = query.cuda()
    wide_out = torch.zeros(query.shape[0], query.shape[1] + 4, 128, dtype=torch.float16, device="cuda")
    out = wide_out[:, : query.shape[1]]
    ctx = prefix_tree(table, seq_lens, 16)
    _decode(qkv[:, : query.shape[1]], kv.cuda(), table.cuda(), seq_lens.cuda(), ctx, 0.1, out)
    expected = reference.paged_attention(query, kv, torch.arange(17), seq_lens, table, 0.1)
    _check(out, expected, torch.float16)
    assert int(wide_out[:, query.shape[1] :].abs().sum()) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_rows_of_several_tokens(dtype, group):
    """Every query token of requests with 0 to 16 new tokens one tree row
    (prefix/query_rows.py): the causal prefill's result."""
    for seed, block_size in enumerate(BLOCK_SIZES):
        rng = np.random.default_rng(100 + seed)
        table, seq_lens = random_forest(rng, 16, block_size, max_shared_blocks=6, max_private_blocks=4)
        query_lens = torch.tensor([int(rng.integers(0, min(int(n), 16) + 1)) for n in seq_lens], dtype=torch.int32)
        rows = expand_query_rows(table, seq_lens, query_lens)
        qsl = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).to(torch.int32)])
        query, kv = _inputs(rows.block_table, rows.seq_lens, block_size, 128, group, dtype, seed=seed)
        ctx = prefix_tree(rows.block_table, rows.unmasked_lens, block_size)
        out = torch.empty_like(query, device="cuda")
        _decode(query.cuda(), kv.cuda(), rows.block_table.cuda(), rows.seq_lens.cuda(), ctx, 0.09, out)
        _check(out, reference.paged_attention(query, kv, qsl, seq_lens, table, 0.09), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
def test_engine_steps_decode_rows_decode(dtype, group):
    """The builder's steps (prefix/step.py) as the engine runs them on CUDA: a
    decode step on the fixed (CUDA-graph) buffers, a step with rows of up to 8
    tokens per request on a context sized to it (requests' own nodes by
    CUDA's rule), a decode step on the fixed buffers again, each against the
    oracle."""
    check_planner_steps("cuda", dtype, group, max_query_len=8, tol=TOL[dtype],
                        own_node_min_query_len=CUDA.own_node_min_query_len)


@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8)])
def test_cuda_reach_is_measured_on_the_gpu(heads, kv_heads):
    """The engine's start-up measurement of the tree path's reach (kernels/tree_reach.py) on this GPU: its
    two paths agree, and the reach is the last q x group before the first loss."""
    from vllm_chunkattn.kernels import tree_reach

    shape = DecodeShape(num_heads=heads, num_kv_heads=kv_heads, head_size=128, block_size=64,
                        dtype=torch.bfloat16)
    device = torch.device("cuda", torch.cuda.current_device())
    paths = tree_reach.tree_paths(shape, query_len=4, device=device)
    _check(paths["tree"](), paths["per_request"]().float().cpu(), torch.bfloat16)
    reach, measured = tree_reach.measure_reach(shape, device)
    print(f"\n{heads}/{kv_heads} heads: reach {reach} rows per KV head; per-request/tree {measured}")
    gains = {int(rows): gain for rows, gain in measured.items()}
    assert reach == max([shape.group] + [rows for rows, gain in gains.items() if gain >= 1.0])
    assert all(gain >= 1.0 for rows, gain in gains.items() if rows < max(gains))


@pytest.mark.parametrize("dtype,head_size,block_size", list(itertools.product(DTYPES, HEAD_SIZES, BLOCK_SIZES)))
def test_prefill_random(dtype, head_size, block_size):
    for seed, group in enumerate(GROUPS):
        rng = np.random.default_rng(100 + seed)
        table, seq_lens = random_forest(rng, 6, block_size, max_shared_blocks=3, max_private_blocks=4)
        new = prefill_split(rng, seq_lens)
        qsl = torch.cat([torch.zeros(1, dtype=torch.int32), new.cumsum(0).to(torch.int32)])
        gen = torch.Generator().manual_seed(seed)
        kv = random_kv_cache(num_blocks_needed(table), 2, block_size, head_size, dtype, generator=gen)
        query = torch.randn(int(qsl[-1]), 2 * group, head_size, generator=gen).to(dtype)
        scale = 1 / math.sqrt(head_size)
        out = torch.empty_like(query, device="cuda")
        ops.paged_prefill(query.cuda(), kv.cuda(), qsl.cuda(), seq_lens.cuda(), table.cuda(), scale, out)
        expected = reference.paged_attention(query, kv, qsl, seq_lens, table, scale)
        _check(out, expected, dtype)


def _on_gpu(variant: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in variant.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(KERNEL_VARIANTS))
def test_decode_and_prefill_attention_variants(dtype, name):
    """The emulator tests' variants (paged_cases.KERNEL_VARIANTS) on the hardware."""
    block_size, head_size, group = 16, 128, 4
    rng = np.random.default_rng(7)
    table, seq_lens = random_forest(rng, 24, block_size, max_shared_blocks=8, max_private_blocks=6)
    query, kv = _inputs(table, seq_lens, block_size, head_size, group, dtype, seed=7)
    variant = attention_variant(KERNEL_VARIANTS[name], query.shape[1], torch.Generator().manual_seed(7))
    scale = 1 / math.sqrt(head_size)
    ctx = prefix_tree(table, seq_lens, block_size)
    plan = ops.plan_tpp_decode(DecodeShape.of_layer(query.cuda(), kv.cuda()), table.cuda(), seq_lens.cuda(), ctx)
    out = ops.tpp_decode(query.cuda(), kv.cuda(), plan, scale, torch.empty_like(query, device="cuda"),
                         **_on_gpu(variant))
    expected = reference.paged_attention(query, kv, torch.arange(len(seq_lens) + 1), seq_lens, table, scale, **variant)
    _check(out, expected, dtype)

    new = prefill_split(rng, seq_lens)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), new.cumsum(0).to(torch.int32)])
    query = torch.randn(int(qsl[-1]), query.shape[1], head_size, generator=torch.Generator().manual_seed(8)).to(dtype)
    out = torch.empty_like(query, device="cuda")
    ops.paged_prefill(query.cuda(), kv.cuda(), qsl.cuda(), seq_lens.cuda(), table.cuda(), scale, out,
                      **_on_gpu(variant))
    _check(out, reference.paged_attention(query, kv, qsl, seq_lens, table, scale, **variant), dtype)


def test_prefill_long_prompt():
    table, seq_lens = shared_prefix(batch=2, context=3000, shared=0, block_size=16)
    new = torch.tensor([3000, 700], dtype=torch.int32)  # a full prompt; a chunk after a cache hit
    qsl = torch.tensor([0, 3000, 3700], dtype=torch.int32)
    query, kv = _inputs(table, seq_lens, 16, 128, 2, torch.bfloat16)
    query = torch.randn(int(new.sum()), 4, 128).to(torch.bfloat16)
    out = torch.empty_like(query, device="cuda")
    ops.paged_prefill(query.cuda(), kv.cuda(), qsl.cuda(), seq_lens.cuda(), table.cuda(), 0.0884, out)
    expected = torch_fallback.paged_prefill(query.cuda().float(), kv.cuda().float(), qsl.tolist(), seq_lens.tolist(),
                                           table.cuda(), 0.0884, torch.empty_like(query, dtype=torch.float32,
                                                                                   device="cuda"))
    _check(out, expected.cpu(), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_cache(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(7)
    tokens, kv_heads, block_size, head_size = 300, 4, 16, 128
    qkv = torch.randn(tokens, 12, head_size, generator=gen).to(dtype).cuda()
    key, value = qkv[:, 4:8], qkv[:, 8:12]
    slots = torch.randperm(64 * block_size, generator=gen)[:tokens].to(slot_dtype)
    slots[::7] = -1
    cache = torch.randn(64, kv_heads, block_size, 2 * head_size, generator=gen).to(dtype).cuda()
    expected = cache.cpu().clone()
    reference.write_kv_cache(key.cpu(), value.cpu(), expected, slots)
    ops.write_kv_cache(key, value, cache, slots.cuda())
    assert torch.equal(cache.cpu(), expected)
