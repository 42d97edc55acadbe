"""The prefix tree's series on the API server's /metrics (vllm_chunkattn/metrics.py),
with tensor parallelism over 2 ranks: the values are the ones the workload
implies, counted once (not once per rank), and every query of the Grafana
dashboard names a series the server exports."""

from __future__ import annotations

import json
import random
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_chunkattn.backend.stats import parse_run_summaries
from vllm_chunkattn.kernels import cpu_tuning
from vllm_chunkattn.metrics import SERIES
from vllm_chunkattn.testing.e2e_runs import CONFIGS
from vllm_chunkattn.testing.models import ensure_model
from vllm_chunkattn.testing.server import VllmServer

pytestmark = pytest.mark.e2e

CONFIG = "float32-gqa-d64-block32-preempt"  # block size 32; GQA group 2: tree rows up to 8 new tokens
DASHBOARD = Path(__file__).parents[2] / "examples" / "prometheus_grafana" / "grafana.json"
PREFIX_CHUNKS, SUFFIX_TOKENS, MAX_TOKENS, NUM_REQUESTS = 4, 40, 8, 4


def scrape(url: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (one model, one engine
    here; histogram buckets sum to nothing meaningful and are only named)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def complete(url: str, model: str, prompt: list[int]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        assert json.load(r)["usage"]["completion_tokens"] == MAX_TOKENS


def test_tree_series_count_the_workload_once_under_tensor_parallelism(tmp_path):
    model_name, dtype, block_size, _, _, _ = CONFIGS[CONFIG]
    model = ensure_model(model_name)
    args = ["--attention-backend", "chunk", "--dtype", dtype, "--block-size", str(block_size),
            "--max-num-seqs", str(NUM_REQUESTS), "--max-num-batched-tokens", "512", "--max-model-len", "512",
            "--enforce-eager", "--enable-prefix-caching", "--seed", "0",
            "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", cpu_tuning.ENV_VAR: "default"}
    # Token-id prompts: a prefix of whole chunks, then a suffix of its own per
    # request, longer than the tree takes, so every prompt is prefilled
    # per request and only decode rows run through the tree.
    rng = random.Random(0)
    prefix = [rng.randrange(100, 500) for _ in range(PREFIX_CHUNKS * block_size)]
    prompts = [prefix + [rng.randrange(100, 500) for _ in range(SUFFIX_TOKENS)] for _ in range(NUM_REQUESTS + 1)]
    prompt_len = len(prompts[0])

    with VllmServer(model, args, log_path=tmp_path / "server.log", env=env) as server:
        complete(server.url, model, prompts[0])  # caches the prefix
        before = scrape(server.url)
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            list(pool.map(lambda p: complete(server.url, model, p), prompts[1:]))
        after = scrape(server.url)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}

    # Each request decodes MAX_TOKENS - 1 tokens after its prefill, one tree row
    # each, attending prompt_len + 1, ..., prompt_len + MAX_TOKENS - 1 keys.
    decode_steps = MAX_TOKENS - 1
    assert delta["vllm:chunk_tree_rows_total"] == NUM_REQUESTS * decode_steps
    attended = NUM_REQUESTS * (decode_steps * prompt_len + decode_steps * (decode_steps + 1) // 2)
    assert delta["vllm:chunk_kv_tokens_attended_total"] == attended  # one rank's count, not two
    # Requests decoding together read the prefix chunks once: at most all of
    # them in every decode step, and some sharing happened.
    most = decode_steps * (NUM_REQUESTS - 1) * PREFIX_CHUNKS * block_size
    assert 0 < delta["vllm:chunk_kv_tokens_saved_total"] <= most, delta
    assert decode_steps <= delta["vllm:chunk_tree_steps_total"] <= NUM_REQUESTS * decode_steps
    assert delta["vllm:chunk_tree_nodes_count"] == delta["vllm:chunk_tree_steps_total"]
    assert delta["vllm:chunk_tree_nodes_sum"] > 0
    assert 0 < delta["vllm:chunk_tree_rebuilds_total"] <= delta["vllm:chunk_tree_steps_total"]
    assert delta["vllm:chunk_plan_seconds_count"] == delta["vllm:chunk_tree_steps_total"]

    # The whole run as /metrics showed it equals what each rank logged for the
    # whole run when it exited (the ranks agree: same tree, same block tables).
    summaries = parse_run_summaries(server.log_text())
    assert len(summaries) == 2, server.log_tail()
    assert summaries[0] == summaries[1]
    assert after["vllm:chunk_kv_tokens_saved_total"] == summaries[0].saved_tokens
    assert after["vllm:chunk_kv_tokens_attended_total"] == summaries[0].context_tokens
    assert after["vllm:chunk_tree_steps_total"] == summaries[0].steps

    # Every series of the dashboard is on /metrics, ours and vLLM's.
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"vllm:[a-z_]+", target["expr"])}
    assert queried - set(after) == set()
    assert {s.name for s in SERIES} <= {re.sub(r"_(total|sum|count|bucket)$", "", n) for n in queried}
