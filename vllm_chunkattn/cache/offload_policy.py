"""Pensieve's eviction policy for vLLM's own offloading tier (CUDA hosts).

On a CUDA host, vLLM's ``OffloadingConnector`` keeps KV in host memory with
its CUDA copy workers; which chunks that tier drops is a ``CachePolicy``
(vllm/v1/kv_offload/cpu/policies), chosen by name. The plugin registers
this one as ``pensieve``:

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_role": "kv_both", "kv_connector_extra_config":
      {"cpu_bytes_to_use": 68719476736, "eviction_policy": "pensieve"}}'

It keeps the tier's chunks in a ``ConversationTree`` (conversation_tree.py)
and evicts as the PensieveConnector's tiers do: the conversation with the
most chunks of its own times idle time loses its trailing part first, and a
chunk goes only after every chunk stored after it in its conversation, so
the tier never holds a chunk it could not serve for want of the one before.

What vLLM tells a policy, and how the tree is built from it:

- the chain: a chunk's parent is the chunk before it in the request that
  stores it, from the request's chunk positions (``ReqContext``), learned
  when vLLM reports the store miss and used when it inserts the chunk. A
  chunk whose parent the tier does not hold starts a chain of its own: the
  offloading connector stores only what the GPU cache missed, and looks the
  tier up from where the GPU cache's hit stops, so such chains are used;
- use: a lookup touches the chunks it hits, and a finished request every
  chunk it had;
- in use: chunks being written (not ready) or read by loads, and the chunks
  of the request that asks for room (``protected``), are not evicted;
- vLLM asks for exactly n evictions, all or none: the last victim loses
  fewer chunks than half its run when fewer are needed.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from vllm_chunkattn.cache.conversation_tree import ConversationTree, PensievePolicy

POLICY_NAME = "pensieve"
_GROUP_BYTES = 4  # an OffloadKey is a block hash followed by its KV-cache group (make_offload_key)


class PensieveCachePolicy(CachePolicy):
    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self.tree = ConversationTree(PensievePolicy())
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._parent_of: dict[OffloadKey, OffloadKey | None] = {}  # chunks vLLM is about to insert

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        previous = _previous_chunks(req_context)
        for key in keys:
            self._parent_of[key] = previous.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        parent = self._parent_of.pop(key, None)
        self.tree.add_child(parent if parent in self.tree else None, key, time.monotonic())
        self.chunks[key] = chunk
        if not chunk.is_ready:  # being written: evictable once vLLM marks it so
            self.tree.acquire([key])

    def remove(self, key: OffloadKey) -> None:
        # A failed store: the chunks after it (stored by other requests) stay usable from the GPU's hit on.
        del self.chunks[key]
        self.tree.detach(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.tree.touch_blocks(list(keys), time.monotonic())

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], req_context: ReqContext) -> None:
        now = time.monotonic()
        for keys in key_groups:
            self.tree.touch_blocks(keys, now)
            for key in keys:
                self._parent_of.pop(key, None)  # chunks offered but never inserted

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        held = [key for key in protected if key in self.tree]
        self.tree.acquire(held)
        try:
            if self.tree.num_evictable() < n:
                return None
            evicted = self.tree.evict(n, time.monotonic(), exact=True)
        finally:
            self.tree.release(held)
        return [(key, self.chunks.pop(key)) for key in evicted]

    def clear(self) -> None:
        self.tree = ConversationTree(self.tree.policy)
        self.chunks.clear()
        self._parent_of.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        self.tree.release([key])

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.tree.acquire([key])


def _previous_chunks(req_context: ReqContext) -> dict[OffloadKey, OffloadKey | None]:
    """Each of the request's chunks -> the one before it in the same KV-cache
    group (None for the first). vLLM records every chunk's end position in
    the request as it hashes the request's blocks; 0.32 has no public way to
    list them, so this reads the record itself."""
    positions: dict[OffloadKey, int] = getattr(req_context, "_offload_key_positions", {})
    by_group: dict[bytes, list[tuple[int, OffloadKey]]] = {}
    for key, end in positions.items():
        by_group.setdefault(key[-_GROUP_BYTES:], []).append((end, key))
    previous: dict[OffloadKey, OffloadKey | None] = {}
    for chunks in by_group.values():
        chunks.sort()
        for i, (_, key) in enumerate(chunks):
            previous[key] = chunks[i - 1][1] if i else None
    return previous


def register() -> None:
    """Makes `"eviction_policy": "pensieve"` select this policy (once per process)."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    if POLICY_NAME not in CachePolicyFactory._registry:  # register_cache_policy raises on a second call
        CachePolicyFactory.register_cache_policy(POLICY_NAME, __name__, PensieveCachePolicy.__name__)
