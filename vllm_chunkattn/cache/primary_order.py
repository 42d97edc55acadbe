"""Pensieve's eviction order for vLLM's own KV cache (the primary tier).

vLLM evicts cached blocks from the head of its block pool's free queue. Blocks
that hold nothing cached are prepended (reused first) and cached blocks are
appended when their last request frees them, a request's tail first, so the
cached part of the queue is LRU by the time each request finished. vLLM has
no policy hook for it; the connector's scheduler half gets the pool through
``bind_gpu_block_pool`` and reorders the cached blocks of finished requests
by the same ``EvictionPolicy`` as its own tiers:

- a finished request's cached blocks, in prompt order, are one conversation's
  run; a block shared by several belongs to the one that finished last;
- the run's length is how many of its blocks are still free and cached (the
  others were reused by a prefix hit or evicted), its idle time the time since
  it finished;
- the policy's victims (Pensieve: the trailing half of the run with the most
  blocks times idle time) go first, so no conversation loses a block before
  its later ones (a hole would make them unreachable: vLLM matches a prompt
  block by block from the start).

The reordered blocks move behind any other cached free blocks (those of
preempted requests), and all stay behind the uncached ones. Reordering walks
only the tracked blocks, and only in the few steps after a request finished
(its blocks are freed then, or a step later when the connector copies them).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from vllm_chunkattn.cache.conversation_tree import EvictionPolicy, TrailingRun

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

logger = logging.getLogger("vllm.chunkattn.pensieve")

REORDER_STEPS_AFTER_FINISH = 3  # a finished request's blocks are free within two steps (delayed free)


@dataclasses.dataclass(eq=False)
class FinishedRun:
    """A finished request's cached blocks, in prompt order."""

    block_ids: list[int]
    hashes: list[object]  # each block's hash when the request finished: a changed hash means reused
    finished_at: float


class PrimaryEvictionOrder:
    def __init__(self, block_pool: BlockPool, policy: EvictionPolicy):
        self.pool = block_pool
        self.policy = policy
        self.owner: dict[int, FinishedRun] = {}  # block id -> the run that freed it last
        self.steps_to_reorder = 0

    def on_request_finished(self, block_ids: list[int], now: float) -> None:
        blocks = [self.pool.blocks[b] for b in block_ids]
        cached = [block for block in blocks if block.block_hash is not None and not block.is_null]
        if not cached:
            return
        run = FinishedRun([block.block_id for block in cached], [block.block_hash for block in cached], now)
        for block_id in run.block_ids:
            self.owner[block_id] = run
        self.steps_to_reorder = REORDER_STEPS_AFTER_FINISH

    def _free_blocks_by_run(self) -> dict[FinishedRun, list[int]]:
        """Each run's blocks still free and holding what it cached, in prompt order."""
        by_run: dict[FinishedRun, list[int]] = {}
        for run in dict.fromkeys(self.owner.values()):  # each run once, in the order first seen
            for block_id, block_hash in zip(run.block_ids, run.hashes):
                block = self.pool.blocks[block_id]
                if self.owner.get(block_id) is not run:
                    continue  # a later request freed it too
                if block.block_hash != block_hash:
                    del self.owner[block_id]  # evicted and reused
                elif block.ref_cnt == 0 and block.prev_free_block is not None:
                    by_run.setdefault(run, []).append(block_id)
        return by_run

    def eviction_order(self, now: float) -> list[int]:
        """The tracked free blocks, first victim first, as the policy chooses."""
        free = self._free_blocks_by_run()
        order: list[int] = []
        while free:
            runs = [TrailingRun(run, len(blocks), now - run.finished_at) for run, blocks in free.items()]
            victim = self.policy.choose(runs)
            blocks = free[victim.run.leaf]
            order += blocks[-victim.num_blocks:][::-1]  # the trailing blocks, last first
            del blocks[-victim.num_blocks:]
            if not blocks:
                del free[victim.run.leaf]
        return order

    def step(self, now: float) -> None:
        """Reorders the queue if a request finished in the last few steps."""
        if self.steps_to_reorder == 0:
            return
        self.steps_to_reorder -= 1
        order = self.eviction_order(now)
        queue = self.pool.free_block_queue
        blocks = [self.pool.blocks[b] for b in order]
        for block in blocks:
            queue.remove(block)
        queue.append_n(blocks)
        if blocks:
            logger.debug("PensieveConnector: %d cached blocks of vLLM's KV cache reordered (%s)", len(blocks),
                         self.policy.name)
