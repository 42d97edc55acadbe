"""The prefix tree derived from block tables: structure properties on random forests."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_chunkattn.prefix.tree import PrefixTreeCache, prefix_tree


@st.composite
def block_tables(draw):
    """Requests drawn from a random forest of shared chunk runs, as vLLM's prefix
    caching lays them out: equal prefixes share physical blocks."""
    block_size = draw(st.sampled_from([4, 16, 32]))
    next_block = iter(range(10_000))
    num_rows = draw(st.integers(1, 24))
    # Known prefixes; each new request extends one of them, so trees get deep.
    paths = [[next(next_block) for _ in range(draw(st.integers(0, 3)))] for _ in range(draw(st.integers(1, 3)))]
    rows, seq_lens = [], []
    for _ in range(num_rows):
        shared = list(draw(st.sampled_from(paths)))
        shared += [next(next_block) for _ in range(draw(st.integers(0, 2)))]
        paths.append(shared)
        private = [next(next_block) for _ in range(draw(st.integers(0, 3)))]
        blocks = shared + private
        if not blocks:
            blocks = [next(next_block)]
        # the context ends somewhere in its last block (or fills it)
        seq_len = (len(blocks) - 1) * block_size + draw(st.integers(1, block_size))
        rows.append(blocks)
        seq_lens.append(seq_len)
    # rows that copy another row's whole prefix (exact-prefix prompts)
    for i in range(draw(st.integers(0, 3))):
        j = draw(st.integers(0, num_rows - 1))
        cut = draw(st.integers(0, len(rows[j])))
        rows.append(rows[j][:cut] + [next(next_block)])
        seq_lens.append(cut * block_size + draw(st.integers(1, block_size)))
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    return table, torch.tensor(seq_lens, dtype=torch.int32), block_size


def shared_prefix_len(table, seq_lens, block_size, a, b) -> int:
    """Full chunks rows a and b have in common, by definition."""
    full = min(int(seq_lens[a]) // block_size, int(seq_lens[b]) // block_size)
    n = 0
    while n < full and table[a, n] == table[b, n]:
        n += 1
    return n


@settings(max_examples=150, deadline=None)
@given(block_tables())
def test_nodes_cover_exactly_the_shared_chunks(case):
    table, seq_lens, block_size = case
    ctx = prefix_tree(table, seq_lens, block_size)
    num_rows = table.shape[0]
    order = ctx.order.tolist()
    assert sorted(order) == list(range(num_rows))
    position = {row: t for t, row in enumerate(order)}

    covering = {}  # (row, chunk) -> node
    for k in range(ctx.num_nodes):
        begin, end = int(ctx.node_begin[k]), int(ctx.node_end[k])
        c0, c1 = int(ctx.node_chunk_begin[k]), int(ctx.node_chunk_end[k])
        assert end - begin >= 2 and c1 > c0
        rows = order[begin:end]
        for row in rows:
            # every covered row has these chunks, full, identical to the others
            assert int(seq_lens[row]) >= c1 * block_size
            assert torch.equal(table[row, :c1], table[rows[0], :c1])
            for c in range(c0, c1):
                assert (row, c) not in covering, "a chunk of a row is in two nodes"
                covering[(row, c)] = k

    # Two rows share chunk c exactly when one node covers both at c.
    for a in range(num_rows):
        for b in range(a + 1, num_rows):
            n = shared_prefix_len(table, seq_lens, block_size, a, b)
            for c in range(n):
                assert covering.get((a, c)) is not None and covering[(a, c)] == covering.get((b, c))
            lo, hi = sorted((position[a], position[b]))
            # contiguity: rows between them in tree order share at least as much
            for t in range(lo, hi + 1):
                assert shared_prefix_len(table, seq_lens, block_size, order[t], a) >= n

    # A row's node chunks are its leading chunks, and its partial rows list them all.
    for row in range(num_rows):
        shared = int(ctx.shared_chunks[row])
        assert all((row, c) in covering for c in range(shared))
        assert (row, shared) not in covering
        partials = ctx.row_partials[ctx.row_partial_offsets[row] : ctx.row_partial_offsets[row + 1]].tolist()
        nodes = sorted({covering[(row, c)] for c in range(shared)})
        expected = sorted(int(ctx.node_partial_offset[k]) + position[row] - int(ctx.node_begin[k]) for k in nodes)
        assert partials == expected  # in node order, so every row merges its parts in one order
    assert ctx.num_partial_rows == int((ctx.node_end - ctx.node_begin).sum())


def test_paper_figure_2_example():
    # S0, S1, S2 share chunks C0..C2; S1 and S2 each have more; S0 has one more.
    block_size = 4
    table = torch.tensor([[0, 1, 2, 3, 0], [0, 1, 2, 4, 6], [0, 1, 2, 5, 7]], dtype=torch.int32)
    seq_lens = torch.tensor([15, 19, 18], dtype=torch.int32)
    ctx = prefix_tree(table, seq_lens, block_size)
    assert ctx.num_nodes == 1
    assert (int(ctx.node_begin[0]), int(ctx.node_end[0])) == (0, 3)
    assert (int(ctx.node_chunk_begin[0]), int(ctx.node_chunk_end[0])) == (0, 3)
    assert ctx.shared_chunks.tolist() == [3, 3, 3]
    assert ctx.reused_tokens(block_size) == 3 * block_size * 2


def test_reused_tokens_under_a_sliding_window():
    """The figure 2 tree with a 10-token window: S0 (15 tokens) sees keys 5..14, from
    chunk 1 on; S1 (19) from chunk 2; S2 (18) from chunk 2. Alone they would read
    2 + 1 + 1 of the node's chunks; the node is read from chunk 1: 2 chunks, 2 saved."""
    block_size = 4
    table = torch.tensor([[0, 1, 2, 3, 0], [0, 1, 2, 4, 6], [0, 1, 2, 5, 7]], dtype=torch.int32)
    seq_lens = torch.tensor([15, 19, 18], dtype=torch.int32)
    ctx = prefix_tree(table, seq_lens, block_size)
    assert ctx.reused_tokens(block_size, seq_lens, sliding_window=10) == 2 * block_size
    # A window past every context changes nothing; one inside the last chunk saves nothing.
    assert ctx.reused_tokens(block_size, seq_lens, sliding_window=100) == ctx.reused_tokens(block_size)
    assert ctx.reused_tokens(block_size, seq_lens, sliding_window=2) == 0


