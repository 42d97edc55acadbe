"""The backend's logger, and what the prefix tree saved, for the engine log
(and, through vllm_chunkattn/metrics.py, for Prometheus).

Two lines report it: one every `period_s` while decoding (for whoever watches
a running server) and one with the totals of the whole run when the process
that runs the model exits (`parse_run_summaries` reads it back, so tests and
scripts see the same numbers a user sees). At debug level
(VLLM_LOGGING_LEVEL=DEBUG) each step's tree is logged too: which rows each
node covers and which chunks (`parse_step_trees` reads those back).
"""

from __future__ import annotations

import logging
import re
import time
import weakref
from dataclasses import dataclass

import torch
from vllm.logger import init_logger

from vllm_chunkattn import BACKEND_NAME
from vllm_chunkattn.metrics import StepCounts, TreeMetricsWriter
from vllm_chunkattn.prefix.tree import PrefixTreeContext

logger = init_logger("vllm.chunkattn.backend")  # in vLLM's hierarchy, see plugin.py


def step_counts(tree: PrefixTreeContext, seq_lens: torch.Tensor, block_size: int, num_requests: int,
                multi_token_rows: int, sliding_window: int, rebuilt: bool, plan_seconds: float) -> StepCounts:
    return StepCounts(
        requests=num_requests, rows=len(seq_lens), multi_token_rows=multi_token_rows, nodes=tree.num_nodes,
        context_tokens=int((seq_lens.clamp(max=sliding_window) if sliding_window else seq_lens).sum()),
        saved_tokens=tree.reused_tokens(block_size, seq_lens, sliding_window),
        rebuilt=rebuilt, plan_seconds=plan_seconds,
    )


@dataclass
class DecodeTotals:
    """Sums over decode steps."""

    steps: int = 0
    requests: int = 0
    rows: int = 0
    multi_token_rows: int = 0
    nodes: int = 0
    context_tokens: int = 0
    saved_tokens: int = 0
    tree_builds: int = 0  # the tree cache's counters as of the last step
    tree_lookups: int = 0

    def add(self, step: StepCounts) -> None:
        self.steps += 1
        self.requests += step.requests
        self.rows += step.rows
        self.multi_token_rows += step.multi_token_rows
        self.nodes += step.nodes
        self.context_tokens += step.context_tokens
        self.saved_tokens += step.saved_tokens

    @property
    def mean_batch(self) -> float:
        return self.requests / max(self.steps, 1)

    @property
    def mean_nodes(self) -> float:
        return self.nodes / max(self.steps, 1)

    @property
    def served_once_share(self) -> float:
        return self.saved_tokens / max(self.context_tokens, 1)


_RUN_SUMMARY = (
    "{name} prefix tree, whole run: {steps} decode steps, mean batch {mean_batch:.1f}, {rows} query rows "
    "({multi} of them from requests with several new tokens), mean {mean_nodes:.2f} shared "
    "nodes, decode KV token reads served once per batch: {saved} of {total} ({share:.1f}%); tree rebuilt in "
    "{builds} of {lookups} steps"
)
_RUN_SUMMARY_PATTERN = re.compile(
    re.escape(BACKEND_NAME) + r" prefix tree, whole run: (\d+) decode steps, mean batch ([\d.]+), (\d+) query rows "
    r"\((\d+) of them from requests with several new tokens\), mean ([\d.]+) "
    r"shared nodes, decode KV token reads served once per batch: (\d+) of (\d+) "
)


# vLLM kills a worker that has not exited VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5 by default) after shutdown
# begins, and the whole-run line is logged as the worker exits: under load a worker's teardown can take longer,
# and a killed worker never logs it. What starts an engine to read the line back sets this in its environment
# (the user's own value wins).
RUN_SUMMARY_ENV = {"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60"}


def with_run_summary_time(env: dict[str, str]) -> dict[str, str]:
    """`env` with RUN_SUMMARY_ENV's values where it has none."""
    return {**RUN_SUMMARY_ENV, **env}


def format_run_summary(totals: DecodeTotals) -> str:
    return _RUN_SUMMARY.format(
        name=BACKEND_NAME, steps=totals.steps, mean_batch=totals.mean_batch, rows=totals.rows,
        multi=totals.multi_token_rows, mean_nodes=totals.mean_nodes,
        saved=totals.saved_tokens, total=totals.context_tokens, share=100.0 * totals.served_once_share,
        builds=totals.tree_builds, lookups=totals.tree_lookups,
    )


