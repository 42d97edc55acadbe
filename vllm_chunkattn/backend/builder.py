"""Per step: the metadata builder, which splits the batch and plans the tree step.

The builder splits the batch into tree requests (few new tokens: decodes,
speculative decodes, short suffixes after a prefix-cache hit; the limit
is the platform's, kernels/support.py) and prefill requests (more:
prefill, chunked prefill), makes one row per query token of the tree requests
(prefix/query_rows.py), derives the prefix tree of those rows from their
block tables (prefix/tree.py, cached across steps) and builds the step's
plan (prefix/plan.py) once, for every layer to run (prefix/step.py). On
CUDA the tree context and the plan of a pure-decode batch live in
fixed-capacity device buffers (prefix/device_buffers.py, DecodeWork), so
those batches run under vLLM's full CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.config import VllmConfig
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec

from vllm_chunkattn import BACKEND_NAME
from vllm_chunkattn.backend.stats import DecodeStats, logger
from vllm_chunkattn.kernels import cpu_tuning, ops, tree_reach
from vllm_chunkattn.kernels.support import CUDA, for_platform, names, tree_max_query_len
from vllm_chunkattn.metrics import TreeMetricsWriter, metrics_writer
from vllm_chunkattn.prefix.device_buffers import DeviceTreeBuffers
from vllm_chunkattn.prefix.plan import DecodePlan, DecodeShape
from vllm_chunkattn.prefix.step import StepPlanner

# Capacity of the device tree context per decode request slot: partial-result
# rows (sum over shared nodes of the requests each covers). A deeper tree is
# cut to its top levels (device_buffers.fit_context), which stays exact.
CUDA_PARTIAL_ROWS_PER_REQUEST = 4


@dataclass
class ChunkAttentionMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    # Tree requests come first in the batch (reorder_batch_threshold); their
    # query tokens are the plan's rows, one each.
    num_decodes: int
    num_decode_tokens: int
    decode_plan: DecodePlan | None  # for every layer of the KV-cache group; None without tree requests
    # Prefill requests follow; their query rows start at num_decode_tokens.
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1], rebased to 0
    prefill_seq_lens: torch.Tensor
    prefill_block_table: torch.Tensor


class ChunkAttentionMetadataBuilder(AttentionMetadataBuilder[ChunkAttentionMetadata]):
    # Ask the runner to put the tree requests first, so they are one slice
    # (set per platform in __init__).
    reorder_batch_threshold: int | None = 1

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        """UNIFORM_SINGLE_TOKEN_DECODE with the CUDA kernels: pure-decode batches
        may replay full CUDA graphs, because the decode launches of a layer (KV
        write, TPP attend / merge) size their grids and workspace from shapes
        only, read every value (block tables, sequence lengths, the tree
        context, the step's plan) from device buffers that stay in place
        (vLLM's persistent inputs; DeviceTreeBuffers and the plan's DecodeWork
        here, refreshed in place by build(), whose TPP plan kernel runs on the
        stream before the replay), and the Python forward takes no
        data-dependent branch within a pure-decode batch. Batches with
        prefills or rows of several tokens are not captured: the forward's
        decode/prefill split is fixed at capture, and the context of rows of
        several tokens is sized to the step (prefix/step.py); with
        speculative decoding vLLM therefore captures attention piecewise.
        NEVER otherwise: the PyTorch fallback reads the tree on the host."""
        dtype = getattr(kv_cache_spec, "dtype", None)
        if current_platform.is_cuda() and ops.cuda_kernels_available() and dtype in CUDA.dtypes:
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
        # One shape for all layers of the group (vLLM groups layers by KV-cache
        # spec; the query heads are the model's): each layer checks it
        # against the plan (DecodePlan.check_layer).
        self.decode_shape = DecodeShape(
            num_heads=vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config),
            num_kv_heads=kv_cache_spec.num_kv_heads,
            head_size=kv_cache_spec.head_size,
            block_size=self.block_size,
            dtype=kv_cache_spec.dtype,
        )
        on_cuda = torch.device(device).type == "cuda"
        support = for_platform(on_cuda)
        block_sizes = support.block_sizes
        if self.block_size not in block_sizes:
            raise ValueError(
                f"{BACKEND_NAME} does not support block size {self.block_size} "
                f"(supported: {names(block_sizes)}); set --block-size"
            )
        # On CUDA with the compiled kernels, the decode context goes to fixed-
        # capacity device buffers (CUDA-graph safe); else it stays on the host.
        device_tree = None
        if on_cuda and ops.cuda_kernels_available() and kv_cache_spec.dtype in CUDA.dtypes:
            max_batch = max(
                vllm_config.scheduler_config.max_num_seqs,
                vllm_config.compilation_config.max_cudagraph_capture_size or 0,
            )
            device_tree = DeviceTreeBuffers(
                max_batch=max_batch,
                max_nodes=max_batch - 1,
                max_partial_rows=CUDA_PARTIAL_ROWS_PER_REQUEST * max_batch,
                device=device,
            )
            logger.info_once(
                "%s attention on the CUDA kernels (vllm_chunkattn._C_cuda); CUDA graphs: "
                "UNIFORM_SINGLE_TOKEN_DECODE (pure-decode batches); tree context capacity: "
                "%d requests, %d nodes, %d partial rows.",
                BACKEND_NAME, max_batch, device_tree.max_nodes, device_tree.max_partial_rows,
            )
        if not vllm_config.cache_config.enable_prefix_caching:
            # A cause of lost sharing, reported once (the others: README, Metrics).
            logger.warning_once(
                "%s attention with prefix caching disabled: requests share no KV "
                "blocks, so nothing is shared and decode runs as plain paged attention. "
                "Enable prefix caching to benefit.",
                BACKEND_NAME,
            )
        group = self.decode_shape.group
        built_in = support.tree_max_query_len(group)
        if not on_cuda:
            # The CPU kernels' tile parameters for this shape on this CPU, and
            # the longest query worth stacking in the tree: from the tuning
            # cache, else measured now (seconds; logged once).
            tuned = cpu_tuning.ensure_tuned(self.decode_shape)
            measure = lambda: tuned.tree_max_query_len(group)  # noqa: E731
        elif device_tree is not None:
            # Timed on this GPU for this shape (about a second; logged once).
            measure = lambda: tree_max_query_len(tree_reach.cuda_reach(self.decode_shape, device), group)  # noqa: E731
        else:
            measure = lambda: built_in  # noqa: E731
        # The threshold orders each worker's batch (decodes first), and the
        # ranks of a tensor- or pipeline-parallel model exchange activations
        # row by row, so all of them must order alike; each would time its own.
        max_query_len = _same_on_every_rank(measure, built_in)
        # Requests with at most max_query_len new tokens are "decodes" to
        # vLLM's batch reordering and take the tree path. Speculative
        # decoding's rows of 1 + k tokens take it too (vLLM raises the
        # threshold to them) where the kernels take rows of several tokens.
        self._init_reorder_batch_threshold(max_query_len,
                                           supports_spec_as_decode=support.tree_max_rows_per_kv_head > 1)
        self.planner = StepPlanner(self.decode_shape, device_tree, support.own_node_min_query_len)
        # A windowed group (vLLM's SlidingWindowSpec) reads each row's last
        # `sliding_window` keys only, and counts its reads so.
        self.stats = DecodeStats(self.block_size, sliding_window=getattr(kv_cache_spec, "sliding_window", None) or 0,
                                 metrics=_metrics_writer(vllm_config))
        logger.info_once("Using %s attention backend (vllm_chunkattn).", BACKEND_NAME)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ChunkAttentionMetadata:
        cm = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold
        )
        num_reqs = num_decodes + num_prefills
        block_table = cm.block_table_tensor[:num_reqs]
        host_seq_lens = _host_seq_lens(cm, num_reqs)
        on_device = cm.seq_lens.device.type != "cpu"
        decode_plan = None
        if num_decodes:
            query_lens, decode_host_lens = None, host_seq_lens[:num_decodes]
            if num_decode_tokens > num_decodes:  # some tree request has several new tokens
                qsl = cm.query_start_loc_cpu[: num_decodes + 1]
                query_lens = qsl[1:] - qsl[:-1]
                decode_host_lens = _exact_host_seq_lens(cm, num_decodes)
            # On CUDA a graph batch is padded with requests of no tokens, one row each.
            step = self.planner.plan(block_table[:num_decodes], cm.seq_lens[:num_decodes], decode_host_lens, query_lens)
            self.stats.record(step.tree, step.host_seq_lens, num_decodes, step.multi_token_rows,
                              self.planner.tree_cache.builds, self.planner.tree_cache.lookups,
                              plan_seconds=step.plan_seconds)
            decode_plan = step.plan
        if on_device:
            # vLLM's own persistent device tensors, so that a captured decode
            # graph reads this step's values on replay.
            seq_lens, query_start_loc = cm.seq_lens[:num_reqs], cm.query_start_loc
        else:
            seq_lens, query_start_loc = host_seq_lens, cm.query_start_loc_cpu
        qsl = query_start_loc[num_decodes : num_reqs + 1]
        return ChunkAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            slot_mapping=cm.slot_mapping,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            decode_plan=decode_plan,
            prefill_query_start_loc=(qsl - qsl[:1]).to(torch.int32),
            prefill_seq_lens=seq_lens[num_decodes:],
            prefill_block_table=block_table[num_decodes:],
        )


def _same_on_every_rank(measure: Callable[[], int], built_in: int) -> int:
    """A value every rank that runs this model's layers on the same batch agrees on: the smallest
    `measure()` of the tensor-parallel ranks, or `built_in` under pipeline parallelism (not measured
    there), whose stages may build different numbers of metadata builders (a hybrid model's layer kinds
    split unevenly), so that a collective per builder could wait forever. `measure()` itself in a single
    process."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return measure()
    if parallel_state.get_pp_group().world_size > 1:
        return built_in
    tp = parallel_state.get_tp_group()
    if tp.world_size == 1:
        return measure()
    smallest = torch.tensor([measure()], dtype=torch.int64)
    torch.distributed.all_reduce(smallest, op=torch.distributed.ReduceOp.MIN, group=tp.cpu_group)
    return int(smallest.item())


def _metrics_writer(vllm_config: VllmConfig) -> TreeMetricsWriter | None:
    """This process's writer of the Prometheus series, on the first rank of its
    tensor- and pipeline-parallel groups only: the other ranks build the same
    tree from the same block tables and would count each step again."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized() and (
        parallel_state.get_tensor_model_parallel_rank() != 0 or not parallel_state.get_pp_group().is_first_rank
    ):
        return None
    return metrics_writer(model_name=vllm_config.model_config.served_model_name,
                          engine=str(vllm_config.parallel_config.data_parallel_rank))


def _host_seq_lens(cm: CommonAttentionMetadata, num_reqs: int) -> torch.Tensor:
    """The requests' sequence lengths on the host, without a device-to-host copy
    where vLLM provides them: its GPU runner passes seq_lens_cpu_upper_bound,
    exact for every row except under asynchronous speculative decoding, whose
    rows of several tokens get _exact_host_seq_lens instead (on CPU seq_lens
    are host tensors anyway)."""
    if cm.seq_lens.device.type == "cpu":
        return cm.seq_lens[:num_reqs]
    if cm.seq_lens_cpu_upper_bound is not None:
        return cm.seq_lens_cpu_upper_bound[:num_reqs]
    return cm.seq_lens[:num_reqs].cpu()  # a caller that gives no host copy


def _exact_host_seq_lens(cm: CommonAttentionMetadata, num_reqs: int) -> torch.Tensor:
    """The sequence lengths of requests with several new tokens, exactly: their
    rows attend up to them. vLLM's host copy is an upper bound under
    asynchronous speculative decoding (rejected draft tokens), so on a device
    this is a copy of the device tensor; the step copies its block table to
    the host anyway."""
    if cm.seq_lens.device.type == "cpu":
        return cm.seq_lens[:num_reqs]
    return cm.seq_lens[:num_reqs].cpu()
