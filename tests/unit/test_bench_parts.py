"""The serving benchmark's parts that need no server: the tree dataset, the
metrics parsing, and the report (table, ratios, plots, timed-out runs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vllm_chunkattn.bench.metrics_poller import MetricsPoller
from vllm_chunkattn.bench.report import markdown, normalised_latencies_ms, percentile, plot_throughput, write_report
from vllm_chunkattn.bench.tree_dataset import TreeShape, load_tokenizer, tree_prompts
from vllm_chunkattn.bench.workloads import workloads
from vllm_chunkattn.testing.models import ensure_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_model("tiny"))


def test_tree_prompts_have_exact_token_counts_and_shared_prefixes(tokenizer):
    shape = TreeShape(system_tokens=100, num_groups=3, document_tokens=70, question_tokens=9, output_tokens=5)
    records = tree_prompts(tokenizer, shape, num_prompts=12, seed=1)
    assert len(records) == 12 and len({r["prompt"] for r in records}) == 12
    ids = [tokenizer.encode(r["prompt"], add_special_tokens=False).ids for r in records]
    assert all(len(x) == 179 for x in ids)
    assert len({tuple(x[:100]) for x in ids}) == 1  # one system prompt
    for g in range(3):
        group = [x for x, r in zip(ids, records) if r["group"] == g]
        assert len({tuple(x[:170]) for x in group}) == 1  # one document per group
    assert len({tuple(x[:170]) for x in ids}) == 3
    assert tree_prompts(tokenizer, shape, 12, seed=1) == records  # deterministic


def test_prefix_repetition_prompt_counts_divide():
    for quick in (True, False):
        for w in workloads(quick).values():
            assert w.shared_tokens < w.prompt_tokens
            if w.num_prompts_multiple > 1:
                assert "--prefix-repetition-num-prefixes" in w.dataset_args


def test_normalised_latency_skips_failed_requests():
    raw = {"latencies": [1.0, 2.0, 0.5], "output_lens": [100, 100, 0], "errors": ["", "", "boom"]}
    assert normalised_latencies_ms(raw) == [10.0, 20.0]
    assert percentile([10.0, 20.0], 90) == pytest.approx(19.0)
    assert math.isnan(percentile([], 90))


METRICS_TEXT = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 5.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="64",kv_cache_memory_bytes="4294967296",engine="0"} 1.0
"""


def test_metrics_poller_peaks_and_deltas(monkeypatch):
    from vllm_chunkattn.bench import metrics_poller

    texts = iter([METRICS_TEXT, METRICS_TEXT.replace(" 7.0", " 9.0").replace(" 5.0", " 12.0")])

    class Response:
        def __init__(self, *args, **kwargs):
            self.text = next(texts)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def read(self):
            return self.text.encode()

    monkeypatch.setattr(metrics_poller.urllib.request, "urlopen", Response)
    poller = MetricsPoller("http://x")
    poller._sample()
    poller._sample()
    summary = poller.summary()
    assert summary.peak_running == 9 and summary.peak_waiting == 2
    assert summary.finished == 7  # summed over finish reasons, a delta over the run
    assert summary.peak_kv_cache_usage == 0.25 and summary.peak_kv_cache_gib == pytest.approx(1.0)


def _record(server, workload, mode, x, tput, lat, **extra):
    return {"server": server, "workload": workload, "mode": mode, "x": x, "num_prompts": 8, "completed": 8,
            "request_throughput": tput / 100, "output_throughput": tput, "mean_ttft_ms": 10.0, "p90_ttft_ms": 12.0,
            "mean_tpot_ms": 5.0, "p90_tpot_ms": 6.0, "mean_normalised_latency_ms": lat,
            "p90_normalised_latency_ms": lat * 1.1, "peak_kv_cache_usage": 0.1, "peak_kv_cache_gib": 0.4,
            "peak_batch": 8, **extra}


