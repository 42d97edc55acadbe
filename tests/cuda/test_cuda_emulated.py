"""The CUDA kernels (csrc/cuda/*.cu), executed on the CPU by a SIMT emulator
(tests/cuda/emulator), against the reference on random prefix trees.

No GPU is needed: the exact kernel source is compiled as C++ with
-DCHUNKATTN_EMULATE, which swaps the device intrinsics (mma.sync, ldmatrix,
cp.async, shuffles, barriers) for emulations that follow the PTX fragment
layouts and run every CUDA thread as a fiber. This checks the kernels' logic:
work decomposition, indexing, masking, online softmax, pipelining and
barriers; not their speed, and not what only hardware shows (the real
instruction encodings, memory ordering beyond barriers). tests/gpu/ checks
them on a real GPU.
"""

from __future__ import annotations

import ctypes
import functools
import math

import numpy as np
import pytest
import torch

from emulator import build as emu_build
from vllm_chunkattn.kernels import support
from vllm_chunkattn.testing import reference
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
from vllm_chunkattn.prefix.query_rows import expand_query_rows
from vllm_chunkattn.prefix.tree import prefix_tree

_reason = emu_build.missing_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"cannot build the CUDA emulator: {_reason}")

TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
# The emulator runs CUDA's kernels on CPU tensors: its caches have CUDA's layout (kernels/layout.py).
reference_attention = functools.partial(reference.paged_attention, kernels_device="cuda")


@pytest.fixture(scope="module")
def emu():
    lib = emu_build.load()
    yield lib
    lib.emu_set_cp_async_early(0)
    lib.emu_set_schedule(0)
    lib.emu_set_smem_per_sm(0)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t.numel() else 0)


def _strides(*values: int):
    return (ctypes.c_int64 * len(values))(*values)


def _variant_args(sliding_window=0, logits_soft_cap=0.0, sinks=None, alibi_slopes=None):
    """The emulated ops' variant arguments (the ops' keywords): window, soft-cap, sinks and slopes
    (float32 or null)."""
    for t in (sinks, alibi_slopes):
        assert t is None or (t.dtype == torch.float32 and t.is_contiguous())
    return (sliding_window, logits_soft_cap, None if sinks is None else _ptr(sinks),
            None if alibi_slopes is None else _ptr(alibi_slopes))


def emu_decode(emu, query, kv_cache, table, seq_lens, ctx, scale, num_sms=4, blocks_per_sm=2, num_partial_rows=None,
               layers=1, **variant):
    """One step's plan, run by `layers` layers on the same inputs (the last one's output).
    `variant`: the ops' variant keywords (_variant_args)."""
    out = torch.full_like(query, float("nan"))
    num_partial_rows = ctx.num_partial_rows if num_partial_rows is None else num_partial_rows
    err = emu.emu_tpp_decode(
        int(query.dtype == torch.bfloat16), _ptr(out), _ptr(query), _ptr(kv_cache), _ptr(table), _ptr(seq_lens),
        _ptr(ctx.order), _ptr(ctx.node_begin), _ptr(ctx.node_end), _ptr(ctx.node_chunk_begin),
        _ptr(ctx.node_chunk_end), _ptr(ctx.node_partial_offset), _ptr(ctx.shared_chunks),
        _ptr(ctx.row_partial_offsets), _ptr(ctx.row_partials), query.shape[0], query.shape[1], kv_cache.shape[1],
        query.shape[2], kv_cache.shape[2], ctx.node_begin.numel(), num_partial_rows, scale,
        *_variant_args(**variant),
        _strides(out.stride(0), out.stride(1), query.stride(0), query.stride(1), kv_cache.stride(0),
                 kv_cache.stride(1), table.stride(0)),
        num_sms, blocks_per_sm, layers,
    )
    assert err is None, err.decode()
    return out


def emu_prefill(emu, query, kv_cache, qsl, seq_lens, table, scale, num_sms=4, **variant):
    out = torch.full_like(query, float("nan"))
    err = emu.emu_paged_prefill(
        int(query.dtype == torch.bfloat16), _ptr(out), _ptr(query), _ptr(kv_cache), _ptr(qsl), _ptr(seq_lens),
        _ptr(table), query.shape[0], seq_lens.numel(), query.shape[1], kv_cache.shape[1], query.shape[2],
        kv_cache.shape[2], scale, *_variant_args(**variant),
        _strides(out.stride(0), out.stride(1), query.stride(0), query.stride(1), kv_cache.stride(0),
                 kv_cache.stride(1), table.stride(0)),
        num_sms, 2,
    )
    assert err is None, err.decode()
    return out


