"""The offline batch benchmark end to end, as a user runs it (`--quick`: the
tiny model, 16 requests on a 256-token system prompt): both backends' engines
in their own processes, outputs compared before any speed is written."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_quick_offline_batch_compares_outputs_and_reports_a_ratio(tmp_path):
    out = tmp_path / "offline"
    done = subprocess.run([sys.executable, "-m", "vllm_chunkattn.bench.offline", "--quick", "--repeats", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = json.loads((out / "results.json").read_text())
    assert [(r["round"], r["backend"]) for r in saved["runs"]] == [(0, "stock"), (0, "chunk")]
    assert all(r["output_tokens"] == 16 * 16 and r["prompt_tokens"] == 16 * (256 + 16) for r in saved["runs"])
    [agreement] = saved["agreement"]
    assert agreement["compared_steps"] == 16 * 16 and agreement["diverged_requests"] == 0
    table = (out / "table.md").read_text()
    assert "Throughput chunk/stock:" in table and "CPU identity:" in table
    # chunk's run shared the system prompt: its whole-run line is in the report.
    chunk = next(r for r in saved["runs"] if r["backend"] == "chunk")
    assert "CHUNK prefix tree, whole run" in chunk["sharing"] and "mean 0.00 shared nodes" not in chunk["sharing"]
