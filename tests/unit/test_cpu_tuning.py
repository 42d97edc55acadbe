"""The CPU tile parameters and the tree path's reach: limits, measurement, the on-disk cache and its failure modes.

That every tuning gives the same results is tested with the kernels
(tests/kernels/test_kernels_cpu.py draws one per example)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging

import pytest
import torch

from vllm_chunkattn import _C
from vllm_chunkattn.kernels import cpu_tuning, tree_reach
from vllm_chunkattn.kernels.support import CPU
from vllm_chunkattn.prefix.plan import DecodeShape

SMALL = DecodeShape(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A private cache folder, no tunings remembered from other tests, the kernels' values restored after."""
    monkeypatch.setattr(cpu_tuning, "cache_dir", lambda: tmp_path / "cpu-tuning")
    monkeypatch.setattr(cpu_tuning, "_tuned", {})
    monkeypatch.delenv(cpu_tuning.ENV_VAR, raising=False)
    before = cpu_tuning.current()
    yield
    before.apply()


def _forbid_measuring(monkeypatch):
    def fail(shape):
        raise AssertionError("measured although a valid cache file exists")

    monkeypatch.setattr(cpu_tuning, "measure", fail)


def test_defaults_are_the_compiled_defaults_and_candidates_lie_within_the_limits():
    cpu_tuning.CpuTuning().apply()
    assert cpu_tuning.current() == cpu_tuning.CpuTuning()
    limits = _C.cpu_tuning_limits()
    assert set(limits) == set(cpu_tuning.CANDIDATES) == set(cpu_tuning.WORKLOADS)
    assert set(limits) == {f.name for f in dataclasses.fields(cpu_tuning.CpuTuning)}
    for name, candidates in cpu_tuning.CANDIDATES.items():
        lo, hi = limits[name]
        assert all(lo <= c <= hi for c in candidates), name
        assert getattr(cpu_tuning.CpuTuning(), name) in candidates, name


@pytest.mark.parametrize("field", ["prefill_tile_rows", "lanes_tile_keys", "prefetch_distance", "lanes_prefetch_spread"])
def test_values_outside_the_limits_are_refused_and_change_nothing(field):
    before = cpu_tuning.current()
    lo, hi = _C.cpu_tuning_limits()[field]
    for bad in (lo - 1, hi + 1):
        with pytest.raises(RuntimeError, match=f"{field} must be in \\[{lo}, {hi}\\], got {bad}"):
            dataclasses.replace(before, **{field: bad}).apply()
        assert cpu_tuning.current() == before


def test_the_search_steps_cover_every_parameter_once():
    searched = [name for names in cpu_tuning.SEARCH_STEPS for name in names]
    assert sorted(searched) == sorted(cpu_tuning.CANDIDATES)


def test_measure_picks_candidates_applies_them_and_records_every_candidate():
    tuning, measured = cpu_tuning.measure(SMALL)
    assert cpu_tuning.current() == tuning.tiles
    for names in cpu_tuning.SEARCH_STEPS:
        step = cpu_tuning.step_name(names)
        every = {cpu_tuning.candidate_name(c) for c in itertools.product(*(cpu_tuning.CANDIDATES[n] for n in names))}
        default = cpu_tuning.candidate_name(tuple(getattr(cpu_tuning.CpuTuning(), n) for n in names))
        workloads = len({w for n in names for w in cpu_tuning.WORKLOADS[n]})
        first_round = measured.get(f"{step} (first round)", measured[step])
        assert set(first_round) == every
        if len(every) > cpu_tuning.FINALISTS:
            # The finalists: the default and the FINALISTS fastest of the first round, timed again.
            assert len(measured[step]) == cpu_tuning.FINALISTS + 1 and set(measured[step]) <= every
            finalists = set(measured[step]) - {default}
            others = set(first_round) - finalists - {default}
            assert max(first_round[c] for c in finalists) <= min(first_round[c] for c in others)
        for costs in (first_round, measured[step]):
            assert all(v > 0 for v in costs.values())
            # The value the step started from is the unit of the relative times.
            assert costs[default] == pytest.approx(workloads)
        assert cpu_tuning.candidate_name(tuple(getattr(tuning.tiles, n) for n in names)) in measured[step]
    # The reach: q x group for doubling q, up to the first q where the tree path lost.
    reach = measured["tree_max_rows_per_kv_head"]
    timed = sorted(int(rows) for rows in reach)
    assert timed == [SMALL.group * 2**i for i in range(1, len(timed) + 1)]
    assert all(reach[str(rows)] >= 1.0 for rows in timed[:-1])
    assert tuning.tree_max_rows_per_kv_head == max([SMALL.group] + [r for r in timed if reach[str(r)] >= 1.0])


