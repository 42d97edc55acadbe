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

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_chunkattn.testing.compare import compare_runs, deviation_from
from vllm_chunkattn.testing.e2e_runs import CONFIGS, REFEREE_OF, SPECULATIVE_CONFIGS

pytestmark = pytest.mark.e2e

@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunk_matches_stock(runs, name):
    *_, logprob_atol, near_tie = CONFIGS[name]
    stock, chunk = runs.pair(name)
    assert "Using CHUNK backend" in chunk["log"] and "Using CHUNK backend" not in stock["log"]
    assert "Using CHUNK attention backend (vllm_chunkattn)" in chunk["log"]  # our builder's own log line
    report = compare_runs(stock, chunk, logprob_atol, near_tie)
    print(name, {k: v for k, v in report.items() if k != "problems"})
    if report["problems"] and name in REFEREE_OF:
        _assert_as_close_to_float32_as_stock(runs, name, stock, chunk, report)
    else:
        assert not report["problems"], "\n".join(report["problems"][:20])
    total_steps = sum(len(r["tokens"]) for r in stock["results"])
    # The comparison must cover most of the workload, not stop at step 0.
    assert report["compared_steps"] >= 0.5 * total_steps
    if near_tie == 0.0:
        assert [r["tokens"] for r in stock["results"]] == [r["tokens"] for r in chunk["results"]]
        assert stock["chat"] == chunk["chat"]


def _assert_as_close_to_float32_as_stock(runs, name, stock, chunk, report):
    """bf16 and fp16 round differently in vLLM's kernel and ours, and on some CPUs (an AVX2-only Zen 3:
    vLLM's AVX2 kernels) a tiny model's logprobs then move apart by more than the tolerance, with both
    runs as far from float32 as each other. There the float32 run is the referee: ours must stray from
    it no more than stock's kernel does (mean logprob difference within 10%, and as many tokens agreeing
    but 5%)."""
    reference = runs(REFEREE_OF[name], "stock")
    ours, theirs = deviation_from(reference, chunk), deviation_from(reference, stock)
    print(name, "against float32: chunk", ours, "stock", theirs)
    detail = f"{report['problems'][:5]}; against float32: chunk {ours}, stock {theirs}"
    assert ours["mean_logprob_diff"] <= 1.1 * theirs["mean_logprob_diff"], detail
    assert ours["agreeing_tokens"] >= 0.95 * theirs["agreeing_tokens"], detail


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


def shared_prompt_tokens(token_lists: list[list[int]]) -> int:
    """Length of the token prefix every list starts with."""
    return len(os.path.commonprefix(token_lists))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunk_reports_sharing_on_the_shared_prefix_workload(runs, name):
    stock, chunk = runs.pair(name)
    assert "CHUNK prefix tree" not in stock["log"] and stock["decode_summaries"] == []
    summaries = chunk["decode_summaries"]
    assert len(summaries) == 1, "one whole-run line from the one metadata builder expected:\n" + chunk["log"][-3000:]
    summary = summaries[0]
    block_size = chunk["settings"]["block_size"]
    # Every request but the short ones starts with the system prompt; its full
    # chunks are what any two decode requests at least share.
    long_requests = [r for r in chunk["results"] if r["group"] != "short"]
    shared_tokens = shared_prompt_tokens([r["prompt_token_ids"] for r in long_requests])
    system_chunk_tokens = shared_tokens // block_size * block_size
    longest_context = max(r["prompt_tokens"] + len(r["tokens"]) for r in long_requests)
    # Lower bound: as if every decode step were a pair of requests sharing only
    # the system prompt's full chunks, both at the longest context. The run
    # decodes up to max_num_seqs requests at a time, and a group's requests
    # share its document too, so a run that shares as the workload does lies
    # well above; one that shares only now and then does not.
    min_share = system_chunk_tokens / (2 * longest_context)
    print(name, summary, f"lower bound {min_share:.3f}")
    assert system_chunk_tokens >= 2 * block_size  # the workload has chunks to share at this block size
    assert summary.steps > 0 and 1 <= summary.mean_batch <= chunk["settings"]["max_num_seqs"]
    assert summary.mean_nodes > 0
    assert summary.served_once_share >= min_share, (summary, min_share)


