"""The prefix tree of the decode batch, derived from vLLM's block tables.

ChunkAttention (section 3.1) keeps the KV cache of running requests as a
prefix tree of fixed-size chunks. vLLM already stores a shared prefix once:
with prefix caching, requests whose prompts share the first k full blocks
point at the same k physical blocks. So the tree is implicit in the block
tables, and we recover it here instead of keeping a second cache manager:

- a chunk position p of request r is *shared* with request s when their
  block tables agree on positions 0..p (vLLM's block hashes chain over the
  whole prefix, so equal block ids at p imply equal prefixes) and the chunk is
  full for both;
- sorting requests lexicographically by block table puts every group that
  shares a prefix into a contiguous range of the sorted order (the paper's
  "sequences covered by each chunk are contiguous");
- a *node* is a maximal run of chunk positions covered by the same range of
  at least two requests. The chunk-first phase attends each node once for
  all the requests it covers; the sequence-first phase handles each
  request's remaining (private) chunks and merges the node partials.

The context is rebuilt only when the tree can change (section 3.3): a request
joins or leaves, or one of its chunks fills. `PrefixTreeCache` keys it on the
full-chunk part of the block tables, which changes exactly then.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class PrefixTreeContext:
    """Kernel context of one decode batch. Batch rows index the decode requests
    in the order the caller gave them; tree positions index the sorted order.
    All arrays are int32 torch tensors (CPU)."""

    order: torch.Tensor  # [B] tree position -> batch row
    node_begin: torch.Tensor  # [N] first tree position a node covers
    node_end: torch.Tensor  # [N] one past the last
    node_chunk_begin: torch.Tensor  # [N] first chunk position (block-table column) of the node
    node_chunk_end: torch.Tensor  # [N] one past its last chunk position
    node_partial_offset: torch.Tensor  # [N] first row of the node's partial results
    shared_chunks: torch.Tensor  # [B] per batch row: leading chunks served by nodes
    row_partial_offsets: torch.Tensor  # [B + 1] CSR over batch rows ...
    row_partials: torch.Tensor  # [M] ... of the partial-result rows each row merges
    num_partial_rows: int

    @property
    def num_nodes(self) -> int:
        return int(self.node_begin.numel())

    def reused_tokens(self, block_size: int, seq_lens: torch.Tensor | None = None, sliding_window: int = 0) -> int:
        """KV token reads saved: each node is read once instead of once per covered request.
        With a sliding window (and the rows' seq_lens), a row reads a node's chunks
        from its window's first one on, and the node is read from the earliest of those."""
        chunks = (self.node_chunk_end - self.node_chunk_begin).long()
        covered = (self.node_end - self.node_begin).long()
        if not sliding_window:
            return int((chunks * (covered - 1)).sum()) * block_size
        order = self.order.long()
        saved = 0
        for k in range(self.num_nodes):
            lens = seq_lens[order[int(self.node_begin[k]) : int(self.node_end[k])]].long()
            first = ((lens - sliding_window).clamp(min=0) // block_size).clamp(
                int(self.node_chunk_begin[k]), int(self.node_chunk_end[k]))
            saved += int((self.node_chunk_end[k] - first).sum() - (self.node_chunk_end[k] - first.min()))
        return saved * block_size


def _full_chunk_table(block_table: np.ndarray, seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Block ids of each row's full chunks; other columns get a value unique to
    the row, so they never compare equal to another row's."""
    full = seq_lens // block_size
    width = int(full.max()) if len(full) else 0
    table = block_table[:, :width].astype(np.int64, copy=True)
    cols = np.arange(width)[None, :]
    pad = -(np.arange(len(full), dtype=np.int64) + 1)[:, None]
    return np.where(cols < full[:, None], table, pad)


def build_prefix_tree(table: np.ndarray) -> PrefixTreeContext:
    """Build the context from a full-chunk table (see `_full_chunk_table`)."""
    num_rows, width = table.shape
    order = np.lexsort(table.T[::-1]) if width else np.arange(num_rows)
    sorted_table = table[order]
    # lcp[j]: chunks shared by tree positions j and j + 1.
    same = sorted_table[1:] == sorted_table[:-1]
    lcp = np.cumprod(same, axis=1).sum(axis=1) if num_rows > 1 else np.zeros(0, np.int64)
    depth = int(lcp.max()) if lcp.size else 0

    nodes: list[tuple[int, int, int, int]] = []  # (begin, end, chunk_begin, chunk_end)
    open_nodes: dict[tuple[int, int], int] = {}  # (begin, end) -> chunk_begin
    # The groups sharing chunk p change only where p reaches an lcp value, so
    # only those depths are visited (not every chunk of a long shared prefix).
    for p in sorted({0, depth, *lcp.tolist()}):
        if p < depth:
            bounds = [0, *(np.flatnonzero(lcp <= p) + 1).tolist(), num_rows]
            groups = {(b, e) for b, e in zip(bounds[:-1], bounds[1:]) if e - b >= 2}
        else:
            groups = set()
        for key in [k for k in open_nodes if k not in groups]:
            nodes.append((*key, open_nodes.pop(key), p))
        for key in groups:
            open_nodes.setdefault(key, p)
    nodes.sort(key=lambda n: (n[2], n[0]))  # parents first: easy to read when printed

    return context_from_nodes(order, nodes, num_rows)


def context_from_nodes(order: np.ndarray, nodes: list[tuple[int, int, int, int]], num_rows: int) -> PrefixTreeContext:
    """A context for tree order `order` and nodes (begin, end, chunk_begin,
    chunk_end), partial rows numbered node by node. Also used for trees cut
    to fit fixed device buffers (device_context.fit_context)."""
    order = np.asarray(order, dtype=np.int64)
    columns = np.asarray(nodes, dtype=np.int64).reshape(-1, 4)
    begin, end, chunk_end = columns[:, 0], columns[:, 1], columns[:, 3]
    sizes = end - begin
    offsets = np.cumsum(sizes) - sizes
    # One entry per (node, covered tree position), numbered node by node: the
    # entry's index is its partial row.
    num_partials = int(sizes.sum())
    node_of = np.repeat(np.arange(len(sizes)), sizes)
    row_of = order[begin[node_of] + np.arange(num_partials) - offsets[node_of]]
    shared = np.zeros(num_rows, np.int64)
    np.maximum.at(shared, row_of, chunk_end[node_of])
    # Each row's partial rows in node order (a stable sort keeps it).
    by_row = np.argsort(row_of, kind="stable")
    counts = np.bincount(row_of, minlength=num_rows)

    def i32(values) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int32).reshape(-1))

    return PrefixTreeContext(
        order=i32(order),
        node_begin=i32(begin),
        node_end=i32(end),
        node_chunk_begin=i32(columns[:, 2]),
        node_chunk_end=i32(chunk_end),
        node_partial_offset=i32(offsets),
        shared_chunks=i32(shared),
        row_partial_offsets=i32(np.concatenate([[0], np.cumsum(counts)])),
        row_partials=i32(by_row),
        num_partial_rows=num_partials,
    )


class PrefixTreeCache:
    """Rebuilds the context only when the decode batch's tree changes."""

    def __init__(self) -> None:
        self._key: bytes | None = None
        self._context: PrefixTreeContext | None = None
        self.builds = 0
        self.lookups = 0

    def get(self, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> PrefixTreeContext:
        table = _full_chunk_table(block_table.numpy(), seq_lens.numpy(), block_size)
        key = np.array(table.shape, np.int64).tobytes() + table.tobytes()
        self.lookups += 1
        if key != self._key or self._context is None:
            self._context = build_prefix_tree(table)
            self._key = key
            self.builds += 1
        return self._context


def prefix_tree(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> PrefixTreeContext:
    """Uncached build, for tests and benchmarks."""
    return build_prefix_tree(_full_chunk_table(block_table.numpy(), seq_lens.numpy(), block_size))
