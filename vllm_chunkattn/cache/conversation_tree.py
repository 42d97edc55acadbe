"""Which KV blocks a cache tier keeps for which conversations, and which it drops first.

A tier stores KV blocks under chain keys: a block's key hashes its tokens
together with the key of the block before it, so a key names a whole prefix.
The stored blocks therefore form a tree: a block's parent is the block before
it, the root is the empty prefix, and a conversation is a path from the root
to a leaf. A new turn resends the conversation and extends its path; requests
that share a system prompt share the path's first blocks.

Invariants the tree keeps, whatever the eviction policy:

- no holes: a block is stored only while its parent is, so what a tier holds
  of any prompt is a prefix of it (a block after a hole could never be used:
  a prompt is matched block by block from the start);
- eviction removes leaves, so a conversation always loses its trailing part,
  which is then recomputed in the same prefill as the new turn's prompt;
- pinned blocks (prompts an operator keeps resident) and blocks in use (being
  copied into or out of the tier) are never evicted.

Which leaf loses how many blocks is the policy's choice (``EvictionPolicy``):

- ``PensievePolicy`` (the Pensieve paper, section 4.3): score each
  conversation by the blocks it alone holds times how long it has been idle,
  and drop the trailing half of the highest-scoring one, repeatedly. Only the
  blocks a conversation alone holds count: dropping a shared system prompt
  would free nothing for the conversations still using it.
- ``LruPolicy``: the least recently used leaf block first, one at a time, as
  vLLM's own prefix cache evicts (for comparison).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterator, Sequence

BlockKey = bytes

_STALE = -math.inf  # last_access of a conversation its client has moved away from


@dataclasses.dataclass(eq=False)
class Node:
    """One stored block (or the root, key None)."""

    key: BlockKey | None
    parent: Node | None
    last_access: float
    children: dict[BlockKey, Node] = dataclasses.field(default_factory=dict)
    pinned: bool = False
    in_use: int = 0  # copies in flight that read or write this block

    def evictable(self) -> bool:
        return self.key is not None and not self.pinned and self.in_use == 0

    def path_keys(self) -> list[BlockKey]:
        keys = []
        node: Node | None = self
        while node is not None and node.key is not None:
            keys.append(node.key)
            node = node.parent
        return keys[::-1]


@dataclasses.dataclass(frozen=True)
class TrailingRun:
    """A leaf and the blocks above it that only its conversation holds:
    what evicting from this conversation can free."""

    leaf: Node  # (primary_order.py passes its FinishedRun: policies only read length and idle_s)
    length: int  # blocks, leaf included
    idle_s: float  # since the conversation was last used


@dataclasses.dataclass(frozen=True)
class Victim:
    run: TrailingRun
    num_blocks: int  # trailing blocks of the run to drop, 1 .. run.length


class EvictionPolicy(abc.ABC):
    """Chooses the next blocks a tier drops. Only trailing runs are offered, so
    whatever a policy picks keeps the tree free of holes."""

    name: str

    @abc.abstractmethod
    def choose(self, runs: Sequence[TrailingRun]) -> Victim:
        """The next victim among `runs` (never empty)."""


class PensievePolicy(EvictionPolicy):
    """Pensieve's cost: blocks held alone x idle time; the trailing half goes."""

    name = "pensieve"

    @staticmethod
    def score(run: TrailingRun) -> float:
        return run.length * run.idle_s

    def choose(self, runs: Sequence[TrailingRun]) -> Victim:
        # Ties (a conversation used this instant scores 0) go to the longer idle.
        run = max(runs, key=lambda r: (self.score(r), r.idle_s, r.length))
        return Victim(run, (run.length + 1) // 2)


class LruPolicy(EvictionPolicy):
    """The least recently used leaf block."""

    name = "lru"

    def choose(self, runs: Sequence[TrailingRun]) -> Victim:
        return Victim(max(runs, key=lambda r: r.idle_s), 1)


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (PensievePolicy, LruPolicy)}


def make_policy(name: str) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; supported: {', '.join(POLICIES)}")
    return POLICIES[name]()


