"""Serve a shared-prefix workload through `vllm serve --attention-backend chunk`
on the embedded model, and report what happened.

    bash scripts/demo.sh            (sets up first)
    python examples/shared_prefix_demo.py [--model DIR] [--concurrency N]

The workload (vllm_chunkattn.testing.workload) has one system prompt shared by every
request, a document shared per group, and unique questions. The report shows
each group's answers, the request timings, vLLM's prefix-cache hit rate and
the backend's own log of how much decode KV it read once per batch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed

from vllm_chunkattn.testing.models import ensure_model
from vllm_chunkattn.testing.server import VllmServer
from vllm_chunkattn.testing.workload import shared_prefix_workload


def complete(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as r:
        reply = json.load(r)
    return {"text": reply["choices"][0]["text"], "usage": reply["usage"], "latency_s": time.perf_counter() - started}


def prometheus_value(metrics: str, name: str) -> float:
    values = [float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", metrics, re.M)]
    return sum(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    model = args.model or ensure_model("tiny")
    requests = shared_prefix_workload()
    serve_args = [
        "--attention-backend", "chunk", "--dtype", "float32", "--block-size", "32",
        "--max-model-len", "2048", "--enforce-eager", "--enable-prefix-caching",
    ]
    print(f"Starting: vllm serve {model} {' '.join(serve_args)}")
    print("(engine start takes about a minute on this machine)", flush=True)
    with VllmServer(model, serve_args, log_path="results/demo-server.log") as server:
        print(f"Server healthy at {server.url}; sending {len(requests)} requests, {args.concurrency} at a time\n")
        started = time.perf_counter()
        answers: dict[int, dict] = {}
        with ThreadPoolExecutor(args.concurrency) as pool:
            futures = {pool.submit(complete, server.url, model, r.prompt, r.max_tokens): i for i, r in enumerate(requests)}
            for done, future in enumerate(as_completed(futures), 1):
                answers[futures[future]] = future.result()
                print(f"\r  {done}/{len(requests)} requests done", end="", flush=True)
        wall_s = time.perf_counter() - started
        with urllib.request.urlopen(server.url + "/metrics") as r:
            metrics = r.read().decode()
        tree_lines = [line for line in server.log_text().splitlines() if "prefix tree:" in line or "Using CHUNK" in line]

    print("\n\nAnswers (greedy, first 60 characters):")
    for i, (req, ans) in enumerate(zip(requests, (answers[i] for i in range(len(requests))))):
        print(f"  [{req.group:>11}] prompt {ans['usage']['prompt_tokens']:4d} tok -> {ans['text'][:60]!r}")
    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers.values())
    output_tokens = sum(a["usage"]["completion_tokens"] for a in answers.values())
    hits = prometheus_value(metrics, "vllm:prefix_cache_hits_total")
    queries = prometheus_value(metrics, "vllm:prefix_cache_queries_total")
    print(f"\n{len(requests)} requests, {prompt_tokens} prompt and {output_tokens} output tokens in {wall_s:.1f} s "
          f"({output_tokens / wall_s:.1f} output tokens/s)")
    if queries:
        print(f"vLLM prefix cache: {hits:.0f} of {queries:.0f} prompt tokens served from shared blocks ({100 * hits / queries:.0f}%)")
    print("Backend log:")
    for line in tree_lines or ["  (no decode statistics logged: the run was shorter than the logging period)"]:
        print("  " + line.split("] ", 1)[-1])
    print("\nFull server log: results/demo-server.log")
    return 0


if __name__ == "__main__":
    sys.exit(main())
