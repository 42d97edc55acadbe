"""The `chunk` attention backend for vLLM: builder / metadata / impl.

Per step, the metadata builder splits the batch into decode requests (one new
token) and prefill requests (many: prefill, chunked prefill, prefill after a
prefix-cache hit), and derives the prefix tree of the decode requests from
their block tables (`tree.py`, cached across steps). Per layer, the impl
writes the new keys/values into the backend's own cache layout, runs the
two-phase-partition decode over the tree and causal paged attention for the
prefill rows.

KV cache layout: vLLM hands each layer a [num_blocks, num_kv_heads,
block_size, 2 * head_size] tensor (layout LBHNC); we read each block and KV
head as a key tile followed by a value tile (csrc/chunkattn.h).

On CUDA (csrc/cuda, docs/cuda.md) the kernels take float16/bfloat16, block
sizes 16 to 128, compute capability 8.0+; the decode context lives in
fixed-capacity device buffers (device_context.py), so pure-decode batches run
under vLLM's full CUDA graphs (AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from vllm_chunkattn import BACKEND_NAME, ops
from vllm_chunkattn.cuda_toolkit import MIN_COMPUTE_CAPABILITY
from vllm_chunkattn.device_context import DeviceTreeBuffers
from vllm_chunkattn.tree import PrefixTreeCache, PrefixTreeContext

logger = init_logger("vllm.chunkattn.backend")  # in vLLM's hierarchy, see plugin.py

SUPPORTED_HEAD_SIZES = [64, 128, 256]
SUPPORTED_BLOCK_SIZES = [32, 64, 128]
SUPPORTED_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The CUDA kernels (csrc/cuda): tensor-core MMA in float16/bfloat16 from sm_80 on
# (MIN_COMPUTE_CAPABILITY, shared with the build).
CUDA_BLOCK_SIZES = [16, 32, 64, 128]
CUDA_DTYPES = [torch.float16, torch.bfloat16]
# Capacity of the device tree context per decode request slot: partial-result
# rows (sum over shared nodes of the requests each covers). A deeper tree is
# cut to its top levels (device_context.fit_context), which stays exact.
CUDA_PARTIAL_ROWS_PER_REQUEST = 4


def _on_cuda() -> bool:
    return current_platform.is_cuda()


def _block_sizes(cuda: bool) -> list[int]:
    return CUDA_BLOCK_SIZES if cuda else SUPPORTED_BLOCK_SIZES


def _dtypes(cuda: bool) -> list[torch.dtype]:
    return CUDA_DTYPES if cuda else SUPPORTED_DTYPES


def _names(values) -> str:
    return ", ".join(str(v).replace("torch.", "") for v in values)


class ChunkAttentionBackend(AttentionBackend):
    # The layer calls do_kv_cache_update before forward.
    forward_includes_kv_cache_update: bool = False

    supported_dtypes: ClassVar[list[torch.dtype]] = SUPPORTED_DTYPES
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

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(_block_sizes(_on_cuda()))

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def validate_configuration(cls, **config) -> list[str]:
        """vLLM's reasons, reworded so each names what is supported."""
        return cls.configuration_reasons(_on_cuda(), **config)

    @classmethod
    def configuration_reasons(cls, cuda: bool, **config) -> list[str]:
        """Why `config` is unsupported on the CUDA (cuda=True) or CPU platform."""
        reasons = []
        head_size, block_size = config["head_size"], config["block_size"]
        dtypes, block_sizes = _dtypes(cuda), _block_sizes(cuda)
        if head_size not in SUPPORTED_HEAD_SIZES:
            reasons.append(f"head size {head_size} (supported: {_names(SUPPORTED_HEAD_SIZES)})")
        if config["dtype"] not in dtypes:
            on = " on CUDA" if cuda else ""
            reasons.append(f"dtype {_names([config['dtype']])}{on} (supported: {_names(dtypes)})")
        if config.get("kv_cache_dtype") not in (None, "auto"):
            reasons.append(
                f"kv_cache_dtype {config['kv_cache_dtype']} (supported: auto, i.e. the model dtype)"
            )
        if block_size is not None and block_size not in block_sizes:
            reasons.append(f"block size {block_size} (supported: {_names(block_sizes)})")
        if cuda:
            capability = config.get("device_capability")
            if capability is not None and (capability.major, capability.minor) < MIN_COMPUTE_CAPABILITY:
                reasons.append(
                    f"compute capability {capability.major}.{capability.minor} (supported: "
                    f"{MIN_COMPUTE_CAPABILITY[0]}.{MIN_COMPUTE_CAPABILITY[1]} and newer, e.g. A100, L4, H100)"
                )
            if not ops.cuda_kernels_available():
                reasons.append(
                    "running without its compiled CUDA kernels (vllm_chunkattn._C_cuda: "
                    f"{ops.CUDA_KERNELS_ERROR}) (supported: an installation built against a CUDA torch, "
                    "`pip install --no-build-isolation .[cuda]`, see docs/cuda.md)"
                )
        if config.get("use_batch_invariant"):
            reasons.append(
                "batch-invariant mode (supported: outputs that may change in the last bits with the "
                "batch's prefix tree)"
            )
        unsupported_features = {
            "use_mla": "MLA",
            "use_sparse": "sparse attention",
            "has_sink": "attention sinks",
            "has_sliding_window": "sliding-window attention",
            "use_mm_prefix": "multimodal prefix attention",
            "use_non_causal": "non-causal attention",
            "use_per_head_quant_scales": "per-head quantisation scales",
            "use_rswa": "R-SWA",
            "use_pcp": "prefill context parallelism",
            "use_dcp": "decode context parallelism",
        }
        for key, what in unsupported_features.items():
            if config.get(key):
                reasons.append(f"{what} (supported: causal decoder self-attention)")
        if config.get("attn_type", AttentionType.DECODER) != AttentionType.DECODER:
            reasons.append(
                f"attention type {config['attn_type']} (supported: decoder self-attention; "
                "no encoder or cross attention)"
            )
        return [f"{BACKEND_NAME} does not support {r}" for r in reasons]


