"""End to end: the shared-prefix workload through stock vLLM (CPU_ATTN) and
through `chunk`, on the same embedded models, compared token by token.

Each run is a fresh process (`python -m vllm_chunkattn.testing.workload`), as a user
would start it. The workload covers prefill, chunked prefill (prompts longer
than max_num_batched_tokens), prefix-cache hits, decode, mixed batches, more
requests than max_num_seqs (requests join while others decode), different
output lengths (they leave at different times), and, in the float32 run, a
KV cache small enough to force preemption and recompute.
"""

from __future__ import annotations

import pytest

from vllm_chunkattn.testing.compare import compare_runs
from vllm_chunkattn.testing.e2e_runs import CONFIGS

pytestmark = pytest.mark.e2e

@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunk_matches_stock(runs, name):
    *_, logprob_atol, near_tie = CONFIGS[name]
    stock, chunk = runs(name, "stock"), runs(name, "chunk")
    assert "Using CHUNK backend" in chunk["log"] and "Using CHUNK backend" not in stock["log"]
    assert "Using CHUNK attention backend (vllm_chunkattn)" in chunk["log"]  # our builder's own log line
    report = compare_runs(stock, chunk, logprob_atol, near_tie)
    print(name, {k: v for k, v in report.items() if k != "problems"})
    assert not report["problems"], "\n".join(report["problems"][:20])
    total_steps = sum(len(r["tokens"]) for r in stock["results"])
    # The comparison must cover most of the workload, not stop at step 0.
    assert report["compared_steps"] >= 0.5 * total_steps
    if near_tie == 0.0:
        assert [r["tokens"] for r in stock["results"]] == [r["tokens"] for r in chunk["results"]]
        assert stock["chat"] == chunk["chat"]


def test_workload_exercised_what_it_claims(runs):
    name = "float32-gqa-d64-block32-preempt"
    for backend in ("stock", "chunk"):
        record = runs(name, backend)
        counters = record["counters"]
        assert counters["vllm:num_preemptions"] > 0, counters
        assert counters["vllm:prefix_cache_hits"] > 0, counters
        prompt_lens = [r["prompt_tokens"] for r in record["results"]]
        assert max(prompt_lens) > 256  # longer than max_num_batched_tokens: chunked prefill
        assert min(prompt_lens) < 32  # shorter than one chunk
        assert len(prompt_lens) > record["settings"]["max_num_seqs"]
        assert len({len(r["tokens"]) for r in record["results"]}) > 1
    # Outputs vary: an equality test on one repeated token would prove little.
    tokens = [t for r in runs(name, "stock")["results"] for t in r["tokens"]]
    assert len(set(tokens)) > len(tokens) / 4
