"""The oracle itself, checked against torch's own attention on dense tensors."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_chunkattn.testing import reference


@settings(max_examples=30, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    new_frac=st.floats(0.0, 1.0),
    group=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([4, 16]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_matches_sdpa(seq_lens, new_frac, group, block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_size = 2, 16
    num_heads = num_kv_heads * group
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = len(seq_lens) * max_blocks
    kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_size)
    block_table = torch.randperm(num_blocks, generator=gen).view(len(seq_lens), max_blocks).int()
    keys = [torch.randn(s, num_kv_heads, head_size, generator=gen) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_size, generator=gen) for s in seq_lens]
    for i, s in enumerate(seq_lens):
        slots = block_table[i, torch.arange(s) // block_size].long() * block_size + torch.arange(s) % block_size
        reference.write_kv_cache(keys[i], values[i], kv_cache, slots)
    new = [max(1, round(s * new_frac)) for s in seq_lens]
    qsl = torch.tensor([0] + new).cumsum(0)
    query = torch.randn(int(qsl[-1]), num_heads, head_size, generator=gen)
    out = reference.paged_attention(query, kv_cache, qsl, torch.tensor(seq_lens), block_table, 0.25)
    for i, s in enumerate(seq_lens):
        q = query[qsl[i] : qsl[i + 1]].transpose(0, 1)  # [heads, new, d]
        k = keys[i].repeat_interleave(group, 1).transpose(0, 1)
        v = values[i].repeat_interleave(group, 1).transpose(0, 1)
        mask = torch.arange(s)[None, :] <= torch.arange(s - new[i], s)[:, None]
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)
        torch.testing.assert_close(out[qsl[i] : qsl[i + 1]], expected.transpose(0, 1), atol=1e-5, rtol=1e-5)
