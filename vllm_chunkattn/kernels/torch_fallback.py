"""Two-phase-partition decode, paged prefill and merge_attn_states in plain PyTorch.

The portable implementation of the backend's kernels: it runs wherever torch
runs and states the algorithm in a few tensor operations. The compiled
kernels (csrc/) compute the same thing and are tested against
`reference.py`, as this module is.

Partial results follow the paper's equation (1): for a set of keys, the
unnormalised output o = sum_j exp(s_j - m) v_j, the running max m and the sum
n = sum_j exp(s_j - m), all float32; a part that saw no key has m = -inf,
n = 0, o = 0. Merging (equation 2) rescales each part by exp(m_part - m_total)
(csrc/common/partial_state.h is the same merge in C++ and CUDA).
"""

from __future__ import annotations

import torch

from vllm_chunkattn.kernels import layout
from vllm_chunkattn.prefix.tree import PrefixTreeContext


def _exp_base(m: torch.Tensor) -> torch.Tensor:
    """What exponentials are taken against for running max m: m, or 0 where no
    key was seen (m = -inf), so that exp(-inf - 0) = 0 and not NaN."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def _partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                       logits_soft_cap: float = 0.0, bias: torch.Tensor | None = None):
    """q [..., M, D] against k, v [..., L, D] -> (o [..., M, D], m [..., M], n [..., M]).

    Rows that see no key get m = -inf, n = 0, o = 0. logits_soft_cap c > 0:
    scores s become c * tanh(s / c) first; then `bias` [..., M, L] (ALiBi) is added.
    """
    if k.shape[-2] == 0:  # no key at all (every request's context lies in nodes): amax needs one
        m = q.new_full(q.shape[:-1], float("-inf"))
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), m, torch.zeros_like(m)
    scores = q @ k.transpose(-1, -2)
    if logits_soft_cap:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1)
    e = torch.exp(scores - _exp_base(m).unsqueeze(-1))
    return e @ v, m, e.sum(dim=-1)


def _merge(o: torch.Tensor, m: torch.Tensor, n: torch.Tensor, dim: int):
    """Merge partial states stacked along `dim` (of m and n; o has one more
    trailing dim) -> (o, m, n) of the merged state, o unnormalised."""
    m_total = m.amax(dim=dim, keepdim=True)
    weight = torch.exp(m - _exp_base(m_total))  # 0 for a part that saw no key
    n_total = (weight * n).sum(dim=dim)
    o_total = (weight.unsqueeze(-1) * o).sum(dim=dim)
    return o_total, m_total.squeeze(dim), n_total


def _merge_sinks(o: torch.Tensor, m: torch.Tensor, n: torch.Tensor, sinks: torch.Tensor | None):
    """The merged state with each row's sink logit (same shape as m) joined
    as one more key of value 0 (csrc/common/partial_state.h merge_sink)."""
    if sinks is None:
        return o, m, n
    part = m.dim()  # the new dim the two parts are stacked along (o's head dim stays last)
    return _merge(torch.stack([o, torch.zeros_like(o)], dim=part), torch.stack([m, sinks.expand_as(m)], dim=part),
                  torch.stack([n, torch.ones_like(n)], dim=part), dim=part)


def _alibi_bias(slopes: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
    """slope * (key position - query position): slopes [..., M, 1] or broadcastable,
    key_pos [..., L], query_pos [..., M, 1] -> [..., M, L]."""
    return slopes * (key_pos - query_pos).float()


def _normalise(o: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """o / n, with 0 for a row that saw no key (n = 0)."""
    return o / torch.where(n > 0, n, torch.ones_like(n)).unsqueeze(-1)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key, value [num_tokens, num_kv_heads, head_size] into their slots; negative slots are padding."""
    block_size = kv_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    layout.write_tokens(kv_cache, slots // block_size, slots % block_size, key[: len(slot_mapping)][valid],
                        value[: len(slot_mapping)][valid])


