"""Where an engine step's time goes, stock vLLM against `chunk`, on the same requests.

For each backend a child process runs one in-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=0, so torch.profiler sees the model runner)
on a generated model (default bench-gqa), float32, blocks of 64:

    --prefixes distinct prefixes of --shared tokens are cached first (each
    by one request alone), then --batch requests arrive together, each behind
    one of them (--order) with --private own tokens; two phases are profiled:
      burst   the requests' prefill (max_tokens=1): the TTFT of a burst
      decode  the same kind of burst generating 1 + --decode-steps tokens,
              minus a burst profile: the decode steps alone, per step

Components, from the profiler's CPU times (the engine's thread):
    attention  attention kernels and KV writes (ours: chunkattn::*; stock:
               _C::cpu_attention_with_kv_cache, _C::cpu_attn_reshape_and_cache)
    builder    the attention metadata builder's build() (ours: prefix tree + decode plan)
    linear     matrix multiplies (_C::onednn_mm, aten::mm / addmm / bmm / linear)
    sampling   vLLM's Sampler.forward
    other ops  every other op (norms, activations, rotary embedding, ...)
    rest       the phase's wall time outside all of the above: scheduling,
               input preparation, output processing, Python

The engine runs on --threads threads. The default is what `vllm serve` gives
its CPU worker: the usable cores less the one it reserves for its scheduler
(VLLM_CPU_NUM_OF_RESERVED_CPU), so on a 2-core machine one. The serving
benchmark's steps are then the profiled ones: e.g. its prefix_repetition-2048
is `--prefixes 4 --shared 2048 --private 32`.

--order says which prefix each request of the batch sits behind, in the
batch's order. It changes stock's time, not ours: vLLM's kernel reads each
request's prefix again, and a request right after one with the same prefix
finds much of it still in the last-level cache (docs/serve-benchmark.md,
"The order of the batch"). The default is the serving benchmark's order:
    shuffled     `vllm bench serve`'s prefix_repetition: the requests, a
                 --batch / --prefixes group per prefix, randomly permuted
                 (random.Random(--order-seed), the same for both backends)
    serving      the first --batch requests that `vllm bench serve
                 --num-prompts 2*batch --max-concurrency batch --seed SEED`
                 sends: its shuffle of 2 * batch requests, so the prefixes
                 have uneven shares (seed 0, 32 of 64 behind 4 prefixes:
                 10/7/8/7), which changes our time too (the last lane vector
                 of a node's rows is only partly filled)
    interleaved  request i behind prefix i mod --prefixes (stock's worst)
    grouped      each prefix's requests next to each other (stock's best)

Two limits for chunk's decode step against stock's:
    attention free   stock / (chunk - chunk's attention)
    at roofline      stock / (chunk - chunk's attention + the roofline of the
                     step's attention: distinct KV bytes, each prefix once,
                     over the read bandwidth, or flops over the peak, both
                     measured on --threads threads, whichever is longer)

    python -m vllm_chunkattn.bench.step_profile [--model-name bench] [--prefixes 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

COMPONENTS = ("attention", "builder", "linear", "sampling", "other ops", "rest")
ATTENTION_OPS = ("chunkattn::", "_C::cpu_attention_with_kv_cache", "_C::cpu_attn_reshape_and_cache")
LINEAR_OPS = ("_C::onednn_mm", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")
# record_function ranges this module wraps around vLLM's methods (totals, not self times).
BUILDER_RANGE = "step_profile::attention_metadata_build"
SAMPLING_RANGE = "step_profile::sampling"
BACKENDS = ("stock", "chunk")
ORDERS = ("shuffled", "serving", "interleaved", "grouped")


def prefix_owners(batch: int, prefixes: int, order: str, seed: int = 0) -> list[int]:
    """The prefix each of the batch's requests sits behind, in the batch's order (module docstring, --order).
    In every order but serving each prefix has batch // prefixes requests or one more."""
    grouped = sorted(i % prefixes for i in range(batch))
    if order == "serving":  # vllm's PrefixRepetitionRandomDataset: random.seed(seed), then random.shuffle
        sent = sorted(i % prefixes for i in range(2 * batch))
        random.Random(seed).shuffle(sent)
        return sent[:batch]
    if order == "interleaved":
        return [i % prefixes for i in range(batch)]
    if order == "grouped":
        return grouped
    if order == "shuffled":
        random.Random(seed).shuffle(grouped)
        return grouped
    raise ValueError(f"order must be one of {', '.join(ORDERS)}; got {order!r}")


