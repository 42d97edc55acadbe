"""Tile parameters of the CPU kernels and the tree path's reach, measured on the CPU they run on.

The fastest tile sizes depend on the CPU: how much fits its L1 and L2, how
many loads it issues per cycle, how far ahead its memory must be asked for.
A kernel tuned on one CPU lost to vLLM's on another, so the parameters are not
constants (csrc/cpu/kernels.h, `CpuTuning`):

  prefill_tile_rows   query rows (new tokens x GQA group) per prefill work item
  lanes_tile_keys     keys per matrix-matrix tile (shared decode, prefill)
  prefetch_distance   KV tiles prefetched ahead by the per-request decode tile
  decode_qk_inline    1: decode's matrix-matrix tiles inline the bf16 Q.K
                      register block (7 to 11% faster shared decode on a Zen 4;
                      out of line it cured a register spill on a Zen 5)
  lanes_prefetch_spread  how gently the matrix-matrix tiles prefetch the next
                      tile: a line every `spread` steps of a register block
                      (a Zen 4's best was 1; a Zen 3 chose 4 or 8 in fp32,
                      up to 1.17x faster on nodes of 32 query rows per KV head)

Nor is the point where a request with several new tokens stops gaining from
the prefix-tree path and is better served by the per-request prefill, so it is
measured too, with the tiles chosen, as `ShapeTuning.tree_max_rows_per_kv_head`
(kernels/tree_reach.py).

`ensure_tuned(shape)` runs once per process and layer shape, at engine start
(the metadata builder calls it). It reads the values from a cache file
keyed by the CPU (`cpu_info.cpu_description()`), the kernel build (a hash of
the compiled library), the shape and the reach probe's batch; without one, it measures: coordinate
descent over `CANDIDATES` in `SEARCH_STEPS` (the lanes tile's keys and prefetch
pace jointly), each step timed on the synthetic workloads its parameters
affect (`WORKLOADS`) with the caches evicted before each call (as a serving
step finds them: the other layers' weights and KV pass through in between;
measured warm, a Zen 3 chose the prefetch pace that is 1.17x slower from
memory), candidates interleaved in rotating order, a step of many candidates
timed again on its `FINALISTS` with more repeats (a step of few
candidates: any value its one round puts ahead of the current one, timed
again against it), a change kept only if it beats the current value by
`MIN_GAIN` in the last round; then, with those tiles, the
tree path's reach. That takes seconds (13 to 33 on a 2-core Zen 4);
the result goes to the cache file and into the kernels, and is logged once.
A cache file that cannot be read or does not match is measured again; the
values change speed only, never results.

`CHUNKATTN_CPU_TUNING=default` skips all of this and runs the built-in values.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_chunkattn import _C
from vllm_chunkattn.kernels.cpu_info import CacheFlusher, cpu_description
from vllm_chunkattn.kernels import tree_reach
from vllm_chunkattn.kernels.support import CPU, tree_max_query_len
from vllm_chunkattn.kernels.tree_reach import blocks, interleaved_timings, random_cache, shared_prefix_batch, timed
from vllm_chunkattn.prefix.plan import DecodeShape

logger = logging.getLogger("vllm.chunkattn.kernels")  # in vLLM's hierarchy, see plugin.py

ENV_VAR = "CHUNKATTN_CPU_TUNING"
MODES = ("auto", "default")

# Candidate values per parameter, the built-in default among them.
CANDIDATES: dict[str, tuple[int, ...]] = {
    "prefill_tile_rows": (32, 64, 128, 256),
    "lanes_tile_keys": (64, 128, 256, 512),
    "prefetch_distance": (0, 1, 2),
    "decode_qk_inline": (0, 1),
    "lanes_prefetch_spread": (1, 2, 4, 8, 16),
}
# The synthetic workloads whose time each parameter changes.
WORKLOADS: dict[str, tuple[str, ...]] = {
    "prefill_tile_rows": ("prefill",),
    "lanes_tile_keys": ("prefill", "shared_decode"),
    "prefetch_distance": ("private_decode",),
    "decode_qk_inline": ("shared_decode",),
    "lanes_prefetch_spread": ("prefill", "short_prefill", "shared_decode", "small_node_decode"),
}
# The order of the coordinate descent; parameters in one step are searched jointly. The tile's keys and
# its prefetch pace act together (how much the tile holds, how gently it asks for the next): searched
# one after the other, a Zen 3 stopped at 256 keys and spread 1 where 128 keys at spread 8 was up to
# 1.25x faster.
SEARCH_STEPS: tuple[tuple[str, ...], ...] = (
    ("prefill_tile_rows",),
    ("lanes_tile_keys", "lanes_prefetch_spread"),
    ("prefetch_distance",),
    ("decode_qk_inline",),
)
MIN_GAIN = 0.03  # a candidate must be this much faster than the current value to replace it
REPEATS = 5
# A step of more candidates than FINALISTS screens them all with SCREEN_REPEATS, then times the FINALISTS
# fastest and the current value again with FINAL_REPEATS: of many candidates whose costs lie within their
# noise, the fastest of one round is often only the luckiest. A step of fewer times them with REPEATS, and
# the value that round puts first, unless it is the current one, is timed again head to head with the
# current value with FINAL_REPEATS: one round is one sample of a noisy machine, both ways (a Zen 4's bf16
# 16-head tuning once took prefetch distance 0 at 0.85 of distance 1's time in one round, 1.03 to 1.06 timed
# again; a Zen 5's fp32 32-head tuning once kept distance 1 with 0 at 0.97 in its one round, where 0 is
# 0.83 to 0.89 of 1's time in decode and measured 0.87 in two tunings after).
FINALISTS = 4
SCREEN_REPEATS = 3
FINAL_REPEATS = 8
# The private-decode workload's KV: well beyond a last-level cache, so that
# prefetching matters as it does in serving.
PRIVATE_DECODE_KV_BYTES = 64 << 20
CACHE_VERSION = 8


_DEFAULTS = _C.cpu_tuning_defaults()  # csrc/cpu/kernels.h: the built-in values


@dataclasses.dataclass(frozen=True)
class CpuTuning:
    prefill_tile_rows: int = _DEFAULTS["prefill_tile_rows"]
    lanes_tile_keys: int = _DEFAULTS["lanes_tile_keys"]
    prefetch_distance: int = _DEFAULTS["prefetch_distance"]
    decode_qk_inline: int = _DEFAULTS["decode_qk_inline"]
    lanes_prefetch_spread: int = _DEFAULTS["lanes_prefetch_spread"]

    def apply(self) -> None:
        """Sets these values in the compiled kernels (checked against their limits there)."""
        _C.set_cpu_tuning(dataclasses.asdict(self))

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


@dataclasses.dataclass(frozen=True)
class ShapeTuning:
    """What a layer shape runs with on this CPU: the kernels' tile parameters, and which requests take
    the prefix-tree path (those whose new tokens x GQA group are at most tree_max_rows_per_kv_head)."""

    tiles: CpuTuning
    tree_max_rows_per_kv_head: int

    def tree_max_query_len(self, group: int) -> int:
        return tree_max_query_len(self.tree_max_rows_per_kv_head, group)

    def describe(self) -> str:
        return f"{self.tiles.describe()}, tree_max_rows_per_kv_head={self.tree_max_rows_per_kv_head}"


def built_in() -> ShapeTuning:
    """The values the kernels were written around (CHUNKATTN_CPU_TUNING=default)."""
    return ShapeTuning(CpuTuning(), CPU.tree_max_rows_per_kv_head)


def current() -> CpuTuning:
    """The values the compiled kernels run with now."""
    return CpuTuning(**_C.cpu_tuning())


def mode() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(MODES)}; got {value!r}")
    return value


@functools.cache
def kernel_build() -> str:
    """A hash of the compiled CPU kernel library: a rebuild invalidates every cached tuning."""
    return hashlib.sha256(Path(_C.__file__).read_bytes()).hexdigest()[:16]


def tuning_key(shape: DecodeShape) -> dict:
    """What a cached tuning is valid for: this CPU, this kernel build and ISA, this layer shape, this many threads,
    the batch the tree path's reach is timed on."""
    return {
        "version": CACHE_VERSION,
        "reach_probe": dataclasses.asdict(tree_reach.CPU_PROBE),
        "cpu": cpu_description(),
        "isa": str(torch.ops.chunkattn.cpu_isa()),
        "kernel_build": kernel_build(),
        "threads": torch.get_num_threads(),
        "shape": {"num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads, "head_size": shape.head_size,
                  "block_size": shape.block_size, "dtype": shape.dtype_name},
    }


