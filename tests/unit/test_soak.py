"""The soak command's judgement (vllm_chunkattn/bench/soak.py): what fails a run."""

from __future__ import annotations

import pytest

from vllm_chunkattn.bench import soak


def sample(t: float, rss: float, errors: int = 0, mismatches: int = 0) -> dict:
    return {"elapsed_s": t, "rss_total_mib": rss,
            "counts": {"requests": {}, "server_errors": errors, "mismatches": mismatches}}


def counts(errors: int = 0, mismatches: int = 0) -> dict:
    return {"requests": {"greedy": 10}, "server_errors": errors, "mismatches": mismatches, "near_tie_divergences": 0}


def test_memory_growth_is_judged_after_warm_up_only():
    # Growth during warm-up (0 to 60 s) does not count; after it, the mean of the last three samples.
    steady = [sample(0, 500), sample(30, 900), sample(60, 1000), sample(120, 1030), sample(180, 1040),
              sample(240, 1045)]
    v = soak.verdict(steady, counts(), warmup_s=60, max_growth=0.05)
    assert v["passed"] and v["rss_growth_after_warmup"] == pytest.approx(0.0383, abs=1e-3)
    leaking = steady[:3] + [sample(120, 1040), sample(180, 1060), sample(240, 1080)]
    v = soak.verdict(leaking, counts(), warmup_s=60, max_growth=0.05)
    assert not v["passed"] and "grew 6.0%" in v["failures"][0]


def test_server_errors_and_differing_answers_fail():
    samples = [sample(0, 100), sample(60, 100), sample(120, 100)]
    assert soak.verdict(samples, counts(), 60, 0.05)["passed"]
    assert not soak.verdict(samples, counts(errors=1), 60, 0.05)["passed"]
    assert not soak.verdict(samples, counts(mismatches=1), 60, 0.05)["passed"]
    assert not soak.verdict(samples[:2], counts(), 60, 0.05)["passed"]  # one sample after warm-up says nothing


def answer(tokens, gaps):
    """Greedy answer whose step i has a top-2 logprob gap gaps[i]."""
    return soak.Answer(200, "".join(tokens), list(tokens), [[(t, -0.1), ("zz", -0.1 - g)] for t, g in zip(tokens, gaps)])


def test_a_greedy_answer_may_diverge_only_after_a_near_tie():
    first = answer(["a", "b", "c"], [1.0, 1.0, 1.0])
    assert soak.same_answer(first, answer(["a", "b", "c"], [1.0, 1.0, 1.0]), "greedy", 1e-4) is None
    assert soak.same_answer(first, answer(["a", "x", "y"], [1.0, 1.0, 1.0]), "greedy", 1e-4)
    tied = answer(["a", "b", "c"], [1.0, 1e-5, 1.0])
    assert soak.same_answer(tied, answer(["a", "x", "y"], [1.0, 1e-5, 1.0]), "greedy", 1e-4) is None
    assert soak.same_answer(first, answer(["a", "b"], [1.0, 1.0]), "greedy", 1e-4)  # cut short
    # Sampled answers: the text, exactly.
    sampled = soak.Answer(200, "one\x1etwo")
    assert soak.same_answer(sampled, soak.Answer(200, "one\x1etwo"), "sampled", 1e-4) is None
    assert soak.same_answer(sampled, soak.Answer(200, "one\x1ethree"), "sampled", 1e-4)


def test_tally_counts_5xx_and_bad_requests_that_are_not_refused():
    tally = soak.Tally(near_tie=1e-4)
    mix = {r.name: r for r in soak.request_mix()}
    assert {r.kind for r in mix.values()} == {"greedy", "stream", "disconnect", "bad", "sampled"}
    tally.add(mix["bad-negative-max-tokens"], soak.Answer(400))
    tally.add(mix["bad-unknown-model"], soak.Answer(200))  # accepted: counts against the server
    tally.add(mix["shared-0"], answer(["a"], [1.0]))
    tally.add(mix["shared-0"], soak.Answer(500))
    tally.add(mix["shared-0"], answer(["b"], [1.0]))
    tally.add(mix["disconnect-0"], soak.Answer(200))
    c = tally.counts()
    assert c["server_errors"] == 2 and c["mismatches"] == 1
    assert c["requests"] == {"bad": 2, "greedy": 3, "disconnect": 1}
