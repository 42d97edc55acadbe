"""Python entry points of the backend's kernels, one per kernel family.

Each op runs the compiled kernel registered for the tensors' device in the
`chunkattn` torch library (csrc/cpu on CPU, csrc/cuda on CUDA: one schema,
dispatched by device), and falls back to the PyTorch version in
`torch_fallback` where no compiled kernel fits (no extension built, or a dtype
the kernels do not take, such as float32 attention on CUDA). All are tested
against `reference.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

import vllm_chunkattn._C  # noqa: F401  (defines torch.ops.chunkattn.* and registers their CPU kernels)
from vllm_chunkattn.kernels import fake_ops  # noqa: F401  (fake kernels for torch.compile)
from vllm_chunkattn.kernels import support
from vllm_chunkattn.kernels import torch_fallback
from vllm_chunkattn.prefix.plan import DecodePlan, DecodeShape, DecodeWork
from vllm_chunkattn.prefix.tree import PrefixTreeContext

try:  # after _C: the CUDA library only adds kernels to the schemas defined there
    import vllm_chunkattn._C_cuda  # noqa: F401

    CUDA_KERNELS_ERROR: str | None = None
except ImportError as e:  # CPU-only build, or a build for another torch
    CUDA_KERNELS_ERROR = f"{type(e).__name__}: {e}"


def cuda_kernels_available() -> bool:
    """Whether the compiled CUDA kernels (vllm_chunkattn._C_cuda) are loaded."""
    return CUDA_KERNELS_ERROR is None


def _compiled(name: str, device: torch.device):
    """The compiled kernel of op `name` for `device`, or None."""
    return _compiled_for(name, device.type)


@functools.lru_cache(maxsize=None)
def _compiled_for(name: str, device_type: str):
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None or not torch._C._dispatch_has_kernel_for_dispatch_key(f"chunkattn::{name}", key):
        return None
    return getattr(torch.ops.chunkattn, name)


def _on(t: torch.Tensor, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return t if t.device == device and t.dtype == dtype else t.to(device=device, dtype=dtype)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value [num_tokens, num_kv_heads, head_size] into their slots of kv_cache."""
    kernel = _compiled("write_kv_cache", kv_cache.device)
    if kernel is None:
        return torch_fallback.write_kv_cache(key, value, kv_cache, slot_mapping)
    kernel(key, value, kv_cache, slot_mapping)


# The tree context's arrays, in the order of the ops' schemas (csrc/cpu/registration.cpp).
_CONTEXT_ARRAYS = (
    "order", "node_begin", "node_end", "node_chunk_begin", "node_chunk_end", "node_partial_offset",
    "shared_chunks", "row_partial_offsets", "row_partials",
)


def _context_arrays(ctx: PrefixTreeContext) -> list[torch.Tensor]:
    return [getattr(ctx, name) for name in _CONTEXT_ARRAYS]


def plan_tpp_decode(
    shape: DecodeShape,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    ctx: PrefixTreeContext,
    work: DecodeWork | None = None,
) -> DecodePlan:
    """The plan of one decode step (prefix/plan.py), for every layer of `shape`.

    block_table [B, max_blocks], seq_lens [B] and ctx's arrays on the device
    the layers run on (CPU arrays are copied to a CUDA block table's device).
    The context is validated here, once per step (CPU). `work`: tensors to
    fill (on CUDA the builder's fixed buffers); new ones when None."""
    device = block_table.device
    kernel = _compiled("tpp_decode_plan", device)
    if device.type == "cuda":
        ctx = dataclasses.replace(ctx, **{name: _on(getattr(ctx, name), device) for name in _CONTEXT_ARRAYS})
        seq_lens = _on(seq_lens, device)
    if kernel is None or (device.type == "cuda" and shape.dtype not in support.CUDA.dtypes):
        return DecodePlan(shape=shape, block_table=block_table, seq_lens=seq_lens, context=ctx, work=None)
    work = work or DecodeWork.empty(device)
    kernel(
        work.header, work.items, work.node_work, work.partial_work, work.row_order, block_table, seq_lens,
        *_context_arrays(ctx), ctx.num_partial_rows, shape.num_heads, shape.num_kv_heads, shape.head_size,
        shape.block_size, shape.dtype,
    )
    return DecodePlan(shape=shape, block_table=block_table, seq_lens=seq_lens, context=ctx, work=work)


def tpp_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    out: torch.Tensor,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Two-phase-partition decode of one layer: query/out [B, num_heads, head_size],
    running the step's `plan` (plan_tpp_decode), which must be for this layer's shape.
    sliding_window, logits_soft_cap: 0 for none; sinks, alibi_slopes: None or
    float32 [num_heads]; each as vLLM's (csrc/chunkattn.h)."""
    plan.check_layer(query, kv_cache)
    if plan.work is None:
        return torch_fallback.tpp_decode(query, kv_cache, plan.block_table, plan.seq_lens, plan.context, scale, out,
                                         sliding_window, logits_soft_cap, sinks, alibi_slopes)
    work = plan.work
    torch.ops.chunkattn.tpp_decode(
        out, query, kv_cache, plan.block_table, plan.seq_lens, *_context_arrays(plan.context), work.header,
        work.items, work.node_work, work.partial_work, work.row_order, scale, sliding_window, logits_soft_cap,
        sinks, alibi_slopes,
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
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of many new tokens per request over the paged cache.
    query/out [T, num_heads, head_size]; query_start_loc [R + 1] (starting at 0);
    the variant arguments as tpp_decode's."""
    device = query.device
    kernel = _compiled("paged_prefill", device)
    if kernel is None or (device.type == "cuda" and query.dtype not in support.CUDA.dtypes):
        return torch_fallback.paged_prefill(
            query, kv_cache, query_start_loc.tolist(), seq_lens.tolist(), block_table, scale, out, sliding_window,
            logits_soft_cap, sinks, alibi_slopes,
        )
    if device.type == "cuda":
        query_start_loc, seq_lens = _on(query_start_loc, device), _on(seq_lens, device)
        block_table = _on(block_table, device)
    kernel(out, query, kv_cache, query_start_loc, seq_lens, block_table, scale, sliding_window, logits_soft_cap, sinks,
           alibi_slopes)
    return out


def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None = None,
    prefill_tokens_with_context: int | None = None,
) -> None:
    """Merge two attention results of the same queries over disjoint keys, as
    vLLM's `merge_attn_states` (vllm/v1/attention/ops/merge_attn_states.py),
    argument for argument less its FP8 `output_scale`.

    output, prefix_output, suffix_output [T, H, D] of one dtype (head_size
    elements contiguous); prefix_lse, suffix_lse and the optional output_lse
    [H, T] float32, natural log. A part with lse = -inf (or +inf, as
    FlashAttention-2 marks a row that saw no key) contributes nothing; a token
    with both parts empty gets output 0 and lse -inf. Tokens from
    prefill_tokens_with_context on take the suffix as is."""
    device = output.device
    kernel = _compiled("merge_attn_states", device)
    if (kernel is None or (device.type == "cuda" and output.dtype not in support.CUDA.dtypes)
            or any(t.stride(-1) != 1 for t in (output, prefix_output, suffix_output))):
        return torch_fallback.merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse,
                                                output_lse, prefill_tokens_with_context)
    kernel(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, prefill_tokens_with_context)
