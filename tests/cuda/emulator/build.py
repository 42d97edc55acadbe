"""Builds the CPU-emulated CUDA kernels (csrc/cuda/*.cu compiled as C++ with
-DCHUNKATTN_EMULATE against tests/cuda/emulator/simt_emulator.h) into a shared
library and loads it with ctypes. Needs g++ and the CUDA headers (cuda_fp16.h,
cuda_bf16.h, cuda_runtime_api.h; no GPU, no CUDA runtime library).

    python tests/cuda/emulator/build.py # builds, prints the library path

With CHUNKATTN_EMU_SANITIZE=1 the library is built with AddressSanitizer;
run the tests with it preloaded to catch out-of-bounds accesses by the kernels:

    CHUNKATTN_EMU_SANITIZE=1 LD_PRELOAD=$(g++ -print-file-name=libasan.so) \
    ASAN_OPTIONS=detect_leaks=0:log_path=/tmp/asan pytest tests/cuda/test_cuda_emulated.py

(a report from inside a kernel fiber ends the process with exit code 1; read
it in /tmp/asan.*).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from vllm_chunkattn.install.cuda_toolkit import cuda_include_dir  # noqa: E402
SOURCES = ["kv_cache.cu", "tpp_decode.cu", "prefill.cu", "merge_attn_states.cu"]


def missing_reason() -> str | None:
    if shutil.which("g++") is None:
        return "g++ not found"
    if cuda_include_dir() is None:
        return "CUDA headers (cuda_fp16.h) not found; set CUDA_HOME"
    return None


def build(out_dir: Path | None = None) -> Path:
    include = cuda_include_dir()
    files = [ROOT / "csrc" / "cuda" / s for s in SOURCES] + sorted((ROOT / "csrc" / "cuda").glob("*.cuh"))
    files += [ROOT / "csrc" / "cuda" / "launch.h", ROOT / "csrc" / "cuda" / "dispatch.h",
              *sorted((ROOT / "csrc" / "common").glob("*.h")),
              HERE / "simt_emulator.h", HERE / "emulated_ops.cpp"]
    sanitize = os.environ.get("CHUNKATTN_EMU_SANITIZE", "") not in ("", "0")  # AddressSanitizer build
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files) + bytes([sanitize])).hexdigest()[:16]
    out_dir = out_dir or Path(os.environ.get("CHUNKATTN_EMU_BUILD", ROOT / "build" / "emulator"))
    lib = out_dir / f"libchunkattn_emu_{digest}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-std=c++17", "-O2", "-fPIC", "-DCHUNKATTN_EMULATE", f"-I{ROOT / 'csrc'}", f"-I{HERE}", f"-I{include}"]
    if sanitize:
        flags += ["-fsanitize=address", "-fno-omit-frame-pointer"]
    objects = []
    for src in [ROOT / "csrc" / "cuda" / s for s in SOURCES] + [HERE / "emulated_ops.cpp"]:
        obj = out_dir / f"{src.stem}_{digest}.o"
        lang = ["-x", "c++"] if src.suffix == ".cu" else []
        subprocess.run(["g++", *flags, *lang, "-c", str(src), "-o", str(obj)], check=True)
        objects.append(str(obj))
    tmp = lib.with_suffix(".tmp")
    subprocess.run(["g++", "-shared", *objects, "-o", str(tmp), *(["-fsanitize=address"] if sanitize else [])],
                   check=True)
    tmp.rename(lib)
    return lib


def load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    S = ctypes.POINTER(ctypes.c_int64)
    lib.emu_write_kv_cache.argtypes = [P, P, P, P, I, I, I, I, I, I, S]
    lib.emu_tpp_decode.argtypes = [I, P, P, P] + [P] * 11 + [I] * 7 + [F, I, F, P, P, S, I, I, I]
    lib.emu_paged_prefill.argtypes = [I, P, P, P, P, P, P] + [I] * 6 + [F, I, F, P, P, S, I, I]
    lib.emu_merge_attn_states.argtypes = [I, P, P, P, P, P, P, I, I, I, I, S]
    for name in ("emu_write_kv_cache", "emu_tpp_decode", "emu_paged_prefill", "emu_merge_attn_states"):
        getattr(lib, name).restype = ctypes.c_char_p
    lib.emu_set_cp_async_early.argtypes = [I]
    lib.emu_set_cp_async_early.restype = None
    lib.emu_set_schedule.argtypes = [I]
    lib.emu_set_schedule.restype = None
    lib.emu_attention_smem_bytes.argtypes = [I, I]
    lib.emu_attention_smem_bytes.restype = I
    lib.emu_set_smem_per_sm.argtypes = [I]
    lib.emu_set_smem_per_sm.restype = None
    lib.emu_take_largest_launch_smem.argtypes = []
    lib.emu_take_largest_launch_smem.restype = I
    return lib


if __name__ == "__main__":
    print(build())
    sys.exit(0)
