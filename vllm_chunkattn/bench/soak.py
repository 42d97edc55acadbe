"""Soak: drive one `chunk` server for a long time and fail on what an operator would be paged for.

    python -m vllm_chunkattn.bench.soak                       # 60 minutes, the tiny model
    python -m vllm_chunkattn.bench.soak --minutes 5 --out DIR

`--clients` threads loop over a fixed mix of requests until the time is up:
greedy completions of prompts that share a system prompt and of prompts that
share nothing, the same streamed, streams the client drops after a few chunks,
bad requests (each must get a 4xx), and seeded parallel sampling (n = 3).
Every `--sample-seconds` the resident memory of every process of the server
(API server, engine core, workers: its process group) and a few `/metrics`
series are sampled, and a progress line is printed.

The run fails (exit status 1) on:
- resident memory of all the server's processes more than `--max-growth`
  (5%) above its level at the end of warm-up (mean of the last three samples
  against the first sample after warm-up);
- any 5xx response, or a bad request that does not get a 4xx;
- an answer that differs from the same request's first answer: greedy answers
  must have identical tokens (logprobs within 1e-3), except after a near tie of
  the two best tokens (within `--near-tie`: floating-point rounding may pick
  either when the batch around a request changes); sampled answers must be
  identical.

Results go to --out: soak.json (every sample, the counts, the verdict) and
soak.png (memory, requests and sharing over time).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from vllm_chunkattn.bench import machine
from vllm_chunkattn.bench.metrics_poller import scrape
from vllm_chunkattn.testing.compare import compare_runs
from vllm_chunkattn.testing.models import ensure_model
from vllm_chunkattn.testing.server import VllmServer
from vllm_chunkattn.testing.workload import WORDS

# /metrics series sampled (summed over label sets).
SAMPLED_SERIES = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:request_success_total",
                  "vllm:generation_tokens_total", "vllm:chunk_kv_tokens_attended_total",
                  "vllm:chunk_kv_tokens_saved_total")
LOGPROB_ATOL = 1e-3


@dataclass(frozen=True)
class SoakRequest:
    name: str
    kind: str  # greedy | stream | disconnect | bad | sampled
    path: str
    body: dict


def request_mix(seed: int = 0) -> list[SoakRequest]:
    """The fixed catalogue the clients cycle through (shuffled per client)."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words))

    system = "System: you are a careful assistant. " + text(150) + "\n"
    shared = [system + f"Question {i}: " + text(6 + 3 * i) + "?\n" for i in range(6)]
    unshared = [f"{rng.choice(WORDS)} {i}: " + text(60) for i in range(4)]
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    mix = [SoakRequest(f"shared-{i}", "greedy", "/v1/completions", dict(prompt=p, **greedy))
           for i, p in enumerate(shared)]
    mix += [SoakRequest(f"unshared-{i}", "greedy", "/v1/completions", dict(prompt=p, **greedy))
            for i, p in enumerate(unshared)]
    mix += [SoakRequest(f"stream-{r.name}", "stream", r.path, dict(r.body, stream=True)) for r in mix[::3]]
    mix += [SoakRequest(f"disconnect-{i}", "disconnect", "/v1/completions",
                        dict(prompt=p, max_tokens=64, temperature=0, ignore_eos=True, stream=True))
            for i, p in enumerate(shared[:2] + unshared[:1])]
    mix += [SoakRequest("bad-negative-max-tokens", "bad", "/v1/completions", dict(prompt=shared[0], max_tokens=-1)),
            SoakRequest("bad-too-long", "bad", "/v1/completions", dict(prompt=system * 40, max_tokens=8)),
            SoakRequest("bad-unknown-model", "bad", "/v1/completions",
                        dict(prompt=shared[1], max_tokens=8, model="no-such-model"))]
    mix += [SoakRequest(f"sampled-{i}", "sampled", "/v1/completions",
                        dict(prompt=p, max_tokens=16, temperature=0.8, n=3, seed=1234 + i, ignore_eos=True))
            for i, p in enumerate(shared[:2] + unshared[:1])]
    return mix


@dataclass
class Answer:
    status: int
    text: str = ""
    tokens: list = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)  # per token: [(token, logprob), ...]


