"""Python entry points of the backend's kernels, one per kernel family.

On CPU each op is the compiled kernel (csrc/cpu) when the extension
provides it, else the PyTorch version in `torch_kernels`; on other devices
the PyTorch version until the CUDA kernels exist. All are tested against
`reference.py`.
"""

from __future__ import annotations

import torch

import vllm_chunkattn._C  # noqa: F401  (registers torch.ops.chunkattn.*)
from vllm_chunkattn import torch_kernels
from vllm_chunkattn.tree import PrefixTreeContext


def _compiled(name: str):
    return getattr(torch.ops.chunkattn, name) if hasattr(torch.ops.chunkattn, name) else None


# Fake (meta) kernels, so torch.compile can trace through the ops: they only
# write into their `out` argument and return nothing.
if _compiled("tpp_decode") is not None:

    @torch.library.register_fake("chunkattn::tpp_decode")
    def _tpp_decode_fake(out, query, kv_cache, block_table, seq_lens, order, node_begin, node_end, node_chunk_begin,
                         node_chunk_end, node_partial_offset, shared_chunks, row_partial_offsets, row_partials,
                         num_partial_rows, scale) -> None:
        return None


if _compiled("paged_prefill") is not None:

    @torch.library.register_fake("chunkattn::paged_prefill")
    def _paged_prefill_fake(out, query, kv_cache, query_start_loc, seq_lens, block_table, scale) -> None:
        return None


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value [num_tokens, num_kv_heads, head_size] into their slots of kv_cache."""
    if kv_cache.device.type != "cpu":  # no compiled GPU kernel yet (issue 5)
        return torch_kernels.write_kv_cache(key, value, kv_cache, slot_mapping)
    torch.ops.chunkattn.write_kv_cache(key, value, kv_cache, slot_mapping)


def tpp_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    ctx: PrefixTreeContext,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Two-phase-partition decode: query/out [B, num_heads, head_size]."""
    kernel = _compiled("tpp_decode")
    if kernel is None or query.device.type != "cpu":
        return torch_kernels.tpp_decode(query, kv_cache, block_table, seq_lens, ctx, scale, out)
    kernel(
        out, query, kv_cache, block_table, seq_lens,
        ctx.order, ctx.node_begin, ctx.node_end, ctx.node_chunk_begin, ctx.node_chunk_end,
        ctx.node_partial_offset, ctx.shared_chunks, ctx.row_partial_offsets, ctx.row_partials,
        ctx.num_partial_rows, scale,
    )
    return out


def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of many new tokens per request over the paged cache.
    query/out [T, num_heads, head_size]; query_start_loc [R + 1] (starting at 0)."""
    kernel = _compiled("paged_prefill")
    if kernel is None or query.device.type != "cpu":
        return torch_kernels.paged_prefill(
            query, kv_cache, query_start_loc.tolist(), seq_lens.tolist(), block_table, scale, out
        )
    kernel(out, query, kv_cache, query_start_loc, seq_lens, block_table, scale)
    return out