def _decode_case(seed, batch, block_size, head_size, group, dtype, num_kv_heads=2, table=None, seq_lens=None):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    if table is None:
        table, seq_lens = random_forest(rng, batch, block_size, max_shared_blocks=4, max_private_blocks=3)
    kv_cache = random_kv_cache(num_blocks_needed(table), num_kv_heads, block_size, head_size, dtype, generator=gen)
    query = torch.randn(table.shape[0], num_kv_heads * group, head_size, generator=gen).to(dtype)
    return query, kv_cache, table, seq_lens


def _check(out, expected, dtype):
    assert not torch.isnan(out).any(), "NaN in the output: something read unwritten workspace or cache"
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


# (seed, batch, block_size, head_size, group, dtype, num_sms): every head size, block
# size, group size 1..8 and both dtypes at least once, and groups over 16 (the
# sequence-first phase's group layout with 32 and 64 Q rows); num_sms changes the
# plan (pieces per node, splits per request, jobs per block).
DECODE_CASES = [
    (0, 9, 16, 128, 1, torch.float16, 4),
    (1, 12, 32, 64, 2, torch.bfloat16, 1),
    (2, 7, 64, 128, 4, torch.float16, 16),
    (3, 6, 128, 64, 8, torch.bfloat16, 64),
    (4, 10, 16, 256, 3, torch.float16, 8),
    (5, 8, 32, 256, 1, torch.bfloat16, 2),
    (6, 5, 16, 64, 5, torch.float16, 32),
    (7, 11, 16, 128, 8, torch.bfloat16, 3),
    (8, 5, 32, 64, 20, torch.float16, 6),
    (9, 4, 16, 256, 64, torch.bfloat16, 2),
]


@pytest.mark.parametrize("smem_per_sm,blocks_per_sm,stages", [(228 * 1024, 3, 2), (164 * 1024, 3, 1)])
def test_sequence_first_keeps_one_stage_where_two_cost_resident_blocks(emu, smem_per_sm, blocks_per_sm, stages):
    """The sequence-first phase's second K/V stage (72 KiB a block at D = 128) is taken where the SM still
    fits as many blocks as with the stacked layout's 51 KiB (an H100's 228 KiB: 3 either way), not where it
    would fit fewer (an A100's 164 KiB: 2 instead of 3); both give the reference's output."""
    script = _compile_script()
    head_size, group, dtype = 128, 4, torch.float16
    query, kv_cache, table, seq_lens = _decode_case(40 + stages, 8, 16, head_size, group, dtype)
    ctx = prefix_tree(table, seq_lens, 16)
    emu.emu_set_smem_per_sm(smem_per_sm)
    try:
        emu.emu_take_largest_launch_smem()
        out = emu_decode(emu, query, kv_cache, table, seq_lens, ctx, 1 / math.sqrt(head_size), num_sms=5,
                         blocks_per_sm=blocks_per_sm)
        launched = emu.emu_take_largest_launch_smem()
    finally:
        emu.emu_set_smem_per_sm(0)
    two_stages = script.dynamic_smem_bytes(head_size, group)
    assert launched == (two_stages if stages == 2 else script.dynamic_smem_bytes(head_size))
    assert smem_per_sm // launched == blocks_per_sm
    expected = reference_attention(query, kv_cache, torch.arange(len(seq_lens) + 1), seq_lens, table,
                                         1 / math.sqrt(head_size))
    _check(out, expected, dtype)


@pytest.mark.parametrize("seed,batch,block_size,head_size,group,dtype,num_sms", DECODE_CASES)
def test_tpp_decode_random_trees(emu, seed, batch, block_size, head_size, group, dtype, num_sms):
    query, kv_cache, table, seq_lens = _decode_case(seed, batch, block_size, head_size, group, dtype)
    ctx = prefix_tree(table, seq_lens, block_size)
    assert ctx.num_nodes > 0, "the case must exercise the chunk-first phase"
    scale = 1 / math.sqrt(head_size)
    out = emu_decode(emu, query, kv_cache, table, seq_lens, ctx, scale, num_sms=num_sms)
    expected = reference_attention(
        query, kv_cache, torch.arange(batch + 1), seq_lens, table, scale
    )
    _check(out, expected, dtype)


