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
- worker side (``_Worker``): a ``HostStore`` pool; runs a step's evictions
  when vLLM binds the step's metadata, then its stores and loads a layer at
  a time on a background thread (``_LayerCopier``) while the forward pass
  runs, each layer's attention waiting for that layer's copies
  (``wait_for_layer_load``). Whole blocks are copied as opaque bytes, so it
  works with any attention backend's cache layout.

With ``disk_cache_dir`` a third tier keeps blocks on disk (``DiskStore``),
written through from the host tier on a background thread, so conversations
outlive the host tier and the server: the scheduler reads the directory's
index at start. A prompt whose blocks are on disk but not in host memory
waits (vLLM keeps scheduling other requests) while the background thread
reads them into host rows, checking each block's checksum and identity; then
it loads from host memory as usual. A block that fails the check is dropped
with a warning, with everything after it, and recomputed: loads into vLLM's
KV cache only ever come from host memory, so they cannot fail.

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
import json
import logging
import os
import queue
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 KVConnectorRole, KVConnectorWorkerMetadata)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_chunkattn.cache import CONNECTOR_NAME
from vllm_chunkattn.cache.block_store import BadBlock, BlockKey, BlockLayout, DiskStore, HostStore
from vllm_chunkattn.cache.conversation_tree import POLICIES, ConversationTree, LruPolicy, make_policy
from vllm_chunkattn.cache.primary_order import PrimaryEvictionOrder
from vllm_chunkattn.kernels import layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("vllm.chunkattn.pensieve")

CONVERSATION_ID_PARAM = "conversation_id"
RESPONSE_PARAM = "pensieve"  # kv_transfer_params of a finished request: what it loaded
PINNED_REQUEST_ID = "pensieve-pinned-prompt"  # the engine-start requests that compute pinned prompts
# vLLM runs a connector's startup requests only with patches/0006 applied.
STARTUP_REQUESTS_HOOK = hasattr(KVConnectorBase_V1, "get_startup_requests")


def _is_pinned_prompt_request(request: Request) -> bool:
    return request.request_id.startswith(PINNED_REQUEST_ID)


# ---------------------------------------------------------------------------
# Configuration (kv_connector_extra_config)


@dataclasses.dataclass(frozen=True)
class PensieveConfig:
    host_cache_gib: float = 4.0
    eviction_policy: str = "pensieve"
    disk_cache_dir: str | None = None  # None: no disk tier
    disk_cache_gib: float = 64.0
    pinned_prompts: tuple[str, ...] = ()  # files: a prompt's text, or a JSON list of its token ids

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> PensieveConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"{CONNECTOR_NAME}: unknown kv_connector_extra_config keys {unknown}; "
                             f"supported: {sorted(known)}")
        if isinstance(extra.get("pinned_prompts"), list):
            extra = {**extra, "pinned_prompts": tuple(extra["pinned_prompts"])}
        config = cls(**extra)
        if not (isinstance(config.host_cache_gib, (int, float)) and config.host_cache_gib > 0):
            raise ValueError(f"{CONNECTOR_NAME}: host_cache_gib must be a positive number of GiB; "
                             f"got {config.host_cache_gib!r}")
        if config.eviction_policy not in POLICIES:
            raise ValueError(f"{CONNECTOR_NAME}: eviction_policy must be one of {sorted(POLICIES)}; "
                             f"got {config.eviction_policy!r}")
        if not (isinstance(config.disk_cache_gib, (int, float)) and config.disk_cache_gib > 0):
            raise ValueError(f"{CONNECTOR_NAME}: disk_cache_gib must be a positive number of GiB; "
                             f"got {config.disk_cache_gib!r}")
        if config.disk_cache_dir is not None:
            if not isinstance(config.disk_cache_dir, str) or not config.disk_cache_dir:
                raise ValueError(f"{CONNECTOR_NAME}: disk_cache_dir must be a directory path; "
                                 f"got {config.disk_cache_dir!r}")
            directory = Path(config.disk_cache_dir)
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"{CONNECTOR_NAME}: cannot create disk_cache_dir {directory}: {e}") from None
            try:
                tempfile.TemporaryFile(dir=directory).close()
            except OSError as e:
                raise ValueError(f"{CONNECTOR_NAME}: disk_cache_dir {directory} is not writable: {e}") from None
        if not (isinstance(config.pinned_prompts, tuple) and all(isinstance(p, str) for p in config.pinned_prompts)):
            raise ValueError(f"{CONNECTOR_NAME}: pinned_prompts must be a list of file paths; "
                             f"got {config.pinned_prompts!r}")
        for path in config.pinned_prompts:
            if not Path(path).is_file():
                raise ValueError(f"{CONNECTOR_NAME}: pinned prompt file {path} does not exist")
        return config

    def host_blocks(self, block_bytes: int) -> int:
        return int(self.host_cache_gib * (1 << 30)) // block_bytes

    def disk_blocks(self, block_bytes: int) -> int:
        return int(self.disk_cache_gib * (1 << 30)) // block_bytes


