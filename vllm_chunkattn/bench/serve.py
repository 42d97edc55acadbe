"""Serving benchmark: stock vLLM against `--attention-backend chunk`, driven by
vLLM's own `vllm bench serve`, as the ChunkAttention paper's section 4.2 does.

    python -m vllm_chunkattn.bench.serve                # full run, benchmark model
    python -m vllm_chunkattn.bench.serve --quick        # CI: tiny model, a few dozen requests

Both servers run side by side on free loopback ports: stock vLLM (its default
CPU attention, prefix caching on) and the same engine arguments plus
`--attention-backend chunk`. The same greedy requests go to both and their
completions are compared; then every run (each workload at a fixed max
concurrency, the throughput table, and at each Poisson request rate, the
paper's Figure 5) is made `--repeats` times, alternating the servers (stock
then chunk, then chunk then stock, ...), so that drift of the machine hits
both alike. Only one server has work at a time. A thread samples the busy
server's `/metrics` for peak KV cache usage and peak batch size. Results go to
one folder: raw `vllm bench serve` JSON per run, results.json, table.md and plots.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

from vllm_chunkattn.bench import greedy_check, machine
from vllm_chunkattn.bench.metrics_poller import FINISHED, KV_CACHE_USAGE, RUNNING, WAITING, MetricsPoller
from vllm_chunkattn.bench.report import CLIENT_FIELDS, summarise_raw, write_report
from vllm_chunkattn.bench.workloads import Workload, workloads
from vllm_chunkattn.testing.models import add_model_arguments
from vllm_chunkattn.testing.server import ServerError, VllmServer

SERVERS = {"stock": [], "chunk": ["--attention-backend", "chunk"]}
READY_CHECK_TIMEOUT_S = 600  # for the untimed first request of a run (bench_command)


# ---------------------------------------------------------------- options

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench.serve", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(ap, default="bench-gqa")
    ap.add_argument("--repeats", type=int, help="runs of each configuration per server, alternating the servers "
                    "(default 2; --quick 1)")
    ap.add_argument("--quick", action="store_true",
                    help="CI: tiny model, short prompts, a few dozen requests, no rate sweep; "
                    "exits non-zero unless both servers give identical greedy completions")
    ap.add_argument("--workloads", help="comma-separated subset (default: all of the mode; "
                    f"full: {','.join(workloads(False))}; quick: {','.join(workloads(True))})")
    ap.add_argument("--servers", default="stock,chunk", help="which servers to run, in this order")
    ap.add_argument("--out", help="results folder (default: results/serve/<timestamp>)")
    ap.add_argument("--max-concurrency", type=int, default=32,
                    help="client concurrency of the throughput runs; also the servers' --max-num-seqs")
    ap.add_argument("--num-prompts", type=int, help="requests per throughput run "
                    "(default 64: two rounds of --max-concurrency 32; --quick 24); rounded up to what the dataset needs")
    ap.add_argument("--request-rates", default="0.25,0.5,1",
                    help="Poisson request rates (req/s) of the sweep; '' for none (--quick: none)")
    ap.add_argument("--sweep-workloads", help="workloads swept over request rates (default: all chosen)")
    ap.add_argument("--sweep-duration", type=float, default=30.0,
                    help="seconds of arrivals per sweep run: num_prompts = rate * this, at least 8")
    ap.add_argument("--kv-cache-space", type=float, help="GiB of KV cache per server, "
                    "VLLM_CPU_KVCACHE_SPACE (default 4; --quick 1)")
    ap.add_argument("--dtype", default="float32", help="bf16 matmul is very slow on CPUs without AMX")
    ap.add_argument("--block-size", type=int, default=64,
                    help="the same for both servers; 64 is the paper's chunk size")
    ap.add_argument("--max-model-len", type=int, help="default 10240, which fits the 8192-token prefixes "
                    "(--quick: 4096, the tiny model's limit)")
    ap.add_argument("--compile", action="store_true",
                    help="let vLLM torch.compile the model (default: --enforce-eager for both servers)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the datasets and arrivals, same for both servers")
    ap.add_argument("--greedy-prompts", type=int, default=8, help="requests of the greedy check")
    ap.add_argument("--greedy-tokens", type=int, help="tokens per greedy-check request (default 32; --quick 16)")
    ap.add_argument("--extra-server-args", default="", help="more `vllm serve` options, given to both servers")
    ap.add_argument("--progress-interval", type=float, default=15.0, help="seconds between progress lines")
    ap.add_argument("--metrics-interval", type=float,
                    help="seconds between /metrics samples (default 0.5; --quick 0.05, its runs last about a second)")
    ap.add_argument("--run-timeout", type=float, default=900.0,
                    help="seconds after which one `vllm bench serve` run is stopped and recorded as timed out "
                    "(the benchmark goes on with the next run)")
    args = ap.parse_args(argv)
    args.num_prompts = args.num_prompts or (24 if args.quick else 64)
    args.kv_cache_space = args.kv_cache_space or (1.0 if args.quick else 4.0)
    args.greedy_tokens = args.greedy_tokens or (16 if args.quick else 32)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.max_model_len = args.max_model_len or (4096 if args.quick else 10240)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.greedy_prompts < 1 or args.greedy_tokens < 1:
        ap.error("--greedy-prompts and --greedy-tokens must be at least 1: the greedy check is how the benchmark "
                 "shows both servers give the same answers")
    args.model_name = args.model_name or ("tiny" if args.quick else "bench-gqa")
    args.metrics_interval = args.metrics_interval or (0.05 if args.quick else 0.5)
    args.rates = [] if args.quick else [float(r) for r in args.request_rates.split(",") if r.strip()]
    return args


def engine_args(args: argparse.Namespace) -> list[str]:
    """What both servers get, identically."""
    common = [
        "--dtype", args.dtype,
        "--block-size", str(args.block_size),
        "--max-num-seqs", str(args.max_concurrency),
        "--max-model-len", str(args.max_model_len),
        "--enable-prefix-caching",
        "--seed", "0",
    ]
    if not args.compile:
        common.append("--enforce-eager")
    return common + shlex.split(args.extra_server_args)


# ---------------------------------------------------------------- runs

@dataclass(frozen=True)
class Run:
    workload: Workload
    mode: str  # "concurrency": --max-concurrency, all requests at once; "rate": Poisson arrivals
    x: float  # the max concurrency or the request rate
    num_prompts: int

    @property
    def name(self) -> str:
        return f"{self.workload.name}-" + (f"c{self.x:g}" if self.mode == "concurrency" else f"r{self.x:g}")

    def traffic_args(self) -> list[str]:
        if self.mode == "concurrency":
            return ["--max-concurrency", str(int(self.x))]
        return ["--request-rate", f"{self.x:g}"]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_runs(args: argparse.Namespace, chosen: dict[str, Workload]) -> list[Run]:
    swept = set(args.sweep_workloads.split(",")) if args.sweep_workloads else set(chosen)
    runs = []
    for w in chosen.values():
        runs.append(Run(w, "concurrency", args.max_concurrency,
                        round_up(w.num_prompts or args.num_prompts, w.num_prompts_multiple)))
        if w.name in swept and w.num_prompts is None:  # a burst is one arrival pattern, not a rate
            for rate in args.rates:
                n = max(8, round(rate * args.sweep_duration))
                runs.append(Run(w, "rate", rate, round_up(n, w.num_prompts_multiple)))
    return runs


class Progress:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"[{int(elapsed // 60):3d}:{int(elapsed % 60):02d}] {message}", flush=True)


def bench_command(args: argparse.Namespace, model: str, url: str, run: Run, server: str,
                  dataset_dir: Path, raw_dir: Path, run_name: str) -> list[str]:
    return [
        *_client_command(args, model, url, run, server, run.workload.bench_args(dataset_dir), run.traffic_args()),
        # The run's first request alone, untimed, before the timed ones: a burst's prefix is then cached
        # when the burst arrives (vLLM 0.32 skips this request unless given a timeout).
        "--ready-check-timeout-sec", str(READY_CHECK_TIMEOUT_S),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", str(raw_dir), "--result-filename", f"{server}-{run_name}.json",
    ]


def warm_up_command(args: argparse.Namespace, model: str, url: str, run: Run, server: str,
                    dataset_dir: Path) -> list[str]:
    """The run's requests with one output token each, nothing saved: fills the prefix cache (Workload.warm).
    At the run's max concurrency whatever the run's traffic: a Poisson run's warm-up need not take its time."""
    return _client_command(args, model, url, run, f"{server}-warm-up", run.workload.warm_up_args(dataset_dir),
                           ["--max-concurrency", str(args.max_concurrency)])


