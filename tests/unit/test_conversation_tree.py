"""The cache tiers' block tree and its eviction policies (cache/conversation_tree.py):
no holes, trailing parts only, Pensieve's order, pins and blocks in use."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_chunkattn.cache.conversation_tree import (ConversationTree, LruPolicy, PensievePolicy, TrailingRun,
                                                    make_policy)


def chain(*blocks: str) -> list[bytes]:
    """Chain keys of a prompt given as block labels, as a tier computes them."""
    keys, parent = [], b""
    for label in blocks:
        parent = hashlib.sha256(parent + label.encode()).digest()
        keys.append(parent)
    return keys


def stored_prefix(tree: ConversationTree, keys: list[bytes]) -> list[bytes]:
    return keys[:tree.match(keys)]


def test_trailing_half_of_the_highest_score_goes_first():
    tree = ConversationTree(PensievePolicy())
    system = ["sys0", "sys1"]
    a = chain(*system, "a0", "a1", "a2", "a3")  # 4 own blocks, idle 10 s: score 40
    b = chain(*system, "b0", "b1")  # 2 own blocks, idle 30 s: score 60
    c = chain("c0", "c1", "c2", "c3", "c4", "c5")  # 6 own blocks, idle 5 s: score 30
    tree.insert(a, now=90.0)
    tree.insert(b, now=70.0)
    tree.insert(c, now=95.0)

    assert tree.evict(1, now=100.0) == [b[3]]  # half of b's 2 own blocks
    # Now b holds 1 own block (score 30) and a scores 40: a loses 2 of its 4.
    assert tree.evict(1, now=100.0) == [a[5], a[4]]
    assert tree.match(a) == 4 and tree.match(b) == 3 and tree.match(c) == 6


def test_a_shared_prefix_is_dropped_only_after_every_branch_on_it():
    tree = ConversationTree(PensievePolicy())
    a = chain("s", "a")
    b = chain("s", "b")
    tree.insert(a, now=0.0)
    tree.insert(b, now=1.0)
    runs = {r.leaf.key: r.length for r in tree.trailing_runs(now=2.0)}
    assert runs == {a[1]: 1, b[1]: 1}  # the shared block counts for neither
    assert tree.evict(2, now=2.0) == [a[1], b[1]]
    assert tree.evict(1, now=2.0) == [a[0]]
    assert len(tree) == 0


def test_lru_drops_the_least_recently_used_leaf_block():
    tree = ConversationTree(LruPolicy())
    a, b = chain("a0", "a1"), chain("b0", "b1")
    tree.insert(a, now=1.0)
    tree.insert(b, now=2.0)
    tree.touch(a, now=3.0)
    assert tree.evict(3, now=4.0) == [b[1], b[0], a[1]]


def test_pinned_and_in_use_blocks_stay():
    tree = ConversationTree(PensievePolicy())
    system, a, b = chain("sys"), chain("sys", "a"), chain("b0", "b1")
    tree.insert(a, now=0.0)
    tree.insert(b, now=0.0)
    tree.pin(system)
    tree.acquire(b[1:])
    assert tree.evict(10, now=1.0) == [a[1]]
    assert tree.match(system) == 1 and tree.match(b) == 2
    tree.release(b[1:])
    assert tree.evict(10, now=1.0) == [b[1], b[0]]
    assert list(tree.keys()) == system
    with pytest.raises(RuntimeError):
        tree.release(system)


def test_a_client_that_rewrites_its_history_leaves_a_stale_branch_evicted_first():
    tree = ConversationTree(PensievePolicy())
    old = chain("t0", "old1", "old2")
    other = chain("x0", "x1", "x2", "x3")
    tree.insert(old, now=0.0)
    tree.touch(old, now=0.0, conversation="chat-1")
    tree.insert(other, now=0.0)
    new = chain("t0", "new1")
    tree.insert(new, now=5.0)
    tree.touch(new, now=5.0, conversation="chat-1")
    # `other` has twice the own blocks and was idle as long, but chat-1's old branch is stale.
    assert tree.evict(2, now=10.0) == [old[2], old[1]]
    assert tree.match(new) == 2


def test_removing_a_bad_block_removes_what_depends_on_it():
    tree = ConversationTree(LruPolicy())
    a, b = chain("s", "a0", "a1"), chain("s", "b0")
    tree.insert(a, now=0.0)
    tree.insert(b, now=0.0)
    assert sorted(tree.remove(a[1])) == sorted(a[1:])
    assert tree.match(a) == 1 and tree.match(b) == 2


def test_unknown_policy_names_the_supported_ones():
    with pytest.raises(ValueError, match="pensieve, lru"):
        make_policy("fifo")


# ---------------------------------------------------------------------------
# Properties over random conversations, turns, pins, copies and evictions.

LABELS = st.sampled_from(["p", "q", "r"])  # few labels: prompts share prefixes
PROMPTS = st.lists(LABELS, min_size=1, max_size=6)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), PROMPTS),
        st.tuples(st.just("touch"), PROMPTS),
        st.tuples(st.just("pin"), PROMPTS),
        st.tuples(st.just("acquire"), PROMPTS),
        st.tuples(st.just("evict"), st.integers(1, 5)),
    ),
    min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(ops=OPS, policy=st.sampled_from(["pensieve", "lru"]))
def test_evictions_are_trailing_runs_and_respect_pins_and_copies(ops, policy):
    tree = ConversationTree(make_policy(policy))
    pinned: set[bytes] = set()
    in_use: set[bytes] = set()
    for step, (op, arg) in enumerate(ops):
        now = float(step)
        if op == "evict":
            before = set(tree.keys())
            runs = tree.trailing_runs(now)
            evicted = tree.evict(arg, now)
            assert len(set(evicted)) == len(evicted) and set(evicted) <= before
            assert not set(evicted) & (pinned | in_use)
            if runs and policy == "pensieve":
                best = max(PensievePolicy.score(r) for r in runs)
                assert PensievePolicy.score(next(r for r in runs if r.leaf.key == evicted[0])) == best
            # Fewer than asked only when nothing else can go.
            if len(evicted) < arg:
                assert not tree.trailing_runs(now)
        keys = chain(*arg) if op != "evict" else []
        if op == "insert":
            added = tree.insert(keys, now)
            assert added == keys[len(keys) - len(added):]
        elif op == "touch":
            tree.touch(keys, now, conversation=arg[0])
        elif op == "pin":
            tree.pin(keys)
            pinned |= set(stored_prefix(tree, keys))
        elif op == "acquire":
            held = stored_prefix(tree, keys)
            tree.acquire(held)
            in_use |= set(held)
        # No holes: every stored block's parent is stored (so evictions took trailing blocks only).
        for key in tree.keys():
            node = tree._nodes[key]
            assert node.parent is tree.root or node.parent.key in tree
        assert (pinned | in_use) <= set(tree.keys())


@given(st.lists(st.tuples(st.integers(1, 8), st.floats(0, 100)), min_size=1, max_size=8))
def test_pensieve_drops_half_of_the_highest_scoring_run(shape):
    tree = ConversationTree(PensievePolicy())
    runs = [TrailingRun(tree.root, length, idle) for length, idle in shape]
    victim = PensievePolicy().choose(runs)
    assert victim.run.length * victim.run.idle_s == max(length * idle for length, idle in shape)
    assert victim.num_blocks == (victim.run.length + 1) // 2