def chain_keys(token_ids: list[int] | np.ndarray, block_size: int, start: int = 0,
               parent: BlockKey = b"") -> list[BlockKey]:
    """Keys of the full blocks of `token_ids` from block `start` on (`parent`: the key of block start - 1)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    keys = []
    for b in range(start, len(tokens) // block_size):
        parent = hashlib.sha256(parent + tokens[b * block_size:(b + 1) * block_size].tobytes()).digest()
        keys.append(parent)
    return keys


def pinned_prompt_tokens(paths: tuple[str, ...], model_config: Any) -> list[list[int]]:
    """The token ids of each pinned prompt: a `.json` file holds them; any
    other file holds text, tokenized as vLLM tokenizes a completion prompt."""
    prompts = []
    for path in paths:
        text = Path(path).read_text()
        if path.endswith(".json"):
            try:
                tokens = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{CONNECTOR_NAME}: pinned prompt {path} is not JSON: {e}") from None
            if not (isinstance(tokens, list) and all(isinstance(t, int) and t >= 0 for t in tokens)):
                raise ValueError(f"{CONNECTOR_NAME}: pinned prompt {path} must be a JSON list of token ids")
        else:
            if model_config.skip_tokenizer_init:
                raise ValueError(f"{CONNECTOR_NAME}: pinned prompt {path} is text, but the engine has no "
                                 "tokenizer (skip_tokenizer_init); give its token ids as a .json list")
            from vllm.tokenizers.registry import cached_tokenizer_from_config

            tokens = cached_tokenizer_from_config(model_config).encode(text)
        # Checked here, not when the engine computes them at start: a bad one would kill it there.
        if not tokens:
            raise ValueError(f"{CONNECTOR_NAME}: pinned prompt {path} is empty")
        if len(tokens) >= model_config.max_model_len:
            raise ValueError(f"{CONNECTOR_NAME}: pinned prompt {path} has {len(tokens)} tokens; the model "
                             f"takes fewer than max_model_len={model_config.max_model_len}")
        vocab = model_config.get_vocab_size()
        if max(tokens) >= vocab:
            raise ValueError(f"{CONNECTOR_NAME}: pinned prompt {path} holds token id {max(tokens)}; the model's "
                             f"vocabulary has {vocab}")
        prompts.append(tokens)
    return prompts


def pinned_prompt_requests(prompts: list[list[int]]) -> list[EngineCoreRequest]:
    """One request per pinned prompt, each generating one token: the engine
    runs them before it serves (vLLM patch 0006), so that the prompts' blocks
    are computed, or read back from the disk tier, and pinned from the start."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    now = time.time()
    return [EngineCoreRequest(request_id=f"{PINNED_REQUEST_ID}-{i}", prompt_token_ids=list(tokens),
                              mm_features=None, sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
                              pooling_params=None, arrival_time=now, lora_request=None, cache_salt=None,
                              data_parallel_rank=None)
            for i, tokens in enumerate(prompts)]


