"""The fake kernels of the chunkattn ops (kernels/fake_ops.py) agree with the
real CPU kernels: every op that takes tensors has one, each passes
torch.library.opcheck on real inputs (the schema's mutation annotations match
what the kernel writes, and the fake's outputs match the real ones in shape,
dtype and aliasing), each rejects a wrongly shaped output as the real kernel
does, and torch.compile traces through the ops."""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vllm_chunkattn.kernels import fake_ops, ops
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.prefix.tree import prefix_tree
from vllm_chunkattn.testing.paged_cases import num_blocks_needed, random_kv_cache, shared_prefix


def _chunkattn_ops_taking_tensors() -> list[str]:
    names = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("chunkattn::"):
            continue
        name = qualified.split("::", 1)[1]
        schema = getattr(torch.ops.chunkattn, name).default._schema
        if any(isinstance(arg.type, torch.TensorType) or "Tensor" in str(arg.type) for arg in schema.arguments):
            names.append(name)
    return sorted(names)


def test_every_op_taking_tensors_has_a_fake_kernel():
    names = _chunkattn_ops_taking_tensors()
    assert {"write_kv_cache", "tpp_decode", "paged_prefill", "merge_attn_states"} <= set(names)
    for name in names:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"chunkattn::{name}", "Meta"), name
    assert set(fake_ops.FAKES) == set(names), "fake_ops.FAKES names an op the C++ library does not define"


def _decode_args(dtype=torch.float32, head_size=64):
    block_size, num_kv_heads, group = 32, 2, 2
    table, seq_lens = shared_prefix(batch=3, context=70, shared=64, block_size=block_size)
    ctx = prefix_tree(table, seq_lens, block_size)
    gen = torch.Generator().manual_seed(0)
    kv_cache = random_kv_cache(num_blocks_needed(table), num_kv_heads, block_size, head_size, dtype, generator=gen)
    query = torch.randn(table.shape[0], num_kv_heads * group, head_size, generator=gen).to(dtype)
    out = torch.empty_like(query)
    plan = ops.plan_tpp_decode(DecodeShape.of_layer(query, kv_cache), table, seq_lens, ctx)
    work = plan.work
    arrays = (ctx.order, ctx.node_begin, ctx.node_end, ctx.node_chunk_begin, ctx.node_chunk_end,
              ctx.node_partial_offset, ctx.shared_chunks, ctx.row_partial_offsets, ctx.row_partials)
    return (out, query, kv_cache, table, seq_lens, *arrays, work.header, work.items, work.node_work,
            work.partial_work, work.row_order, 1 / math.sqrt(head_size))


def _prefill_args(dtype=torch.float32, head_size=64):
    block_size, num_kv_heads, group = 32, 2, 2
    table, seq_lens = shared_prefix(batch=2, context=50, shared=32, block_size=block_size)
    gen = torch.Generator().manual_seed(1)
    kv_cache = random_kv_cache(num_blocks_needed(table), num_kv_heads, block_size, head_size, dtype, generator=gen)
    new_tokens = torch.tensor([5, 3], dtype=torch.int32)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), new_tokens.cumsum(0).to(torch.int32)])
    query = torch.randn(int(new_tokens.sum()), num_kv_heads * group, head_size, generator=gen).to(dtype)
    return (torch.empty_like(query), query, kv_cache, query_start_loc, seq_lens, table, 1 / math.sqrt(head_size))


def _write_kv_args(dtype=torch.float32):
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(3, 2, 64, generator=gen).to(dtype)
    value = torch.randn(3, 2, 64, generator=gen).to(dtype)
    return (key, value, torch.zeros(4, 2, 16, 128, dtype=dtype), torch.tensor([5, -1, 17]))


def _merge_args(dtype=torch.float32, with_output_lse=True):
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_size = 5, 3, 64
    parts = [torch.randn(tokens, heads, head_size, generator=gen).to(dtype) for _ in range(2)]
    lses = [torch.randn(heads, tokens, generator=gen) for _ in range(2)]
    output_lse = torch.empty(heads, tokens) if with_output_lse else None
    return (torch.empty(tokens, heads, head_size, dtype=dtype), parts[0], lses[0], parts[1], lses[1], output_lse, 3)


# tpp_decode_plan is not here: it runs in the metadata builder, outside traced graphs,
# and sizes its outputs from the tree's values, which a fake cannot know.
CASES = {
    "write_kv_cache": _write_kv_args,
    "tpp_decode": _decode_args,
    "paged_prefill": _prefill_args,
    "merge_attn_states": _merge_args,
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_real_against_fake(name, dtype):
    """Schema mutations, fake vs real outputs (shapes, dtypes, aliasing) and AOT dispatch on real inputs."""
    args = CASES[name](dtype)
    torch.library.opcheck(getattr(torch.ops.chunkattn, name).default, args)


def test_opcheck_merge_without_output_lse():
    torch.library.opcheck(torch.ops.chunkattn.merge_attn_states.default, _merge_args(with_output_lse=False))


def _wrong_output(name, args):
    """The op's arguments with its output (out, output or kv_cache) one column short."""
    args = list(args)
    index = 2 if name == "write_kv_cache" else 0
    args[index] = args[index][..., :-1].contiguous()
    return args


@pytest.mark.parametrize("name", list(CASES))
def test_fake_and_real_reject_a_wrongly_shaped_output(name):
    args = _wrong_output(name, CASES[name]())
    op = getattr(torch.ops.chunkattn, name)
    with pytest.raises(RuntimeError):
        op(*args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with pytest.raises(RuntimeError):
            op(*fake_args)


@pytest.mark.parametrize("name", list(CASES))
def test_fakes_accept_what_the_real_kernels_accept(name):
    args = CASES[name]()
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        getattr(torch.ops.chunkattn, name)(*fake_args)


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