def cache_dir() -> Path:
    """Under vLLM's cache root (VLLM_CACHE_ROOT, default ~/.cache/vllm)."""
    import vllm.envs

    return Path(vllm.envs.VLLM_CACHE_ROOT) / "chunkattn" / "cpu-tuning"


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{digest}.json"


def load(path: Path, key: dict) -> ShapeTuning | None:
    """The tuning cached at `path` for `key`, or None (with the reason logged) if it is missing or unusable."""
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
        if record["key"] != key:
            raise ValueError("it was measured for another CPU, kernel build or shape")
        fields = {f.name for f in dataclasses.fields(CpuTuning)}
        if set(record["tuning"]) != fields:
            raise ValueError(f"its parameters are {sorted(record['tuning'])}, not {sorted(fields)}")
        tiles = CpuTuning(**record["tuning"])
        limits = {**_C.cpu_tuning_limits(),
                  "tree_max_rows_per_kv_head": (1, tree_reach.CPU_PROBE.max_rows_per_kv_head)}
        tuning = ShapeTuning(tiles, record["tree_max_rows_per_kv_head"])
        for name, value in [*dataclasses.asdict(tiles).items(),
                            ("tree_max_rows_per_kv_head", tuning.tree_max_rows_per_kv_head)]:
            lo, hi = limits[name]
            if not (isinstance(value, int) and lo <= value <= hi):
                raise ValueError(f"{name}={value!r} is outside [{lo}, {hi}]")
        return tuning
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("chunkattn: ignoring the CPU tuning cache %s (%s); measuring again.", path, e)
        return None