def test_report_table_ratios_and_plots(tmp_path):
    ws = [{"name": "tree", "description": "d", "shared_tokens": 10, "output_tokens": 5, "min_throughput_ratio": 1.4,
           "max_p90_latency_ratio": None},
          {"name": "random", "description": "d", "shared_tokens": 0, "output_tokens": 5, "min_throughput_ratio": 0.97,
           "max_p90_latency_ratio": None}]
    runs = [
        _record("stock", "tree", "concurrency", 32, 100.0, 20.0),
        _record("chunk", "tree", "concurrency", 32, 150.0, 10.0),
        _record("stock", "random", "concurrency", 32, 100.0, 20.0),
        _record("chunk", "random", "concurrency", 32, math.nan, math.nan, timed_out=True, completed=3),
        _record("stock", "tree", "rate", 0.5, 50.0, 30.0),
        _record("chunk", "tree", "rate", 0.5, 50.0, 15.0),
    ]
    results = {"command": "cmd", "workloads": ws, "runs": runs}
    table = write_report(tmp_path, results)
    assert "| tree | **chunk/stock** | **1.50** | **1.50** |" in table
    assert "3/8 (timed out)" in table
    assert "| tree | output throughput chunk/stock ≥ 1.4 | 1.500 | met |" in table
    assert "| tree | 0.5 | 30.0 | 15.0 | **0.50** |" in table
    saved = json.loads((tmp_path / "results.json").read_text())  # strict JSON: NaN became null
    assert saved["runs"][3]["output_throughput"] is None
    assert markdown(saved) == table  # the report can be rebuilt from results.json
    for name in ("fig5_normalised_latency.png", "throughput.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_the_throughput_plot_shows_the_tables_medians(tmp_path):
    """With repeats the bars are the medians the table reports, not the last run."""
    ws = [{"name": "tree", "description": "d", "shared_tokens": 10, "output_tokens": 5, "min_throughput_ratio": 1.4,
           "max_p90_latency_ratio": None}]
    runs = [{**_record(server, "tree", "concurrency", 32, tput, 20.0), "repeat": repeat}
            for server, repeat, tput in (("stock", 1, 100.0), ("chunk", 1, 150.0),
                                         ("chunk", 2, 150.0), ("stock", 2, 140.0))]
    results = {"command": "cmd", "workloads": ws, "runs": runs}
    assert "| tree | **chunk/stock** | **1.25** | **1.25** |" in markdown(results)
    assert plot_throughput(results, tmp_path / "throughput.png") == {"tree": 1.25}  # the last runs: 1.07
    assert (tmp_path / "throughput.png").stat().st_size > 1000


def test_server_start_failure_shows_the_cause():
    from vllm_chunkattn.bench.serve import error_lines

    log = (
        "(APIServer pid=1) WARNING 11-21 [system_utils.py:255] Found ulimit; fd limit errors like `OSError: [Errno 24]`\n"
        "(Worker pid=2) ERROR 11-21 [multiproc_executor.py:953] ValueError: CHUNK does not support block size 16\n"
        "(Worker pid=2) ERROR 11-21 [multiproc_executor.py:953] ValueError: CHUNK does not support block size 16\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert error_lines(log) == ["ValueError: CHUNK does not support block size 16",
                                "RuntimeError: Engine core initialization failed. See root cause above."]


def test_report_opens_with_the_machine_and_names_results_of_another_cpu(tmp_path):
    from vllm_chunkattn.bench import machine

    record = machine.describe_machine()
    results = {"command": "cmd", "workloads": [], "runs": [], "machine": record,
               "results_from_other_cpus": ["results/serve/old/results.json: AuthenticAMD family 25 model 17"]}
    table = markdown(results)
    assert table.index(machine.describe_line(record)) < table.index("| workload |")
    assert machine.IDENTITY_LINE.format(record["cpu_identity"]) in table
    assert "- results/serve/old/results.json: AuthenticAMD family 25 model 17" in table
    write_report(tmp_path, results)
    assert machine.results_from_other_cpus(tmp_path, record["cpu_identity"]) == []  # its own record reads back


def test_report_takes_medians_over_alternated_repeats_and_shows_the_gain_due_to_sharing(tmp_path):
    ws = [{"name": "tree", "description": "d", "shared_tokens": 2048, "output_tokens": 64, "min_throughput_ratio": 1.15,
           "max_p90_latency_ratio": None, "max_ttft_ratio": 1.0},
          {"name": "random", "description": "d", "shared_tokens": 0, "output_tokens": 64, "min_throughput_ratio": 1.0,
           "max_p90_latency_ratio": None, "max_ttft_ratio": 1.0}]
    runs = []
    # three repeats; the median repeat decides, and each repeat's own ratio is listed
    for repeat, (stock, chunk, ttft) in enumerate([(100.0, 130.0, 12.0), (90.0, 150.0, 9.0), (110.0, 120.0, 12.5)], 1):
        runs += [_record("stock", "tree", "concurrency", 32, stock, 20.0, repeat=repeat),
                 _record("chunk", "tree", "concurrency", 32, chunk, 10.0, repeat=repeat, mean_ttft_ms=ttft)]
        runs += [_record("stock", "random", "concurrency", 32, 100.0, 20.0, repeat=repeat),
                 _record("chunk", "random", "concurrency", 32, 110.0, 20.0, repeat=repeat)]
    table = write_report(tmp_path, {"command": "cmd", "workloads": ws, "runs": runs})
    # medians: stock 100, chunk 130 -> 1.30; without sharing 1.10; due to sharing 1.30 / 1.10 = 1.18;
    # mean TTFT: median 12.0 over stock's 10.0, and each repeat's own ratio
    assert "| tree | 2048 | 64 | **1.30** | 1.30, 1.67, 1.09 | 1.10 | 1.18 | 1.20 | 1.20, 0.90, 1.25 | 1.00 | 1.00 |" in table
    assert "| random | 0 | 64 | **1.10** | 1.10, 1.10, 1.10 | 1.10 | – | 1.00 | 1.00, 1.00, 1.00 |" in table
    assert "| tree | stock | 1.00 | 100.0 (90.0–110.0) |" in table
    assert "24/24" in table  # completed summed over the repeats
    assert "| tree | mean TTFT chunk/stock ≤ 1.0 | 1.200 | NOT met |" in table
    assert "| tree | p90 TTFT chunk/stock ≤ 1.0 | 1.000 | met |" in table


def test_full_workloads_have_the_output_lengths_and_targets_of_issue_12():
    full = workloads(False)
    for name in ("prefix_repetition-2048", "tree"):
        assert [full[n].output_tokens for n in (name, f"{name}-out64", f"{name}-out256")] == [128, 64, 256]
        assert full[name].min_throughput_ratio == 1.15
    assert full["tree-out64"].tree.output_tokens == 64
    assert "64" == full["prefix_repetition-2048-out64"].dataset_args[
        full["prefix_repetition-2048-out64"].dataset_args.index("--prefix-repetition-output-len") + 1]
    assert full["prefix_repetition-8192"].min_throughput_ratio == 2.0
    assert full["random-1024"].min_throughput_ratio == 1.0
    assert all(w.max_ttft_ratio == 1.0 for w in full.values())


def test_the_burst_is_one_run_of_32_requests_behind_one_cached_prefix():
    from vllm_chunkattn.bench import serve

    args = serve.parse_args(["--request-rates", "0.5,1"])
    chosen = {n: w for n, w in workloads(False).items() if n in ("burst-2048", "prefix_repetition-2048")}
    runs = serve.plan_runs(args, chosen)
    burst = [r for r in runs if r.workload.name == "burst-2048"]
    assert [(r.mode, r.x, r.num_prompts) for r in burst] == [("concurrency", 32, 32)]  # no rate sweep of a burst
    # One prefix for all 32: `vllm bench serve` sends the first prompt alone before timing, which caches it.
    args_of = burst[0].workload.dataset_args
    assert args_of[args_of.index("--prefix-repetition-num-prefixes") + 1] == "1"
    assert args_of[args_of.index("--prefix-repetition-prefix-len") + 1] == "2048"
    assert burst[0].workload.max_ttft_ratio == 1.0 and burst[0].workload.min_throughput_ratio is None
    others = [r for r in runs if r.workload.name == "prefix_repetition-2048"]
    assert [r.mode for r in others] == ["concurrency", "rate", "rate"]
    assert others[0].num_prompts == args.num_prompts


def test_warm_workloads_send_the_timed_runs_prompts_with_one_output_token_first():
    from vllm_chunkattn.bench import serve

    full = workloads(False)
    for name, target in (("prefix_repetition-2048", 1.15), ("prefix_repetition-8192", 2.0)):
        cold, warm = full[name], full[f"{name}-warm"]
        assert not cold.warm and warm.warm
        assert (warm.min_throughput_ratio, warm.max_ttft_ratio) == (target, 1.0) == (cold.min_throughput_ratio, 1.0)
        assert warm.dataset_args == cold.dataset_args
    assert sum(w.warm for w in full.values()) == 2
    args = serve.parse_args(["--workloads", "prefix_repetition-8192-warm", "--request-rates", ""])
    (run,) = serve.plan_runs(args, {"prefix_repetition-8192-warm": full["prefix_repetition-8192-warm"]})
    timed = serve.bench_command(args, "m", "http://x", run, "chunk", Path("d"), Path("raw"), "r")
    warm_up = serve.warm_up_command(args, "m", "http://x", run, "chunk", Path("d"))

    def option(cmd, flag):
        return cmd[cmd.index(flag) + 1]

    assert option(timed, "--prefix-repetition-output-len") == "128" and option(warm_up, "--prefix-repetition-output-len") == "1"
    for flag in ("--seed", "--num-prompts", "--max-concurrency", "--prefix-repetition-prefix-len",
                 "--prefix-repetition-suffix-len", "--prefix-repetition-num-prefixes", "--base-url"):
        assert option(timed, flag) == option(warm_up, flag)
    assert "--save-result" in timed and "--save-result" not in warm_up
    # The timed run's first request goes alone, untimed, first (a burst's prefix is then cached).
    assert int(option(timed, "--ready-check-timeout-sec")) > 0
    # A Poisson run's warm-up sends the same requests, all at once.
    args = serve.parse_args(["--request-rates", "0.5"])
    chosen = {"prefix_repetition-8192-warm": full["prefix_repetition-8192-warm"]}
    rate_run = [r for r in serve.plan_runs(args, chosen) if r.mode == "rate"][0]
    rate_warm_up = serve.warm_up_command(args, "m", "http://x", rate_run, "chunk", Path("d"))
    assert option(rate_warm_up, "--max-concurrency") == "32" and "--request-rate" not in rate_warm_up
    assert option(rate_warm_up, "--num-prompts") == str(rate_run.num_prompts) != option(warm_up, "--num-prompts")
    # The tree dataset reads its file; the warm-up overrides the file's output lengths.
    tree = full["tree"]
    assert tree.warm_up_args(Path("d")) == ["--dataset-name", "custom", "--skip-chat-template", "--custom-output-len",
                                            "1", "--dataset-path", str(tree.dataset_path(Path("d")))]


def test_one_output_token_leaves_vllms_dataset_prompts_unchanged():
    """What the warm-up relies on: vLLM's datasets draw the same prompts whatever the output length."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    model = ensure_model("tiny")
    tokenizer = get_tokenizer(model)
    w = workloads(True)["prefix_repetition-256"]

    def samples(dataset_args):
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args(["--model", model, "--seed", "0", "--num-prompts", "8", *dataset_args])
        return [(r.prompt, r.expected_output_len) for r in get_samples(args, tokenizer)]

    timed, warm_up = samples(list(w.dataset_args)), samples(w.warm_up_args(Path("unused")))
    assert [p for p, _ in timed] == [p for p, _ in warm_up] and len({p for p, _ in timed}) == 8
    assert {n for _, n in timed} == {w.output_tokens} and {n for _, n in warm_up} == {1}


# ---------------------------------------------------------------- offline batch (bench/offline.py)

def test_offline_batch_prompts_share_exactly_the_system_prompt():
    from vllm_chunkattn.bench.offline import BatchShape, make_prompts

    prompts = make_prompts(BatchShape(num_requests=5, system_len=40, user_len=7, output_len=3), vocab_size=500, seed=1)
    assert len(prompts) == 5 and all(len(p) == 47 for p in prompts)
    assert len({tuple(p[:40]) for p in prompts}) == 1 and len({tuple(p[:41]) for p in prompts}) == 5
    assert all(100 <= t < 400 for p in prompts for t in p)
    assert make_prompts(BatchShape(5, 40, 7, 3), 500, seed=1) == prompts


def _fake_offline_runs(monkeypatch, tmp_path, chunk_tokens):
    """bench/offline.main with engine runs replaced: stock takes 10 s, chunk 8 s."""
    from vllm_chunkattn.bench import offline

    order = []

    def run_one(args, backend, round_, out_dir):
        order.append((round_, backend))
        tokens = [1, 2, 3] if backend == "stock" else chunk_tokens
        record = {"results": [{"tokens": tokens, "top_logprobs": [[[t, -0.5], [9, -2.0]] for t in tokens]}]}
        result = offline.RunResult(backend, round_, 10.0 if backend == "stock" else 8.0, 50, 3, 1.0,
                                   "CHUNK prefix tree, whole run: ..." if backend == "chunk" else "")
        return result, record

    monkeypatch.setattr(offline, "run_one", run_one)
    code = offline.main(["--model", str(tmp_path), "--repeats", "3", "--out", str(tmp_path / "out")])
    return code, order


def test_offline_batch_alternates_the_backends_and_reports_ratios(monkeypatch, tmp_path):
    code, order = _fake_offline_runs(monkeypatch, tmp_path, [1, 2, 3])
    assert code == 0
    assert order == [(0, "stock"), (0, "chunk"), (1, "chunk"), (1, "stock"), (2, "stock"), (2, "chunk")]
    table = (tmp_path / "out" / "table.md").read_text()
    assert "**Throughput chunk/stock: 1.25x**" in table and table.count("| chunk |") == 3
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(saved["runs"]) == 6 and [a["compared_steps"] for a in saved["agreement"]] == [3, 3, 3]


def test_offline_batch_reports_no_speed_when_outputs_differ(monkeypatch, tmp_path, capsys):
    code, _ = _fake_offline_runs(monkeypatch, tmp_path, [1, 5, 3])
    assert code == 1
    assert not (tmp_path / "out" / "table.md").exists()
    assert "no speed is reported" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--repeats", "-1"), ("--greedy-prompts", "0"), ("--greedy-tokens", "-1")])
def test_serve_refuses_counts_below_one_with_a_message(flag, value, capsys):
    from vllm_chunkattn.bench import serve

    with pytest.raises(SystemExit):
        serve.parse_args([flag, value])
    assert f"{flag}" in capsys.readouterr().err