def test_chunk_reports_no_sharing_without_shared_prefixes(runs):
    name = "float32-gqa-d64-block32-preempt"
    record = runs(name, "chunk", workload="distinct-prompts")
    block_size = record["settings"]["block_size"]
    prompts = [r["prompt_token_ids"] for r in record["results"]]
    # Every prompt fills a chunk, and they part after the first token (the BOS token every prompt starts with).
    assert min(len(p) for p in prompts) >= block_size
    assert shared_prompt_tokens(prompts) <= 1
    summaries = record["decode_summaries"]
    assert len(summaries) == 1, record["log"][-3000:]
    summary = summaries[0]
    print(name, "distinct prompts", summary)
    # Requests decoded together, so a tree could have found (false) sharing.
    assert summary.steps > 0 and summary.mean_batch > 1
    assert summary.mean_nodes == 0 and summary.saved_tokens == 0 and summary.served_once_share == 0


def test_a_burst_on_a_cached_system_prompt_shares_its_prompt_rows(runs):
    """32 requests arrive together on a 1504-token system prompt (47 whole chunks)
    with 3 to 8 tokens each of their own. The first computes the prompt; the
    other 31 hit its blocks in the same step (vLLM registers them when it
    schedules the first) and send only their own tokens: few enough for the
    tree path, so their prompt rows attend the system prompt as one node while
    the first request is still writing it. Identical greedy tokens, logprobs
    within the float32 tolerance, and the log shows the rows went through the tree."""
    from vllm_chunkattn.testing.workload import burst_workload

    name = "float32-gqa-d64-block32-preempt"
    *_, logprob_atol, near_tie = CONFIGS[name]
    stock, chunk = runs.pair(name, "burst")
    report = compare_runs(stock, chunk, logprob_atol, near_tie)
    assert not report["problems"], "\n".join(report["problems"][:20])
    assert [r["tokens"] for r in stock["results"]] == [r["tokens"] for r in chunk["results"]]
    requests = burst_workload()
    system = 47 * 32
    # The 31 later requests hit the whole system prompt...
    assert chunk["counters"]["vllm:prefix_cache_hits"] >= (len(requests) - 1) * system, chunk["counters"]
    # ... and their own tokens are rows of the tree: at least all of them, once.
    own_tokens = sum(len(r.prompt) - system for r in requests[1:])
    [summary] = chunk["decode_summaries"]
    print(summary, f"own prompt tokens of the later requests: {own_tokens}")
    assert summary.multi_token_rows >= own_tokens
    assert summary.mean_nodes > 0 and summary.served_once_share > 0.5


def test_speculative_decoding_rows_take_the_tree_path(runs):
    """n-gram speculative decoding (3 tokens): each verification step gives a
    request 1 + k query rows, which take the tree path. On a model whose greedy
    output repeats at times, some drafts are accepted and others rejected (KV
    of rejected tokens is written, then overwritten); drafts, acceptances,
    tokens and logprobs are identical to stock's, and the tree saw the
    verification rows."""
    name = "float32-repeats-gqa-d64-block32"
    *_, logprob_atol, near_tie = SPECULATIVE_CONFIGS[name]
    stock, chunk = runs.pair(name, "speculative")
    report = compare_runs(stock, chunk, logprob_atol, near_tie)
    assert not report["problems"], "\n".join(report["problems"][:20])
    assert [r["tokens"] for r in stock["results"]] == [r["tokens"] for r in chunk["results"]]
    spec = {k: v for k, v in chunk["counters"].items() if "spec_decode" in k}
    assert spec == {k: v for k, v in stock["counters"].items() if "spec_decode" in k}
    print(spec, chunk["decode_summaries"])
    accepted, proposed = spec["vllm:spec_decode_num_accepted_tokens"], spec["vllm:spec_decode_num_draft_tokens"]
    assert 0 < accepted < proposed  # both verification outcomes happened
    [summary] = chunk["decode_summaries"]
    # Each draft is verified as 1 + (its draft tokens) rows of one request.
    assert summary.multi_token_rows >= spec["vllm:spec_decode_num_drafts"] + proposed