def _client_command(args: argparse.Namespace, model: str, url: str, run: Run, label: str,
                    dataset_args: list[str], traffic_args: list[str]) -> list[str]:
    vllm = str(Path(sys.executable).with_name("vllm"))
    return [
        vllm, "bench", "serve",
        "--base-url", url, "--model", model, "--label", label,
        "--seed", str(args.seed), "--num-prompts", str(run.num_prompts),
        *dataset_args, *traffic_args,
        # Greedy, full length: the same work for both servers, and comparable texts.
        "--temperature", "0", "--ignore-eos", "--disable-tqdm",
    ]


def warm_prefix_cache(args, model: str, server: VllmServer, server_name: str, run: Run, repeat: int, out: Path) -> float:
    """Sends the run's requests with one output token each and waits for them; returns the seconds taken."""
    cmd = warm_up_command(args, model, server.url, run, server_name, out / "datasets")
    log_path = out / "logs" / f"{server_name}-{run.name}-rep{repeat}.warm-up.log"
    log_path.write_text("$ " + shlex.join(cmd) + "\n")
    started = time.monotonic()
    with open(log_path, "a") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"warming the prefix cache took over {args.run_timeout:g} s (--run-timeout); "
                               f"see {log_path}") from None
    if proc.returncode != 0:
        raise client_failed("warming the prefix cache", proc.returncode, log_path)
    return time.monotonic() - started


