"""The multi-turn benchmark's parts that need no server: the seeded workload
(lengths, arrivals, think times), cache sizing, the server counters, the
metrics of a run, the SLO interpolation and the greedy-check gate; and main()
end to end with its servers replaced by synthetic runs, to see a configuration
whose answers differ lose its speeds and fail the benchmark."""

from __future__ import annotations

import json
import math
import random
import statistics

import numpy as np
import pytest

from vllm_chunkattn.bench import multiturn as mt
from vllm_chunkattn.bench.multiturn import (ClientRun, Conversation, LengthDistribution, Turn, TurnRecord,
                                            WorkloadShape)


def shape(conversations=200, turns=5, think=2.0, vocab=1695, scale=0.25) -> WorkloadShape:
    return WorkloadShape(conversations, turns, LengthDistribution(160 * scale),
                         LengthDistribution(340 * scale, minimum=2), think, vocab)


# ---------------------------------------------------------------- the workload

def test_same_seed_same_workload_other_seed_other_workload():
    a, b = mt.make_conversations(shape(), seed=7), mt.make_conversations(shape(), seed=7)
    assert a == b
    c = mt.make_conversations(shape(), seed=8)
    assert [t.user_tokens for t in a[0].turns] != [t.user_tokens for t in c[0].turns]


def test_conversations_have_their_turns_and_ordinary_token_ids():
    conversations = mt.make_conversations(shape(conversations=50, turns=6, vocab=300), seed=1)
    assert [c.index for c in conversations] == list(range(50))
    ids = [i for c in conversations for t in c.turns for i in t.user_tokens]
    assert all(len(c.turns) == 6 for c in conversations)
    assert min(ids) == len(mt.SPECIAL_TOKENS) == 4 and max(ids) == 299  # the whole range but special ids 0..3
    assert all(t.answer_tokens >= 2 and len(t.user_tokens) >= 1 for c in conversations for t in c.turns)
    assert conversations[0].total_tokens == sum(len(t.user_tokens) + t.answer_tokens for t in conversations[0].turns)


def test_lengths_follow_the_clipped_lognormal():
    dist = LengthDistribution(mean=40.0)
    rng = random.Random(0)
    draws = [dist.draw(rng) for _ in range(40000)]
    assert max(draws) == dist.cap == 160 and min(draws) >= 1
    # the median of a lognormal is exp(mu); clipping the tail does not move it
    assert statistics.median(draws) == pytest.approx(math.exp(dist.mu), rel=0.03)
    # clipping at 4x the mean takes about 7% off it (sigma 1), and the draws' mean is the clipped one
    assert dist.clipped_mean() == pytest.approx(0.931 * 40, rel=0.01)
    assert statistics.fmean(draws) == pytest.approx(dist.clipped_mean(), rel=0.02)
    assert sum(d == dist.cap for d in draws) / len(draws) == pytest.approx(0.0297, abs=0.004)  # P(X > 4 x mean)
    # answers are about twice as long as user messages, as in ShareGPT
    conversations = mt.make_conversations(shape(conversations=400), seed=3)
    users = [len(t.user_tokens) for c in conversations for t in c.turns]
    answers = [t.answer_tokens for c in conversations for t in c.turns]
    assert statistics.fmean(answers) / statistics.fmean(users) == pytest.approx(340 / 160, rel=0.1)


def test_arrivals_are_poisson_and_think_times_exponential():
    conversations = mt.make_conversations(shape(conversations=4000, turns=3, think=2.0), seed=5)
    arrivals = [c.arrival_at_unit_rate_s for c in conversations]
    assert arrivals[0] == 0.0 and all(b > a for a, b in zip(arrivals, arrivals[1:]))
    gaps = np.diff(arrivals)
    assert gaps.mean() == pytest.approx(1.0, rel=0.05)  # unit rate: the run divides by its rate
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.07)  # exponential: coefficient of variation 1
    assert all(c.turns[0].think_time_s == 0.0 for c in conversations)  # nobody thinks before the first message
    thinks = np.array([t.think_time_s for c in conversations for t in c.turns[1:]])
    assert thinks.mean() == pytest.approx(2.0, rel=0.05)
    assert thinks.std() / thinks.mean() == pytest.approx(1.0, rel=0.07)
    no_think = mt.make_conversations(shape(conversations=3, think=0.0), seed=5)
    assert all(t.think_time_s == 0.0 for c in no_think for t in c.turns)


