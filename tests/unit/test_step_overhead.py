"""Smoke run of the per-step overhead benchmark (bench/step_overhead.py) on a
tiny step: it builds, runs every layer and writes its JSON."""

from __future__ import annotations

import json

from vllm_chunkattn.bench import step_overhead
from vllm_chunkattn.kernels import cpu_tuning


def test_quick_step_runs_and_reports_both_batches(tmp_path, monkeypatch):
    # The built-in tile parameters: measuring them for the step's layer shape took 30 of the test's 31 s,
    # and this smoke run asserts no timing.
    monkeypatch.setenv(cpu_tuning.ENV_VAR, "default")
    out = tmp_path / "step.json"
    results = step_overhead.main(["--quick", "--dtype", "fp32", "--out", str(out)])
    assert [r.batch_name for r in results] == ["shared", "unshared"]
    assert all(r.build_ms > 0 and r.layers_ms > 0 for r in results)
    saved = json.loads(out.read_text())
    assert saved["shape"]["layers"] == 4 and len(saved["results"]) == 2
    assert saved["results"][0]["shared_tokens"] == 128 and saved["results"][1]["shared_tokens"] == 0
