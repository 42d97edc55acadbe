"""The prefix tree's Prometheus series, on the API server's `/metrics`.

The tree is built where the model runs (a worker process), but `/metrics` is
served by the API server. vLLM carries its own worker statistics to the API
server inside structures a plugin cannot extend (only a KV connector's
statistics ride along, and `chunk` must not need one). So the series travel
the way prometheus_client shares metrics between processes: each
model-running process writes its values into a memory-mapped file of
prometheus_client's multiprocess format, and a `MultiProcessCollector` reads
the directory when `/metrics` is scraped. Writing is a store into the mapped
file, no system call, so each step pays microseconds.

Which directory:
- `PROMETHEUS_MULTIPROC_DIR` where vLLM has one (it creates it for
  `--api-server-count` > 1, or the user set it): vLLM's own collector serves it;
- else `VLLM_CHUNKATTN_METRICS_DIR`: the first process that loads the plugin
  (the API server, or the user's process with vLLM's `LLM`) creates it and
  removes it at exit, unless the user set it. Every process under it inherits
  it (vLLM copies `VLLM_` variables to its Ray workers too) and serves it from
  its default registry, which is what `/metrics` shows with one API server.

Only the first rank of each tensor- and pipeline-parallel group writes: every
rank builds the same tree from the same block tables, so the others would
count each step again.

The files are named `<type>_chunkattn-<pid>.db`: prometheus_client reads the
type from the name up to the first `_`, and the suffix keeps them apart from
the files its own metrics write in the same process.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass

from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.utils import floatToGoString

METRICS_DIR_ENV = "VLLM_CHUNKATTN_METRICS_DIR"
VLLM_MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
LABEL_NAMES = ("model_name", "engine")  # as vLLM's own series (v1/metrics/loggers.py)


@dataclass(frozen=True)
class Series:
    name: str  # as /metrics shows it, without the _total / _bucket / _sum / _count suffix
    kind: str  # "counter" or "histogram"
    help: str
    buckets: tuple[float, ...] = ()  # histograms: upper bounds, +Inf added


TREE_STEPS = Series("vllm:chunk_tree_steps", "counter",
                    "Steps (per KV-cache group) that ran query rows through the prefix tree.")
TREE_ROWS = Series("vllm:chunk_tree_rows", "counter",
                   "Query rows that ran through the prefix tree (one per decode token).")
KV_TOKENS_ATTENDED = Series("vllm:chunk_kv_tokens_attended", "counter",
                            "KV tokens the tree rows attended: what attention reads without sharing.")
KV_TOKENS_SAVED = Series("vllm:chunk_kv_tokens_saved", "counter",
                         "Of the attended KV tokens, the reads the prefix tree saved by reading each shared "
                         "chunk once for all the rows that share it. saved / attended is the share of reads "
                         "sharing removed.")
TREE_REBUILDS = Series("vllm:chunk_tree_rebuilds", "counter",
                       "Steps whose prefix tree was rebuilt: a request joined or left, or a chunk filled.")
TREE_NODES = Series("vllm:chunk_tree_nodes", "histogram",
                    "Shared nodes of each step's prefix tree.", (0, 1, 2, 4, 8, 16, 32, 64, 128))
PLAN_SECONDS = Series("vllm:chunk_plan_seconds", "histogram",
                      "Host time to build a step's tree and plan (once per step, for all layers).",
                      (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1))
SERIES = (TREE_STEPS, TREE_ROWS, KV_TOKENS_ATTENDED, KV_TOKENS_SAVED, TREE_REBUILDS, TREE_NODES, PLAN_SECONDS)


@dataclass(frozen=True)
class StepCounts:
    """What one step's tree did (per KV-cache group)."""

    requests: int  # tree requests: decodes, and requests with a few new tokens (prefix/query_rows.py)
    rows: int  # their query tokens, one tree row each
    multi_token_rows: int  # of those, the rows of requests with several new tokens
    nodes: int
    context_tokens: int  # KV token reads without sharing: the sum of the rows' seq lens (within the window)
    saved_tokens: int  # of those, reads the tree served once for several requests
    rebuilt: bool  # the tree was built anew, not taken from the cache
    plan_seconds: float  # host time for the tree and the plan



