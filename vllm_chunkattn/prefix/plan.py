"""The decode step's plan: built once per step, run by every layer.

The metadata builder makes one `DecodePlan` per step (kernels/ops.py,
`plan_tpp_decode`: FlashInfer's plan()/run() split) and every layer's
forward hands it to the decode kernel, which only runs it. Everything the
kernel would otherwise redo per layer is in it: the validated tree context,
the chunk-first work items sorted by cost, how each node's chunks are split
and where its partials go, which node each partial row belongs to, the
sequence-first row order and the scratch sizes. It depends on the layer
shape (query heads, KV heads, head size, block size) and on the intra-op
thread count, which are the same for all layers of one KV-cache group; a
layer of another shape is refused (`DecodePlan.check_layer`).

The work plan is int32 tensors on the kernel's device (csrc/common/decode_plan.h
describes them), so on CUDA it can live in fixed buffers that a captured
CUDA graph reads on every replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_chunkattn.prefix.tree import PrefixTreeContext


@dataclass(frozen=True)
class DecodeShape:
    """The attention shape a plan is built for: every layer that runs it has this shape."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        return (f"{self.dtype_name}, {self.num_heads}/{self.num_kv_heads} heads of {self.head_size}, "
                f"block {self.block_size}")

    @classmethod
    def of_layer(cls, query: torch.Tensor, kv_cache: torch.Tensor) -> DecodeShape:
        """The shape of one layer's inputs: query [B, num_heads, head_size],
        kv_cache [num_blocks, num_kv_heads, block_size, 2 * head_size]."""
        return cls(
            num_heads=int(query.shape[1]),
            num_kv_heads=int(kv_cache.shape[1]),
            head_size=int(query.shape[2]),
            block_size=int(kv_cache.shape[2]),
            dtype=query.dtype,
        )


@dataclass(frozen=True)
class DecodeWork:
    """The compiled kernels' work plan: int32 tensors filled by the
    tpp_decode_plan op, laid out as csrc/common/decode_plan.h describes."""

    header: torch.Tensor  # [kDecodePlanHeaderInts], host: shapes and sizes (DecodePlanHeader)
    items: torch.Tensor  # [num_items + 1, 4] chunk-first work list, ended by node -1
    node_work: torch.Tensor  # [num_nodes, 4] (first slot, pieces, piece size, 0)
    partial_work: torch.Tensor  # [num_partial_rows, 4] (first slot, slot stride, pieces, node)
    row_order: torch.Tensor  # CPU: [batch + runs + 1] the rows in sequence-first runs, then the runs' offsets; CUDA: empty

    @classmethod
    def empty(cls, device: torch.device | str) -> DecodeWork:
        """Tensors for the plan op to fill: it sizes them (on CUDA once, at the
        first plan, so that their addresses stay fixed for CUDA graphs)."""

        def new(on: torch.device | str) -> torch.Tensor:
            return torch.empty(0, dtype=torch.int32, device=on)

        return cls(header=new("cpu"), items=new(device), node_work=new(device), partial_work=new(device),
                   row_order=new(device))

    @property
    def num_items(self) -> int:
        """Chunk-first items, the end row not counted (CPU; on CUDA the list's capacity)."""
        return int(self.items.shape[0]) - 1


@dataclass(frozen=True)
class DecodePlan:
    """One decode step's inputs and work plan, for every layer of one KV-cache group."""

    shape: DecodeShape
    block_table: torch.Tensor  # [batch, max_blocks] int32, on the kernel's device
    seq_lens: torch.Tensor  # [batch] int32, on the kernel's device
    context: PrefixTreeContext  # the tree, validated against block_table and seq_lens
    work: DecodeWork | None  # None where the PyTorch fallback runs the step (no compiled kernel fits)

    @property
    def batch(self) -> int:
        return int(self.context.order.numel())

    def check_layer(self, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Refuse a layer whose shape is not the one this plan was built for."""
        layer = DecodeShape.of_layer(query, kv_cache)
        if layer != self.shape or query.shape[0] != self.batch:
            raise ValueError(
                f"decode plan built for {self.batch} requests x {self.shape.num_heads} query heads over "
                f"{self.shape.num_kv_heads} KV heads, head size {self.shape.head_size}, block size "
                f"{self.shape.block_size}, {self.shape.dtype}; this layer has {query.shape[0]} requests x "
                f"{layer.num_heads} heads over {layer.num_kv_heads} KV heads, head size {layer.head_size}, "
                f"block size {layer.block_size}, {layer.dtype}. All layers of one KV-cache group must share "
                f"one attention shape."
            )