# ---------------------------------------------------------------- cache sizes

def _conversation(index: int, tokens_per_turn: list[tuple[int, int]], arrival: float = 0.0,
                  think: float = 0.0) -> Conversation:
    return Conversation(index, arrival, tuple(Turn(tuple([5] * u), a, think if i else 0.0)
                                              for i, (u, a) in enumerate(tokens_per_turn)))


def test_kv_cache_is_the_asked_fraction_of_the_conversations_kv_but_holds_the_longest():
    timed = [_conversation(i, [(40, 60)] * 4) for i in range(10)]  # 400 tokens: 13 blocks of 32 each
    sizing = mt.size_caches(timed, [], block_size=32, kv_ratio=4.0, host_ratio=0.5, block_bytes=65536)
    assert sizing.conversation_blocks == 130 and sizing.kv_cache_blocks == 33  # ceil(130 / 4)
    assert sizing.kv_ratio == pytest.approx(130 / 33)
    assert sizing.max_model_len == 416 and sizing.max_model_len <= (sizing.kv_cache_blocks - 1) * 32
    assert sizing.host_tier_blocks == 65 and sizing.host_cache_gib * 2**30 == 65 * 65536
    # the check's conversations may be longer; the cache then grows to hold one of them
    long = [_conversation(0, [(500, 600)] * 2)]
    sizing = mt.size_caches(timed, long, block_size=32, kv_ratio=4.0, host_ratio=0.5, block_bytes=65536)
    assert sizing.max_model_len == 2208 and sizing.kv_cache_blocks == 2208 // 32 + 1
    assert sizing.conversation_blocks == 130  # the timed ones only


def test_peak_live_kv_grows_with_the_rate():
    conversations = [_conversation(i, [(32, 32)] * 3, arrival=float(i), think=1.0) for i in range(10)]  # 6 blocks each
    # each lives 2 s (two thinks) after its arrival; at 1 conv/s, arrivals 1 s apart: two alive at a time
    # (the one ending at t leaves before the one arriving at t comes)
    assert mt.peak_live_blocks(conversations, rate=1.0, block_size=32) == 12
    assert mt.peak_live_blocks(conversations, rate=0.1, block_size=32) == 6
    assert mt.peak_live_blocks(conversations, rate=100.0, block_size=32) == 60


def test_server_configurations_differ_only_as_named():
    args = {name: c.server_args(0.5) for name, c in mt.CONFIGS.items()}
    assert args["stock-nocache"] == ["--no-enable-prefix-caching"]
    assert args["stock"] == ["--enable-prefix-caching"]
    for name, policy in (("pensieve-lru", "lru"), ("pensieve", "pensieve")):
        assert args[name][:3] == ["--enable-prefix-caching", "--attention-backend", "chunk"]
        transfer = json.loads(args[name][args[name].index("--kv-transfer-config") + 1])
        assert transfer["kv_connector"] == "PensieveConnector" and transfer["kv_role"] == "kv_both"
        assert transfer["kv_connector_extra_config"] == {"host_cache_gib": 0.5, "eviction_policy": policy}
    assert mt.run_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert mt.run_order(["a", "b", "c"], 1) == ["b", "c", "a"]
    assert mt.run_order(["a", "b", "c"], 3) == ["a", "b", "c"]


# ---------------------------------------------------------------- counters and metrics

METRICS_TEXT = """\
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 500.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 300.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 200.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0
# TYPE vllm:external_prefix_cache_queries counter
vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 700.0
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 200.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
# TYPE vllm:prompt_tokens_cached_by_source counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 300.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 150.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 50.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="p2p"} 0.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 77.0
"""