class DecodeStats:
    """What the prefix tree saved, logged every `period_s` while decoding."""

    def __init__(self, block_size: int, period_s: float = 10.0) -> None:
        self.block_size = block_size
        self.period_s = period_s
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.since = now
        self.steps = self.requests = self.nodes = self.context_tokens = self.saved_tokens = 0

    def record(self, tree: PrefixTreeContext, seq_lens: torch.Tensor, builds: int, lookups: int) -> None:
        self.steps += 1
        self.requests += len(seq_lens)
        self.nodes += tree.num_nodes
        self.context_tokens += int(seq_lens.sum())
        self.saved_tokens += tree.reused_tokens(self.block_size)
        now = time.monotonic()
        if now - self.since >= self.period_s:
            logger.info(
                "%s prefix tree: %d decode steps, mean batch %.1f, mean %.1f shared nodes; "
                "%.0f%% of decode KV reads served once per batch; tree rebuilt in %d of %d steps so far",
                BACKEND_NAME, self.steps, self.requests / self.steps, self.nodes / self.steps,
                100.0 * self.saved_tokens / max(self.context_tokens, 1), builds, lookups,
            )
            self._reset(now)


@dataclass
class ChunkAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    # Decode requests come first in the batch (reorder_batch_threshold = 1).
    num_decodes: int
    num_decode_tokens: int
    decode_block_table: torch.Tensor
    decode_seq_lens: torch.Tensor
    tree: PrefixTreeContext | None
    # Prefill requests follow; their query rows start at num_decode_tokens.
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1], rebased to 0
    prefill_seq_lens: torch.Tensor
    prefill_block_table: torch.Tensor


