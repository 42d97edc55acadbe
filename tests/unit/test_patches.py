"""The vLLM patches: they apply cleanly to the pinned vLLM, idempotently, and work."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_chunkattn.install import patching

PINNED = "0.32.0"


def test_installed_vllm_is_the_pinned_release():
    from vllm.version import __version__

    assert __version__.startswith(PINNED), __version__


def _targets(patch: Path) -> list[str]:
    return [line.split()[1][2:] for line in patch.read_text().splitlines() if line.startswith("+++ ")]


@pytest.mark.parametrize("patch", patching.patch_files(), ids=lambda p: p.name)
def test_patch_applies_cleanly_to_pristine_vllm(patch, tmp_path):
    # Recover the pristine files by reversing, in a copy, every installed patch
    # that touches them (later ones first), then check that the patches apply
    # forward in order without fuzz or offset and reproduce the installed files.
    site = patching.vllm_site_dir()
    targets = _targets(patch)
    stack = [p for p in patching.patch_files() if set(_targets(p)) & set(targets)]
    for rel in {rel for p in stack for rel in _targets(p)}:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(site / rel, tmp_path / rel)
    assert patching.state(patch, tmp_path) == "applied"
    for p in reversed(stack):
        subprocess.run(["patch", "-p1", "--batch", "--reverse", "-d", str(tmp_path), "-i", str(p)],
                       check=True, capture_output=True)
    assert patching.state(patch, tmp_path) == "applicable"
    for p in stack:
        out = subprocess.run(["patch", "-p1", "--batch", "--forward", "-d", str(tmp_path), "-i", str(p)],
                             check=True, capture_output=True, text=True).stdout
        assert "fuzz" not in out and "offset" not in out, (p.name, out)
    for rel in targets:
        assert (tmp_path / rel).read_text() == (site / rel).read_text()


def test_apply_is_idempotent():
    report = patching.apply_all()
    assert [what for _, what in report] == ["already applied"] * len(patching.patch_files())
    assert patching.all_applied()


def test_vllm_command_starts():
    vllm = Path(sys.executable).with_name("vllm")
    done = subprocess.run([str(vllm), "--version"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert PINNED in done.stdout


@pytest.mark.parametrize("module", ["vllm.platforms.cpu", "vllm.v1.worker.gpu_model_runner"])
def test_plugin_warns_when_a_patch_is_missing(module, tmp_path, monkeypatch, caplog):
    import importlib.util
    import logging

    from vllm_chunkattn import plugin

    find_spec = importlib.util.find_spec
    assert "not patched" not in _warnings_of(plugin, caplog)  # the installed vLLM is patched
    unpatched = tmp_path / "source.py"
    unpatched.write_text("# the pristine source has neither patch's code\n")

    def fake_find_spec(name, *args):
        spec = find_spec(name, *args)
        if name == module:
            spec = importlib.util.spec_from_file_location(name, unpatched)
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)
    with caplog.at_level(logging.WARNING):
        message = _warnings_of(plugin, caplog)
    assert "not patched" in message and module in message and "patching apply" in message


def _warnings_of(plugin, caplog) -> str:
    caplog.clear()
    plugin._warn_if_cpu_platform_unpatched()
    return caplog.text