def test_a_change_needs_min_gain(monkeypatch):
    """A candidate within MIN_GAIN of the current value does not replace it (noise never moves the defaults)."""
    default = cpu_tuning.CpuTuning()

    def timed(names, candidates, base, calls, flush, repeats):
        # Every other candidate 2% faster than the default: not enough.
        now = tuple(getattr(default, n) for n in names)
        return {c: 1.0 if c == now else 0.98 for c in candidates}

    monkeypatch.setattr(cpu_tuning, "_time_candidates", timed)
    monkeypatch.setattr(tree_reach, "measure_reach", lambda shape: (4, {}))
    assert cpu_tuning.measure(SMALL)[0] == cpu_tuning.ShapeTuning(default, 4)

    def much_faster(names, candidates, base, calls, flush, repeats):
        last = tuple(cpu_tuning.CANDIDATES[n][-1] for n in names)
        return {c: 0.5 if c == last else 1.0 for c in candidates}

    monkeypatch.setattr(cpu_tuning, "_time_candidates", much_faster)
    assert cpu_tuning.measure(SMALL)[0].tiles == cpu_tuning.CpuTuning(**{n: c[-1] for n, c in
                                                                        cpu_tuning.CANDIDATES.items()})


def test_a_value_one_round_puts_first_is_timed_again_before_it_is_kept_or_dropped(monkeypatch):
    """A step of few candidates whose one round puts another value ahead times it again, head to head with the
    current value and with FINAL_REPEATS: only a second win by MIN_GAIN changes the value, and a first round
    that puts it ahead by less than MIN_GAIN does not drop it."""
    default = cpu_tuning.CpuTuning()
    names = ("prefetch_distance",)
    now = (default.prefetch_distance,)
    other = next((c,) for c in cpu_tuning.CANDIDATES["prefetch_distance"] if (c,) != now)
    assert len(cpu_tuning.CANDIDATES["prefetch_distance"]) <= cpu_tuning.FINALISTS  # a step without screening
    rounds = []

    def timed_with(second_round_cost, first_round_cost=0.8):
        def timed(step_names, candidates, base, calls, flush, repeats):
            if step_names != names:
                return {c: 1.0 for c in candidates}
            rounds.append((list(candidates), repeats))
            cost = first_round_cost if len(rounds) == 1 else second_round_cost  # `other`, then again
            return {c: cost if c == other else 1.0 for c in candidates}
        return timed

    monkeypatch.setattr(tree_reach, "measure_reach", lambda shape: (4, {}))
    monkeypatch.setattr(cpu_tuning, "_time_candidates", timed_with(1.01))  # a lucky first round
    tuning, measured = cpu_tuning.measure(SMALL)
    assert tuning.tiles.prefetch_distance == default.prefetch_distance
    assert rounds[1] == ([now, other], cpu_tuning.FINAL_REPEATS) and rounds[0][1] == cpu_tuning.REPEATS
    assert measured["prefetch_distance (first round)"][cpu_tuning.candidate_name(other)] == 0.8
    assert measured["prefetch_distance"] == {cpu_tuning.candidate_name(now): 1.0,
                                             cpu_tuning.candidate_name(other): 1.01}

    rounds.clear()
    monkeypatch.setattr(cpu_tuning, "_time_candidates", timed_with(0.9))  # found again
    assert cpu_tuning.measure(SMALL)[0].tiles.prefetch_distance == other[0]
    assert len(rounds) == 2

    rounds.clear()
    # An unlucky first round: `other` ahead, but by less than MIN_GAIN; timed again, it wins by more.
    monkeypatch.setattr(cpu_tuning, "_time_candidates", timed_with(0.9, first_round_cost=1.0 - cpu_tuning.MIN_GAIN / 2))
    assert cpu_tuning.measure(SMALL)[0].tiles.prefetch_distance == other[0]
    assert len(rounds) == 2 and rounds[1] == ([now, other], cpu_tuning.FINAL_REPEATS)

    rounds.clear()
    monkeypatch.setattr(cpu_tuning, "_time_candidates", timed_with(0.9, first_round_cost=1.0))
    # No value ahead of the current one in the first round (a tie keeps it first): one round only.
    assert cpu_tuning.measure(SMALL)[0].tiles.prefetch_distance == default.prefetch_distance
    assert len(rounds) == 1


