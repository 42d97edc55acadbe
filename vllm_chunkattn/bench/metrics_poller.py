"""Samples a vLLM server's Prometheus `/metrics` while a benchmark runs.

`vllm bench serve` reports what the client saw; the paper's Table 4 also
has what the server held: peak KV cache and peak batch size. vLLM exports
them as gauges, so a thread scrapes them every `interval_s` and keeps every
sample; peaks and counter deltas are computed from the samples.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# Gauges: the value now. Counters: totals since the server started.
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # fraction in [0, 1] of the KV blocks in use
RUNNING = "vllm:num_requests_running"  # the batch: requests scheduled this step
WAITING = "vllm:num_requests_waiting"
FINISHED = "vllm:request_success_total"
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
SAMPLED = (KV_CACHE_USAGE, RUNNING, WAITING, FINISHED, PREEMPTIONS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS)


def metrics_text(url: str, timeout_s: float = 5.0) -> str:
    """The server's /metrics page, Prometheus text format."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
        return r.read().decode()


def scrape(url: str, timeout_s: float = 5.0, series: tuple[str, ...] = SAMPLED
           ) -> tuple[dict[str, float], dict[str, str]]:
    """The sampled metrics (`series`, summed over label sets), and the labels
    of `vllm:cache_config_info` (block size, KV cache bytes, ...)."""
    text = metrics_text(url, timeout_s)
    values = dict.fromkeys(series, 0.0)
    cache_config: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
            elif family.name == "vllm:cache_config_info":
                cache_config = dict(sample.labels)
    return values, cache_config


@dataclass
class MetricsSummary:
    samples: int
    peak_kv_cache_usage: float  # fraction of the KV cache
    peak_kv_cache_gib: float | None  # the same in GiB, from the cache size the server reports
    peak_running: int  # peak batch size
    peak_waiting: int
    mean_running: float  # over samples with at least one request running
    finished: int
    preemptions: int
    prefix_cache_hit_rate: float | None  # of the prompt tokens looked up during the run
    series: dict[str, list[float]] = field(repr=False)


class MetricsPoller:
    """`with MetricsPoller(url) as poller: ...; poller.summary()`"""

    def __init__(self, url: str, interval_s: float = 0.5) -> None:
        self.url = url
        self.interval_s = interval_s
        self.times: list[float] = []
        self.values: list[dict[str, float]] = []
        self.cache_config: dict[str, str] = {}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-poller", daemon=True)
        self._lock = threading.Lock()

    def _sample(self) -> None:
        try:
            values, cache_config = scrape(self.url)
        except OSError:
            self.errors += 1  # a slow scrape under load is not fatal; the next one counts
            return
        with self._lock:
            self.times.append(time.monotonic())
            self.values.append(values)
            self.cache_config = cache_config or self.cache_config

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._sample()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def start(self) -> MetricsPoller:
        self._sample()  # the baseline for counter deltas, before the run starts
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # counters after the run

    def __enter__(self) -> MetricsPoller:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def latest(self) -> dict[str, float]:
        with self._lock:
            return dict(self.values[-1]) if self.values else {}

    def delta(self, name: str) -> float:
        with self._lock:
            return self.values[-1][name] - self.values[0][name] if self.values else 0.0

    def summary(self) -> MetricsSummary:
        with self._lock:
            values, times = list(self.values), list(self.times)
        if not values:
            raise RuntimeError(f"no /metrics sample could be read from {self.url}")

        def column(name: str) -> list[float]:
            return [v[name] for v in values]

        kv = column(KV_CACHE_USAGE)
        running = column(RUNNING)
        busy = [r for r in running if r > 0]
        queries = values[-1][PREFIX_CACHE_QUERIES] - values[0][PREFIX_CACHE_QUERIES]
        hits = values[-1][PREFIX_CACHE_HITS] - values[0][PREFIX_CACHE_HITS]
        kv_bytes = self.cache_config.get("kv_cache_memory_bytes")
        return MetricsSummary(
            samples=len(values),
            peak_kv_cache_usage=max(kv),
            peak_kv_cache_gib=max(kv) * float(kv_bytes) / 2**30 if kv_bytes not in (None, "None") else None,
            peak_running=int(max(running)),
            peak_waiting=int(max(column(WAITING))),
            mean_running=sum(busy) / len(busy) if busy else 0.0,
            finished=int(values[-1][FINISHED] - values[0][FINISHED]),
            preemptions=int(values[-1][PREEMPTIONS] - values[0][PREEMPTIONS]),
            prefix_cache_hit_rate=hits / queries if queries else None,
            series={
                "t_s": [t - times[0] for t in times],
                "kv_cache_usage": kv,
                "running": running,
                "waiting": column(WAITING),
            },
        )
