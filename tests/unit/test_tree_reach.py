"""The tree path's reach (kernels/tree_reach.py): the two paths it times compute the same attention, the
search stops at the first loss, and on CUDA a probe that does not fit falls back to the platform's value.

Timed on a GPU in tests/gpu/test_gpu_kernels.py::test_cuda_reach_is_measured_on_the_gpu."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_chunkattn.kernels import tree_reach
from vllm_chunkattn.kernels.support import CUDA
from vllm_chunkattn.prefix.plan import DecodeShape

SMALL = DecodeShape(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.float32)
CUDA_DEVICE = torch.device("cuda", 0)


def test_the_two_paths_of_the_reach_measurement_agree():
    """The tree path and the per-request prefill timed against each other compute the same attention."""
    for shape, atol in ((SMALL, 1e-5),
                        (DecodeShape(num_heads=8, num_kv_heads=8, head_size=128, block_size=32,
                                     dtype=torch.bfloat16), 2e-2)):
        paths = tree_reach.tree_paths(shape, query_len=3)
        tree, per_request = paths["tree"]().float(), paths["per_request"]().float()
        assert tree.shape == (tree_reach.CPU_PROBE.requests * 3, shape.num_heads, shape.head_size)
        assert torch.allclose(tree, per_request, atol=atol), shape


@pytest.mark.parametrize("device", [torch.device("cpu"), CUDA_DEVICE], ids=["cpu", "cuda"])
@pytest.mark.parametrize("gains,reach", [
    ([1.5, 1.2, 0.9], 8),  # group 2: q = 2 and 4 win (4, 8 rows per KV head), q = 8 loses
    ([0.8], 2),            # q = 2 loses already: decodes only (q = 1, the group's 2 rows)
    ([1.1] * 5, 64),       # never loses: up to the probe's max_rows_per_kv_head
])
def test_the_reach_stops_at_the_first_loss(monkeypatch, device, gains, reach):
    timed = []

    def gain(shape, query_len, on, flush):
        assert on == device and callable(flush)
        timed.append(query_len)
        return gains[len(timed) - 1]

    monkeypatch.setattr(tree_reach, "tree_gain", gain)
    assert tree_reach.probe_for(device).max_rows_per_kv_head == 64
    measured_reach, measured = tree_reach.measure_reach(SMALL, device)
    assert measured_reach == reach
    assert timed == [2 ** (i + 1) for i in range(len(gains))]
    assert measured == {str(SMALL.group * q): g for q, g in zip(timed, gains)}


def test_on_cpu_every_timed_call_starts_from_evicted_caches(monkeypatch):
    """As the tile tuner and the relay grid time: a serving step finds its KV in memory, not in the L3."""
    events = []

    class Flusher:
        def __call__(self):
            events.append("flush")

    def fake_timed(call, device):
        events.append("call " + call())
        return {"tree": 1.0, "per_request": 2.0}[call()]

    monkeypatch.setattr(tree_reach, "CacheFlusher", Flusher)
    monkeypatch.setattr(tree_reach, "timed", fake_timed)
    monkeypatch.setattr(tree_reach, "tree_paths", lambda shape, q, device: {p: (lambda p=p: p) for p in
                                                                           ("tree", "per_request")})
    assert tree_reach.tree_gain(SMALL, 2) == 2.0
    calls = [e for e in events if e != "flush"]
    assert len(calls) == 2 * (tree_reach.CPU_PROBE.repeats + 1)  # both paths, a warm-up pass and the repeats
    assert events == [x for call in calls for x in ("flush", call)]


def test_both_probes_are_the_relay_grids_shape():
    """The tree path's gain grows with the requests that share a chunk, so the reach is timed on the batch
    the relay grids measure (bench/kernel.py on CPU, bench/kernel_gpu.py on CUDA): 32 requests, 2048 shared
    and 128 private tokens. A tuning cached for another probe is not reused."""
    from vllm_chunkattn.bench import kernel, kernel_gpu
    from vllm_chunkattn.kernels import cpu_tuning

    gpu_points = [(p.batch, p.shared, p.context - p.shared - p.query_len) for p in kernel_gpu.grid_points(["relay"])]
    cpu_points = [(p.requests, p.shared, p.context - p.shared - p.new) for p in kernel.relay_points("fp32", False)]
    for probe, points in ((tree_reach.CUDA_PROBE, gpu_points), (tree_reach.CPU_PROBE, cpu_points)):
        assert points and set(points) == {(probe.requests, probe.shared_tokens, probe.private_tokens)}
    assert cpu_tuning.tuning_key(SMALL)["reach_probe"]["shared_tokens"] == 2048


@pytest.fixture
def fresh_cuda_reach():
    tree_reach.cuda_reach.cache_clear()
    yield
    tree_reach.cuda_reach.cache_clear()


def test_cuda_reach_is_measured_once_per_shape_and_logged(monkeypatch, caplog, fresh_cuda_reach):
    calls = []
    monkeypatch.setattr(tree_reach, "measure_reach", lambda shape, device: calls.append(shape) or (16, {"8": 1.2}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a test GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    with caplog.at_level(logging.INFO, logger="vllm.chunkattn"):
        assert tree_reach.cuda_reach(SMALL, CUDA_DEVICE) == 16
        assert tree_reach.cuda_reach(SMALL, CUDA_DEVICE) == 16
    assert calls == [SMALL]
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and "a test GPU" in logged[0] and "tree_max_rows_per_kv_head=16" in logged[0]


def test_cuda_reach_falls_back_to_the_platform_value_without_memory(monkeypatch, caplog, fresh_cuda_reach):
    def out_of_memory(shape, device):
        raise torch.OutOfMemoryError("CUDA out of memory")

    emptied = []
    monkeypatch.setattr(tree_reach, "measure_reach", out_of_memory)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    with caplog.at_level(logging.WARNING, logger="vllm.chunkattn"):
        assert tree_reach.cuda_reach(SMALL, CUDA_DEVICE) == CUDA.tree_max_rows_per_kv_head
    assert emptied == [True]
    assert any("no GPU memory left" in r.getMessage() for r in caplog.records)
