"""Where the CUDA toolkit is, and which GPU architectures to build for.

Used by setup.py (the `_C_cuda` build), scripts/check_cuda_compile.py and
tests/cuda/emulator/build.py. Imports nothing beyond the standard library, so
setup.py can load it before torch.

Toolkit: torch.utils.cpp_extension takes CUDA_HOME from the environment, else
the folder above the `nvcc` on PATH. Where that nvcc is a wrapper script (on
our CI machine /usr/local/bin/nvcc runs /usr/local/cuda-13.0/bin/nvcc) the
guess is /usr/local, which has no cuda_runtime.h, and the build stops with
"cuda_runtime.h: No such file or directory". find_cuda_home() asks nvcc.

Architectures: the kernels use mma.sync (bf16), ldmatrix and cp.async, all
sm_80 and newer. vLLM's own images export a TORCH_CUDA_ARCH_LIST that starts
at 7.0; building those entries would fail, so cuda_arch_list() drops them
and says so.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

# A100; A10 / A40 / RTX 30xx; L4 / L40 / RTX 40xx; H100 / H200 (+ PTX, which
# the driver compiles for newer GPUs such as Blackwell).
DEFAULT_CUDA_ARCHS = "8.0 8.6 8.9 9.0+PTX"
MIN_COMPUTE_CAPABILITY = (8, 0)


def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _is_toolkit(folder: str | Path | None) -> bool:
    return bool(folder) and (Path(folder) / "include" / "cuda_runtime.h").exists()


def find_cuda_home() -> Path | None:
    """The toolkit folder (with include/cuda_runtime.h and bin/nvcc), or None.

    CUDA_HOME / CUDA_PATH when they name a toolkit; else where the nvcc on
    PATH says its toolkit is (`nvcc --dryrun` prints TOP=...), the folder
    above its real path, /usr/local/cuda, /usr/local/cuda-*."""
    candidates: list[str | Path | None] = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = find_nvcc()
    if nvcc:
        try:
            out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull],
                                 capture_output=True, text=True, timeout=60)
            top = re.search(r"TOP=(\S+)", out.stderr + out.stdout)
            if top:
                candidates.append(top.group(1))
        except (OSError, subprocess.SubprocessError):
            pass
        candidates.append(Path(os.path.realpath(nvcc)).parents[1])
    candidates += ["/usr/local/cuda", *sorted(Path("/usr/local").glob("cuda-*"))]
    for c in candidates:
        if _is_toolkit(c):
            return Path(os.path.realpath(c))
    return None


def cuda_include_dir() -> Path | None:
    home = find_cuda_home()
    return home / "include" if home else None


def cuda_arch_list(requested: str | None) -> tuple[str, list[str]]:
    """(TORCH_CUDA_ARCH_LIST to build with, entries dropped as older than sm_80).

    `requested` is the user's TORCH_CUDA_ARCH_LIST (None or empty: the
    default). Entries are "X.Y", optionally with a/f and +PTX, separated by
    spaces or semicolons; names torch knows ("Ampere", ...) pass through."""
    if not requested or not requested.strip():
        return DEFAULT_CUDA_ARCHS, []
    kept, dropped = [], []
    for entry in re.split(r"[\s;]+", requested.strip()):
        m = re.fullmatch(r"(\d+)\.(\d+)[af]?(\+PTX)?", entry)
        if m and (int(m.group(1)), int(m.group(2))) < MIN_COMPUTE_CAPABILITY:
            dropped.append(entry)
        elif entry:
            kept.append(entry)
    return " ".join(kept), dropped
