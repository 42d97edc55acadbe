"""The referee of two low-precision runs (testing/compare.py deviation_from): what it counts."""

from vllm_chunkattn.testing.compare import deviation_from


def _run(*requests):
    """Each request: (tokens, per step the top logprobs as (token, logprob) pairs)."""
    return {"results": [{"tokens": tokens, "top_logprobs": tops} for tokens, tops in requests]}


def test_counts_the_tokens_before_the_first_difference_and_the_logprobs_up_to_it():
    reference = _run(([1, 2, 3], [[(1, -0.1), (9, -2.0)], [(2, -0.2)], [(3, -0.3)]]))
    run = _run(([1, 2, 4], [[(1, -0.3), (9, -2.0)], [(2, -0.2)], [(4, -0.1), (3, -0.4)]]))
    deviation = deviation_from(reference, run)
    assert deviation["agreeing_tokens"] == 2
    # steps 0 and 1 and the first differing step 2: |0.2|, |0|, |0|, |0.1| over the tokens both list
    assert abs(deviation["mean_logprob_diff"] - 0.3 / 4) < 1e-9


def test_a_run_further_from_the_reference_scores_worse():
    reference = _run(([1, 2], [[(1, -0.1)], [(2, -0.1)]]))
    near = _run(([1, 2], [[(1, -0.15)], [(2, -0.1)]]))
    far = _run(([1, 5], [[(1, -0.6)], [(5, -0.1), (2, -0.9)]]))
    assert deviation_from(reference, near)["mean_logprob_diff"] < deviation_from(reference, far)["mean_logprob_diff"]
    assert deviation_from(reference, near)["agreeing_tokens"] > deviation_from(reference, far)["agreeing_tokens"]
