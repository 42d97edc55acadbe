"""End to end: conversations continued from the PensieveConnector's host tier
give the tokens stock vLLM gives, under vLLM's attention backend and ours.

Four conversations take three turns each on a KV cache of 24 blocks of 32
tokens; each turn resends the conversation (150 tokens, then every answer
and a 40-token user message). By its next turn a conversation's history has
been evicted from vLLM's cache by the others', so what the connector supplies
is history the prefix cache no longer has. The host tier holds 32 blocks, fewer
than the conversations' 36, so it evicts too (the workload's engine settings)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e

CONFIG = "float32-gqa-d64-block32-preempt"  # tiny model, float32, blocks of 32, 24 blocks


@pytest.fixture(scope="module")
def baseline(runs):
    return runs(CONFIG, "stock", "conversations")


@pytest.mark.parametrize("backend, policy", [("stock", "pensieve"), ("chunk", "pensieve"), ("chunk", "lru")])
def test_conversations_continue_from_the_host_tier_with_stock_tokens(runs, baseline, backend, policy):
    run = runs(CONFIG, backend, "conversations", policy)
    assert "PensieveConnector: host tier of 32 blocks" in run["log"]
    assert f"blocks from the host tier ({policy}) to store" in run["log"]  # the tier was full at times
    # vLLM's own cache follows Pensieve's order under that policy and keeps its LRU under lru.
    assert ("cached blocks of vLLM's KV cache reordered (pensieve)" in run["log"]) == (policy == "pensieve")
    assert [r["group"] for r in run["results"]] == [r["group"] for r in baseline["results"]]
    for ours, stock in zip(run["results"], baseline["results"]):
        assert ours["tokens"] == stock["tokens"], ours["group"]
        worst = max(abs(a - b) for a, b in zip(ours["top1_logprobs"], stock["top1_logprobs"]))
        assert worst < 1e-3, (ours["group"], worst)
    loaded = [r["host_loaded_tokens"] for r in run["results"]]
    first_turns = loaded[:4]
    assert first_turns == [0, 0, 0, 0]  # nothing stored before a conversation's first turn
    # Later turns load their history (whole blocks of 32) from the host tier.
    later = loaded[4:]
    assert all(n % 32 == 0 for n in later) and sum(n > 0 for n in later) >= 4, loaded
    assert baseline["results"][0]["host_loaded_tokens"] is None  # no connector there


def test_the_small_cache_evicts_histories_between_turns(baseline):
    """Without the connector, a later turn's history is mostly not in vLLM's
    prefix cache any more (the premise of the test above)."""
    counters = baseline["counters"]
    later_prompt_tokens = sum(r["prompt_tokens"] for r in baseline["results"][4:])
    assert counters["vllm:prefix_cache_hits"] < 0.5 * later_prompt_tokens, counters


def _assert_stock_tokens(run, baseline):
    for ours, stock in zip(run["results"], baseline["results"], strict=True):
        assert ours["tokens"] == stock["tokens"], ours["group"]
        worst = max(abs(a - b) for a, b in zip(ours["top1_logprobs"], stock["top1_logprobs"]))
        assert worst < 1e-3, (ours["group"], worst)


def test_conversations_continue_from_disk_across_restarts_and_bad_blocks_are_recomputed(
        tmp_path_factory, baseline):
    """A host tier of 8 blocks, a quarter of what the conversations hold: their
    histories come back from the disk tier. A second server on the same
    directory starts with them; a third finds every block file corrupted,
    warns, and recomputes."""
    from vllm_chunkattn.testing.e2e_runs import run_workload

    disk = tmp_path_factory.mktemp("pensieve-disk")
    args = ("--pensieve-disk-dir", str(disk), "--pensieve-host-gib", str(8 * 64 / 2**20))

    first = run_workload(tmp_path_factory, CONFIG, "chunk", "conversations", "pensieve", args)
    assert "host tier of 8 blocks" in first["log"] and "0 blocks kept from earlier runs" in first["log"]
    _assert_stock_tokens(first, baseline)
    from_disk = [r["disk_loaded_tokens"] for r in first["results"]]
    assert from_disk[:4] == [0, 0, 0, 0] and sum(n > 0 for n in from_disk[4:]) >= 4, from_disk
    files = sorted(disk.rglob("*.kv"))
    assert len(files) == 36  # every full block of the four conversations, prompts and answers

    restarted = run_workload(tmp_path_factory, CONFIG, "chunk", "conversations", "pensieve", args)
    assert "36 blocks kept from earlier runs" in restarted["log"]
    _assert_stock_tokens(restarted, baseline)
    # The first turns' prompts (150 tokens: 4 whole blocks) come from the first server's disk tier.
    assert [r["disk_loaded_tokens"] for r in restarted["results"][:4]] == [128, 128, 128, 128]

    for path in files:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01  # one bit of each block's KV data
        path.write_bytes(bytes(data))
    damaged = run_workload(tmp_path_factory, CONFIG, "chunk", "conversations", "pensieve", args)
    assert "a block on disk is unusable" in damaged["log"] and "checksum mismatch" in damaged["log"]
    _assert_stock_tokens(damaged, baseline)
    assert [r["disk_loaded_tokens"] for r in damaged["results"][:4]] == [0, 0, 0, 0]


def test_a_pinned_prompt_is_computed_before_the_engine_serves_and_read_back_after_a_restart(
        tmp_path_factory, baseline):
    """The first conversation's opening prompt pinned: the engine computes it
    at start (vLLM patch 0006), so that conversation's first turn already finds
    its 4 whole blocks in the cache, where without the pin it finds nothing.
    A restarted server reads them back from its disk tier before it serves."""
    import json
    import random

    from vllm_chunkattn.testing.e2e_runs import run_workload
    from vllm_chunkattn.testing.workload import conversation_openings

    opening = conversation_openings(random.Random(0))[0]  # run_conversations' seed
    pinned = tmp_path_factory.mktemp("pinned") / "system.json"
    pinned.write_text(json.dumps(opening))
    args = ("--pensieve-pinned-prompt", str(pinned), "--pensieve-disk-dir", str(pinned.parent / "disk"))
    for loaded_from_disk in (0, 128):
        run = run_workload(tmp_path_factory, CONFIG, "chunk", "conversations", "pensieve", args)
        assert ("1 pinned prompts, 4 blocks, never evicted; computed, or read from disk, before the engine serves "
                f"({loaded_from_disk // 32} blocks being read from disk now)") in run["log"]
        assert (f"pinned prompt 0: 150 tokens, {loaded_from_disk} of them from the host tier ({loaded_from_disk} "
                "read from disk)") in run["log"]
        assert "KV connector: ran 1 startup requests (150 prompt tokens)" in run["log"]
        _assert_stock_tokens(run, baseline)
        assert run["results"][0]["cached_tokens"] == 128
        if not loaded_from_disk:  # the other conversations' openings were not pinned
            assert [r["cached_tokens"] for r in run["results"][1:4]] == [0, 0, 0]
    assert [r["cached_tokens"] for r in baseline["results"][:4]] == [0, 0, 0, 0]
