"""Does a shared node's cost follow its rows or its rows rounded up to whole vectors? One layer, 16/4 heads x 128,
fp32, block 64, one prefix of 8192 tokens shared by b requests (+64 own tokens each), 1 thread."""
import statistics, sys, time
import torch
torch.set_num_threads(1)
import vllm_chunkattn.kernels.ops as ops
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.prefix.tree import prefix_tree
from vllm_chunkattn.testing.paged_cases import num_blocks_needed, random_kv_cache, shared_prefix
H, KVH, D, BS, N = 16, 4, 128, 64, 8192 + 64
cases = {}
for b in [int(x) for x in sys.argv[1:]]:
    table, lens = shared_prefix(b, N, 8192, BS)
    kv = random_kv_cache(num_blocks_needed(table), KVH, BS, D, torch.float32)
    q = torch.randn(b, H, D)
    plan = ops.plan_tpp_decode(DecodeShape(H, KVH, D, BS, torch.float32), table, lens, prefix_tree(table, lens, BS))
    out = torch.empty_like(q)
    cases[b] = (lambda q=q, kv=kv, plan=plan, out=out: ops.tpp_decode(q, kv, plan, 0.088, out))
    cases[b]()
times = {b: [] for b in cases}
for rep in range(7):
    for b, fn in cases.items():
        t = time.perf_counter(); fn(); fn(); fn(); times[b].append((time.perf_counter() - t) / 3 * 1e3)
for b, t in times.items():
    m = statistics.median(t)
    print(f"b={b:2d} rows/KV head {4*b:3d} lanes {-(-4*b//16)*16:3d}: {m:6.2f} ms  {m/(4*b):.3f} ms/row")