def test_parallel_samples_share_their_prompt_as_one_node(runs):
    """n = 4 samples of a prompt run as 4 requests on the prompt's blocks, and
    each step's tree has one node covering all of them. A prompt of 5 whole
    chunks and 5 tokens shares its 5 chunks; one of exactly 7 chunks shares
    only 6, because vLLM caps a prefix hit at the prompt length minus one and
    each later sample recomputes the last chunk into a block of its own.
    Seeded sampling draws the same tokens as stock."""
    name = "float32-gqa-d64-block32-preempt"
    *_, logprob_atol, near_tie = CONFIGS[name]
    stock, chunk = runs.pair(name, "parallel-sampling")
    report = compare_runs(stock, chunk, logprob_atol, near_tie)
    assert not report["problems"], "\n".join(report["problems"][:20])
    assert [r["tokens"] for r in stock["results"]] == [r["tokens"] for r in chunk["results"]]
    by_prompt = {}
    for r in chunk["results"]:
        by_prompt.setdefault(r["group"], []).append(tuple(r["tokens"]))
    assert {g: len(s) for g, s in by_prompt.items()} == {"n-inside-chunk": 4, "n-chunk-boundary": 4}
    assert all(len(set(samples)) > 1 for samples in by_prompt.values())  # the samples went their own ways

    steps = chunk["step_trees"]
    assert steps and stock["step_trees"] == []
    for step in steps:
        print(step)
        if step.rows == 1:  # one decode row shares with nobody
            assert step.nodes == ()
            continue
        # One node, over every row of the step: the samples of one prompt run
        # alone, and a lone later sample's prompt rows share its context too.
        [node] = step.nodes
        assert (node.row_begin, node.row_end) == (0, step.rows)
    spans = {(node.chunk_begin, node.chunk_end) for step in steps for node in step.nodes}
    assert spans == {(0, 5), (0, 6)}
    for chunks in (5, 6):  # all four samples together under one node, for both prompts
        assert any(step.requests == 4 and step.nodes[0].chunk_end == chunks for step in steps)


def test_seeded_samples_do_not_depend_on_prefill_chunking(runs):
    """The parallel-sampling workload with its prompts prefilled 64 tokens a
    step: each partial step samples a token for the seeded requests that vLLM
    discards. Stock vLLM 0.32 on CPU died there ('CPU Generator does not use
    offset': it rewinds a CUDA generator's offset); patched (patches/0003), the
    generator's state is restored, so the samples are the ones drawn when the
    prompts are prefilled whole."""
    name = "float32-gqa-d64-block32-preempt"
    whole = runs(name, "stock", workload="parallel-sampling")
    chunked = runs(name, "chunk", workload="parallel-sampling-chunked")
    assert chunked["settings"]["max_num_batched_tokens"] == 64
    assert all(r["prompt_tokens"] > 64 for r in chunked["results"])  # every prompt took partial steps
    assert [r["tokens"] for r in chunked["results"]] == [r["tokens"] for r in whole["results"]]


# Per attention variant: the KV cache groups vLLM makes (one per kind of
# layer), and changes that take a feature away from the same model, each of
# which must change the outputs (else agreeing with stock would not show the
# feature works): config.json keys, or tensors of the weights set to a value.
# Each feature is taken away once (a run each: CI time), on the model that
# brings it first; BLOOM's ALiBi cannot be taken away from its implementation,
# and the kernel tests show its bias matters
# (test_tpp_decode_sinks_and_alibi_across_node_splits).
VARIANT_CHECKS = {
    "float32-window80-block32": dict(groups=2, without={"the window": {"sliding_window": None, "layer_types": None}}),
    "float32-gemma2-block32": dict(groups=2, without={"soft-capping": {"attn_logit_softcapping": None}}),
    "float32-gemma3-block32": dict(groups=2, without={}),
    "float32-mistral-block32": dict(groups=1, without={}),
    "float32-bloom-block32": dict(groups=1, without={}),
    # A sink of -1e4 takes no share of any softmax: the model without sinks.
    "float32-gptoss-block32": dict(groups=2, without={"the sinks": {"tensors": {"self_attn.sinks": -1e4}}}),
}


