"""The backend's logger, and what the prefix tree saved, for the engine log."""

from __future__ import annotations

import time

import torch
from vllm.logger import init_logger

from vllm_chunkattn import BACKEND_NAME
from vllm_chunkattn.prefix.tree import PrefixTreeContext

logger = init_logger("vllm.chunkattn.backend")  # in vLLM's hierarchy, see plugin.py


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