def _logprob_steps(logprobs: dict | None) -> tuple[list, list]:
    if not logprobs:
        return [], []
    return list(logprobs["tokens"]), [sorted(step.items()) for step in logprobs["top_logprobs"]]


def send(url: str, model: str, request: SoakRequest, timeout_s: float = 300) -> Answer:
    body = {"model": model, **request.body}
    http = urllib.request.Request(url + request.path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as response:
            if not body.get("stream"):
                choices = json.load(response)["choices"]
                tokens, top = _logprob_steps(choices[0].get("logprobs"))
                return Answer(response.status, "\x1e".join(c["text"] for c in choices), tokens, top)
            answer = Answer(response.status)
            for chunks, line in enumerate(response):
                if request.kind == "disconnect" and chunks >= 4:
                    break  # closing the response drops the connection mid-stream
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[len("data: "):])["choices"][0]
                answer.text += choice["text"]
                tokens, top = _logprob_steps(choice.get("logprobs"))
                answer.tokens += tokens
                answer.top_logprobs += top
            return answer
    except urllib.error.HTTPError as e:
        return Answer(e.code)


def same_answer(first: Answer, later: Answer, kind: str, near_tie: float) -> str | None:
    """None where `later` counts as the same answer as `first`, else why not."""
    if kind == "sampled" or not first.tokens:
        return None if later.text == first.text else f"text {later.text[:60]!r} != {first.text[:60]!r}"
    record = lambda a: {"results": [{"tokens": a.tokens, "top_logprobs": a.top_logprobs}]}  # noqa: E731
    if len(first.tokens) != len(later.tokens):
        return f"{len(later.tokens)} tokens, first answer {len(first.tokens)}"
    problems = compare_runs(record(first), record(later), LOGPROB_ATOL, near_tie)["problems"]
    return problems[0] if problems else None


class Tally:
    """What the clients saw, shared between them."""

    def __init__(self, near_tie: float) -> None:
        self.near_tie = near_tie
        self.lock = threading.Lock()
        self.first: dict[str, Answer] = {}
        self.done: Counter = Counter()  # by kind
        self.server_errors: list[str] = []  # 5xx, and bad requests not refused with a 4xx
        self.mismatches: list[str] = []
        self.near_tie_divergences = 0

    def add(self, request: SoakRequest, answer: Answer) -> None:
        with self.lock:
            self.done[request.kind] += 1
            if answer.status >= 500:
                self.server_errors.append(f"{request.name}: HTTP {answer.status}")
            elif request.kind == "bad":
                if not 400 <= answer.status < 500:
                    self.server_errors.append(f"{request.name}: HTTP {answer.status}, expected a 4xx")
            elif request.kind != "disconnect":
                first = self.first.setdefault(request.name, answer)
                if first is not answer:
                    why = same_answer(first, answer, request.kind, self.near_tie)
                    if why:
                        self.mismatches.append(f"{request.name}: {why}")
                    elif first.tokens != answer.tokens:
                        self.near_tie_divergences += 1

    def counts(self) -> dict:
        with self.lock:
            return {"requests": dict(self.done), "server_errors": len(self.server_errors),
                    "mismatches": len(self.mismatches), "near_tie_divergences": self.near_tie_divergences}


def client_loop(url: str, model: str, mix: list[SoakRequest], seed: int, deadline: float, tally: Tally,
                timeout_s: float) -> None:
    order = list(mix)
    random.Random(seed).shuffle(order)
    for request in itertools.cycle(order):
        if time.monotonic() >= deadline:
            return
        try:
            answer = send(url, model, request, timeout_s)
        except (urllib.error.URLError, OSError, ValueError) as e:  # connection refused or reset: the server is down
            answer = Answer(599, text=repr(e))
        tally.add(request, answer)


def process_group_rss_mib(pgid: int) -> dict[str, float]:
    """Resident memory of every live process of group `pgid`, by 'name pid'."""
    rss = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) != pgid:  # fields after the name: state, ppid, pgrp, ...
                continue
            name = stat[stat.index("(") + 1: stat.rindex(")")]
            with open(f"/proc/{entry}/status") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, ValueError, StopIteration):
            continue  # exited meanwhile, or a kernel thread
        rss[f"{name} {entry}"] = kib / 1024
    return rss