def test_tpp_decode_many_rows_per_node(emu):
    """A node covering more requests x group than one 64-row tile, long shared
    and private parts (several pieces and splits), GQA group 3 (tiles of 21
    requests, 63 rows)."""
    table, seq_lens = multi_level(batch=26, levels=[(1, 96), (2, 32)], private=40, block_size=16)
    query, kv_cache, table, seq_lens = _decode_case(11, 0, 16, 64, 3, torch.float16, table=table, seq_lens=seq_lens)
    ctx = prefix_tree(table, seq_lens, 16)
    out = emu_decode(emu, query, kv_cache, table, seq_lens, ctx, 0.125, num_sms=8)
    expected = reference_attention(query, kv_cache, torch.arange(27), seq_lens, table, 0.125)
    _check(out, expected, torch.float16)


def test_tpp_decode_paper_batch(emu):
    """The paper's shape in small: every request shares the first half."""
    table, seq_lens = shared_prefix(batch=6, context=300, shared=192, block_size=64)
    query, kv_cache, table, seq_lens = _decode_case(12, 0, 64, 128, 1, torch.bfloat16, table=table, seq_lens=seq_lens)
    ctx = prefix_tree(table, seq_lens, 64)
    assert ctx.num_nodes == 1
    out = emu_decode(emu, query, kv_cache, table, seq_lens, ctx, 0.1, num_sms=6)
    expected = reference_attention(query, kv_cache, torch.arange(7), seq_lens, table, 0.1)
    _check(out, expected, torch.bfloat16)


@pytest.mark.parametrize("schedule", [1, 2, 3])
@pytest.mark.parametrize("early", [0, 1])
def test_races_under_skewed_schedules(emu, schedule, early):
    """Decode and prefill under thread orders that differ from lockstep (one warp
    running ahead until it blocks on a barrier, reverse order, random order),
    with cp.async landing at its wait or at issue, and with a single resident
    block so the chunk-first block loops over many jobs: a missing
    __syncthreads lets a thread overwrite shared memory that another still
    reads, and the result goes wrong."""
    emu.emu_set_schedule(schedule)
    emu.emu_set_cp_async_early(early)
    try:
        for head_size, group in ((64, 2), (128, 1), (256, 4)):
            query, kv_cache, table, seq_lens = _decode_case(20 + head_size, 6, 16, head_size, group, torch.float16)
            ctx = prefix_tree(table, seq_lens, 16)
            out = emu_decode(emu, query, kv_cache, table, seq_lens, ctx, 0.1, num_sms=1, blocks_per_sm=1)
            expected = reference_attention(query, kv_cache, torch.arange(7), seq_lens, table, 0.1)
            _check(out, expected, torch.float16)
        rng = np.random.default_rng(schedule * 2 + early)
        table, seq_lens = random_forest(rng, 3, 32, max_shared_blocks=2, max_private_blocks=2)
        qsl = torch.cat([torch.zeros(1, dtype=torch.int32), prefill_split(rng, seq_lens, 70).cumsum(0).to(torch.int32)])
        kv_cache = random_kv_cache(num_blocks_needed(table), 2, 32, 128, torch.bfloat16)
        query = torch.randn(int(qsl[-1]), 4, 128).to(torch.bfloat16)
        out = emu_prefill(emu, query, kv_cache, qsl, seq_lens, table, 0.09)
        _check(out, reference_attention(query, kv_cache, qsl, seq_lens, table, 0.09), torch.bfloat16)
    finally:
        emu.emu_set_schedule(0)
        emu.emu_set_cp_async_early(0)


