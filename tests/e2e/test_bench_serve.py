"""The serving benchmark's CI run (`--quick`: tiny model, a few dozen requests):
both servers start and stop, answer the same greedy requests identically, and
every output file is written. Correctness only: speed is never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-serve")
    cmd = [sys.executable, "-m", "vllm_chunkattn.bench.serve", "--quick", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=os.environ.copy())
    print(done.stdout)  # progress lines, shown by pytest on failure
    return out, done


def test_exits_cleanly_with_identical_greedy_completions(quick_run):
    out, done = quick_run
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    results = json.loads((out / "results.json").read_text())
    check = results["greedy_check"]
    assert check["all_identical"], check["summary"]
    assert check["requests"] >= 4


def test_table_has_both_servers_and_ratios(quick_run, capsys):
    out, _ = quick_run
    table = (out / "table.md").read_text()
    with capsys.disabled():  # shown in the CI log, pass or fail
        print("\n" + table)
    results = json.loads((out / "results.json").read_text())
    for w in results["workloads"]:
        for server in ("stock", "chunk", "**chunk/stock**"):
            assert f"| {w['name']} | {server} |" in table


def test_raw_results_are_complete(quick_run):
    out, _ = quick_run
    results = json.loads((out / "results.json").read_text())
    assert {(r["server"], r["workload"]) for r in results["runs"]} == {
        (s, w["name"]) for s in ("stock", "chunk") for w in results["workloads"]}
    for record in results["runs"]:
        raw = json.loads((out / record["raw"]).read_text())
        assert raw["completed"] == raw["num_prompts"] > 0, record["raw"]
        assert 0 <= record["peak_kv_cache_usage"] <= 1
    # The /metrics poller saw each server's batch and KV cache. Quick runs last
    # well under a second, so one of them can fall between two samples; not all.
    for server in ("stock", "chunk"):
        runs = [r for r in results["runs"] if r["server"] == server]
        assert max(r["peak_batch"] for r in runs) >= 1, server
        assert max(r["peak_kv_cache_usage"] for r in runs) > 0, server


def test_plots_written(quick_run):
    out, _ = quick_run
    for name in ("fig5_normalised_latency.png", "throughput.png"):
        path = Path(out) / name
        assert path.is_file() and path.stat().st_size > 1000, name


def test_no_server_left_running(quick_run):
    out, _ = quick_run
    results = json.loads((out / "results.json").read_text())
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    for server in results["servers"].values():
        port = server["url"].rsplit(":", 1)[1]
        assert not [line for line in ps.splitlines() if "serve" in line and f"--port {port}" in line]


def test_a_warm_workload_starts_its_timed_run_with_the_prefixes_cached(quick_run):
    """prefix_repetition-256-warm sends its requests once, untimed, before the timed run; the same requests
    from an empty cache (prefix_repetition-256) compute the prefixes inside theirs."""
    out, _ = quick_run
    results = json.loads((out / "results.json").read_text())
    runs = {(r["server"], r["workload"]): r for r in results["runs"]}
    for server in ("stock", "chunk"):
        cold, warm = runs[(server, "prefix_repetition-256")], runs[(server, "prefix_repetition-256-warm")]
        assert warm["prefix_cache_hit_rate"] > cold["prefix_cache_hit_rate"], (server, cold, warm)
        warm_ups = [k for k in results["timings_s"] if k.startswith(f"{server}/") and k.endswith("/warm-up")]
        assert warm_ups == [f"{server}/prefix_repetition-256-warm-c32-rep1/warm-up"]
        assert (out / "logs" / f"{server}-prefix_repetition-256-warm-c32-rep1.warm-up.log").is_file()
