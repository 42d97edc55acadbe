"""Tensor parallelism: `--tensor-parallel-size 2` with vLLM's multiprocessing
executor and with its Ray executor (on a local Ray cluster this test starts on
loopback and stops) on the CPU build (one rank per core here), each rank
running the prefix tree and the kernels over its own heads. Tokens and
logprobs equal to stock vLLM at the same parallel configuration, and both
ranks share."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from vllm_chunkattn.testing.compare import compare_runs
from vllm_chunkattn.backend.stats import parse_step_trees
from vllm_chunkattn.testing.e2e_runs import CONFIGS, run_workload
from vllm_chunkattn.testing.server import free_port

pytestmark = pytest.mark.e2e

NAME = "float32-gqa-d64-block32-preempt"  # 4 query heads over 2 KV heads: 2 over 1 per rank


@pytest.fixture(scope="module")
def mp_runs(tmp_path_factory) -> dict[str, dict]:
    """Stock and chunk at TP=2 on the multiprocessing executor, run at once."""
    tp = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
    with ThreadPoolExecutor(2) as pool:
        runs = pool.map(lambda backend: run_workload(tmp_path_factory, NAME, backend, extra_args=tp),
                        ("stock", "chunk"))
        return dict(zip(("stock", "chunk"), runs))


def test_tensor_parallel_matches_stock_and_every_rank_shares(mp_runs):
    *_, logprob_atol, near_tie = CONFIGS[NAME]
    stock, chunk = mp_runs["stock"], mp_runs["chunk"]
    assert chunk["settings"]["tensor_parallel_size"] == 2
    report = compare_runs(stock, chunk, logprob_atol, near_tie)
    assert not report["problems"], "\n".join(report["problems"][:20])
    assert [r["tokens"] for r in stock["results"]] == [r["tokens"] for r in chunk["results"]]
    # One whole-run summary per rank (each worker process logs its own), both sharing the same tree:
    # the tree comes from the block tables, which every rank has in full.
    summaries = chunk["decode_summaries"]
    assert len(summaries) == 2, chunk["log"][-3000:]
    assert all(s.mean_nodes > 0 and s.saved_tokens > 0 for s in summaries), summaries
    assert summaries[0].steps == summaries[1].steps and summaries[0].saved_tokens == summaries[1].saved_tokens


# Ray puts a node on a routable address unless told this host is a cluster of
# one (the variable's name is Ray's; it applies to Linux too). And it would
# print one rank's log line for lines all ranks print alike.
RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}


@pytest.fixture
def ray_cluster(monkeypatch):
    """A one-node Ray cluster bound to 127.0.0.1, with a logical CPU per rank,
    stopped with its whole process group."""
    pytest.importorskip("ray", reason="the `distributed` extra is not installed")
    port = free_port()
    env = {**os.environ, **RAY_LOOPBACK_ENV}
    ray = str(Path(sys.executable).with_name("ray"))
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
         "--include-dashboard=false", "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _accepts(port):
            assert head.poll() is None and time.monotonic() < deadline, head.stdout.read()[-3000:]
            time.sleep(0.5)
        for name, value in {**RAY_LOOPBACK_ENV, "RAY_ADDRESS": f"127.0.0.1:{port}"}.items():
            monkeypatch.setenv(name, value)
        yield port
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops the node's processes
        try:
            head.wait(timeout=10)  # its graceful stop can take half a minute; nothing here needs it
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _step_trees_by_rank(log: str) -> dict[str, list]:
    """The per-step tree lines of each tensor-parallel rank (Ray forwards its
    workers' output to the driver, prefixed with their names)."""
    by_rank: dict[str, list[str]] = {}
    for line in log.splitlines():
        rank = re.search(r"\(Worker_(TP\d+)", line)
        if rank:
            by_rank.setdefault(rank.group(1), []).append(line)
    return {rank: parse_step_trees("\n".join(lines)) for rank, lines in by_rank.items()}


def _assert_same_steps_up_to_lost_lines(tp0: list, tp1: list, max_lost_share: float = 0.05) -> None:
    """Both ranks planned the same tree at every step. Their lines reach this
    log through Ray's forwarding and several processes' buffered output, which
    can drop or split a line now and then (CI once saw 1 of ~90 missing), so
    the two sequences must agree up to a few lines missing from either one: a
    step the ranks planned differently costs a line on each side."""
    common = [[0] * (len(tp1) + 1) for _ in range(len(tp0) + 1)]  # longest common subsequence
    for i, step0 in enumerate(tp0):
        for j, step1 in enumerate(tp1):
            common[i + 1][j + 1] = common[i][j] + 1 if step0 == step1 else max(common[i][j + 1], common[i + 1][j])
    lost = len(tp0) + len(tp1) - 2 * common[-1][-1]
    assert lost <= max_lost_share * max(len(tp0), len(tp1)), \
        f"the ranks' step trees differ in {lost} of {len(tp0)} and {len(tp1)} lines"


def test_ray_executor_matches_stock_and_every_rank_shares(tmp_path_factory, ray_cluster, mp_runs):
    """chunk on Ray's executor against stock at the same parallel configuration
    (TP=2, gloo all-reduce; the executor only places the ranks: stock gives
    the same tokens on either)."""
    *_, logprob_atol, near_tie = CONFIGS[NAME]
    tp = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
    stock, chunk = mp_runs["stock"], run_workload(tmp_path_factory, NAME, "chunk", extra_args=tp)
    assert chunk["settings"]["distributed_executor_backend"] == "ray"
    assert "RayWorkerProc" in chunk["log"]  # the ranks ran as Ray actors
    report = compare_runs(stock, chunk, logprob_atol, near_tie)
    assert not report["problems"], "\n".join(report["problems"][:20])
    assert [r["tokens"] for r in stock["results"]] == [r["tokens"] for r in chunk["results"]]
    # Ray ends its actors without running their exit hooks, so no whole-run
    # line: the per-step trees (debug level) show both ranks sharing, alike.
    trees = _step_trees_by_rank(chunk["log"])
    assert set(trees) == {"TP0", "TP1"}, chunk["log"][-3000:]
    _assert_same_steps_up_to_lost_lines(trees["TP0"], trees["TP1"])
    assert any(step.nodes for step in trees["TP0"])
