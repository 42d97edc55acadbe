"""GPU kernel benchmark: the `chunk` TPP decode kernel against other decode
attention kernels on the paper's microbenchmark grid (ChunkAttention,
section 4.1), so that one command reproduces the comparison on a GPU host:

    python -m vllm_chunkattn.bench.kernel_gpu                       # all grids
    python -m vllm_chunkattn.bench.kernel_gpu --grids table3 --out results/kernel_gpu

Grids (defined here; the CPU kernel benchmark, vllm_chunkattn/bench/kernel.py,
uses the same points):
  table3      Table 3: b = 32, n_p in {1024, 2048, 4096}, n_s in {0, n_p/2, 3n_p/4, n_p}
  figure3     Figure 3: b = 32, n_p = 2048, n_s in {1024, 2048}, n_c = 1 .. 2048
  figure4     Figure 4: n_p = n_s = 2048, n_c = 64, b = 1 .. 128
  multilevel  a three-level tree: 1 system prompt (1024) -> 4 documents (512)
              -> 4 templates (256) each, 128 private tokens per request
  relay       b = 32, q in {1, 2, 4, 8, 16, 64} new tokens per request after
              2048 shared + 128 private tokens (RelayAttention's prompt
              phase, speculative rows): where the tree path stops paying on
              this GPU, i.e. what CUDA.tree_max_rows_per_kv_head should be
Each point decodes one token per request over a context of n_p + n_c tokens
(n_c >= 1: the token being decoded is the request's own), the first n_s of
them one physical copy shared by all (vLLM prefix caching: whole blocks);
relay points decode the last q of them, causally (prefix/query_rows.py).
Model shape defaults to the paper's: 32 heads of 128, chunk (block) 64, fp16.

Methods (one column each; a method that is not installed or does not apply
to a point says so instead of a time):
  chunk          ops.tpp_decode (csrc/cuda): chunk-first phase over shared
                 nodes on tensor cores + sequence-first phase + merge
  chunk_no_tree  the same kernels with an empty tree (no chunk-first phase):
                 what TPP itself buys
  chunk_own_stacked  on points of several tokens per request, every request's
                 own rows stacked over its private chunks, where `chunk` drops
                 those nodes as the engine does (CUDA.own_node_min_query_len):
                 what that per-node rule buys
  chunk_prefill  our per-request paged prefill (ops.paged_prefill), where
                 requests have several new tokens: the path the engine takes
                 for them above the tree threshold
  fa_shared      vLLM's FlashAttention decode (flash_attn_varlen_func, paged)
                 over the same physically shared blocks (the paper's PagedAttn*)
  fa_unshared    the same with every request's own copy of the prefix (PagedAttn)
  flashinfer     FlashInfer's MultiLevelCascadeAttentionWrapper, one level per
                 tree level plus the private level (regular trees), if installed
  xformers       xformers memory_efficient_attention on dense per-request K/V
                 (monolithic KV, not prefix-aware), if installed
  sdpa           torch scaled_dot_product_attention on dense K/V (the "Naive" row)
Times are GPU time per call in microseconds: each call is captured in a CUDA
graph and replayed (launch overhead excluded, as the paper measures the
kernel), falling back to timed eager calls where capture fails. Before any
timing, every method's output is checked against `chunk`'s (max abs
difference, one tolerance per dtype in bench/agreement.py): a point where one
differs by more is not timed, and the run exits 1 naming the point, the
method and the difference. The results record the machine
(bench/machine.py: the host CPU, the GPU, torch, vLLM, the commit) and warn
about results of another machine beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from vllm_chunkattn.bench import agreement, machine
from vllm_chunkattn.prefix.device_buffers import DeviceTreeBuffers
from vllm_chunkattn.kernels import layout
from vllm_chunkattn.kernels.support import CUDA
from vllm_chunkattn.prefix.query_rows import expand_query_rows, unstack_own_nodes
from vllm_chunkattn.prefix.tree import context_from_nodes
from vllm_chunkattn.testing.paged_cases import multi_level, num_blocks_needed, shared_prefix
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.prefix.tree import PrefixTreeContext, prefix_tree

METHODS = ["chunk", "chunk_no_tree", "chunk_own_stacked", "chunk_prefill", "fa_shared", "fa_unshared", "flashinfer",
           "xformers", "sdpa"]
RELAY_QUERY_LENS = (1, 2, 4, 8, 16, 64)


@dataclass(frozen=True)
class Point:
    grid: str
    batch: int
    prompt: int  # n_p
    shared: int  # n_s
    completion: int  # n_c: tokens decoded so far (>= 1: includes the current one)
    levels: tuple[tuple[int, int], ...] = ()  # multi-level tree: (fan-out, tokens) per level
    private: int = 0  # multi-level tree: private tokens per request
    query_len: int = 1  # new tokens per request (the last of the context), one tree row each

    @property
    def context(self) -> int:
        if self.levels:
            return sum(tokens for _, tokens in self.levels) + self.private
        return self.prompt + self.completion

    def label(self) -> str:
        if self.levels:
            return f"{self.grid} b={self.batch} levels={list(self.levels)} private={self.private}"
        rows = f" q={self.query_len}" if self.query_len > 1 else ""
        return f"{self.grid} b={self.batch} n_p={self.prompt} n_s={self.shared} n_c={self.completion}{rows}"


def grid_points(names: list[str], quick: bool = False) -> list[Point]:
    grids: dict[str, list[Point]] = {
        "table3": [
            Point("table3", 32, n_p, n_s, 1)
            for n_p in (1024, 2048, 4096)
            for n_s in (0, n_p // 2, 3 * n_p // 4, n_p)
        ],
        "figure3": [
            Point("figure3", 32, 2048, n_s, n_c) for n_s in (1024, 2048) for n_c in (1, 256, 512, 1024, 2048)
        ],
        "figure4": [Point("figure4", b, 2048, 2048, 64) for b in (1, 8, 16, 32, 64, 96, 128)],
        "multilevel": [
            Point("multilevel", b, 0, 0, 0, levels=((1, 1024), (4, 512), (4, 256)), private=128)
            for b in (32, 64, 128)
        ],
        "relay": [Point("relay", 32, 2048, 2048, 128 + q, query_len=q) for q in RELAY_QUERY_LENS],
    }
    unknown = [n for n in names if n not in grids]
    if unknown:
        raise ValueError(f"unknown grid(s) {unknown}; known: {', '.join(grids)}")
    points = [p for n in names for p in grids[n]]
    if quick:  # first and last point of each grid
        points = [p for n in names for p in dict.fromkeys([grids[n][0], grids[n][-1]])]
    return points


def point_table(point: Point, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block table (block 0 left free, as vLLM's null block) and sequence lengths."""
    if point.levels:
        return multi_level(point.batch, list(point.levels), point.private, block_size)
    return shared_prefix(point.batch, point.context, point.shared, block_size)


