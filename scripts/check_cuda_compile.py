#!/usr/bin/env python3
"""Compile-only check of the CUDA extension, for machines without a GPU (CI).

For every csrc/cuda/*.cu: `nvcc -c` for sm_80 and sm_90 (one call, two
-gencode targets) with the flags setup.py and torch's CUDAExtension use (C++20), `-Xptxas -v`,
and all template instantiations (head sizes 64/128/256 x fp16/bf16). For
every csrc/cuda/*.cpp (the torch wrappers and the op registration): a syntax
check with the host compiler against the installed torch headers. Nothing is
linked, nothing runs.

Prints a markdown table of registers, spills, static and dynamic shared
memory per kernel and architecture (from ptxas; dynamic shared memory from
the tile layout of csrc/cuda/attention.cuh, which tests/cuda/test_cuda_emulated.py
checks against the compiled constant), writes it to
build/cuda_compile/ptxas.md, and exits non-zero on any compile error.

    python scripts/check_cuda_compile.py [--archs 80 90] [--minimal] [--no-host]

A CPU-only torch wheel ships the ATen/c10 CUDA headers but not the generated
c10/cuda/impl/cuda_cmake_macros.h; a one-line stand-in is put on the include
path for the host check (the .cu files include no torch headers at all).
Exit codes: 0 ok, 1 compile error, 2 nvcc missing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
sys.path.insert(0, str(ROOT))
from vllm_chunkattn.install.cuda_toolkit import cuda_include_dir, find_nvcc  # noqa: E402

# Dynamic shared memory of the attention kernels (csrc/cuda/attention.cuh):
# prefill's is SmemLayout<D>::kBytes (64 Q rows), the TPP attend kernel's the
# larger of that and the group layout's for its GQA group (Q rows rounded up
# to 16, two KV stages); each is max(main loop buffers, epilogue buffers).
TILE = {64: (64, 2, 2), 128: (64, 1, 2), 256: (32, 1, 2)}  # D -> (KV tile, stages, group stages)


def dynamic_smem_bytes(head_size: int, group: int | None = None) -> int:
    """Prefill's bytes without a group, else the TPP attend kernel's for that GQA group."""
    kv_tile, stages, group_stages = TILE[head_size]
    ld = head_size + 8
    epilogue = (4 * 16 * (head_size + 4) + 2 * 4 * 16) * 4

    def layout(q_rows: int, layout_stages: int) -> int:
        return max((q_rows * ld + layout_stages * 2 * kv_tile * ld) * 2, epilogue)

    stacked = layout(64, stages)
    return stacked if group is None else max(stacked, layout(-(-group // 16) * 16, group_stages))


def torch_flags() -> tuple[list[str], list[str]]:
    """(include dirs, nvcc flags) as torch's CUDAExtension would use them."""
    from torch.utils import cpp_extension

    includes = list(cpp_extension.include_paths())
    flags = list(getattr(cpp_extension, "COMMON_NVCC_FLAGS", []))
    return includes, flags


def shim_dir(build: Path, torch_includes: list[str]) -> Path | None:
    header = "c10/cuda/impl/cuda_cmake_macros.h"
    if any((Path(d) / header).exists() for d in torch_includes):
        return None
    shim = build / "shim"
    (shim / "c10/cuda/impl").mkdir(parents=True, exist_ok=True)
    (shim / header).write_text(
        "// Stand-in for the header a CUDA build of torch generates (compile check only).\n"
        "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"
    )
    return shim


def short_name(mangled: str) -> str:
    name = mangled
    if shutil.which("c++filt"):
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip() or mangled
    name = re.sub(r"\(anonymous namespace\)::", "", name)
    name = name.replace("chunkattn::cuda::", "")
    name = re.sub(r"^void ", "", name)
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # drop the parameter list
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    name = name[:cut]
    for long, short in (("__nv_bfloat16", "bf16"), ("__half", "fp16"), ("unsigned int", "u32"),
                        ("unsigned short", "u16"), ("long", "i64"), ("int", "i32")):
        name = re.sub(rf"\b{long}\b", short, name)
    return name


def parse_ptxas(text: str) -> list[dict]:
    rows, current = [], None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\d+)'", line)
        if m:
            current = {"kernel": short_name(m.group(1)), "arch": m.group(2), "spill": "0/0", "stack": 0}
            rows.append(current)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current["stack"] = int(m.group(1))
            current["spill"] = f"{m.group(2)}/{m.group(3)}"
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current["smem"] = int(s.group(1)) if s else 0
    return rows


