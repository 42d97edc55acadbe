"""Offline batch benchmark: RelayAttention's non-interactive case (its section
4.2) through the engine, stock vLLM against `chunk`.

    python -m vllm_chunkattn.bench.offline --model-name bench          # MHA bench model
    python -m vllm_chunkattn.bench.offline --model-name bench-gqa      # shaped like a served model
    python -m vllm_chunkattn.bench.offline --quick                     # tiny model, small batch: a smoke run

One `LLM.generate` call per engine: `--num-requests` requests (default 256),
each a `--system-len`-token system prompt shared by all of them followed by
its own `--user-len` tokens, all `--output-len` tokens long (greedy,
ignore_eos), with vLLM's offline defaults otherwise (max_num_seqs 256,
max_num_batched_tokens 4096 on CPU) and prefix caching on. Prompts are random
token ids from a fixed seed, the same for both backends.

Each engine runs in a fresh process, as `python -m
vllm_chunkattn.testing.workload` does, and only one at a time. The runs
alternate (stock, chunk, then chunk, stock, ...) for `--repeats` rounds, so
drift of the machine hits both alike. Only `generate` is timed (engine start
is not). Before any speed is reported, every chunk run's tokens must equal
the first stock run's, with top-2 logprobs within `--logprob-atol`; a differing
token is accepted only at a near tie (see testing/compare.py). Otherwise the
benchmark fails. Results: results.json and table.md in `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_chunkattn import BACKEND_NAME
from vllm_chunkattn.backend.stats import parse_run_summaries, with_run_summary_time
from vllm_chunkattn.bench import machine
from vllm_chunkattn.testing.compare import compare_runs
from vllm_chunkattn.testing.models import add_model_arguments
from vllm_chunkattn.testing.workload import random_token_ids

BACKENDS = ("stock", "chunk")


@dataclass(frozen=True)
class BatchShape:
    num_requests: int
    system_len: int  # tokens shared by every request
    user_len: int  # tokens of each request's own
    output_len: int


def make_prompts(shape: BatchShape, vocab_size: int, seed: int) -> list[list[int]]:
    """Token ids: one system prompt, then each request's own tokens."""
    rng = random.Random(seed)
    system = random_token_ids(rng, shape.system_len, vocab_size)
    return [system + random_token_ids(rng, shape.user_len, vocab_size) for _ in range(shape.num_requests)]


def run_engine(args: argparse.Namespace) -> dict:
    """The worker: one engine, one generate call (this process runs it)."""
    from vllm_chunkattn.testing.workload import EngineSettings, Request, run_offline

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_space)
    with open(Path(args.model) / "config.json") as f:
        vocab_size = json.load(f)["vocab_size"]
    shape = BatchShape(args.num_requests, args.system_len, args.user_len, args.output_len)
    requests = [Request(prompt, shape.output_len, "batch") for prompt in make_prompts(shape, vocab_size, args.seed)]
    settings = EngineSettings(model=args.model, backend=args.backend, dtype=args.dtype, block_size=args.block_size,
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              max_model_len=shape.system_len + shape.user_len + shape.output_len)
    return run_offline(settings, requests)


@dataclass
class RunResult:
    backend: str
    round: int
    generate_s: float
    prompt_tokens: int
    output_tokens: int
    engine_start_s: float
    sharing: str  # the backend's whole-run line, for chunk

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.generate_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.generate_s


