"""Shared fixtures: engine runs of the workloads, cached for the whole
session (an engine start costs about a minute here)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_chunkattn.testing.e2e_runs import run_workload


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """runs(name, backend, workload, pensieve) -> the run's record; runs.pair(name, workload) -> the
    (stock, chunk) records, the missing ones run in parallel processes: most of a run is starting its
    engine, which overlaps well even on two cores."""
    cache = {}
    # Created lazily and not thread-safely: the first pair's two threads would race to make it.
    tmp_path_factory.getbasetemp()

    def get(name: str, backend: str, workload: str = "shared-prefix", pensieve: str | None = None) -> dict:
        key = (name, backend, workload, pensieve)
        if key not in cache:
            cache[key] = run_workload(tmp_path_factory, *key)
        return cache[key]

    def pair(name: str, workload: str = "shared-prefix") -> tuple[dict, dict]:
        keys = [(name, backend, workload, None) for backend in ("stock", "chunk")]
        missing = [key for key in keys if key not in cache]
        with ThreadPoolExecutor(max(1, len(missing))) as pool:
            for key, record in zip(missing, pool.map(lambda key: run_workload(tmp_path_factory, *key), missing)):
                cache[key] = record
        return cache[keys[0]], cache[keys[1]]

    get.pair = pair
    return get