def block_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> BlockLayout:
    """What a stored block holds, from what both halves know: one page of every
    attention layer, in the KV cache config's layer order. Its fingerprint names
    the weights (the checkpoint's files, not only its path) and what decides the
    bytes' layout, so a disk tier never serves another model's or layout's KV."""
    import vllm
    from vllm.platforms import current_platform

    layers = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        dtype = str(spec.dtype).removeprefix("torch.")
        itemsize = spec.dtype.itemsize
        layers += [(dtype, (spec.page_size_bytes // itemsize,))] * len(group.layer_names)
    model_config = vllm_config.model_config
    model = f"{model_config.model}@{model_config.revision or ''}"
    if os.path.isdir(model_config.model):
        files = sorted(p for p in Path(model_config.model).iterdir() if p.is_file())
        model += ";" + ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    specs = [f"{type(g.kv_cache_spec).__name__}({getattr(g.kv_cache_spec, 'num_kv_heads', '')}"
             f"x{getattr(g.kv_cache_spec, 'head_size', '')}): " + ",".join(g.layer_names)
             for g in kv_cache_config.kv_cache_groups]
    backend = vllm_config.attention_config.backend
    # The chunk backend's value tiles (kernels/layout.py): in key pairs or by row.
    values = "chunk value tiles in key pairs" if any(
        layout.values_in_pairs(g.kv_cache_spec.dtype, current_platform.device_type)
        for g in kv_cache_config.kv_cache_groups) else "chunk value tiles by row"
    kv_format = (f"{current_platform.device_type}; attention backend {getattr(backend, 'name', backend)}; "
                 f"cache dtype {vllm_config.cache_config.cache_dtype}; {values}; vLLM {vllm.__version__}; "
                 + "; ".join(specs))
    return BlockLayout(model, vllm_config.cache_config.block_size, tuple(layers), kv_format)


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
class DiskWrite:
    key: BlockKey
    parent: BlockKey | None  # None: the prompt's first block
    block_id: int | None = None  # where its data is: a block of vLLM's KV cache, or None: its host row


@dataclasses.dataclass
class PensieveMetadata(KVConnectorMetadata):
    """One step's work for the worker, in the order it runs it."""

    evictions: list[BlockKey] = dataclasses.field(default_factory=list)  # host rows freed first
    stores: list[BlockCopy] = dataclasses.field(default_factory=list)  # KV cache -> host rows
    loads: list[BlockCopy] = dataclasses.field(default_factory=list)  # host rows -> KV cache
    finished_after_store: list[str] = dataclasses.field(default_factory=list)  # request ids whose blocks can go
    # The disk tier, on the background thread, in this order:
    disk_drops: list[BlockKey] = dataclasses.field(default_factory=list)
    disk_writes: list[DiskWrite] = dataclasses.field(default_factory=list)  # host rows (after this step's stores)
    promotions: list[list[BlockKey]] = dataclasses.field(default_factory=list)  # chains read into new host rows


@dataclasses.dataclass
class PensieveWorkerMetadata(KVConnectorWorkerMetadata):
    """What the worker's background thread finished since the last step."""

    promoted: list[BlockKey] = dataclasses.field(default_factory=list)  # now readable in host rows
    # Each the part of a promoted chain that did not arrive: its first block was
    # bad (the worker has dropped those rows), the rest were not read.
    failed_promotions: list[list[BlockKey]] = dataclasses.field(default_factory=list)
    failed_writes: list[BlockKey] = dataclasses.field(default_factory=list)  # not on disk after all

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PensieveWorkerMetadata)
        return PensieveWorkerMetadata(self.promoted + other.promoted,
                                      self.failed_promotions + other.failed_promotions,
                                      self.failed_writes + other.failed_writes)


# ---------------------------------------------------------------------------
# Scheduler side


@dataclasses.dataclass
class _RequestState:
    keys: list[BlockKey]  # chain keys of the request's full blocks so far
    cacheable: bool
    local_hit_tokens: int = 0  # vLLM's own prefix-cache hit at admission
    loaded_blocks: int = 0  # supplied from the host tier at admission
    promoted: set[BlockKey] = dataclasses.field(default_factory=set)  # read from disk for this request
    promotion_holds: list[BlockKey] = dataclasses.field(default_factory=list)  # kept in host memory until admitted
    disk_loaded_blocks: int = 0  # of the loaded blocks, those
    stored_blocks: int = 0  # leading blocks known to be in the host tier


class _Tier:
    """One tier's index: which blocks it holds (a ConversationTree) and how many it can."""

    def __init__(self, name: str, capacity: int, policy: str, pinned: list[list[BlockKey]]):
        self.name = name
        self.capacity = capacity
        self.tree = ConversationTree(make_policy(policy))
        self.pinned = pinned  # chains pinned as soon as the tier holds them
        pinned_blocks = len({key for chain in pinned for key in chain})
        if pinned_blocks >= capacity:
            raise ValueError(f"{CONNECTOR_NAME}: the pinned prompts take {pinned_blocks} blocks, the {name} tier "
                             f"holds {capacity}; make it larger or pin less")

    def admit(self, keys: list[BlockKey], now: float) -> tuple[int, list[BlockKey], list[BlockKey]]:
        """Makes the chain `keys` stored as far as room allows, evicting as the
        policy chooses but never from this chain. Returns how many leading keys
        were stored already, the keys added after them, and the keys evicted."""
        stored = self.tree.match(keys)
        missing = len(keys) - stored
        evicted: list[BlockKey] = []
        free = self.capacity - len(self.tree)
        if missing > free:
            self.tree.acquire(keys[:stored])
            evicted = self.tree.evict(missing - free, now)
            self.tree.release(keys[:stored])
            logger.debug("%s: evicted %d blocks from the %s tier (%s) to store %d", CONNECTOR_NAME, len(evicted),
                         self.name, self.tree.policy.name, missing)
        new = min(missing, self.capacity - len(self.tree))
        added = self.tree.insert(keys[:stored + new], now)
        if added:
            for chain in self.pinned:
                self.tree.pin(chain)
        return stored, added, evicted


class _Scheduler:
    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: PensieveConfig,
                 layout: BlockLayout | None = None, pinned_prompts: list[list[int]] = ()):
        self.block_size = vllm_config.cache_config.block_size
        # The blocks before a pinned prompt's last token: that token may merge with the text that follows it.
        pinned = [chain_keys(tokens[:-1], self.block_size) for tokens in pinned_prompts]
        self.pinned_prompts = [tokens for tokens, chain in zip(pinned_prompts, pinned) if chain]
        if len(self.pinned_prompts) < len(pinned_prompts):
            logger.warning("%s: %d pinned prompts are shorter than a block and one token (%d tokens): they pin "
                           "nothing", CONNECTOR_NAME, len(pinned_prompts) - len(self.pinned_prompts),
                           self.block_size + 1)
        self.block_bytes = block_bytes_of(kv_cache_config)
        capacity = config.host_blocks(self.block_bytes)
        if capacity < 1:
            raise ValueError(f"{CONNECTOR_NAME}: host_cache_gib={config.host_cache_gib} holds no block of "
                             f"{self.block_bytes} bytes")
        self.host = _Tier("host", capacity, config.eviction_policy, pinned)
        self.requests: dict[str, _RequestState] = {}
        self.pending = PensieveMetadata()
        self.holds: list[tuple[ConversationTree, list[BlockKey]]] = []  # released once the step's metadata is out
        self.promoting: set[BlockKey] = set()  # host rows the worker is still reading from disk
        self.policy_name = config.eviction_policy
        self.primary: PrimaryEvictionOrder | None = None  # vLLM's own cache, once its block pool is bound
        logger.info("%s: host tier of %d blocks (%.2f GiB, %d bytes each), eviction policy %s", CONNECTOR_NAME,
                    capacity, config.host_cache_gib, self.block_bytes, config.eviction_policy)
        self.disk: _Tier | None = None
        if config.disk_cache_dir is not None:
            self.disk = _Tier("disk", config.disk_blocks(self.block_bytes), config.eviction_policy, pinned)
            store = DiskStore(config.disk_cache_dir, layout or block_layout(vllm_config, kv_cache_config))
            found = self._index_disk(store)
            logger.info("%s: disk tier of %d blocks (%.1f GiB) under %s; %d blocks kept from earlier runs",
                        CONNECTOR_NAME, self.disk.capacity, config.disk_cache_gib, store.directory, found)
            for chain in pinned:  # back in host memory before the first request
                self.host.tree.release(self._promote(chain, 0, 0))
        # Read from disk for the pinned prompts' startup requests (reported as theirs).
        self.pinned_promotions = {key for chain in self.pending.promotions for key in chain}
        if self.pinned_prompts:
            logger.info("%s: %d pinned prompts, %d blocks, never evicted; %s (%d blocks being read from disk "
                        "now)", CONNECTOR_NAME, len(self.pinned_prompts), sum(map(len, pinned)),
                        "computed, or read from disk, before the engine serves" if STARTUP_REQUESTS_HOOK else
                        "computed by the first request that holds one (vLLM lacks patches/0006: run "
                        "`python -m vllm_chunkattn.install.patching apply`)", sum(map(len, self.pending.promotions)))

    def _index_disk(self, store: DiskStore) -> int:
        """Rebuilds the disk tier's tree from the block files' headers. Blocks
        whose parent is gone can never be matched: their files are deleted, as
        are the policy's choices when the directory holds more than the tier may."""
        children: dict[BlockKey | None, list] = defaultdict(list)
        entries = list(store.scan())
        for entry in entries:
            children[entry.parent].append(entry)
        age = time.time() - time.monotonic()  # file times are wall-clock, the tree's monotonic
        parents: list[BlockKey | None] = [None]
        while parents:
            parent = parents.pop()
            for entry in children.pop(parent, ()):
                self.disk.tree.add_child(parent, entry.key, entry.mtime - age)
                parents.append(entry.key)
        orphans = [entry.key for group in children.values() for entry in group]
        over = max(0, len(self.disk.tree) - self.disk.capacity)
        for chain in self.disk.pinned:
            self.disk.tree.pin(chain)
        for key in orphans + self.disk.tree.evict(over, time.monotonic()):
            store.drop(key)
        return len(self.disk.tree)

    def bind_block_pool(self, block_pool: Any) -> None:
        """vLLM's cache keeps its own LRU order under `lru`; any other policy orders it too."""
        if self.policy_name != LruPolicy.name:
            self.primary = PrimaryEvictionOrder(block_pool, make_policy(self.policy_name))

    def _state(self, request: Request) -> _RequestState:
        state = self.requests.get(request.request_id)
        if state is None:
            cacheable = not (request.mm_features or request.lora_request or request.cache_salt)
            state = self.requests[request.request_id] = _RequestState([], cacheable)
            if _is_pinned_prompt_request(request):
                state.promoted.update(self.pinned_promotions)
        if state.cacheable:
            tokens = request.all_token_ids
            if len(tokens) // self.block_size > len(state.keys):
                state.keys += chain_keys(tokens, self.block_size, len(state.keys),
                                         state.keys[-1] if state.keys else b"")
        return state

    def _hold(self, tree: ConversationTree, keys: list[BlockKey]) -> None:
        """Keeps `keys` from eviction until this step's metadata has gone out
        (a block planned for a copy this step must still be there when it runs)."""
        tree.acquire(keys)
        self.holds.append((tree, keys))

    @staticmethod
    def _conversation_id(request: Request) -> str | None:
        params = request.kv_transfer_params or {}
        conversation = params.get(CONVERSATION_ID_PARAM) or getattr(request, "session_id", None)
        return str(conversation) if conversation is not None else None

    def on_new_request(self, request: Request) -> None:
        state = self._state(request)
        if state.cacheable:
            now, conversation = time.monotonic(), self._conversation_id(request)
            for tier in (self.host, self.disk):
                if tier is not None:
                    tier.tree.touch(state.keys, now, conversation)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if not state.cacheable:
            return 0, False
        # At least the last prompt token is computed: its logits start the answer.
        usable = (request.num_tokens - 1) // self.block_size
        keys = state.keys[:usable]
        in_host = self.host.tree.match(keys)
        ready = next((b for b in range(in_host) if keys[b] in self.promoting), in_host)
        if ready < in_host:
            return None, False  # blocks of this prompt are on their way from disk
        if self.disk is not None:
            promoted = self._promote(keys, ready, num_computed_tokens)
            if promoted:
                state.promoted.update(promoted)
                state.promotion_holds += promoted
                return None, False
        state.local_hit_tokens = num_computed_tokens
        return max(0, ready * self.block_size - num_computed_tokens), False

    def _promote(self, keys: list[BlockKey], in_host: int, num_computed_tokens: int) -> list[BlockKey]:
        """Starts reading the prompt's blocks that only the disk holds into host
        rows, if that gets it past vLLM's own hit. Returns the blocks."""
        on_disk = self.disk.tree.match(keys)
        if on_disk <= max(in_host, num_computed_tokens // self.block_size):
            return []
        now = time.monotonic()
        _, added, evicted = self.host.admit(keys[:on_disk], now)
        self.pending.evictions += evicted
        if added:  # else no room: every host block is pinned or in use
            self.host.tree.acquire(added)
            self.disk.tree.acquire(added)
            self.promoting.update(added)
            self.pending.promotions.append(added)
        return added

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._state(request)
        self._release_promotion_holds(state)
        if num_external_tokens == 0:
            return
        block_ids = blocks.get_block_ids()[0]
        first = state.local_hit_tokens // self.block_size  # our blocks follow the prefix cache's hit
        count = num_external_tokens // self.block_size
        copies = [BlockCopy(state.keys[b], block_ids[b]) for b in range(first, first + count)]
        self._hold(self.host.tree, [c.key for c in copies])
        self.pending.loads += copies
        state.loaded_blocks += count
        state.disk_loaded_blocks += sum(c.key in state.promoted for c in copies)
        logger.debug("%s: request %s loads %d tokens from the host tier", CONNECTOR_NAME, request.request_id,
                     num_external_tokens)

    def _release_promotion_holds(self, state: _RequestState) -> None:
        """Blocks read from disk for a request stay in host memory until it is
        admitted (its loads hold them then) or gone: a small host tier would
        otherwise evict them again before the request could use them."""
        self.host.tree.release(state.promotion_holds)
        state.promotion_holds = []

    def _plan_stores(self, state: _RequestState, block_ids: list[int], num_computed: int) -> None:
        """Copies out the request's full blocks among its first `num_computed`
        tokens that the host tier lacks, and writes them through to disk."""
        full = min(num_computed // self.block_size, len(state.keys), len(block_ids))
        if full <= state.stored_blocks:
            return
        now = time.monotonic()
        keys = state.keys[:full]
        stored, added, evicted = self.host.admit(keys, now)
        self.pending.evictions += evicted
        self.pending.stores += [BlockCopy(key, block_ids[b]) for b, key in enumerate(added, stored)]
        self._hold(self.host.tree, added)
        state.stored_blocks = stored + len(added)
        if self.disk is not None:
            # Write-through: from host rows, or from the KV cache for blocks the host tier had no room for.
            on_disk, written, dropped = self.disk.admit(keys, now)
            self.pending.disk_drops += dropped
            self.pending.disk_writes += [
                DiskWrite(key, keys[b - 1] if b else None, None if b < state.stored_blocks else block_ids[b])
                for b, key in enumerate(written, on_disk)]
            self._hold(self.disk.tree, written)
            self._hold(self.host.tree, [key for b, key in enumerate(written, on_disk) if b < state.stored_blocks])

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
        if self.primary is not None:
            self.primary.step(time.monotonic())
        meta, self.pending = self.pending, PensieveMetadata()
        for tree, keys in self.holds:
            tree.release(keys)
        self.holds = []
        return meta

    def update_connector_output(self, output: PensieveWorkerMetadata) -> None:
        """The background thread's results: promoted blocks become loadable;
        a bad block on disk is forgotten with everything after it (recomputed)."""
        for key in output.promoted:
            self.promoting.discard(key)
            self.disk.tree.release([key])
        for chain in output.failed_promotions:
            self.promoting.difference_update(chain)
            self.disk.tree.release(chain)
            # The worker dropped the chain's own rows; blocks stored under them since go too.
            removed = self.host.tree.remove(chain[0])
            self.pending.evictions += [k for k in removed if k not in chain]
            self._forget(self.host.tree, set(removed))
            self._drop_from_disk(chain[0])
        for key in output.failed_writes:
            self._drop_from_disk(key)

    def _drop_from_disk(self, key: BlockKey) -> None:
        removed = self.disk.tree.remove(key)
        self.pending.disk_drops += removed
        self._forget(self.disk.tree, set(removed))

    def _forget(self, tree: ConversationTree, removed: set[BlockKey]) -> None:
        """Blocks just removed from `tree` are neither copied into that tier
        this step nor released later (a new block of the same key is another)."""
        if tree is self.host.tree:
            self.pending.stores = [c for c in self.pending.stores if c.key not in removed]
            for state in self.requests.values():
                state.promotion_holds = [k for k in state.promotion_holds if k not in removed]
        else:
            self.pending.disk_writes = [w for w in self.pending.disk_writes if w.key not in removed]
        self.holds = [(t, [k for k in keys if t is not tree or k not in removed]) for t, keys in self.holds]

    def reset_cache(self) -> bool:
        """Empties the host tier but for pinned prompts (vLLM's /reset_prefix_cache with
        reset_external). The disk tier stays: it is meant to outlive the server; delete its
        directory to clear it. False while blocks are being copied: try again."""
        self.pending.evictions += self.host.tree.evict(len(self.host.tree), time.monotonic())
        for state in self.requests.values():
            state.stored_blocks = 0
        pinned = len({key for chain in self.host.pinned for key in chain if key in self.host.tree})
        return len(self.host.tree) == pinned

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Stores what the request computed since the last step; its blocks are
        freed once the worker has copied them (the next step)."""
        if self.primary is not None:
            self.primary.on_request_finished(block_ids, time.monotonic())
        if request.request_id not in self.requests:
            return False, None
        state = self._state(request)
        self._release_promotion_holds(state)
        stores_before = len(self.pending.stores)
        if state.cacheable:
            self._plan_stores(state, block_ids, request.num_computed_tokens)
        del self.requests[request.request_id]
        if _is_pinned_prompt_request(request):
            logger.info("%s: pinned prompt %s: %d tokens, %d of them from the host tier (%d read from disk)",
                        CONNECTOR_NAME, request.request_id.rsplit("-", 1)[1], request.num_prompt_tokens,
                        state.loaded_blocks * self.block_size, state.disk_loaded_blocks * self.block_size)
        delay_free = len(self.pending.stores) > stores_before
        if delay_free:
            self.pending.finished_after_store.append(request.request_id)
        return delay_free, {RESPONSE_PARAM: {"host_loaded_tokens": state.loaded_blocks * self.block_size,
                                             "disk_loaded_tokens": state.disk_loaded_blocks * self.block_size}}


# ---------------------------------------------------------------------------
# Worker side


class _DiskIO:
    """The disk tier's background thread: drops, writes and promotions (disk
    to host rows), one at a time in the order given, so a block written is
    on disk before a later read or drop of it runs. Results are collected
    for the scheduler (``drain``)."""

    def __init__(self, store: DiskStore):
        self.store = store
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._done = PensieveWorkerMetadata()
        self._thread = threading.Thread(target=self._run, name="pensieve-disk", daemon=True)
        self._thread.start()

    def drop(self, key: BlockKey) -> None:
        self._queue.put((self.store.drop, key))

    def write(self, item: DiskWrite, data: torch.Tensor) -> None:
        self._queue.put((self._write, item, data))

    def promote(self, keys: list[BlockKey], rows: list[torch.Tensor]) -> None:
        self._queue.put((self._promote, keys, rows))

    def _write(self, item: DiskWrite, data: torch.Tensor) -> None:
        try:
            self.store.write(item.key, item.parent, data)
        except OSError as e:
            logger.warning("%s: cannot write a block to the disk tier (%s); it stays in host memory only",
                           CONNECTOR_NAME, e)
            with self._lock:
                self._done.failed_writes.append(item.key)

    def _promote(self, keys: list[BlockKey], rows: list[torch.Tensor]) -> None:
        for i, (key, row) in enumerate(zip(keys, rows)):
            try:
                self.store.read_into(key, row)
            except BadBlock as e:
                logger.warning("%s: a block on disk is unusable (%s); it and the %d blocks after it are recomputed",
                               CONNECTOR_NAME, e, len(keys) - i - 1)
                with self._lock:
                    self._done.failed_promotions.append(keys[i:])
                return
            with self._lock:
                self._done.promoted.append(key)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                job[0](*job[1:])
            except Exception:  # a bug, not a disk error: keep serving from the other tiers
                logger.exception("%s: disk tier job failed", CONNECTOR_NAME)
                if job[0] == self._promote:
                    with self._lock:
                        self._done.failed_promotions.append(job[1])
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def flush(self) -> None:
        """Waits until every queued job has run."""
        self._queue.join()

    def drain(self) -> PensieveWorkerMetadata:
        with self._lock:
            done, self._done = self._done, PensieveWorkerMetadata()
        return done

    def close(self) -> None:
        """Finishes the queued writes (a restart finds them), then stops."""
        self._queue.put(None)
        self._thread.join()


@dataclasses.dataclass
class _CopyTimes:
    """Where the worker's time goes: its copies against the forward steps
    they sit in (from binding a step's metadata to waiting for its saves),
    and how long the forward pass waited for them (what the overlap left)."""

    steps: int = 0
    step_s: float = 0.0
    loaded_blocks: int = 0
    load_s: float = 0.0
    stored_blocks: int = 0
    store_s: float = 0.0
    waited_s: float = 0.0

    def summary(self) -> str:
        share = (self.load_s + self.store_s) / self.step_s if self.step_s else 0.0
        waited = self.waited_s / self.step_s if self.step_s else 0.0
        return (f"host-tier copies took {share:.1%} of the forward steps' time ({self.steps} steps, "
                f"{self.step_s:.1f} s): loads of {self.loaded_blocks} blocks {self.load_s:.3f} s, stores of "
                f"{self.stored_blocks} blocks {self.store_s:.3f} s; the forward pass waited for them "
                f"{self.waited_s:.3f} s ({waited:.1%})")


@dataclasses.dataclass
class _StepCopies:
    """One step's copies, as (host row, KV cache block) pairs: stores copy
    the block out to the row, loads the row into the block."""

    stores: list[tuple[int, int]]
    loads: list[tuple[int, int]]


class _LayerCopier:
    """Runs a step's copies a layer at a time on a background thread, so that
    layer L's copies overlap the forward pass through the layers before L.
    ``wait(L)``, from the attention of layer L, returns once they are done; a
    layer the thread has not begun by then, the waiting thread copies itself,
    so a wait costs no more than copying in the forward pass would. A copy
    that fails is raised in the forward pass: a layer must never run on KV
    that did not arrive."""

    def __init__(self, copy_layer: Any, num_layers: int):
        self._copy_layer = copy_layer  # (layer index, _StepCopies) -> None
        self._num_layers = num_layers
        self._cond = threading.Condition()
        self._copies: _StepCopies | None = None
        self._next = num_layers  # the next layer to claim (num_layers: none left)
        self._done = [True] * num_layers
        self._error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="pensieve-copies", daemon=True)
        self._thread.start()

    def start(self, copies: _StepCopies) -> None:
        self.wait_all()  # the previous step's, if vLLM did not wait for them
        with self._cond:
            self._copies, self._next, self._done = copies, 0, [False] * self._num_layers
        self._queue.put(copies)

    def _claim(self, copies: _StepCopies | None) -> int | None:
        """The next layer to copy of step `copies`, or None (called under the lock)."""
        if copies is not self._copies or self._next >= self._num_layers:
            return None
        self._next += 1
        return self._next - 1

    def _copy(self, layer: int, copies: _StepCopies) -> None:
        try:
            self._copy_layer(layer, copies)
        except BaseException as e:  # noqa: BLE001 -- handed to the forward pass, which raises it
            with self._cond:
                self._error, self._next = e, self._num_layers
                self._cond.notify_all()
            return
        with self._cond:
            if copies is self._copies:  # not a step that failed and was replaced meanwhile
                self._done[layer] = True
            self._cond.notify_all()

    def wait_all(self) -> None:
        """Every layer's copies: a layer may still be in the thread's hands when the waiter has copied the
        layers after it."""
        for layer in range(self._num_layers):
            self.wait(layer)

    def wait(self, layer: int) -> None:
        while True:
            with self._cond:
                if self._error is None and not self._done[layer]:
                    claimed = self._claim(self._copies) if self._next <= layer else None
                    if claimed is None:
                        self._cond.wait()
                        continue
                    copies = self._copies
                elif self._error is not None:
                    error, self._error = self._error, None
                    self._done = [True] * self._num_layers
                    raise RuntimeError(f"{CONNECTOR_NAME}: a host-tier copy failed") from error
                else:
                    return
            self._copy(claimed, copies)

    def _run(self) -> None:
        while (copies := self._queue.get()) is not None:
            while True:
                with self._cond:
                    layer = self._claim(copies)
                if layer is None:
                    break
                self._copy(layer, copies)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class _Worker:
    def __init__(self, config: PensieveConfig, layout: BlockLayout, layer_names: list[str]):
        self.config = config
        self.layout = layout
        self.layer_names = layer_names  # the layout's layer order
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.layers: list[torch.Tensor] = []  # each [num_blocks, block bytes of the layer] uint8
        self.columns: list[slice] = []  # each layer's bytes within a host row
        self.device = torch.device("cpu")
        self.store = HostStore(layout, config.host_blocks(layout.block_bytes))
        self.disk = _DiskIO(DiskStore(config.disk_cache_dir, layout)) if config.disk_cache_dir else None
        self.meta = PensieveMetadata()
        self._step_meta: PensieveMetadata | None = None  # the step whose copies are under way
        self.copier: _LayerCopier | None = None  # KV cache in host memory: copies on a background thread
        self._copying = False  # the copier has this step's copies
        self.finished_sending: set[str] = set()
        self.times = _CopyTimes()
        self._step_start: float | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        offset = 0
        for name, width in zip(self.layer_names, self.layout.layer_bytes):
            kv = kv_caches[name]
            if kv.shape[0] != num_blocks or not kv.is_contiguous():
                raise ValueError(f"{CONNECTOR_NAME}: layer {name}'s KV cache is {tuple(kv.shape)} "
                                 f"(contiguous: {kv.is_contiguous()}); blocks must be its first dimension "
                                 f"({num_blocks}) and the tensor contiguous")
            if kv[0].numel() * kv.element_size() != width:
                raise ValueError(f"{CONNECTOR_NAME}: layer {name}'s KV cache holds "
                                 f"{kv[0].numel() * kv.element_size()} bytes per block, the scheduler planned "
                                 f"with {width}")
            self.layers.append(kv.view(torch.uint8).reshape(num_blocks, width))
            self.device = kv.device  # host rows are in host memory whatever the KV cache's device
            self.columns.append(slice(offset, offset + width))
            offset += width
        if self.device.type == "cpu":
            # numpy's copies release the GIL and stay on the copier's thread (torch's
            # would start an OpenMP team of their own beside the forward pass's).
            self._layers_np = [layer.numpy() for layer in self.layers]
            self._rows_np = self.store.rows.numpy()
            self.copier = _LayerCopier(self._copy_layer, len(self.layers))

    def _copy_layer(self, layer: int, copies: _StepCopies) -> None:
        """Layer `layer`'s stores, then its loads (the copier's numpy copies; the
        waiter's too): a block stored this step (a request that just finished)
        may be loaded by another one this step."""
        started = time.perf_counter()
        columns, kv, rows = self.columns[layer], self._layers_np[layer], self._rows_np
        for row, block in copies.stores:
            rows[row, columns] = kv[block]
        stored = time.perf_counter()
        for row, block in copies.loads:
            kv[block] = rows[row, columns]
        self.times.store_s += stored - started
        self.times.load_s += time.perf_counter() - stored

    def _copy_in_forward_pass(self, copies: _StepCopies) -> None:
        """An accelerator's KV cache: every layer's stores, then every layer's
        loads, with torch's copies in the forward pass's stream."""
        started = time.perf_counter()
        if copies.stores:
            rows = torch.tensor([r for r, _ in copies.stores], dtype=torch.long)
            blocks = torch.tensor([b for _, b in copies.stores], dtype=torch.long, device=self.device)
            for kv, columns in zip(self.layers, self.columns):
                self.store.rows[rows, columns] = kv.index_select(0, blocks).cpu()
        stored = time.perf_counter()
        if copies.loads:
            rows = torch.tensor([r for r, _ in copies.loads], dtype=torch.long)
            blocks = torch.tensor([b for _, b in copies.loads], dtype=torch.long, device=self.device)
            for kv, columns in zip(self.layers, self.columns):
                kv.index_copy_(0, blocks, self.store.rows[rows, columns].to(self.device))
        self.times.store_s += stored - started
        self.times.load_s += time.perf_counter() - stored

    def start_step(self) -> None:
        """Evictions (host rows freed first), then the step's stores and loads,
        layer by layer: on the copier's thread, overlapping the forward pass,
        or at once on an accelerator. Every block copied out was computed in an
        earlier step and is held by its request, and every block loaded lies
        before the request's first new token, so the forward pass, which writes
        only its new tokens' slots, leaves both be."""
        self.finish_step()  # a step vLLM bound without waiting for its saves
        meta, self.meta = self.meta, PensieveMetadata()
        for key in meta.evictions:
            self.store.drop(key)
        copies = _StepCopies([(self.store.put_slot(c.key), c.block_id) for c in meta.stores],
                             [(self.store.slot(c.key), c.block_id) for c in meta.loads])
        self.times.stored_blocks += len(copies.stores)
        self.times.loaded_blocks += len(copies.loads)
        self._step_meta = meta
        if meta.stores or meta.evictions or meta.disk_writes or meta.promotions:
            logger.debug("%s: step copies: %d evictions, %d stores, %d loads; disk: %d drops, %d writes, "
                         "%d blocks read", CONNECTOR_NAME, len(meta.evictions), len(meta.stores), len(meta.loads),
                         len(meta.disk_drops), len(meta.disk_writes), sum(map(len, meta.promotions)))
        if not (copies.stores or copies.loads):
            return
        if self.copier is not None:
            self.copier.start(copies)
            self._copying = True
        else:
            self._copy_in_forward_pass(copies)

    def wait_for_layer(self, layer_name: str) -> None:
        """Blocks until layer `layer_name`'s copies of this step are done (every
        layer's, for a layer the layout does not name)."""
        if not self._copying:
            return
        started = time.perf_counter()
        layer = self.layer_index.get(layer_name)
        if layer is None:
            self.copier.wait_all()
        else:
            self.copier.wait(layer)
        self.times.waited_s += time.perf_counter() - started

    def finish_step(self) -> None:
        """After the forward pass: waits for the step's copies, then reports
        the requests whose blocks are stored and hands the disk tier its work."""
        meta, self._step_meta = self._step_meta, None
        if meta is None:
            return
        if self._copying:
            started = time.perf_counter()
            self.copier.wait_all()
            self.times.waited_s += time.perf_counter() - started
            self._copying = False
        self.finished_sending.update(meta.finished_after_store)
        if self.disk is not None:
            for key in meta.disk_drops:
                self.disk.drop(key)
            for item in meta.disk_writes:  # copies now: a row or block may be reused before the write
                self.disk.write(item, self.store.get(item.key).clone() if item.block_id is None else
                                torch.cat([layer[item.block_id] for layer in self.layers]).cpu())
            for keys in meta.promotions:
                self.disk.promote(keys, [self.store.put(key) for key in keys])

    def run_step(self) -> None:
        """A whole step's copies at once (no forward pass between)."""
        self.start_step()
        self.finish_step()

    def finished_disk_work(self) -> PensieveWorkerMetadata | None:
        if self.disk is None:
            return None
        done = self.disk.drain()
        for chain in done.failed_promotions:
            for key in chain:
                self.store.drop(key)
        return done if (done.promoted or done.failed_promotions or done.failed_writes) else None

    def get_finished(self, finished_req_ids: set[str]) -> set[str] | None:
        done = self.finished_sending & finished_req_ids
        self.finished_sending -= done
        return done or None

    def step_started(self) -> None:
        self._step_start = time.perf_counter()

    def step_finished(self) -> None:
        if self._step_start is not None:
            self.times.steps += 1
            self.times.step_s += time.perf_counter() - self._step_start
            self._step_start = None

    def shutdown(self) -> None:
        self.finish_step()
        if self.times.steps:
            logger.info("%s: %s", CONNECTOR_NAME, self.times.summary())
        if self.copier is not None:
            self.copier.close()
        if self.disk is not None:
            self.disk.close()


# ---------------------------------------------------------------------------
# The connector vLLM instantiates (one per role)


class PensieveConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = PensieveConfig.from_extra_config(dict(self._kv_transfer_config.kv_connector_extra_config))
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise ValueError(f"{CONNECTOR_NAME} supports one worker (tensor and pipeline parallel size 1); got "
                             f"tensor {parallel.tensor_parallel_size} x pipeline {parallel.pipeline_parallel_size}")
        if kv_cache_config is None:
            raise ValueError(f"{CONNECTOR_NAME} needs the KV cache config vLLM 0.32 passes to connectors")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(f"{CONNECTOR_NAME} supports models with one KV cache group (every layer full "
                             f"attention); this model has {len(kv_cache_config.kv_cache_groups)}")
        layout = block_layout(vllm_config, kv_cache_config)
        self._scheduler = _Scheduler(vllm_config, kv_cache_config, config, layout, pinned_prompt_tokens(
            config.pinned_prompts, vllm_config.model_config)) if role == KVConnectorRole.SCHEDULER else None
        self._worker = _Worker(config, layout, kv_cache_config.kv_cache_groups[0].layer_names) \
            if role == KVConnectorRole.WORKER else None
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

    def get_startup_requests(self) -> list[EngineCoreRequest]:
        return pinned_prompt_requests(self._scheduler.pinned_prompts)

    def reset_cache(self) -> bool:
        return self._scheduler.reset_cache()

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._scheduler.bind_block_pool(gpu_block_pool)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        done = connector_output.kv_connector_worker_meta
        if isinstance(done, PensieveWorkerMetadata):
            self._scheduler.update_connector_output(done)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        return self._scheduler.request_finished(request, block_ids)

    # -- worker side ---------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # vLLM binds after it zeroed and copied this step's new blocks and before the
        # forward pass; the copies start here, so that stores overlap it too (vLLM calls
        # start_load_kv after the forward pass in a step without loads).
        super().bind_connector_metadata(connector_metadata)
        self._worker.meta = connector_metadata
        self._worker.step_started()
        self._worker.start_step()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # started in bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        # The forward pass is over (vLLM calls this after it, before get_finished).
        self._worker.finish_step()
        self._worker.step_finished()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker.get_finished(finished_req_ids), None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.finished_disk_work()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
