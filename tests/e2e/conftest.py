"""Shared fixtures: engine runs of the workloads, cached for the whole
session (an engine start costs about a minute here)."""

from __future__ import annotations

import pytest

from vllm_chunkattn.testing.e2e_runs import run_workload


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    cache = {}

    def get(name: str, backend: str, workload: str = "shared-prefix", pensieve: str | None = None) -> dict:
        key = (name, backend, workload, pensieve)
        if key not in cache:
            cache[key] = run_workload(tmp_path_factory, name, backend, workload, pensieve)
        return cache[key]

    return get


