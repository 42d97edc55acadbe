"""How the build finds the CUDA toolkit and picks GPU architectures
(vllm_chunkattn/install/cuda_toolkit.py, used by setup.py); no GPU or CUDA torch needed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from vllm_chunkattn.install.cuda_toolkit import DEFAULT_CUDA_ARCHS, cuda_arch_list, find_cuda_home


def test_default_architectures():
    assert cuda_arch_list(None) == (DEFAULT_CUDA_ARCHS, [])
    assert cuda_arch_list("  ") == (DEFAULT_CUDA_ARCHS, [])
    assert DEFAULT_CUDA_ARCHS.split() == ["8.0", "8.6", "8.9", "9.0+PTX"]


@pytest.mark.parametrize(
    "requested, kept, dropped",
    [
        # vLLM's Docker images export this list
        ("7.0 7.5 8.0 8.9 9.0 10.0 12.0", "8.0 8.9 9.0 10.0 12.0", ["7.0", "7.5"]),
        ("7.5;8.0;9.0a+PTX", "8.0 9.0a+PTX", ["7.5"]),
        ("6.1+PTX 8.6", "8.6", ["6.1+PTX"]),
        ("Ampere 9.0", "Ampere 9.0", []),
        ("7.5", "", ["7.5"]),
    ],
)
def test_architectures_older_than_sm80_are_dropped(requested, kept, dropped):
    assert cuda_arch_list(requested) == (kept, dropped)


def _script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_toolkit_found_through_an_nvcc_wrapper_script(tmp_path, monkeypatch):
    # The layout of our CI machine: /usr/local/bin/nvcc is a script that runs
    # the toolkit's nvcc, so "the folder above nvcc" is not the toolkit.
    toolkit = tmp_path / "cuda-x"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    _script(toolkit / "bin" / "nvcc", f'echo "#$ TOP={toolkit}/bin/.." >&2\n')
    _script(tmp_path / "wrap" / "bin" / "nvcc", f'exec {toolkit}/bin/nvcc "$@"\n')
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'wrap' / 'bin'}{os.pathsep}{os.environ['PATH']}")
    assert find_cuda_home() == toolkit.resolve()


def test_cuda_home_wins_when_it_is_a_toolkit(tmp_path, monkeypatch):
    toolkit = tmp_path / "mine"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    assert find_cuda_home() == toolkit.resolve()
