"""The `chunk` attention backend: capabilities (chunk_backend.py), the per-step
metadata builder (builder.py), the per-layer impl (impl.py) and the decode
statistics it logs (stats.py)."""

from vllm_chunkattn.backend.builder import ChunkAttentionMetadata, ChunkAttentionMetadataBuilder
from vllm_chunkattn.backend.chunk_backend import ChunkAttentionBackend
from vllm_chunkattn.backend.impl import ChunkAttentionImpl

__all__ = ["ChunkAttentionBackend", "ChunkAttentionImpl", "ChunkAttentionMetadata", "ChunkAttentionMetadataBuilder"]
