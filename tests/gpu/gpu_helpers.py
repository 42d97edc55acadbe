"""Shared by the GPU tests: when they run, and the tolerances."""

from __future__ import annotations

import pytest
import torch

from vllm_chunkattn.install.cuda_toolkit import MIN_COMPUTE_CAPABILITY


def _no_gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return (
            "no CUDA device: the CUDA kernels are compile-checked (tests/cuda/test_cuda_compile.py) and run on "
            "a CPU emulator (tests/cuda/test_cuda_emulated.py) here; run tests/gpu on a GPU host"
        )
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        return f"compute capability {major}.{minor}: the CUDA kernels need 8.0 or newer"
    return None


NO_GPU = _no_gpu_reason()
requires_gpu = pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")

# Output tolerance against the float64 reference: fp16/bf16 inputs, P rounded
# to the input type before P.V (as FlashAttention does), fp32 accumulation.
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def require_cuda_kernels() -> None:
    """On a GPU host the CUDA build must be there: fail, never skip, without it."""
    from vllm_chunkattn.kernels import ops

    assert ops.cuda_kernels_available(), (
        f"vllm_chunkattn._C_cuda is not importable ({ops.CUDA_KERNELS_ERROR}); build with a CUDA torch: "
        "pip install --no-build-isolation -e .[cuda] (docs/cuda.md)"
    )