def client_failed(what: str, returncode: int, log_path: Path) -> RuntimeError:
    """The error of a `vllm bench serve` that exited non-zero, with the last lines of its log."""
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
    return RuntimeError(f"{what} failed (exit {returncode}); last lines of {log_path}:\n{tail}")


def reset_prefix_cache(url: str) -> bool:
    """Each run starts with an empty prefix cache, so no run profits from an
    earlier one and the order of runs does not matter (a dev-mode endpoint)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", method="POST"), timeout=30):
            return True
    except (urllib.error.URLError, OSError):
        return False


CHUNK_STATS = re.compile(r"(\d+)% of decode KV reads served once per batch")


def chunk_log_stats(log_text: str) -> float | None:
    """Mean of the backend's periodic 'x% of decode KV reads served once per batch'."""
    values = [int(m) for m in CHUNK_STATS.findall(log_text)]
    return sum(values) / len(values) if values else None


# A raised exception as Python prints it, alone or after a vLLM log prefix "... [file.py:123] ".
ERROR_LINE = re.compile(r"^(?:.*\] )?(\w+(?:Error|Exception): .+)$", re.MULTILINE)


def error_lines(log_text: str, limit: int = 3) -> list[str]:
    """The first distinct 'SomethingError: message' lines of a server log."""
    found: list[str] = []
    for m in ERROR_LINE.finditer(log_text):
        if m.group(1) not in found:
            found.append(m.group(1))
    return found[:limit]


