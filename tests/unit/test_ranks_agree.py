"""Every rank of a parallel model orders its batch alike (backend/builder.py, _same_on_every_rank).

The builder's tree threshold decides which requests vLLM's model runner puts first in each worker's batch,
and tensor- and pipeline-parallel ranks exchange activations row by row, so a threshold that differed
between ranks would mix up requests. Each rank times its own (kernels/tree_reach.py); here two ranks with
vLLM's real distributed state (gloo, on CPU) measure different values and must end with one."""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp

BUILT_IN = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, tp: int, pp: int, measured: list[int], results) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    from vllm_chunkattn.backend.builder import _same_on_every_rank

    with set_current_vllm_config(VllmConfig()):
        parallel_state.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 backend="gloo")
        timed = []

        def measure() -> int:
            timed.append(rank)
            return measured[rank]

        results.put((rank, _same_on_every_rank(measure, BUILT_IN), timed))
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()


@pytest.mark.parametrize("tp,pp,expected", [
    (2, 1, 2),         # tensor parallel: the smaller of the two measurements
    (1, 2, BUILT_IN),  # pipeline parallel: the platform's value, without a collective per builder
])
def test_ranks_that_measured_differently_agree(tp, pp, expected):
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    measured = [8, 2]
    ranks = [context.Process(target=_rank, args=(r, 2, port, tp, pp, measured, results)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        reports = [results.get(timeout=240) for _ in ranks]
    finally:
        for p in ranks:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert {rank: value for rank, value, _ in reports} == {0: expected, 1: expected}
    # Under pipeline parallelism nothing is measured: its result would be thrown away.
    assert {rank: timed for rank, _, timed in reports} == ({0: [0], 1: [1]} if pp == 1 else {0: [], 1: []})
    assert all(p.exitcode == 0 for p in ranks)


def test_a_single_process_keeps_its_measurement():
    from vllm_chunkattn.backend.builder import _same_on_every_rank

    assert _same_on_every_rank(lambda: 8, BUILT_IN) == 8