def test_tpp_decode_graph_padded_context(emu):
    """As under a CUDA graph: the context lives in fixed-capacity buffers (empty
    padding nodes, num_partial_rows = capacity) and the batch is padded with
    requests of length 0 whose block-table rows point at the null block."""
    block_size, head_size, group = 16, 64, 2
    rng = np.random.default_rng(30)
    table, seq_lens = random_forest(rng, 7, block_size)
    pad = 3
    table = torch.cat([table, torch.zeros(pad, table.shape[1], dtype=torch.int32)])
    seq_lens = torch.cat([seq_lens, torch.zeros(pad, dtype=torch.int32)])
    query, kv_cache, table, seq_lens = _decode_case(30, 0, block_size, head_size, group, torch.float16,
                                                    table=table, seq_lens=seq_lens)
    buffers = DeviceTreeBuffers(max_batch=16, max_nodes=15, max_partial_rows=40, device="cpu")
    ctx = buffers.load(prefix_tree(table, seq_lens, block_size), batch=table.shape[0])
    assert ctx.num_partial_rows == 40 and ctx.node_begin.numel() == 15
    out = emu_decode(emu, query, kv_cache, table, seq_lens, ctx, 0.125)
    expected = reference_attention(query, kv_cache, torch.arange(11), seq_lens, table, 0.125)
    _check(out[:7], expected[:7], torch.float16)
    assert torch.equal(out[7:], torch.zeros_like(out[7:])), "padding requests must give zeros"


@pytest.mark.parametrize("num_sms", [1, 32])
def test_tpp_decode_one_plan_for_many_layers(emu, num_sms):
    """One plan, three layers' runs: the runs only read it. Fixed-capacity
    context with few items in a long item list, so that (with many SMs) the
    chunk-first blocks stride far past the last item and must stop at an end
    row rather than read what the plan did not write this step."""
    block_size = 16
    table, seq_lens = multi_level(batch=10, levels=[(1, 48), (2, 32)], private=30, block_size=block_size)
    query, kv_cache, table, seq_lens = _decode_case(32, 0, block_size, 64, 2, torch.bfloat16,
                                                    table=table, seq_lens=seq_lens)
    buffers = DeviceTreeBuffers(max_batch=16, max_nodes=15, max_partial_rows=64, device="cpu")
    ctx = buffers.load(prefix_tree(table, seq_lens, block_size), batch=10)
    out = emu_decode(emu, query, kv_cache, table, seq_lens, ctx, 0.125, num_sms=num_sms, layers=3)
    expected = reference_attention(query, kv_cache, torch.arange(11), seq_lens, table, 0.125)
    _check(out, expected, torch.bfloat16)


def test_tpp_decode_truncated_tree(emu):
    """A tree larger than the buffers is cut to its top levels; the chunks of the
    dropped nodes become private again and the result stays exact."""
    block_size = 16
    table, seq_lens = multi_level(batch=12, levels=[(1, 32), (3, 32), (2, 16)], private=20, block_size=block_size)
    query, kv_cache, table, seq_lens = _decode_case(31, 0, block_size, 128, 1, torch.float16,
                                                    table=table, seq_lens=seq_lens)
    full = prefix_tree(table, seq_lens, block_size)
    buffers = DeviceTreeBuffers(max_batch=12, max_nodes=3, max_partial_rows=20, device="cpu")
    ctx = buffers.load(full, batch=12)
    assert int((ctx.node_end - ctx.node_begin).clamp(min=0).count_nonzero()) < full.num_nodes
    out = emu_decode(emu, query, kv_cache, table, seq_lens, ctx, 0.125)
    expected = reference_attention(query, kv_cache, torch.arange(13), seq_lens, table, 0.125)
    _check(out, expected, torch.float16)


def test_tpp_decode_plan_with_many_nodes(emu):
    """More nodes than the plan kernel's 256 threads: its prefix sums carry over
    rounds. Real nodes sit on both sides of 300 empty padding nodes."""
    query, kv_cache, table, seq_lens = _decode_case(45, 10, 16, 64, 2, torch.float16)
    ctx = prefix_tree(table, seq_lens, 16)
    assert ctx.num_nodes >= 2
    pad = torch.zeros(300, dtype=torch.int32)

    def spread(t):
        return torch.cat([t[:1], pad, t[1:]])

    ctx = type(ctx)(
        order=ctx.order, node_begin=spread(ctx.node_begin), node_end=spread(ctx.node_end),
        node_chunk_begin=spread(ctx.node_chunk_begin), node_chunk_end=spread(ctx.node_chunk_end),
        node_partial_offset=spread(ctx.node_partial_offset), shared_chunks=ctx.shared_chunks,
        row_partial_offsets=ctx.row_partial_offsets, row_partials=ctx.row_partials,
        num_partial_rows=ctx.num_partial_rows,
    )
    out = emu_decode(emu, query, kv_cache, table, seq_lens, ctx, 0.125, num_sms=2)
    expected = reference_attention(query, kv_cache, torch.arange(11), seq_lens, table, 0.125)
    _check(out, expected, torch.float16)


