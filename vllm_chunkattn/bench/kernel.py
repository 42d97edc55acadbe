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

Every point also gets a roofline bound, max(bytes / bandwidth, flops / matmul
throughput), with both rates measured on this machine at the start of the
run: bytes are the distinct KV bytes a step must read (a shared chunk
counted once), flops = 4 * b * h * n * d.

Grids:
    table3  the paper's Table 3: n_p in 1024/2048/4096, n_s in 0, n_p/2, 3n_p/4, n_p,
            batch 32, 32 heads, d 128, chunk 64
    fig3    Figure 3: 2048 shared prompt tokens + n_c = 64..2048 private (decoded) tokens
    fig4    Figure 4: batch 8..96 with n_p = 2048, n_s = 2048 and n_s = 1024
    tree    a two-level tree: 1024-token system prompt shared by 32 requests,
            4 groups of 8 sharing 512 more tokens, 256 private tokens each
    serve   the decode steps of the serving benchmark (bench.serve) at max
            concurrency 32, on its model's attention (16 heads of 128, MHA):
            prefix_repetition-2048 (4 prompts of 2048 tokens, 8 requests each)
            and the tree (1024-token system prompt + 4 documents of 1024),
            192 private tokens per request (suffix and output so far)
    prefill chunkattn::paged_prefill vs vLLM's CPU kernel on causal prefill:
            8 requests x 512 new tokens after 512 cached ones (context 1024),
            and 8 x 512 new tokens from scratch; 32 heads, d 128, chunk 64

Timing: `--warmup` untimed calls, then `--repeats` timed calls (the dense
baselines at most 5: they are slow and not the subject); median, min, max.
`--clock wall` (default) times wall-clock with torch's threads. On a machine
shared with other work, `--clock cpu` is the robust alternative: one thread,
and the calling thread's CPU time (time.thread_time), which excludes the time
the thread waits while other processes run; machine rates and rooflines are
then single-core.
Before each timed call the last-level cache is flushed (a 64 MiB write):
in a model, the layer's KV was evicted by the other layers since its last
step. `--warm` skips the flush.

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
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from vllm_chunkattn.kernels import ops
from vllm_chunkattn.prefix import tree
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.kernels.layout import split_kv