def test_counters_are_read_by_name_and_source_and_differenced():
    after = mt.parse_counters(METRICS_TEXT)
    assert after[mt.PROMPT_TOKENS] == 1000 and after[f"{mt.PROMPT_TOKENS_BY_SOURCE}{{external_kv_transfer}}"] == 200
    assert "vllm:generation_tokens_total" not in after
    before = {**after, mt.PROMPT_TOKENS: 400.0, mt.HOST_TIER_HITS: 50.0}
    delta = mt.counter_deltas(before, after)
    assert delta[mt.PROMPT_TOKENS] == 600 and delta[mt.HOST_TIER_HITS] == 150 and delta[mt.PREEMPTIONS] == 0


def _record(conversation, turn, sent, ttft, latency, tokens=10, answer=None, top=None, error=None) -> TurnRecord:
    return TurnRecord(conversation, turn, prompt_tokens=100, answer_tokens_asked=tokens, sent_s=sent,
                      first_token_s=sent + ttft, finished_s=None if error else sent + latency,
                      answer=answer if answer is not None else [7] * tokens, top_logprobs=top, error=error)


def test_run_metrics_from_synthetic_turns():
    conversations = [_conversation(i, [(4, 10)] * 3) for i in range(2)]
    records = [_record(0, 1, 0.0, 0.5, 1.0), _record(0, 2, 2.0, 0.1, 1.0), _record(0, 3, 4.0, 0.2, 2.0),
               _record(1, 1, 1.0, 0.9, 1.0), _record(1, 2, 3.0, 0.3, 1.0),
               _record(1, 3, 5.0, 0.4, 3.0, error="HTTP 500: boom")]
    client = ClientRun(records, duration_s=10.0, timed_out=False)
    counters = mt.parse_counters(METRICS_TEXT)
    m = mt.summarise_run("pensieve", 0.5, conversations, client, counters)
    assert (m.turns, m.turns_completed, m.conversations_completed) == (6, 5, 1)
    assert m.request_throughput == pytest.approx(0.5) and m.output_throughput == pytest.approx(5.0)
    later = [0.1, 0.2, 0.3]  # TTFTs of turns >= 2 that were answered
    assert m.ttft_p50_s == pytest.approx(np.percentile(later, 50))
    assert m.ttft_p90_s == pytest.approx(np.percentile(later, 90))
    assert m.ttft_first_turn_p50_s == pytest.approx(0.7)
    normalised = [0.1, 0.1, 0.2, 0.1, 0.1]  # latency / 10 tokens
    assert m.normalised_latency_mean_s == pytest.approx(np.mean(normalised))
    assert m.normalised_latency_p90_s == pytest.approx(np.percentile(normalised, 90))
    assert (m.prompt_tokens, m.prefill_computed_tokens, m.prefix_cache_hit_tokens, m.host_tier_hit_tokens) == (
        1000, 500, 300, 200)
    assert m.prefix_cache_hit_rate == pytest.approx(0.3) and m.host_tier_hit_rate == pytest.approx(200 / 700)
    assert m.preemptions == 3
    assert m.cached_tokens_by_tier == {"device": 300, "host": 150, "disk": 50}  # tiers that supplied none left out
    stock = mt.summarise_run("stock", 0.5, conversations, client, counters)
    assert stock.host_tier_hit_rate is None  # no connector, no host tier to hit


# ---------------------------------------------------------------- the SLO

def test_rate_under_the_slo_is_interpolated_where_p90_crosses_it():
    result = mt.max_rate_under_slo({0.1: 0.05, 0.2: 0.08, 0.3: 0.2}, slo_s=0.1)
    assert result.highest_swept_rate == 0.2 and not result.all_under
    assert result.interpolated_rate == pytest.approx(0.2 + 0.1 * (0.1 - 0.08) / (0.2 - 0.08))
    everything_under = mt.max_rate_under_slo({0.3: 0.05, 0.1: 0.01}, slo_s=0.1)
    assert (everything_under.highest_swept_rate, everything_under.interpolated_rate) == (0.3, 0.3)
    assert everything_under.all_under and everything_under.describe().startswith(">= 0.3")
    over_at_once = mt.max_rate_under_slo({0.1: 0.5, 0.2: 0.6}, slo_s=0.1)
    assert over_at_once.interpolated_rate is None and "lowest rate" in over_at_once.describe()
    # a failed run is over any SLO, and a later rate back under it does not count: latency has to stay under
    failed = mt.max_rate_under_slo({0.1: 0.05, 0.2: None, 0.3: 0.01}, slo_s=0.1)
    assert (failed.highest_swept_rate, failed.interpolated_rate, failed.all_under) == (0.1, 0.1, False)


