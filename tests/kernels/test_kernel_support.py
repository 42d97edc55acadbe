"""The CPU build instantiates its tiles for exactly what support.CPU (the one
table the backend's validation reads) promises: no head size or dtype the
backend accepts is missing, and none is compiled that nothing can reach."""

from __future__ import annotations

import pytest
import torch

import vllm_chunkattn._C as compiled
from vllm_chunkattn.kernels import support


def test_cpu_kernel_tables_match_the_support_table():
    built = compiled.kernel_support()
    assert tuple(built["head_sizes"]) == support.CPU.head_sizes
    assert tuple(getattr(torch, name) for name in built["dtypes"]) == support.CPU.dtypes


def test_cpu_kernels_reject_other_head_sizes_naming_the_supported_ones():
    head_size = 80  # a multiple of 16 the tiles could be built for, but are not
    assert head_size not in support.CPU.head_sizes
    query = torch.zeros(1, 2, head_size)
    kv_cache = torch.zeros(1, 2, 32, 2 * head_size)
    with pytest.raises(RuntimeError, match=f"head size {head_size} .*supported: {support.names(support.CPU.head_sizes)}"):
        torch.ops.chunkattn.paged_prefill(torch.empty_like(query), query, kv_cache, torch.tensor([0, 1]),
                                          torch.tensor([1]), torch.zeros(1, 1, dtype=torch.int32), 1.0)
