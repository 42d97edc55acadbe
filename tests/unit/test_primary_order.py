"""Pensieve's order for vLLM's own KV cache (cache/primary_order.py), on a
real vLLM BlockPool: which cached blocks its free queue gives up first."""

from __future__ import annotations

import hashlib

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from vllm_chunkattn.cache.conversation_tree import LruPolicy, PensievePolicy
from vllm_chunkattn.cache.primary_order import PrimaryEvictionOrder


def _finish(pool: BlockPool, order: PrimaryEvictionOrder, label: str, num_blocks: int, now: float) -> list[int]:
    """A request computes `num_blocks` full blocks, finishes and is freed as vLLM frees it."""
    blocks = pool.get_new_blocks(num_blocks)
    for i, block in enumerate(blocks):
        block.set_block_hash(make_block_hash_with_group_id(hashlib.sha256(f"{label}{i}".encode()).digest(), 0))
    ids = [block.block_id for block in blocks]
    order.on_request_finished(ids, now)
    pool.free_blocks(reversed(blocks))  # vLLM frees a request's tail first
    return ids


def _cached_queue(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None]


def test_the_conversation_with_most_blocks_times_idle_time_loses_its_trailing_half_first():
    pool = BlockPool(num_gpu_blocks=32, enable_caching=True, hash_block_size=16)
    order = PrimaryEvictionOrder(pool, PensievePolicy())
    short = _finish(pool, order, "short", 2, now=0.0)  # idle 10 s, 2 blocks: score 20
    long = _finish(pool, order, "long", 6, now=5.0)  # idle 5 s, 6 blocks: score 30
    assert _cached_queue(pool) == short[::-1] + long[::-1]  # vLLM's LRU: the older conversation first
    num_free = pool.get_num_free_blocks()
    order.step(now=10.0)
    # long's last 3 (30 > 20), then short's last (20 > 15), then long's 2 (15 > 10), ...
    assert _cached_queue(pool) == [long[5], long[4], long[3], short[1], long[2], long[1], short[0], long[0]]
    assert pool.get_num_free_blocks() == num_free
    uncached = [b for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash is None]
    assert pool.free_block_queue.get_all_free_blocks()[:len(uncached)] == uncached  # still reused first


def test_blocks_in_use_or_reused_are_left_alone_and_lru_keeps_vllms_order():
    pool = BlockPool(num_gpu_blocks=32, enable_caching=True, hash_block_size=16)
    order = PrimaryEvictionOrder(pool, PensievePolicy())
    first = _finish(pool, order, "a", 4, now=0.0)
    pool.touch([pool.blocks[first[0]], pool.blocks[first[1]]])  # a new turn hits the first two blocks
    order.step(now=1.0)
    assert _cached_queue(pool) == [first[3], first[2]]
    assert pool.blocks[first[0]].ref_cnt == 1 and pool.blocks[first[0]].prev_free_block is None

    lru = PrimaryEvictionOrder(pool, LruPolicy())  # one block at a time, longest idle first
    second = _finish(pool, lru, "b", 2, now=0.0)
    third = _finish(pool, lru, "c", 2, now=1.0)
    lru.step(now=2.0)
    assert _cached_queue(pool)[-4:] == [second[1], second[0], third[1], third[0]]
