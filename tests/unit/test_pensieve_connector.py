"""The PensieveConnector's parts that run without an engine: its options, the
chain keys, and the worker's copies between vLLM's KV cache and host rows."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from vllm_chunkattn.cache.block_store import BlockLayout
from vllm_chunkattn.cache.connector import (BlockCopy, PensieveConfig, PensieveMetadata, _Scheduler, _Worker,
                                            chain_keys, pinned_prompt_requests, pinned_prompt_tokens)


def test_options_are_validated_with_what_is_supported(tmp_path):
    assert PensieveConfig.from_extra_config({}) == PensieveConfig()
    assert PensieveConfig.from_extra_config({"host_cache_gib": 0.5, "eviction_policy": "lru"}).host_blocks(1 << 20) == 512
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys \\['disk'\\]"):
        PensieveConfig.from_extra_config({"disk": "/tmp"})
    with pytest.raises(ValueError, match="disk_cache_dir .* is not writable"):
        PensieveConfig.from_extra_config({"disk_cache_dir": "/proc"})
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot create disk_cache_dir"):
        PensieveConfig.from_extra_config({"disk_cache_dir": str(tmp_path / "file" / "kv")})
    assert PensieveConfig.from_extra_config({"disk_cache_dir": str(tmp_path / "kv")}).disk_cache_dir
    assert (tmp_path / "kv").is_dir()
    with pytest.raises(ValueError, match="disk_cache_gib must be a positive"):
        PensieveConfig.from_extra_config({"disk_cache_gib": -1})
    with pytest.raises(ValueError, match="eviction_policy must be one of \\['lru', 'pensieve'\\]"):
        PensieveConfig.from_extra_config({"eviction_policy": "fifo"})
    with pytest.raises(ValueError, match="positive number of GiB"):
        PensieveConfig.from_extra_config({"host_cache_gib": 0})


def test_chain_keys_name_whole_prefixes_and_extend_incrementally():
    tokens = list(range(100, 200))
    keys = chain_keys(tokens, 16)
    assert len(keys) == 6  # full blocks only
    assert chain_keys(tokens[:40], 16) == keys[:2]
    assert chain_keys(tokens, 16, start=2, parent=keys[1]) == keys[2:]
    other = chain_keys([7] + tokens[1:], 16)
    assert all(a != b for a, b in zip(keys, other))  # a different first token changes every later key


def _worker(num_blocks=6, host_gib=1e-3, disk_dir=None):
    g = torch.Generator().manual_seed(0)
    # Two layers of different dtypes and shapes, blocks first, as vLLM hands them over.
    caches = {"layer0": torch.randn(num_blocks, 2, 4, 16, generator=g),
              "layer1": torch.randn(num_blocks, 4, 8, generator=g).to(torch.bfloat16)}
    layout = BlockLayout("m", 4, (("float32", (2 * 4 * 16,)), ("bfloat16", (4 * 8,))), "test")
    worker = _Worker(PensieveConfig(host_cache_gib=host_gib, disk_cache_dir=disk_dir), layout, list(caches))
    worker.register_kv_caches(caches, num_blocks)
    return worker, caches


@pytest.mark.parametrize("copies", ["copier thread", "in the forward pass"])
def test_blocks_go_to_host_rows_and_come_back_into_other_blocks(copies):
    worker, caches = _worker()
    if copies == "in the forward pass":  # what an accelerator's KV cache takes (torch's copies), run on CPU here
        worker.copier.close()
        worker.copier = None
    original = {name: kv.clone() for name, kv in caches.items()}
    worker.meta = PensieveMetadata(stores=[BlockCopy(b"a", 1), BlockCopy(b"b", 4)], finished_after_store=["r1"])
    worker.run_step()
    assert worker.get_finished({"r0"}) is None and worker.get_finished({"r1"}) == {"r1"}
    # Evict a, store c from block 2, load b into block 0 and c into block 5, in one step.
    worker.meta = PensieveMetadata(evictions=[b"a"], stores=[BlockCopy(b"c", 2)],
                                   loads=[BlockCopy(b"b", 0), BlockCopy(b"c", 5)])
    worker.run_step()
    for name, kv in caches.items():
        assert torch.equal(kv[0], original[name][4]) and torch.equal(kv[5], original[name][2])
        assert torch.equal(kv[1:5], original[name][1:5])
    assert b"a" not in worker.store and len(worker.store) == 2
    # The copies are counted against the forward steps they sit in (no step was bound here).
    times = worker.times
    assert (times.stored_blocks, times.loaded_blocks, times.steps) == (3, 2, 0)
    worker.step_started()
    worker.step_finished()
    worker.step_finished()  # vLLM's deferred finalize may call it twice: one step
    assert times.steps == 1 and "host-tier copies took" in times.summary()


def _loading_a_stored_block(copy_hook):
    """A worker that stored block 1 as key a, then began a step that loads a into
    block 3, its copier copying each layer through copy_hook(layer, copies, copy_layer)."""
    worker, caches = _worker()
    original = {name: kv.clone() for name, kv in caches.items()}
    worker.meta = PensieveMetadata(stores=[BlockCopy(b"a", 1)])
    worker.run_step()
    copy_layer = worker._copy_layer
    worker.copier._copy_layer = lambda layer, copies: copy_hook(layer, copies, copy_layer)
    worker.meta = PensieveMetadata(loads=[BlockCopy(b"a", 3)])
    worker.start_step()  # as vLLM binds a step's metadata, before the forward pass
    return worker, caches, original


def test_a_layers_loads_arrive_before_its_attention_while_later_layers_still_copy():
    gate = threading.Event()

    def layer1_held_back(layer, copies, copy_layer):
        if layer == 1:
            assert gate.wait(30)
        copy_layer(layer, copies)

    worker, caches, original = _loading_a_stored_block(layer1_held_back)
    worker.wait_for_layer("layer0")  # layer 0's attention
    assert torch.equal(caches["layer0"][3], original["layer0"][1])
    assert torch.equal(caches["layer1"][3], original["layer1"][3])  # not yet copied: the forward pass goes on
    gate.set()
    worker.wait_for_layer("layer1")
    assert torch.equal(caches["layer1"][3], original["layer1"][1])
    worker.finish_step()
    assert worker.times.loaded_blocks == 1 and worker.times.waited_s > 0


def _copier_holding_layer_0():
    """_loading_a_stored_block with the copier thread held in its first layer, layer 0, until `gate` is
    set; copied_by: the thread that copied each layer."""
    gate, holding = threading.Event(), threading.Event()
    copied_by = {}

    def copier_stuck(layer, copies, copy_layer):
        copied_by[layer] = threading.current_thread().name
        if threading.current_thread().name == "pensieve-copies":
            holding.set()
            assert gate.wait(30)
        copy_layer(layer, copies)

    worker, caches, original = _loading_a_stored_block(copier_stuck)
    assert holding.wait(30)
    return worker, caches, original, gate, copied_by


def test_a_layer_the_copier_has_not_begun_is_copied_by_the_forward_pass_that_needs_it():
    worker, caches, original, gate, copied_by = _copier_holding_layer_0()
    worker.wait_for_layer("layer1")  # the copier is stuck on layer 0: this thread copies layer 1 itself
    assert torch.equal(caches["layer1"][3], original["layer1"][1])
    assert copied_by[1] == threading.current_thread().name
    gate.set()
    worker.finish_step()
    assert torch.equal(caches["layer0"][3], original["layer0"][1])


@pytest.mark.parametrize("waiter", ["the step's end", "a layer the layout does not name"])
def test_the_step_ends_only_when_every_layer_is_copied_whoever_copies_it(waiter):
    worker, caches, original, gate, _ = _copier_holding_layer_0()
    # The waiting thread copies layer 1, and must still wait for the copier's layer 0.
    finishing = threading.Thread(target=worker.finish_step if waiter == "the step's end" else
                                 lambda: worker.wait_for_layer("draft.layers.0.attn"))
    finishing.start()
    finishing.join(0.5)
    assert finishing.is_alive()
    gate.set()
    finishing.join(30)
    for name in caches:
        assert torch.equal(caches[name][3], original[name][1])


def test_a_failed_copy_fails_the_forward_pass_instead_of_running_on_kv_that_did_not_arrive():
    def broken(layer, copies, copy_layer):
        raise OSError("simulated")

    worker, _, _ = _loading_a_stored_block(broken)
    with pytest.raises(RuntimeError, match="host-tier copy failed"):
        worker.wait_for_layer("layer1")


def test_a_cache_whose_blocks_are_not_the_first_dimension_is_refused():
    worker, _ = _worker()
    with pytest.raises(ValueError, match="blocks must be its first dimension"):
        worker.register_kv_caches({"layer0": torch.zeros(2, 6, 4, 16), "layer1": torch.zeros(6, 4, 8)}, 6)


# ---------------------------------------------------------------------------
# The scheduler half, driven as vLLM's scheduler drives it.

BLOCK = 16


def _scheduler(capacity_blocks: int, policy: str = "pensieve") -> _Scheduler:
    page = 1024
    kv_cache_config = types.SimpleNamespace(kv_cache_groups=[
        types.SimpleNamespace(kv_cache_spec=types.SimpleNamespace(page_size_bytes=page), layer_names=["l0", "l1"])])
    vllm_config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=BLOCK))
    config = PensieveConfig(host_cache_gib=capacity_blocks * 2 * page / (1 << 30), eviction_policy=policy)
    return _Scheduler(vllm_config, kv_cache_config, config)


def _request(request_id: str, tokens: list[int], conversation: str | None = None):
    return types.SimpleNamespace(request_id=request_id, all_token_ids=list(tokens), num_tokens=len(tokens),
                                 num_computed_tokens=0, mm_features=[], lora_request=None, cache_salt=None,
                                 kv_transfer_params={"conversation_id": conversation} if conversation else None,
                                 session_id=None)


def _step(scheduler: _Scheduler, scheduled: dict, block_ids: dict[str, list[int]]) -> PensieveMetadata:
    output = types.SimpleNamespace(
        num_scheduled_tokens={r.request_id: 1 for r in scheduled.values()}, preempted_req_ids=set(),
        kv_connector_block_state=types.SimpleNamespace(get_block_ids=lambda rid: (block_ids[rid],)))
    return scheduler.build_connector_meta(output, scheduled)


def test_a_conversations_blocks_are_stored_as_computed_and_loaded_by_its_next_turn():
    scheduler = _scheduler(capacity_blocks=64)
    turn1 = _request("a", range(1000, 1100))  # 6 full blocks and 4 tokens
    scheduler.on_new_request(turn1)
    assert scheduler.get_num_new_matched_tokens(turn1, 0) == (0, False)
    ids_a = list(range(10, 20))
    assert _step(scheduler, {"a": turn1}, {"a": ids_a}).stores == []  # nothing computed before this step
    turn1.num_computed_tokens = 100
    meta = _step(scheduler, {"a": turn1}, {"a": ids_a})
    assert [c.block_id for c in meta.stores] == ids_a[:6]
    # The answer: 29 more tokens computed; at the finish blocks 6 and 7 are full, and stored before the free.
    turn1.all_token_ids += list(range(2000, 2030))
    turn1.num_computed_tokens = 129
    delay, params = scheduler.request_finished(turn1, ids_a[:9])
    assert delay and params == {"pensieve": {"host_loaded_tokens": 0, "disk_loaded_tokens": 0}}
    meta = _step(scheduler, {}, {})
    assert [c.block_id for c in meta.stores] == ids_a[6:8] and meta.finished_after_store == ["a"]

    # Next turn: the history plus a new message; vLLM's own cache still has the first 2 blocks.
    turn2 = _request("b", turn1.all_token_ids + list(range(3000, 3020)))
    scheduler.on_new_request(turn2)
    assert scheduler.get_num_new_matched_tokens(turn2, 2 * BLOCK) == (6 * BLOCK, False)
    ids_b = list(range(30, 40))
    scheduler.update_state_after_alloc(turn2, types.SimpleNamespace(get_block_ids=lambda: (ids_b,)), 6 * BLOCK)
    meta = _step(scheduler, {"b": turn2}, {"b": ids_b})
    history = chain_keys(turn1.all_token_ids, BLOCK)
    assert [(c.key, c.block_id) for c in meta.loads] == list(zip(history[2:8], ids_b[2:8]))
    assert meta.stores == [] and meta.evictions == []


def test_the_last_prompt_token_is_always_computed():
    scheduler = _scheduler(capacity_blocks=64)
    first = _request("a", range(1000, 1064))  # exactly 4 blocks
    scheduler.on_new_request(first)
    first.num_computed_tokens = 64
    _step(scheduler, {"a": first}, {"a": [1, 2, 3, 4]})
    again = _request("b", range(1000, 1064))
    assert scheduler.get_num_new_matched_tokens(again, 0) == (3 * BLOCK, False)


def test_a_full_tier_evicts_another_conversations_tail_never_the_one_it_stores():
    scheduler = _scheduler(capacity_blocks=8)
    old = _request("old", range(1000, 1096))  # 6 blocks
    scheduler.on_new_request(old)
    old.num_computed_tokens = 96
    _step(scheduler, {"old": old}, {"old": list(range(6))})
    assert scheduler.request_finished(old, list(range(6)))[0] is False  # everything already stored
    new = _request("new", range(5000, 5080))  # 5 blocks: 3 must go
    scheduler.on_new_request(new)
    new.num_computed_tokens = 80
    meta = _step(scheduler, {"new": new}, {"new": list(range(10, 15))})
    old_keys = chain_keys(old.all_token_ids, BLOCK)
    assert meta.evictions == old_keys[:2:-1]  # Pensieve: half of old's 6 own blocks, its last three
    assert len(meta.stores) == 5 and len(scheduler.host.tree) == 8


# ---------------------------------------------------------------------------
# The disk tier: the scheduler and the worker together, as the engine runs them.

PAGE_FLOATS = 256  # one layer's page: 1024 bytes, as _scheduler's KV cache config says
DISK_LAYOUT = BlockLayout("m", BLOCK, (("float32", (PAGE_FLOATS,)), ("float32", (PAGE_FLOATS,))), "test")


class _Engine:
    """A scheduler half and a worker half over one disk directory, stepped like vLLM's engine."""

    def __init__(self, disk_dir, host_blocks=64, disk_blocks=64, num_blocks=32, seed=0, pinned=()):
        page = PAGE_FLOATS * 4
        config = PensieveConfig(host_cache_gib=host_blocks * 2 * page / (1 << 30), disk_cache_dir=str(disk_dir),
                                disk_cache_gib=disk_blocks * 2 * page / (1 << 30))
        kv_cache_config = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(
            kv_cache_spec=types.SimpleNamespace(page_size_bytes=page), layer_names=["l0", "l1"])])
        vllm_config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=BLOCK))
        self.scheduler = _Scheduler(vllm_config, kv_cache_config, config, DISK_LAYOUT, pinned)
        self.worker = _Worker(config, DISK_LAYOUT, ["l0", "l1"])
        g = torch.Generator().manual_seed(seed)
        self.caches = {name: torch.randn(num_blocks, PAGE_FLOATS, generator=g) for name in ("l0", "l1")}
        self.worker.register_kv_caches(self.caches, num_blocks)

    def step(self, scheduled: dict, block_ids: dict[str, list[int]]) -> PensieveMetadata:
        meta = _step(self.scheduler, scheduled, block_ids)
        self.worker.meta = meta
        self.worker.run_step()
        self.worker.disk.flush()  # the engine goes on instead; a test wants the thread's results now
        done = self.worker.finished_disk_work()
        if done is not None:
            self.scheduler.update_connector_output(done)
        return meta

    def block(self, block_id: int) -> list[torch.Tensor]:
        return [kv[block_id].clone() for kv in self.caches.values()]

    def compute(self, request, block_ids: list[int]) -> None:
        """The request's prompt computed in one step, its blocks stored the step after."""
        self.scheduler.on_new_request(request)
        request.num_computed_tokens = request.num_tokens
        self.step({request.request_id: request}, {request.request_id: block_ids})
        assert self.scheduler.request_finished(request, block_ids)[0] is False  # all full blocks stored

    def admit(self, request, block_ids: list[int]) -> int:
        """vLLM's admission: ask until the connector knows, allocate, step. Returns the tokens loaded."""
        self.scheduler.on_new_request(request)
        for _ in range(3):
            tokens, asynchronous = self.scheduler.get_num_new_matched_tokens(request, 0)
            assert asynchronous is False
            if tokens is not None:
                break
            self.step({}, {})  # the disk reads run while other requests would
        self.scheduler.update_state_after_alloc(request, types.SimpleNamespace(get_block_ids=lambda: (block_ids,)),
                                                tokens)
        self.step({request.request_id: request}, {request.request_id: block_ids})
        return tokens


