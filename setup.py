"""Builds the compiled kernels of vllm-chunkattn at install time.

The CPU extension (csrc/cpu) and the benchmark's machine-rate probe
(csrc/bench, vllm_chunkattn.bench._machine) are always built. The CUDA extension (csrc/cuda)
is built only when the installed torch has CUDA and nvcc is available; with a
CPU torch it is skipped with a message, so `pip install` works on both kinds
of host. CUDA architectures: TORCH_CUDA_ARCH_LIST, default "8.0 8.6 8.9
9.0+PTX" (A100, A10/A40/RTX 30xx, L4/L40/RTX 40xx, H100/H200, PTX for newer
GPUs); entries older than 8.0 are dropped with a message. Set
VLLM_CHUNKATTN_SKIP_CUDA=1 to build the CPU kernels only. See docs/cuda.md.
"""

import glob
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, ROOT)
from vllm_chunkattn.install import cuda_toolkit

import torch  # noqa: E402

# Before cpp_extension reads it, and only where the CUDA build can happen:
# torch's own guess (the folder above nvcc) is wrong where nvcc is a wrapper
# script (vllm_chunkattn/cuda_toolkit.py).
if torch.version.cuda and not os.environ.get("CUDA_HOME"):
    _cuda_home = cuda_toolkit.find_cuda_home()
    if _cuda_home:
        os.environ["CUDA_HOME"] = str(_cuda_home)

from torch.utils import cpp_extension  # noqa: E402


def _sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _headers(*folders: str) -> list[str]:
    """The headers and included fragments of these csrc folders: an extension's
    `depends`, so that build_ext rebuilds it when only one of them changed."""
    return [h for folder in folders for pattern in ("*.h", "*.cuh", "*.inc") for h in _sources(f"{folder}/{pattern}")]


def _extensions():
    # -g0: Python's default CFLAGS add -g, which makes the templated kernels
    # several times slower to build and the library ~10x bigger.
    # C++20: torch 2.13's headers use C++20 features.
    cxx_flags = ["-O3", "-g0", "-std=c++20", "-fopenmp", "-DNDEBUG"]
    exts = [
        cpp_extension.CppExtension(
            name="vllm_chunkattn._C",
            sources=_sources("csrc/cpu/*.cpp"),
            depends=_headers("csrc", "csrc/common", "csrc/cpu"),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        ),
        # The kernel benchmark's machine rates (peak FMA per ISA, read bandwidth):
        # apart from the kernels, so that the roofline does not depend on them.
        cpp_extension.CppExtension(
            name="vllm_chunkattn.bench._machine",
            sources=_sources("csrc/bench/*.cpp"),
            depends=_headers("csrc/common"),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        ),
    ]
    cuda_sources = _sources("csrc/cuda/*.cu")
    skip = os.environ.get("VLLM_CHUNKATTN_SKIP_CUDA", "0") not in ("", "0")
    archs, dropped = cuda_toolkit.cuda_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"))
    if cuda_sources and not skip and torch.version.cuda and cpp_extension.CUDA_HOME and archs:
        if dropped:
            print(f"vllm-chunkattn: leaving {' '.join(dropped)} out of TORCH_CUDA_ARCH_LIST (the CUDA kernels "
                  f"need compute capability 8.0 or newer); building them for {archs}")
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        exts.append(
            cpp_extension.CUDAExtension(
                name="vllm_chunkattn._C_cuda",
                sources=cuda_sources + _sources("csrc/cuda/*.cpp"),
                depends=_headers("csrc", "csrc/common", "csrc/cuda"),
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
        elif not cpp_extension.CUDA_HOME:
            why = "nvcc / CUDA_HOME not found"
        else:
            why = (f"TORCH_CUDA_ARCH_LIST names no architecture the kernels support ({' '.join(dropped)}; "
                   "they need 8.0 or newer)")
        print(f"vllm-chunkattn: {why}; building the CPU kernels only (no vllm_chunkattn._C_cuda)")
    return exts


setup(ext_modules=_extensions(), cmdclass={"build_ext": cpp_extension.BuildExtension})
