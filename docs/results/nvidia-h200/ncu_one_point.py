"""One unshared decode point for ncu: b = 32, 4096 tokens, 32/8 heads, bf16."""
import sys, torch
import vllm_chunkattn.kernels.ops as ops
from vllm_chunkattn.prefix.tree import prefix_tree
from vllm_chunkattn.prefix.plan import DecodeShape
from vllm_chunkattn.testing.paged_cases import shared_prefix, random_kv_cache, num_blocks_needed
heads, kvh, n, shared = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dtype = torch.bfloat16
table, lens = shared_prefix(32, n, shared, 64)
kv = random_kv_cache(num_blocks_needed(table), kvh, 64, 128, dtype).cuda()
q = torch.randn(32, heads, 128).to(dtype).cuda()
plan = ops.plan_tpp_decode(DecodeShape(heads, kvh, 128, 64, dtype), table.cuda(), lens.cuda(), prefix_tree(table, lens, 64))
out = torch.empty_like(q)
for _ in range(3):
    ops.tpp_decode(q, kv, plan, 0.08, out)
torch.cuda.synchronize()
