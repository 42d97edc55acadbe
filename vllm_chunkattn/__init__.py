"""vllm-chunkattn: prefix-aware chunked KV cache and two-phase-partition
attention for vLLM, selected with `--attention-backend chunk`."""

__version__ = "0.1.0"

BACKEND_NAME = "CHUNK"
