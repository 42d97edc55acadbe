"""Before timing anything: do both servers give the same greedy answers?

The same prompts (with shared prefixes, sent together so they are decoded
in one batch and the shared-prefix path runs) go to each server with
temperature 0 and ignore_eos. Greedy decoding is exact only up to rounding:
where the two best tokens of a step are closer than rounding can separate,
two correct backends may pick different tokens and then differ forever. So
a difference is reported with the top-2 logprob gap at its first step.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

NEAR_TIE = 1e-3  # float32: logprobs of the two backends agree far closer than this


def complete(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 600.0) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 2}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        choice = json.load(r)["choices"][0]
    lp = choice["logprobs"]
    return {"text": choice["text"], "tokens": lp["tokens"], "top_logprobs": lp["top_logprobs"]}


def greedy_completions(url: str, model: str, prompts: list[str], max_tokens: int) -> list[dict]:
    pool = ThreadPoolExecutor(len(prompts))
    try:
        return list(pool.map(lambda p: complete(url, model, p, max_tokens), prompts))
    finally:
        # Not waiting: on Ctrl-C the caller stops the server, which ends the requests.
        pool.shutdown(wait=False, cancel_futures=True)


def _top2_gap(top: dict[str, float] | None) -> float:
    values = sorted((top or {}).values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def compare(stock: list[dict], chunk: list[dict]) -> dict:
    """Identical completions, and for each that differs its first differing step."""
    differences = []
    for i, (a, b) in enumerate(zip(stock, chunk, strict=True)):
        if a["tokens"] == b["tokens"]:
            continue
        step = next(s for s, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
        gaps = (_top2_gap(a["top_logprobs"][step]), _top2_gap(b["top_logprobs"][step]))
        differences.append({
            "request": i, "step": step, "stock_token": a["tokens"][step], "chunk_token": b["tokens"][step],
            "top2_gap_stock": gaps[0], "top2_gap_chunk": gaps[1], "near_tie": min(gaps) <= NEAR_TIE,
        })
    return {
        "requests": len(stock),
        "identical": len(stock) - len(differences),
        "all_identical": not differences,
        "differences_all_near_ties": all(d["near_tie"] for d in differences),
        "differences": differences,
    }


def describe(result: dict) -> str:
    line = f"{result['identical']}/{result['requests']} greedy completions identical"
    for d in result["differences"]:
        line += (f"; request {d['request']} differs from step {d['step']} "
                 f"({d['stock_token']!r} vs {d['chunk_token']!r}, top-2 logprob gaps "
                 f"{d['top2_gap_stock']:.2g} / {d['top2_gap_chunk']:.2g}"
                 f"{', a near tie' if d['near_tie'] else ', NOT a near tie'})")
    return line


def compare_benchmark_texts(out_dir: Path, runs: list[dict]) -> dict[str, list[int]]:
    """The benchmark runs are greedy too (--temperature 0) and saved with their
    texts, in request order: per run present for both servers, [identical, compared].
    Informational: in big batches a near tie may legitimately go either way."""
    raw = {(r["server"], r["workload"], r["mode"], r["x"], r.get("repeat", 1)): r["raw"] for r in runs if r.get("raw")}
    result = {}
    for (server, workload, mode, x, repeat), path in sorted(raw.items(), key=str):
        other = raw.get(("chunk", workload, mode, x, repeat))
        if server != "stock" or other is None:
            continue
        a = json.loads((Path(out_dir) / path).read_text()).get("generated_texts") or []
        b = json.loads((Path(out_dir) / other).read_text()).get("generated_texts") or []
        name = f"{workload}-" + (f"c{x:g}" if mode == "concurrency" else f"r{x:g}") + (f"-rep{repeat}" if repeat > 1 else "")
        result[name] = [sum(x == y for x, y in zip(a, b)), min(len(a), len(b))]
    return result
