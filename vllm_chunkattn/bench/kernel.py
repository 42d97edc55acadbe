"""Decode-attention microbenchmark on this CPU (the paper's section 4.1).

Times one decode step of one attention layer, in one run and on the same
tensors, for:

    ours        chunkattn::tpp_decode (two-phase partition) over block tables
                that share the prefix's blocks
    PagedAttn   vLLM's CPU kernel (cpu_attention_with_kv_cache) with non-shared
                block tables
    PagedAttn*  vLLM's CPU kernel with the prefix's blocks physically shared
    Naive       matmul-softmax-matmul on dense [b, h, n, d] tensors
    SDPA        torch.nn.functional.scaled_dot_product_attention, same dense tensors

plus the per-step costs of ours, measured apart from the layer's kernel:
`rebuild` (tree.prefix_tree from the block tables, paid when the tree
changes), `lookup` (PrefixTreeCache.get when it did not) and `plan`
(ops.plan_tpp_decode), both paid once per step for all layers.

Correctness gate: before any timing, every implementation's output at a
point is compared with ours (bench/agreement.py, one tolerance per dtype);
a point where one differs by more is not timed, and the run exits 1 naming
the point, the implementation and the difference.

Roofline: the machine's rates are measured at the start and at the end of
the run (bench/machine.py): peak GFLOP/s of register-only loops per ISA
(vfmadd zmm and ymm, vdpbf16ps where the CPU has AVX512_BF16) and the read
bandwidth of a streaming sum over a buffer far larger than the last-level
cache, both with the threads the kernels use. A point's roofline is
max(distinct KV bytes / best bandwidth, flops / best peak of a loop that can
compute the dtype), flops = 4 * b * h * n * d, bytes the KV a step must read
(a shared chunk counted once): no implementation can take less time, so
time / roofline >= 1, and the report says loudly where a measured time is
below it (the model then misses something).

Grids:
    table3  the paper's Table 3: n_p in 1024/2048/4096, n_s in 0, n_p/2, 3n_p/4, n_p,
            batch 32, 32 heads, d 128, chunk 64
    fig3    Figure 3: 2048 shared prompt tokens + n_c = 64..2048 private (decoded) tokens
    fig4    Figure 4: batch 8..96 with n_p = 2048, n_s = 2048 and n_s = 1024
    tree    a two-level tree: 1024-token system prompt shared by 32 requests,
            4 groups of 8 sharing 512 more tokens, 256 private tokens each
    serve   the last decode step of each workload of the serving benchmark
            (bench/workloads.py) at its default max concurrency, block size and
            model's attention (bench/serve.py, testing/models.py): the prompt's
            shared tokens shared as the workload shares them, the rest of the
            prompt and the output private
    prefill chunkattn::paged_prefill vs vLLM's CPU kernel on causal prefill:
            8 requests x 512 new tokens after 512 cached ones (context 1024),
            and 8 x 512 new tokens from scratch; 32 heads, d 128, chunk 64
    relay   rows of several tokens sharing a cached prefix (RelayAttention's
            prompt phase, speculative decoding): 32 requests with q in 1, 2,
            4, 8, 16, 64 new tokens each after 2048 shared + 128 private
            tokens, 16 and 32 heads, GQA 1 and 4; the tree path (every query
            token a row of chunkattn::tpp_decode, prefix/query_rows.py)
            against our per-request chunkattn::paged_prefill and vLLM's
            kernel. The report names the most query rows per KV head (q x
            GQA group) up to which the tree path beats the per-request one
            at every point, beside the reach the engine measured for each
            shape at start (kernels/cpu_tuning.py), which decides the
            "engine's path" column
    offline the attention of one layer of the offline batch benchmark
            (bench/offline.py, its defaults, on the bench-gqa model's heads):
            a decode step halfway through the outputs (every request one row
            behind the system prompt) and a prompt step (as many requests'
            own tokens as fit max_num_batched_tokens behind the cached system
            prompt), in the relay grid's table: what the batch's attention
            takes in each backend and at its roofline

Timing: `--warmup` untimed calls of each implementation, then `--repeats`
repetitions; each repetition runs every implementation once, in an order that
rotates by one place per repetition (the VM's bandwidth drifts during a run:
no implementation always runs first or last), on the same inputs. The dense
baselines take part in the first 5 repetitions only: they are slow and not the
subject. Reported: median, and the spread (min to max) per implementation.
`--clock wall` (default) times wall-clock with torch's threads. On a machine
shared with other work, `--clock cpu` is the robust alternative: one thread,
and the calling thread's CPU time (time.thread_time), which excludes the time
the thread waits while other processes run; machine rates and rooflines are
then single-core.
Before each timed call the caches are flushed (a write of twice L2 + L3):
in a model, the layer's KV was evicted by the other layers since its last
step. `--warm` skips the flush; the roofline's memory term then counts only
the bytes that cannot all fit in the caches.

`--as-avx2-cpu` runs every implementation as on a CPU without AVX-512 (a
Zen 3, say): our kernels' AVX2 build (CHUNKATTN_CPU_ISA=avx2), vLLM's AVX2
build of its CPU kernels (vllm._C_AVX2, which vLLM loads where torch reports
no AVX-512), torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2) and oneDNN's
(ONEDNN_MAX_CPU_ISA=AVX2); the roofline's compute term then takes the AVX2
FMA peak. The process re-executes itself with that environment, which torch
reads when it loads.

Every results file records the machine (CPU, flags, caches, ISA of our
kernels, torch, vLLM, commit); if the output folder holds results from
another CPU, the report says so.

    python -m vllm_chunkattn.bench.kernel --grid all --dtype both --out results/kernel

Writes DIR/table.md, DIR/results.json and DIR/table3.png (needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from vllm_chunkattn.bench import agreement, machine
from vllm_chunkattn.kernels import cpu_tuning, ops
from vllm_chunkattn.kernels.cpu_info import CacheFlusher
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.kernels import layout
from vllm_chunkattn.prefix import tree
from vllm_chunkattn.prefix.query_rows import expand_query_rows, unstack_own_nodes
from vllm_chunkattn.kernels.support import CPU

IMPLS = ["ours", "PagedAttn", "PagedAttn*", "Naive", "SDPA"]
# Timed per point beside the implementations, paid once per engine step for all layers; not attention,
# so no roofline applies to them.
DECODE_BOOKKEEPING = ("tree rebuild", "tree lookup", "decode plan")  # columns of the decode tables
STEP_BOOKKEEPING = (*DECODE_BOOKKEEPING, "tree rows plan")
DENSE_IMPLS = ("Naive", "SDPA")
VLLM_DECODE_IMPLS = ("PagedAttn", "PagedAttn*")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DEFAULT_HEAD_SIZE = 128  # the paper's; --head-size takes the CPU kernels' others
# --as-avx2-cpu (module docstring): the environment the benchmark re-executes itself with.
AS_AVX2_CPU_MARKER = "CHUNKATTN_BENCH_AS_AVX2_CPU"  # set in the re-executed process
AS_AVX2_CPU_ENV = {"CHUNKATTN_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                   AS_AVX2_CPU_MARKER: "1"}
AVX2_PEAK_LOOPS = ("avx2_fma",)
DENSE_MAX_REPEATS = 5
GRIDS = ["table3", "fig3", "fig4", "tree", "serve", "prefill", "relay", "offline"]
PREFILL_GRIDS = ("prefill", "relay", "offline")  # PrefillPoint grids: against vLLM's prefill kernel only
MODEL_GRIDS = ("serve", "offline")  # shaped by a benchmark model: --head-size leaves them
# Share of the available memory a point's inputs may take; above it the dense
# baselines (a dense copy of every request's K and V) are left out of the point.
MEMORY_FRACTION = 0.8


@dataclasses.dataclass
class Workload:
    grid: str
    batch: int
    # (tokens, requests sharing them): the batch is cut into consecutive groups
    # of that many requests, each group with its own copy of the tokens.
    segments: list[tuple[int, int]]
    n_p: int  # prompt tokens
    n_s: int  # prompt tokens shared by the whole batch... or by a group (tree)
    n_c: int  # decoded (private) tokens after the prompt
    heads: int
    head_dim: int
    chunk: int
    dtype: str
    name: str = ""  # the serving benchmark's workload, for the serve grid
    window: int = 0  # vLLM's sliding window (--sliding-window); 0: none
    sinks: bool = False  # a sink logit per head (--sinks), as gpt-oss's

    @property
    def kv_heads(self) -> int:
        """The decode grids are MHA."""
        return self.heads

    @property
    def context(self) -> int:
        return sum(tokens for tokens, _ in self.segments)

    def visible_segments(self) -> list[tuple[int, int]]:
        """`segments` less the leading tokens outside every request's window (all
        requests have the same context): what a step must read at all."""
        hidden = max(0, self.context - self.window) if self.window else 0
        visible = []
        for tokens, group in self.segments:
            dropped = min(tokens, hidden)
            hidden -= dropped
            if tokens > dropped:
                visible.append((tokens - dropped, group))
        return visible

    def label(self) -> str:
        return (f"{self.grid}{' ' + self.name if self.name else ''} {self.dtype} b={self.batch} n_p={self.n_p} "
                f"n_s={self.n_s} n_c={self.n_c} h={self.heads} d={self.head_dim} c={self.chunk}"
                + (f" W={self.window}" if self.window else "") + (" sinks" if self.sinks else ""))


def serve_points(dtype: str, quick: bool) -> list[Workload]:
    """The last decode step of each serving-benchmark workload (the largest context of the run), with
    its default max concurrency as the batch, its block size as the chunk and its model's attention."""
    from vllm_chunkattn.bench import serve
    from vllm_chunkattn.bench.workloads import workloads
    from vllm_chunkattn.testing.models import SPECS

    defaults = serve.parse_args(["--quick"] if quick else [])
    spec = SPECS["tiny-mha" if quick else "bench"]
    if spec["num_key_value_heads"] != spec["num_attention_heads"]:
        raise ValueError("the kernel benchmark times multi-head attention (as many KV heads as query heads)")
    batch, chunk = defaults.max_concurrency, defaults.block_size
    points = []
    for w in workloads(quick).values():
        private = w.prompt_tokens - w.shared_tokens + w.output_tokens
        if w.tree is not None:
            segments = [(w.tree.system_tokens, batch), (w.tree.document_tokens, batch // w.tree.num_groups)]
        elif w.shared_tokens:
            segments = [(w.shared_tokens, batch // w.num_prompts_multiple)]
        else:
            segments = []
        points.append(Workload("serve", batch, segments + [(private, 1)], w.prompt_tokens, w.shared_tokens,
                               w.output_tokens, spec["num_attention_heads"], spec["head_dim"], chunk, dtype, w.name))
    return points


def grid_points(grid: str, dtype: str, quick: bool) -> list[Workload]:
    h, d, c = (4, 64, 16) if quick else (32, 128, 64)
    points: list[Workload] = []

    def simple(batch: int, n_p: int, n_s: int, n_c: int = 0) -> Workload:
        segments = [(n_s, batch), (n_p - n_s + n_c, 1)]
        return Workload(grid, batch, [s for s in segments if s[0] > 0], n_p, n_s, n_c, h, d, c, dtype)

    if grid == "table3":
        for n_p in ([128, 256] if quick else [1024, 2048, 4096]):
            for n_s in (0, n_p // 2, 3 * n_p // 4, n_p):
                points.append(simple(4 if quick else 32, n_p, n_s))
    elif grid == "fig3":
        n_p = 128 if quick else 2048
        for n_c in ([16, 64] if quick else [64, 128, 256, 512, 1024, 2048]):
            points.append(simple(4 if quick else 32, n_p, n_p, n_c))
    elif grid == "fig4":
        n_p = 128 if quick else 2048
        for n_s in (n_p, n_p // 2):
            for batch in ([2, 6] if quick else [8, 16, 32, 48, 64, 96]):
                points.append(simple(batch, n_p, n_s))
    elif grid == "tree":
        system, group_tokens, private, group, batch = (64, 32, 16, 2, 4) if quick else (1024, 512, 256, 8, 32)
        points.append(Workload(grid, batch, [(system, batch), (group_tokens, group), (private, 1)],
                               system + group_tokens + private, system + group_tokens, 0, h, d, c, dtype))
    elif grid == "serve":
        points = serve_points(dtype, quick)
    else:
        raise ValueError(grid)
    return points


# ---------------------------------------------------------------------------
# Tensors


def block_tables(w: Workload, shared: bool, rng: np.random.Generator) -> tuple[torch.Tensor, int]:
    """[batch, blocks] int32 block table and the number of physical blocks.
    Blocks are scattered over the cache (a random permutation), as a running
    server's free list leaves them."""
    rows: list[list[int]] = [[] for _ in range(w.batch)]
    num_blocks = 0
    for tokens, group in w.segments:
        nblk = -(-tokens // w.chunk)
        group = group if shared else 1
        for g0 in range(0, w.batch, group):
            ids = list(range(num_blocks, num_blocks + nblk))
            num_blocks += nblk
            for b in range(g0, min(g0 + group, w.batch)):
                rows[b].extend(ids)
    perm = rng.permutation(num_blocks)
    return torch.from_numpy(perm[np.array(rows)].astype(np.int32)), num_blocks


def physically_shared_table(private_table: torch.Tensor, shared_table: torch.Tensor) -> torch.Tensor:
    """A table over the blocks of `private_table` that shares what `shared_table` shares:
    every request reads, for each shared block, the copy of the first request holding it."""
    flat_shared = shared_table.flatten().numpy()
    _, first, inverse = np.unique(flat_shared, return_index=True, return_inverse=True)
    owner = private_table.flatten().numpy()[first]
    return torch.from_numpy(owner[inverse].reshape(shared_table.shape).astype(np.int32))


def random_cache(num_blocks: int, w: Workload, dtype: torch.dtype) -> torch.Tensor:
    kv = torch.empty(num_blocks, w.heads, w.chunk, 2 * w.head_dim, dtype=dtype)
    step = max(1, (1 << 26) // (w.heads * w.chunk * 2 * w.head_dim))
    for b0 in range(0, num_blocks, step):
        kv[b0 : b0 + step].uniform_(-2.0, 2.0)
    return kv


def vllm_cache(src: torch.Tensor, src_table: torch.Tensor, dst_table: torch.Tensor, num_dst_blocks: int):
    """A cache in vLLM's CPU layout (K packed by cpu_attn_reshape_and_cache) whose
    block dst_table[b, j] holds the data of our block src_table[b, j]."""
    from vllm import _custom_ops as vops

    _, heads, chunk, two_d = src.shape
    d = two_d // 2
    kv = torch.zeros(num_dst_blocks, heads, chunk, two_d, dtype=src.dtype)
    key_cache, value_cache = kv.view(num_dst_blocks, heads, 2 * chunk, d).chunk(2, dim=2)
    pairs: dict[int, int] = {}
    for s, t in zip(src_table.flatten().tolist(), dst_table.flatten().tolist()):
        pairs[t] = s
    dst = torch.tensor(sorted(pairs), dtype=torch.long)
    srcs = torch.tensor([pairs[t] for t in dst.tolist()], dtype=torch.long)
    step = max(1, 4096 // chunk)
    rows = torch.arange(chunk)
    for i in range(0, len(dst), step):
        s, t = srcs[i : i + step], dst[i : i + step]
        keys, values = (x.permute(0, 2, 1, 3).reshape(-1, heads, d) for x in layout.read_blocks(src, s))
        slots = (t[:, None] * chunk + rows[None, :]).reshape(-1)
        vops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, _vllm_isa(src.dtype, chunk))
    return kv, key_cache, value_cache


def _vllm_isa(dtype: torch.dtype, chunk: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, chunk)
    if isa == "amx":
        # Linux hands a process AMX's tile state only once it asks
        # (arch_prctl ARCH_REQ_XCOMP_PERM); vLLM's AMX kernels assume it has, and
        # die of SIGILL otherwise. In the engine oneDNN's bf16 linear layers have
        # asked before the first attention; here nothing else runs first.
        if not torch.cpu._init_amx():
            raise RuntimeError("vLLM chose its AMX attention kernel, but this process was refused AMX's tile state")
    return isa


def dense_kv(src: torch.Tensor, table: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, h, n, d] key and value tensors gathered from the paged cache."""
    batch, heads, d = table.shape[0], src.shape[1], src.shape[3] // 2
    keys = torch.empty(batch, heads, context, d, dtype=src.dtype)
    values = torch.empty_like(keys)
    for b in range(batch):
        blocks = table[b].long()
        k, v = layout.read_blocks(src, blocks)
        keys[b] = k.permute(1, 0, 2, 3).reshape(heads, -1, d)[:, :context]
        values[b] = v.permute(1, 0, 2, 3).reshape(heads, -1, d)[:, :context]
    return keys, values


def memory_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


# ---------------------------------------------------------------------------
# Timing


_CLOCK: Callable[[], float] = time.perf_counter


def measure(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """ms per call of one function on its own (the tree costs: Python, no flush)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = _CLOCK()
        fn()
        times.append((_CLOCK() - t0) * 1e3)
    return times


@dataclasses.dataclass
class Candidate:
    """One implementation, ready to run on a point's inputs."""
    name: str
    step: Callable[[], torch.Tensor]  # one call; returns the output ([b, h, d] decode, [T, h, d] prefill)
    repeats: int  # repetitions it takes part in (the first ones)
    timed: bool = True  # False: run once for the correctness check only


def interleaved_order(names: list[str], repetition: int) -> list[str]:
    """The order of repetition `repetition`: rotated by one place per repetition, so that
    over len(names) repetitions every implementation runs once in every position."""
    if not names:
        return []
    k = repetition % len(names)
    return names[k:] + names[:k]


def time_interleaved(candidates: list[Candidate], repeats: int, warmup: int,
                     flush: Callable[[], None] | None) -> dict[str, list[float]]:
    """ms per call of each timed candidate: `warmup` untimed calls each, then `repeats` repetitions of
    one call per candidate in `interleaved_order`; a flush before each timed call."""
    timed = {c.name: c for c in candidates if c.timed}
    for c in timed.values():
        for _ in range(warmup):
            c.step()
    times: dict[str, list[float]] = {name: [] for name in timed}
    for repetition in range(repeats):
        for name in interleaved_order(list(timed), repetition):
            if len(times[name]) >= timed[name].repeats:
                continue
            if flush is not None:
                flush()
            t0 = _CLOCK()
            timed[name].step()
            times[name].append((_CLOCK() - t0) * 1e3)
    return times


@dataclasses.dataclass
class PointResult:
    times: dict[str, list[float]]  # ms per implementation (empty when the point failed its check)
    diffs: dict[str, float]  # max |diff| vs ours per other implementation
    disagreements: list[agreement.Disagreement]
    skipped: dict[str, str]  # implementation -> why it was left out of this point


def check(label: str, dtype: torch.dtype, candidates: list[Candidate]) -> PointResult:
    """One call of each candidate, outputs compared with ours; no timing yet."""
    outputs = {c.name: c.step().clone() for c in candidates}
    diffs = {name: agreement.max_abs_diff(out, outputs["ours"]) for name, out in outputs.items() if name != "ours"}
    return PointResult({}, diffs, agreement.check(label, dtype, diffs, reference="ours"), {})


def check_and_time(label: str, dtype: torch.dtype, candidates: list[Candidate], repeats: int, warmup: int,
                   flush: Callable[[], None] | None) -> PointResult:
    """One call of each candidate; outputs compared with ours; only if they agree, the timing."""
    result = check(label, dtype, candidates)
    if not result.disagreements:
        result.times = time_interleaved(candidates, repeats, max(0, warmup - 1), flush)
    return result


# ---------------------------------------------------------------------------
# Roofline


def element_size(dtype: str) -> int:
    return torch.tensor([], dtype=DTYPES[dtype]).element_size()


def distinct_kv_bytes(w: Workload) -> int:
    """KV bytes one step must read: a shared chunk once."""
    tokens = sum(tokens * -(-w.batch // group) for tokens, group in w.visible_segments())
    return tokens * w.heads * w.head_dim * 2 * element_size(w.dtype)


def visible_context(w: Workload) -> int:
    return sum(tokens for tokens, _ in w.visible_segments())


def unshared_kv_bytes(w: Workload) -> int:
    return w.batch * visible_context(w) * w.heads * w.head_dim * 2 * element_size(w.dtype)


def decode_flops(w: Workload) -> int:
    return 4 * w.batch * w.heads * visible_context(w) * w.head_dim


def cache_bytes(machine_record: dict) -> int:
    return sum(c["kib"] * c["instances"] for c in machine_record.get("caches", {}).values()) * 1024


def memory_term_bytes(nbytes: int, flushed: bool, machine_record: dict) -> int:
    """Bytes that must come from memory: all of them after a flush; warm, what cannot fit in the caches."""
    return nbytes if flushed else max(0, nbytes - cache_bytes(machine_record))


# ---------------------------------------------------------------------------
# One point


def run_point(w: Workload, impls: list[str], repeats: int, warmup: int, flush: Callable[[], None] | None,
              rng: np.random.Generator, windows: tuple[int, ...] | None = None) -> list[PointResult]:
    """The point once per window in `windows` (default: its own), on the same inputs, every window's
    implementations timed in one interleaved rotation: how much speedup a window keeps is a ratio of
    ratios, and the VM's drift between two back-to-back timings would be most of it. One result per window;
    each window's outputs are checked against ours under the same window."""
    windows = windows or (w.window,)
    dtype = DTYPES[w.dtype]
    scale = w.head_dim**-0.5
    seq_lens = torch.full((w.batch,), w.context, dtype=torch.int32)
    query = torch.empty(w.batch, w.heads, w.head_dim, dtype=dtype).uniform_(-2.0, 2.0)
    qsl = torch.arange(w.batch + 1, dtype=torch.int32)
    skipped: dict[str, str] = {}

    shared_table, shared_blocks = block_tables(w, True, rng)
    cache = random_cache(shared_blocks, w, dtype)

    # Ours is always run: it is the reference of the correctness check, timed only if asked for.
    ctx_cache = tree.PrefixTreeCache()
    ctx = ctx_cache.get(shared_table, seq_lens, w.chunk)
    # The plan is built once per engine step for all layers; its cost is reported apart ("decode plan").
    shape = DecodeShape.of_layer(query, cache)
    plan = ops.plan_tpp_decode(shape, shared_table, seq_lens, ctx)

    # Sinks near the log of the keys' count: each takes a real share of its head's softmax.
    sinks = (torch.from_numpy(rng.standard_normal(w.heads)).float() + math.log(w.context)) if w.sinks else None

    def ours(window: int) -> Callable[[], torch.Tensor]:
        out = torch.empty_like(query)

        def step() -> torch.Tensor:
            ops.tpp_decode(query, cache, plan, scale, out, window, sinks=sinks)
            return out

        return step

    by_window: dict[int, list[Candidate]] = {
        window: [Candidate("ours", ours(window), repeats, timed="ours" in impls)] for window in windows}

    vllm_blocks = 0
    if "PagedAttn" in impls or "PagedAttn*" in impls:
        from vllm import _custom_ops as vops

        if "PagedAttn" in impls:
            private_table, vllm_blocks = block_tables(w, False, rng)
            _, key_cache, value_cache = vllm_cache(cache, shared_table, private_table, vllm_blocks)
            tables = {"PagedAttn": private_table, "PagedAttn*": physically_shared_table(private_table, shared_table)}
        else:
            vllm_blocks = shared_blocks
            _, key_cache, value_cache = vllm_cache(cache, shared_table, shared_table, vllm_blocks)
            tables = {"PagedAttn*": shared_table}

        def paged(table: torch.Tensor, window: int) -> Callable[[], torch.Tensor]:
            out = torch.empty_like(query)
            metadata = vops.cpu_attn_get_scheduler_metadata(
                num_reqs=w.batch, num_heads=w.heads, num_kv_heads=w.heads, head_dim=w.head_dim, seq_lens=seq_lens,
                dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=window or -1,
                isa=_vllm_isa(dtype, w.chunk), enable_kv_split=True)

            def step() -> torch.Tensor:
                vops.cpu_attention_with_kv_cache(
                    query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
                    seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=window or -1,
                    block_table=table, softcap=0.0, scheduler_metadata=metadata, s_aux=sinks)
                return out

            return step

        for window in windows:
            by_window[window] += [Candidate(name, paged(tables[name], window), repeats)
                                  for name in ("PagedAttn", "PagedAttn*") if name in impls]

    dense = [i for i in DENSE_IMPLS if i in impls]
    if dense and (any(windows) or w.sinks):
        for name in dense:
            skipped[name] = "the dense baselines have no sliding window or sinks"
        dense = []
    if dense:
        block_bytes = w.heads * w.chunk * 2 * w.head_dim * element_size(w.dtype)
        needed = (shared_blocks + vllm_blocks) * block_bytes + unshared_kv_bytes(w)
        available = memory_available_bytes()
        if needed > MEMORY_FRACTION * available:
            for name in dense:
                skipped[name] = (f"its dense K/V would bring the point's inputs to {needed / 2**30:.1f} GiB, "
                                 f"over {MEMORY_FRACTION:.0%} of the {available / 2**30:.1f} GiB available")
            dense = []
    if dense:
        keys, values = dense_kv(cache, shared_table, w.context)
        q4 = query.unsqueeze(2)  # [b, h, 1, d]
        dense_repeats = min(repeats, DENSE_MAX_REPEATS)

        def naive() -> torch.Tensor:
            return (torch.softmax((q4 @ keys.transpose(-1, -2)) * scale, dim=-1) @ values).squeeze(2)

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q4, keys, values, scale=scale).squeeze(2)

        for name, step in (("Naive", naive), ("SDPA", sdpa)):
            if name in dense:
                by_window[windows[0]].append(Candidate(name, step, dense_repeats))

    results = {window: check(dataclasses.replace(w, window=window).label(), dtype, candidates)
               for window, candidates in by_window.items()}
    if not any(r.disagreements for r in results.values()):
        # One rotation over every window's candidates, named apart while they run.
        timed = [dataclasses.replace(c, name=(window, c.name)) for window, candidates in by_window.items()
                 for c in candidates]
        times = time_interleaved(timed, repeats, max(0, warmup - 1), flush)
        bookkeeping = {
            "tree rebuild": measure(lambda: tree.prefix_tree(shared_table, seq_lens, w.chunk), repeats, 1),
            "tree lookup": measure(lambda: ctx_cache.get(shared_table, seq_lens, w.chunk), repeats, 1),
            "decode plan": measure(lambda: ops.plan_tpp_decode(shape, shared_table, seq_lens, ctx), repeats, 1),
        }
        for window, result in results.items():
            result.times = {name: ts for (of_window, name), ts in times.items() if of_window == window}
            result.times.update(bookkeeping)
    for result in results.values():
        result.skipped.update(skipped)
    del by_window, cache
    gc.collect()
    return list(results.values())


# ---------------------------------------------------------------------------
# Prefill


@dataclasses.dataclass
class PrefillPoint:
    requests: int
    new: int  # new tokens per request
    context: int  # seq_len: cached + new
    heads: int
    head_dim: int
    chunk: int
    dtype: str
    kv_heads: int = 0  # 0: heads (MHA)
    shared: int = 0  # leading context tokens all requests share (whole chunks; the relay grid)

    def __post_init__(self) -> None:
        if not self.kv_heads:
            self.kv_heads = self.heads

    @property
    def grid(self) -> str:
        return "relay" if self.shared else "prefill"

    def label(self) -> str:
        heads = f"h={self.heads}" + (f"/{self.kv_heads}" if self.kv_heads != self.heads else "")
        shared = f" shared={self.shared}" if self.shared else ""
        return (f"{self.grid} {self.dtype} requests={self.requests} new={self.new} seq_len={self.context}{shared} "
                f"{heads} d={self.head_dim} c={self.chunk}")

    def flops(self) -> int:
        """Causal: new token t (0-based) attends to context - new + t + 1 keys."""
        keys = sum(self.context - self.new + t + 1 for t in range(self.new))
        return 4 * self.requests * self.heads * self.head_dim * keys

    def nbytes(self) -> int:
        """KV of every request's context (the shared part once), its queries and its outputs."""
        kv = (self.shared + self.requests * (self.context - self.shared)) * 2 * self.kv_heads
        queries_and_outputs = self.requests * 2 * self.new * self.heads
        return (kv + queries_and_outputs) * self.head_dim * element_size(self.dtype)


def point_shape(p: Workload | PrefillPoint) -> DecodeShape:
    """The layer shape of a point: what ours is tuned for (kernels/cpu_tuning.py)."""
    return DecodeShape(p.heads, p.kv_heads, p.head_dim, p.chunk, DTYPES[p.dtype])


def prefill_points(dtype: str, quick: bool) -> list[PrefillPoint]:
    if quick:
        return [PrefillPoint(2, 32, 64, 4, 64, 32, dtype)]
    return [
        PrefillPoint(8, 512, 1024, 32, 128, 64, dtype), PrefillPoint(8, 512, 512, 32, 128, 64, dtype),
        # Many requests with a few new tokens each behind a long cached prefix (a burst after a system prompt).
        PrefillPoint(32, 16, 2048 + 16, 32, 128, 64, dtype), PrefillPoint(32, 64, 2048 + 64, 32, 128, 64, dtype),
        # The serving benchmark's burst-2048 on its default model (bench-gqa: 16 query heads over 4 KV heads).
        PrefillPoint(32, 64, 2048 + 64, 16, 128, 64, dtype, kv_heads=4),
    ]


RELAY_QUERY_LENS = (1, 2, 4, 8, 16, 64)


def relay_points(dtype: str, quick: bool) -> list[PrefillPoint]:
    """32 requests, q new tokens each after 2048 shared + 128 private tokens of context."""
    if quick:
        return [PrefillPoint(4, q, 128 + 32 + q, 4, 64, 32, dtype, kv_heads=2, shared=128) for q in (1, 4)]
    return [PrefillPoint(32, q, 2048 + 128 + q, heads, 128, 64, dtype, kv_heads=heads // group, shared=2048)
            for heads in (16, 32) for group in (1, 4) for q in RELAY_QUERY_LENS]


def offline_points(dtype: str, quick: bool) -> list[PrefillPoint]:
    """One layer of the offline batch (bench/offline.py's defaults): its decode step halfway through the
    outputs, and a prompt step of own tokens behind the cached system prompt."""
    from vllm_chunkattn.bench import offline
    from vllm_chunkattn.testing.models import SPECS

    batch = offline.parse_args(["--quick"] if quick else [])
    spec = SPECS["tiny" if quick else "bench-gqa"]
    heads, kv_heads, head_dim = spec["num_attention_heads"], spec["num_key_value_heads"], spec["head_dim"]
    prompt_requests = min(batch.num_requests, batch.max_num_batched_tokens // batch.user_len)
    decode_context = batch.system_len + batch.user_len + batch.output_len // 2
    return [PrefillPoint(batch.num_requests, 1, decode_context, heads, head_dim, batch.block_size, dtype,
                         kv_heads=kv_heads, shared=batch.system_len),
            PrefillPoint(prompt_requests, batch.user_len, batch.system_len + batch.user_len, heads, head_dim,
                         batch.block_size, dtype, kv_heads=kv_heads, shared=batch.system_len)]


def run_prefill_point(p: PrefillPoint, repeats: int, warmup: int, flush: Callable[[], None] | None,
                      rng: np.random.Generator) -> PointResult:
    """ours: chunkattn::paged_prefill; with a shared prefix (relay) ours is the
    tree path and "ours per-request" the paged prefill."""
    from vllm import _custom_ops as vops

    dtype = DTYPES[p.dtype]
    # The cache's shape: the KV heads.
    segments = [(p.shared, p.requests), (p.context - p.shared, 1)] if p.shared else [(p.context, 1)]
    w = Workload(p.grid, p.requests, segments, p.context, p.shared, 0, p.kv_heads, p.head_dim, p.chunk, p.dtype)
    table, num_blocks = block_tables(w, bool(p.shared), rng)
    cache = random_cache(num_blocks, w, dtype)
    seq_lens = torch.full((p.requests,), p.context, dtype=torch.int32)
    qsl = torch.arange(p.requests + 1, dtype=torch.int32) * p.new
    query = torch.empty(p.requests * p.new, p.heads, p.head_dim, dtype=dtype).uniform_(-2.0, 2.0)
    scale = p.head_dim**-0.5
    prefill_out = torch.empty_like(query)

    def per_request() -> torch.Tensor:
        ops.paged_prefill(query, cache, qsl, seq_lens, table, scale, prefill_out)
        return prefill_out

    if p.shared:
        # The builder's work, once per step for all layers: timed apart ("tree rows plan").
        def plan_rows():
            query_lens = qsl[1:] - qsl[:-1]
            rows = expand_query_rows(table, seq_lens, query_lens)
            ctx = unstack_own_nodes(tree.prefix_tree(rows.block_table, rows.unmasked_lens, p.chunk), query_lens,
                                    CPU.own_node_min_query_len)  # the engine's nodes
            return ops.plan_tpp_decode(point_shape(p), rows.block_table, rows.seq_lens, ctx)

        tree_plan = plan_rows()
        tree_out = torch.empty_like(query)

        def ours() -> torch.Tensor:
            ops.tpp_decode(query, cache, tree_plan, scale, tree_out)
            return tree_out
    else:
        ours = per_request

    _, key_cache, value_cache = vllm_cache(cache, table, table, num_blocks)
    metadata = vops.cpu_attn_get_scheduler_metadata(
        num_reqs=p.requests, num_heads=p.heads, num_kv_heads=p.kv_heads, head_dim=p.head_dim, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=_vllm_isa(dtype, p.chunk),
        enable_kv_split=True)
    theirs_out = torch.empty_like(query)

    def theirs() -> torch.Tensor:
        vops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=theirs_out, query_start_loc=qsl,
            seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=metadata, s_aux=None)
        return theirs_out

    candidates = [Candidate("ours", ours, repeats), Candidate("vLLM", theirs, repeats)]
    if p.shared:
        candidates.append(Candidate("ours per-request", per_request, repeats))
    result = check_and_time(p.label(), dtype, candidates, repeats, warmup, flush)
    if p.shared and not result.disagreements:
        result.times["tree rows plan"] = measure(plan_rows, repeats, 1)
    return result


# ---------------------------------------------------------------------------
# Report


def summarise(times: list[float]) -> dict[str, float]:
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "p25_ms": q1, "p75_ms": q3, "times_ms": list(times)}


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if x < 100 else f"{x:.0f}"


def time_cell(times: list[float] | None) -> str:
    """Median and spread: ± half the range (max - min) of the repetitions, in % of the median."""
    if not times:
        return "-"
    median = statistics.median(times)
    return f"{fmt(median)} ±{50 * (max(times) - min(times)) / median:.0f}%"


def markdown_table(rows: list[dict], impls: list[str]) -> str:
    """One table of a grid and dtype; rows are dicts made by main()."""
    head = ["n_p", "n_s", "n_c", "batch", "tokens:requests sharing them"] + [f"{i} ms" for i in impls] + ["roofline ms"]
    ratios = [f"{i}/ours" for i in impls if i != "ours"]
    vllm = [i for i in impls if i in VLLM_DECODE_IMPLS]
    head += ratios + ["ours/roofline"] + (["ceiling: faster vLLM/roofline"] if vllm else [])
    head += ["bound by", "tok/s ours", "rebuild ms (% step)", "lookup ms (% step)", "plan ms (% step)",
             "max|Δ| vs ours"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        w, times, bound = r["w"], r["times"], r["roofline"]
        median = {name: statistics.median(ts) for name, ts in times.items()}
        ours = median.get("ours")
        shares = " + ".join(f"{tokens}:{group}" for tokens, group in w.segments)
        cells = [str(w.n_p), str(w.n_s), str(w.n_c), str(w.batch), f"{w.name}: {shares}" if w.name else shares]
        cells += [time_cell(times.get(i)) for i in impls] + [fmt(bound.bound_ms)]
        for i in impls:
            if i == "ours":
                continue
            cells.append(f"{median[i] / ours:.2f}x" if ours and i in median else "-")
        cells.append(f"{ours / bound.bound_ms:.2f}" if ours else "-")
        if vllm:
            faster = min((median[i] for i in vllm if i in median), default=None)
            cells.append(f"{faster / bound.bound_ms:.2f}x" if faster else "-")
        cells.append(bound.bound_by)
        cells.append(f"{w.batch / (ours / 1e3):.0f}" if ours else "-")
        for key in DECODE_BOOKKEEPING:
            t = median[key]
            cells.append(f"{t:.3f} ({100 * t / ours:.1f}%)" if ours else f"{t:.3f}")
        cells.append(", ".join(f"{k} {v:.1e}" for k, v in r["diffs"].items()) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def prefill_table(rows: list[dict]) -> str:
    lines = ["| dtype | requests | new tokens | seq_len | heads | d | chunk | ours ms | vLLM ms | vLLM/ours | "
             "roofline ms | ours/roofline | ceiling: vLLM/roofline | bound by | GFLOP/s ours | max|Δ| |",
             "|" + "---|" * 16]
    for r in rows:
        p, times, bound = r["p"], r["times"], r["roofline"]
        ours, theirs = statistics.median(times["ours"]), statistics.median(times["vLLM"])
        heads = f"{p.heads}" + (f" / {p.kv_heads} KV" if p.kv_heads != p.heads else "")
        lines.append(f"| {p.dtype} | {p.requests} | {p.new} | {p.context} | {heads} | {p.head_dim} | {p.chunk} | "
                     f"{time_cell(times['ours'])} | {time_cell(times['vLLM'])} | {theirs / ours:.2f}x | "
                     f"{fmt(bound.bound_ms)} | {ours / bound.bound_ms:.2f} | {theirs / bound.bound_ms:.2f}x | "
                     f"{bound.bound_by} | "
                     f"{p.flops() / (ours / 1e3) / 1e9:.1f} | {r['diffs']['vLLM']:.1e} |")
    return "\n".join(lines)


def relay_table(rows: list[dict]) -> list[str]:
    """The relay grid's table, and the most query rows per KV head (q x GQA group) up to which
    the tree path beat the per-request one at every point, beside what the engine measured at
    start for each shape (ShapeTuning.tree_max_rows_per_kv_head, kernels/cpu_tuning.py)."""
    lines = ["| dtype | heads | requests | q | context | tree ms | per-request ms | vLLM ms | vLLM/tree | "
             "per-request/tree | engine's path | "
             "engine / better of vLLM and per-request | engine / vLLM | tree plan ms (per step) | tree/roofline | "
             "ceiling: vLLM/roofline | max|Δ| vLLM, per-request |", "|" + "---|" * 17]
    wins: dict[int, bool] = {}  # rows per KV head -> the tree path won at every such point
    reach = {point_shape(r["p"]): r["tuning"] for r in rows}
    for r in rows:
        p, times, bound = r["p"], r["times"], r["roofline"]
        tree_ms, per_ms, vllm_ms = (statistics.median(times[k]) for k in ("ours", "ours per-request", "vLLM"))
        group = p.heads // p.kv_heads
        wins[p.new * group] = wins.get(p.new * group, True) and tree_ms <= per_ms
        on_tree = p.new <= r["tuning"].tree_max_query_len(group)
        engine_ms = tree_ms if on_tree else per_ms
        heads = f"{p.heads}" + (f" / {p.kv_heads} KV" if p.kv_heads != p.heads else "")
        lines.append(f"| {p.dtype} | {heads} | {p.requests} | {p.new} | {p.context} | {time_cell(times['ours'])} | "
                     f"{time_cell(times['ours per-request'])} | {time_cell(times['vLLM'])} | {vllm_ms / tree_ms:.2f}x | "
                     f"{per_ms / tree_ms:.2f}x | {'tree' if on_tree else 'per-request'} | "
                     f"{min(vllm_ms, per_ms) / engine_ms:.2f}x | {vllm_ms / engine_ms:.2f}x | "
                     f"{fmt(statistics.median(times['tree rows plan']), 3)} | {tree_ms / bound.bound_ms:.2f} | "
                     f"{vllm_ms / bound.bound_ms:.2f}x | "
                     f"{r['diffs']['vLLM']:.1e}, {r['diffs']['ours per-request']:.1e} |")
    most = 0
    for rows_per_kv_head in sorted(wins):
        if not wins[rows_per_kv_head]:
            break
        most = rows_per_kv_head
    lines += ["", f"Tree path at least as fast as the per-request prefill at every point with at most {most} query "
              f"rows per KV head and request (q x GQA group; measured: "
              f"{', '.join(f'{n}: ' + ('yes' if ok else 'no') for n, ok in sorted(wins.items()))}). The engine "
              f"sends a request to the tree path when q x group is at most what it measured at start for the "
              f"layer shape (kernels/tree_reach.py, tree_max_rows_per_kv_head): "
              f"{'; '.join(f'{shape.describe()}: {t.tree_max_rows_per_kv_head}' for shape, t in reach.items())}; "
              f"\"engine's path\" is that choice."]
    return lines


def below_roofline(label: str, times: dict[str, list[float]], bound: machine.Roofline) -> list[str]:
    """Implementations whose fastest repetition beat the roofline: the model misses something there."""
    return [f"{label}: {name} {min(ts):.3f} ms < roofline {bound.bound_ms:.3f} ms ({bound.bound_by} bound: "
            f"{bound.nbytes} B at {bound.bandwidth_gbps:.1f} GB/s, {bound.flops} flop at {bound.peak_gflops:.0f} "
            f"GFLOP/s of {bound.peak_loop})"
            for name, ts in times.items() if name not in STEP_BOOKKEEPING and ts and min(ts) < bound.bound_ms]


def plot_table3(rows: list[dict], impls: list[str], path: Path) -> None:
    try:
        from vllm_chunkattn.bench.report import _pyplot

        plt = _pyplot()
    except ImportError:
        print(f"matplotlib is not installed: skipping {path} (add `matplotlib` to the environment to get the plot)",
              flush=True)
        return
    dtypes = sorted({r["w"].dtype for r in rows})
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(12, 4.5 * len(dtypes)), squeeze=False)
    for ax, dtype in zip(axes[:, 0], dtypes):
        sel = [r for r in rows if r["w"].dtype == dtype]
        labels = [f"{r['w'].n_p}/{r['w'].n_s}" for r in sel]
        names = impls + ["roofline"]
        width = 0.8 / len(names)
        for k, name in enumerate(names):
            ys = [r["roofline"].bound_ms if name == "roofline" else
                  statistics.median(r["times"][name]) if name in r["times"] else float("nan") for r in sel]
            ax.bar(np.arange(len(sel)) + k * width, ys, width, label=name)
        ax.set_xticks(np.arange(len(sel)) + width * (len(names) - 1) / 2, labels)
        ax.set_yscale("log")
        ax.set_xlabel("n_p / n_s")
        ax.set_ylabel("decode latency, ms (one layer)")
        ax.set_title(f"Table 3 on CPU, {dtype}: batch {sel[0]['w'].batch}, {sel[0]['w'].heads} heads, "
                     f"d {sel[0]['w'].head_dim}, chunk {sel[0]['w'].chunk}")
        ax.legend(ncols=len(names), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


class Progress:
    """A line per point with the time so far and an estimate of the time left, from the points' estimated
    costs (the roofline of reading every request's KV unshared: what the baselines read)."""

    def __init__(self, costs: list[float]):
        self.costs = costs
        self.done = 0
        self.started = time.monotonic()

    def point(self, label: str) -> None:
        elapsed = time.monotonic() - self.started
        done_cost, left_cost = sum(self.costs[: self.done]), sum(self.costs[self.done :])
        eta = f"ETA {_duration(elapsed * left_cost / done_cost)}" if self.done and done_cost > 0 else "ETA -"
        print(f"[{_duration(elapsed)} | {self.done + 1}/{len(self.costs)} | {eta}] {label} ...", flush=True)
        self.done += 1


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# The GPU benchmark's names for this module's grids and dtypes.
GPU_GRIDS = {"table3": ["table3"], "fig3": ["figure3"], "fig4": ["figure4"], "tree": ["multilevel"],
             "all": ["table3", "figure3", "figure4", "multilevel"]}
GPU_DTYPES = {"bf16": ["bfloat16"], "both": ["float16", "bfloat16"]}


def run_on_gpu(args: argparse.Namespace) -> int:
    """`--device cuda`: the same grids through vllm_chunkattn.bench.kernel_gpu, one run per dtype."""
    if args.grid not in GPU_GRIDS:
        print(f"--device cuda: grid {args.grid!r} is CPU-only (GPU grids: {', '.join(GPU_GRIDS)})", file=sys.stderr)
        return 2
    if args.dtype not in GPU_DTYPES:
        print(f"--device cuda: dtype {args.dtype!r} is not supported by the CUDA kernels (use bf16, or both for "
              f"fp16 and bf16)", file=sys.stderr)
        return 2
    from vllm_chunkattn.bench import kernel_gpu

    for dtype in GPU_DTYPES[args.dtype]:
        gpu_argv = ["--grids", *GPU_GRIDS[args.grid], "--dtype", dtype, "--out", str(Path(args.out) / f"gpu_{dtype}")]
        gpu_argv += ["--quick"] if args.quick else ["--head-size", str(args.head_size)]
        code = kernel_gpu.main(gpu_argv)
        if code:
            return code
    return 0


@dataclasses.dataclass
class PlannedPoint:
    grid: str
    point: Workload | PrefillPoint

    def label(self) -> str:
        return self.point.label()


def plan(grids: list[str], dtypes: list[str], quick: bool, windows: tuple[int, ...] = (0,),
         sinks: bool = False, head_size: int = DEFAULT_HEAD_SIZE) -> list[PlannedPoint]:
    """The run's points; with several windows, each point once per window, back to back (run_point times
    them together, so that their ratios come from the same rotation of the same run). `head_size` replaces
    the grids' 128 (serve and offline keep their models', the quick grids their own)."""
    planned = []
    for grid in grids:
        for dtype in dtypes:
            points_of = {"prefill": prefill_points, "relay": relay_points, "offline": offline_points}.get(grid)
            points = points_of(dtype, quick) if points_of else grid_points(grid, dtype, quick)
            if head_size != DEFAULT_HEAD_SIZE and grid not in MODEL_GRIDS and not quick:
                points = [dataclasses.replace(p, head_dim=head_size) for p in points]
            if windows != (0,) or sinks:
                points = [dataclasses.replace(p, window=w, sinks=sinks) for p in points for w in windows]
            planned += [PlannedPoint(grid, p) for p in points]
    return planned


def window_groups(planned: list[PlannedPoint]) -> list[list[PlannedPoint]]:
    """The planned points in runs of one decode point under each of its windows (plan() puts them back to
    back), which run_point times together; every other point alone."""
    groups: list[list[PlannedPoint]] = []
    for planned_point in planned:
        p = planned_point.point
        previous = groups[-1][-1] if groups else None
        if (isinstance(p, Workload) and previous is not None and isinstance(previous.point, Workload)
                and previous.grid == planned_point.grid and dataclasses.replace(previous.point, window=p.window) == p):
            groups[-1].append(planned_point)
        else:
            groups.append([planned_point])
    return groups


def window_list(text: str) -> tuple[int, ...]:
    """--sliding-window: one window or several, comma-separated (0: none)."""
    try:
        windows = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a window or comma-separated windows: {text!r}") from None
    if any(w < 0 for w in windows) or len(set(windows)) != len(windows):
        raise argparse.ArgumentTypeError(f"windows must be distinct and >= 0 (0: none), got {text!r}")
    return windows


def window_name(window: int) -> str:
    return f"W={window}" if window else "no window"


def window_kept(rows_by_table: dict, windows: tuple[int, ...]) -> list[str]:
    """With several windows: per shared point, its speedup over the faster of vLLM's kernels under each
    later window as a fraction of its speedup under the first (timed in one rotation, run_point)."""
    speedup: dict[tuple, float] = {}
    for (grid, dtype, window), rows in rows_by_table.items():
        for r in rows:
            median = {name: statistics.median(ts) for name, ts in r["times"].items()}
            vllm = [median[i] for i in ("PagedAttn", "PagedAttn*") if i in median]
            if "ours" in median and vllm and r["w"].n_s:
                speedup[(grid, dtype, r["w"].n_p, r["w"].n_s, window)] = min(vllm) / median["ours"]
    first, later = windows[0], windows[1:]
    points = sorted({key[:4] for key in speedup if key[4] == first})
    if not points or not later:
        return []
    head = ["grid", "dtype", "n_p", "n_s", f"speedup, {window_name(first)}"]
    head += [f"{window_name(w)} / {window_name(first)}" for w in later]
    lines = [f"## Shared points: speedup kept under each window (over the faster of PagedAttn and PagedAttn*, "
             f"relative to {window_name(first)})", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    kept: dict[int, list[float]] = {w: [] for w in later}
    for point in points:
        cells = [*map(str, point), f"{speedup[(*point, first)]:.2f}x"]
        for w in later:
            ratio = speedup.get((*point, w), float("nan")) / speedup[(*point, first)]
            kept[w].append(ratio)
            cells.append(f"{ratio:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{window_name(w)}: {min(r):.2f} to {max(r):.2f}, mean {statistics.mean(r):.2f}" for w, r in kept.items()]
    return lines


def point_roofline(point: Workload | PrefillPoint, rates: list[machine.MachineRates], flushed: bool,
                   machine_record: dict, unshared: bool = False) -> machine.Roofline:
    """The point's roofline (`unshared`: as if no chunk were shared, the progress line's cost estimate)."""
    if isinstance(point, PrefillPoint):
        nbytes, flops = point.nbytes(), point.flops()
    else:
        nbytes, flops = (unshared_kv_bytes(point) if unshared else distinct_kv_bytes(point)), decode_flops(point)
    return machine.roofline(memory_term_bytes(nbytes, flushed, machine_record), flops, point.dtype, rates)


def report_header(args: argparse.Namespace, env: dict, machine_record: dict, rates: list[machine.MachineRates],
                  bandwidth_samples: list[machine.MachineRates], failures: list[agreement.Disagreement],
                  below: list[str], others: list[str]) -> list[str]:
    lines = ["# Decode attention kernel benchmark (one layer, one step)", ""]
    if failures:
        lines += ["**THIS RUN FAILED: implementations disagree beyond the tolerance "
                  "(bench/agreement.py); these points are not timed and not in the tables:**", "",
                  *[f"- {d.message()}" for d in failures], ""]
    lines += [machine.describe_line(machine_record), "", machine.IDENTITY_LINE.format(machine_record["cpu_identity"]),
              "", *machine.other_cpu_warning(others)]
    if env.get("as_avx2_cpu"):
        lines += ["**As on a CPU without AVX-512 (`--as-avx2-cpu`): our kernels' AVX2 build, vLLM's AVX2 build of "
                  "its CPU kernels, torch's and oneDNN's AVX2 kernels; the roofline's compute term from the AVX2 FMA "
                  "peak.**", ""]
    windows = env.get("sliding_windows", [0])
    if windows != [0]:
        lines += [f"**Every layer with a sliding window of {', then '.join(map(str, windows))} tokens "
                  "(`--sliding-window`; 0: none), ours and vLLM's; the roofline counts the keys inside it.**", ""]
    if env.get("sinks"):
        lines += ["**Every head with an attention sink (`--sinks`, gpt-oss's), ours and vLLM's.**", ""]
    if env.get("vllm_kernel_libraries"):
        lines += [f"vLLM's kernels loaded from: {', '.join(env['vllm_kernel_libraries'])}", ""]
    lines += [f"- {machine.rates_line(label, r)}" for label, r in zip(("At the start", "At the end"), rates)]
    if bandwidth_samples:
        sampled = [s.read_bandwidth_gbps for s in bandwidth_samples]
        lines += [f"- Read bandwidth sampled before each of the {len(sampled)} points (once for all windows of a "
                  f"point): {min(sampled):.1f} to {max(sampled):.1f} GB/s"]
    unmeasured = machine.unmeasured_instructions(machine_record)
    lines += [
        "",
        "Roofline of a point: max(bytes / the highest bandwidth measured in the run (start, end and every "
        "sample), flops / the highest peak of a loop "
        "that computes the dtype: " + "; ".join(f"{dtype} {', '.join(loops)}" for dtype, loops in
                                                 machine.PEAK_LOOPS_BY_DTYPE.items())
        + "), bytes = distinct KV bytes of the step"
        + (" (all of them: the caches are flushed before each call)" if env["flush_cache"]
           else " beyond what the caches can hold (--warm)") + ", flops = 4 b h n d: a lower bound of every "
        "implementation's time, so time / roofline >= 1.",
    ]
    if unmeasured:
        lines += ["", f"**This CPU has {', '.join(unmeasured)}, which no peak loop measures: an implementation "
                  f"using them can beat the compute term, so the roofline is not a lower bound for it.**"]
    if below:
        lines += ["", "**BELOW THE ROOFLINE: these measured times are under the bound; the roofline model misses "
                  "something here (a rate measured too low, bytes that did not come from memory):**", "",
                  *[f"- {line}" for line in below]]
    lines += [
        "",
        f"Clock: {'wall, torch threads' if args.clock == 'wall' else 'CPU time of the (single) calling thread'} "
        f"({env['threads']} threads); load average at start {env['loadavg_start'][0]:.1f}, at end "
        f"{env['loadavg_end'][0]:.1f}; caches {'flushed' if env['flush_cache'] else 'warm'} before each timed call; "
        f"{args.repeats} repetitions (dense baselines: {min(args.repeats, DENSE_MAX_REPEATS)}), each running every "
        f"implementation once in an order rotated by one per repetition; cells: median ±half the range (max - min) "
        f"in % of the median.",
        "",
        "Ratios X/ours > 1 mean ours is faster. ceiling: vLLM's time over the roofline, the most any kernel "
        "could be ahead of vLLM's at the point on this machine. rebuild/lookup: prefix-tree context costs of "
        "ours, outside the kernel time; % of one layer's decode step of ours.",
        "",
        f"Command: `python -m vllm_chunkattn.bench.kernel {' '.join(env['argv'][1:])}`",
    ]
    return lines


def as_avx2_cpu(argv: list[str] | None) -> None:
    """--as-avx2-cpu: re-executes this benchmark with AS_AVX2_CPU_ENV (torch reads its ISA when it loads), then,
    in that process, makes vLLM load its AVX2 kernels: it picks vllm._C_AVX2 where torch reports no AVX-512."""
    if os.environ.get(AS_AVX2_CPU_MARKER) != "1":
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "vllm_chunkattn.bench.kernel",
                                   *(sys.argv[1:] if argv is None else argv)], {**os.environ, **AS_AVX2_CPU_ENV})
    if "vllm._custom_ops" in sys.modules:
        raise RuntimeError("--as-avx2-cpu: vLLM's kernels were loaded before their ISA could be chosen")
    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    # No CPU without AVX-512 has AMX; vLLM's _C_AVX2 has no AMX kernel, yet vLLM picks "amx" for bf16 where
    # torch reports AMX tiles.
    torch.cpu._is_amx_tile_supported = lambda: False


def loaded_vllm_kernel_libraries() -> list[str]:
    """The builds of vLLM's compiled kernels this process has mapped (vllm/_C*.so: _C, _C_AVX512 or _C_AVX2)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({Path(line.split()[-1]).name for line in maps.splitlines()
                   if "/vllm/_C" in line and line.rstrip().endswith(".so")})


def avx2_rates(rates: machine.MachineRates) -> machine.MachineRates:
    """The machine's rates with only the AVX2 peak loops: the roofline of a CPU without AVX-512."""
    def keep(peaks: dict[str, float]) -> dict[str, float]:
        return {loop: gflops for loop, gflops in peaks.items() if loop in AVX2_PEAK_LOOPS}

    return dataclasses.replace(rates, peak_gflops=keep(rates.peak_gflops),
                               peak_gflops_one_core=keep(rates.peak_gflops_one_core))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default="all", choices=GRIDS + ["all"])
    parser.add_argument("--dtype", default="both", choices=["bf16", "fp32", "fp16", "both"])
    parser.add_argument("--head-size", type=int, default=DEFAULT_HEAD_SIZE, choices=CPU.head_sizes,
                        help="head size of every grid but serve and offline, which take their models' "
                             "(the paper's: 128)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a CI smoke run")
    parser.add_argument("--warm", action="store_true", help="do not flush the cache before timed calls")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="wall: wall-clock, torch's threads; cpu: one thread, its CPU time (robust to other load)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the GPU kernels on the same grids (vllm_chunkattn.bench.kernel_gpu)")
    parser.add_argument("--as-avx2-cpu", action="store_true",
                        help="every implementation as on a CPU without AVX-512: ours, vLLM's and torch's AVX2 "
                             "kernels, the roofline from the AVX2 FMA peak")
    parser.add_argument("--sliding-window", type=window_list, default=(0,), metavar="W[,W...]",
                        help="decode grids only: every layer with vLLM's sliding window W (each query sees its "
                             "last W keys), ours and vLLM's alike; 0: none. Several, comma-separated: each point "
                             "once per window, every window's implementations timed in one rotation, and how much "
                             "of its speedup each window keeps")
    parser.add_argument("--sinks", action="store_true",
                        help="decode grids only: every head with an attention sink (gpt-oss's learned logit), "
                             "ours and vLLM's alike")
    parser.add_argument("--out", default="results/kernel")
    args = parser.parse_args(argv)
    for flag, used in (("--sliding-window", args.sliding_window != (0,)), ("--sinks", args.sinks)):
        if used and args.grid in (*PREFILL_GRIDS, "all"):
            parser.error(f"{flag} applies to the decode grids; choose one of "
                         f"{', '.join(g for g in GRIDS if g not in PREFILL_GRIDS)}")
    if args.device == "cuda":
        sys.exit(run_on_gpu(args))
    if args.as_avx2_cpu:
        as_avx2_cpu(argv)

    impls = [i for i in IMPLS if i in args.impls.split(",")]
    global _CLOCK
    if args.clock == "cpu":
        torch.set_num_threads(1)
        _CLOCK = time.thread_time
    try:
        import vllm._custom_ops  # noqa: F401
    except ImportError:
        print("vLLM is not importable: skipping PagedAttn and PagedAttn*", flush=True)
        impls = [i for i in impls if not i.startswith("PagedAttn")]
    grids = GRIDS if args.grid == "all" else [args.grid]
    if not any(i.startswith("PagedAttn") for i in impls):
        grids = [g for g in grids if g not in PREFILL_GRIDS]  # they need vLLM
    dtypes = ["bf16", "fp32"] if args.dtype == "both" else [args.dtype]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    machine_record = machine.describe_machine()
    print(machine.describe_line(machine_record), flush=True)
    # This run replaces table.md and results.json; anything else in the folder stays beside them.
    others = machine.results_from_other_cpus(out_dir, machine_record["cpu_identity"],
                                             exclude=(out_dir / "table.md", out_dir / "results.json"))
    for line in others:
        print(f"WARNING: {out_dir} holds results of another CPU: {line}", flush=True)
    threads = torch.get_num_threads()

    def measure_rates() -> machine.MachineRates:
        rates = machine.measure_rates(threads, machine_record, args.quick)
        return avx2_rates(rates) if args.as_avx2_cpu else rates

    rates = [measure_rates()]
    print(machine.rates_line("machine rates at the start", rates[0]), flush=True)
    env = {
        "threads": threads, "loadavg_start": os.getloadavg(), "flush_cache": not args.warm,
        "clock": args.clock, "sliding_windows": list(args.sliding_window), "sinks": args.sinks, "repeats": args.repeats,
        "warmup": args.warmup, "argv": sys.argv if argv is None else
        ["kernel.py", *argv], "impls": impls, "as_avx2_cpu": args.as_avx2_cpu,
    }
    if os.getloadavg()[0] > (os.cpu_count() or 1) * 0.5:
        print(f"WARNING: load average {os.getloadavg()} on {os.cpu_count()} cores: other processes share the "
              f"machine, timings will be noisy", flush=True)

    flush = None if args.warm else CacheFlusher(machine_record.get("caches", {}))
    planned = plan(grids, dtypes, args.quick, args.sliding_window, args.sinks, args.head_size)
    progress = Progress([point_roofline(p.point, rates, True, machine_record, unshared=True).bound_ms
                         for p in planned])
    rng = np.random.default_rng(0)
    results: list[tuple[PlannedPoint, PointResult]] = []
    failures: list[agreement.Disagreement] = []
    start = time.time()
    bandwidth_samples: list[machine.MachineRates] = []
    tunings: dict[DecodeShape, cpu_tuning.ShapeTuning] = {}
    for group in window_groups(planned):
        for planned_point in group:
            progress.point(planned_point.label())
        p = group[0].point
        bandwidth_samples.append(machine.sample_bandwidth(threads, machine_record, args.quick))
        # Ours runs with the tile parameters the engine would use for this shape on this CPU.
        shape = point_shape(p)
        tunings[shape] = cpu_tuning.ensure_tuned(shape)
        if isinstance(p, PrefillPoint):
            group_results = [run_prefill_point(p, args.repeats, args.warmup, flush, rng)]
        else:
            group_results = run_point(p, impls, args.repeats, args.warmup, flush, rng,
                                      windows=tuple(planned_point.point.window for planned_point in group))
        for planned_point, result in zip(group, group_results, strict=True):
            results.append((planned_point, result))
            for d in result.disagreements:
                print(f"FAILED: {d.message()}", flush=True)
            failures += result.disagreements
            for name, why in result.skipped.items():
                print(f"    {name} left out: {why}", flush=True)
            if result.times:
                window = f"{window_name(planned_point.point.window)}: " if len(group) > 1 else ""
                print("    " + window + "  ".join(f"{k} {statistics.median(v):.2f}" for k, v in result.times.items()),
                      flush=True)
    rates.append(measure_rates())
    print(machine.rates_line("machine rates at the end", rates[1]), flush=True)
    env["loadavg_end"] = os.getloadavg()
    env["vllm_kernel_libraries"] = loaded_vllm_kernel_libraries()
    env["seconds"] = round(time.time() - start)

    records: list[dict] = []
    rows_by_table: dict[tuple[str, str, int], list[dict]] = {}
    prefill_rows: list[dict] = []
    relay_rows: dict[str, list[dict]] = {}  # grid -> rows of points with a shared prefix
    below: list[str] = []
    for planned_point, result in results:
        p = planned_point.point
        bound = point_roofline(p, rates + bandwidth_samples, not args.warm, machine_record)
        if isinstance(p, PrefillPoint):
            base = dict(grid=p.grid, n_p=p.context, n_s=p.shared, n_c=p.new, batch=p.requests, heads=p.heads,
                        kv_heads=p.kv_heads, head_dim=p.head_dim, chunk=p.chunk, dtype=p.dtype)
        else:
            base = dict(grid=planned_point.grid, workload=p.name or None, n_p=p.n_p, n_s=p.n_s, n_c=p.n_c,
                        batch=p.batch, heads=p.heads, head_dim=p.head_dim, chunk=p.chunk, dtype=p.dtype,
                        segments=p.segments, window=p.window, sinks=p.sinks)
        base["cpu_tuning"] = dataclasses.asdict(tunings[point_shape(p)])
        roofline_record = dict(base, impl="roofline", median_ms=bound.bound_ms, min_ms=bound.bound_ms,
                               max_ms=bound.bound_ms, **dataclasses.asdict(bound), memory_ms=bound.memory_ms,
                               compute_ms=bound.compute_ms, bound_by=bound.bound_by)
        records.append(roofline_record)
        if result.disagreements:
            records += [dict(base, impl=d.impl, failed=True, max_abs_diff_vs_ours=d.max_abs_diff,
                             tolerance=d.tolerance) for d in result.disagreements]
            continue
        for name, ts in result.times.items():
            stats = summarise(ts)
            extra = {"max_abs_diff_vs_ours": result.diffs[name]} if name in result.diffs else {}
            if name not in STEP_BOOKKEEPING:
                extra["median_over_roofline"] = stats["median_ms"] / bound.bound_ms
            records.append(dict(base, impl=name, **stats, **extra))
        for name, why in result.skipped.items():
            records.append(dict(base, impl=name, skipped=why))
        below += below_roofline(p.label(), result.times, bound)
        row = dict(w=p, p=p, times=result.times, roofline=bound, diffs=result.diffs, tuning=tunings[point_shape(p)])
        if isinstance(p, PrefillPoint):
            if p.shared:
                relay_rows.setdefault(planned_point.grid, []).append(row)
            else:
                prefill_rows.append(row)
        else:
            rows_by_table.setdefault((planned_point.grid, p.dtype, p.window), []).append(row)
    for line in below:
        print(f"WARNING: below the roofline: {line}", flush=True)

    shown = [i for i in IMPLS if i in impls]
    sections = report_header(args, env, machine_record, rates, bandwidth_samples, failures, below, others)
    sections += ["", f"Tile parameters and tree reach of ours ({cpu_tuning.__name__}, measured on this CPU at its first use, "
                 f"{cpu_tuning.ENV_VAR}={cpu_tuning.mode()}): "
                 + "; ".join(f"{shape.describe()}: {t.describe()}" for shape, t in tunings.items())]
    several = len(args.sliding_window) > 1
    for (grid, dtype, window), rows in rows_by_table.items():
        sections += ["", f"## {grid}, {dtype}{', ' + window_name(window) if several else ''}", "",
                     markdown_table(rows, shown)]
        skipped = sorted({f"{name}: {why}" for planned_point, result in results
                          if not isinstance(planned_point.point, PrefillPoint) and planned_point.grid == grid
                          and planned_point.point.dtype == dtype for name, why in result.skipped.items()})
        if skipped:
            sections += ["", "Left out of some points: " + "; ".join(skipped)]
    if several:
        sections += ["", *window_kept(rows_by_table, args.sliding_window)]
    if prefill_rows:
        sections += ["", "## prefill (causal, paged): chunkattn::paged_prefill vs vLLM's CPU kernel", "",
                     "n_c in results.json = new tokens per request, n_p = seq_len; roofline bytes: KV, queries and "
                     "outputs.", "", prefill_table(prefill_rows)]
    for grid, rows in relay_rows.items():
        title = {"relay": "rows of several tokens over a shared prefix",
                 "offline": "one layer of the offline batch (bench/offline.py)"}[grid]
        sections += ["", f"## {grid}: {title} (tree path vs per-request prefill vs vLLM)", "",
                     "requests x q new tokens after a shared prefix and private tokens (the "
                     "grid's points: module docstring); tree: every "
                     "query token a row of chunkattn::tpp_decode over the rows' prefix tree; per-request: "
                     "chunkattn::paged_prefill; roofline bytes: the shared KV once, private KV, queries and "
                     "outputs.", "", *relay_table(rows)]
    text = "\n".join(sections) + "\n"
    print("\n" + text, flush=True)
    (out_dir / "table.md").write_text(text)
    (out_dir / "results.json").write_text(json.dumps({
        "machine": machine_record, "machine_rates": {"start": machine.as_json(rates[0]), "end": machine.as_json(rates[1]),
                                                    "bandwidth_samples_gbps": [s.read_bandwidth_gbps
                                                                               for s in bandwidth_samples]},
        "environment": env, "results_from_other_cpus": others,
        "disagreements": [dataclasses.asdict(d) for d in failures], "below_roofline": below, "records": records,
    }, indent=1, default=str))
    print(f"wrote {out_dir / 'table.md'} and {out_dir / 'results.json'}", flush=True)
    table3 = [r for (grid, _, window), rows in rows_by_table.items()
              if grid == "table3" and window == args.sliding_window[0] for r in rows]
    if table3:
        plot_table3(table3, shown, out_dir / "table3.png")
    if failures:
        print("\nFAILED: implementations disagree beyond the tolerance; their points are not timed:\n"
              + "\n".join("  " + d.message() for d in failures), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
