"""How far the prefix-tree path reaches, measured on the device the engine runs on.

A request with q new tokens can take either of two exact paths: the tree path
(each of its q x GQA-group query rows per KV head stacked with the other
requests' rows over their shared chunks, prefix/query_rows.py) or the
per-request paged prefill. Stacking pays while each request brings few rows;
with many, the prefill's own query tiles already reuse each key and the tree
only adds partial results. Where the crossover lies depends on the device and
the layer shape: the relay grids put it at 16 rows per KV head on a Zen 5, 8
on a Zen 4, and on an H200 at 8 with MHA but 16 with GQA 4.

So the engine measures it at start, per layer shape: both paths timed on the
same synthetic batch (`Probe`: the relay grid's 32 requests behind a shared
prefix of 2048 tokens, each with 128 private tokens and q new ones), for
q = 2, 4, 8, ... while q x group is at most `Probe.max_rows_per_kv_head`; the
reach is the last q x group up to which the tree path's fastest call was at
least as fast as the per-request path's, at every q (on CPU each call timed
from evicted caches). The tree path is planned
by the engine's own StepPlanner, with the platform's rule for a request's own
node. On CPU this runs inside the tile tuning (kernels/cpu_tuning.py, 1 to 15 s
per shape, cached on disk); on CUDA it takes about a second per shape and is
measured in every process (`cuda_reach`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable

import torch

from vllm_chunkattn.kernels.cpu_info import CacheFlusher
from vllm_chunkattn.kernels.support import for_platform
from vllm_chunkattn.prefix.plan import DecodeShape

logger = logging.getLogger("vllm.chunkattn.kernels")  # in vLLM's hierarchy, see plugin.py


@dataclasses.dataclass(frozen=True)
class Probe:
    """The synthetic batch the reach is timed on: the kernel benchmarks' relay grid."""

    requests: int
    shared_tokens: int
    private_tokens: int
    max_rows_per_kv_head: int  # the largest q x group timed, and so the largest reach
    repeats: int  # timed calls per path and q, after one that warms up


# Both devices time the relay grid's batch (bench/kernel.py, bench/kernel_gpu.py). The tree path's gain
# grows with the requests that share a chunk, so a smaller batch under-rates it (16 requests behind 1024
# tokens: 0.89x to 0.95x on a Zen 3 where this batch gives 1.12x, bf16 16/4 heads at 16 rows per KV head);
# on a GPU the crossover also moves with how many blocks fill its SMs. A CPU takes 1 to 15 s per layer
# shape at this size, once (cached on disk).
CUDA_PROBE = Probe(requests=32, shared_tokens=2048, private_tokens=128, max_rows_per_kv_head=64, repeats=10)
CPU_PROBE = dataclasses.replace(CUDA_PROBE, repeats=5)


def probe_for(device: torch.device) -> Probe:
    return CUDA_PROBE if device.type == "cuda" else CPU_PROBE


# ---------------------------------------------------------------- timing (shared with cpu_tuning)


def timed(call: Callable[[], object], device: torch.device = torch.device("cpu")) -> float:
    """Seconds of one call; on CUDA, from an idle device to the end of the call's kernels."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def interleaved_timings(options: list, run: Callable[[object], list[float]], repeats: int,
                        statistic: Callable[[list[float]], float] = statistics.median_high) -> dict[object, list[float]]:
    """Per option, the median (or another `statistic`) over `repeats` runs of each time `run(option)` returns.
    The options run interleaved, in an order rotated by one per repetition, after a first pass that warms up."""
    times: dict[object, list[list[float]]] = {o: [] for o in options}
    for rep in range(repeats + 1):
        first = rep % len(options)
        for option in options[first:] + options[:first]:
            measured = run(option)
            if rep:
                times[option].append(measured)
    return {o: [statistic(list(column)) for column in zip(*times[o])] for o in options}


# ---------------------------------------------------------------- the synthetic batch


def blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def random_cache(num_blocks: int, shape: DecodeShape, generator: torch.Generator) -> torch.Tensor:
    cache = torch.empty(num_blocks, shape.num_kv_heads, shape.block_size, 2 * shape.head_size, dtype=shape.dtype)
    return cache.uniform_(-1.0, 1.0, generator=generator)


def shared_prefix_batch(shape: DecodeShape, batch: int, shared: int, context: int,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random cache, block table and seq_lens (on the host) of `batch` requests of `context` tokens whose
    first `shared` tokens (whole blocks) are the same blocks."""
    bs = shape.block_size
    shared_blocks, private_blocks = shared // bs, blocks(context - shared, bs)
    cache = random_cache(shared_blocks + batch * private_blocks, shape, generator)
    private = shared_blocks + torch.arange(batch * private_blocks, dtype=torch.int32).reshape(batch, -1)
    table = torch.cat([torch.arange(shared_blocks, dtype=torch.int32).expand(batch, -1), private], dim=1)
    return cache, table, torch.full((batch,), context, dtype=torch.int32)