# ---------------------------------------------------------------- baselines' inputs
def unshared_table(table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """A table in which every request owns a private copy of each of its blocks:
    row r's j-th block becomes block 1 + r * width + j."""
    batch, width = table.shape
    return (1 + torch.arange(batch * width, dtype=torch.int32)).view(batch, width)


def dense_kv(kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of requests that all have `seq_len` tokens, gathered into
    dense [batch, seq_len, num_kv_heads, head_size] tensors."""
    _, kv_heads, block_size, two_d = kv_cache.shape
    batch, n = table.shape[0], -(-seq_len // block_size)
    blocks = table[:, :n].long().to(kv_cache.device).flatten()
    k, v = (x.view(batch, n, kv_heads, block_size, two_d // 2).permute(0, 1, 3, 2, 4)
            .reshape(batch, n * block_size, kv_heads, two_d // 2) for x in layout.read_blocks(kv_cache, blocks))
    return k[:, :seq_len].contiguous(), v[:, :seq_len].contiguous()


def flash_layout(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our [blocks, H, bs, 2D] cache as vLLM FlashAttention's K and V caches [blocks, bs, H, D]."""
    k, v = layout.read_blocks(kv_cache, torch.arange(kv_cache.shape[0], device=kv_cache.device))
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


@dataclass
class CascadeLevel:
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    last_page_len: list[int]


def cascade_levels(
    ctx: PrefixTreeContext, table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> list[CascadeLevel] | None:
    """The tree as FlashInfer cascade levels, queries in tree order (ctx.order):
    level l holds, for each node at depth l, its covered query range and its
    pages; the last level each request's private pages. None where the tree is
    not regular (requests at different depths) or a request has no private page."""
    order = ctx.order.tolist()
    batch = len(order)
    per_position: list[list[int]] = [[] for _ in range(batch)]
    for k in range(ctx.num_nodes):
        for t in range(int(ctx.node_begin[k]), int(ctx.node_end[k])):
            per_position[t].append(k)
    for nodes in per_position:
        nodes.sort(key=lambda k: int(ctx.node_chunk_begin[k]))
    depth = len(per_position[0]) if batch else 0
    if any(len(nodes) != depth for nodes in per_position):
        return None
    levels = []
    for level in range(depth):
        lv = CascadeLevel([0], [0], [], [])
        t = 0
        while t < batch:
            k = per_position[t][level]
            begin, end = int(ctx.node_begin[k]), int(ctx.node_end[k])
            if begin != t:
                return None
            blocks = table[order[begin], int(ctx.node_chunk_begin[k]) : int(ctx.node_chunk_end[k])].tolist()
            lv.kv_indices += blocks
            lv.kv_indptr.append(len(lv.kv_indices))
            lv.last_page_len.append(block_size)
            lv.qo_indptr.append(end)
            t = end
        levels.append(lv)
    unique = CascadeLevel(list(range(batch + 1)), [0], [], [])
    for row in order:
        start = int(ctx.shared_chunks[row])
        n = -(-int(seq_lens[row]) // block_size)
        if n <= start:
            return None
        unique.kv_indices += table[row, start:n].tolist()
        unique.kv_indptr.append(len(unique.kv_indices))
        unique.last_page_len.append(int(seq_lens[row]) - (n - 1) * block_size)
    levels.append(unique)
    return levels


# ---------------------------------------------------------------- timing
def time_gpu(fn: Callable[[], object], iters: int, warmup: int = 3, graph: bool = True) -> tuple[float, str]:
    """Microseconds per call, and whether it was measured as CUDA-graph replays or eager calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run, mode = fn, "eager"
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run, mode = g.replay, "graph"
        except Exception:  # not capturable: time eager calls
            torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters, mode


@dataclass
class Settings:
    heads: int = 32
    kv_heads: int = 32
    head_size: int = 128
    block_size: int = 64
    dtype: str = "float16"
    iters: int = 50
    graph: bool = True
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    memory_fraction: float = 0.6  # skip dense/unshared copies that need more of the free memory


def _method_fns(point: Point, s: Settings, device: torch.device) -> tuple[dict, dict, dict]:
    """Callables per method (each writes / returns [B, H, D]), skip reasons, and setup facts."""
    from vllm_chunkattn.kernels import ops

    dtype = getattr(torch, s.dtype)
    table, seq_lens = point_table(point, s.block_size)
    batch, seq_len, q = table.shape[0], int(seq_lens.max()), point.query_len
    gen = torch.Generator(device=device).manual_seed(0)
    num_blocks = num_blocks_needed(table)
    kv = torch.randn(num_blocks, s.kv_heads, s.block_size, 2 * s.head_size, device=device, generator=gen).to(dtype)
    query = torch.randn(batch * q, s.heads, s.head_size, device=device, generator=gen).to(dtype)
    scale = 1.0 / math.sqrt(s.head_size)
    table_d, lens_d = table.to(device), seq_lens.to(device)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device) * q
    started = time.perf_counter()
    # One tree row per query token (for q = 1: the requests themselves), as the builder makes them.
    query_lens = torch.full((batch,), q)
    rows = expand_query_rows(table, seq_lens, query_lens)
    stacked_ctx = prefix_tree(rows.block_table, rows.unmasked_lens, s.block_size)
    ctx = unstack_own_nodes(stacked_ctx, query_lens, CUDA.own_node_min_query_len)  # the engine's nodes
    facts = {"tree_build_ms": (time.perf_counter() - started) * 1e3, "nodes": ctx.num_nodes,
             "partial_rows": ctx.num_partial_rows, "context": seq_len,
             "inputs": (query, kv, table, seq_lens, scale)}
    num_rows = batch * q
    rows_table_d, rows_lens_d = rows.block_table.to(device), rows.seq_lens.to(device)
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    skipped: dict[str, str] = {}
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 1 << 40
    dense_bytes = 2 * batch * seq_len * s.kv_heads * s.head_size * query.element_size()

    def chunk_fn(tree: PrefixTreeContext) -> Callable[[], torch.Tensor]:
        buffers = DeviceTreeBuffers(num_rows, max(tree.num_nodes, 1), max(tree.num_partial_rows, 1), device)
        view = buffers.load(tree, num_rows)
        # Planned once, as the builder does per step; the timed call is one layer's.
        plan = ops.plan_tpp_decode(DecodeShape.of_layer(query, kv), rows_table_d, rows_lens_d, view)
        out = torch.empty_like(query)
        return lambda: ops.tpp_decode(query, kv, plan, scale, out)

    if "chunk" in s.methods:
        fns["chunk"] = chunk_fn(ctx)
    if "chunk_no_tree" in s.methods:
        fns["chunk_no_tree"] = chunk_fn(context_from_nodes(np.arange(num_rows), [], num_rows))
    if "chunk_own_stacked" in s.methods:
        if ctx is stacked_ctx:
            skipped["chunk_own_stacked"] = "no own node dropped here: the same nodes as chunk"
        else:
            fns["chunk_own_stacked"] = chunk_fn(stacked_ctx)
    if "chunk_prefill" in s.methods:
        if q == 1:
            skipped["chunk_prefill"] = "one-token rows: the engine's path is the tree"
        else:
            prefill_out = torch.empty_like(query)
            fns["chunk_prefill"] = lambda: ops.paged_prefill(query, kv, cu_q, lens_d, table_d, scale, prefill_out)

    if "fa_shared" in s.methods or "fa_unshared" in s.methods:
        try:
            from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

            fa_version = get_flash_attn_version()
            k_fa, v_fa = flash_layout(kv)

            def fa_fn(k_cache, v_cache, blocks):
                out = torch.empty_like(query)
                kwargs = dict(
                    q=query, k=k_cache, v=v_cache, out=out, cu_seqlens_q=cu_q, max_seqlen_q=q, seqused_k=lens_d,
                    max_seqlen_k=seq_len, softmax_scale=scale, causal=True, block_table=blocks,
                )
                if fa_version is not None:
                    kwargs["fa_version"] = fa_version

                def call():
                    flash_attn_varlen_func(**kwargs)
                    return out

                return call

            if "fa_shared" in s.methods:
                fns["fa_shared"] = fa_fn(k_fa, v_fa, table_d)
            if "fa_unshared" in s.methods:
                if dense_bytes > s.memory_fraction * free:
                    skipped["fa_unshared"] = "does not fit in free GPU memory"
                else:
                    private = unshared_table(table, seq_lens, s.block_size).to(device)
                    src = table_d.long().flatten()
                    k_u = torch.cat([k_fa[:1], k_fa[src]])
                    v_u = torch.cat([v_fa[:1], v_fa[src]])
                    fns["fa_unshared"] = fa_fn(k_u, v_u, private)
        except Exception as e:  # not a CUDA build of vLLM / no FlashAttention
            for m in ("fa_shared", "fa_unshared"):
                skipped.setdefault(m, f"vLLM FlashAttention unavailable: {type(e).__name__}: {e}")

    decode_only = [m for m in ("flashinfer", "xformers", "sdpa") if m in s.methods]
    if q > 1:  # these baselines are set up for one query token per request
        for m in decode_only:
            skipped[m] = "one query token per request only"
    elif "flashinfer" in s.methods:
        try:
            import flashinfer

            levels = cascade_levels(ctx, table, seq_lens, s.block_size)
            if levels is None:
                skipped["flashinfer"] = "tree is not regular (requests at different depths)"
            else:
                order = ctx.order.long().to(device)
                q_tree = query[order].contiguous()
                k_tiles, v_tiles = layout.read_blocks(kv, torch.arange(kv.shape[0], device=device))
                paged = torch.stack([k_tiles, v_tiles], 1).permute(0, 1, 3, 2, 4).contiguous()  # NHD
                workspace = torch.empty(256 << 20, dtype=torch.uint8, device=device)
                wrapper = flashinfer.MultiLevelCascadeAttentionWrapper(len(levels), workspace, "NHD")

                def i32(values):
                    return torch.tensor(values, dtype=torch.int32, device=device)

                wrapper.plan(
                    [i32(lv.qo_indptr) for lv in levels], [i32(lv.kv_indptr) for lv in levels],
                    [i32(lv.kv_indices) for lv in levels], [i32(lv.last_page_len) for lv in levels],
                    s.heads, s.kv_heads, s.head_size, s.block_size, sm_scale=scale, q_data_type=dtype,
                )
                inverse = torch.empty_like(order)
                inverse[order] = torch.arange(batch, device=device)
                fns["flashinfer"] = lambda: wrapper.run(q_tree, paged)[inverse]  # back to batch order
                facts["flashinfer_levels"] = len(levels)
        except ImportError:
            skipped["flashinfer"] = "flashinfer not installed"
        except Exception as e:
            skipped["flashinfer"] = f"{type(e).__name__}: {e}"

    dense_needed = [m for m in ("xformers", "sdpa") if m in s.methods and q == 1]
    if dense_needed:
        if int(seq_lens.min()) != seq_len:
            for m in dense_needed:
                skipped[m] = "requests of different lengths"
        elif dense_bytes > s.memory_fraction * free:
            for m in dense_needed:
                skipped[m] = "dense K/V does not fit in free GPU memory"
        else:
            k_dense, v_dense = dense_kv(kv, table, seq_len)
            group = s.heads // s.kv_heads
            if "xformers" in s.methods:
                try:
                    import xformers.ops as xops

                    q5 = query.view(batch, 1, s.kv_heads, group, s.head_size)
                    k5 = k_dense.unsqueeze(3).expand(batch, seq_len, s.kv_heads, group, s.head_size)
                    v5 = v_dense.unsqueeze(3).expand(batch, seq_len, s.kv_heads, group, s.head_size)
                    fns["xformers"] = lambda: xops.memory_efficient_attention_forward(q5, k5, v5, scale=scale).reshape(
                        batch, s.heads, s.head_size
                    )
                except ImportError:
                    skipped["xformers"] = "xformers not installed"
            if "sdpa" in s.methods:
                q4 = query.unsqueeze(2)  # [B, H, 1, D]
                k4, v4 = k_dense.transpose(1, 2), v_dense.transpose(1, 2)  # [B, Hkv, L, D]
                fns["sdpa"] = lambda: torch.nn.functional.scaled_dot_product_attention(
                    q4, k4, v4, scale=scale, enable_gqa=group > 1
                )[:, :, 0]
    return fns, skipped, facts


def run_point(point: Point, s: Settings, device: torch.device) -> dict:
    """Every method's output checked against chunk's first; the methods timed only if all agree."""
    fns, skipped, facts = _method_fns(point, s, device)
    row: dict = {**asdict(point), "context": facts["context"], "nodes": facts["nodes"],
                 "partial_rows": facts["partial_rows"], "tree_build_ms": round(facts["tree_build_ms"], 3),
                 "times_us": {}, "timing": {}, "max_abs_diff_vs_chunk": {}, "skipped": skipped, "disagreements": []}
    outputs: dict[str, torch.Tensor] = {}
    for method in s.methods:
        if method not in fns:
            continue
        try:
            outputs[method] = fns[method]().float().clone()  # every method returns [batch * q, heads, head_size]
            torch.cuda.synchronize()
        except Exception as e:
            skipped[method] = f"{type(e).__name__}: {e}"
    if "chunk" not in outputs:
        skipped.setdefault("chunk", "not run")
        row["disagreements"] = [asdict(agreement.Disagreement(point.label(), "chunk", "chunk", math.inf, 0.0))]
        return row
    diffs = {m: agreement.max_abs_diff(out, outputs["chunk"]) for m, out in outputs.items() if m != "chunk"}
    row["max_abs_diff_vs_chunk"] = diffs
    row["disagreements"] = [asdict(d) for d in agreement.check(point.label(), getattr(torch, s.dtype), diffs, "chunk")]
    del outputs
    if row["disagreements"]:
        return row
    for method in s.methods:
        if method not in fns or method in skipped:
            continue
        try:
            us, mode = time_gpu(fns[method], s.iters, graph=s.graph)
            row["times_us"][method] = round(us, 2)
            row["timing"][method] = mode
        except Exception as e:
            skipped[method] = f"{type(e).__name__}: {e}"
    t = row["times_us"]
    if "chunk" in t:
        row["speedup_vs"] = {m: round(t[m] / t["chunk"], 3) for m in t if m != "chunk"}
    return row


def markdown(rows: list[dict], methods: list[str]) -> str:
    shown = [m for m in methods if any(m in r["times_us"] for r in rows)]
    ratios = [m for m in ("fa_shared", "chunk_prefill") if m in shown]
    header = ["grid", "b", "n_p", "n_s", "n_c", "q", "context", "nodes"] + [f"{m} (us)" for m in shown]
    header += [f"{m} / chunk" for m in ratios]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r["grid"], r["batch"], r["prompt"] or "-", r["shared"] or ("-" if r["levels"] else 0),
                 r["completion"] or "-", r.get("query_len", 1), r["context"], r["nodes"]]
        cells += [r["times_us"].get(m, "n/a") for m in shown]
        cells += [f"{r.get('speedup_vs', {}).get(m, 'n/a')}x" for m in ratios]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def relay_crossover(rows: list[dict], group: int) -> str | None:
    """Where the tree path stops beating our per-request prefill on the relay
    grid: the most query rows per KV head (q x GQA group) up to which it won
    at every point, against the engine's CUDA.tree_max_rows_per_kv_head."""
    from vllm_chunkattn.kernels.support import CUDA

    wins: dict[int, bool] = {}
    for r in rows:
        t = r["times_us"]
        if r["grid"] != "relay" or "chunk" not in t or "chunk_prefill" not in t:
            continue
        rows_per_kv_head = r["query_len"] * group
        wins[rows_per_kv_head] = wins.get(rows_per_kv_head, True) and t["chunk"] <= t["chunk_prefill"]
    if not wins:
        return None
    most = group  # one-token rows always take the tree
    for n in sorted(wins):
        if not wins[n]:
            break
        most = n
    measured = ", ".join(f"{n}: {'yes' if ok else 'no'}" for n, ok in sorted(wins.items()))
    return (f"Relay: the tree path was at least as fast as our per-request prefill at every point with at most "
            f"{most} query rows per KV head (q x GQA group; measured: {measured}). The engine sends a request to "
            f"the tree path on CUDA when q x group <= {CUDA.tree_max_rows_per_kv_head} "
            f"(kernels/support.py, CUDA.tree_max_rows_per_kv_head).")


def plot_speedups(rows: list[dict], methods: list[str], title: str, path: Path) -> None:
    """One panel per grid: each baseline's time over chunk's at every point (above 1: chunk is faster)."""
    try:
        from vllm_chunkattn.bench.report import _pyplot

        plt = _pyplot()
    except ImportError:
        print(f"matplotlib is not installed: skipping {path}", flush=True)
        return
    rows = [r for r in rows if "chunk" in r["times_us"]]
    grids = list(dict.fromkeys(r["grid"] for r in rows))
    baselines = [m for m in methods if m != "chunk" and any(m in r["times_us"] for r in rows)]
    if not rows or not baselines:
        return
    fig, axes = plt.subplots(len(grids), 1, figsize=(12, 3.6 * len(grids)), squeeze=False)
    width = 0.8 / len(baselines)
    for ax, grid in zip(axes[:, 0], grids):
        sel = [r for r in rows if r["grid"] == grid]
        for k, m in enumerate(baselines):
            ys = [r["times_us"][m] / r["times_us"]["chunk"] if m in r["times_us"] else float("nan") for r in sel]
            ax.bar(np.arange(len(sel)) + k * width, ys, width, label=m)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(sel)) + width * (len(baselines) - 1) / 2, [_short_label(r) for r in sel],
                      fontsize=8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(lambda y, _: f"{y:g}x")
        ax.yaxis.set_minor_formatter(lambda y, _: f"{y:g}x" if round(y * 10) % 5 == 0 else "")
        ax.set_ylabel("time / chunk's time")
        ax.set_title(f"{grid}: above 1 = chunk faster", fontsize=10)
        ax.legend(ncols=len(baselines), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)


def _short_label(row: dict) -> str:
    if row["levels"]:
        return f"b={row['batch']}"
    rows = f" q={row['query_len']}" if row.get("query_len", 1) > 1 else ""
    return f"b={row['batch']}{rows}\n{row['prompt']}/{row['shared']}/{row['completion']}"


def _title(meta: dict) -> str:
    s = meta["settings"]
    return (f"{meta['device']} (sm_{meta['capability'].replace('.', '')}), {s['heads']} heads ({s['kv_heads']} KV) "
            f"x {s['head_size']}, block {s['block_size']}, {s['dtype']}; labels b, n_p/n_s/n_c")


def replot(json_path: Path) -> int:
    """The plot of a finished run (e.g. one made on a GPU host), here: JSON -> .png beside it."""
    results = json.loads(json_path.read_text())
    methods = list(dict.fromkeys(m for r in results["rows"] for m in r["times_us"]))
    plot_speedups(results["rows"], methods, _title(results["meta"]), json_path.with_suffix(".png"))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench.kernel_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--grids", nargs="+", default=["table3", "figure3", "figure4", "multilevel", "relay"])
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-size", type=int, default=128, choices=[64, 128, 256])
    ap.add_argument("--block-size", type=int, default=64, choices=[16, 32, 64, 128])
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    ap.add_argument("--quick", action="store_true", help="first and last point of each grid only")
    ap.add_argument("--out", default="results/kernel_gpu", help="output prefix (.json, .md and .png are written)")
    ap.add_argument("--replot", type=Path, metavar="JSON", help="only redraw the plot of a finished run (no GPU needed)")
    args = ap.parse_args(argv)
    if args.replot:
        return replot(args.replot)
    if not torch.cuda.is_available():
        print("kernel_gpu: no CUDA device; this benchmark needs a GPU (the CPU one is vllm_chunkattn.bench.kernel)",
              file=sys.stderr)
        return 2
    from vllm_chunkattn.kernels import ops

    if not ops.cuda_kernels_available():
        print(f"kernel_gpu: vllm_chunkattn._C_cuda not built ({ops.CUDA_KERNELS_ERROR}); see docs/cuda.md",
              file=sys.stderr)
        return 2
    # chunk is the reference every other method's output is checked against.
    methods = ["chunk"] + [m for m in args.methods if m != "chunk"]
    settings = Settings(heads=args.heads, kv_heads=args.kv_heads, head_size=args.head_size,
                        block_size=args.block_size, dtype=args.dtype, iters=args.iters, graph=not args.eager,
                        methods=methods)
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    record = machine.describe_machine()
    record["gpu"] = f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
    record["cpu_identity"] = machine.cpu_identity(record)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    others = machine.results_from_other_cpus(out.parent, record["cpu_identity"],
                                             exclude=(out.with_suffix(".json"), out.with_suffix(".md")))
    print(machine.describe_line(record), flush=True)
    for line in others:
        print(f"WARNING: {out.parent} holds results of another machine: {line}", flush=True)
    points = grid_points(args.grids, args.quick)
    costs = [p.batch * p.context for p in points]  # the KV a baseline without sharing reads
    started = time.monotonic()
    rows = []
    for i, point in enumerate(points):
        elapsed = time.monotonic() - started
        done = sum(costs[:i])
        eta = f"ETA {elapsed * sum(costs[i:]) / done:.0f} s" if done else "ETA -"
        print(f"[{elapsed:.0f} s | {i + 1}/{len(points)} | {eta}] {point.label()} ...", flush=True)
        row = run_point(point, settings, device)
        rows.append(row)
        for d in row["disagreements"]:
            print(f"FAILED: {agreement.Disagreement(**d).message()}", flush=True)
        print(json.dumps({k: row[k] for k in ("grid", "batch", "prompt", "shared", "completion", "times_us")}),
              flush=True)
        torch.cuda.empty_cache()
    failures = [agreement.Disagreement(**d) for r in rows for d in r["disagreements"]]
    meta = {"device": props.name, "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
            "cuda": torch.version.cuda, "settings": asdict(settings)}
    table = markdown([r for r in rows if not r["disagreements"]], settings.methods)
    crossover = relay_crossover([r for r in rows if not r["disagreements"]], settings.heads // settings.kv_heads)
    if crossover:
        table += "\n\n" + crossover
    out.with_suffix(".json").write_text(json.dumps({"machine": record, "meta": meta, "results_from_other_cpus": others,
                                                    "disagreements": [asdict(d) for d in failures], "rows": rows},
                                                   indent=1, default=str))
    skipped = sorted({f"{m}: {why}" for r in rows for m, why in r["skipped"].items()})
    notes = "\n".join(f"- {s}" for s in skipped)
    failed = ("**THIS RUN FAILED: methods disagree with chunk beyond the tolerance (bench/agreement.py); these "
              "points are not timed and not in the table:**\n\n" + "\n".join(f"- {d.message()}" for d in failures)
              + "\n\n") if failures else ""
    out.with_suffix(".md").write_text(
        f"GPU: {props.name} (sm_{props.major}{props.minor}), torch {torch.__version__}, "
        f"{settings.heads} heads ({settings.kv_heads} KV) x {settings.head_size}, block {settings.block_size}, "
        f"{settings.dtype}; GPU time per call (CUDA-graph replay unless noted).\n\n"
        f"{failed}{machine.describe_line(record)}\n\n{machine.IDENTITY_LINE.format(record['cpu_identity'])}\n\n"
        + "\n".join(machine.other_cpu_warning(others)) + f"{table}\n"
        + (f"\nNot measured:\n{notes}\n" if notes else "")
    )
    plot_speedups([r for r in rows if not r["disagreements"]], settings.methods, _title(meta), out.with_suffix(".png"))
    print()
    print(table)
    print(f"\nwritten: {out.with_suffix('.json')}, {out.with_suffix('.md')}")
    if failures:
        print("FAILED: methods disagree with chunk beyond the tolerance; their points are not timed:\n"
              + "\n".join("  " + d.message() for d in failures), file=sys.stderr)
        return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