def stop_process_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def run_bench(args, model: str, server: VllmServer, server_name: str, run: Run, repeat: int, out: Path,
              progress: Progress) -> dict:
    raw_dir, log_dir = out / "raw", out / "logs"
    run_name = f"{run.name}-rep{repeat}"
    cmd = bench_command(args, model, server.url, run, server_name, out / "datasets", raw_dir, run_name)
    log_path = log_dir / f"{server_name}-{run_name}.client.log"
    log_path.write_text("$ " + shlex.join(cmd) + "\n")
    server_log_offset = len(server.log_text())
    load_before = os.getloadavg()
    started = time.monotonic()
    with MetricsPoller(server.url, args.metrics_interval) as poller, open(log_path, "a") as log:
        # Its own process group, so that stopping it also stops anything it started.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            last = time.monotonic()
            while proc.poll() is None:
                time.sleep(0.5)
                if time.monotonic() - started > args.run_timeout:
                    timed_out = True
                    break
                if time.monotonic() - last >= args.progress_interval:
                    last = time.monotonic()
                    now = poller.latest()
                    progress(f"    {int(poller.delta(FINISHED))}/{run.num_prompts} done, "
                             f"running {now.get(RUNNING, 0):.0f}, waiting {now.get(WAITING, 0):.0f}, "
                             f"KV cache {100 * now.get(KV_CACHE_USAGE, 0):.1f}%")
        finally:
            stop_process_group(proc)
    wall_s = time.monotonic() - started
    if proc.returncode != 0 and not timed_out:
        raise client_failed("vllm bench serve", proc.returncode, log_path)
    metrics = poller.summary()
    (out / "metrics").mkdir(exist_ok=True)
    (out / "metrics" / f"{server_name}-{run_name}.json").write_text(json.dumps(asdict(metrics)) + "\n")
    raw_path = raw_dir / f"{server_name}-{run_name}.json"
    if timed_out:
        # The client saves nothing when stopped; what the server finished is all there is.
        client = {**dict.fromkeys(CLIENT_FIELDS, math.nan), "num_prompts": run.num_prompts,
                  "completed": metrics.finished, "failed": run.num_prompts - metrics.finished}
        progress(f"    TIMED OUT after {args.run_timeout:.0f} s ({metrics.finished}/{run.num_prompts} finished); "
                 "going on with the next run")
    else:
        client = summarise_raw(json.loads(raw_path.read_text()))
    record = {
        "server": server_name, "workload": run.workload.name, "mode": run.mode, "x": run.x, "repeat": repeat,
        "raw": None if timed_out else str(raw_path.relative_to(out)),
        "timed_out": timed_out,
        **client,
        "peak_kv_cache_usage": metrics.peak_kv_cache_usage,
        "peak_kv_cache_gib": metrics.peak_kv_cache_gib,
        "peak_batch": metrics.peak_running,
        "peak_waiting": metrics.peak_waiting,
        "mean_batch": metrics.mean_running,
        "preemptions": metrics.preemptions,
        "prefix_cache_hit_rate": metrics.prefix_cache_hit_rate,
        "chunk_decode_kv_read_once_pct": chunk_log_stats(server.log_text()[server_log_offset:]),
        "wall_s": wall_s,
        "load_avg_before": load_before[0],
        "load_avg_after": os.getloadavg()[0],
    }
    if not timed_out:
        progress(f"    {record['completed']}/{record['num_prompts']} completed in {record['duration_s']:.0f} s: "
                 f"{record['request_throughput']:.2f} req/s, {record['output_throughput']:.1f} output tok/s, "
                 f"normalised latency {record['mean_normalised_latency_ms']:.1f} ms/tok, "
                 f"peak batch {record['peak_batch']}, peak KV {100 * record['peak_kv_cache_usage']:.1f}%")
    if record["completed"] != record["num_prompts"] and not timed_out:
        progress(f"    WARNING: {record['num_prompts'] - record['completed']} requests failed; see {raw_path}")
    return record


