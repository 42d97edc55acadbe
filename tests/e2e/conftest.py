"""Shared fixtures: engine runs of the shared-prefix workload, cached for the
whole session (an engine start costs about a minute here)."""

from __future__ import annotations

import pytest

from vllm_chunkattn.testing.e2e_runs import run_workload


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    cache = {}

    def get(name: str, backend: str) -> dict:
        if (name, backend) not in cache:
            cache[(name, backend)] = run_workload(tmp_path_factory, name, backend)
        return cache[(name, backend)]

    return get