def test_tpp_decode_strided_query_and_output(emu):
    """query / out as views into wider [tokens, heads + extra, D] tensors, as vLLM's
    fused QKV projection hands them over."""
    query, kv_cache, table, seq_lens = _decode_case(40, 6, 32, 128, 2, torch.bfloat16)
    wide = torch.randn(query.shape[0], query.shape[1] + 3, 128).to(torch.bfloat16)
    wide[:, : query.shape[1]] = query
    q_view = wide[:, : query.shape[1]]
    ctx = prefix_tree(table, seq_lens, 32)
    out = emu_decode(emu, q_view, kv_cache, table, seq_lens, ctx, 0.09)
    expected = reference_attention(query, kv_cache, torch.arange(7), seq_lens, table, 0.09)
    _check(out, expected, torch.bfloat16)


# Rows of several query tokens per request (prefix/query_rows.py): speculative
# decodes, short suffixes after a prefix hit, mixed with decodes. Each row is
# one query token; the tree is keyed on the rows' unmasked lengths, so a node
# stacks every query token of the requests it covers (x GQA group) in its
# mma tiles. The result must be the causal prefill's.
MULTI_ROW_CASES = [
    # seed, batch, block_size, head_size, group, dtype, max_query_len, num_sms
    (60, 6, 16, 64, 1, torch.float16, 8, 4),
    (61, 5, 32, 128, 2, torch.bfloat16, 16, 1),
    (62, 4, 16, 256, 4, torch.float16, 4, 8),
    (63, 7, 64, 64, 8, torch.bfloat16, 3, 16),
    (64, 5, 16, 128, 3, torch.float16, 33, 2),
]


def _multi_row_case(seed, batch, block_size, head_size, group, dtype, max_query_len):
    """A random forest with 0 to max_query_len new tokens per request (1 often,
    and computed contexts ending on either side of a chunk boundary)."""
    rng = np.random.default_rng(seed)
    table, seq_lens = random_forest(rng, batch, block_size, max_shared_blocks=4, max_private_blocks=3)
    query_lens = []
    for seq_len in seq_lens.tolist():
        boundary = (seq_len - 1) // block_size * block_size
        choices = [1, int(rng.integers(0, min(seq_len, max_query_len) + 1))]
        choices += [seq_len - c for c in (boundary - 1, boundary, boundary + 1) if c >= 0 and seq_len - c <= max_query_len]
        query_lens.append(choices[int(rng.integers(0, len(choices)))])
    query_lens = torch.tensor(query_lens, dtype=torch.int32)
    rows = expand_query_rows(table, seq_lens, query_lens)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).to(torch.int32)])
    query, kv_cache, _, _ = _decode_case(seed, 0, block_size, head_size, group, dtype,
                                         table=rows.block_table, seq_lens=rows.seq_lens)
    return query, kv_cache, table, seq_lens, qsl, rows


@pytest.mark.parametrize("seed,batch,block_size,head_size,group,dtype,max_query_len,num_sms", MULTI_ROW_CASES)
def test_tpp_decode_rows_of_several_tokens(emu, seed, batch, block_size, head_size, group, dtype, max_query_len,
                                           num_sms):
    query, kv_cache, table, seq_lens, qsl, rows = _multi_row_case(seed, batch, block_size, head_size, group, dtype,
                                                                  max_query_len)
    assert int((qsl[1:] - qsl[:-1]).max()) > 1, "the case must have a request of several tokens"
    ctx = prefix_tree(rows.block_table, rows.unmasked_lens, block_size)
    assert ctx.num_nodes > 0
    scale = 1 / math.sqrt(head_size)
    out = emu_decode(emu, query, kv_cache, rows.block_table, rows.seq_lens, ctx, scale, num_sms=num_sms)
    _check(out, reference_attention(query, kv_cache, qsl, seq_lens, table, scale), dtype)


