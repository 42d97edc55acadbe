"""Summaries, the markdown table and the plots of a serving-benchmark results folder.

`vllm_chunkattn.bench.serve` calls `write_report` at the end of a run; it can
also be rerun on a finished folder (e.g. after editing the table layout):

    python -m vllm_chunkattn.bench.report results/serve/<timestamp>
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from vllm_chunkattn.bench import machine

SERVERS = ("stock", "chunk")


def normalised_latencies_ms(raw: dict) -> list[float]:
    """Per request: end-to-end latency / output tokens, in ms per token, as
    the paper (after vLLM) defines normalised latency. `latencies` run from
    sending the request to its last token, so they include the time it
    waited in the server's queue (not in the client's --max-concurrency queue)."""
    out = []
    for latency, n_out, error in zip(raw["latencies"], raw["output_lens"], raw.get("errors") or [""] * len(raw["latencies"])):
        if not error and n_out:
            out.append(1000.0 * latency / n_out)
    return out


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics, as numpy's default."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


CLIENT_FIELDS = (
    "num_prompts", "completed", "failed", "duration_s", "request_throughput", "output_throughput",
    "total_output_tokens", "mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "p90_tpot_ms",
    "mean_normalised_latency_ms", "p90_normalised_latency_ms",
)


def summarise_raw(raw: dict) -> dict:
    """The client-side numbers of one `vllm bench serve` JSON (saved with --save-detailed)."""
    norm = normalised_latencies_ms(raw)
    return {
        "num_prompts": raw["num_prompts"],
        "completed": raw["completed"],
        "failed": raw.get("failed", 0),
        "duration_s": raw["duration"],
        "request_throughput": raw["request_throughput"],
        "output_throughput": raw["output_throughput"],
        "total_output_tokens": raw["total_output_tokens"],
        "mean_ttft_ms": raw["mean_ttft_ms"],
        "p90_ttft_ms": raw.get("p90_ttft_ms", math.nan),
        "mean_tpot_ms": raw["mean_tpot_ms"],
        "p90_tpot_ms": raw.get("p90_tpot_ms", math.nan),
        "mean_normalised_latency_ms": sum(norm) / len(norm) if norm else math.nan,
        "p90_normalised_latency_ms": percentile(norm, 90),
    }


# ---------------------------------------------------------------- the table

def _fmt(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def _ratio(chunk, stock) -> float | None:
    if chunk is None or stock is None or not stock or math.isnan(chunk) or math.isnan(stock):
        return None
    return chunk / stock


def _pair_ratio(pair: dict[str, dict], key: str) -> float | None:
    """chunk/stock of one field of a configuration's pair of (median) records; None without both servers."""
    if "chunk" not in pair or "stock" not in pair:
        return None
    return _ratio(pair["chunk"][key], pair["stock"][key])


def _kv(rec: dict) -> str:
    gib = rec.get("peak_kv_cache_gib")
    pct = 100.0 * rec["peak_kv_cache_usage"]
    return f"{pct:.1f}% ({gib:.3g} GiB)" if gib is not None else f"{pct:.1f}%"


def _repeats(records: list[dict], workload: str, mode: str, x) -> dict[str, list[dict]]:
    """Per server, its runs of one configuration, in repeat order."""
    out: dict[str, list[dict]] = {}
    for r in sorted(records, key=lambda r: r.get("repeat", 1)):
        if r["workload"] == workload and r["mode"] == mode and r["x"] == x:
            out.setdefault(r["server"], []).append(r)
    return out


