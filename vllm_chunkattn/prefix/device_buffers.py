"""The prefix-tree context on the device, in buffers of fixed capacity.

Under a CUDA graph the decode kernels replay with the pointers, shapes and
scalars of the capture, so the context they read must live in buffers that
are allocated once and refreshed in place (ChunkAttention section 3.3: copy
the context to the GPU only when the tree changes). `DeviceTreeBuffers` holds
one int32 device tensor with a section per context array:

    order [max_batch] | node_begin, node_end, node_chunk_begin, node_chunk_end,
    node_partial_offset [max_nodes] each | shared_chunks [max_batch] |
    row_partial_offsets [max_batch + 1] | row_partials [max_partial_rows]

and hands the kernels views of it: the node and partial-row arrays always at
full capacity (unused nodes are empty: begin == end), `num_partial_rows` is
always the capacity, and the per-request arrays are sliced to the batch size
(vLLM pads a graph batch to the captured size). So everything a launch sees
stays the same between replays except the values. The CUDA kernels size
their grids and workspace from those shapes only (csrc/cuda/tpp_decode.cu).

A tree larger than the capacities is cut to its top levels (`fit_context`):
the chunks of the dropped nodes are attended as private chunks of each
request instead, so results stay exact; only the sharing of those chunks is
lost.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_chunkattn.prefix.tree import PrefixTreeContext, context_from_nodes

_NODE_FIELDS = ("node_begin", "node_end", "node_chunk_begin", "node_chunk_end", "node_partial_offset")


def fit_context(ctx: PrefixTreeContext, max_nodes: int, max_partial_rows: int) -> PrefixTreeContext:
    """`ctx` if it fits, else the context of its top levels that do.

    Nodes are kept in order of their first chunk (a parent ends where its
    children begin, so it always comes before them) while they fit; a kept
    node's ancestors are therefore always kept, and every request's shared
    chunks stay a prefix of its chunks."""
    rows = (ctx.node_end - ctx.node_begin).tolist()
    if ctx.num_nodes <= max_nodes and sum(rows) <= max_partial_rows:
        return ctx
    nodes = list(
        zip(ctx.node_begin.tolist(), ctx.node_end.tolist(), ctx.node_chunk_begin.tolist(), ctx.node_chunk_end.tolist())
    )
    nodes.sort(key=lambda n: (n[2], n[0]))
    kept, used = [], 0
    for node in nodes:
        if len(kept) == max_nodes or used + node[1] - node[0] > max_partial_rows:
            break
        kept.append(node)
        used += node[1] - node[0]
    return context_from_nodes(ctx.order.numpy(), kept, int(ctx.order.numel()))


class DeviceTreeBuffers:
    """Fixed-capacity device copy of the decode batch's tree context."""

    def __init__(self, max_batch: int, max_nodes: int, max_partial_rows: int, device: str | torch.device) -> None:
        self.max_batch = max_batch
        self.max_nodes = max(max_nodes, 1)
        self.max_partial_rows = max(max_partial_rows, 1)
        self.device = torch.device(device)
        sizes = [("order", max_batch)]
        sizes += [(name, self.max_nodes) for name in _NODE_FIELDS]
        sizes += [("shared_chunks", max_batch), ("row_partial_offsets", max_batch + 1)]
        sizes += [("row_partials", self.max_partial_rows)]
        self._sections: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in sizes:
            self._sections[name] = (offset, size)
            offset += size
        self.buffer = torch.zeros(offset, dtype=torch.int32, device=self.device)
        on_cuda = self.device.type == "cuda"
        # Two host staging buffers used in turn, so that filling one never races
        # with the asynchronous copy out of the other.
        self._staging = [torch.zeros(offset, dtype=torch.int32, pin_memory=on_cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() if on_cuda else None for _ in range(2)]
        self._turn = 0
        self._loaded: tuple[PrefixTreeContext, int] | None = None
        self._view: PrefixTreeContext | None = None
        self.copies = 0
        self.truncated = 0

    def _section(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        offset, size = self._sections[name]
        return tensor[offset : offset + size]

    def load(self, ctx: PrefixTreeContext, batch: int) -> PrefixTreeContext:
        """Device views of `ctx` for a batch of `batch` requests (ctx's rows first,
        padding requests after them have no nodes). Copies only when `ctx` is a
        different object than last time or the batch size changed."""
        if batch > self.max_batch:
            raise ValueError(f"decode batch of {batch} exceeds the buffers' capacity of {self.max_batch}")
        if self._loaded is not None and self._loaded[0] is ctx and self._loaded[1] == batch:
            return self._view
        fitted = fit_context(ctx, self.max_nodes, self.max_partial_rows)
        if fitted is not ctx:
            self.truncated += 1
        stage = self._staging[self._turn]
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        stage.zero_()
        rows = int(fitted.order.numel())
        self._section(stage, "order")[:rows] = fitted.order
        self._section(stage, "order")[rows:batch] = torch.arange(rows, batch, dtype=torch.int32)
        for name in _NODE_FIELDS:
            values = getattr(fitted, name)
            self._section(stage, name)[: values.numel()] = values
        self._section(stage, "shared_chunks")[:rows] = fitted.shared_chunks
        offsets = self._section(stage, "row_partial_offsets")
        offsets[: rows + 1] = fitted.row_partial_offsets
        offsets[rows + 1 : batch + 1] = fitted.row_partial_offsets[-1] if rows else 0
        self._section(stage, "row_partials")[: fitted.row_partials.numel()] = fitted.row_partials
        self.buffer.copy_(stage, non_blocking=event is not None)
        if event is not None:
            event.record()
        self._turn ^= 1
        self.copies += 1
        self._loaded = (ctx, batch)
        self._view = PrefixTreeContext(
            order=self._section(self.buffer, "order")[:batch],
            node_begin=self._section(self.buffer, "node_begin"),
            node_end=self._section(self.buffer, "node_end"),
            node_chunk_begin=self._section(self.buffer, "node_chunk_begin"),
            node_chunk_end=self._section(self.buffer, "node_chunk_end"),
            node_partial_offset=self._section(self.buffer, "node_partial_offset"),
            shared_chunks=self._section(self.buffer, "shared_chunks")[:batch],
            row_partial_offsets=self._section(self.buffer, "row_partial_offsets")[: batch + 1],
            row_partials=self._section(self.buffer, "row_partials"),
            num_partial_rows=self.max_partial_rows,
        )
        return self._view
