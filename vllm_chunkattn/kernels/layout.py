"""The backend's KV cache layout, stated once for the Python side.

One tensor per attention layer (csrc/chunkattn.h states the same for C++):

    kv_cache: [num_blocks, num_kv_heads, block_size, 2 * head_size]

read as [num_blocks, num_kv_heads, 2, block_size, head_size]: for one block
(chunk) and KV head, the block_size x head_size key tile, then the value
tile, both row-major and contiguous. A token in slot s lives in block
s // block_size at row s % block_size.
"""

from __future__ import annotations

import torch


def split_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the key and value caches, each [num_blocks, num_kv_heads, block_size, head_size]."""
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    kv = kv_cache.view(num_blocks, num_kv_heads, 2, block_size, two_d // 2)
    return kv[:, :, 0], kv[:, :, 1]