def save(path: Path, key: dict, tuning: ShapeTuning, measured: dict, seconds: float) -> None:
    """Writes the record atomically (a reader never sees half a file); a read-only cache only costs a warning."""
    record = {"key": key, "tuning": dataclasses.asdict(tuning.tiles),
              "tree_max_rows_per_kv_head": tuning.tree_max_rows_per_kv_head, "measured": measured,
              "seconds": round(seconds, 2), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        logger.warning("chunkattn: could not write the CPU tuning cache %s (%s); it will be measured again.", path, e)


# ---------------------------------------------------------------- measurement


def workloads(shape: DecodeShape) -> dict[str, Callable[[], None]]:
    """One call per synthetic workload of `shape`, small enough that measuring takes seconds:
    prefill        8 requests x 256 new tokens after 768 cached
    short_prefill  the same requests' last 16 tokens, blocks scattered over the cache as a
                   running server leaves them: few rows per KV read, as a burst of requests
                   behind cached prompts, where how evenly the next tile is asked for counts
                   (on a Zen 5, fp32 32 x 16 new tokens after 2048 ran 1.29x faster at
                   lanes_prefetch_spread 2 than at 1; the other workloads within 1%)
    shared_decode  32 requests sharing 1024 tokens, 1 private token each
    small_node_decode  8 requests sharing 2048 tokens, 1 private token each (the
                   serving benchmark's nodes: 32 query rows per KV head with GQA 4)
    private_decode 8 requests, nothing shared, PRIVATE_DECODE_KV_BYTES of KV in all."""
    from vllm_chunkattn.kernels import ops
    from vllm_chunkattn.prefix.tree import PrefixTreeCache

    gen = torch.Generator().manual_seed(0)
    bs, heads, d = shape.block_size, shape.num_heads, shape.head_size
    scale = d**-0.5
    calls: dict[str, Callable[[], None]] = {}

    # prefill
    reqs, new, ctx = 8, 256, 1024
    per_req = blocks(ctx, bs)
    cache = random_cache(reqs * per_req, shape, gen)
    table = torch.arange(reqs * per_req, dtype=torch.int32).reshape(reqs, per_req)
    seq_lens = torch.full((reqs,), ctx, dtype=torch.int32)
    qsl = torch.arange(reqs + 1, dtype=torch.int32) * new
    query = torch.empty(reqs * new, heads, d, dtype=shape.dtype).uniform_(-1.0, 1.0, generator=gen)
    out = torch.empty_like(query)
    calls["prefill"] = lambda: ops.paged_prefill(query, cache, qsl, seq_lens, table, scale, out)
    short = 16
    scattered = torch.randperm(reqs * per_req, generator=gen).to(torch.int32)[table.long()]
    short_qsl = torch.arange(reqs + 1, dtype=torch.int32) * short
    short_query = query[: reqs * short]
    short_out = out[: reqs * short]
    calls["short_prefill"] = lambda: ops.paged_prefill(short_query, cache, short_qsl, seq_lens, scattered, scale,
                                                       short_out)

    def decode(batch: int, shared: int, context: int) -> Callable[[], None]:
        kv, table, lens = shared_prefix_batch(shape, batch, shared, context, gen)
        q = torch.empty(batch, heads, d, dtype=shape.dtype).uniform_(-1.0, 1.0, generator=gen)
        o = torch.empty_like(q)
        plan = ops.plan_tpp_decode(shape, table, lens, PrefixTreeCache().get(table, lens, bs))
        return lambda: ops.tpp_decode(q, kv, plan, scale, o)

    shared = blocks(1024, bs) * bs
    calls["shared_decode"] = decode(32, shared, shared + 1)
    calls["small_node_decode"] = decode(8, 2 * shared, 2 * shared + 1)
    token_bytes = shape.num_kv_heads * 2 * d * shape.dtype.itemsize
    batch = 8
    context = max(bs, min(16384, PRIVATE_DECODE_KV_BYTES // token_bytes // batch // bs * bs))
    calls["private_decode"] = decode(batch, 0, context)
    return calls


def step_name(names: tuple[str, ...]) -> str:
    return "+".join(names)


def candidate_name(values: tuple[int, ...]) -> str:
    return "/".join(map(str, values))


def _time_candidates(names: tuple[str, ...], candidates: list[tuple[int, ...]], base: CpuTuning,
                     calls: list[Callable[[], None]], flush: Callable[[], None], repeats: int) -> dict:
    """Per candidate (values of `names`): the sum over `calls` of each call's fastest time relative to the
    first candidate's, each call timed after `flush` has evicted the caches (from the same state every
    time, a call is only ever slowed by what else the machine does, so the fastest is the least noisy)."""

    def run(values: tuple[int, ...]) -> list[float]:
        dataclasses.replace(base, **dict(zip(names, values))).apply()
        times = []
        for call in calls:
            flush()
            times.append(timed(call))
        return times

    fastest = interleaved_timings(candidates, run, repeats, min)
    first = fastest[candidates[0]]
    return {c: sum(t / t0 for t, t0 in zip(fastest[c], first)) for c in candidates}


def _beats(cost: dict, candidate: tuple[int, ...], now: tuple[int, ...]) -> bool:
    """Whether `candidate` is MIN_GAIN faster than the current value in one round's relative costs."""
    return cost[candidate] < cost[now] * (1.0 - MIN_GAIN)


def measure(shape: DecodeShape) -> tuple[ShapeTuning, dict]:
    """Coordinate descent from the default tiles over SEARCH_STEPS, then the tree path's reach with the
    tiles chosen (module docstring). Returns the tuning and, per step, each candidate's relative time
    (for a step timed twice, also the first round's)."""
    calls = workloads(shape)
    flush = CacheFlusher()
    best = CpuTuning()
    measured: dict[str, dict[str, float]] = {}
    try:
        for names in SEARCH_STEPS:
            now = tuple(getattr(best, n) for n in names)
            candidates = [now] + [c for c in itertools.product(*(CANDIDATES[n] for n in names)) if c != now]
            step_calls = [calls[w] for w in dict.fromkeys(w for n in names for w in WORKLOADS[n])]
            screen = len(candidates) > FINALISTS
            cost = _time_candidates(names, candidates, best, step_calls, flush, SCREEN_REPEATS if screen else REPEATS)
            winner = min(cost, key=cost.get)
            if screen or winner != now:
                # The second round decides (FINAL_REPEATS, above).
                measured[f"{step_name(names)} (first round)"] = {candidate_name(c): round(v, 4)
                                                                 for c, v in cost.items()}
                finalists = [now] + ([c for c in sorted(cost, key=cost.get) if c != now][:FINALISTS]
                                     if screen else [winner])
                cost = _time_candidates(names, finalists, best, step_calls, flush, FINAL_REPEATS)
                winner = min(cost, key=cost.get)
            measured[step_name(names)] = {candidate_name(c): round(v, 4) for c, v in cost.items()}
            if _beats(cost, winner, now):
                best = dataclasses.replace(best, **dict(zip(names, winner)))
    finally:
        best.apply()
    reach, measured["tree_max_rows_per_kv_head"] = tree_reach.measure_reach(shape)
    return ShapeTuning(best, reach), measured


# ---------------------------------------------------------------- entry point

_tuned: dict[str, ShapeTuning] = {}


def ensure_tuned(shape: DecodeShape) -> ShapeTuning:
    """The tuning for `shape` on this CPU, its tiles applied to the kernels: from the cache, else
    measured (and cached). Once per process and shape; logged once."""
    if mode() == "default":
        tuning = built_in()
        tuning.tiles.apply()
        _log_once(f"chunkattn CPU kernels: built-in values ({ENV_VAR}=default): {tuning.describe()}.")
        return tuning
    key = tuning_key(shape)
    path = cache_path(key)
    if str(path) in _tuned:
        tuning = _tuned[str(path)]
        tuning.tiles.apply()
        return tuning
    tuning = load(path, key)
    if tuning is not None:
        how = f"from {path}"
    else:
        # Up to a minute on a small CPU, before the engine serves: say what the pause is.
        logger.info("chunkattn: measuring the CPU kernels' tile parameters for %s on this CPU (once per CPU, "
                    "kernel build and layer shape: seconds to a minute; %s=default skips it).",
                    shape.describe(), ENV_VAR)
        start = time.perf_counter()
        tuning, measured = measure(shape)
        seconds = time.perf_counter() - start
        save(path, key, tuning, measured, seconds)
        how = f"measured in {seconds:.1f} s, cached at {path}"
    tuning.tiles.apply()
    _tuned[str(path)] = tuning
    cpu = key["cpu"]
    _log_once(f"chunkattn CPU kernels on {cpu['cpu_model_name']} (family {cpu['cpu_family']} model "
              f"{cpu['cpu_model']}, {key['isa']}), {shape.describe()}: {tuning.describe()} ({how}).")
    return tuning


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)