def test_conversations_on_disk_survive_a_restart_and_load_once_for_two_requests(tmp_path):
    first = _Engine(tmp_path)
    turn1 = _request("a", range(1000, 1100))  # 6 full blocks
    first.compute(turn1, list(range(10, 17)))
    written = [first.block(b) for b in range(10, 16)]
    assert len(list(first.worker.disk.store.directory.glob("*.kv"))) == 6
    first.worker.shutdown()

    second = _Engine(tmp_path, seed=1)  # a restarted server: new KV cache contents, empty host tier
    assert len(second.scheduler.disk.tree) == 6 and len(second.scheduler.host.tree) == 0
    turn2 = _request("b", list(turn1.all_token_ids) + list(range(3000, 3020)))
    same_history = _request("c", list(turn1.all_token_ids) + list(range(4000, 4030)))
    second.scheduler.on_new_request(turn2)
    assert second.scheduler.get_num_new_matched_tokens(turn2, 0) == (None, False)  # reading from disk
    second.scheduler.on_new_request(same_history)
    meta = second.step({}, {})
    assert meta.promotions == [chain_keys(turn1.all_token_ids, BLOCK)]  # one read for both requests
    assert second.scheduler.get_num_new_matched_tokens(same_history, 0) == (6 * BLOCK, False)
    assert second.admit(turn2, list(range(20, 28))) == 6 * BLOCK
    for b in range(6):
        assert all(torch.equal(x, y) for x, y in zip(second.block(20 + b), written[b]))
    _, params = second.scheduler.request_finished(turn2, list(range(20, 28)))
    assert params == {"pensieve": {"host_loaded_tokens": 96, "disk_loaded_tokens": 96}}