def tpp_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    ctx: PrefixTreeContext,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per request.

    query [B, num_heads, D], block_table [B, max_blocks], seq_lens [B] (context
    including the token being decoded). With sliding_window W > 0 a row sees
    only its last W keys; logits_soft_cap c > 0 caps the scores; sinks and
    alibi_slopes [num_heads] as reference.py. Returns [B, num_heads, D].
    """
    batch, num_heads, head_size = query.shape
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    device = query.device
    q = (query.float() * scale).view(batch, num_kv_heads, group, head_size)
    seq_lens = seq_lens.to(device)
    query_pos = seq_lens.long() - 1
    slopes = alibi_slopes.to(device).view(num_kv_heads, group) if alibi_slopes is not None else None

    # Chunk-first phase: each shared node once, for all the requests it covers.
    part_o = q.new_zeros(ctx.num_partial_rows, num_kv_heads, group, head_size)
    part_m = q.new_full((ctx.num_partial_rows, num_kv_heads, group), float("-inf"))
    part_n = q.new_zeros(ctx.num_partial_rows, num_kv_heads, group)
    order = ctx.order.to(device).long()
    for k in range(ctx.num_nodes):
        begin, end = int(ctx.node_begin[k]), int(ctx.node_end[k])
        rows = order[begin:end]
        blocks = block_table[rows[0], int(ctx.node_chunk_begin[k]) : int(ctx.node_chunk_end[k])].long()
        # [num_kv_heads, chunks * block_size, D]
        keys, values = (x.float().transpose(0, 1).reshape(num_kv_heads, -1, head_size)
                        for x in layout.read_blocks(kv_cache, blocks))
        # [num_kv_heads, rows * group, D]: the query matrix of the node
        q_node = q[rows].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_size)
        key_pos = int(ctx.node_chunk_begin[k]) * block_size + torch.arange(keys.shape[1], device=device)
        mask = bias = None
        if sliding_window:  # [rows * group, keys]: a key at or after the row's window start
            first = (seq_lens[rows].long() - sliding_window).repeat_interleave(group)
            mask = (key_pos[None, :] >= first[:, None])[None]
        if slopes is not None:  # [num_kv_heads, rows * group, keys]
            row_slopes = slopes[:, None, :].expand(-1, len(rows), -1).reshape(num_kv_heads, -1, 1)
            bias = _alibi_bias(row_slopes, key_pos, query_pos[rows].repeat_interleave(group)[:, None])
        o, m, n = _partial_attention(q_node, keys, values, mask, logits_soft_cap, bias)
        first = int(ctx.node_partial_offset[k])
        part_o[first : first + len(rows)] = o.view(num_kv_heads, len(rows), group, head_size).transpose(0, 1)
        part_m[first : first + len(rows)] = m.view(num_kv_heads, len(rows), group).transpose(0, 1)
        part_n[first : first + len(rows)] = n.view(num_kv_heads, len(rows), group).transpose(0, 1)

    # Sequence-first phase: each request's private chunks, padded into one batch.
    shared_tokens = ctx.shared_chunks.to(device).long() * block_size
    private_len = seq_lens.long() - shared_tokens
    max_private = int(private_len.max()) if batch else 0
    pos = shared_tokens[:, None] + torch.arange(max_private, device=device)[None, :]  # [B, L]
    valid = pos < seq_lens.long()[:, None]
    if sliding_window:
        valid &= pos >= seq_lens.long()[:, None] - sliding_window
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    blocks = torch.gather(block_table.long(), 1, pos // block_size)
    keys, values = (x.float() for x in layout.read_tokens(kv_cache, blocks, pos % block_size))  # [B, L, heads, D]
    bias = None
    if slopes is not None:  # [B, num_kv_heads, group, L]
        bias = _alibi_bias(slopes[None, :, :, None], pos[:, None, None, :], query_pos[:, None, None, None])
    o, m, n = _partial_attention(
        q, keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3), valid[:, None, None, :], logits_soft_cap, bias
    )  # o [B, num_kv_heads, group, D]

    # Merge: each request's node partials (depth <= tree depth) and its own part.
    offsets = ctx.row_partial_offsets.to(device).long()
    counts = offsets[1:] - offsets[:-1]
    slot = torch.arange(int(counts.max()) if batch else 0, device=device)
    has = slot[None, :] < counts[:, None]  # [B, depth]
    idx = torch.where(has, offsets[:-1, None] + slot, 0)
    rows = ctx.row_partials.to(device).long()[idx]
    all_o = torch.cat([part_o[rows], o[:, None]], dim=1)
    all_m = torch.cat([part_m[rows].masked_fill(~has[..., None, None], float("-inf")), m[:, None]], dim=1)
    all_n = torch.cat([part_n[rows], n[:, None]], dim=1)
    merged = _merge(all_o, all_m, all_n, dim=1)
    sink_logits = sinks.to(device).float().view(num_kv_heads, group) if sinks is not None else None
    merged_o, _, merged_n = _merge_sinks(*merged, sink_logits)
    result = _normalise(merged_o, merged_n).view(batch, num_heads, head_size)
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context
    (prefill, chunked prefill, and prefill after a prefix-cache hit alike);
    with sliding_window W > 0, over the last W positions of each token;
    logits_soft_cap c > 0 caps the scores; sinks and alibi_slopes
    [num_heads] as reference.py.

    query [T, num_heads, D] holds the requests' rows back to back;
    query_start_loc has len(seq_lens) + 1 entries. Writes into out [T, num_heads, D].
    """
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    for i, seq_len in enumerate(seq_lens):
        q_begin, q_end = query_start_loc[i], query_start_loc[i + 1]
        num_new = q_end - q_begin
        num_blocks = -(-seq_len // block_size)
        blocks = block_table[i, :num_blocks].long()
        # [num_kv_heads, seq_len, D]
        keys, values = (x.float().transpose(0, 1).reshape(num_kv_heads, -1, head_size)[:, :seq_len]
                        for x in layout.read_blocks(kv_cache, blocks))
        # [num_kv_heads, group * num_new, D], rows ordered (group, token)
        q = (query[q_begin:q_end].float() * scale).view(num_new, num_kv_heads, group, head_size)
        q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * num_new, head_size)
        q_pos = torch.arange(seq_len - num_new, seq_len, device=query.device).repeat(group)
        key_pos = torch.arange(seq_len, device=query.device)[None, :]
        mask = key_pos <= q_pos[:, None]
        if sliding_window:
            mask &= key_pos > q_pos[:, None] - sliding_window
        bias = None
        if alibi_slopes is not None:  # rows (group, token) of each KV head
            row_slopes = alibi_slopes.to(query.device).view(num_kv_heads, group, 1).expand(-1, -1, num_new)
            bias = _alibi_bias(row_slopes.reshape(num_kv_heads, -1, 1), key_pos, q_pos[:, None])
        state = _partial_attention(q, keys, values, mask[None], logits_soft_cap, bias)
        row_sinks = None
        if sinks is not None:
            row_sinks = sinks.to(query.device).float().view(num_kv_heads, group, 1).expand(-1, -1, num_new)
            row_sinks = row_sinks.reshape(num_kv_heads, -1)
        o, _, n = _merge_sinks(*state, row_sinks)
        o = (o / n.unsqueeze(-1)).view(num_kv_heads, group, num_new, head_size)
        out[q_begin:q_end] = o.permute(2, 0, 1, 3).reshape(num_new, num_heads, head_size).to(out.dtype)
    return out