class ConversationTree:
    """The blocks one tier holds, as a tree of chain keys (see the module doc)."""

    def __init__(self, policy: EvictionPolicy):
        self.policy = policy
        self.root = Node(None, None, 0.0)
        self._nodes: dict[BlockKey, Node] = {}
        self._latest_of: dict[str, Node] = {}  # conversation id -> the node its last turn ended at

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._nodes

    def keys(self) -> Iterator[BlockKey]:
        return iter(self._nodes)

    def match(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of `keys` are stored."""
        return len(self._path(keys))

    def _path(self, keys: Sequence[BlockKey]) -> list[Node]:
        """The stored nodes of `keys`' matched prefix."""
        path, node = [], self.root
        for key in keys:
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        return path

    def touch(self, keys: Sequence[BlockKey], now: float, conversation: str | None = None) -> None:
        """A request used the stored prefix of `keys` at `now`.

        With a client's conversation id: if that conversation's previous turn
        ended on a branch this prompt does not continue (the client edited its
        history), the old branch is marked stale, to be evicted first."""
        path = self._path(keys)
        for node in path:
            node.last_access = max(node.last_access, now)
        if conversation is None:
            return
        previous = self._latest_of.pop(conversation, None)
        on_path = {id(node) for node in path}
        node = previous
        # Up the old branch to where it meets this prompt's path or another
        # conversation's blocks, which keep their own times.
        while node is not None and node.key in self._nodes and id(node) not in on_path and len(node.children) <= 1:
            node.last_access = _STALE
            node = node.parent
        if path:
            self._latest_of[conversation] = path[-1]

    def touch_blocks(self, keys: Sequence[BlockKey], now: float) -> None:
        """Requests used these stored blocks at `now`, wherever they sit in the tree."""
        for key in keys:
            node = self._nodes.get(key)
            if node is not None:
                node.last_access = max(node.last_access, now)

    def insert(self, keys: Sequence[BlockKey], now: float) -> list[BlockKey]:
        """Adds the blocks of `keys` not stored yet; returns them, in order.
        The caller stores their data (and calls `remove` if that fails)."""
        node, added = self.root, []
        for key in keys:
            child = node.children.get(key)
            if child is None:
                if key in self._nodes:
                    raise ValueError("a block key appears under two parents: keys must chain over the whole prefix")
                child = Node(key, node, now)
                node.children[key] = child
                self._nodes[key] = child
                added.append(key)
            child.last_access = max(child.last_access, now)
            node = child
        return added

    def add_child(self, parent: BlockKey | None, key: BlockKey, last_access: float) -> None:
        """Adds one block under a stored `parent` (None: the root), as a
        restart rebuilds the tree from blocks that name their parents."""
        parent_node = self.root if parent is None else self._nodes[parent]
        if key in self._nodes:
            raise ValueError("a block key appears under two parents: keys must chain over the whole prefix")
        self._nodes[key] = parent_node.children[key] = Node(key, parent_node, last_access)

    def remove(self, key: BlockKey) -> list[BlockKey]:
        """Drops a block and everything after it (a block whose data turned out
        bad: its descendants cannot be reached without it). Returns the keys."""
        node = self._nodes.get(key)
        if node is None:
            return []
        removed = []
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            removed.append(n.key)
            del self._nodes[n.key]
        del node.parent.children[key]
        self._forget_removed_conversations()
        return removed

    def detach(self, key: BlockKey) -> None:
        """Drops one block; the blocks after it stay, each now the start of a
        chain of its own (a tier whose lookups start where the accelerator's
        cache stops, vLLM's offloading tier, still uses them)."""
        node = self._nodes.pop(key, None)
        if node is None:
            return
        del node.parent.children[key]
        for child in node.children.values():
            child.parent = self.root
            self.root.children[child.key] = child
        self._forget_removed_conversations()

    def pin(self, keys: Sequence[BlockKey], pinned: bool = True) -> None:
        """Pins (or unpins) the stored blocks of `keys`; pinned blocks are never evicted."""
        for node in self._path(keys):
            node.pinned = pinned

    def acquire(self, keys: Sequence[BlockKey]) -> None:
        """Marks blocks in use (a copy reads or writes them): never evicted until released."""
        for key in keys:
            self._nodes[key].in_use += 1

    def release(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            node = self._nodes.get(key)
            if node is not None:
                if node.in_use <= 0:
                    raise RuntimeError("release of a block that is not in use")
                node.in_use -= 1

    def num_evictable(self) -> int:
        """How many blocks `evict` could drop now: those neither pinned nor in
        use with no such block after them."""
        blocked: set[int] = set()  # ids of nodes that stay, and of every node above them
        for node in self._nodes.values():
            if not node.evictable():
                while node is not self.root and id(node) not in blocked:
                    blocked.add(id(node))
                    node = node.parent
        return len(self._nodes) - len(blocked)

    def trailing_runs(self, now: float) -> list[TrailingRun]:
        """Every conversation that can lose blocks now, with what it alone holds."""
        runs = []
        for node in self._nodes.values():
            if node.children or not node.evictable():
                continue
            length, top = 1, node
            while top.parent is not self.root and len(top.parent.children) == 1 and top.parent.evictable():
                top = top.parent
                length += 1
            runs.append(TrailingRun(node, length, now - node.last_access))
        return runs

    def evict(self, num_blocks: int, now: float, exact: bool = False) -> list[BlockKey]:
        """Drops at least `num_blocks` blocks if it can (fewer when only pinned
        or in-use blocks are left), as the policy chooses; with `exact`, no
        more than `num_blocks` either (the last victim loses fewer blocks than
        the policy chose). Returns the keys, each block before its parent."""
        evicted: list[BlockKey] = []
        while len(evicted) < num_blocks:
            runs = self.trailing_runs(now)
            if not runs:
                break
            victim = self.policy.choose(runs)
            if not 1 <= victim.num_blocks <= victim.run.length:
                raise ValueError(f"policy {self.policy.name} chose {victim.num_blocks} of a run of {victim.run.length}")
            node = victim.run.leaf
            count = min(victim.num_blocks, num_blocks - len(evicted)) if exact else victim.num_blocks
            for _ in range(count):
                parent = node.parent
                del parent.children[node.key]
                del self._nodes[node.key]
                evicted.append(node.key)
                node = parent
        self._forget_removed_conversations()
        return evicted

    def _forget_removed_conversations(self) -> None:
        for conversation, node in list(self._latest_of.items()):
            if node.key not in self._nodes:
                del self._latest_of[conversation]
