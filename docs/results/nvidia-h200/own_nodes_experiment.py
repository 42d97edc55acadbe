import time, torch, numpy as np, sys
import vllm_chunkattn.kernels.ops as ops
from vllm_chunkattn.prefix.tree import prefix_tree, context_from_nodes
from vllm_chunkattn.prefix.query_rows import expand_query_rows
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.testing.paged_cases import shared_prefix, random_kv_cache, num_blocks_needed

def prune(ctx, request_of_row):
    order = ctx.order.numpy()
    keep = []
    for b, e, cb, ce in zip(ctx.node_begin.tolist(), ctx.node_end.tolist(), ctx.node_chunk_begin.tolist(), ctx.node_chunk_end.tolist()):
        reqs = {int(request_of_row[order[t]]) for t in range(b, e)}
        if len(reqs) > 1:
            keep.append((b, e, cb, ce))
    return context_from_nodes(order, keep, len(order))

heads, kvh, D, bs = int(sys.argv[1]), int(sys.argv[2]), 128, 64
dtype = getattr(torch, sys.argv[3])
dev = sys.argv[4] if len(sys.argv) > 4 else "cpu"
torch.set_num_threads(2)
def now():
    if dev == "cuda": torch.cuda.synchronize()
    return time.perf_counter()
for q in ((2, 4, 8) if dev == "cpu" else (2, 4, 8, 16)):
    table, lens = shared_prefix(32, 2048 + 128 + q, 2048, bs)
    qlens = torch.full((32,), q, dtype=torch.int32)
    rows = expand_query_rows(table, lens, qlens)
    req = torch.repeat_interleave(torch.arange(32), q).numpy()
    full = prefix_tree(rows.block_table, rows.unmasked_lens, bs)
    pruned = prune(full, req)
    kv = random_kv_cache(num_blocks_needed(table), kvh, bs, D, dtype).to(dev)
    query = torch.randn(rows.block_table.shape[0], heads, D).to(dtype).to(dev)
    shape = DecodeShape(heads, kvh, D, bs, dtype)
    outs, times = {}, {"full": [], "pruned": []}
    plans = {n: ops.plan_tpp_decode(shape, rows.block_table.to(dev), rows.seq_lens.to(dev), c) for n, c in (("full", full), ("pruned", pruned))}
    reps = 1 if dev == "cpu" else 50
    for it in range(7):
        for n, p in plans.items():
            out = torch.empty_like(query)
            t = now()
            for _ in range(reps): ops.tpp_decode(query, kv, p, 0.08, out)
            times[n].append((now() - t) / reps)
            outs[n] = out
    diff = (outs["full"].float() - outs["pruned"].float()).abs().max().item()
    mf, mp = np.median(times["full"][2:]) * 1e3, np.median(times["pruned"][2:]) * 1e3
    print(f"{heads}/{kvh} {sys.argv[3]} q={q}: nodes {full.num_nodes} -> {pruned.num_nodes}; full {mf*1e3:.1f} us, pruned {mp*1e3:.1f} us, full/pruned {mf/mp:.2f}, maxdiff {diff:.2e}")
