"""Fake kernels of the `chunkattn` torch ops, for torch.compile / FakeTensor tracing.

The schemas are written once, in C++ (csrc/cpu/registration.cpp,
TORCH_LIBRARY(chunkattn, ...)); the CUDA extension adds CUDA kernels to them.
This module only registers a fake kernel per op, by name. The ops write into
their `(a!)` arguments and return nothing, so a fake checks the shapes and
dtypes the real kernel would reject and does nothing else.
"""

from __future__ import annotations

import torch

import vllm_chunkattn._C  # noqa: F401  (defines the op schemas)

_library = torch.library.Library("chunkattn", "FRAGMENT")


def _check_same(t: torch.Tensor, like: torch.Tensor, what: str) -> None:
    torch._check(t.shape == like.shape, lambda: f"{what} must have shape {tuple(like.shape)}, got {tuple(t.shape)}")
    torch._check(t.dtype == like.dtype, lambda: f"{what} must have dtype {like.dtype}, got {t.dtype}")


def _fake_write_kv_cache(key, value, kv_cache, slot_mapping) -> None:
    torch._check(key.dim() == 3, lambda: "key must be [num_tokens, num_kv_heads, head_size]")
    _check_same(value, key, "value")
    torch._check(kv_cache.dim() == 4 and kv_cache.shape[3] == 2 * key.shape[2],
                 lambda: "kv_cache must be [num_blocks, num_kv_heads, block_size, 2 * head_size]")
    torch._check(kv_cache.dtype == key.dtype, lambda: "key/value dtype must match the kv cache dtype")


def _fake_tpp_decode_plan(plan_header, plan_items, plan_node_work, plan_partial_work, plan_row_order, block_table,
                          seq_lens, order, node_begin, node_end, node_chunk_begin, node_chunk_end,
                          node_partial_offset, shared_chunks, row_partial_offsets, row_partials, num_partial_rows,
                          num_heads, num_kv_heads, head_size, block_size, dtype) -> None:
    # Runs in the metadata builder, outside any traced graph; the plan's sizes
    # depend on the tree's values, so a fake cannot give them.
    torch._check(num_heads % num_kv_heads == 0, lambda: "num_heads must be a multiple of num_kv_heads")


def _fake_tpp_decode(out, query, kv_cache, block_table, seq_lens, order, node_begin, node_end, node_chunk_begin,
                     node_chunk_end, node_partial_offset, shared_chunks, row_partial_offsets, row_partials,
                     plan_header, plan_items, plan_node_work, plan_partial_work, plan_row_order, scale,
                     sliding_window=0, logits_soft_cap=0.0, sinks=None, alibi_slopes=None) -> None:
    torch._check(query.dim() == 3, lambda: "query must be [batch, num_heads, head_size]")
    _check_same(out, query, "out")


def _fake_paged_prefill(out, query, kv_cache, query_start_loc, seq_lens, block_table, scale,
                        sliding_window=0, logits_soft_cap=0.0, sinks=None, alibi_slopes=None) -> None:
    torch._check(query.dim() == 3, lambda: "query must be [num_tokens, num_heads, head_size]")
    _check_same(out, query, "out")


def _fake_merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                            prefill_tokens_with_context=None) -> None:
    torch._check(output.dim() == 3, lambda: "output must be [num_tokens, num_heads, head_size]")
    _check_same(prefix_output, output, "prefix_output")
    _check_same(suffix_output, output, "suffix_output")
    lse_shape = (output.shape[1], output.shape[0])
    for name, lse in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse), ("output_lse", output_lse)):
        if lse is not None:
            torch._check(tuple(lse.shape) == lse_shape and lse.dtype == torch.float32,
                         lambda name=name: f"{name} must be float32 [num_heads, num_tokens] = {list(lse_shape)}")


FAKES = {
    "write_kv_cache": _fake_write_kv_cache,
    "tpp_decode_plan": _fake_tpp_decode_plan,
    "tpp_decode": _fake_tpp_decode,
    "paged_prefill": _fake_paged_prefill,
    "merge_attn_states": _fake_merge_attn_states,
}


def register() -> None:
    """Register the fake kernels (idempotent)."""
    for name, fake in FAKES.items():
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"chunkattn::{name}", "Meta"):
            continue  # registered by an earlier call
        torch.library.register_fake(f"chunkattn::{name}", fake, lib=_library)


register()