def worker_command(args: argparse.Namespace, backend: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "vllm_chunkattn.bench.offline", "--worker", "--backend", backend,
            "--model", args.model, "--dtype", args.dtype, "--block-size", str(args.block_size),
            "--num-requests", str(args.num_requests), "--system-len", str(args.system_len),
            "--user-len", str(args.user_len), "--output-len", str(args.output_len), "--seed", str(args.seed),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--kv-cache-space", str(args.kv_cache_space), "--worker-out", str(out)]


def run_one(args: argparse.Namespace, backend: str, round_: int, out_dir: Path) -> tuple[RunResult, dict]:
    out = out_dir / f"run-{round_}-{backend}.json"
    log = out_dir / f"run-{round_}-{backend}.log"
    started = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(worker_command(args, backend, out), stdout=f, stderr=subprocess.STDOUT,
                              timeout=args.run_timeout, env=with_run_summary_time(dict(os.environ)))
    text = log.read_text()
    if done.returncode != 0:
        raise SystemExit(f"{backend} run {round_} failed (exit {done.returncode}); the tail of {log}:\n{text[-4000:]}")
    record = json.loads(out.read_text())
    out.unlink()  # tokens are compared here; the raw records are large
    summaries = parse_run_summaries(text)
    sharing = text[text.rfind(f"{BACKEND_NAME} prefix tree, whole run"):].splitlines()[0] if summaries else ""
    result = RunResult(backend, round_, record["generate_s"],
                       sum(r["prompt_tokens"] for r in record["results"]),
                       sum(len(r["tokens"]) for r in record["results"]), record["engine_start_s"], sharing)
    print(f"  round {round_} {backend:5s}: generate {result.generate_s:7.1f} s, "
          f"{result.output_tokens_per_s:7.1f} output tok/s ({time.perf_counter() - started:.0f} s with engine start)",
          flush=True)
    return result, record


def table(results: list[RunResult], args: argparse.Namespace, machine_record: dict,
          agreement: list[dict]) -> str:
    ratios = [c.output_tokens_per_s / s.output_tokens_per_s
              for s, c in paired(results)]
    lines = [
        "# Offline batch: chunk against stock vLLM",
        "",
        machine.describe_line(machine_record),
        "",
        machine.IDENTITY_LINE.format(machine_record["cpu_identity"]),
        "",
        f"Model `{Path(args.model).name}`, {args.dtype}, block size {args.block_size}; one `LLM.generate` of "
        f"{args.num_requests} requests: a {args.system_len}-token system prompt shared by all, {args.user_len} tokens "
        f"each of their own, {args.output_len} output tokens each (greedy, ignore_eos); max_num_seqs "
        f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, prefix caching on, eager. "
        f"Runs alternate between the backends, {args.repeats} per backend; only `generate` is timed.",
        "",
        "| round | backend | generate (s) | output tok/s | total tok/s |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r.round} | {r.backend} | {r.generate_s:.1f} | {r.output_tokens_per_s:.1f} | "
                     f"{r.total_tokens_per_s:.1f} |")
    lines += [
        "",
        f"**Throughput chunk/stock: {statistics.median(ratios):.2f}x** (median over rounds; each round: "
        + ", ".join(f"{x:.2f}x" for x in ratios) + ").",
        "",
        "Outputs: every chunk run against the first stock run: "
        + "; ".join(f"round {a['round']}: {a['compared_steps']} tokens compared, {a['diverged_requests']} requests "
                    f"diverged at a near tie, worst top-2 logprob difference {a['worst_logprob_diff']:.2g}"
                    for a in agreement) + ".",
        "",
        "Sharing (chunk's whole-run line, first run): `" + next((r.sharing for r in results if r.sharing), "none") + "`",
        "",
    ]
    return "\n".join(lines)


def paired(results: list[RunResult]) -> list[tuple[RunResult, RunResult]]:
    """(stock, chunk) of each round."""
    by_round: dict[int, dict[str, RunResult]] = {}
    for r in results:
        by_round.setdefault(r.round, {})[r.backend] = r
    return [(runs["stock"], runs["chunk"]) for _, runs in sorted(by_round.items())]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench.offline", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(ap, default="bench")
    ap.add_argument("--quick", action="store_true", help="tiny model, 16 requests of 256 + 16 tokens, 16 output tokens")
    ap.add_argument("--num-requests", type=int, help="default 256 (--quick 16)")
    ap.add_argument("--system-len", type=int, help="default 2048 (--quick 256)")
    ap.add_argument("--user-len", type=int, help="default 64 (--quick 16)")
    ap.add_argument("--output-len", type=int, help="default 128 (--quick 16)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per backend, alternating the backends")
    ap.add_argument("--dtype", default="float32", help="bf16 matmul is very slow on CPUs without AMX")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="vLLM's offline default on CPU")
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096, help="vLLM's offline default on CPU")
    ap.add_argument("--kv-cache-space", type=int, default=4, help="GiB, VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--logprob-atol", type=float, default=1e-3,
                    help="largest top-2 logprob difference accepted between the backends (float32); also the "
                    "top-2 gap below which a step counts as a near tie, where the tokens may part")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    ap.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one engine run may take")
    ap.add_argument("--out", help="results folder (default: results/offline/<model>-<timestamp>)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    defaults = dict(num_requests=(16, 256), system_len=(256, 2048), user_len=(16, 64), output_len=(16, 128))
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    args.model_name = args.model_name or ("tiny" if args.quick else "bench")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        with open(args.worker_out, "w") as f:
            json.dump(run_engine(args), f)
        return 0
    if args.model is None:
        from vllm_chunkattn.testing.models import ensure_model

        args.model = ensure_model(args.model_name)
    out_dir = Path(args.out or f"results/offline/{Path(args.model).name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    machine_record = machine.describe_machine()
    print(machine.describe_line(machine_record), flush=True)
    print(f"{args.num_requests} requests x ({args.system_len} shared + {args.user_len} own) tokens, "
          f"{args.output_len} out; {args.repeats} rounds; logs in {out_dir}", flush=True)

    results: list[RunResult] = []
    reference: dict | None = None
    agreement: list[dict] = []
    for round_ in range(args.repeats):
        for backend in BACKENDS if round_ % 2 == 0 else BACKENDS[::-1]:
            result, record = run_one(args, backend, round_, out_dir)
            results.append(result)
            if backend == "stock" and reference is None:
                reference = record
            elif backend == "chunk":
                # The first round runs stock first, so the reference exists here.
                report = compare_runs(reference, record, args.logprob_atol, args.logprob_atol)
                if report["problems"]:
                    print("chunk's outputs differ from stock's beyond tolerance; no speed is reported:\n  "
                          + "\n  ".join(report["problems"][:20]), file=sys.stderr)
                    return 1
                agreement.append({"round": round_, **{k: v for k, v in report.items() if k != "problems"}})

    markdown = table(results, args, machine_record, agreement)
    (out_dir / "table.md").write_text(markdown)
    (out_dir / "results.json").write_text(json.dumps({
        "machine": machine_record, "args": {k: v for k, v in vars(args).items() if not k.startswith("worker")},
        "runs": [asdict(r) for r in results], "agreement": agreement}, indent=1))
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