def _server_that_stopped(tmp_path):
    """An engine that computed one 6-block conversation (KV blocks 10..15) into its disk tier, then stopped."""
    first = _Engine(tmp_path)
    turn1 = _request("a", range(1000, 1100))
    first.compute(turn1, list(range(10, 17)))
    first.worker.shutdown()
    return first, turn1, chain_keys(turn1.all_token_ids, BLOCK)


def test_a_corrupted_block_on_disk_is_recomputed_with_everything_after_it(tmp_path):
    first, turn1, keys = _server_that_stopped(tmp_path)
    path = first.worker.disk.store.path(keys[3])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit of KV data
    path.write_bytes(bytes(data))

    second = _Engine(tmp_path, seed=1)
    turn2 = _request("b", list(turn1.all_token_ids) + list(range(3000, 3020)))
    assert second.admit(turn2, list(range(20, 28))) == 3 * BLOCK  # blocks 0..2 only: 3 on is recomputed
    assert second.block(20)[0].equal(first.block(10)[0])
    assert set(second.scheduler.host.tree.keys()) == set(keys[:3])
    assert set(second.scheduler.disk.tree.keys()) == set(keys[:3])
    assert keys[3] not in second.worker.store and keys[4] not in second.worker.store
    second.step({}, {})  # the drops run
    assert sorted(p.name for p in second.worker.disk.store.directory.glob("*.kv")) == \
        sorted(f"{k.hex()}.kv" for k in keys[:3])


