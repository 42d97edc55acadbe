"""Smoke run of the CPU kernel benchmark (tiny sizes): it runs ours and the
baselines side by side and writes the table, the JSON records and the plot.
Timings are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys

RECORD_FIELDS = {"impl", "n_p", "n_s", "batch", "heads", "head_dim", "chunk", "median_ms", "min_ms", "max_ms"}


def test_kernel_benchmark_quick(tmp_path):
    cmd = [sys.executable, "-m", "vllm_chunkattn.bench.kernel", "--quick", "--grid", "table3", "--dtype", "both", "--repeats", "3", "--warmup", "1",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(done.stdout[-4000:])
    table = (tmp_path / "table.md").read_text()
    assert "PagedAttn*" in table and "ours" in table
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    assert {r["impl"] for r in records} >= {"ours", "PagedAttn", "PagedAttn*", "Naive", "SDPA"}
    for record in records:
        assert RECORD_FIELDS <= record.keys()
        assert 0 < record["min_ms"] <= record["median_ms"] <= record["max_ms"]
    assert (tmp_path / "table3.png").stat().st_size > 1000