IMPLS = ["ours", "PagedAttn", "PagedAttn*", "Naive", "SDPA"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DENSE_MAX_REPEATS = 5


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

    @property
    def context(self) -> int:
        return sum(tokens for tokens, _ in self.segments)

    def label(self) -> str:
        return (f"{self.grid} {self.dtype} b={self.batch} n_p={self.n_p} n_s={self.n_s} n_c={self.n_c} "
                f"h={self.heads} d={self.head_dim} c={self.chunk}")


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
        heads, shared, private = (4, 128, 16) if quick else (16, 2048, 192)
        points.append(Workload(grid, 32, [(shared, 8), (private, 1)], shared + private, shared, 0, heads, d, c, dtype))
        points.append(Workload(grid, 32, [(shared // 2, 32), (shared // 2, 8), (private, 1)], shared + private, shared,
                               0, heads, d, c, dtype))
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
    k_src, v_src = split_kv(src)
    pairs: dict[int, int] = {}
    for s, t in zip(src_table.flatten().tolist(), dst_table.flatten().tolist()):
        pairs[t] = s
    dst = torch.tensor(sorted(pairs), dtype=torch.long)
    srcs = torch.tensor([pairs[t] for t in dst.tolist()], dtype=torch.long)
    step = max(1, 4096 // chunk)
    rows = torch.arange(chunk)
    for i in range(0, len(dst), step):
        s, t = srcs[i : i + step], dst[i : i + step]
        keys = k_src[s].permute(0, 2, 1, 3).reshape(-1, heads, d)
        values = v_src[s].permute(0, 2, 1, 3).reshape(-1, heads, d)
        slots = (t[:, None] * chunk + rows[None, :]).reshape(-1)
        vops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, _vllm_isa(src.dtype, chunk))
    return kv, key_cache, value_cache


def _vllm_isa(dtype: torch.dtype, chunk: int) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, chunk)


def dense_kv(src: torch.Tensor, table: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, h, n, d] key and value tensors gathered from the paged cache."""
    k_src, v_src = split_kv(src)
    batch, heads, d = table.shape[0], src.shape[1], src.shape[3] // 2
    keys = torch.empty(batch, heads, context, d, dtype=src.dtype)
    values = torch.empty_like(keys)
    for b in range(batch):
        blocks = table[b].long()
        keys[b] = k_src[blocks].permute(1, 0, 2, 3).reshape(heads, -1, d)[:, :context]
        values[b] = v_src[blocks].permute(1, 0, 2, 3).reshape(heads, -1, d)[:, :context]
    return keys, values


# ---------------------------------------------------------------------------
# Timing


_FLUSH: torch.Tensor | None = None
_CLOCK: Callable[[], float] = time.perf_counter


def flush_cache() -> None:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.zeros(64 << 20, dtype=torch.uint8)
    _FLUSH.add_(1)


def measure(fn: Callable[[], object], repeats: int, warmup: int, flush: bool) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if flush:
            flush_cache()
        t0 = _CLOCK()
        fn()
        times.append((_CLOCK() - t0) * 1e3)
    return times


def machine_rates() -> tuple[float, float]:
    """(read bandwidth in GB/s, fp32 matmul GFLOP/s) with torch's threads."""
    big = torch.empty(1 << 28, dtype=torch.float32).uniform_()  # 1 GiB
    big.sum()
    bw = max(big.numel() * 4 / (t / 1e3) / 1e9 for t in measure(lambda: big.sum(), 5, 1, False))
    del big
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = max(2 * n**3 / (t / 1e3) / 1e9 for t in measure(lambda: a @ b, 5, 2, False))
    return bw, flops


def roofline_ms(w: Workload, bandwidth: float, gflops: float) -> tuple[float, float, float]:
    """(bound ms, distinct KV bytes, flops)."""
    elem = torch.tensor([], dtype=DTYPES[w.dtype]).element_size()
    tokens = sum(tokens * (w.batch // group) for tokens, group in w.segments)  # distinct
    nbytes = tokens * w.heads * w.head_dim * 2 * elem
    flops = 4 * w.batch * w.heads * w.context * w.head_dim
    return max(nbytes / (bandwidth * 1e9), flops / (gflops * 1e9)) * 1e3, nbytes, flops


# ---------------------------------------------------------------------------
# One point


def run_point(w: Workload, impls: list[str], repeats: int, warmup: int, flush: bool, rng: np.random.Generator):
    dtype = DTYPES[w.dtype]
    scale = w.head_dim**-0.5
    seq_lens = torch.full((w.batch,), w.context, dtype=torch.int32)
    query = torch.empty(w.batch, w.heads, w.head_dim, dtype=dtype).uniform_(-2.0, 2.0)
    qsl = torch.arange(w.batch + 1, dtype=torch.int32)
    results: dict[str, list[float]] = {}
    outputs: dict[str, torch.Tensor] = {}

    shared_table, shared_blocks = block_tables(w, True, rng)
    cache = random_cache(shared_blocks, w, dtype)

    # Ours, and the tree-context costs.
    ctx_cache = tree.PrefixTreeCache()
    ctx = ctx_cache.get(shared_table, seq_lens, w.chunk)
    results["tree rebuild"] = measure(lambda: tree.prefix_tree(shared_table, seq_lens, w.chunk), repeats, 1, False)
    results["tree lookup"] = measure(lambda: ctx_cache.get(shared_table, seq_lens, w.chunk), repeats, 1, False)
    shape = DecodeShape.of_layer(query, cache)
    results["decode plan"] = measure(lambda: ops.plan_tpp_decode(shape, shared_table, seq_lens, ctx), repeats, 1, False)
    if "ours" in impls:
        out = torch.empty_like(query)
        plan = ops.plan_tpp_decode(shape, shared_table, seq_lens, ctx)
        results["ours"] = measure(lambda: ops.tpp_decode(query, cache, plan, scale, out), repeats, warmup, flush)
        outputs["ours"] = out

    def run_vllm(table: torch.Tensor, num_blocks: int, name: str) -> None:
        from vllm import _custom_ops as vops

        _, key_cache, value_cache = vllm_cache(cache, shared_table, table, num_blocks)
        metadata = vops.cpu_attn_get_scheduler_metadata(
            num_reqs=w.batch, num_heads=w.heads, num_kv_heads=w.heads, head_dim=w.head_dim, seq_lens=seq_lens,
            dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=_vllm_isa(dtype, w.chunk),
            enable_kv_split=True)
        out = torch.empty_like(query)

        def step():
            vops.cpu_attention_with_kv_cache(
                query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
                seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
                softcap=0.0, scheduler_metadata=metadata, s_aux=None)

        results[name] = measure(step, repeats, warmup, flush)
        outputs[name] = out

    if "PagedAttn*" in impls:
        run_vllm(shared_table, shared_blocks, "PagedAttn*")
        gc.collect()
    if "PagedAttn" in impls:
        private_table, private_blocks = block_tables(w, False, rng)
        run_vllm(private_table, private_blocks, "PagedAttn")
        gc.collect()
    if "Naive" in impls or "SDPA" in impls:
        keys, values = dense_kv(cache, shared_table, w.context)
        q4 = query.unsqueeze(2)  # [b, h, 1, d]
        dense_repeats = min(repeats, DENSE_MAX_REPEATS)
        if "Naive" in impls:
            def naive():
                return torch.softmax((q4 @ keys.transpose(-1, -2)) * scale, dim=-1) @ values

            results["Naive"] = measure(naive, dense_repeats, 1, flush)
            outputs["Naive"] = naive().squeeze(2)
        if "SDPA" in impls:
            def sdpa():
                return F.scaled_dot_product_attention(q4, keys, values, scale=scale)

            results["SDPA"] = measure(sdpa, dense_repeats, 1, flush)
            outputs["SDPA"] = sdpa().squeeze(2)
        del keys, values
    del cache
    gc.collect()

    # Sanity: every implementation computed the same attention.
    diffs = {}
    if "ours" in outputs:
        for name, o in outputs.items():
            if name != "ours":
                diffs[name] = (o.float() - outputs["ours"].float()).abs().max().item()
    return results, diffs


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


def prefill_points(dtype: str, quick: bool) -> list[PrefillPoint]:
    if quick:
        return [PrefillPoint(2, 32, 64, 4, 64, 32, dtype)]
    return [PrefillPoint(8, 512, 1024, 32, 128, 64, dtype), PrefillPoint(8, 512, 512, 32, 128, 64, dtype)]


def run_prefill_point(p: PrefillPoint, repeats: int, warmup: int, flush: bool, rng: np.random.Generator):
    from vllm import _custom_ops as vops

    dtype = DTYPES[p.dtype]
    w = Workload("prefill", p.requests, [(p.context, 1)], p.context, 0, 0, p.heads, p.head_dim, p.chunk, p.dtype)
    table, num_blocks = block_tables(w, False, rng)
    cache = random_cache(num_blocks, w, dtype)
    seq_lens = torch.full((p.requests,), p.context, dtype=torch.int32)
    qsl = torch.arange(p.requests + 1, dtype=torch.int32) * p.new
    query = torch.empty(p.requests * p.new, p.heads, p.head_dim, dtype=dtype).uniform_(-2.0, 2.0)
    scale = p.head_dim**-0.5
    ours = torch.empty_like(query)
    times = {"ours": measure(lambda: ops.paged_prefill(query, cache, qsl, seq_lens, table, scale, ours),
                             repeats, warmup, flush)}
    _, key_cache, value_cache = vllm_cache(cache, table, table, num_blocks)
    isa = _vllm_isa(dtype, p.chunk)
    metadata = vops.cpu_attn_get_scheduler_metadata(
        num_reqs=p.requests, num_heads=p.heads, num_kv_heads=p.heads, head_dim=p.head_dim, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)
    theirs = torch.empty_like(query)
    times["vLLM"] = measure(lambda: vops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=theirs, query_start_loc=qsl,
        seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
        softcap=0.0, scheduler_metadata=metadata, s_aux=None), repeats, warmup, flush)
    diff = (ours.float() - theirs.float()).abs().max().item()
    return times, diff


def prefill_table(rows: list[dict]) -> str:
    lines = ["| dtype | requests | new tokens | seq_len | heads | d | chunk | ours ms | vLLM ms | vLLM/ours | "
             "GFLOP/s ours | max|Δ| |", "|" + "---|" * 12]
    for r in rows:
        p, med = r["p"], r["median"]
        flops = 4 * p.requests * p.heads * p.head_dim * sum(p.context - p.new + t + 1 for t in range(p.new))
        lines.append(f"| {p.dtype} | {p.requests} | {p.new} | {p.context} | {p.heads} | {p.head_dim} | {p.chunk} | "
                     f"{fmt(med['ours'])} | {fmt(med['vLLM'])} | {med['vLLM'] / med['ours']:.2f}x | "
                     f"{flops / (med['ours'] / 1e3) / 1e9:.1f} | {r['diff']:.1e} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Report


def summarise(times: list[float]) -> dict[str, float]:
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if x < 100 else f"{x:.0f}"


def markdown_table(rows: list[dict], impls: list[str]) -> str:
    """One table of a grid and dtype; rows are dicts made by main()."""
    head = ["n_p", "n_s", "n_c", "batch", "tokens:requests sharing them"] + [f"{i} ms" for i in impls] + ["roofline ms"]
    ratios = [f"{i}/ours" for i in impls if i != "ours"]
    head += ratios + ["ours/roofline", "tok/s ours", "rebuild ms (% step)", "lookup ms (% step)", "plan ms (% step)",
                      "max|Δ| vs ours"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ours = r["median"].get("ours")
        cells = [str(r["w"].n_p), str(r["w"].n_s), str(r["w"].n_c), str(r["w"].batch),
                 " + ".join(f"{tokens}:{group}" for tokens, group in r["w"].segments)]
        cells += [fmt(r["median"].get(i)) for i in impls] + [fmt(r["roofline"])]
        for i in impls:
            if i == "ours":
                continue
            cells.append(f"{r['median'][i] / ours:.2f}x" if ours and i in r["median"] else "-")
        cells.append(f"{ours / r['roofline']:.2f}" if ours else "-")
        cells.append(f"{r['w'].batch / (ours / 1e3):.0f}" if ours else "-")
        for key in ("tree rebuild", "tree lookup", "decode plan"):
            t = r["median"][key]
            cells.append(f"{t:.3f} ({100 * t / ours:.1f}%)" if ours else f"{t:.3f}")
        cells.append(", ".join(f"{k} {v:.1e}" for k, v in r["diffs"].items()) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_table3(rows: list[dict], impls: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
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
            ys = [r["roofline"] if name == "roofline" else r["median"].get(name, float("nan")) for r in sel]
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
        gpu_argv += ["--quick"] if args.quick else []
        code = kernel_gpu.main(gpu_argv)
        if code:
            return code
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default="all", choices=["table3", "fig3", "fig4", "tree", "serve", "prefill", "all"])
    parser.add_argument("--dtype", default="both", choices=["bf16", "fp32", "both"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a CI smoke run")
    parser.add_argument("--warm", action="store_true", help="do not flush the cache before timed calls")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {IMPLS}")
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="wall: wall-clock, torch's threads; cpu: one thread, its CPU time (robust to other load)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the GPU kernels on the same grids (vllm_chunkattn.bench.kernel_gpu)")
    parser.add_argument("--out", default="results/kernel")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        sys.exit(run_on_gpu(args))

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
    grids = ["table3", "fig3", "fig4", "tree", "serve", "prefill"] if args.grid == "all" else [args.grid]
    if "prefill" in grids and not any(i.startswith("PagedAttn") for i in impls):
        grids.remove("prefill")  # needs vLLM
    dtypes = ["bf16", "fp32"] if args.dtype == "both" else [args.dtype]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    bandwidth, gflops = machine_rates()
    env = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_isa": torch.ops.chunkattn.cpu_isa(),
        "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "read_bandwidth_GBps": round(bandwidth, 1), "fp32_matmul_GFLOPs": round(gflops, 1),
        "loadavg_start": os.getloadavg(), "flush_cache": not args.warm, "clock": args.clock, "repeats": args.repeats,
        "warmup": args.warmup, "argv": sys.argv,
    }
    print(f"machine: {env}", flush=True)
    if os.getloadavg()[0] > (os.cpu_count() or 1) * 0.5:
        print(f"WARNING: load average {os.getloadavg()} on {os.cpu_count()} cores: other processes share the "
              f"machine, timings will be noisy", flush=True)

    rng = np.random.default_rng(0)
    records = []
    rows_by_table: dict[tuple[str, str], list[dict]] = {}
    start = time.time()
    prefill_rows: list[dict] = []
    for grid in grids:
        for dtype in dtypes:
            if grid == "prefill":
                for p in prefill_points(dtype, args.quick):
                    print(f"[{time.time() - start:6.0f}s] prefill {p} ...", flush=True)
                    times, diff = run_prefill_point(p, args.repeats, args.warmup, not args.warm, rng)
                    for name, ts in times.items():
                        records.append(dict(grid="prefill", impl=name, n_p=p.context, n_s=0, n_c=p.new,
                                            batch=p.requests, heads=p.heads, head_dim=p.head_dim, chunk=p.chunk,
                                            dtype=p.dtype, **summarise(ts), max_abs_diff_vs_ours=diff))
                    median = {name: statistics.median(ts) for name, ts in times.items()}
                    prefill_rows.append(dict(p=p, median=median, diff=diff))
                    print("    " + "  ".join(f"{k} {v:.2f}" for k, v in median.items()), flush=True)
                continue
            for w in grid_points(grid, dtype, args.quick):
                print(f"[{time.time() - start:6.0f}s] {w.label()} ...", flush=True)
                times, diffs = run_point(w, impls, args.repeats, args.warmup, not args.warm, rng)
                bound, nbytes, flops = roofline_ms(w, bandwidth, gflops)
                base = dict(grid=grid, n_p=w.n_p, n_s=w.n_s, n_c=w.n_c, batch=w.batch, heads=w.heads,
                            head_dim=w.head_dim, chunk=w.chunk, dtype=w.dtype)
                for name, ts in times.items():
                    records.append(dict(base, impl=name, **summarise(ts), **(
                        {"max_abs_diff_vs_ours": diffs[name]} if name in diffs else {})))
                records.append(dict(base, impl="roofline", median_ms=bound, min_ms=bound, max_ms=bound,
                                    kv_bytes=nbytes, flops=flops))
                median = {name: statistics.median(ts) for name, ts in times.items()}
                rows_by_table.setdefault((grid, dtype), []).append(
                    dict(w=w, median=median, roofline=bound, diffs=diffs))
                print("    " + "  ".join(f"{k} {v:.2f}" for k, v in median.items()) + f"  roofline {bound:.2f} ms",
                      flush=True)
    env["loadavg_end"] = os.getloadavg()
    env["seconds"] = round(time.time() - start)

    sections = [
        "# Decode attention kernel benchmark (one layer, one step)",
        "",
        f"Machine: {env['cores']} cores, ours on `{env['cpu_isa']}`, torch {env['torch']} with {env['threads']} "
        f"threads; clock: {'wall' if args.clock == 'wall' else 'CPU time of the (single) calling thread'}; "
        f"measured read bandwidth {env['read_bandwidth_GBps']} GB/s, fp32 matmul "
        f"{env['fp32_matmul_GFLOPs']} GFLOP/s; load average at start {env['loadavg_start'][0]:.1f}, at end "
        f"{env['loadavg_end'][0]:.1f}; cache {'flushed' if env['flush_cache'] else 'warm'} before each timed call; "
        f"median of {args.repeats} (dense baselines: {min(args.repeats, DENSE_MAX_REPEATS)}).",
        "",
        "Ratios X/ours > 1 mean ours is faster. rebuild/lookup: prefix-tree context costs of ours, outside the "
        "kernel time; % of one layer's decode step of ours.",
        "",
        f"Command: `python -m vllm_chunkattn.bench.kernel {' '.join(sys.argv[1:])}`",
    ]
    for (grid, dtype), rows in rows_by_table.items():
        sections += ["", f"## {grid}, {dtype}", "", markdown_table(rows, impls)]
    if prefill_rows:
        sections += ["", "## prefill (causal, paged): chunkattn::paged_prefill vs vLLM's CPU kernel", "",
                     "n_c in results.json = new tokens per request, n_p = seq_len.", "", prefill_table(prefill_rows)]
    text = "\n".join(sections) + "\n"
    print("\n" + text, flush=True)
    (out_dir / "table.md").write_text(text)
    (out_dir / "results.json").write_text(json.dumps({"environment": env, "records": records}, indent=1))
    print(f"wrote {out_dir / 'table.md'} and {out_dir / 'results.json'}", flush=True)
    table3 = [r for (grid, _), rows in rows_by_table.items() if grid == "table3" for r in rows]
    if table3:
        plot_table3(table3, impls, out_dir / "table3.png")


if __name__ == "__main__":
    main()