def tree_paths(shape: DecodeShape, query_len: int,
               device: torch.device = torch.device("cpu")) -> dict[str, Callable[[], torch.Tensor]]:
    """The engine's two ways to attend the probe's requests with `query_len` new tokens each, on the same
    inputs on `device`: "tree" (tpp_decode, planned as the engine's StepPlanner plans a step of rows of
    several tokens) and "per_request" (paged_prefill). Each call returns its output."""
    from vllm_chunkattn.kernels import ops
    from vllm_chunkattn.prefix.step import StepPlanner

    probe, support = probe_for(device), for_platform(device.type == "cuda")
    gen = torch.Generator().manual_seed(1)
    shared = blocks(probe.shared_tokens, shape.block_size) * shape.block_size
    cache, table, lens = shared_prefix_batch(shape, probe.requests, shared,
                                             shared + probe.private_tokens + query_len, gen)
    query_lens = torch.full((probe.requests,), query_len, dtype=torch.int32)
    qsl = torch.arange(probe.requests + 1, dtype=torch.int32) * query_len
    query = torch.empty(probe.requests * query_len, shape.num_heads, shape.head_size, dtype=shape.dtype)
    query.uniform_(-1.0, 1.0, generator=gen)
    cache, query, device_table, device_lens, qsl = (t.to(device) for t in (cache, query, table, lens, qsl))
    tree_out, per_request_out = torch.empty_like(query), torch.empty_like(query)
    scale = shape.head_size**-0.5
    planner = StepPlanner(shape, own_node_min_query_len=support.own_node_min_query_len)
    plan = planner.plan(device_table, device_lens, lens, query_lens).plan
    return {"tree": lambda: ops.tpp_decode(query, cache, plan, scale, tree_out),
            "per_request": lambda: ops.paged_prefill(query, cache, qsl, device_lens, device_table, scale,
                                                     per_request_out)}


# ---------------------------------------------------------------- the measurement


def evict_caches(device: torch.device) -> Callable[[], None]:
    """What to call before each timed call on `device`: on CPU a cache eviction (its buffer is allocated
    here, once per search), on CUDA nothing."""
    return CacheFlusher() if device.type == "cpu" else (lambda: None)


def tree_gain(shape: DecodeShape, query_len: int, device: torch.device = torch.device("cpu"),
              flush: Callable[[], None] | None = None) -> float:
    """The per-request prefill's fastest call over the tree path's on tree_paths(shape, query_len, device).
    Minima, not medians: on a shared 2-core VM the median gain of fp32 32/8 heads at 16 rows per KV head
    ranged 0.98x to 1.17x over six probes and the minimum 1.06x to 1.12x (the relay grid: 1.14x); what other
    tenants take from one call says nothing about which path is faster. On CPU each call starts from evicted
    caches, as a serving step finds its KV (and as the tile tuner and the relay grid time): warm, a GQA
    probe's KV (25 MiB for fp32 16/4 heads) sits in the L3 and the paths' memory traffic is not compared.
    `flush`: the eviction to call (default: evict_caches(device)), so that a search builds its buffer once."""
    paths = tree_paths(shape, query_len, device)
    if flush is None:
        flush = evict_caches(device)

    def run(path: str) -> list[float]:
        flush()
        return [timed(paths[path], device)]

    fastest = interleaved_timings(list(paths), run, probe_for(device).repeats, statistic=min)
    return fastest["per_request"][0] / fastest["tree"][0]


def measure_reach(shape: DecodeShape, device: torch.device = torch.device("cpu")) -> tuple[int, dict[str, float]]:
    """The most query rows per KV head (q x group for q = 1, 2, 4, ...) up to which the tree path was at
    least as fast as the per-request prefill at every q on `device`, with the kernels as they are set now;
    and, per q x group timed, the per-request time over the tree path's."""
    flush = evict_caches(device)
    reach, measured = shape.group, {}
    query_len = 2
    while query_len * shape.group <= probe_for(device).max_rows_per_kv_head:
        gain = tree_gain(shape, query_len, device, flush)
        measured[str(query_len * shape.group)] = round(gain, 4)
        if gain < 1.0:
            break
        reach = query_len * shape.group
        query_len *= 2
    return reach, measured


@functools.cache
def cuda_reach(shape: DecodeShape, device: torch.device) -> int:
    """The tree path's reach for `shape` on CUDA `device`, measured once per process and logged. If the
    probe's batch does not fit beside vLLM's KV cache, the platform's value (kernels/support.py)."""
    fallback = for_platform(True).tree_max_rows_per_kv_head
    start = time.perf_counter()
    try:
        reach, measured = measure_reach(shape, device)
    except torch.OutOfMemoryError:
        logger.warning("chunkattn: no GPU memory left to measure the tree path's reach for %s; using %d query "
                       "rows per KV head (kernels/support.py).", shape.describe(), fallback)
        return fallback
    finally:
        torch.cuda.empty_cache()
    logger.info("chunkattn CUDA kernels on %s, %s: tree_max_rows_per_kv_head=%d (measured in %.1f s; per-request "
                "time over the tree path's per q x group: %s).", torch.cuda.get_device_name(device),
                shape.describe(), reach, time.perf_counter() - start, measured)
    return reach
