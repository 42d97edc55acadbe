"""One layer's decode attention (16/4 heads x 128, fp32, block 64, 1 thread) for a batch behind 4 prefixes of
8192 tokens, `counts` requests per prefix, 64 own tokens each, in the order given; median ms of 9."""
import statistics, sys, time
import torch
torch.set_num_threads(1)
import vllm_chunkattn.kernels.ops as ops
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.prefix.tree import prefix_tree
from vllm_chunkattn.testing.paged_cases import num_blocks_needed, random_kv_cache
H, KVH, D, BS = 16, 4, 128, 64
def run(counts):
    rows, blk = [], 1
    prefixes = []
    for c in counts:
        prefixes.append(list(range(blk, blk + 128))); blk += 128
    for p, c in enumerate(counts):
        for _ in range(c):
            rows.append(prefixes[p] + [blk]); blk += 1
    table = torch.tensor(rows, dtype=torch.int32)
    lens = torch.full((len(rows),), 8192 + 64, dtype=torch.int32)
    kv = random_kv_cache(blk, KVH, BS, D, torch.float32)
    q = torch.randn(len(rows), H, D)
    plan = ops.plan_tpp_decode(DecodeShape(H, KVH, D, BS, torch.float32), table, lens, prefix_tree(table, lens, BS))
    out = torch.empty_like(q)
    ops.tpp_decode(q, kv, plan, 0.088, out)
    t = []
    for _ in range(9):
        s = time.perf_counter(); ops.tpp_decode(q, kv, plan, 0.088, out); t.append((time.perf_counter() - s) * 1e3)
    return statistics.median(t)
for spec in sys.argv[1:]:
    counts = [int(x) for x in spec.split(",")]
    print(f"{spec:12s} {run(counts):7.2f} ms", flush=True)