def dynamic_for(kernel: str) -> str:
    m = re.search(r"(tpp|prefill)_attend_kernel<\w+, (\d+)>", kernel)
    if not m:
        return "0"
    head_size = int(m.group(2))
    if m.group(1) == "prefill":
        return str(dynamic_smem_bytes(head_size))
    return f"{dynamic_smem_bytes(head_size, 16)} (G <= 16) to {dynamic_smem_bytes(head_size, 64)} (G = 64)"


def timed_run(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    return done, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=["80", "90"], help="SM versions (default: 80 90)")
    ap.add_argument("--minimal", action="store_true", help="only head size 128 (-DCHUNKATTN_CI_MINIMAL)")
    ap.add_argument("--no-host", action="store_true", help="skip the host-compiler check of the .cpp wrappers")
    ap.add_argument("--out", default=str(ROOT / "build" / "cuda_compile"), help="output folder")
    args = ap.parse_args(argv)

    nvcc = find_nvcc()
    if nvcc is None:
        print("check_cuda_compile: nvcc not found (set CUDA_HOME or put nvcc on PATH)", file=sys.stderr)
        return 2
    build = Path(args.out)
    build.mkdir(parents=True, exist_ok=True)
    torch_includes, nvcc_torch_flags = torch_flags()
    shim = shim_dir(build, torch_includes)
    cuda_include = cuda_include_dir()
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in args.archs]
    defines = ["-DTORCH_EXTENSION_NAME=_C_cuda"] + (["-DCHUNKATTN_CI_MINIMAL"] if args.minimal else [])

    # Every compiler call is independent: they run side by side, one per CPU, and are reported in file order.
    nvcc_jobs = []
    for cu in sorted((CSRC / "cuda").glob("*.cu")):
        cmd = [nvcc, "-c", str(cu), "-o", str(build / f"{cu.stem}.o"), "-O3", "-std=c++20",
               *nvcc_torch_flags, "--expt-relaxed-constexpr", f"-I{CSRC}", *[f"-I{d}" for d in torch_includes],
               *gencode, "-Xptxas", "-v", *defines]
        nvcc_jobs.append((cu, cmd))
    host_jobs = []
    if not args.no_host:
        cxx = os.environ.get("CXX", "g++")
        py_include = sysconfig.get_paths()["include"]
        for cpp in sorted((CSRC / "cuda").glob("*.cpp")):
            cmd = [cxx, "-fsyntax-only", "-std=c++20", str(cpp), f"-I{CSRC}", *([f"-I{shim}"] if shim else []),
                   *[f"-I{d}" for d in torch_includes], *([f"-I{cuda_include}"] if cuda_include else []),
                   f"-I{py_include}", *defines]
            host_jobs.append((cpp, cmd))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # the host checks take longest: first
        finished = list(pool.map(timed_run, [cmd for _, cmd in host_jobs + nvcc_jobs]))
    host_done, nvcc_done = finished[:len(host_jobs)], finished[len(host_jobs):]

    failures, rows = [], []
    for (cu, _), (done, took) in zip(nvcc_jobs, nvcc_done):
        status = "ok" if done.returncode == 0 else "FAILED"
        print(f"nvcc {cu.relative_to(ROOT)} [{' '.join('sm_' + a for a in args.archs)}]: {status} ({took:.0f} s)")
        errors = [ln for ln in (done.stdout + done.stderr).splitlines() if "error" in ln or "warning" in ln.lower()
                  and "ptxas info" not in ln]
        for line in errors[:40]:
            print("   ", line)
        if done.returncode:
            failures.append(str(cu))
            continue
        for row in parse_ptxas(done.stdout + done.stderr):
            row["file"] = cu.name
            rows.append(row)
    for (cpp, cmd), (done, took) in zip(host_jobs, host_done):
        status = "ok" if done.returncode == 0 else "FAILED"
        print(f"{cmd[0]} -fsyntax-only {cpp.relative_to(ROOT)}: {status} ({took:.0f} s)")
        if done.returncode:
            failures.append(str(cpp))
            for line in [ln for ln in done.stderr.splitlines() if "error" in ln][:40]:
                print("   ", line)

    header = ["kernel", "file", "arch", "registers", "spill st/ld (B)", "stack (B)", "static smem (B)",
              "dynamic smem (B)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in sorted(rows, key=lambda r: (r["file"], r["kernel"], r["arch"])):
        lines.append(
            f"| `{r['kernel']}` | {r['file']} | {r['arch']} | {r.get('registers', '?')} | {r['spill']} | "
            f"{r['stack']} | {r.get('smem', 0)} | {dynamic_for(r['kernel'])} |"
        )
    table = "\n".join(lines)
    (build / "ptxas.md").write_text(table + "\n")
    print()
    print(table)
    print(f"\n(written to {build / 'ptxas.md'})")
    if failures:
        print(f"\ncheck_cuda_compile: {len(failures)} file(s) failed: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
