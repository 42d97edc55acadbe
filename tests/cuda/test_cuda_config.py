"""What the backend declares for CUDA, checked on any machine: the reasons
validate_configuration gives on the CUDA platform, the CUDA-graph support
level, and the fixed-capacity device tree context (on CPU tensors here)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm.v1.attention.backend import AttentionCGSupport

from vllm_chunkattn.backend import ChunkAttentionBackend, ChunkAttentionMetadataBuilder, chunk_backend
from vllm_chunkattn.kernels import ops, torch_fallback
from vllm_chunkattn.prefix.device_buffers import DeviceTreeBuffers, fit_context
from vllm_chunkattn.prefix.tree import prefix_tree
from vllm_chunkattn.testing import reference
from vllm_chunkattn.testing.paged_cases import multi_level, num_blocks_needed, random_forest, random_kv_cache

# What vLLM passes (platforms/cuda.py and cpu.py): the selector config plus device_capability.
BASE = dict(AttentionSelectorConfig(head_size=128, dtype=torch.float16, kv_cache_dtype="auto", block_size=16)._asdict(),
            device_capability=DeviceCapability(9, 0))


def reasons_on(cuda: bool, **config) -> list[str]:
    """validate_configuration as it runs on the CUDA (cuda=True) or the CPU platform."""
    with mock.patch.object(chunk_backend, "_on_cuda", lambda: cuda):
        return ChunkAttentionBackend.validate_configuration(**config)


def cuda_reasons(**change):
    reasons = reasons_on(True, **{**BASE, **change})
    # On a machine without the CUDA build there is always that reason too.
    return [r for r in reasons if "compiled CUDA kernels" not in r]


def test_cuda_supported_configurations():
    for head_size in (64, 128, 256):
        for dtype in (torch.float16, torch.bfloat16):
            for block_size in (16, 32, 64, 128):
                for major, minor in ((8, 0), (8, 6), (8, 9), (9, 0)):
                    assert cuda_reasons(head_size=head_size, dtype=dtype, block_size=block_size,
                                        device_capability=DeviceCapability(major, minor)) == []


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"dtype": torch.float32}, "dtype float32 on CUDA (supported: float16, bfloat16)"),
        ({"block_size": 8}, "block size 8 (supported: 16, 32, 64, 128)"),
        ({"block_size": 256}, "block size 256 (supported: 16, 32, 64, 128)"),
        ({"head_size": 96}, "head size 96 (supported: 64, 128, 256)"),
        ({"device_capability": DeviceCapability(7, 5)}, "compute capability 7.5 (supported: 8.0 and newer"),
        ({"use_batch_invariant": True}, "batch-invariant mode"),
    ],
)
def test_cuda_unsupported_configurations_say_what_is_supported(change, expected):
    reasons = cuda_reasons(**change)
    assert len(reasons) == 1 and expected in reasons[0], reasons
    assert reasons[0].startswith("CHUNK does not support")


def test_missing_cuda_build_is_a_reason():
    reasons = reasons_on(True, **BASE)
    if ops.cuda_kernels_available():
        assert reasons == []
    else:
        assert len(reasons) == 1 and "vllm_chunkattn._C_cuda" in reasons[0] and "docs/cuda.md" in reasons[0]


def test_cpu_reasons_unchanged():
    assert reasons_on(False, **{**BASE, "block_size": 16}) == [
        "CHUNK does not support block size 16 (supported: 32, 64, 128)"
    ]


def test_cudagraph_support_is_declared_honestly():
    class Spec:
        dtype = torch.float16

    level = ChunkAttentionMetadataBuilder.get_cudagraph_support(None, Spec())
    if torch.cuda.is_available() and ops.cuda_kernels_available():
        assert level == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    else:  # no compiled CUDA kernels here: the host-side fallback cannot be captured
        assert level == AttentionCGSupport.NEVER
    Spec.dtype = torch.float32
    assert ChunkAttentionMetadataBuilder.get_cudagraph_support(None, Spec()) == AttentionCGSupport.NEVER


FIT_BLOCK_SIZE = 4
# Deep trees: random forests (5 to 8 nodes) and a three-level tree (10 nodes).
FIT_TREES = {
    **{f"forest{seed}": (seed, None) for seed in (0, 1, 2, 4)},
    "three-levels": (0, [(1, 8), (3, 8), (2, 4)]),
}


def fit_tree(name: str):
    seed, levels = FIT_TREES[name]
    if levels is None:
        table, seq_lens = random_forest(np.random.default_rng(seed), 14, FIT_BLOCK_SIZE, max_shared_blocks=5)
    else:
        table, seq_lens = multi_level(12, levels, private=6, block_size=FIT_BLOCK_SIZE)
    full = prefix_tree(table, seq_lens, FIT_BLOCK_SIZE)
    assert full.num_nodes >= 3, "the case must be deep enough to be cut"
    return table, seq_lens, full


def nodes_of(ctx) -> list[tuple[int, int, int, int]]:
    """(begin, end, chunk_begin, chunk_end) per node."""
    return list(zip(ctx.node_begin.tolist(), ctx.node_end.tolist(), ctx.node_chunk_begin.tolist(),
                    ctx.node_chunk_end.tolist()))


def assert_decodes_exactly(table, seq_lens, ctx, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv = random_kv_cache(num_blocks_needed(table), 2, FIT_BLOCK_SIZE, 16, torch.float32, generator=gen)
    query = torch.randn(table.shape[0], 4, 16, generator=gen)
    expected = reference.paged_attention(query, kv, torch.arange(table.shape[0] + 1), seq_lens, table, 0.3)
    out = torch_fallback.tpp_decode(query, kv, table, seq_lens, ctx, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree", list(FIT_TREES))
def test_fit_context_returns_a_tree_that_fits_unchanged(tree):
    _, _, full = fit_tree(tree)
    assert fit_context(full, full.num_nodes, full.num_partial_rows) is full
    assert fit_context(full, full.num_nodes + 5, full.num_partial_rows + 50) is full


# Capacities as a function of the full tree's (nodes, partial rows): each is too small for it.
CUTS = {
    "one-node-short": lambda nodes, rows: (nodes - 1, rows),
    "one-row-short": lambda nodes, rows: (nodes, rows - 1),
    "top-node-only": lambda nodes, rows: (1, rows),
    "half-the-rows": lambda nodes, rows: (nodes, rows // 2),
    "no-capacity": lambda nodes, rows: (0, 0),
}


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("tree", list(FIT_TREES))
def test_fit_context_cuts_a_tree_too_large(tree, cut):
    table, seq_lens, full = fit_tree(tree)
    max_nodes, max_rows = CUTS[cut](full.num_nodes, full.num_partial_rows)
    ctx = fit_context(full, max_nodes, max_rows)
    assert ctx is not full
    assert ctx.num_nodes < full.num_nodes
    assert ctx.num_nodes <= max_nodes and ctx.num_partial_rows <= max_rows
    assert int(ctx.row_partial_offsets[-1]) == ctx.num_partial_rows == int((ctx.node_end - ctx.node_begin).sum())
    assert torch.equal(ctx.order, full.order)
    kept = nodes_of(ctx)
    assert set(kept) <= set(nodes_of(full))  # nodes are kept whole or dropped
    # Every request's shared chunks are still a prefix of its chunks: the kept
    # nodes covering it tile chunks [0, shared) without a gap.
    position = {row: pos for pos, row in enumerate(ctx.order.tolist())}
    for row, shared in enumerate(ctx.shared_chunks.tolist()):
        ranges = sorted((cb, ce) for b, e, cb, ce in kept if b <= position[row] < e)
        covered = 0
        for chunk_begin, chunk_end in ranges:
            assert chunk_begin == covered, (row, ranges)
            covered = chunk_end
        assert shared == covered <= int(full.shared_chunks[row])
    # A dropped node covered at least two requests: they lost shared chunks.
    assert int(ctx.shared_chunks.sum()) < int(full.shared_chunks.sum())
    assert_decodes_exactly(table, seq_lens, ctx, seed=len(kept))


@pytest.mark.parametrize("tree", list(FIT_TREES))
def test_full_tree_decodes_exactly(tree):
    table, seq_lens, full = fit_tree(tree)
    assert_decodes_exactly(table, seq_lens, full, seed=full.num_nodes)


def test_device_tree_buffers_copy_only_when_the_tree_changes():
    rng = np.random.default_rng(3)
    table, seq_lens = random_forest(rng, 8, 16)
    ctx = prefix_tree(table, seq_lens, 16)
    buffers = DeviceTreeBuffers(max_batch=10, max_nodes=9, max_partial_rows=40, device="cpu")
    view = buffers.load(ctx, 8)
    pointers = [t.data_ptr() for t in (view.order, view.node_begin, view.row_partials)]
    assert buffers.copies == 1 and view.num_partial_rows == 40 and view.node_begin.numel() == 9
    assert torch.equal(view.order, ctx.order)
    assert torch.equal(view.node_begin[: ctx.num_nodes], ctx.node_begin)
    assert int(view.node_end[ctx.num_nodes :].abs().sum()) == 0  # padding nodes are empty
    assert buffers.load(ctx, 8) is view and buffers.copies == 1
    other = prefix_tree(table[:6], seq_lens[:6], 16)
    view2 = buffers.load(other, 6)
    assert buffers.copies == 2
    # same storage: a captured graph reads the new values in place
    assert [t.data_ptr() for t in (view2.order, view2.node_begin, view2.row_partials)] == pointers
    assert torch.equal(view2.order, other.order)
    with pytest.raises(ValueError, match="capacity"):
        buffers.load(ctx, 11)


def test_cuda_accepts_every_attention_variant():
    """Sliding windows, soft-capping, sinks and ALiBi on CUDA: vLLM's selection and the impl accept them."""
    from vllm_chunkattn.backend import impl as impl_module

    assert cuda_reasons(has_sliding_window=True, has_sink=True) == []
    with mock.patch.object(impl_module.current_platform, "is_cuda", lambda: True):
        impl = impl_module.ChunkAttentionImpl(num_heads=8, head_size=128, scale=0.1, num_kv_heads=2,
                                              alibi_slopes=[0.5] * 8, sliding_window=128, kv_cache_dtype="auto",
                                              logits_soft_cap=30.0, sinks=torch.zeros(8))
    assert (impl.sliding_window, impl.logits_soft_cap, impl.alibi_slopes.tolist()) == (128, 30.0, [0.5] * 8)
