"""Paged KV-cache batches with shared prefixes, laid out as vLLM's prefix
caching lays them out (equal prefixes share physical blocks): for the kernel
tests (CPU emulator of the CUDA kernels, GPU tests) and the GPU kernel
benchmark.

    table, seq_lens = random_forest(rng, batch=12, block_size=16)
    table, seq_lens = shared_prefix(batch=32, context=2048, shared=1024, block_size=64)
    kv_cache = random_kv_cache(num_blocks, num_kv_heads, block_size, head_size, dtype)
"""

from __future__ import annotations

import numpy as np
import torch


def _table(rows: list[list[int]], seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    return table, torch.tensor(seq_lens, dtype=torch.int32)


def random_forest(
    rng: np.random.Generator,
    batch: int,
    block_size: int,
    max_shared_blocks: int = 6,
    max_private_blocks: int = 5,
    num_roots: int = 2,
    first_block: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` requests drawn from a random forest of shared block runs: each
    request extends a known prefix by a few blocks (so trees get deep), adds
    private blocks and ends somewhere in its last block. Some requests are an
    exact prefix of others, some share nothing. Block ids start at
    `first_block` (vLLM keeps block 0 as the null block)."""
    counter = iter(range(first_block, 1 << 30))
    paths = [[next(counter) for _ in range(int(rng.integers(0, max_shared_blocks + 1)))] for _ in range(num_roots)]
    rows, seq_lens = [], []
    for _ in range(batch):
        shared = list(paths[int(rng.integers(0, len(paths)))])
        shared += [next(counter) for _ in range(int(rng.integers(0, 3)))]
        paths.append(shared)
        if rng.random() < 0.2:  # exact prefix of another request (+ one partial block)
            blocks = shared[: int(rng.integers(0, len(shared) + 1))] + [next(counter)]
        else:
            blocks = shared + [next(counter) for _ in range(int(rng.integers(0, max_private_blocks + 1)))]
        if not blocks:
            blocks = [next(counter)]
        rows.append(blocks)
        seq_lens.append((len(blocks) - 1) * block_size + int(rng.integers(1, block_size + 1)))
    return _table(rows, seq_lens)


def shared_prefix(
    batch: int, context: int, shared: int, block_size: int, first_block: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's microbenchmark batch (Table 3, Figures 3 and 4): `batch`
    requests of `context` tokens whose first `shared` tokens (rounded down to
    whole blocks) are one physical copy."""
    counter = iter(range(first_block, 1 << 30))
    shared_blocks = [next(counter) for _ in range(shared // block_size)]
    total_blocks = -(-context // block_size)
    rows = [shared_blocks + [next(counter) for _ in range(total_blocks - len(shared_blocks))] for _ in range(batch)]
    return _table(rows, [context] * batch)


def multi_level(
    batch: int, levels: list[tuple[int, int]], private: int, block_size: int, first_block: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """A multi-level tree: levels = [(fan_out, tokens), ...] from the root; e.g.
    [(1, 1024), (4, 512), (4, 256)] is one system prompt, 4 documents under it,
    4 question templates under each; every leaf group gets an equal share of
    the `batch` requests, each with `private` tokens of its own."""
    counter = iter(range(first_block, 1 << 30))
    groups: list[list[int]] = [[]]
    for fan_out, tokens in levels:
        groups = [g + [next(counter) for _ in range(tokens // block_size)] for g in groups for _ in range(fan_out)]
    rows, seq_lens = [], []
    for i in range(batch):
        prefix = groups[i % len(groups)]
        blocks = prefix + [next(counter) for _ in range(-(-private // block_size))]
        rows.append(blocks)
        seq_lens.append(len(prefix) * block_size + private)
    return _table(rows, seq_lens)


def num_blocks_needed(table: torch.Tensor) -> int:
    return int(table.max()) + 1 if table.numel() else 1


def random_kv_cache(
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """[num_blocks, num_kv_heads, block_size, 2 * head_size], standard normal."""
    cache = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size, generator=generator)
    return cache.to(device=device, dtype=dtype)


def decode_query_start_loc(batch: int) -> torch.Tensor:
    return torch.arange(batch + 1, dtype=torch.int32)


def prefill_split(
    rng: np.random.Generator, seq_lens: torch.Tensor, max_new: int | None = None
) -> torch.Tensor:
    """New-token counts for a prefill batch over these contexts: each request's
    last 1..seq_len tokens are new (a prefix-cache hit or an earlier chunk
    covered the rest)."""
    new = []
    for s in seq_lens.tolist():
        hi = s if max_new is None else min(s, max_new)
        new.append(int(rng.integers(1, hi + 1)))
    return torch.tensor(new, dtype=torch.int32)


# The attention variants (csrc/chunkattn.h), alone and as models combine them
# (gpt-oss: a window and sinks), for the kernel tests. Windows shorter than
# most contexts and not a whole number of chunks, so that nodes straddle window
# edges and whole pieces and splits lie before every window; True for sinks and
# ALiBi: attention_variant() draws them.
KERNEL_VARIANTS = {
    "window": dict(sliding_window=37),
    "soft-cap": dict(logits_soft_cap=1.5),
    "sinks": dict(sinks=True),
    "alibi": dict(alibi_slopes=True),
    "window+sinks": dict(sliding_window=37, sinks=True),
    "all": dict(sliding_window=50, logits_soft_cap=5.0, sinks=True, alibi_slopes=True),
}


def attention_variant(spec: dict, num_heads: int, generator: torch.Generator | None = None) -> dict:
    """A KERNEL_VARIANTS entry (or one like it) as the ops' and reference.paged_attention's keyword
    arguments: sinks near the log of a few dozen keys' count, so that each takes a real share of its
    softmax; BLOOM's ALiBi slopes (2^(-8 (h + 1) / num_heads))."""
    variant = dict(spec)
    if variant.get("sinks"):
        variant["sinks"] = 4.0 + torch.randn(num_heads, generator=generator)
    if variant.get("alibi_slopes"):
        variant["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])
    return variant