def test_cache_rebuilds_only_when_the_tree_changes():
    cache = PrefixTreeCache()
    block_size = 4
    table = torch.tensor([[0, 1, 2, 0], [0, 1, 3, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 10], dtype=torch.int32)
    first = cache.get(table, seq_lens, block_size)
    # decoding within the current chunks: same context object, no rebuild
    assert cache.get(table, seq_lens + 1, block_size) is first
    assert cache.builds == 1
    # a chunk fills (seq_len 12 -> 3 full chunks): rebuilt
    cache.get(table, torch.tensor([12, 11], dtype=torch.int32), block_size)
    assert cache.builds == 2
    # a request leaves: rebuilt
    cache.get(table[:1], torch.tensor([12], dtype=torch.int32), block_size)
    assert cache.builds == 3


def test_cache_tells_batches_without_full_chunks_apart():
    # Regression: with no full chunk the table is empty; batch size must still count.
    cache = PrefixTreeCache()
    one = cache.get(torch.zeros((1, 2), dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 4)
    two = cache.get(torch.zeros((2, 2), dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32), 4)
    assert one.order.numel() == 1 and two.order.numel() == 2


def test_no_sharing_gives_no_nodes():
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    ctx = prefix_tree(table, torch.tensor([16, 16, 13], dtype=torch.int32), 4)
    assert ctx.num_nodes == 0 and ctx.shared_chunks.tolist() == [0, 0, 0]
    assert np.array_equal(ctx.row_partial_offsets.numpy(), np.zeros(4))
