"""Smoke run of the CPU kernel benchmark (tiny sizes): it runs ours and the
baselines side by side and writes the table, the JSON records and the plot.
Timings are printed, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import numpy as np

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


def test_serve_grid_is_the_serving_benchmarks_decode_shape():
    """`--grid serve`: 32 requests; prefix_repetition-2048 as 4 groups of 8 sharing 2048 tokens, the tree as one
    1024-token prompt shared by all under 4 groups of 8 sharing 1024 more; 192 private tokens each."""
    from vllm_chunkattn.bench.kernel import block_tables, grid_points

    prefix, tree = grid_points("serve", "fp32", quick=False)
    for w in (prefix, tree):
        assert (w.batch, w.heads, w.head_dim, w.chunk, w.context) == (32, 16, 128, 64, 2240)
        table, num_blocks = block_tables(w, True, np.random.default_rng(0))
        rows = [tuple(r) for r in table.tolist()]
        # 2048 shared tokens = 32 blocks, each group of 8 requests with its own; 3 private blocks per request.
        assert sorted(Counter(r[:32] for r in rows).values()) == [8, 8, 8, 8]
        assert len({b for r in rows for b in r[32:]}) == 32 * 3
        system = {r[:16] for r in rows}
        assert len(system) == (4 if w is prefix else 1)
        assert num_blocks == (4 * 32 if w is prefix else 16 + 4 * 16) + 32 * 3
