"""Tensor parallelism: `--tensor-parallel-size 2` with vLLM's multiprocessing
executor on the CPU build (one rank per core here), each rank running the
prefix tree and the kernels over its own heads. Tokens and logprobs equal to
stock vLLM at the same parallel configuration, and both ranks share."""

from __future__ import annotations

import pytest

from vllm_chunkattn.testing.compare import compare_runs
from vllm_chunkattn.testing.e2e_runs import CONFIGS, run_workload

pytestmark = pytest.mark.e2e

NAME = "float32-gqa-d64-block32-preempt"  # 4 query heads over 2 KV heads: 2 over 1 per rank


def test_tensor_parallel_matches_stock_and_every_rank_shares(tmp_path_factory):
    *_, logprob_atol, near_tie = CONFIGS[NAME]
    tp = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
    stock = run_workload(tmp_path_factory, NAME, "stock", extra_args=tp)
    chunk = run_workload(tmp_path_factory, NAME, "chunk", extra_args=tp)
    assert chunk["settings"]["tensor_parallel_size"] == 2
    report = compare_runs(stock, chunk, logprob_atol, near_tie)
    assert not report["problems"], "\n".join(report["problems"][:20])
    assert [r["tokens"] for r in stock["results"]] == [r["tokens"] for r in chunk["results"]]
    # One whole-run summary per rank (each worker process logs its own), both sharing the same tree:
    # the tree comes from the block tables, which every rank has in full.
    summaries = chunk["decode_summaries"]
    assert len(summaries) == 2, chunk["log"][-3000:]
    assert all(s.mean_nodes > 0 and s.saved_tokens > 0 for s in summaries), summaries
    assert summaries[0].steps == summaries[1].steps and summaries[0].saved_tokens == summaries[1].saved_tokens
