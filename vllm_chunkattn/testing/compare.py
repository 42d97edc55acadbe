"""How two runs of the same greedy workload are compared.

Greedy decoding is exact only up to floating-point rounding: where a run's
two best tokens are closer than rounding can separate, the two backends may
legitimately pick different tokens, and everything after differs. So a
comparison walks each request's tokens and:
- requires the top logprobs of every step compared to agree within `logprob_atol`;
- at the first differing token, requires that one of the runs had a near tie
  there (its top-2 logprobs within `near_tie`), else fails; then stops, since
  the two runs no longer see the same context.
With near_tie = 0 that is "identical tokens".
"""

from __future__ import annotations


def compare_runs(stock: dict, chunk: dict, logprob_atol: float, near_tie: float) -> dict:
    compared = diverged = 0
    worst = 0.0
    problems = []
    for i, (a, b) in enumerate(zip(stock["results"], chunk["results"], strict=True)):
        for pos, (ta, tb) in enumerate(zip(a["tokens"], b["tokens"], strict=True)):
            top_a, top_b = _top_logprobs(a, pos), _top_logprobs(b, pos)
            for tok in set(top_a) & set(top_b):
                worst = max(worst, abs(top_a[tok] - top_b[tok]))
                if abs(top_a[tok] - top_b[tok]) > logprob_atol:
                    problems.append(f"request {i} step {pos}: logprob of {tok} {top_a[tok]:.5f} vs {top_b[tok]:.5f}")
            compared += 1
            if ta != tb:
                gaps = [_top2_gap(a["top_logprobs"][pos]), _top2_gap(b["top_logprobs"][pos])]
                if min(gaps) > near_tie:
                    problems.append(f"request {i} step {pos}: token {ta} vs {tb} with top-2 gaps {gaps}")
                diverged += 1
                break
    return {"compared_steps": compared, "diverged_requests": diverged, "worst_logprob_diff": worst, "problems": problems}


def _top_logprobs(result: dict, pos: int) -> dict[int, float]:
    """A request's top logprobs at step `pos`, by token."""
    return {tok: lp for tok, lp in result["top_logprobs"][pos]}


def _top2_gap(step) -> float:
    lps = sorted((lp for _, lp in step), reverse=True)
    return lps[0] - lps[1] if len(lps) > 1 else float("inf")


def deviation_from(reference: dict, run: dict) -> dict:
    """How far a low-precision run strays from a float32 run of the same workload (the referee when two
    low-precision runs disagree: each rounds differently, and which is right only the reference says):
    its tokens equal to the reference's before their first difference, and the mean absolute difference
    of the top logprobs both have, over those steps and the first differing one."""
    agreeing, diffs = 0, []
    for ref, res in zip(reference["results"], run["results"], strict=True):
        same = 0
        while same < min(len(ref["tokens"]), len(res["tokens"])) and ref["tokens"][same] == res["tokens"][same]:
            same += 1
        agreeing += same
        for pos in range(min(same + 1, len(ref["tokens"]), len(res["tokens"]))):
            top_ref, top_run = _top_logprobs(ref, pos), _top_logprobs(res, pos)
            diffs += [abs(top_ref[tok] - top_run[tok]) for tok in set(top_ref) & set(top_run)]
    return {"agreeing_tokens": agreeing, "mean_logprob_diff": sum(diffs) / max(1, len(diffs))}