def test_the_disk_index_drops_unreachable_blocks_and_what_exceeds_its_size_at_start(tmp_path):
    first, _, keys = _server_that_stopped(tmp_path)
    first.worker.disk.store.path(keys[1]).unlink()  # blocks 2..5 lose their parent
    second = _Engine(tmp_path, disk_blocks=4)
    assert set(second.scheduler.disk.tree.keys()) == {keys[0]}
    assert [p.name for p in second.worker.disk.store.directory.glob("*.kv")] == [f"{keys[0].hex()}.kv"]

    # A full disk tier evicts another conversation's trailing blocks, as the host tier does.
    b = _request("b", range(5000, 5080))  # 5 blocks into a tier of 4 holding a's first block
    second.compute(b, list(range(20, 25)))
    second.step({}, {})
    assert len(second.scheduler.disk.tree) == 4 and keys[0] not in second.scheduler.disk.tree
    assert len(list(second.worker.disk.store.directory.glob("*.kv"))) == 4


def test_pinned_prompts_are_never_evicted_and_come_back_from_disk_at_start(tmp_path):
    system = list(range(1000, 1050))  # 50 tokens: the 3 whole blocks before its last token are pinned
    pinned_keys = chain_keys(system[:-1], BLOCK)
    first = _Engine(tmp_path, host_blocks=8, pinned=[system])
    a = _request("a", system + list(range(2000, 2050)))  # 6 blocks, the first 3 the pinned prompt's
    first.compute(a, list(range(10, 17)))
    b = _request("b", range(5000, 5096))  # 6 blocks of another conversation into a tier of 8
    first.compute(b, list(range(20, 27)))
    first.step({}, {})
    host = set(first.scheduler.host.tree.keys())
    assert set(pinned_keys) <= host and len(host) == 8  # a lost its unpinned tail, never the prompt
    first.worker.shutdown()

    restarted = _Engine(tmp_path, host_blocks=8, pinned=[system], seed=1)
    assert restarted.scheduler.pending.promotions == [pinned_keys]  # read before the first request
    restarted.step({}, {})
    assert set(restarted.scheduler.host.tree.keys()) == set(pinned_keys) and not restarted.scheduler.promoting
    c = _request("c", system + list(range(7000, 7030)))
    assert restarted.admit(c, list(range(0, 5))) == 3 * BLOCK
    assert all(torch.equal(x, y) for x, y in zip(restarted.block(2), first.block(12)))

    with pytest.raises(ValueError, match="pinned prompts take 3 blocks, the host tier holds 3"):
        _Engine(tmp_path / "other", host_blocks=3, pinned=[system])