def greedy_prompts(args, chosen: dict[str, Workload], model: str, out: Path) -> list[str]:
    """Prompts with a multi-level shared prefix (the tree dataset when chosen, else a
    small one), so the check runs the backend's shared-prefix decode path."""
    from vllm_chunkattn.bench.workloads import workloads as all_workloads

    tree = next((w for w in chosen.values() if w.tree is not None), None)
    tree = tree or next(w for w in all_workloads(args.quick).values() if w.tree is not None)
    path = tree.dataset_path(out / "datasets")
    if not path.exists():
        tree.prepare(model, out / "datasets", args.greedy_prompts, args.seed)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["prompt"] for r in rows[: args.greedy_prompts]]


# ---------------------------------------------------------------- main

class Terminated(KeyboardInterrupt):
    pass


def raise_terminated(signum, frame):
    raise Terminated(f"signal {signum}")


def environment_info(model: str) -> dict:
    """What results.json records besides the machine (bench/machine.py)."""
    return {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "model": model}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    progress = Progress()
    from vllm_chunkattn.testing.models import ensure_model

    model = args.model or ensure_model(args.model_name)
    available = workloads(args.quick)
    names = args.workloads.split(",") if args.workloads else list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        print(f"unknown workloads {unknown}; known: {', '.join(available)}", file=sys.stderr)
        return 2
    chosen = {n: available[n] for n in names}
    servers = args.servers.split(",")
    if not set(servers) <= set(SERVERS):
        print(f"unknown servers in {args.servers!r}; known: {', '.join(SERVERS)}", file=sys.stderr)
        return 2
    out = Path(args.out or f"results/serve/{datetime.now():%Y%m%d-%H%M%S}")
    for sub in ("raw", "logs", "datasets"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    runs = plan_runs(args, chosen)
    for w in chosen.values():
        w.prepare(model, out / "datasets", max(r.num_prompts for r in runs if r.workload is w), args.seed)
    common = engine_args(args)
    machine_record = machine.describe_machine()
    # The runs beside this one (results/serve/<timestamp>/) are what this run's numbers get compared with.
    others = machine.results_from_other_cpus(out.parent, machine_record["cpu_identity"], exclude=(out,))
    progress(machine.describe_line(machine_record))
    for line in others:
        progress(f"WARNING: {out.parent} holds results of another CPU: {line}")
    command = "python -m vllm_chunkattn.bench.serve " + shlex.join(argv if argv is not None else sys.argv[1:])
    results = {
        "command": command.strip(),
        "setup": (f"Model `{Path(model).name}`, {args.dtype}, block size {args.block_size}, "
                  f"{args.repeats} run{'s' * (args.repeats > 1)} of each configuration per server, servers alternated, "
                  f"max {args.max_concurrency} running requests, KV cache {args.kv_cache_space:g} GiB, "
                  f"{'torch.compile' if args.compile else '--enforce-eager'}, seed {args.seed}; "
                  f"`vllm serve` arguments for both servers: `{shlex.join(common)}`."),
        "args": vars(args), "engine_args": common, "environment": environment_info(model),
        "machine": machine_record, "results_from_other_cpus": others,
        "workloads": [{**asdict(w), "tree": asdict(w.tree) if w.tree else None} for w in chosen.values()],
        "servers": {}, "runs": [], "timings_s": {}, "greedy": {},
    }
    (out / "config.json").write_text(json.dumps({k: results[k] for k in ("command", "args", "engine_args", "environment",
                                                                         "machine")},
                                                indent=2, default=str) + "\n")
    progress(f"results in {out}; {len(runs)} runs per server: " + ", ".join(r.name for r in runs))

    previous = {s: signal.signal(s, raise_terminated) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Also where SIGINT was ignored at start (a job started with & by a script), Ctrl-C must stop the servers.
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    status = 0
    running: dict[str, VllmServer] = {}
    try:
        prompts = greedy_prompts(args, chosen, model, out)
        for server_name in servers:
            progress(f"{server_name}: starting vllm serve {shlex.join(SERVERS[server_name] + common)}")
            started = time.monotonic()
            server = VllmServer(model, SERVERS[server_name] + common, log_path=out / "logs" / f"{server_name}.server.log",
                                env={"VLLM_CPU_KVCACHE_SPACE": f"{args.kv_cache_space:g}", "VLLM_SERVER_DEV_MODE": "1"})
            results["servers"][server_name] = {"url": server.url, "log": str(server.log_path.relative_to(out))}
            running[server_name] = server
            try:
                server.start()
            except ServerError:
                # The log's tail is the API server's traceback; the cause is further up.
                for line in error_lines(server.log_text()):
                    progress(f"{server_name}: {line}")
                raise
            results["timings_s"][f"{server_name}/start"] = time.monotonic() - started
            progress(f"{server_name}: healthy after {time.monotonic() - started:.0f} s on {server.url}")
            t0 = time.monotonic()
            results["greedy"][server_name] = greedy_check.greedy_completions(server.url, model, prompts,
                                                                             args.greedy_tokens)
            results["timings_s"][f"{server_name}/greedy_check"] = time.monotonic() - t0
            progress(f"{server_name}: greedy check, {len(prompts)} requests, {time.monotonic() - t0:.0f} s")
        total = len(runs) * args.repeats * len(servers)
        done = 0
        for run in runs:
            for repeat in range(1, args.repeats + 1):
                # Alternate which server goes first, so neither always runs on a warmer or cooler machine.
                for server_name in servers if repeat % 2 else servers[::-1]:
                    server = running[server_name]
                    if not reset_prefix_cache(server.url):
                        progress("    WARNING: could not reset the prefix cache (needs VLLM_SERVER_DEV_MODE=1)")
                    done += 1
                    progress(f"[{done}/{total}] {server_name} {run.name} (repeat {repeat}/{args.repeats}): "
                             f"{run.num_prompts} requests, "
                             + (f"max concurrency {run.x:g}" if run.mode == "concurrency" else f"Poisson {run.x:g} req/s"))
                    if run.workload.warm:
                        progress("    warming the prefix cache: the same requests, one output token each, untimed")
                        seconds = warm_prefix_cache(args, model, server, server_name, run, repeat, out)
                        results["timings_s"][f"{server_name}/{run.name}-rep{repeat}/warm-up"] = seconds
                        progress(f"    prefix cache warm after {seconds:.0f} s")
                    record = run_bench(args, model, server, server_name, run, repeat, out, progress)
                    results["runs"].append(record)
                    results["timings_s"][f"{server_name}/{run.name}-rep{repeat}"] = record["wall_s"]
    except KeyboardInterrupt as exc:
        progress(f"interrupted ({str(exc) or 'Ctrl-C'}); servers stopped")
        status = 130
    finally:
        for server_name, server in running.items():
            server.stop()
            progress(f"{server_name}: stopped")
        for s, handler in previous.items():
            signal.signal(s, handler)
        if all(s in results["greedy"] for s in SERVERS):
            check = greedy_check.compare(results["greedy"]["stock"], results["greedy"]["chunk"])
            check["summary"] = greedy_check.describe(check)
            results["greedy_check"] = check
            progress(f"greedy check: {check['summary']}")
            if args.quick and not check["all_identical"] and status == 0:
                status = 1
        results["benchmark_texts_identical"] = greedy_check.compare_benchmark_texts(out, results["runs"])
        if results["runs"] or results["greedy"]:
            table = write_report(out, results)
            print("\n" + table, flush=True)
            written = ["table.md", "results.json", *(p.name for p in sorted(out.glob("*.png")))]
            progress(f"wrote {', '.join(written)} in {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
