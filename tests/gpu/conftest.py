"""GPU tests: run only where a CUDA device (compute capability 8.0+) is present."""

from __future__ import annotations

import pytest
from gpu_helpers import NO_GPU, require_cuda_kernels


@pytest.fixture(autouse=True)
def _cuda_kernels_built():
    if NO_GPU is None:
        require_cuda_kernels()
