"""The chunkattn ops have schemas and fake implementations everywhere (CPU
build included), so torch.compile traces through them; on a CUDA build the
CUDA kernels are registered under the same schemas."""

from __future__ import annotations

import torch

from vllm_chunkattn.kernels import ops
from vllm_chunkattn.kernels.fake_ops import SCHEMAS


def test_every_op_has_a_schema_and_a_fake():
    for name in SCHEMAS:
        assert hasattr(torch.ops.chunkattn, name), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"chunkattn::{name}", "Meta"), name


def test_fakes_run_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(4, 8, 64, dtype=torch.float16)
        out = torch.empty_like(q)
        kv = torch.empty(10, 2, 16, 128, dtype=torch.float16)
        i = torch.empty(4, dtype=torch.int32)
        table = torch.empty(4, 3, dtype=torch.int32)
        rows = torch.empty(1, 4, dtype=torch.int32)
        torch.ops.chunkattn.tpp_decode(out, q, kv, table, i, i, i, i, i, i, i, i, torch.empty(5, dtype=torch.int32),
                                       i, torch.empty(12, dtype=torch.int32), rows, rows, rows, i, 0.1)
        torch.ops.chunkattn.paged_prefill(out, q, kv, torch.empty(2, dtype=torch.int32), i[:1], table[:1], 0.1)
        torch.ops.chunkattn.write_kv_cache(q[:, :2], q[:, :2], kv, i)


def test_torch_compile_traces_the_kv_write():
    """fullgraph=True fails on a graph break, i.e. if the op cannot be traced."""
    kv = torch.zeros(4, 2, 16, 128)
    key = torch.randn(3, 2, 64)
    value = torch.randn(3, 2, 64)
    slots = torch.tensor([5, -1, 17])

    def write(key, value, kv, slots):
        torch.ops.chunkattn.write_kv_cache(key, value, kv, slots)
        return kv.sum()

    compiled = torch.compile(write, backend="aot_eager", fullgraph=True)
    expected = kv.clone()
    ops.write_kv_cache(key, value, expected, slots)
    compiled(key, value, kv, slots)
    assert torch.equal(kv, expected)