def test_tpp_decode_stacked_rows_span_several_tiles(emu):
    """12 requests of 4 query tokens each on one 96-token prefix, GQA 2: the node
    stacks 96 query-head rows per KV head, more than one 64-row tile; each
    request's 4 rows also form a node over its private chunk."""
    block_size = 16
    table, seq_lens = multi_level(batch=12, levels=[(1, 96)], private=40, block_size=block_size)
    query_lens = torch.full((12,), 4, dtype=torch.int32)
    rows = expand_query_rows(table, seq_lens, query_lens)
    qsl = torch.arange(13, dtype=torch.int32) * 4
    query, kv_cache, _, _ = _decode_case(65, 0, block_size, 64, 2, torch.bfloat16,
                                         table=rows.block_table, seq_lens=rows.seq_lens)
    ctx = prefix_tree(rows.block_table, rows.unmasked_lens, block_size)
    covered = (ctx.node_end - ctx.node_begin).tolist()
    assert max(covered) == 48 and covered.count(4) == 12, covered  # the prefix node, and each request's own
    out = emu_decode(emu, query, kv_cache, rows.block_table, rows.seq_lens, ctx, 0.125, num_sms=6)
    _check(out, reference_attention(query, kv_cache, qsl, seq_lens, table, 0.125), torch.bfloat16)


PREFILL_CASES = [
    (50, 5, 16, 128, 1, torch.float16),
    (51, 4, 32, 64, 4, torch.bfloat16),
    (52, 3, 64, 256, 2, torch.float16),
    (53, 6, 128, 64, 8, torch.bfloat16),
    (54, 4, 16, 128, 3, torch.bfloat16),
]


@pytest.mark.parametrize("seed,batch,block_size,head_size,group,dtype", PREFILL_CASES)
def test_paged_prefill(emu, seed, batch, block_size, head_size, group, dtype):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    table, seq_lens = random_forest(rng, batch, block_size, max_shared_blocks=3, max_private_blocks=2)
    new = prefill_split(rng, seq_lens, max_new=90)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), new.cumsum(0).to(torch.int32)])
    num_kv_heads = 2
    kv_cache = random_kv_cache(num_blocks_needed(table), num_kv_heads, block_size, head_size, dtype, generator=gen)
    query = torch.randn(int(qsl[-1]), num_kv_heads * group, head_size, generator=gen).to(dtype)
    scale = 1 / math.sqrt(head_size)
    out = emu_prefill(emu, query, kv_cache, qsl, seq_lens, table, scale)
    expected = reference_attention(query, kv_cache, qsl, seq_lens, table, scale)
    _check(out, expected, dtype)


@pytest.mark.parametrize("name", list(KERNEL_VARIANTS))
def test_tpp_decode_attention_variants(emu, name):
    """Random trees with each variant: the merge adds a sink once per query
    however many pieces and splits a row has; ALiBi and soft-capping give the
    same logits in both phases; a window drops whole pieces and splits."""
    block_size, head_size, group, dtype = 16, 64, 2, torch.float16
    query, kv_cache, table, seq_lens = _decode_case(21, 10, block_size, head_size, group, dtype)
    ctx = prefix_tree(table, seq_lens, block_size)
    assert ctx.num_nodes > 0 and int(seq_lens.max()) > 2 * 37
    variant = attention_variant(KERNEL_VARIANTS[name], query.shape[1], torch.Generator().manual_seed(5))
    scale = 1 / math.sqrt(head_size)
    qsl = torch.arange(query.shape[0] + 1)
    expected = reference_attention(query, kv_cache, qsl, seq_lens, table, scale, **variant)
    plain = reference_attention(query, kv_cache, qsl, seq_lens, table, scale)
    assert (expected.float() - plain.float()).abs().max() > 10 * TOL[dtype]  # the variant matters here
    for num_sms in (1, 16):  # few and many pieces per node and splits per request
        out = emu_decode(emu, query, kv_cache, table, seq_lens, ctx, scale, num_sms=num_sms, **variant)
        _check(out, expected, dtype)