def verdict(samples: list[dict], counts: dict, warmup_s: float, max_growth: float) -> dict:
    """Pass or fail, and the figures it rests on."""
    failures = []
    after = [s for s in samples if s["elapsed_s"] >= warmup_s]
    growth = None
    if len(after) >= 2:
        baseline = after[0]["rss_total_mib"]
        final = sum(s["rss_total_mib"] for s in after[-3:]) / len(after[-3:])
        growth = final / baseline - 1
        if growth > max_growth:
            failures.append(f"resident memory grew {100 * growth:.1f}% after warm-up "
                            f"({baseline:.0f} to {final:.0f} MiB; limit {100 * max_growth:.0f}%)")
    else:
        failures.append("too short: fewer than two samples after warm-up")
    if counts["server_errors"]:
        failures.append(f"{counts['server_errors']} server errors (5xx, or a bad request not refused with a 4xx)")
    if counts["mismatches"]:
        failures.append(f"{counts['mismatches']} answers differ from the same request's first answer")
    return {"passed": not failures, "failures": failures, "rss_growth_after_warmup": growth}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    minutes = [s["elapsed_s"] / 60 for s in samples]
    fig, (mem, reqs, share) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    names = sorted({n for s in samples for n in s["rss_mib"]}, key=lambda n: -samples[-1]["rss_mib"].get(n, 0))
    for name in names:
        mem.plot(minutes, [s["rss_mib"].get(name) for s in samples], label=name, lw=1)
    mem.plot(minutes, [s["rss_total_mib"] for s in samples], label="all", color="black", lw=2)
    warmup_min = result["settings"]["warmup_minutes"]
    after = [s for s in samples if s["elapsed_s"] >= 60 * warmup_min]
    if after:
        mem.axhline(after[0]["rss_total_mib"] * (1 + result["settings"]["max_growth"]), color="red", ls="--",
                    lw=1, label="limit")
    mem.axvspan(0, warmup_min, color="grey", alpha=0.15, label="warm-up")
    mem.set_ylabel("resident memory (MiB)")
    mem.legend(fontsize=7, ncol=2)
    kinds = sorted({k for s in samples for k in s["counts"]["requests"]})
    for kind in kinds:
        reqs.plot(minutes, [s["counts"]["requests"].get(kind, 0) for s in samples], label=kind)
    reqs.plot(minutes, [s["counts"]["server_errors"] + s["counts"]["mismatches"] for s in samples],
              label="5xx + differing answers", color="red", lw=2)
    reqs.set_ylabel("requests (cumulative)")
    reqs.legend(fontsize=7)
    shares, usage = [], []
    for prev, cur in zip(samples, samples[1:]):
        attended = cur["metrics"]["vllm:chunk_kv_tokens_attended_total"] - prev["metrics"]["vllm:chunk_kv_tokens_attended_total"]
        saved = cur["metrics"]["vllm:chunk_kv_tokens_saved_total"] - prev["metrics"]["vllm:chunk_kv_tokens_saved_total"]
        shares.append(100 * saved / attended if attended else None)
        usage.append(100 * cur["metrics"]["vllm:kv_cache_usage_perc"])
    share.plot(minutes[1:], shares, label="decode KV reads removed by sharing (%)")
    share.plot(minutes[1:], usage, label="KV cache in use (%)")
    share.set_ylabel("%")
    share.set_xlabel("minutes")
    share.legend(fontsize=7)
    fig.suptitle(f"soak of a chunk server: {'passed' if result['verdict']['passed'] else 'FAILED'} "
                 f"({result['settings']['minutes']:g} min, {result['settings']['clients']} clients; "
                 f"{result['machine'].get('cpu_model_name')})\n{machine.cpu_identity(result['machine'])}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench.soak", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="how long the clients run")
    ap.add_argument("--warmup-minutes", type=float, help="memory baseline taken after this (default: a twelfth "
                    "of the run, at least one sample interval)")
    ap.add_argument("--sample-seconds", type=float, default=60.0, help="memory and /metrics sampling period")
    ap.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    ap.add_argument("--max-growth", type=float, default=0.05, help="resident memory growth allowed after warm-up")
    ap.add_argument("--near-tie", type=float, default=1e-4,
                    help="a greedy answer may diverge after a step whose two best logprobs are this close")
    ap.add_argument("--request-timeout", type=float, default=300.0,
                    help="seconds a request may take before it counts as a server error")
    ap.add_argument("--model", help="model directory (default: the generated tiny model)")
    ap.add_argument("--server-args", default="", help="more `vllm serve` arguments, one string")
    ap.add_argument("--out", type=Path, help="results folder (default: soak-<time>)")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.sample_seconds <= 0 or args.clients < 1 or args.max_growth <= 0:
        ap.error("--minutes, --sample-seconds and --max-growth must be positive, --clients at least 1")
    if args.warmup_minutes is None:
        args.warmup_minutes = max(args.minutes / 12, args.sample_seconds / 60)
    if args.warmup_minutes >= args.minutes:
        ap.error("--warmup-minutes must be shorter than --minutes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path(f"soak-{datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or ensure_model("tiny")
    serve_args = ["--attention-backend", "chunk", "--dtype", "float32", "--block-size", "32",
                  "--enable-prefix-caching", "--max-num-seqs", "8", "--max-model-len", "1024", "--seed", "0",
                  *args.server_args.split()]
    info = machine.describe_machine()
    print(f"soak: {args.minutes:g} minutes, {args.clients} clients, on {machine.describe_line(info)}", flush=True)
    tally = Tally(args.near_tie)
    samples: list[dict] = []
    with VllmServer(model, serve_args, log_path=out / "server.log") as server:
        start = time.monotonic()
        deadline = start + 60 * args.minutes
        clients = [threading.Thread(target=client_loop, daemon=True, args=(
                       server.url, model, request_mix(), seed, deadline, tally, args.request_timeout))
                   for seed in range(args.clients)]
        for c in clients:
            c.start()
        next_sample = start
        while True:
            now = time.monotonic()
            if now >= next_sample or now >= deadline:
                rss = process_group_rss_mib(server.process.pid)
                try:
                    metrics, _ = scrape(server.url, series=SAMPLED_SERIES)
                except OSError:
                    metrics = dict.fromkeys(SAMPLED_SERIES, float("nan"))
                sample = {"elapsed_s": round(now - start, 1), "rss_mib": rss, "rss_total_mib": sum(rss.values()),
                          "metrics": metrics, "counts": tally.counts()}
                samples.append(sample)
                c = sample["counts"]
                print(f"[{sample['elapsed_s'] / 60:5.1f} min] {sum(c['requests'].values())} requests, "
                      f"{c['server_errors']} server errors, {c['mismatches']} differing answers, "
                      f"memory {sample['rss_total_mib']:.0f} MiB in {len(rss)} processes", flush=True)
                next_sample += args.sample_seconds
            if now >= deadline:
                break
            time.sleep(min(1.0, max(0.0, min(next_sample, deadline) - time.monotonic())))
        for c in clients:
            c.join(timeout=600)
    counts = tally.counts()
    result = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": info, "machine_line": machine.describe_line(info), "serve_args": serve_args,
        "counts": counts, "server_errors": tally.server_errors[:50], "mismatches": tally.mismatches[:50],
        "samples": samples,
        "verdict": verdict(samples, counts, 60 * args.warmup_minutes, args.max_growth),
        "mix": [asdict(r) for r in request_mix()],
    }
    (out / "soak.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, out / "soak.png")
    v = result["verdict"]
    growth = "n/a" if v["rss_growth_after_warmup"] is None else f"{100 * v['rss_growth_after_warmup']:+.1f}%"
    print(f"soak {'passed' if v['passed'] else 'FAILED'}: {sum(counts['requests'].values())} requests "
          f"{counts['requests']}, memory after warm-up {growth}, {counts['near_tie_divergences']} greedy answers "
          f"diverged after a near tie; results in {out}/soak.json, plot {out}/soak.png", flush=True)
    for failure in v["failures"]:
        print(f"  FAILED: {failure}", flush=True)
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