def classify(name: str) -> str | None:
    """The component of an op's self time; None for what is not an op (the profiler's and vLLM's ranges,
    whose self time is Python between ops: the rest)."""
    if name.startswith(ATTENTION_OPS + ("vllm::unified_",)):  # vllm::unified_*: the attention layer's Python
        return "attention"
    if name in LINEAR_OPS:
        return "linear"
    if "::" in name and not name.startswith("step_profile::"):
        return "other ops"
    return None


RANGES = {BUILDER_RANGE: "builder", SAMPLING_RANGE: "sampling"}


def _in_range(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in RANGES:
            return True
        parent = parent.cpu_parent
    return False


def breakdown(events, wall_ms: float) -> dict[str, float]:
    """ms per component of one profiled phase (module docstring), from the profiler's event tree:
    a builder or sampler range counts whole, the ops inside it not again."""
    ms = dict.fromkeys(COMPONENTS, 0.0)
    for e in events:
        if _in_range(e):
            continue
        if e.name in RANGES:
            ms[RANGES[e.name]] += e.cpu_time_total / 1e3
        elif (component := classify(e.name)) is not None:
            ms[component] += e.self_cpu_time_total / 1e3
    ms["rest"] = wall_ms - sum(v for k, v in ms.items() if k != "rest")
    return ms


def _wrap_with_range(cls, method: str, range_name: str) -> None:
    import torch

    original = getattr(cls, method)

    def wrapped(self, *args, **kwargs):
        with torch.profiler.record_function(range_name):
            return original(self, *args, **kwargs)

    setattr(cls, method, wrapped)


def child(args: argparse.Namespace) -> dict:
    """One backend's engine: profiles of the burst and of the decode steps."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import torch

    torch.set_num_threads(args.threads)  # before vLLM's CPU worker forbids it
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder
    from vllm.v1.sample.sampler import Sampler

    from vllm_chunkattn.backend import ChunkAttentionMetadataBuilder
    from vllm_chunkattn.testing.models import SPECS, ensure_model

    _wrap_with_range(ChunkAttentionMetadataBuilder, "build", BUILDER_RANGE)
    _wrap_with_range(CPUAttentionMetadataBuilder, "build", BUILDER_RANGE)
    _wrap_with_range(Sampler, "forward", SAMPLING_RANGE)

    model = ensure_model(args.model_name)
    engine = dict(model=model, dtype="float32", block_size=64, max_num_seqs=args.batch, enforce_eager=True, seed=0,
                  max_model_len=args.shared + args.private + args.decode_steps + 64, enable_prefix_caching=True)
    if args.child == "chunk":
        engine["attention_backend"] = "chunk"
    llm = LLM(**engine)
    vocab = llm.get_tokenizer().vocab_size
    prefixes = [torch.randint(4, vocab, (args.shared,), generator=torch.Generator().manual_seed(1 + p)).tolist()
                for p in range(args.prefixes)]

    owners = prefix_owners(args.batch, args.prefixes, args.order, args.order_seed)

    def burst(seed: int) -> list:
        g = torch.Generator().manual_seed(seed)
        return [TokensPrompt(prompt_token_ids=prefixes[owner]
                             + torch.randint(4, vocab, (args.private,), generator=g).tolist())
                for owner in owners]

    def run(seed: int, max_tokens: int, profiled: bool) -> tuple[float, dict[str, float] | None]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        prompts = burst(seed)
        if not profiled:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            return (time.perf_counter() - start) * 1e3, None
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = (time.perf_counter() - start) * 1e3
        return wall, breakdown(prof.events(), wall)

    for prefix in prefixes:  # each cached before any request behind it arrives
        llm.generate([TokensPrompt(prompt_token_ids=prefix)], SamplingParams(max_tokens=1), use_tqdm=False)
    run(100, 1 + args.decode_steps, False)  # warm-up
    burst_wall = [run(200 + i, 1, False)[0] for i in range(args.repeats)]
    decode_wall = [run(300 + i, 1 + args.decode_steps, False)[0] for i in range(args.repeats)]
    _, burst_ms = run(400, 1, True)
    _, with_decode_ms = run(401, 1 + args.decode_steps, True)
    decode_ms = {k: (with_decode_ms[k] - burst_ms[k]) / args.decode_steps for k in COMPONENTS}
    spec = SPECS[args.model_name]
    return {"backend": args.child, "model": args.model_name, "spec": spec, "engine_threads": torch.get_num_threads(),
            "burst_wall_ms": burst_wall, "burst_ms": burst_ms,
            "decode_step_wall_ms": [(d - b) / args.decode_steps for d, b in zip(decode_wall, burst_wall)],
            "decode_step_ms": decode_ms}


def combine(rounds: list[dict]) -> dict:
    """One backend's rounds as one result: per component the mean over rounds, the wall times pooled."""
    out = dict(rounds[0])
    for key in ("burst_ms", "decode_step_ms"):
        out[key] = {c: sum(r[key][c] for r in rounds) / len(rounds) for c in COMPONENTS}
    for key in ("burst_wall_ms", "decode_step_wall_ms"):
        out[key] = [x for r in rounds for x in r[key]]
    out["rounds"] = rounds
    return out


def attention_roofline_ms(args: argparse.Namespace, spec: dict, rates: list) -> float:
    """The roofline of one decode step's attention over all layers, each prefix read once."""
    from vllm_chunkattn.bench import machine

    context = args.shared + args.private + args.decode_steps // 2  # the decode steps' mean context
    per_token = spec["num_key_value_heads"] * spec["head_dim"] * 2 * 4  # K and V, float32
    distinct_tokens = args.prefixes * args.shared + args.batch * (context - args.shared)
    nbytes = distinct_tokens * per_token * spec["num_hidden_layers"]
    flops = 4 * args.batch * spec["num_attention_heads"] * spec["head_dim"] * context * spec["num_hidden_layers"]
    return machine.roofline(nbytes, flops, "fp32", rates).bound_ms


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def report(args: argparse.Namespace, results: dict[str, dict], roofline_ms: float, machine_record: dict) -> str:
    from vllm_chunkattn.bench import machine

    behind = (f"a cached {args.shared}-token prefix" if args.prefixes == 1
              else f"{args.prefixes} cached {args.shared}-token prefixes ({describe_order(args)})")
    lines = [f"# Step profile: {args.model_name}, {args.batch} requests behind {behind}, "
             f"{args.private} own tokens each, float32, blocks of 64, the engine on {args.threads} "
             f"thread{'s' if args.threads > 1 else ''}", "",
             machine.describe_line(machine_record), "", machine.IDENTITY_LINE.format(machine_record["cpu_identity"]),
             "", f"Command: `python -m vllm_chunkattn.bench.step_profile {' '.join(sys.argv[1:])}`", ""]
    for phase, key, wall_key in (("burst (prefill of all requests: TTFT)", "burst_ms", "burst_wall_ms"),
                                 (f"decode step (mean of {args.decode_steps})", "decode_step_ms", "decode_step_wall_ms")):
        lines += [f"## {phase}", "", f"Profiled ms, mean of {args.rounds} engine runs per backend "
                  "(alternating which goes first).", "", "| component | stock ms | chunk ms | chunk/stock | stock share | chunk share |",
                  "|---|---:|---:|---:|---:|---:|"]
        stock, chunk = results["stock"][key], results["chunk"][key]
        total_s, total_c = sum(stock.values()), sum(chunk.values())
        for c in COMPONENTS:
            ratio = f"{chunk[c] / stock[c]:.2f}" if stock[c] > 0.05 else "–"
            lines.append(f"| {c} | {stock[c]:.1f} | {chunk[c]:.1f} | {ratio} | {stock[c] / total_s:.0%} | "
                         f"{chunk[c] / total_c:.0%} |")
        lines.append(f"| **profiled total** | **{total_s:.1f}** | **{total_c:.1f}** | **{total_c / total_s:.2f}** | | |")
        ws, wc = _median(results["stock"][wall_key]), _median(results["chunk"][wall_key])
        lines += ["", f"Unprofiled wall time, median of {args.repeats * args.rounds}: stock {ws:.1f} ms, chunk {wc:.1f} ms, "
                  f"chunk/stock {wc / ws:.2f}."
                  + (" (A decode step's is the difference of a run with and one without the decode steps: it carries "
                     "the burst's run-to-run noise divided by --decode-steps.)" if key == "decode_step_ms" else ""), ""]
    stock, chunk = results["stock"]["decode_step_ms"], results["chunk"]["decode_step_ms"]
    total_s, total_c = sum(stock.values()), sum(chunk.values())
    free = total_s / (total_c - chunk["attention"])
    at_roof = total_s / (total_c - chunk["attention"] + roofline_ms)
    lines += ["## Limits of the decode step (speedup over stock)", "",
              f"- measured: {total_s / total_c:.2f}x (profiled totals)",
              f"- if attention cost nothing: {free:.2f}x",
              f"- if our attention ran at its roofline ({roofline_ms:.2f} ms for the step's layers): {at_roof:.2f}x",
              f"- our attention is {chunk['attention'] / roofline_ms:.1f}x its roofline; stock's "
              f"{stock['attention'] / roofline_ms:.1f}x of the same bound (which counts the prefix once)", ""]
    return "\n".join(lines)


def describe_order(args: argparse.Namespace) -> str:
    owners = prefix_owners(args.batch, args.prefixes, args.order, args.order_seed)
    seed = f", seed {args.order_seed}" if args.order in ("shuffled", "serving") else ""
    return f"{args.order} order{seed}: {' '.join(map(str, owners))}"


def serve_worker_threads() -> int:
    """The OpenMP threads `vllm serve`'s CPU worker runs with here: vLLM binds it to the usable cores less
    those it reserves for the scheduler process (vllm/utils/ompmultiprocessing.py: one on x86 for one worker)."""
    from vllm_chunkattn.bench.machine import usable_cores

    usable = usable_cores()
    reserved = int(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"))
    return max(1, usable - reserved)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-name", default="bench-gqa", help="generated model (vllm_chunkattn/testing/models.py)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--shared", type=int, default=2048, help="tokens of each cached prefix")
    ap.add_argument("--prefixes", type=int, default=1, help="distinct cached prefixes (the serving benchmark's "
                    "prefix_repetition workloads have 4)")
    ap.add_argument("--order", choices=ORDERS, default="shuffled", help="which prefix each request of the batch "
                    "sits behind, in the batch's order: shuffled as `vllm bench serve` does (default), serving (its "
                    "first wave of 2 x BATCH requests, uneven across the prefixes), interleaved (i mod PREFIXES: "
                    "stock's worst) or grouped (stock's best); see the module docstring")
    ap.add_argument("--order-seed", type=int, default=0, help="the shuffled and serving orders' random seed")
    ap.add_argument("--private", type=int, default=64, help="each request's own prompt tokens")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="unprofiled timings per phase")
    ap.add_argument("--rounds", type=int, default=2, help="engine runs per backend, alternating which goes first")
    ap.add_argument("--threads", type=int, default=serve_worker_threads(),
                    help="the engine's threads (default: as many as `vllm serve` gives its CPU worker here, "
                    f"{serve_worker_threads()})")
    ap.add_argument("--out", type=Path, default=Path("results/step-profile"))
    ap.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("batch", "shared", "prefixes", "private", "decode_steps", "repeats", "rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.prefixes > args.batch:
        ap.error(f"--prefixes {args.prefixes} is more than --batch {args.batch}: a prefix without requests")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print("STEP_PROFILE_RESULT " + json.dumps(child(args)), flush=True)
        return 0
    from vllm_chunkattn.bench import machine
    from vllm_chunkattn.testing.models import SPECS

    args.out.mkdir(parents=True, exist_ok=True)
    machine_record = machine.describe_machine()
    rates = [machine.measure_rates(args.threads, machine_record)]
    rounds: dict[str, list[dict]] = {b: [] for b in BACKENDS}
    for r in range(args.rounds):
        # Alternate which backend goes first: the VM's speed drifts over minutes.
        for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
            print(f"[round {r + 1}/{args.rounds}, {backend}] profiling (an engine start, then "
                  f"{2 * args.repeats + 4} bursts) ...", flush=True)
            cmd = [sys.executable, "-m", "vllm_chunkattn.bench.step_profile",
                   *(argv if argv is not None else sys.argv[1:]), "--child", backend]
            done = subprocess.run(cmd, capture_output=True, text=True)
            found = [line for line in done.stdout.splitlines() if line.startswith("STEP_PROFILE_RESULT ")]
            if done.returncode != 0 or not found:
                tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
                print(f"[{backend}] FAILED (exit {done.returncode}):\n{tail}", file=sys.stderr)
                return 1
            result = json.loads(found[0].removeprefix("STEP_PROFILE_RESULT "))
            if result["engine_threads"] != args.threads:
                print(f"[{backend}] FAILED: the engine ran on {result['engine_threads']} threads, not --threads "
                      f"{args.threads}", file=sys.stderr)
                return 1
            rounds[backend].append(result)
    results = {b: combine(rs) for b, rs in rounds.items()}
    rates.append(machine.measure_rates(args.threads, machine_record))
    roof = attention_roofline_ms(args, SPECS[args.model_name], rates)
    text = report(args, results, roof, machine_record)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps({"machine": machine_record, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "attention_roofline_ms": roof,
        "machine_rates": [machine.as_json(r) for r in rates], "results": results}, indent=1))
    print(text)
    print(f"wrote {args.out / 'table.md'} and {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