@pytest.mark.parametrize("window", [40, 100])
def test_tpp_decode_windows_that_start_inside_nodes(emu, window):
    """Every request's window starts inside a shared node (the 96-token root,
    or a 32-token child), at a different position per request: a chunk-first
    job must start exactly at the earliest window of the requests it covers,
    and mask the rest of each row's. With sinks, as gpt-oss has."""
    table, seq_lens = multi_level(batch=12, levels=[(1, 96), (2, 32)], private=20, block_size=16)
    seq_lens = seq_lens - (torch.arange(12, dtype=torch.int32) % 5)  # 144..148: windows start at 5 positions
    query, kv_cache, table, seq_lens = _decode_case(12, 0, 16, 64, 2, torch.float16, table=table, seq_lens=seq_lens)
    ctx = prefix_tree(table, seq_lens, 16)
    assert ctx.num_nodes == 3
    variant = attention_variant(dict(sliding_window=window, sinks=True), query.shape[1],
                                torch.Generator().manual_seed(6))
    qsl = torch.arange(13)
    expected = reference_attention(query, kv_cache, qsl, seq_lens, table, 0.125, **variant)
    for num_sms in (1, 16):
        _check(emu_decode(emu, query, kv_cache, table, seq_lens, ctx, 0.125, num_sms=num_sms, **variant), expected,
               torch.float16)


@pytest.mark.parametrize("name", list(KERNEL_VARIANTS))
def test_paged_prefill_attention_variants(emu, name):
    rng = np.random.default_rng(22)
    gen = torch.Generator().manual_seed(22)
    block_size, head_size, group, dtype, num_kv_heads = 16, 64, 3, torch.bfloat16, 2
    table, seq_lens = random_forest(rng, 4, block_size, max_shared_blocks=3, max_private_blocks=3)
    new = prefill_split(rng, seq_lens, max_new=90)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), new.cumsum(0).to(torch.int32)])
    kv_cache = random_kv_cache(num_blocks_needed(table), num_kv_heads, block_size, head_size, dtype, generator=gen)
    query = torch.randn(int(qsl[-1]), num_kv_heads * group, head_size, generator=gen).to(dtype)
    variant = attention_variant(KERNEL_VARIANTS[name], query.shape[1], gen)
    scale = 1 / math.sqrt(head_size)
    expected = reference_attention(query, kv_cache, qsl, seq_lens, table, scale, **variant)
    plain = reference_attention(query, kv_cache, qsl, seq_lens, table, scale)
    assert (expected.float() - plain.float()).abs().max() > 10 * TOL[dtype]
    _check(emu_prefill(emu, query, kv_cache, qsl, seq_lens, table, scale, **variant), expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_write_kv_cache(emu, dtype, slot_dtype):
    gen = torch.Generator().manual_seed(60)
    num_blocks, num_kv_heads, block_size, head_size = 6, 3, 16, 64
    tokens = 20
    qkv = torch.randn(tokens, 7 * num_kv_heads, head_size, generator=gen).to(dtype)  # fused projection
    key = qkv[:, 5 * num_kv_heads : 6 * num_kv_heads]
    value = qkv[:, 6 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(slot_dtype)
    slots[3] = -1  # padding
    cache = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size, generator=gen).to(dtype)
    expected = cache.clone()
    reference.write_kv_cache(key, value, expected, slots, kernels_device="cuda")
    err = emu.emu_write_kv_cache(
        _ptr(key), _ptr(value), _ptr(cache), _ptr(slots), int(slot_dtype == torch.int64), tokens, num_kv_heads,
        head_size, block_size, cache.element_size(),
        _strides(key.stride(0), key.stride(1), value.stride(0), value.stride(1), cache.stride(0), cache.stride(1)),
    )
    assert err is None, err.decode()
    assert torch.equal(cache, expected)


def _compile_script():
    """scripts/check_cuda_compile.py as a module (its shared-memory formula)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "check_cuda_compile.py"
    spec = importlib.util.spec_from_file_location("check_cuda_compile", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_compile_report_states_the_compiled_shared_memory(emu):
    """scripts/check_cuda_compile.py reports dynamic shared memory from a formula;
    it must equal what the kernels are compiled with."""
    script = _compile_script()
    for head_size in support.CUDA.head_sizes:
        assert script.dynamic_smem_bytes(head_size) == emu.emu_attention_smem_bytes(head_size, 0)
        for group in (1, 4, 16, 17, 64):
            compiled = emu.emu_attention_smem_bytes(head_size, group)
            assert script.dynamic_smem_bytes(head_size, group) == compiled
            assert compiled <= 99 * 1024