_collecting = False


def init_metrics_dir() -> None:
    """Make (first process) or inherit the directory the model-running
    processes write to, and serve it from this process's default registry."""
    global _collecting
    if _collecting or os.environ.get(VLLM_MULTIPROC_DIR_ENV):
        return
    path = os.environ.get(METRICS_DIR_ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="vllm-chunkattn-metrics-")
        os.environ[METRICS_DIR_ENV] = path
        owner = os.getpid()
        # Only the creator removes it: forked children run the same exit hooks.
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, ignore_errors=True))
    os.makedirs(path, exist_ok=True)
    from prometheus_client import REGISTRY
    from prometheus_client.multiprocess import MultiProcessCollector

    MultiProcessCollector(REGISTRY, path=path)
    _collecting = True


class _MetricsFile:
    """One file of this process, and the values written to it."""

    def __init__(self, path: str) -> None:
        self.mmap = MmapedDict(path)
        self.values: dict[str, float] = {}

    def add(self, key: str, amount: float) -> None:
        if key not in self.values:  # a process with a reused pid continues the file's count
            self.values[key] = self.mmap.read_value(key)[0]
        self.values[key] += amount
        self.mmap.write_value(key, self.values[key], 0.0)


_files: dict[str, _MetricsFile] = {}  # by path: one mapping per file and process


class TreeMetricsWriter:
    """Adds steps to `SERIES` under one model name and engine."""

    def __init__(self, directory: str, model_name: str, engine: str) -> None:
        self.label_values = (model_name, engine)
        self._histograms_shown: set[str] = set()
        pid = os.getpid()
        self._files = {}
        for kind in ("counter", "histogram"):
            path = os.path.join(directory, f"{kind}_chunkattn-{pid}.db")
            self._files[kind] = _files.get(path) or _files.setdefault(path, _MetricsFile(path))

    def _add(self, series: Series, sample: str, amount: float, extra_labels: dict[str, str] | None = None) -> None:
        names = [*LABEL_NAMES, *(extra_labels or {})]
        values = [*self.label_values, *(extra_labels or {}).values()]
        self._files[series.kind].add(mmap_key(series.name, sample, names, values, series.help), amount)

    def _count(self, series: Series, amount: float) -> None:
        if amount:
            self._add(series, series.name + "_total", amount)

    def _observe(self, series: Series, value: float) -> None:
        # The multiprocess format stores each bucket's own count; the
        # collector makes them cumulative and adds _count.
        bounds = (*series.buckets, float("inf"))
        if series.name not in self._histograms_shown:  # every bucket on /metrics from the first step on
            self._histograms_shown.add(series.name)
            for bound in bounds:
                self._add(series, series.name + "_bucket", 0.0, {"le": floatToGoString(bound)})
        bound = next(b for b in bounds if value <= b)
        self._add(series, series.name + "_bucket", 1.0, {"le": floatToGoString(bound)})
        self._add(series, series.name + "_sum", value)

    def record(self, step: StepCounts) -> None:
        self._count(TREE_STEPS, 1)
        self._count(TREE_ROWS, step.rows)
        self._count(KV_TOKENS_ATTENDED, step.context_tokens)
        self._count(KV_TOKENS_SAVED, step.saved_tokens)
        self._count(TREE_REBUILDS, int(step.rebuilt))
        self._observe(TREE_NODES, step.nodes)
        self._observe(PLAN_SECONDS, step.plan_seconds)


def metrics_writer(model_name: str, engine: str) -> TreeMetricsWriter | None:
    """A writer into this process's files, or None where no directory was set
    up (a process not started from one that loaded the plugin)."""
    directory = os.environ.get(VLLM_MULTIPROC_DIR_ENV) or os.environ.get(METRICS_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return None
    return TreeMetricsWriter(directory, model_name, engine)
