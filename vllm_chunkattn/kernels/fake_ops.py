"""Schemas and fake (meta) implementations of the `chunkattn` torch ops.

The compiled CPU extension (csrc/cpu/registration.cpp) defines the schemas
with TORCH_LIBRARY(chunkattn, ...); the CUDA extension only adds CUDA kernels
(TORCH_LIBRARY_IMPL). Any schema the loaded CPU extension does not define
(an older build) is defined here, with the same text, so the CUDA kernels
still register and dispatch.

Fake implementations let torch.compile / FakeTensor tracing run through the
ops: they only mutate their `(a!)` argument (out, or kv_cache) and return
nothing, so the fakes check shapes cheaply and do nothing else.
"""

from __future__ import annotations

import torch

SCHEMAS = {
    "write_kv_cache": "write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
    "tpp_decode_plan": (
        "tpp_decode_plan(Tensor(a!) plan_header, Tensor(b!) plan_items, Tensor(c!) plan_node_work, "
        "Tensor(d!) plan_partial_work, Tensor(e!) plan_row_order, Tensor block_table, Tensor seq_lens, "
        "Tensor order, Tensor node_begin, Tensor node_end, Tensor node_chunk_begin, Tensor node_chunk_end, "
        "Tensor node_partial_offset, Tensor shared_chunks, Tensor row_partial_offsets, Tensor row_partials, "
        "int num_partial_rows, int num_heads, int num_kv_heads, int head_size, int block_size, "
        "ScalarType dtype) -> ()"
    ),
    "tpp_decode": (
        "tpp_decode(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor order, Tensor node_begin, Tensor node_end, Tensor node_chunk_begin, Tensor node_chunk_end, "
        "Tensor node_partial_offset, Tensor shared_chunks, Tensor row_partial_offsets, Tensor row_partials, "
        "Tensor plan_header, Tensor plan_items, Tensor plan_node_work, Tensor plan_partial_work, "
        "Tensor plan_row_order, float scale) -> ()"
    ),
    "paged_prefill": (
        "paged_prefill(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor block_table, float scale) -> ()"
    ),
}

_library = torch.library.Library("chunkattn", "FRAGMENT")


def _defined(name: str) -> bool:
    return hasattr(torch.ops.chunkattn, name)


def _fake_write_kv_cache(key, value, kv_cache, slot_mapping) -> None:
    torch._check(key.dim() == 3 and value.shape == key.shape, lambda: "key/value must be [tokens, heads, dim]")
    torch._check(kv_cache.dim() == 4, lambda: "kv_cache must be 4-D")


def _fake_tpp_decode_plan(plan_header, plan_items, plan_node_work, plan_partial_work, plan_row_order, block_table,
                          seq_lens, order, node_begin, node_end, node_chunk_begin, node_chunk_end,
                          node_partial_offset, shared_chunks, row_partial_offsets, row_partials, num_partial_rows,
                          num_heads, num_kv_heads, head_size, block_size, dtype) -> None:
    # Runs in the metadata builder, outside any traced graph; the plan's sizes
    # depend on the tree's values, so a fake cannot give them.
    torch._check(num_heads % num_kv_heads == 0, lambda: "num_heads must be a multiple of num_kv_heads")


def _fake_tpp_decode(out, query, kv_cache, block_table, seq_lens, order, node_begin, node_end, node_chunk_begin,
                     node_chunk_end, node_partial_offset, shared_chunks, row_partial_offsets, row_partials,
                     plan_header, plan_items, plan_node_work, plan_partial_work, plan_row_order, scale) -> None:
    torch._check(out.shape == query.shape, lambda: "out must have the query's shape")


def _fake_paged_prefill(out, query, kv_cache, query_start_loc, seq_lens, block_table, scale) -> None:
    torch._check(out.shape == query.shape, lambda: "out must have the query's shape")


_FAKES = {
    "write_kv_cache": _fake_write_kv_cache,
    "tpp_decode_plan": _fake_tpp_decode_plan,
    "tpp_decode": _fake_tpp_decode,
    "paged_prefill": _fake_paged_prefill,
}


def register() -> None:
    """Define the missing schemas and register the fakes (idempotent)."""
    for name, schema in SCHEMAS.items():
        if not _defined(name):
            _library.define(schema)
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"chunkattn::{name}", "Meta"):
            continue  # a compiled Meta kernel (or an earlier registration) is there
        try:
            torch.library.register_fake(f"chunkattn::{name}", _FAKES[name], lib=_library)
        except RuntimeError as e:  # registered by someone else already
            if "already" not in str(e):
                raise


register()