def _model_without(model_dir: str, out_dir, change: dict) -> str:
    """A copy of the model with `change` applied: config.json keys, and under
    "tensors", every weight whose name ends so set to one value."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    change = dict(change)
    tensors = change.pop("tensors", {})
    config = json.loads((out_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({**config, **change}))
    if tensors:
        weights = load_file(out_dir / "model.safetensors")
        for suffix, value in tensors.items():
            names = [n for n in weights if n.endswith(suffix)]
            assert names, f"no weight ends with {suffix}"
            for n in names:
                weights[n][...] = value
        save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return str(out_dir)


@pytest.mark.parametrize("name", list(VARIANT_CHECKS))
def test_attention_variants_match_stock(tmp_path_factory, name):
    """vLLM's own implementations of models whose attention goes beyond plain
    causal (testing/models.py ATTENTION_VARIANTS): sliding windows (an 80-token
    window interleaved with global layers, which vLLM puts in KV cache groups
    of their own, so two metadata builders, both sharing; or on every layer),
    logits soft-capping (Gemma 2), ALiBi (BLOOM) and attention sinks (gpt-oss).
    Identical tokens and logprobs within 1e-3 against stock; and each feature
    matters to these prompts: the same model without it gives other logprobs."""
    from vllm_chunkattn.testing.e2e_runs import VARIANT_CONFIGS, run_workload
    from vllm_chunkattn.testing.models import ATTENTION_VARIANTS, ensure_model

    model, *_, logprob_atol, near_tie = VARIANT_CONFIGS[name]
    checks = VARIANT_CHECKS[name]
    # The runs of a variant in parallel processes: each spends most of its time
    # starting an engine, which overlaps well even on two cores.
    jobs = {"stock": ("stock", ()), "chunk": ("chunk", ())}
    for feature, change in checks["without"].items():
        other_dir = _model_without(ensure_model(model), tmp_path_factory.mktemp("variant") / "model", change)
        jobs[feature] = ("chunk", ("--model", other_dir))
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {job: pool.submit(run_workload, tmp_path_factory, name, backend, extra_args=extra)
                   for job, (backend, extra) in jobs.items()}
        done = {job: future.result() for job, future in futures.items()}
    stock, chunk = done["stock"], done["chunk"]
    assert "Using CHUNK backend" in chunk["log"]
    report = compare_runs(stock, chunk, logprob_atol, near_tie)
    assert not report["problems"], "\n".join(report["problems"][:20])
    assert [r["tokens"] for r in stock["results"]] == [r["tokens"] for r in chunk["results"]]
    assert stock["chat"] == chunk["chat"]
    # Varied output: a model that repeats one token would hide most attention bugs.
    varied = [len(set(r["tokens"])) > 2 for r in chunk["results"]]
    assert sum(varied) >= len(varied) / 2, [r["tokens"] for r in chunk["results"]]
    if window := ATTENTION_VARIANTS[model].get("sliding_window"):
        assert max(r["prompt_tokens"] for r in chunk["results"]) > 4 * window
    summaries = chunk["decode_summaries"]
    assert len(summaries) == checks["groups"], chunk["log"][-3000:]  # one per KV cache group
    assert all(s.mean_nodes > 0 for s in summaries), summaries

    for feature in checks["without"]:
        assert compare_runs(chunk, done[feature], logprob_atol, near_tie)["problems"], f"{feature} changed nothing"
