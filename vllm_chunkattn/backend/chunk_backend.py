"""The `chunk` attention backend class: what it supports and where its parts are.

vLLM asks a backend class for its capabilities through class methods
(head sizes, dtypes, block sizes, attention types, ...) and validates a
configuration with `validate_configuration`. Ours declares each capability
from the one support table (kernels/support.py) and lets the base class
decide, so a flag that a later vLLM adds is refused by vLLM's own check
rather than slipping past a copy of it; we only reword the reasons so that
each names what is supported.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import KVCacheLayout

from vllm_chunkattn import BACKEND_NAME
from vllm_chunkattn.backend.builder import ChunkAttentionMetadataBuilder
from vllm_chunkattn.backend.impl import ChunkAttentionImpl
from vllm_chunkattn.kernels import ops
from vllm_chunkattn.kernels.support import PlatformSupport, for_platform, names

# vLLM's reasons (AttentionBackend.validate_configuration) -> ours, which say what
# is supported. A reason not listed here (a check vLLM adds later) is kept as vLLM says it.
_CAUSAL_ONLY = "(supported: causal decoder self-attention)"
_REWORDED = {
    "MLA not supported": f"MLA {_CAUSAL_ONLY}",
    "sparse not supported": f"sparse attention {_CAUSAL_ONLY}",
    "partial multimodal token full attention not supported": f"multimodal prefix attention {_CAUSAL_ONLY}",
    "non-causal attention not supported": f"non-causal attention {_CAUSAL_ONLY}",
    "per-head quant scales not supported": f"per-head quantisation scales {_CAUSAL_ONLY}",
    "R-SWA not supported": f"R-SWA {_CAUSAL_ONLY}",
    "PCP not supported": f"prefill context parallelism {_CAUSAL_ONLY}",
    "DCP not supported": f"decode context parallelism {_CAUSAL_ONLY}",
    "batch invariance not supported": (
        "batch-invariant mode (supported: outputs that may change in the last bits with the batch's prefix tree)"
    ),
}


def _on_cuda() -> bool:
    return current_platform.is_cuda()


class ChunkAttentionBackend(AttentionBackend):
    # The layer calls do_kv_cache_update before forward.
    forward_includes_kv_cache_update: bool = False
    # The base class's supports_dtype reads this; every platform's dtypes, narrowed per
    # platform by supports_dtype below.
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[ChunkAttentionImpl]:
        return ChunkAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[ChunkAttentionMetadataBuilder]:
        return ChunkAttentionMetadataBuilder

    @classmethod
    def support(cls) -> PlatformSupport:
        return for_platform(_on_cuda())

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(for_platform(_on_cuda()).block_sizes)

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        # Exactly these: a chunk of the prefix tree is one vLLM block, so the base
        # class's "any multiple of a kernel block size" does not apply.
        return block_size is None or block_size in cls.support().block_sizes

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(cls.support().head_sizes)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.support().dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype is None or kv_cache_dtype in cls.support().kv_cache_dtypes

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        minimum = cls.support().min_compute_capability
        return minimum is None or capability is None or (capability.major, capability.minor) >= minimum

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return cls.support().sliding_window

    @classmethod
    def supports_sink(cls) -> bool:
        return cls.support().attention_sinks

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_combination(cls, *args, **kwargs) -> str | None:
        if _on_cuda() and not ops.cuda_kernels_available():
            return (
                "running without its compiled CUDA kernels (vllm_chunkattn._C_cuda: "
                f"{ops.CUDA_KERNELS_ERROR}) (supported: an installation built against a CUDA torch, "
                "`pip install --no-build-isolation .[cuda]`, see docs/cuda.md)"
            )
        return None

    @classmethod
    def validate_configuration(cls, **config) -> list[str]:
        """vLLM's reasons (the base class, from the capability methods above), reworded so
        that each names what is supported."""
        support = cls.support()
        on = " on CUDA" if support.platform == "CUDA" else ""
        capability = config.get("device_capability")
        specific = {
            "head_size not supported": f"head size {config.get('head_size')} (supported: {names(support.head_sizes)})",
            "dtype not supported": (
                f"dtype {names([config.get('dtype')])}{on} (supported: {names(support.dtypes)})"
            ),
            "kv_cache_dtype not supported": (
                f"kv_cache_dtype {config.get('kv_cache_dtype')} (supported: auto, i.e. the model dtype)"
            ),
            "block_size not supported": (
                f"block size {config.get('block_size')} (supported: {names(support.block_sizes)})"
            ),
            f"attention type {config.get('attn_type')} not supported": (
                f"attention type {config.get('attn_type')} (supported: decoder self-attention; "
                "no encoder or cross attention)"
            ),
        }
        if support.min_compute_capability is not None and capability is not None:
            major, minor = support.min_compute_capability
            specific["compute capability not supported"] = (
                f"compute capability {capability.major}.{capability.minor} (supported: {major}.{minor} "
                "and newer, e.g. A100, L4, H100)"
            )
        reasons = super().validate_configuration(**config)
        return [f"{BACKEND_NAME} does not support {specific.get(r) or _REWORDED.get(r) or r}" for r in reasons]

