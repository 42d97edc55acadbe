"""The prefix tree's Prometheus series: what a model-running process writes is
what prometheus_client's multiprocess collector (the API server's /metrics)
reads back."""

from __future__ import annotations

import os
import subprocess
import sys

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from vllm_chunkattn import metrics
from vllm_chunkattn.metrics import StepCounts


def scrape(path) -> dict[tuple[str, tuple], float]:
    """Every sample as /metrics would show it: (name, sorted labels) -> value."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(path))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def step(**kw) -> StepCounts:
    base = dict(requests=4, rows=4, multi_token_rows=0, nodes=1, context_tokens=1000, saved_tokens=600,
                rebuilt=False, plan_seconds=2e-4)
    return StepCounts(**{**base, **kw})


def test_counters_and_histograms_read_back_per_label_set(tmp_path):
    labels = (("engine", "0"), ("model_name", "m"))
    first = metrics.TreeMetricsWriter(str(tmp_path), "m", "0")
    first.record(step(rebuilt=True, nodes=0))
    first.record(step(nodes=3, plan_seconds=0.5))
    # A second builder of the same process (another KV-cache group) adds to the same series.
    metrics.TreeMetricsWriter(str(tmp_path), "m", "0").record(step(rows=6, context_tokens=10, saved_tokens=0))
    metrics.TreeMetricsWriter(str(tmp_path), "other", "1").record(step())
    got = scrape(tmp_path)

    assert got[("vllm:chunk_tree_steps_total", labels)] == 3
    assert got[("vllm:chunk_tree_rows_total", labels)] == 14
    assert got[("vllm:chunk_kv_tokens_attended_total", labels)] == 2010
    assert got[("vllm:chunk_kv_tokens_saved_total", labels)] == 1200
    assert got[("vllm:chunk_tree_rebuilds_total", labels)] == 1
    assert got[("vllm:chunk_tree_steps_total", (("engine", "1"), ("model_name", "other")))] == 1
    # Histograms are cumulative over the buckets: nodes 0, 3, 1.
    nodes = {dict(k[1])["le"]: v for k, v in got.items()
             if k[0] == "vllm:chunk_tree_nodes_bucket" and dict(k[1])["model_name"] == "m"}
    assert nodes["0.0"] == 1 and nodes["1.0"] == 2 and nodes["2.0"] == 2 and nodes["4.0"] == 3
    assert nodes["+Inf"] == 3
    assert got[("vllm:chunk_tree_nodes_count", labels)] == 3
    assert got[("vllm:chunk_tree_nodes_sum", labels)] == 4
    assert abs(got[("vllm:chunk_plan_seconds_sum", labels)] - (0.5 + 4e-4)) < 1e-9
    plan = {dict(k[1])["le"]: v for k, v in got.items()
            if k[0] == "vllm:chunk_plan_seconds_bucket" and dict(k[1])["model_name"] == "m"}
    assert (plan["0.0001"], plan["0.0003"], plan["0.1"]) == (0, 2, 2)  # 2e-4 twice, 0.5 above every bound
    assert plan["+Inf"] == 3
    # Every series of the list, and nothing else, under the chunk prefix.
    names = {name for name, _ in got}
    for series in metrics.SERIES:
        suffixes = ("_total",) if series.kind == "counter" else ("_bucket", "_sum", "_count")
        assert {series.name + s for s in suffixes} <= names
    assert all(name.startswith("vllm:chunk_") for name in names)


def test_two_processes_write_apart_and_add_up(tmp_path):
    """Two processes (two pids: a worker and its restarted successor) write
    separate files, and the collector sums them."""
    code = ("import sys; from vllm_chunkattn import metrics; from vllm_chunkattn.metrics import StepCounts;"
            "metrics.TreeMetricsWriter(sys.argv[1], 'm', '0').record(StepCounts(2, 2, 0, 1, 50, 20, True, 1e-4))")
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    assert len(os.listdir(tmp_path)) == 4  # counter and histogram file of each process
    got = scrape(tmp_path)
    labels = (("engine", "0"), ("model_name", "m"))
    assert got[("vllm:chunk_kv_tokens_saved_total", labels)] == 40
    assert got[("vllm:chunk_tree_nodes_count", labels)] == 2


def test_the_first_process_makes_the_directory_and_children_inherit_it(tmp_path):
    """The process that loads the plugin first creates the directory and
    serves it from its default registry; a child started with the variable
    writes into it; the directory goes when its creator exits."""
    code = r"""
import os, subprocess, sys
from prometheus_client import REGISTRY, generate_latest
from vllm_chunkattn import metrics
os.environ.pop(metrics.VLLM_MULTIPROC_DIR_ENV, None)
os.environ.pop(metrics.METRICS_DIR_ENV, None)
metrics.init_metrics_dir()
metrics.init_metrics_dir()  # loading plugins twice registers one collector
path = os.environ[metrics.METRICS_DIR_ENV]
child = ("from vllm_chunkattn import metrics; from vllm_chunkattn.metrics import StepCounts;"
         "metrics.init_metrics_dir();"
         "metrics.metrics_writer('m', '0').record(StepCounts(3, 3, 0, 1, 90, 60, False, 1e-4))")
subprocess.run([sys.executable, "-c", child], check=True)
text = generate_latest(REGISTRY).decode()
print(path)
print([l for l in text.splitlines() if l.startswith("vllm:chunk_kv_tokens_saved_total")])
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    path, line = out.splitlines()[-2:]
    assert line == "['vllm:chunk_kv_tokens_saved_total{engine=\"0\",model_name=\"m\"} 60.0']"
    assert path.startswith("/") and not os.path.exists(path)  # removed when the creator exited


def test_no_directory_no_writer(monkeypatch, tmp_path):
    monkeypatch.delenv(metrics.VLLM_MULTIPROC_DIR_ENV, raising=False)
    monkeypatch.delenv(metrics.METRICS_DIR_ENV, raising=False)
    assert metrics.metrics_writer("m", "0") is None
    monkeypatch.setenv(metrics.METRICS_DIR_ENV, str(tmp_path / "gone"))
    assert metrics.metrics_writer("m", "0") is None
    # vLLM's own multiprocess directory wins: its collector serves it.
    monkeypatch.setenv(metrics.VLLM_MULTIPROC_DIR_ENV, str(tmp_path))
    writer = metrics.metrics_writer("m", "0")
    writer.record(step())
    assert scrape(tmp_path)[("vllm:chunk_tree_steps_total", (("engine", "0"), ("model_name", "m")))] == 1