def test_pinned_prompt_files(tmp_path):
    ids = tmp_path / "system.json"
    ids.write_text("[1, 5, 9]")
    text = tmp_path / "system.txt"
    text.write_text("You are a helpful assistant.")
    no_tokenizer = types.SimpleNamespace(skip_tokenizer_init=True, max_model_len=4, get_vocab_size=lambda: 10)
    assert pinned_prompt_tokens((str(ids),), no_tokenizer) == [[1, 5, 9]]
    with pytest.raises(ValueError, match="has no tokenizer"):
        pinned_prompt_tokens((str(text),), no_tokenizer)
    # Refused at start with the reason: the engine computes them before it serves, and one it could not would kill it.
    for content, reason in [("[1, -5]", "must be a JSON list of token ids"), ("[]", "is empty"),
                            ("[1, 2, 3, 4]", "has 4 tokens; the model takes fewer than max_model_len=4"),
                            ("[1, 10]", "holds token id 10; the model's vocabulary has 10")]:
        ids.write_text(content)
        with pytest.raises(ValueError, match=reason.replace("[", "\\[")):
            pinned_prompt_tokens((str(ids),), no_tokenizer)
    with pytest.raises(ValueError, match="pinned prompt file .*missing.txt does not exist"):
        PensieveConfig.from_extra_config({"pinned_prompts": [str(tmp_path / "missing.txt")]})
    assert PensieveConfig.from_extra_config({"pinned_prompts": [str(text)]}).pinned_prompts == (str(text),)


