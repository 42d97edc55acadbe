"""Builds the compiled kernels of vllm-chunkattn at install time.

The CPU extension (csrc/cpu) is always built. The CUDA extension (csrc/cuda)
is built only when the installed torch has CUDA and nvcc is available; with a
CPU torch it is skipped with a message, so `pip install` works on both kinds
of host. CUDA architectures: TORCH_CUDA_ARCH_LIST, default "8.0 8.6 8.9 9.0"
(A100, A10/A40/RTX 30xx, L4/L40/RTX 40xx, H100/H200). Set
VLLM_CHUNKATTN_SKIP_CUDA=1 to build the CPU kernels only. See docs/cuda.md.
"""

import glob
import os

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _extensions():
    # -g0: Python's default CFLAGS add -g, which makes the templated kernels
    # several times slower to build and the library ~10x bigger.
    # C++20: torch 2.13's headers use C++20 features.
    cxx_flags = ["-O3", "-g0", "-std=c++20", "-fopenmp", "-DNDEBUG"]
    exts = [
        cpp_extension.CppExtension(
            name="vllm_chunkattn._C",
            sources=_sources("csrc/cpu/*.cpp"),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        )
    ]
    import torch

    cuda_sources = _sources("csrc/cuda/*.cu")
    skip = os.environ.get("VLLM_CHUNKATTN_SKIP_CUDA", "0") not in ("", "0")
    if cuda_sources and not skip and torch.version.cuda and cpp_extension.CUDA_HOME:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0 8.6 8.9 9.0")
        exts.append(
            cpp_extension.CUDAExtension(
                name="vllm_chunkattn._C_cuda",
                sources=cuda_sources + _sources("csrc/cuda/*.cpp"),
                include_dirs=[os.path.join(ROOT, "csrc")],
                extra_compile_args={
                    "cxx": ["-O3", "-std=c++20"],
                    "nvcc": ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"],
                },
            )
        )
    elif cuda_sources:
        if skip:
            why = "VLLM_CHUNKATTN_SKIP_CUDA is set"
        elif not torch.version.cuda:
            why = f"torch {torch.__version__} has no CUDA"
        else:
            why = "nvcc / CUDA_HOME not found"
        print(f"vllm-chunkattn: {why}; building the CPU kernels only (no vllm_chunkattn._C_cuda)")
    return exts


setup(ext_modules=_extensions(), cmdclass={"build_ext": cpp_extension.BuildExtension})
