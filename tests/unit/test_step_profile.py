"""The step profile's attribution of profiler events to components, on a synthetic event tree
(the command itself starts engines: it is run by hand, its tables are in docs/results/)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from vllm_chunkattn.bench import step_profile as sp


@dataclass
class Event:
    name: str
    self_ms: float
    total_ms: float
    cpu_parent: "Event | None" = None

    @property
    def self_cpu_time_total(self) -> float:  # microseconds, as torch.profiler reports
        return self.self_ms * 1e3

    @property
    def cpu_time_total(self) -> float:
        return self.total_ms * 1e3


def test_components_add_up_to_the_wall_time_and_ranges_count_once():
    step = Event("execute_model", 5.0, 100.0)  # a vLLM range: its self time is Python, i.e. the rest
    wrapper = Event("vllm::unified_attention_with_output", 0.5, 10.5, step)
    build = Event(sp.BUILDER_RANGE, 0.2, 1.0, step)
    events = [
        step, wrapper, build,
        Event("chunkattn::paged_prefill", 8.0, 8.0, wrapper),
        Event("_C::cpu_attn_reshape_and_cache", 2.0, 2.0, wrapper),
        Event("aten::to", 0.8, 0.8, build),  # inside the builder: counted with it, not as an op
        Event("_C::onednn_mm", 50.0, 50.0, step),
        Event("aten::silu", 4.0, 4.0, step),
        Event(sp.SAMPLING_RANGE, 1.0, 3.0, step),
        Event("aten::argmax", 2.0, 2.0, None),
    ]
    events[-1].cpu_parent = events[-2]
    ms = sp.breakdown(events, wall_ms=110.0)
    assert ms["attention"] == pytest.approx(0.5 + 8.0 + 2.0)
    assert ms["builder"] == pytest.approx(1.0)
    assert ms["linear"] == pytest.approx(50.0)
    assert ms["sampling"] == pytest.approx(3.0)
    assert ms["other ops"] == pytest.approx(4.0)
    assert sum(ms.values()) == pytest.approx(110.0)
    assert ms["rest"] == pytest.approx(110.0 - 10.5 - 1.0 - 50.0 - 3.0 - 4.0)


@pytest.mark.parametrize("name,component", [
    ("chunkattn::tpp_decode", "attention"), ("chunkattn::write_kv_cache", "attention"),
    ("_C::cpu_attention_with_kv_cache", "attention"), ("aten::addmm", "linear"), ("_C::onednn_mm", "linear"),
    ("_C::rotary_embedding", "other ops"), ("vllm::all_reduce", "other ops"), ("ProfilerStep#1", None),
])
def test_classify(name, component):
    assert sp.classify(name) == component


def test_arguments_are_validated():
    with pytest.raises(SystemExit):
        sp.parse_args(["--decode-steps", "0"])
    assert sp.parse_args([]).model_name == "bench-gqa"


def test_several_prefixes_are_each_read_once_in_the_roofline():
    from vllm_chunkattn.bench.machine import MachineRates

    # Rates that make every bound a memory bound: 1 GB/s, a huge peak.
    rates = [MachineRates(1, 1.0, (1.0,), {"avx2_fma": 1e9}, {"avx2_fma": 1e9})]
    spec = {"num_key_value_heads": 4, "head_dim": 128, "num_attention_heads": 16, "num_hidden_layers": 4}
    one = sp.attention_roofline_ms(sp.parse_args(["--prefixes", "1", "--decode-steps", "2"]), spec, rates)
    four = sp.attention_roofline_ms(sp.parse_args(["--prefixes", "4", "--decode-steps", "2"]), spec, rates)
    per_prefix_ms = 2048 * 4 * 128 * 2 * 4 * 4 / 1e9 * 1e3  # tokens x K/V bytes per token x layers at 1 GB/s
    assert four - one == pytest.approx(3 * per_prefix_ms)


def test_prefixes_and_threads_are_validated(monkeypatch):
    with pytest.raises(SystemExit):
        sp.parse_args(["--prefixes", "0"])
    with pytest.raises(SystemExit):
        sp.parse_args(["--batch", "4", "--prefixes", "8"])
    with pytest.raises(SystemExit):
        sp.parse_args(["--threads", "0"])
    assert sp.parse_args(["--threads", "3"]).threads == 3


def test_default_threads_are_those_vllm_serve_gives_its_worker(monkeypatch):
    monkeypatch.setattr(sp.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert sp.serve_worker_threads() == 3
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "2")
    assert sp.serve_worker_threads() == 2
    monkeypatch.setattr(sp.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert sp.serve_worker_threads() == 1


@pytest.mark.parametrize("batch,prefixes", [(32, 4), (30, 4), (5, 5), (7, 1)])
def test_every_order_gives_each_prefix_the_same_requests(batch, prefixes):
    orders = {order: sp.prefix_owners(batch, prefixes, order, seed=3) for order in sp.ORDERS if order != "serving"}
    for owners in orders.values():
        assert len(owners) == batch
        assert sorted(owners) == orders["grouped"]
        assert max(owners.count(p) for p in range(prefixes)) - min(owners.count(p) for p in range(prefixes)) <= 1
    assert orders["interleaved"] == [i % prefixes for i in range(batch)]


def test_the_shuffled_order_is_a_seeded_permutation_as_the_serving_benchmark_sends():
    first = sp.prefix_owners(32, 4, "shuffled", seed=0)
    assert first == sp.prefix_owners(32, 4, "shuffled", seed=0)  # the same for both backends
    assert first != sp.prefix_owners(32, 4, "shuffled", seed=1)
    assert first not in (sp.prefix_owners(32, 4, "grouped"), sp.prefix_owners(32, 4, "interleaved"))
    with pytest.raises(ValueError, match="shuffled"):
        sp.prefix_owners(32, 4, "sorted")


def test_the_serving_order_is_the_first_wave_vllm_bench_serve_sends():
    """vllm bench serve --num-prompts 64 --max-concurrency 32 --seed 0 on 4 prefixes (its prefix_repetition
    dataset, checked against vLLM's own class on 2026-11-26): 10/7/8/7 requests in the first wave."""
    owners = sp.prefix_owners(32, 4, "serving", seed=0)
    assert len(owners) == 32 and owners[:8] == [1, 1, 1, 2, 2, 3, 1, 2]
    assert [owners.count(p) for p in range(4)] == [10, 7, 8, 7]
    assert owners != sp.prefix_owners(32, 4, "serving", seed=1)
    assert sp.describe_order(sp.parse_args(["--prefixes", "4", "--order", "serving"])).startswith(
        "serving order, seed 0: 1 1 1 2 2 3 1 2")


def test_the_order_defaults_to_the_serving_benchmarks_and_is_named_in_the_report():
    args = sp.parse_args(["--prefixes", "4"])
    assert (args.order, args.order_seed) == ("shuffled", 0)
    assert sp.describe_order(args).startswith("shuffled order, seed 0: ")
    assert sp.describe_order(sp.parse_args(["--prefixes", "4", "--order", "interleaved"])) == (
        "interleaved order: " + " ".join(str(i % 4) for i in range(32)))
    with pytest.raises(SystemExit):
        sp.parse_args(["--order", "sorted"])
