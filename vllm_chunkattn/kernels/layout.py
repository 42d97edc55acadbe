"""The backend's KV cache layout, stated once for the Python side.

One tensor per attention layer (csrc/chunkattn.h states the same for C++):

    kv_cache: [num_blocks, num_kv_heads, block_size, 2 * head_size]

read as [num_blocks, num_kv_heads, 2, block_size, head_size]: for one block
(chunk) and KV head, the block_size x head_size key tile, then the value
tile, both contiguous. A token in slot s lives in block s // block_size at
row s % block_size. The key tile is row-major. So is the value tile, except
in a bfloat16 cache of the CPU kernels, which keeps it in key pairs: rows 2p
and 2p + 1 interleaved, the value of row r at head dim d at [r // 2][2d + r % 2]
of the tile read as [block_size // 2, 2 * head_size], the operand layout of
AMX's bf16 products.

Which layout a cache has is its kernels' device's: the tensor's own device,
unless `kernels_device` names another (the CUDA emulator runs CUDA's kernels,
and so CUDA's layout, on CPU tensors).
"""

from __future__ import annotations

import torch


def values_in_pairs(dtype: torch.dtype, kernels_device: str) -> bool:
    """Whether a cache of `dtype` for `kernels_device`'s kernels keeps its value tiles in key pairs."""
    return kernels_device == "cpu" and dtype == torch.bfloat16


def _pairs(kv_cache: torch.Tensor, kernels_device: str | None) -> bool:
    return values_in_pairs(kv_cache.dtype, kernels_device or kv_cache.device.type)


def _tiles(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value tiles as they lie, each [num_blocks, num_kv_heads, block_size, head_size]."""
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    kv = kv_cache.view(num_blocks, num_kv_heads, 2, block_size, two_d // 2)
    return kv[:, :, 0], kv[:, :, 1]


def _value_pairs(v_tiles: torch.Tensor) -> torch.Tensor:
    """Value tiles in key pairs as [num_blocks, num_kv_heads, block_size // 2, head_size, 2] (pair, dim, row % 2)."""
    num_blocks, num_kv_heads, block_size, head_size = v_tiles.shape
    return v_tiles.view(num_blocks, num_kv_heads, block_size // 2, head_size, 2)


def read_blocks(
    kv_cache: torch.Tensor, blocks: torch.Tensor, kernels_device: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of whole blocks, each [len(blocks), num_kv_heads, block_size, head_size] in row order."""
    k_tiles, v_tiles = _tiles(kv_cache)
    blocks = blocks.long()
    if not _pairs(kv_cache, kernels_device):
        return k_tiles[blocks], v_tiles[blocks]
    values = _value_pairs(v_tiles)[blocks].transpose(-1, -2)  # [n, heads, block_size // 2, 2, head_size]
    return k_tiles[blocks], values.reshape(len(blocks), *v_tiles.shape[1:])


def read_tokens(
    kv_cache: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor, kernels_device: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the tokens at (blocks, rows), index tensors of one shape S: each [*S, num_kv_heads, head_size]."""
    k_tiles, v_tiles = _tiles(kv_cache)
    blocks, rows = blocks.long(), rows.long()
    if not _pairs(kv_cache, kernels_device):
        return k_tiles[blocks, :, rows], v_tiles[blocks, :, rows]
    return k_tiles[blocks, :, rows], _value_pairs(v_tiles)[blocks, :, rows // 2, :, rows % 2]


def write_tokens(
    kv_cache: torch.Tensor,
    blocks: torch.Tensor,
    rows: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kernels_device: str | None = None,
) -> None:
    """Store key, value [len(rows), num_kv_heads, head_size] at (blocks[i], rows[i])."""
    k_tiles, v_tiles = _tiles(kv_cache)
    blocks, rows = blocks.long(), rows.long()
    k_tiles[blocks, :, rows] = key
    if _pairs(kv_cache, kernels_device):
        _value_pairs(v_tiles)[blocks, :, rows // 2, :, rows % 2] = value
    else:
        v_tiles[blocks, :, rows] = value