def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None = None,
    prefill_tokens_with_context: int | None = None,
) -> None:
    """vLLM's merge_attn_states contract (csrc/cpu/merge_attn_states.cpp states it):
    outputs [T, H, D], log-sum-exps [H, T] float32; a normalised result with
    log-sum-exp lse is the partial state (m = lse, n = 1, o = out)."""
    num_tokens = output.shape[0]
    merging = num_tokens if prefill_tokens_with_context is None else min(prefill_tokens_with_context, num_tokens)

    def state_max(lse: torch.Tensor) -> torch.Tensor:  # [T, H]; +inf (FlashAttention-2's empty row) is empty too
        lse = lse[:, :merging].float().transpose(0, 1)
        return torch.where(torch.isinf(lse), torch.full_like(lse, float("-inf")), lse)

    o = torch.stack([prefix_output[:merging].float(), suffix_output[:merging].float()], dim=2)  # [T, H, 2, D]
    m = torch.stack([state_max(prefix_lse), state_max(suffix_lse)], dim=2)
    merged_o, merged_m, merged_n = _merge(o, m, torch.ones_like(m), dim=2)
    output[:merging] = _normalise(merged_o, merged_n).to(output.dtype)
    output[merging:] = suffix_output[merging:]
    if output_lse is not None:
        lse = torch.where(merged_n > 0, merged_m + torch.log(merged_n), torch.full_like(merged_m, float("-inf")))
        output_lse[:, :merging] = lse.transpose(0, 1)
        rest = suffix_lse[:, merging:].float()
        output_lse[:, merging:] = torch.where(torch.isinf(rest), torch.full_like(rest, float("-inf")), rest)
