"""Every CUDA source compiles (no GPU needed): each csrc/cuda/*.cu with nvcc for
sm_80 and sm_90, every template instantiation, and the torch wrappers with the
host compiler against the installed torch headers. Skipped only without nvcc."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import check_cuda_compile  # noqa: E402

from vllm_chunkattn.kernels import support  # noqa: E402

NVCC = check_cuda_compile.find_nvcc()


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: set CUDA_HOME or put nvcc on PATH to compile-check csrc/cuda")
def test_cuda_sources_compile_for_sm80_and_sm90(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_cuda_compile.py"), "--archs", "80", "90", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    table = (tmp_path / "ptxas.md").read_text()
    kernel_file = {"tpp_attend_kernel": "tpp_decode.cu", "tpp_merge_kernel": "tpp_decode.cu",
                   "prefill_attend_kernel": "prefill.cu"}
    short_dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}
    for arch in ("sm_80", "sm_90"):
        for dtype in support.CUDA.dtypes:
            for head_size in support.CUDA.head_sizes:
                for kernel in ("tpp_attend_kernel", "tpp_merge_kernel", "prefill_attend_kernel"):
                    assert f"| `{kernel}<{short_dtype[dtype]}, {head_size}>` | {kernel_file[kernel]} | {arch} |" in table
            assert f"| `merge_attn_states_kernel<{short_dtype[dtype]}>` | merge_attn_states.cu | {arch} |" in table
        for kernel in ("tpp_plan_kernel", "prefill_plan_kernel", "write_kv_kernel<uint4, i64>"):
            assert f"`{kernel}`" in table
    for cu in (ROOT / "csrc" / "cuda").glob("*.cu"):
        assert f"| {cu.name} |" in table, f"{cu.name} produced no kernels"