@dataclass(frozen=True)
class RunSummary:
    """The whole-run line read back from a log."""

    steps: int
    mean_batch: float
    rows: int
    multi_token_rows: int
    mean_nodes: float
    saved_tokens: int
    context_tokens: int

    @property
    def served_once_share(self) -> float:
        return self.saved_tokens / max(self.context_tokens, 1)


def parse_run_summaries(log_text: str) -> list[RunSummary]:
    """Every whole-run line in `log_text`: one per metadata builder that decoded
    (one per KV cache group and model-running process)."""
    return [
        RunSummary(int(steps), float(batch), int(rows), int(multi), float(nodes), int(saved), int(total))
        for steps, batch, rows, multi, nodes, saved, total in _RUN_SUMMARY_PATTERN.findall(log_text)
    ]


@dataclass(frozen=True)
class NodeSpan:
    """A node of one step's tree: tree positions (rows) [row_begin, row_end)
    attend block-table columns (chunks) [chunk_begin, chunk_end) together."""

    row_begin: int
    row_end: int
    chunk_begin: int
    chunk_end: int


@dataclass(frozen=True)
class StepTree:
    """One step's debug line read back from a log."""

    requests: int
    rows: int
    nodes: tuple[NodeSpan, ...]


_STEP_LINE = "{name} prefix tree step: {requests} requests, {rows} rows, nodes: {nodes}"
_STEP_PATTERN = re.compile(re.escape(BACKEND_NAME) + r" prefix tree step: (\d+) requests, (\d+) rows, nodes: (.*)")
_NODE_TEXT = "rows [{}, {}) x chunks [{}, {})"
_NODE_PATTERN = re.compile(r"rows \[(\d+), (\d+)\) x chunks \[(\d+), (\d+)\)")


def format_step_tree(tree: PrefixTreeContext, num_requests: int, num_rows: int) -> str:
    spans = zip(tree.node_begin.tolist(), tree.node_end.tolist(), tree.node_chunk_begin.tolist(),
                tree.node_chunk_end.tolist())
    nodes = "; ".join(_NODE_TEXT.format(*span) for span in spans) or "none"
    return _STEP_LINE.format(name=BACKEND_NAME, requests=num_requests, rows=num_rows, nodes=nodes)


def parse_step_trees(log_text: str) -> list[StepTree]:
    """Every per-step tree line in `log_text` (logged at debug level only)."""
    return [
        StepTree(int(requests), int(rows),
                 tuple(NodeSpan(*map(int, span)) for span in _NODE_PATTERN.findall(nodes)))
        for requests, rows, nodes in _STEP_PATTERN.findall(log_text)
    ]


def _log_run_summary(totals: DecodeTotals) -> None:
    if totals.steps:
        logger.info(format_run_summary(totals))


class DecodeStats:
    """What the prefix tree saved: logged every `period_s` while decoding, and
    for the whole run when this object goes away (at the latest when the
    process exits: vLLM's engine core and workers exit normally on shutdown);
    and, where `metrics` is given, added to the Prometheus series each step
    (vllm_chunkattn/metrics.py)."""

    def __init__(self, block_size: int, period_s: float = 10.0, sliding_window: int = 0,
                 metrics: TreeMetricsWriter | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window  # the group's layers': their reads are counted within it
        self.period_s = period_s
        self.metrics = metrics
        self.run = DecodeTotals()
        weakref.finalize(self, _log_run_summary, self.run)
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.since = now
        self.window = DecodeTotals()

    def record(self, tree: PrefixTreeContext, seq_lens: torch.Tensor, num_requests: int, multi_token_rows: int,
               builds: int, lookups: int, plan_seconds: float = 0.0) -> None:
        """One step's tree over `seq_lens` (per row) of `num_requests` requests;
        `builds` and `lookups` are the tree cache's counters after it."""
        step = step_counts(tree, seq_lens, self.block_size, num_requests, multi_token_rows, self.sliding_window,
                           rebuilt=builds > self.run.tree_builds, plan_seconds=plan_seconds)
        for totals in (self.window, self.run):
            totals.add(step)
        if self.metrics is not None:
            self.metrics.record(step)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(format_step_tree(tree, num_requests, len(seq_lens)))
        self.run.tree_builds, self.run.tree_lookups = builds, lookups
        now = time.monotonic()
        if now - self.since >= self.period_s:
            window = self.window
            logger.info(
                "%s prefix tree: %d decode steps, mean batch %.1f, mean %.1f shared nodes; "
                "%.0f%% of decode KV reads served once per batch; tree rebuilt in %d of %d steps so far",
                BACKEND_NAME, window.steps, window.mean_batch, window.mean_nodes,
                100.0 * window.served_once_share, builds, lookups,
            )
            self._reset(now)
