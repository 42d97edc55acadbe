"""Per layer: the impl, which writes K/V into our cache layout and runs the kernels.

KV cache layout: vLLM hands each layer a [num_blocks, num_kv_heads,
block_size, 2 * head_size] tensor (layout LBHNC), read per block and KV head
as a key tile followed by a value tile (kernels/layout.py, csrc/chunkattn.h).
"""

from __future__ import annotations

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionImpl, AttentionLayer, AttentionType

from vllm_chunkattn import BACKEND_NAME
from vllm_chunkattn.backend.builder import ChunkAttentionMetadata
from vllm_chunkattn.kernels import ops
from vllm_chunkattn.kernels.support import VARIANTS, for_platform, names


class ChunkAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        support = for_platform(current_platform.is_cuda())
        unsupported = []
        if alibi_slopes is not None and not support.alibi:
            unsupported.append(f"ALiBi on {support.platform}")
        if sliding_window is not None and not support.sliding_window:
            unsupported.append(f"sliding window ({sliding_window}) on {support.platform}")
        if logits_soft_cap and not support.logits_soft_cap:
            unsupported.append(f"logits soft-cap ({logits_soft_cap}) on {support.platform}")
        if sinks is not None and not support.attention_sinks:
            unsupported.append(f"attention sinks on {support.platform}")
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type}")
        if kv_cache_dtype != "auto":
            unsupported.append(f"kv_cache_dtype {kv_cache_dtype}")
        if head_size not in support.head_sizes:
            unsupported.append(f"head size {head_size}")
        if num_heads % num_kv_heads:
            unsupported.append(f"{num_heads} query heads over {num_kv_heads} KV heads")
        if unsupported:
            supported = "".join(f", {v}" for v, flag in VARIANTS.items() if getattr(support, flag))
            refused = [v for v, flag in VARIANTS.items() if not getattr(support, flag)]
            raise NotImplementedError(
                f"{BACKEND_NAME} attention does not support: {', '.join(unsupported)}. "
                f"Supported: causal decoder self-attention, MHA or GQA, head sizes "
                f"{names(support.head_sizes)}, dtypes {names(support.dtypes)}, "
                f"kv_cache_dtype auto{supported}"
                + (f"; not {', '.join(refused)} on {support.platform}." if refused else ".")
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.sliding_window = sliding_window or 0  # the kernels' convention: 0 for none
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        # The layer's parameter, whose values are loaded after this: read at each forward.
        self.sinks = sinks
        # On the device the kernels run on, made once (a copy per forward would not survive CUDA-graph capture).
        self.alibi_slopes = (None if alibi_slopes is None else
                             torch.tensor(alibi_slopes, dtype=torch.float32, device=current_platform.device_type))
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        num_tokens = slot_mapping.shape[0]
        ops.write_kv_cache(key[:num_tokens], value[:num_tokens], kv_cache, slot_mapping)

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: ChunkAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME} does not support fused output quantisation")
        if attn_metadata is None:  # profiling run
            return output
        md = attn_metadata
        output = output.view(-1, self.num_heads, self.head_size)
        num_decode_tokens = md.num_decode_tokens
        # The kernels take float32 per-head vectors (a float32 sinks parameter is passed as it is).
        sinks = None if self.sinks is None else self.sinks.float()
        variant = dict(sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap, sinks=sinks,
                       alibi_slopes=self.alibi_slopes)
        if md.num_decodes:
            # One row per query token of the tree requests (prefix/query_rows.py).
            # In a CUDA-graph batch padded with requests of no tokens the plan
            # has one row per request, more than num_decode_tokens: those rows
            # are padding the kernels fill with zeros.
            rows = md.decode_plan.batch
            ops.tpp_decode(query[:rows], kv_cache, md.decode_plan, self.scale, output[:rows], **variant)
        if md.prefill_seq_lens.numel():
            ops.paged_prefill(
                query[num_decode_tokens : md.num_actual_tokens],
                kv_cache,
                md.prefill_query_start_loc,
                md.prefill_seq_lens,
                md.prefill_block_table,
                self.scale,
                output[num_decode_tokens : md.num_actual_tokens],
                **variant,
            )
        return output