def test_tile_keys_and_prefetch_pace_are_searched_jointly(monkeypatch):
    """A cost surface where the best pair lies off both axes through the default: one parameter after
    the other would stop at (256 keys, its default pace); the joint step finds (128 keys, spread 8), and
    the finalists are timed again with more repeats."""
    default = cpu_tuning.CpuTuning()
    rounds = []

    def timed(names, candidates, base, calls, flush, repeats):
        rounds.append((names, list(candidates), repeats))
        if names != ("lanes_tile_keys", "lanes_prefetch_spread"):
            return {c: 1.0 for c in candidates}
        costs = {(256, default.lanes_prefetch_spread): 0.8, (128, 8): 0.6}
        return {c: costs.get(c, 1.0) for c in candidates}

    monkeypatch.setattr(cpu_tuning, "_time_candidates", timed)
    monkeypatch.setattr(tree_reach, "measure_reach", lambda shape: (4, {}))
    tiles = cpu_tuning.measure(SMALL)[0].tiles
    assert (tiles.lanes_tile_keys, tiles.lanes_prefetch_spread) == (128, 8)
    joint = [r for r in rounds if r[0] == ("lanes_tile_keys", "lanes_prefetch_spread")]
    assert [repeats for _, _, repeats in joint] == [cpu_tuning.SCREEN_REPEATS, cpu_tuning.FINAL_REPEATS]
    now = (default.lanes_tile_keys, default.lanes_prefetch_spread)
    assert len(joint[0][1]) == len(cpu_tuning.CANDIDATES["lanes_tile_keys"]) * len(
        cpu_tuning.CANDIDATES["lanes_prefetch_spread"])
    assert joint[1][1][0] == now and {(128, 8), (256, default.lanes_prefetch_spread)} <= set(joint[1][1])
    assert len(joint[1][1]) == cpu_tuning.FINALISTS + 1


def test_every_timed_call_starts_from_evicted_caches(monkeypatch):
    """The tiles are chosen on a step's memory behaviour: each timed call runs right after the caches were
    evicted, never after another call left its inputs there."""
    events = []

    class Flusher:
        def __call__(self):
            events.append("flush")

    monkeypatch.setattr(cpu_tuning, "CacheFlusher", Flusher)
    monkeypatch.setattr(cpu_tuning, "timed", lambda call: events.append("call") or 1.0)
    monkeypatch.setattr(tree_reach, "measure_reach", lambda shape: (4, {}))
    cpu_tuning.measure(SMALL)
    assert events.count("call") > len(cpu_tuning.CANDIDATES)
    assert events == ["flush", "call"] * events.count("call")


def test_ensure_tuned_measures_once_caches_and_reuses_the_file(monkeypatch, caplog):
    calls = []
    real_measure = cpu_tuning.measure
    monkeypatch.setattr(cpu_tuning, "measure", lambda shape: calls.append(shape) or real_measure(shape))
    with caplog.at_level(logging.INFO, logger="vllm.chunkattn"):
        first = cpu_tuning.ensure_tuned(SMALL)
        assert cpu_tuning.ensure_tuned(SMALL) == first
    assert calls == [SMALL]
    path = cpu_tuning.cache_path(cpu_tuning.tuning_key(SMALL))
    record = json.loads(path.read_text())
    assert record["tuning"] == dataclasses.asdict(first.tiles)
    assert record["tree_max_rows_per_kv_head"] == first.tree_max_rows_per_kv_head
    assert record["key"]["shape"]["dtype"] == "float32" and record["key"]["kernel_build"] == cpu_tuning.kernel_build()
    logged = [r.getMessage() for r in caplog.records if "chunkattn CPU kernels" in r.getMessage()]
    assert len(logged) == 1 and "measured in" in logged[0] and first.describe() in logged[0]
    # The pause at engine start is announced before it, once.
    messages = [r.getMessage() for r in caplog.records]
    announced = [i for i, m in enumerate(messages) if "measuring the CPU kernels' tile parameters" in m]
    assert len(announced) == 1 and SMALL.describe() in messages[announced[0]]
    assert announced[0] < messages.index(logged[0])

    # A new process: read from the file, not measured.
    monkeypatch.setattr(cpu_tuning, "_tuned", {})
    _forbid_measuring(monkeypatch)
    cpu_tuning.CpuTuning(prefill_tile_rows=8, lanes_tile_keys=16, prefetch_distance=4).apply()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vllm.chunkattn"):
        assert cpu_tuning.ensure_tuned(SMALL) == first
    assert cpu_tuning.current() == first.tiles
    assert not any("measuring" in r.getMessage() for r in caplog.records)


