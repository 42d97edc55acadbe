"""Stack a shared node or not: the tree path with the node stacked (chunk-first over
every covered request's rows), the same tree path with the node's chunks attended
per request instead (keyed for the tree on ids unique per request, so no node
forms; the plan reads the real blocks), and the per-request prefill, on the same
inputs, interleaved in each repetition. Requests: WIDTH share 1024 tokens, each
with 64 private tokens and q new ones. Fails if the three disagree.

    .venv/bin/python docs/results/amd-epyc-f25-m17-zen4/node-stacking/stacking.py float32|bfloat16
"""

import sys
import time

import torch

from vllm_chunkattn.kernels import cpu_tuning, ops
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.prefix.query_rows import expand_query_rows
from vllm_chunkattn.prefix.tree import prefix_tree

SHARED, PRIVATE, BLOCK, HEADS, HEAD_SIZE = 1024, 64, 64, 16, 128


def median_seconds(call, n=7):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2]


def point(dtype, kv_heads, width, q, gen):
    shape = DecodeShape(HEADS, kv_heads, HEAD_SIZE, BLOCK, dtype)
    cpu_tuning.ensure_tuned(shape)
    sb, pb = SHARED // BLOCK, -(-(PRIVATE + q) // BLOCK)
    cache = torch.empty(sb + width * pb, kv_heads, BLOCK, 2 * HEAD_SIZE, dtype=dtype).uniform_(-1, 1, generator=gen)
    private = sb + torch.arange(width * pb, dtype=torch.int32).reshape(width, -1)
    table = torch.cat([torch.arange(sb, dtype=torch.int32).expand(width, -1), private], 1).contiguous()
    lens = torch.full((width,), SHARED + PRIVATE + q, dtype=torch.int32)
    query_lens = torch.full((width,), q, dtype=torch.int32)
    qsl = torch.arange(width + 1, dtype=torch.int32) * q
    query = torch.empty(width * q, HEADS, HEAD_SIZE, dtype=dtype).uniform_(-1, 1, generator=gen)
    rows = expand_query_rows(table, lens, query_lens)
    stacked = ops.plan_tpp_decode(shape, rows.block_table, rows.seq_lens,
                                  prefix_tree(rows.block_table, rows.unmasked_lens, BLOCK))
    renamed = table.clone()
    renamed[:, :sb] += (torch.arange(width, dtype=torch.int32)[:, None] + 1) * 1_000_000
    renamed_rows = expand_query_rows(renamed, lens, query_lens)
    unstacked = ops.plan_tpp_decode(shape, rows.block_table, rows.seq_lens,
                                    prefix_tree(renamed_rows.block_table, renamed_rows.unmasked_lens, BLOCK))
    assert unstacked.context.num_nodes < stacked.context.num_nodes
    scale = HEAD_SIZE**-0.5
    outs = {name: torch.empty_like(query) for name in ("stacked", "unstacked", "per_request")}
    calls = {
        "stacked": lambda: ops.tpp_decode(query, cache, stacked, scale, outs["stacked"]),
        "unstacked": lambda: ops.tpp_decode(query, cache, unstacked, scale, outs["unstacked"]),
        "per_request": lambda: ops.paged_prefill(query, cache, qsl, lens, table, scale, outs["per_request"]),
    }
    best = {name: float("inf") for name in calls}
    for rep in range(4):
        for name, call in calls.items():
            seconds = median_seconds(call)
            if rep:
                best[name] = min(best[name], seconds)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name in ("stacked", "unstacked"):
        err = (outs[name].float() - outs["per_request"].float()).abs().max().item()
        assert err <= tol, f"{name} disagrees with the per-request prefill by {err}"
    return shape.group, best


def main():
    dtype = getattr(torch, sys.argv[1])
    gen = torch.Generator().manual_seed(0)
    print("| dtype | GQA group | requests sharing | q | rows per KV head per request | stacked ms | unstacked ms "
          "| per-request ms | per-request/stacked | per-request/unstacked | unstacked/stacked |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kv_heads in (4, 16):
        for width in (2, 16):
            for q in (1, 2, 4, 8, 16):
                group, t = point(dtype, kv_heads, width, q, gen)
                print(f"| {sys.argv[1]} | {group} | {width} | {q} | {q * group} | {t['stacked'] * 1e3:.2f} "
                      f"| {t['unstacked'] * 1e3:.2f} | {t['per_request'] * 1e3:.2f} "
                      f"| {t['per_request'] / t['stacked']:.2f} | {t['per_request'] / t['unstacked']:.2f} "
                      f"| {t['unstacked'] / t['stacked']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