def test_a_cache_reset_empties_the_host_tier_but_for_pinned_prompts(tmp_path):
    system = list(range(1000, 1050))
    engine = _Engine(tmp_path, pinned=[system])
    a = _request("a", system + list(range(2000, 2050)))
    engine.compute(a, list(range(10, 17)))
    b = _request("b", system + list(range(3000, 3050)))
    engine.scheduler.on_new_request(b)
    engine.scheduler.promoting.add(b"in flight")  # stands for a copy under way: its block stays
    engine.scheduler.host.tree.insert([b"in flight"], 0.0)
    engine.scheduler.host.tree.acquire([b"in flight"])
    assert engine.scheduler.reset_cache() is False
    engine.scheduler.host.tree.release([b"in flight"])
    assert engine.scheduler.reset_cache() is True
    assert set(engine.scheduler.host.tree.keys()) == set(chain_keys(system[:-1], BLOCK))
    engine.step({}, {})
    assert len(engine.worker.store) == 3 and len(engine.scheduler.disk.tree) == 6  # the disk tier stays


def test_pinned_prompts_become_startup_requests_of_one_greedy_token(tmp_path):
    system, short = list(range(1000, 1050)), list(range(7, 7 + BLOCK))  # short: no whole block before its last token
    engine = _Engine(tmp_path, pinned=[system, short])
    assert engine.scheduler.pinned_prompts == [system]  # the short one pins nothing: not computed either
    (request,) = pinned_prompt_requests(engine.scheduler.pinned_prompts)
    assert request.prompt_token_ids == system and request.request_id == "pensieve-pinned-prompt-0"
    assert request.sampling_params.max_tokens == 1 and request.sampling_params.temperature == 0.0
    assert request.mm_features is None and request.lora_request is None and request.cache_salt is None