def _median_record(runs: list[dict]) -> dict:
    """One record for the repeats of a configuration: the median of every number, the first run's other fields;
    timed out if any repeat timed out, completed and num_prompts summed."""
    if len(runs) == 1:
        return runs[0]
    merged = dict(runs[0])
    for key, value in runs[0].items():
        values = [r.get(key) for r in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            median = statistics.median(values)
            merged[key] = int(median) if all(isinstance(v, int) for v in values) and median == int(median) else median
    merged["completed"] = sum(r["completed"] for r in runs)
    merged["num_prompts"] = sum(r["num_prompts"] for r in runs)
    merged["timed_out"] = any(r.get("timed_out") for r in runs)
    return merged


def _medians(by_server: dict[str, list[dict]]) -> dict[str, dict]:
    """Per server, one record for its repeats (_median_record)."""
    return {server: _median_record(runs) for server, runs in by_server.items()}


def _pair(records: list[dict], workload: str, mode: str, x) -> dict[str, dict]:
    """Per server, the median over the repeats of one configuration."""
    return _medians(_repeats(records, workload, mode, x))


def _repeat_ratios(records: list[dict], workload: str, mode: str, x, key: str) -> list[float]:
    """chunk/stock of `key` per repeat (repeat k of chunk against repeat k of stock)."""
    by_server = _repeats(records, workload, mode, x)
    stock = {r.get("repeat", 1): r for r in by_server.get("stock", []) if not r.get("timed_out")}
    ratios = [_ratio(r[key], stock[r.get("repeat", 1)][key]) for r in by_server.get("chunk", [])
              if not r.get("timed_out") and r.get("repeat", 1) in stock]
    return [x for x in ratios if x is not None]


THROUGHPUT_COLUMNS = [
    # header, record key, digits
    ("req/s", "request_throughput", 2),
    ("output tok/s", "output_throughput", 1),
    ("TTFT mean ms", "mean_ttft_ms", 0),
    ("TTFT p90 ms", "p90_ttft_ms", 0),
    ("TPOT mean ms", "mean_tpot_ms", 1),
    ("norm. latency mean ms/tok", "mean_normalised_latency_ms", 1),
    ("norm. latency p90 ms/tok", "p90_normalised_latency_ms", 1),
]


def throughput_table(records: list[dict], workloads: list[dict]) -> list[str]:
    runs = [r for r in records if r["mode"] == "concurrency"]
    if not runs:
        return []
    c = runs[0]["x"]
    lines = [
        f"### Throughput at max concurrency {c} (medians over repeats; output tok/s: median (lowest–highest))",
        "",
        "| workload | server | " + " | ".join(h for h, _, _ in THROUGHPUT_COLUMNS)
        + " | peak KV cache | peak batch | completed |",
        "|---|---|" + "---:|" * (len(THROUGHPUT_COLUMNS) + 3),
    ]
    for w in workloads:
        pair = _pair(runs, w["name"], "concurrency", c)
        for server in SERVERS:
            if server in pair:
                r = pair[server]
                cells = [_fmt(r[k], d) for _, k, d in THROUGHPUT_COLUMNS]
                each = [x["output_throughput"] for x in _repeats(runs, w["name"], "concurrency", c)[server]]
                if len(each) > 1:  # the spread over repeats
                    cells[1] += f" ({_fmt(min(each), 1)}–{_fmt(max(each), 1)})"
                done = f"{r['completed']}/{r['num_prompts']}" + (" (timed out)" if r.get("timed_out") else "")
                lines.append(f"| {w['name']} | {server} | " + " | ".join(cells)
                             + f" | {_kv(r)} | {r['peak_batch']} | {done} |")
        if len(pair) == 2 and not any(r.get("timed_out") for r in pair.values()):
            cells = [_fmt(_pair_ratio(pair, k), 2) for _, k, _ in THROUGHPUT_COLUMNS]
            kv = _pair_ratio(pair, "peak_kv_cache_usage")
            batch = _pair_ratio(pair, "peak_batch")
            lines.append(f"| {w['name']} | **chunk/stock** | " + " | ".join(f"**{x}**" for x in cells)
                         + f" | {_fmt(kv, 2)} | {_fmt(batch, 2)} | |")
    return lines + [""]


def summary_table(records: list[dict], workloads: list[dict]) -> list[str]:
    """chunk/stock per workload beside the same ratio without sharing, so the gain due to sharing shows alone."""
    runs = [r for r in records if r["mode"] == "concurrency"]
    if not runs:
        return []
    c = runs[0]["x"]
    repeats = max(r.get("repeat", 1) for r in runs)
    unshared = next((w["name"] for w in workloads if not w["shared_tokens"]), None)
    base = _pair_ratio(_pair(runs, unshared, "concurrency", c), "output_throughput") if unshared else None
    lines = [
        f"### Summary at max concurrency {c}: chunk/stock, median of {repeats} run{'s' * (repeats > 1)} per server",
        "",
        "| workload | shared | output | output tok/s | per repeat | "
        + (f"without sharing ({unshared}) | due to sharing | " if unshared else "")
        + "TTFT mean | per repeat | TTFT p90 | TPOT mean |",
        "|---|---:|---:|---:|---|" + ("---:|---:|" if unshared else "") + "---:|---|---:|---:|",
    ]
    for w in workloads:
        pair = _pair(runs, w["name"], "concurrency", c)
        if len(pair) != 2 or any(r.get("timed_out") for r in pair.values()):
            continue
        tput = _pair_ratio(pair, "output_throughput")

        def each(key: str) -> str:
            return ", ".join(f"{x:.2f}" for x in _repeat_ratios(runs, w["name"], "concurrency", c, key))

        cells = [w["name"], str(w["shared_tokens"]), str(w["output_tokens"]), f"**{_fmt(tput, 2)}**",
                 each("output_throughput")]
        if unshared:
            cells += [_fmt(base, 2), _fmt(_ratio(tput, base), 2) if w["shared_tokens"] else "–"]
        cells += [_fmt(_pair_ratio(pair, "mean_ttft_ms"), 2), each("mean_ttft_ms")]
        cells += [_fmt(_pair_ratio(pair, key), 2) for key in ("p90_ttft_ms", "mean_tpot_ms")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + ["", "Output tok/s: above 1 is better; TTFT and TPOT: below 1 is better. Due to sharing: the "
                    "workload's ratio over the ratio without sharing (the part of the gain that is not the kernel "
                    "being faster on unshared attention).", ""]


def sweep_table(records: list[dict], workloads: list[dict]) -> list[str]:
    runs = [r for r in records if r["mode"] == "rate"]
    if not runs:
        return []
    lines = [
        "### Request-rate sweep (Poisson arrivals; the paper's Figure 5 and Table 4)",
        "",
        "| workload | req/s offered | norm. latency mean ms/tok stock | chunk | chunk/stock "
        "| p90 stock | p90 chunk | peak KV cache stock | chunk | peak batch stock | chunk |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in workloads:
        for x in sorted({r["x"] for r in runs if r["workload"] == w["name"]}):
            p = _pair(runs, w["name"], "rate", x)
            s, ch = p.get("stock"), p.get("chunk")

            def get(rec, key, digits=1):
                return _fmt(rec[key], digits) if rec else "–"

            ratio = _ratio(ch["mean_normalised_latency_ms"], s["mean_normalised_latency_ms"]) if s and ch else None
            lines.append(
                f"| {w['name']} | {x:g} | {get(s, 'mean_normalised_latency_ms')} | {get(ch, 'mean_normalised_latency_ms')}"
                f" | **{_fmt(ratio, 2)}** | {get(s, 'p90_normalised_latency_ms')} | {get(ch, 'p90_normalised_latency_ms')}"
                f" | {_kv(s) if s else '–'} | {_kv(ch) if ch else '–'}"
                f" | {s['peak_batch'] if s else '–'} | {ch['peak_batch'] if ch else '–'} |"
            )
    return lines + [""]


def targets_table(records: list[dict], workloads: list[dict]) -> list[str]:
    rows = []
    for w in workloads:
        pair = _pair([r for r in records if r["mode"] == "concurrency"], w["name"], "concurrency",
                     next((r["x"] for r in records if r["mode"] == "concurrency"), None))
        if len(pair) != 2:
            continue
        if w.get("min_throughput_ratio") is not None:
            got = _pair_ratio(pair, "output_throughput")
            ok = got is not None and got >= w["min_throughput_ratio"]
            rows.append(f"| {w['name']} | output throughput chunk/stock ≥ {w['min_throughput_ratio']} "
                        f"| {_fmt(got, 3)} | {'met' if ok else 'NOT met'} |")
        if w.get("max_p90_latency_ratio") is not None:
            got = _pair_ratio(pair, "p90_normalised_latency_ms")
            ok = got is not None and got <= w["max_p90_latency_ratio"]
            rows.append(f"| {w['name']} | p90 normalised latency chunk/stock ≤ {w['max_p90_latency_ratio']} "
                        f"| {_fmt(got, 3)} | {'met' if ok else 'NOT met'} |")
        if w.get("max_ttft_ratio") is not None:
            for label, key in (("mean", "mean_ttft_ms"), ("p90", "p90_ttft_ms")):
                got = _pair_ratio(pair, key)
                ok = got is not None and got <= w["max_ttft_ratio"]
                rows.append(f"| {w['name']} | {label} TTFT chunk/stock ≤ {w['max_ttft_ratio']} "
                            f"| {_fmt(got, 3)} | {'met' if ok else 'NOT met'} |")
    if not rows:
        return []
    return ["### Targets", "", "| workload | target | measured | |", "|---|---|---:|---|", *rows, ""]


def markdown(results: dict) -> str:
    records, workloads = results["runs"], results["workloads"]
    lines = ["## Serving benchmark: chunk vs stock vLLM", ""]
    if results.get("machine"):
        lines += [machine.describe_line(results["machine"]), "",
                  machine.IDENTITY_LINE.format(results["machine"]["cpu_identity"]), ""]
    lines += machine.other_cpu_warning(results.get("results_from_other_cpus") or [])
    if results.get("command"):
        lines += ["```", results["command"], "```", ""]
    if results.get("setup"):
        lines += [results["setup"], ""]
    lines += ["| workload | prompt | shared | output |", "|---|---|---:|---:|"]
    lines += [f"| {w['name']} | {w['description']} | {w['shared_tokens']} | {w['output_tokens']} |" for w in workloads]
    lines.append("")
    if results.get("greedy_check"):
        lines += [f"Greedy check: {results['greedy_check']['summary']}", ""]
    if results.get("benchmark_texts_identical"):
        lines += ["Identical greedy texts, chunk vs stock, in the benchmark runs: " + ", ".join(
            f"{name} {same}/{n}" for name, (same, n) in results["benchmark_texts_identical"].items()), ""]
    lines += summary_table(records, workloads)
    lines += throughput_table(records, workloads)
    lines += sweep_table(records, workloads)
    lines += targets_table(records, workloads)
    lines += [
        "Ratios are chunk/stock: above 1 is better for throughput, below 1 is better for latencies.",
        "Normalised latency: per request, end-to-end latency (incl. server queueing) / output tokens; mean and p90 over requests.",
        f"Peak KV cache: highest `vllm:kv_cache_usage_perc` sampled (every {results.get('args', {}).get('metrics_interval', 0.5):g} s); "
        "peak batch: highest `vllm:num_requests_running` sampled.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- the plots

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


STYLE = {"stock": dict(color="tab:blue", marker="o"), "chunk": dict(color="tab:red", marker="s")}


def plot_normalised_latency(results: dict, path: Path) -> None:
    """The paper's Figure 5: normalised latency against request rate, one panel per workload.
    Without a sweep (--quick) each max-concurrency run is drawn at its achieved request rate."""
    plt = _pyplot()
    records = results["runs"]
    sweep = any(r["mode"] == "rate" for r in records)
    mode = "rate" if sweep else "concurrency"
    names = [w["name"] for w in results["workloads"] if any(r["workload"] == w["name"] and r["mode"] == mode
                                                             for r in records)]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        for server in SERVERS:
            pts = sorted(
                ((r["x"] if sweep else r["request_throughput"]), r["mean_normalised_latency_ms"])
                for r in records if r["workload"] == name and r["server"] == server and r["mode"] == mode
                and not r.get("timed_out")
            )
            if pts:
                ax.plot(*zip(*pts), label=server, **STYLE[server])
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("request rate (req/s)" if sweep else "achieved req/s (max-concurrency runs)")
        ax.set_ylabel("normalised latency (ms/token)")
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(results: dict, path: Path) -> dict[str, float]:
    """Per workload and server, the median output throughput over repeats (the table's number) as a bar, each
    repeat as a dot on it, and chunk/stock of the medians above the pair; returns those ratios."""
    plt = _pyplot()
    runs = [r for r in results["runs"] if r["mode"] == "concurrency"]
    names = [w["name"] for w in results["workloads"]]
    c = runs[0]["x"] if runs else "?"
    fig, ax = plt.subplots(figsize=(max(5.0, 1.8 * len(names) + 1.5), 3.8))
    width = 0.38
    ratios: dict[str, float] = {}
    for i, name in enumerate(names):
        by_server = _repeats(runs, name, "concurrency", c)
        pair = _medians(by_server)
        for j, server in enumerate(SERVERS):
            x = i + (j - 0.5) * width
            if server not in pair:
                continue
            if pair[server].get("timed_out"):
                ax.text(x, 0, "timed\nout", ha="center", va="bottom", fontsize=8)
                continue
            ax.bar(x, pair[server]["output_throughput"], width, color=STYLE[server]["color"],
                   label=server if i == 0 else None)
            each = [r["output_throughput"] for r in by_server[server]]
            if len(each) > 1:
                ax.plot([x] * len(each), each, linestyle="none", marker=".", color="black", markersize=5,
                        label="each run" if i == 0 and j == 0 else None)
        ratio = None if any(r.get("timed_out") for r in pair.values()) else _pair_ratio(pair, "output_throughput")
        if ratio is not None:
            top = max(r["output_throughput"] for server_runs in by_server.values() for r in server_runs)
            ax.text(i, top * 1.02, f"{ratio:.2f}x", ha="center", va="bottom", fontsize=9)
            ratios[name] = ratio
    ax.set_xticks(range(len(names)), names, fontsize=8, rotation=10)
    ax.set_ylabel("output tokens/s")
    repeats = max((r.get("repeat", 1) for r in runs), default=1)
    ax.set_title(f"Output throughput at max concurrency {c}, median of {repeats} run{'s' * (repeats > 1)}\n"
                 "(chunk/stock of the medians above the bars)", fontsize=10)
    ax.margins(y=0.15)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return ratios


def _json_safe(x):
    """NaN (a number nobody measured) as null: strict JSON readers reject NaN."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_report(out_dir: Path, results: dict) -> str:
    out_dir = Path(out_dir)
    results = _json_safe(results)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (out_dir / "table.md").write_text(table)
    if results["runs"]:
        plot_normalised_latency(results, out_dir / "fig5_normalised_latency.png")
        plot_throughput(results, out_dir / "throughput.png")
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench.report", description=__doc__.splitlines()[0])
    ap.add_argument("results_dir")
    args = ap.parse_args(argv)
    out = Path(args.results_dir)
    print(write_report(out, json.loads((out / "results.json").read_text())))


if __name__ == "__main__":
    main()