# ---------------------------------------------------------------- the gate

def _turns(answers: dict[tuple[int, int], list[int]], gaps: dict[tuple[int, int, int], float] | None = None,
           shift: float = 0.0) -> list[TurnRecord]:
    """Greedy records; every step's top-2 logprobs are -1 and -3 unless `gaps` says (conversation, turn, step).
    The runner-up is a token no answer has, so only the chosen tokens' logprobs are compared."""
    records = []
    for (c, t), answer in answers.items():
        top = []
        for step, token in enumerate(answer):
            gap = (gaps or {}).get((c, t, step), 2.0)
            top.append([(f"token_id:{token}", -1.0 + shift), (f"token_id:{token + 1000}", -1.0 - gap + shift)])
        records.append(_record(c, t, 0.0, 0.1, 1.0, tokens=len(answer), answer=answer, top=top))
    return records


def test_identical_answers_pass_the_gate():
    answers = {(c, t): [10 + c, 20 + t, 30] for c in range(2) for t in (1, 2)}
    result = mt.compare_conversations("pensieve", "stock", _turns(answers, shift=4e-4), _turns(answers))
    assert result.passed and result.turns_compared == 4 and result.worst_logprob_diff == pytest.approx(4e-4)


def test_a_different_answer_fails_the_gate_naming_conversation_and_turn():
    reference = {(c, t): [10, 20, 30] for c in range(2) for t in (1, 2, 3)}
    ours = {**reference, (1, 2): [10, 21, 30]}
    result = mt.compare_conversations("pensieve", "stock", _turns(ours), _turns(reference))
    assert not result.passed
    assert result.problems == ["conversation 1 turn 2: step 1: token 20 vs 21 with top-2 gaps [2.0, 2.0]"]
    assert "DIFFERENT: conversation 1 turn 2" in result.describe()
    # conversation 1's turn 3 followed another history: not compared
    assert result.turns_compared == 5


def test_a_near_tie_may_part_a_conversation_which_is_then_not_compared_further():
    reference = {(0, 1): [10, 20, 30], (0, 2): [40, 50, 60], (0, 3): [70, 80, 90]}
    ours = {(0, 1): [10, 20, 30], (0, 2): [40, 51, 60], (0, 3): [1, 2, 3]}
    near = {(0, 2, 1): 1e-5}
    result = mt.compare_conversations("pensieve", "stock", _turns(ours, near), _turns(reference, near))
    assert result.passed and result.turns_compared == 2
    assert result.conversations_diverged_at_near_tie == ["conversation 0 turn 2"]


def test_logprobs_beyond_the_tolerance_and_missing_turns_fail_the_gate():
    answers = {(0, 1): [10, 20], (0, 2): [30, 40]}
    drifted = mt.compare_conversations("pensieve", "stock", _turns(answers, shift=2e-3), _turns(answers))
    assert not drifted.passed and "logprob of token_id:10" in drifted.problems[0]
    missing = mt.compare_conversations("pensieve", "stock", _turns({(0, 1): [10, 20]}), _turns(answers))
    assert missing.problems == ["conversation 0 turn 2: missing"]
    failed = _turns(answers)
    failed[1].error, failed[1].finished_s = "HTTP 500", None
    assert not mt.compare_conversations("pensieve", "stock", failed, _turns(answers)).passed


# ---------------------------------------------------------------- main, its servers replaced

