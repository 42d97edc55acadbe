"""PensieveConnector: conversations keep their KV across turns in a host-memory
tier beside vLLM's KV cache, evicted by Pensieve's policy.

    vllm serve MODEL --kv-transfer-config \\
      '{"kv_connector": "PensieveConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_cache_gib": 4, "eviction_policy": "pensieve"}}'

How it runs (vLLM's KV-connector protocol; the two halves live in different
processes and talk only through the per-step metadata):

- scheduler side (``_Scheduler``): names every full block of a request by a
  chain key over its token ids (so a new turn, which resends the
  conversation, matches its earlier turns; and a key means the same prompt in
  every process and run). It keeps the tier's index (conversation_tree.py),
  answers vLLM's "how many more prompt tokens can you supply", and plans each
  step: which host rows to copy into which of the request's KV blocks
  (loads), which blocks to evict, which full blocks to copy out (stores).
  Stores are write-through and cover prompts and generated answers: every
  block a request has computed, at the step after it was computed, and the
  rest when the request finishes (its blocks are freed only after the copy).
- worker side (``_Worker``): a ``HostStore`` pool; runs a step's evictions,
  stores and loads before the forward pass, copying whole blocks as opaque
  bytes, so it works with any attention backend's cache layout.

A conversation is identified by its token prefix, and by the client's id when
the request carries one (`kv_transfer_params: {"conversation_id": ...}`, or
vLLM's session id): an id whose new turn no longer continues its cached turns
(edited history) marks the old branch to be evicted first.

Not cached (served, but neither stored nor loaded): requests with multimodal
inputs, LoRA adapters or a cache salt, whose KV depends on more than tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 KVConnectorRole)

from vllm_chunkattn.cache import CONNECTOR_NAME
from vllm_chunkattn.cache.block_store import BlockKey, BlockLayout, HostStore
from vllm_chunkattn.cache.conversation_tree import POLICIES, ConversationTree, make_policy

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.chunkattn.pensieve")

CONVERSATION_ID_PARAM = "conversation_id"
RESPONSE_PARAM = "pensieve"  # kv_transfer_params of a finished request: what it loaded


# ---------------------------------------------------------------------------
# Configuration (kv_connector_extra_config)


@dataclasses.dataclass(frozen=True)
class PensieveConfig:
    host_cache_gib: float = 4.0
    eviction_policy: str = "pensieve"

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> PensieveConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"{CONNECTOR_NAME}: unknown kv_connector_extra_config keys {unknown}; "
                             f"supported: {sorted(known)}")
        config = cls(**extra)
        if not (isinstance(config.host_cache_gib, (int, float)) and config.host_cache_gib > 0):
            raise ValueError(f"{CONNECTOR_NAME}: host_cache_gib must be a positive number of GiB; "
                             f"got {config.host_cache_gib!r}")
        if config.eviction_policy not in POLICIES:
            raise ValueError(f"{CONNECTOR_NAME}: eviction_policy must be one of {sorted(POLICIES)}; "
                             f"got {config.eviction_policy!r}")
        return config

    def host_blocks(self, block_bytes: int) -> int:
        return int(self.host_cache_gib * (1 << 30)) // block_bytes


def chain_keys(token_ids: list[int] | np.ndarray, block_size: int, start: int = 0,
               parent: BlockKey = b"") -> list[BlockKey]:
    """Keys of the full blocks of `token_ids` from block `start` on (`parent`: the key of block start - 1)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    keys = []
    for b in range(start, len(tokens) // block_size):
        parent = hashlib.sha256(parent + tokens[b * block_size:(b + 1) * block_size].tobytes()).digest()
        keys.append(parent)
    return keys


def block_bytes_of(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of one block over every attention layer: a host row."""
    return sum(group.kv_cache_spec.page_size_bytes * len(group.layer_names)
               for group in kv_cache_config.kv_cache_groups)


# ---------------------------------------------------------------------------
# What the scheduler tells the worker for one step


@dataclasses.dataclass
class BlockCopy:
    key: BlockKey
    block_id: int  # in vLLM's KV cache


@dataclasses.dataclass
class PensieveMetadata(KVConnectorMetadata):
    evictions: list[BlockKey] = dataclasses.field(default_factory=list)  # host rows freed first
    stores: list[BlockCopy] = dataclasses.field(default_factory=list)  # KV cache -> host rows
    loads: list[BlockCopy] = dataclasses.field(default_factory=list)  # host rows -> KV cache
    finished_after_store: list[str] = dataclasses.field(default_factory=list)  # request ids whose blocks can go


# ---------------------------------------------------------------------------
# Scheduler side


@dataclasses.dataclass
class _RequestState:
    keys: list[BlockKey]  # chain keys of the request's full blocks so far
    cacheable: bool
    local_hit_tokens: int = 0  # vLLM's own prefix-cache hit at admission
    loaded_blocks: int = 0  # supplied from the host tier at admission
    stored_blocks: int = 0  # leading blocks known to be in the host tier


class _Scheduler:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: PensieveConfig):
        self.block_size = vllm_config.cache_config.block_size
        self.block_bytes = block_bytes_of(kv_cache_config)
        self.capacity = config.host_blocks(self.block_bytes)
        if self.capacity < 1:
            raise ValueError(f"{CONNECTOR_NAME}: host_cache_gib={config.host_cache_gib} holds no block of "
                             f"{self.block_bytes} bytes")
        self.tree = ConversationTree(make_policy(config.eviction_policy))
        self.requests: dict[str, _RequestState] = {}
        self.pending = PensieveMetadata()
        logger.info("%s: host tier of %d blocks (%.2f GiB, %d bytes each), eviction policy %s", CONNECTOR_NAME,
                    self.capacity, config.host_cache_gib, self.block_bytes, config.eviction_policy)

    def _state(self, request: Request) -> _RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            cacheable = not (request.mm_features or request.lora_request or request.cache_salt)
            state = self.requests[request.request_id] = _RequestState([], cacheable)
        if state.cacheable:
            tokens = request.all_token_ids
            if len(tokens) // self.block_size > len(state.keys):
                state.keys += chain_keys(tokens, self.block_size, len(state.keys),
                                         state.keys[-1] if state.keys else b"")
        return state

    @staticmethod
    def _conversation_id(request: Request) -> str | None:
        params = request.kv_transfer_params or {}
        conversation = params.get(CONVERSATION_ID_PARAM) or getattr(request, "session_id", None)
        return str(conversation) if conversation is not None else None

    def on_new_request(self, request: Request) -> None:
        state = self._state(request)
        if state.cacheable:
            self.tree.touch(state.keys, time.monotonic(), self._conversation_id(request))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        state = self._state(request)
        if not state.cacheable:
            return 0, False
        # At least the last prompt token is computed: its logits start the answer.
        loadable = min(self.tree.match(state.keys) * self.block_size, request.num_tokens - 1)
        loadable -= loadable % self.block_size
        state.local_hit_tokens = num_computed_tokens
        return max(0, loadable - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        state = self._state(request)
        block_ids = blocks.get_block_ids()[0]
        first = state.local_hit_tokens // self.block_size  # our blocks follow the prefix cache's hit
        count = num_external_tokens // self.block_size
        copies = [BlockCopy(state.keys[b], block_ids[b]) for b in range(first, first + count)]
        self.tree.acquire([c.key for c in copies])
        self.pending.loads += copies
        state.loaded_blocks += count
        logger.debug("%s: request %s loads %d tokens from the host tier", CONNECTOR_NAME, request.request_id,
                     num_external_tokens)

    def _plan_stores(self, state: _RequestState, block_ids: list[int], num_computed: int) -> None:
        """Copies out the request's full blocks among its first `num_computed`
        tokens that the tier lacks, evicting for room as the policy chooses."""
        now = time.monotonic()
        full = min(num_computed // self.block_size, len(state.keys), len(block_ids))
        if full <= state.stored_blocks:
            return
        keys = state.keys[:full]
        stored = self.tree.match(keys)
        missing = full - stored
        free = self.capacity - len(self.tree)
        if missing > free:
            self.tree.acquire(keys[:stored])  # never evict this chain to make room for its own tail
            evicted = self.tree.evict(missing - free, now)
            self.tree.release(keys[:stored])
            self.pending.evictions += evicted
            logger.debug("%s: evicted %d blocks from the host tier (%s) to store %d", CONNECTOR_NAME,
                         len(evicted), self.tree.policy.name, missing)
        new = min(missing, self.capacity - len(self.tree))
        self.tree.insert(keys[:stored + new], now)
        self.pending.stores += [BlockCopy(keys[b], block_ids[b]) for b in range(stored, stored + new)]
        state.stored_blocks = stored + new

    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> PensieveMetadata:
        block_state = scheduler_output.kv_connector_block_state
        preempted = set(scheduler_output.preempted_req_ids or ())
        # Blocks computed in earlier steps: this step's forward pass does not write them.
        for request_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(request_id)
            if request is None or request_id in preempted:
                continue
            state = self._state(request)
            if state.cacheable and block_state is not None:
                self._plan_stores(state, block_state.get_block_ids(request_id)[0], request.num_computed_tokens)
        meta, self.pending = self.pending, PensieveMetadata()
        self.tree.release([c.key for c in meta.loads])
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Stores what the request computed since the last step; its blocks are
        freed once the worker has copied them (the next step)."""
        if request.request_id not in self.requests:
            return False, None
        state = self._state(request)
        stores_before = len(self.pending.stores)
        if state.cacheable:
            self._plan_stores(state, block_ids, request.num_computed_tokens)
        del self.requests[request.request_id]
        delay_free = len(self.pending.stores) > stores_before
        if delay_free:
            self.pending.finished_after_store.append(request.request_id)
        return delay_free, {RESPONSE_PARAM: {"host_loaded_tokens": state.loaded_blocks * self.block_size}}


# ---------------------------------------------------------------------------
# Worker side


class _Worker:
    def __init__(self, config: PensieveConfig, vllm_config: VllmConfig):
        self.config = config
        self.vllm_config = vllm_config
        self.layers: list[torch.Tensor] = []  # each [num_blocks, block bytes of the layer] uint8
        self.columns: list[slice] = []  # each layer's bytes within a host row
        self.store: HostStore | None = None
        self.meta = PensieveMetadata()
        self.finished_sending: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int, block_bytes: int) -> None:
        for name, kv in kv_caches.items():
            if kv.shape[0] != num_blocks or not kv.is_contiguous():
                raise ValueError(f"{CONNECTOR_NAME}: layer {name}'s KV cache is {tuple(kv.shape)} "
                                 f"(contiguous: {kv.is_contiguous()}); blocks must be its first dimension "
                                 f"({num_blocks}) and the tensor contiguous")
        layout = BlockLayout(self.vllm_config.model_config.model, self.vllm_config.cache_config.block_size,
                             tuple((str(kv.dtype).removeprefix("torch."), tuple(kv.shape[1:]))
                                   for kv in kv_caches.values()))
        if layout.block_bytes != block_bytes:
            raise ValueError(f"{CONNECTOR_NAME}: the KV cache's layers hold {layout.block_bytes} bytes per block, "
                             f"the scheduler planned with {block_bytes}")
        offset = 0
        for kv, width in zip(kv_caches.values(), layout.layer_bytes):
            self.layers.append(kv.view(torch.uint8).reshape(num_blocks, width))
            self.columns.append(slice(offset, offset + width))
            offset += width
        self.store = HostStore(layout, self.config.host_blocks(block_bytes))

    def run_step(self) -> None:
        """Evictions, then stores, then loads: a block stored this step (a
        request that just finished) may be loaded by another one this step.
        Every block copied out was computed in an earlier step and is held by
        its request, so this step's forward pass, before or after, leaves it be."""
        meta, self.meta = self.meta, PensieveMetadata()
        for key in meta.evictions:
            self.store.drop(key)
        if meta.stores:
            block_ids = torch.tensor([c.block_id for c in meta.stores], dtype=torch.long)
            rows = [self.store.put(c.key) for c in meta.stores]
            for layer, columns in zip(self.layers, self.columns):
                for row, data in zip(rows, layer.index_select(0, block_ids)):
                    row[columns].copy_(data)
        if meta.loads:
            block_ids = torch.tensor([c.block_id for c in meta.loads], dtype=torch.long)
            rows = torch.stack([self.store.get(c.key) for c in meta.loads])
            for layer, columns in zip(self.layers, self.columns):
                layer.index_copy_(0, block_ids, rows[:, columns])
        self.finished_sending.update(meta.finished_after_store)

    def get_finished(self, finished_req_ids: set[str]) -> set[str] | None:
        done = self.finished_sending & finished_req_ids
        self.finished_sending -= done
        return done or None


# ---------------------------------------------------------------------------
# The connector vLLM instantiates (one per role)


class PensieveConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = PensieveConfig.from_extra_config(dict(self._kv_transfer_config.kv_connector_extra_config))
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise ValueError(f"{CONNECTOR_NAME} supports one worker (tensor and pipeline parallel size 1); got "
                             f"tensor {parallel.tensor_parallel_size} x pipeline {parallel.pipeline_parallel_size}")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(f"{CONNECTOR_NAME} supports models with one KV cache group (every layer full "
                             f"attention); this model has {len(kv_cache_config.kv_cache_groups)}")
        self._scheduler = _Scheduler(vllm_config, kv_cache_config, config) \
            if role == KVConnectorRole.SCHEDULER else None
        self._worker = _Worker(config, vllm_config) if role == KVConnectorRole.WORKER else None
        self._requests: dict[str, Request] = {}

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a preempted request is simply recomputed.
        return False

    # -- scheduler side ------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output, self._requests)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return self._scheduler.request_finished(request, block_ids)

    # -- worker side ---------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks,
                                        block_bytes_of(self._kv_cache_config))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.meta = connector_metadata

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Before the forward pass when this step loads (vLLM orders it so), after it otherwise.
        self._worker.run_step()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids), None
