"""The multi-turn benchmark's CI run (`--quick`, stock and pensieve: the tiny
model, 4 conversations of 5 turns on a KV cache smaller than their KV): it
exits cleanly with the greedy check passed, reports every metric of both
configurations, the pensieve server continues later turns from its host tier,
and the plots are written. Correctness only: speed is never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from vllm_chunkattn.bench.multiturn import RunMetrics

pytestmark = pytest.mark.e2e

CONFIGS = ("stock", "pensieve")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-multiturn")
    cmd = [sys.executable, "-m", "vllm_chunkattn.bench.multiturn", "--quick", "--configs", ",".join(CONFIGS),
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    print(done.stdout)  # progress lines and the tables, shown by pytest on failure
    return out, done


def test_exits_cleanly_with_the_greedy_check_passed(quick_run):
    out, done = quick_run
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    results = json.loads((out / "results.json").read_text())
    gate = results["gate"]["pensieve"]
    assert gate["passed"] and gate["turns_compared"] >= 2, gate["summary"]
    assert "SLO summary" in done.stdout


def test_every_metric_of_both_configurations(quick_run):
    out, _ = quick_run
    results = json.loads((out / "results.json").read_text())
    runs = {r["config"]: r["metrics"] for r in results["runs"]}
    assert set(runs) == set(CONFIGS)
    always = {"request_throughput", "output_throughput", "ttft_p50_s", "ttft_p90_s", "normalised_latency_mean_s",
              "normalised_latency_p90_s", "prompt_tokens", "prefill_computed_tokens", "prefix_cache_hit_rate"}
    for config, metrics in runs.items():
        assert set(metrics) == {f.name for f in fields(RunMetrics)}, config
        assert all(metrics[k] is not None and metrics[k] >= 0 for k in always), (config, metrics)
        assert metrics["turns_completed"] == metrics["turns"] == 20 and not metrics["timed_out"]
        assert metrics["output_throughput"] > 0 and metrics["normalised_latency_p90_s"] > 0
    assert runs["stock"]["host_tier_hit_rate"] is None and runs["pensieve"]["host_tier_hit_rate"] is not None
    table = (out / "table.md").read_text()
    assert "| conv/s | stock | pensieve |" in table and "Highest rate under the SLO" in table


def test_the_kv_cache_loses_history_and_pensieve_loads_it_from_the_host_tier(quick_run):
    out, _ = quick_run
    results = json.loads((out / "results.json").read_text())
    assert results["sizing"]["kv_ratio"] >= 2  # the conversations' KV is at least twice the KV cache
    stock = {r["config"]: r["metrics"] for r in results["runs"]}["stock"]
    turns = json.loads((out / "raw" / "stock-r1.json").read_text())
    by_turn = {(t["conversation"], t["turn"]): t for t in turns}
    history = sum(by_turn[(c, n - 1)]["prompt_tokens"] + len(by_turn[(c, n - 1)]["answer"])
                  for c, n in by_turn if n >= 2)  # what turns >= 2 resend
    assert stock["prefix_cache_hit_tokens"] < 0.8 * history, (stock, history)
    pensieve = {r["config"]: r["metrics"] for r in results["runs"]}["pensieve"]
    # Every first turn is new random tokens, so whatever the host tier supplied went to turns >= 2.
    assert pensieve["host_tier_hit_tokens"] > 0, pensieve
    # the connector made the host tier the benchmark asked for
    assert f"host tier of {results['sizing']['host_tier_blocks']} blocks" in results["servers"]["pensieve-r1"][
        "connector_log"]


def test_plots_written(quick_run):
    out, _ = quick_run
    for name in ("normalised_latency_p90.png", "ttft_p90_turns2plus.png"):
        path = out / name
        assert path.is_file() and path.stat().st_size > 1000, name


def test_no_server_left_running(quick_run):
    out, _ = quick_run
    results = json.loads((out / "results.json").read_text())
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert len(results["servers"]) == len(CONFIGS)
    for server in results["servers"].values():
        port = server["url"].rsplit(":", 1)[1]
        assert not [line for line in ps.splitlines() if "serve" in line and f"--port {port}" in line]
