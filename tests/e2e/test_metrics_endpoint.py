"""The prefix tree's series on the API server's /metrics (vllm_chunkattn/metrics.py),
with tensor parallelism over 2 ranks: the values are the ones the workload
implies, counted once (not once per rank); requests that lose their share of a
cached prefix (prompt logprobs) are counted by cause and reported once (patch
0005); and every query of the Grafana dashboard names a series the server
exports."""

from __future__ import annotations

import json
import random
import re
import threading
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
PREFIX_CHUNKS, SUFFIX_TOKENS, MAX_TOKENS, NUM_REQUESTS = 4, 40, 24, 4


def scrape(url: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (one model, one engine
    here; histogram buckets sum to nothing meaningful and are only named),
    and (sample name, reason) -> value for series labelled by reason."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
            if "reason" in s.labels:
                values[s.name, s.labels["reason"]] = s.value
    return values


def complete(url: str, model: str, prompt: list[int], **params) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            **params}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        assert json.load(r)["usage"]["completion_tokens"] == MAX_TOKENS


def complete_together(url: str, model: str, prompts: list[list[int]], **params) -> None:
    """The requests sent at once (a barrier), so that they are scheduled
    within a step or two of each other and decode together for most of their
    MAX_TOKENS steps (sent from a pool without it and decoding 7 tokens each,
    once no two of them decoded in the same step, so nothing was shared)."""
    barrier = threading.Barrier(len(prompts))

    def send(prompt: list[int]) -> None:
        barrier.wait(timeout=60)
        complete(url, model, prompt, **params)

    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(send, prompts))


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
    prompts = [prefix + [rng.randrange(100, 500) for _ in range(SUFFIX_TOKENS)] for _ in range(NUM_REQUESTS + 3)]
    prompt_len = len(prompts[0])
    logprobs_prompts = prompts[NUM_REQUESTS + 1 :]

    with VllmServer(model, args, log_path=tmp_path / "server.log", env=env) as server:
        complete(server.url, model, prompts[0])  # caches the prefix
        before = scrape(server.url)
        complete_together(server.url, model, prompts[1 : NUM_REQUESTS + 1])
        after = scrape(server.url)
        # Two requests with the cached prefix that ask for prompt logprobs:
        # vLLM does not read the prefix cache for them, so each recomputes the
        # prefix into blocks of its own, and decoding together they share nothing.
        complete_together(server.url, model, logprobs_prompts, prompt_logprobs=1)
        final = scrape(server.url)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    lost = {name: final.get(name, 0.0) - after.get(name, 0.0) for name in final}

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

    # The sharing the prompt-logprobs requests lost: both decoded through the
    # tree, read nothing once for the two, and each is counted with what the
    # cache held of its prompt (the whole-chunk prefix) and reported once.
    assert lost["vllm:chunk_tree_rows_total"] == len(logprobs_prompts) * decode_steps
    assert lost["vllm:chunk_kv_tokens_saved_total"] == 0
    assert lost["vllm:prefix_cache_skipped_requests_total", "prompt_logprobs"] == len(logprobs_prompts)
    assert lost["vllm:prefix_cache_skipped_hits_total", "prompt_logprobs"] == len(logprobs_prompts) * len(prefix)
    assert delta["vllm:prefix_cache_skipped_requests_total"] == 0
    log = server.log_text()
    assert log.count("that the prefix cache holds") == 1, server.log_tail()
    assert f"recomputes {len(prefix)} prompt tokens" in log
    assert "because it asks for prompt logprobs" in log

    # The whole run as /metrics showed it equals what each rank logged for the
    # whole run when it exited (the ranks agree: same tree, same block tables).
    summaries = parse_run_summaries(log)
    assert len(summaries) == 2, server.log_tail()
    assert summaries[0] == summaries[1]
    assert final["vllm:chunk_kv_tokens_saved_total"] == summaries[0].saved_tokens
    assert final["vllm:chunk_kv_tokens_attended_total"] == summaries[0].context_tokens
    assert final["vllm:chunk_tree_steps_total"] == summaries[0].steps

    # Every series of the dashboard is on /metrics, ours and vLLM's.
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"vllm:[a-z_]+", target["expr"])}
    assert queried - set(final) == set()
    assert {s.name for s in SERIES} <= {re.sub(r"_(total|sum|count|bucket)$", "", n) for n in queried}
