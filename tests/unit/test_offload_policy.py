"""Pensieve's policy in vLLM's own offloading tier (cache/offload_policy.py),
driven through vLLM's CPUOffloadingManager, the scheduler half of the
OffloadingConnector, as the connector drives it on a CUDA host."""

from __future__ import annotations

import hashlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from vllm_chunkattn.cache import offload_policy
from vllm_chunkattn.cache.offload_policy import PensieveCachePolicy

CHUNK_TOKENS = 64


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(offload_policy, "time", clock)
    return clock


def manager(num_chunks: int, policy: str = "pensieve") -> CPUOffloadingManager:
    offload_policy.register()
    return CPUOffloadingManager(num_chunks=num_chunks, cache_policy=policy)


def conversation(name: str, num_chunks: int) -> list:
    """The chunk keys of a conversation (a chain: each names its whole prefix)."""
    keys, parent = [], b""
    for i in range(num_chunks):
        parent = hashlib.sha256(parent + f"{name}/{i}".encode()).digest()
        keys.append(make_offload_key(parent, 0))
    return keys


_request_ids = itertools.count()


def request(keys: list) -> ReqContext:
    """A request over `keys` with vLLM's record of where each chunk ends."""
    context = ReqContext(req_id=f"r{next(_request_ids)}")
    for i, key in enumerate(keys):
        context.set_offload_key_position(key, (i + 1) * CHUNK_TOKENS)
    return context


def store(mgr: CPUOffloadingManager, keys: list, offered: slice = slice(None)) -> list:
    """A request over `keys` computes and stores the chunks `offered`; returns the evicted keys."""
    context = request(keys)
    mgr.on_new_request(context)
    out = mgr.prepare_store(keys[offered], context)
    assert out is not None, "no room"
    mgr.complete_store(out.keys_to_store, context)
    mgr.on_request_finished(context)
    return list(out.evicted_keys)


def stored(mgr: CPUOffloadingManager, keys: list) -> list[bool]:
    return [mgr.lookup(key, request(keys)).name == "HIT" for key in keys]


def test_the_conversation_with_most_chunks_times_idle_time_loses_its_trailing_part_first(clock):
    long, short, new = conversation("long", 6), conversation("short", 1), conversation("new", 1)
    for policy, evicted in [("lru", [short[0]]), ("pensieve", [long[5]])]:
        mgr = manager(7, policy)
        store(mgr, short)  # idle 20 s at the eviction: score 1 x 20
        clock.now += 10
        store(mgr, long)  # idle 10 s: 6 x 10
        clock.now += 10
        assert store(mgr, new) == evicted, policy  # LRU takes the oldest chunk instead
    # Pensieve's tier (the last): the trailing half of a run when that much is needed, last chunk first.
    assert store(mgr, conversation("three more", 3)) == [long[4], long[3], long[2]]
    assert stored(mgr, long) == [True, True, False, False, False, False]


def test_chunks_in_use_and_the_chunks_before_them_stay_and_eviction_is_all_or_nothing(clock):
    mgr = manager(4)
    a = conversation("a", 4)
    store(mgr, a)
    loading = request(a)
    mgr.on_new_request(loading)
    mgr.prepare_load(a[2:3], loading)  # a[2] is being read into the GPU: a[3] may go, a[0..2] may not
    clock.now += 5
    b = conversation("b", 2)
    context = request(b)
    mgr.on_new_request(context)
    assert mgr.prepare_store(b, context) is None  # 2 needed, 1 evictable without a hole
    assert stored(mgr, a) == [True, True, True, True]  # nothing was dropped
    assert mgr.prepare_store(b[:1], context).evicted_keys == [a[3]]
    mgr.complete_load(a[2:3], loading)


def test_a_failed_store_drops_only_its_chunk(clock):
    mgr = manager(8)
    a = conversation("a", 4)
    first = request(a)
    mgr.on_new_request(first)
    out = mgr.prepare_store(a[:2], first)
    # Another request stores the chunks after them before the first store fails.
    store(mgr, a, slice(2, 4))
    mgr.complete_store(out.keys_to_store, first, success=False)
    assert stored(mgr, a) == [False, False, True, True]
    policy: PensieveCachePolicy = mgr._policy
    assert set(policy.tree.keys()) == set(policy.chunks) == {a[2], a[3]}
    # The orphaned chain is still evicted from its end.
    assert store(mgr, conversation("b", 7)) == [a[3]]


def test_a_chain_stored_from_where_the_gpu_hit_stopped_keeps_its_order(clock):
    """The connector stores only what the GPU cache missed: chunks 3..5 of a
    conversation whose first three the GPU held. They form a chain of their own."""
    mgr = manager(4)
    a = conversation("a", 6)
    store(mgr, a, slice(3, 6))
    clock.now += 5
    assert store(mgr, conversation("b", 2)) == [a[5]]  # its trailing half, capped at what is needed


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 5), st.booleans(), st.integers(0, 10)),
                min_size=1, max_size=25))
def test_every_conversation_keeps_a_prefix_of_its_chunks_and_the_books_agree(steps):
    """Random turns of four conversations into a tier of 10 chunks: each turn
    extends its conversation by 1..5 chunks (stored from the start, as vLLM
    does when the GPU cache lost it), and may first read its stored prefix.
    Whatever is evicted, each conversation keeps a prefix of its chunks, and
    the manager, the policy and the tree agree on what is stored and in use."""
    import time as real_time

    clock = Clock()
    offload_policy.time = clock
    try:
        mgr = manager(10)
        chains = [conversation(f"c{i}", 40) for i in range(4)]
        lengths = [0] * 4
        for conv, grow, read_first, seconds in steps:
            clock.now += seconds
            keys = chains[conv][: lengths[conv] + grow]
            context = request(keys)
            mgr.on_new_request(context)
            hits = list(itertools.takewhile(lambda k: mgr.lookup(k, context).name == "HIT", keys))
            if read_first and hits:
                mgr.prepare_load(hits, context)
            out = mgr.prepare_store(keys, context)
            if out is not None:
                mgr.complete_store(out.keys_to_store, context)
            if read_first and hits:
                mgr.complete_load(hits, context)
            mgr.on_request_finished(context)
            lengths[conv] += grow
            for chain in chains:
                present = stored(mgr, chain)
                assert present == sorted(present, reverse=True), "a hole inside a conversation"
            policy: PensieveCachePolicy = mgr._policy
            assert set(policy.chunks) == set(policy.tree.keys())
            assert len(policy.chunks) <= 10
            assert mgr._num_evictable_cache_chunks == sum(c.ref_cnt == 0 for c in policy.chunks.values())
            assert policy.tree.num_evictable() == len(policy.chunks)  # nothing in use between turns
    finally:
        offload_policy.time = real_time