class ChunkAttentionMetadataBuilder(AttentionMetadataBuilder[ChunkAttentionMetadata]):
    # Ask the runner to put single-token requests first, so decodes are one slice.
    reorder_batch_threshold: int | None = 1

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        """UNIFORM_SINGLE_TOKEN_DECODE with the CUDA kernels: pure-decode batches
        may replay full CUDA graphs, because the decode launches (KV write, TPP
        plan / attend / merge) size their grids and workspace from shapes
        only, read every value (block tables, sequence lengths, the tree
        context) from device buffers that stay in place (vLLM's persistent
        inputs, DeviceTreeBuffers here, refreshed by in-place copies in
        build()), and the Python forward takes no data-dependent branch within
        a pure-decode batch. Batches with prefills are not captured: the
        forward's decode/prefill split is fixed at capture. NEVER otherwise:
        the PyTorch fallback reads the tree on the host."""
        dtype = getattr(kv_cache_spec, "dtype", None)
        if _on_cuda() and ops.cuda_kernels_available() and dtype in CUDA_DTYPES:
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return AttentionCGSupport.NEVER

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        on_cuda = torch.device(device).type == "cuda"
        block_sizes = _block_sizes(on_cuda)
        if self.block_size not in block_sizes:
            raise ValueError(
                f"{BACKEND_NAME} does not support block size {self.block_size} "
                f"(supported: {_names(block_sizes)}); set --block-size"
            )
        # On CUDA with the compiled kernels, the decode context goes to fixed-
        # capacity device buffers (CUDA-graph safe); else it stays on the host.
        self.device_tree: DeviceTreeBuffers | None = None
        if on_cuda and ops.cuda_kernels_available() and kv_cache_spec.dtype in CUDA_DTYPES:
            max_batch = max(
                vllm_config.scheduler_config.max_num_seqs,
                vllm_config.compilation_config.max_cudagraph_capture_size or 0,
            )
            self.device_tree = DeviceTreeBuffers(
                max_batch=max_batch,
                max_nodes=max_batch - 1,
                max_partial_rows=CUDA_PARTIAL_ROWS_PER_REQUEST * max_batch,
                device=device,
            )
            logger.info_once(
                "%s attention on the CUDA kernels (vllm_chunkattn._C_cuda); CUDA graphs: "
                "UNIFORM_SINGLE_TOKEN_DECODE (pure-decode batches); tree context capacity: "
                "%d requests, %d nodes, %d partial rows.",
                BACKEND_NAME, max_batch, self.device_tree.max_nodes, self.device_tree.max_partial_rows,
            )
        if not vllm_config.cache_config.enable_prefix_caching:
            logger.warning(
                "%s attention with prefix caching disabled: requests share no KV "
                "blocks, so nothing is shared and decode runs as plain paged attention. "
                "Enable prefix caching to benefit.",
                BACKEND_NAME,
            )
        self.tree_cache = PrefixTreeCache()
        self.stats = DecodeStats(self.block_size)
        logger.info_once("Using %s attention backend (vllm_chunkattn).", BACKEND_NAME)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ChunkAttentionMetadata:
        cm = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=1
        )
        num_reqs = num_decodes + num_prefills
        block_table = cm.block_table_tensor[:num_reqs]
        seq_lens = cm.seq_lens[:num_reqs].cpu()
        decode_block_table = block_table[:num_decodes]
        decode_seq_lens = seq_lens[:num_decodes]
        tree = None
        if num_decodes:
            tree = self.tree_cache.get(decode_block_table.cpu(), decode_seq_lens, self.block_size)
            self.stats.record(tree, decode_seq_lens, self.tree_cache.builds, self.tree_cache.lookups)
        if self.device_tree is not None:
            # CUDA kernels: every input on the device, the tree in the fixed
            # buffers (copied only when it changed), the rest vLLM's own
            # persistent device tensors, so a captured decode graph reads this
            # step's values on replay.
            if tree is not None:
                tree = self.device_tree.load(tree, num_decodes)
            seq_lens, query_start_loc = cm.seq_lens[:num_reqs], cm.query_start_loc
        else:
            query_start_loc = cm.query_start_loc_cpu
        qsl = query_start_loc[num_decodes : num_reqs + 1]
        return ChunkAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            slot_mapping=cm.slot_mapping,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            decode_block_table=decode_block_table,
            decode_seq_lens=seq_lens[:num_decodes],
            tree=tree,
            prefill_query_start_loc=(qsl - qsl[:1]).to(torch.int32),
            prefill_seq_lens=seq_lens[num_decodes:],
            prefill_block_table=block_table[num_decodes:],
        )


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
        unsupported = []
        if alibi_slopes is not None:
            unsupported.append("ALiBi")
        if sliding_window is not None:
            unsupported.append(f"sliding window ({sliding_window})")
        if logits_soft_cap:
            unsupported.append(f"logits soft-cap ({logits_soft_cap})")
        if sinks is not None:
            unsupported.append("attention sinks")
        if attn_type != AttentionType.DECODER:
            unsupported.append(f"attention type {attn_type}")
        if kv_cache_dtype != "auto":
            unsupported.append(f"kv_cache_dtype {kv_cache_dtype}")
        if head_size not in SUPPORTED_HEAD_SIZES:
            unsupported.append(f"head size {head_size}")
        if num_heads % num_kv_heads:
            unsupported.append(f"{num_heads} query heads over {num_kv_heads} KV heads")
        if unsupported:
            raise NotImplementedError(
                f"{BACKEND_NAME} attention does not support: {', '.join(unsupported)}. "
                f"Supported: causal decoder self-attention, MHA or GQA, head sizes "
                f"{_names(SUPPORTED_HEAD_SIZES)}, dtypes {_names(SUPPORTED_DTYPES)}, "
                f"kv_cache_dtype auto, no ALiBi, sliding window, soft-cap or sinks."
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = float(scale)
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
        if md.num_decodes:
            # One row per decode request: in a CUDA-graph batch padded with
            # requests of no tokens, num_decode_tokens may be smaller; their
            # rows are padding the kernels fill with zeros.
            num_decodes = md.num_decodes
            ops.tpp_decode(
                query[:num_decodes],
                kv_cache,
                md.decode_block_table,
                md.decode_seq_lens,
                md.tree,
                self.scale,
                output[:num_decodes],
            )
        if md.prefill_seq_lens.numel():
            ops.paged_prefill(
                query[num_decode_tokens : md.num_actual_tokens],
                kv_cache,
                md.prefill_query_start_loc,
                md.prefill_seq_lens,
                md.prefill_block_table,
                self.scale,
                output[num_decode_tokens : md.num_actual_tokens],
            )
        return output