def test_the_key_separates_shapes_and_dtypes():
    other = dataclasses.replace(SMALL, dtype=torch.bfloat16)
    paths = {cpu_tuning.cache_path(cpu_tuning.tuning_key(s))
             for s in (SMALL, other, dataclasses.replace(SMALL, block_size=32))}
    assert len(paths) == 3


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other key", "out of range", "missing field",
                                    "reach out of range", "reach missing"])
def test_a_damaged_cache_file_is_measured_again(monkeypatch, caplog, damage):
    key = cpu_tuning.tuning_key(SMALL)
    path = cpu_tuning.cache_path(key)
    good = cpu_tuning.ShapeTuning(cpu_tuning.CpuTuning(prefill_tile_rows=32, lanes_tile_keys=256,
                                                       prefetch_distance=2), tree_max_rows_per_kv_head=8)
    cpu_tuning.save(path, key, good, {}, 0.0)
    text = path.read_text()
    record = json.loads(text)
    if damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "other key":
        record["key"]["cpu"]["cpu_model"] = -1
        path.write_text(json.dumps(record))
    elif damage == "out of range":
        record["tuning"]["lanes_tile_keys"] = 10**6
        path.write_text(json.dumps(record))
    elif damage == "missing field":
        del record["tuning"]["prefetch_distance"]
        path.write_text(json.dumps(record))
    elif damage == "reach out of range":
        record["tree_max_rows_per_kv_head"] = 0
        path.write_text(json.dumps(record))
    else:
        del record["tree_max_rows_per_kv_head"]
        path.write_text(json.dumps(record))
    measured = []
    fresh = cpu_tuning.ShapeTuning(cpu_tuning.CpuTuning(prefill_tile_rows=128, lanes_tile_keys=64,
                                                        prefetch_distance=0), tree_max_rows_per_kv_head=16)
    monkeypatch.setattr(cpu_tuning, "measure", lambda shape: (measured.append(shape) or (fresh, {})))
    with caplog.at_level(logging.WARNING, logger="vllm.chunkattn"):
        assert cpu_tuning.ensure_tuned(SMALL) == fresh
    assert measured == [SMALL]
    assert cpu_tuning.current() == fresh.tiles
    assert any("ignoring the CPU tuning cache" in r.getMessage() for r in caplog.records)
    rewritten = json.loads(path.read_text())
    assert rewritten["tuning"] == dataclasses.asdict(fresh.tiles) and rewritten["tree_max_rows_per_kv_head"] == 16


def test_an_unwritable_cache_only_warns(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setattr(cpu_tuning, "cache_dir", lambda: blocker / "cpu-tuning")  # under a file: mkdir fails
    fresh = cpu_tuning.ShapeTuning(cpu_tuning.CpuTuning(prefetch_distance=2), tree_max_rows_per_kv_head=4)
    monkeypatch.setattr(cpu_tuning, "measure", lambda shape: (fresh, {}))
    with caplog.at_level(logging.WARNING, logger="vllm.chunkattn"):
        assert cpu_tuning.ensure_tuned(SMALL) == fresh
    assert any("could not write the CPU tuning cache" in r.getMessage() for r in caplog.records)


def test_default_mode_uses_the_built_in_values_without_measuring(monkeypatch):
    monkeypatch.setenv(cpu_tuning.ENV_VAR, "default")
    _forbid_measuring(monkeypatch)
    cpu_tuning.CpuTuning(prefetch_distance=3).apply()
    assert cpu_tuning.ensure_tuned(SMALL) == cpu_tuning.ShapeTuning(cpu_tuning.CpuTuning(),
                                                                    CPU.tree_max_rows_per_kv_head)
    assert cpu_tuning.current() == cpu_tuning.CpuTuning()
    assert not cpu_tuning.cache_dir().exists()


def test_a_bad_mode_is_refused_with_the_allowed_values(monkeypatch):
    monkeypatch.setenv(cpu_tuning.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="CHUNKATTN_CPU_TUNING must be one of auto, default; got 'fast'"):
        cpu_tuning.ensure_tuned(SMALL)


def test_setting_needs_every_parameter_and_no_other():
    before = cpu_tuning.current()
    values = dataclasses.asdict(before)
    with pytest.raises(RuntimeError, match="is missing prefetch_distance"):
        _C.set_cpu_tuning({**{k: v for k, v in values.items() if k != "prefetch_distance"}, "prefetch": 1})
    with pytest.raises(RuntimeError, match="every parameter of cpu_tuning_limits"):
        _C.set_cpu_tuning({**values, "tile_cols": 8})
    assert cpu_tuning.current() == before
    assert _C.cpu_tuning_defaults() == dataclasses.asdict(cpu_tuning.CpuTuning())
