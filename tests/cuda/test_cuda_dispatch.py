"""The CUDA dispatch lists (csrc/cuda/dispatch.h: head sizes, dtypes, block
sizes, the one place the CUDA kernels, their torch wrappers and the emulator
read them from) match support.CUDA, the table the backend's validation reads.
No GPU needed: a small host program includes the header and prints the lists
as the kernels' X-macros expand them."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from vllm_chunkattn.kernels import support

ROOT = Path(__file__).resolve().parents[2]

PRINTER = r"""
#include <cstdio>
#include "cuda/dispatch.h"

int main() {
  const char* sep = "";
  std::printf("{\"head_sizes\": [");
#define PRINT_INT(V) std::printf("%s%d", sep, V); sep = ", ";
  CHUNKATTN_CUDA_FOR_EACH_HEAD_SIZE(PRINT_INT)
  sep = "";
  std::printf("], \"block_sizes\": [");
  CHUNKATTN_CUDA_FOR_EACH_BLOCK_SIZE(PRINT_INT)
  sep = "";
  std::printf("], \"dtypes\": [");
#define PRINT_DTYPE(ENUM, T, SCALAR, NAME) std::printf("%s\"%s\"", sep, NAME); sep = ", ";
  CHUNKATTN_CUDA_FOR_EACH_DTYPE(PRINT_DTYPE)
  std::printf("], \"messages\": [\"%s\", \"%s\", \"%s\"]}\n", chunkattn::cuda::supported_head_sizes().c_str(),
              chunkattn::cuda::supported_block_sizes().c_str(), chunkattn::cuda::supported_dtypes().c_str());
}
"""


@pytest.fixture(scope="module")
def dispatch_lists(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler to expand csrc/cuda/dispatch.h")
    build = tmp_path_factory.mktemp("dispatch")
    (build / "print.cpp").write_text(PRINTER)
    subprocess.run([cxx, "-std=c++17", f"-I{ROOT / 'csrc'}", str(build / "print.cpp"), "-o", str(build / "print")],
                   check=True)
    return json.loads(subprocess.run([str(build / "print")], check=True, capture_output=True, text=True).stdout)


def test_cuda_dispatch_lists_match_the_support_table(dispatch_lists):
    assert tuple(dispatch_lists["head_sizes"]) == support.CUDA.head_sizes
    assert tuple(dispatch_lists["block_sizes"]) == support.CUDA.block_sizes
    assert tuple(getattr(torch, name) for name in dispatch_lists["dtypes"]) == support.CUDA.dtypes


def test_cuda_error_messages_name_the_support_table(dispatch_lists):
    assert dispatch_lists["messages"] == [support.names(support.CUDA.head_sizes),
                                          support.names(support.CUDA.block_sizes),
                                          support.names(support.CUDA.dtypes)]


def test_no_cuda_source_spells_out_its_own_head_size_list():
    """The lists live in dispatch.h only: a `case 64:` or `== 256` elsewhere is a second copy."""
    for path in sorted((ROOT / "csrc" / "cuda").glob("*")):
        if path.name == "dispatch.h":
            continue
        text = path.read_text()
        for head_size in support.CUDA.head_sizes:
            assert f"case {head_size}:" not in text, f"{path.name} dispatches on head size {head_size} by hand"
            assert f"head_size == {head_size}" not in text, f"{path.name} checks head size {head_size} by hand"
