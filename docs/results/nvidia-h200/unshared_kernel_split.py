"""Where the unshared decode's time goes on the GPU: our attend and merge kernels against cuDNN's SDPA,
per kernel from torch.profiler, b = 32, head size 128, chunk 64, nothing shared."""
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import vllm_chunkattn.kernels.ops as ops
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.prefix.tree import prefix_tree
from vllm_chunkattn.testing.paged_cases import num_blocks_needed, random_kv_cache, shared_prefix

ITERS = 50


def kernel_times(fn):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(ITERS):
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name[:90]] += e.device_time
    return {k: v / ITERS for k, v in total.items()}


for heads, kvh, n, dtype in [(32, 32, 1024, torch.float16), (32, 32, 4096, torch.float16),
                             (32, 8, 1024, torch.bfloat16), (32, 8, 4096, torch.bfloat16)]:
    table, lens = shared_prefix(32, n, 0, 64)
    kv = random_kv_cache(num_blocks_needed(table), kvh, 64, 128, dtype).cuda()
    q = torch.randn(32, heads, 128).to(dtype).cuda()
    plan = ops.plan_tpp_decode(DecodeShape(heads, kvh, 128, 64, dtype), table.cuda(), lens.cuda(),
                               prefix_tree(table, lens, 64))
    out = torch.empty_like(q)
    k = torch.randn(32, n, kvh, 128, dtype=dtype, device="cuda").transpose(1, 2)  # as kernel_gpu's dense K/V
    v = torch.randn(32, n, kvh, 128, dtype=dtype, device="cuda").transpose(1, 2)
    qd = q.view(32, heads, 1, 128)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qd, k, v, enable_gqa=kvh != heads)
    mb = 2 * 32 * kvh * n * 128 * q.element_size() / 1e6
    print(f"\n{heads}/{kvh} heads, n = {n}, {str(dtype)[6:]}, {mb:.0f} MB of K/V")
    for name, fn in [("chunk", lambda: ops.tpp_decode(q, kv, plan, 0.08, out)), ("sdpa", sdpa)]:
        times = kernel_times(fn)
        for kname, us in sorted(times.items(), key=lambda kv_: -kv_[1]):
            print(f"  {name:5s} {us:8.1f} us  {mb / us:5.2f} TB/s  {kname}")
        print(f"  {name:5s} {sum(times.values()):8.1f} us  total of kernels")