def _fake_run_once(tamper_config: str):
    """run_once without a server: answers are a function of the conversation, turn and step (so every
    configuration agrees), latencies grow with the rate; `tamper_config`'s greedy check answers differently."""

    def answer(conversation: Conversation, turn: int) -> list[int]:
        return [100 + conversation.index * 10 + turn + s for s in range(conversation.turns[turn - 1].answer_tokens)]

    def client(config, conversations, rate, checked: bool) -> ClientRun:
        records, clock = [], 0.0
        per_token = 0.01 * (1 + (rate or 0)) * (0.5 if config.startswith("pensieve") else 1.0)
        for c in conversations:
            for number, turn in enumerate(c.turns, start=1):
                tokens = answer(c, number)
                if checked and config == tamper_config and (c.index, number) == (1, 3):
                    tokens = tokens[:2] + [tokens[2] + 1] + tokens[3:]
                top = [[(f"token_id:{t}", -1.0), (f"token_id:{t + 1}", -2.0)] for t in tokens] if checked else None
                records.append(TurnRecord(c.index, number, 50, turn.answer_tokens, clock, clock + per_token,
                                          clock + per_token * len(tokens), 0, tokens, top))
                clock += 1.0
        return ClientRun(records, clock, False)

    def run_once(args, model, config, rate, timed, checked, sizing, common, out, progress):
        run = client(config.name, timed, rate, False)
        counters = {mt.PROMPT_TOKENS: 1000.0, f"{mt.PROMPT_TOKENS_BY_SOURCE}{{local_compute}}": 600.0,
                    f"{mt.PROMPT_TOKENS_BY_SOURCE}{{local_cache_hit}}": 300.0,
                    f"{mt.PROMPT_TOKENS_BY_SOURCE}{{external_kv_transfer}}": 100.0}
        metrics = mt.summarise_run(config.name, rate, timed, run, counters)
        check = client(config.name, checked, None, True) if checked is not None else None
        info = {"log": "none"}
        if config.name.startswith("pensieve"):
            info["copy_times"] = (f"host-tier copies took 0.1% of the forward steps' time ({config.name} at {rate:g}); "
                                  "the forward pass waited for them 0.01 s (0.0%)")
        return metrics, run, check, info

    return run_once


def test_main_withholds_the_speeds_of_a_configuration_whose_answers_differ(tmp_path, monkeypatch):
    monkeypatch.setattr(mt, "run_once", _fake_run_once(tamper_config="pensieve-lru"))
    out = tmp_path / "run"
    status = mt.main(["--quick", "--rates", "0.5,1", "--out", str(out)])
    assert status == 1
    results = json.loads((out / "results.json").read_text())
    assert results["gate"]["pensieve"]["passed"] and results["gate"]["stock-nocache"]["passed"]
    assert not results["gate"]["pensieve-lru"]["passed"]
    assert "conversation 1 turn 3: step 2" in results["gate"]["pensieve-lru"]["summary"]
    lru = [r for r in results["runs"] if r["config"] == "pensieve-lru"]
    assert len(lru) == 2 and all(r["withheld"] and "metrics" not in r for r in lru)
    table = (out / "table.md").read_text()
    assert "| 0.5 | " in table and "| withheld |" in table and "pensieve-lru | withheld (greedy check failed)" in table
    # the others are reported; pensieve is twice as fast per token in the fake, and both stay under the SLO
    assert results["slo_summary"]["by_config"]["pensieve"]["all_under"]
    assert results["slo_summary"]["pensieve_over_stock_ttft_p90"] == pytest.approx({"0.5": 0.5, "1.0": 0.5})
    for name in ("normalised_latency_p90.png", "ttft_p90_turns2plus.png"):
        assert (out / name).stat().st_size > 1000
    assert mt.markdown(results) == table  # the report can be rebuilt from results.json


def test_main_passes_when_every_configuration_agrees(tmp_path, monkeypatch):
    monkeypatch.setattr(mt, "run_once", _fake_run_once(tamper_config="none"))
    out = tmp_path / "run"
    assert mt.main(["--quick", "--configs", "stock,pensieve", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["config"] for r in results["runs"]] == ["stock", "pensieve"]
    table = (out / "table.md").read_text()
    assert "### Host-tier copies" in table and "- pensieve-r1: host-tier copies took 0.1% of the forward steps' " \
        "time (pensieve at 1)" in table and "- stock-r1" not in table
    assert set(results["runs"][1]["metrics"]) == set(mt.RunMetrics.__dataclass_fields__)
    slo = results["slo"]["seconds_per_token"]
    assert slo == pytest.approx(5 * results["runs"][0]["metrics"]["normalised_latency_p50_s"])
