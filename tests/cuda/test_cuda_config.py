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
        ({"has_sliding_window": True}, "sliding-window attention"),
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


@pytest.mark.parametrize("seed", range(6))
def test_fit_context_keeps_results_exact(seed):
    rng = np.random.default_rng(seed)
    block_size = 4
    table, seq_lens = random_forest(rng, 14, block_size, max_shared_blocks=5)
    if seed % 2:
        table, seq_lens = multi_level(12, [(1, 8), (3, 8), (2, 4)], private=6, block_size=block_size)
    full = prefix_tree(table, seq_lens, block_size)
    gen = torch.Generator().manual_seed(seed)
    kv = random_kv_cache(num_blocks_needed(table), 2, block_size, 16, torch.float32, generator=gen)
    query = torch.randn(table.shape[0], 4, 16, generator=gen)
    expected = reference.paged_attention(query, kv, torch.arange(table.shape[0] + 1), seq_lens, table, 0.3)
    for max_nodes, max_rows in ((1, 100), (2, 6), (100, 3), (0, 0)):
        ctx = fit_context(full, max_nodes, max_rows)
        assert ctx.num_nodes <= max(max_nodes, 0) and ctx.num_partial_rows <= max_rows or ctx is full
        # shared chunks stay a prefix covered by kept nodes, so results stay exact
        out = torch_fallback.tpp_decode(query, kv, table, seq_lens, ctx, 0.3)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


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
