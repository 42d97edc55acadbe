"""The support table (kernels/support.py) is the one source: the backend's
capability methods, the impl's refusals and the README's table follow it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from unittest import mock

import pytest
import torch

from vllm_chunkattn.backend import ChunkAttentionBackend, ChunkAttentionImpl, chunk_backend
from vllm_chunkattn.kernels import support

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_support_table_is_generated_from_the_table():
    text = README.read_text()
    block = re.search(r"<!-- support-table:.*?-->\n(.*?)<!-- /support-table -->", text, re.S)
    assert block, "README.md lost its support-table markers"
    rows = block.group(1).strip().splitlines()
    assert rows[2:] == support.markdown_rows(), "regenerate the README table from support.markdown_rows()"


@pytest.mark.parametrize("platform", [support.CPU, support.CUDA], ids=lambda p: p.platform)
def test_backend_capabilities_follow_the_table(platform):
    with mock.patch.object(chunk_backend, "_on_cuda", lambda: platform is support.CUDA):
        assert ChunkAttentionBackend.get_supported_head_sizes() == list(platform.head_sizes)
        assert ChunkAttentionBackend.get_supported_kernel_block_sizes() == list(platform.block_sizes)
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            assert ChunkAttentionBackend.supports_dtype(dtype) == (dtype in platform.dtypes)
        for block_size in (8, 16, 32, 64, 128, 256):
            assert ChunkAttentionBackend.supports_block_size(block_size) == (block_size in platform.block_sizes)


def test_impl_refuses_a_head_size_outside_the_table():
    with pytest.raises(NotImplementedError, match=r"head size 96.*head sizes 64, 128, 256"):
        ChunkAttentionImpl(num_heads=8, head_size=96, scale=0.1, num_kv_heads=8, alibi_slopes=None,
                           sliding_window=None, kv_cache_dtype="auto")
    ChunkAttentionImpl(num_heads=8, head_size=support.CPU.head_sizes[0], scale=0.1, num_kv_heads=8,
                       alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")


def test_cuda_tree_reach_is_the_gpu_measurement():
    """CUDA.tree_max_rows_per_kv_head is what the GPU benchmark's relay grid
    measured (docs/results/nvidia-h200): the tree path at least as fast as our
    per-request prefill at every point within it, slower at some point just
    beyond it, in every recorded configuration."""
    from vllm_chunkattn.bench.kernel_gpu import relay_crossover

    reach = support.CUDA.tree_max_rows_per_kv_head
    runs = sorted((Path(__file__).resolve().parents[2] / "docs/results/nvidia-h200").glob("relay*.json"))
    assert len(runs) >= 4
    measured_reach = []
    for path in runs:
        run = json.loads(path.read_text())
        settings = run["meta"]["settings"]
        group = settings["heads"] // settings["kv_heads"]
        for row in run["rows"]:
            times = row["times_us"]
            if row["query_len"] * group <= reach and "chunk_prefill" in times:
                assert times["chunk"] <= times["chunk_prefill"], (path.name, row["query_len"])
        measured_reach.append(int(re.search(r"at most (\d+) query rows", relay_crossover(run["rows"], group))[1]))
    assert min(measured_reach) == reach
