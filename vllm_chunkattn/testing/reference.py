"""Plain, obviously-correct attention over the paged KV cache: the test oracle.

Every kernel of this project is checked against `paged_attention` here. It is
deliberately slow: one request at a time, keys and values gathered token by
token from the block table, softmax in float64.

KV cache layout: vllm_chunkattn/kernels/layout.py.
"""

from __future__ import annotations

import math

import torch

from vllm_chunkattn.kernels import layout


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kernels_device: str | None = None,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_size] at their slots; negative slots are padding.
    kernels_device: whose layout the cache has (layout.py)."""
    block_size = kv_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        where = torch.tensor([slot // block_size]), torch.tensor([slot % block_size])
        layout.write_tokens(kv_cache, *where, key[t : t + 1], value[t : t + 1], kernels_device)


def gather_context(
    kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int, kernels_device: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first `seq_len` tokens of one request: [seq_len, num_kv_heads, head_size]."""
    block_size = kv_cache.shape[2]
    pos = torch.arange(seq_len)
    return layout.read_tokens(kv_cache, block_row[pos // block_size], pos % block_size, kernels_device)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    kernels_device: str | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole context,
    or with `sliding_window` W > 0 over its last W positions (p - W + 1 .. p);
    with `logits_soft_cap` c > 0 each scaled score s becomes c * tanh(s / c);
    with `alibi_slopes` [num_heads], the score of key position k for a query
    at position p then gains slope * (k - p); with `sinks` [num_heads], each
    head's softmax has one more term exp(sink) in its denominator.

    query:           [num_tokens, num_heads, head_size]
    query_start_loc: [num_reqs + 1]; request i owns query rows qsl[i]:qsl[i+1]
    seq_lens:        [num_reqs]; context length including the new tokens
    block_table:     [num_reqs, max_blocks]
    kernels_device:  whose layout kv_cache has (layout.py); the tensor's device's by default
    Returns [num_tokens, num_heads, head_size] in the query's dtype.
    """
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    for i in range(len(seq_lens)):
        q_begin, q_end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        seq_len = int(seq_lens[i])
        num_new = q_end - q_begin
        if num_new == 0:
            continue
        k, v = gather_context(kv_cache, block_table[i], seq_len, kernels_device)
        k = k.double().repeat_interleave(group, dim=1)  # [seq_len, num_heads, d]
        v = v.double().repeat_interleave(group, dim=1)
        q = query[q_begin:q_end].double()  # [num_new, num_heads, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - num_new, seq_len).unsqueeze(1)
        k_pos = torch.arange(seq_len).unsqueeze(0)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.double().view(-1, 1, 1) * (k_pos - q_pos)
        hidden = k_pos > q_pos
        if sliding_window:
            hidden |= k_pos <= q_pos - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # one more column: the sink, whose value is 0
            sink_column = sinks.double().view(-1, 1, 1).expand(-1, num_new, 1)
            probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def merge_attn_states(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    prefill_tokens_with_context: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's merge_attn_states in float64, one (token, head) at a time:
    outputs [T, H, D], log-sum-exps [H, T] -> (output [T, H, D], lse [H, T]).

    Each part is a normalised attention output with the log-sum-exp of its
    scores; the merge is their mean weighted by exp(lse). A part with lse -inf
    or +inf (FlashAttention-2's mark of a row that saw no key) is left out; with
    none left the output is 0 and the lse -inf. Tokens from
    prefill_tokens_with_context on take the suffix output as is (and its lse,
    +inf read as -inf)."""
    num_tokens, num_heads = prefix_output.shape[:2]
    context = num_tokens if prefill_tokens_with_context is None else prefill_tokens_with_context
    output = torch.zeros(prefix_output.shape, dtype=torch.float64)
    lse = torch.full((num_heads, num_tokens), -math.inf, dtype=torch.float64)
    for t in range(num_tokens):
        for h in range(num_heads):
            if t >= context:
                output[t, h] = suffix_output[t, h].double()
                lse[h, t] = -math.inf if math.isinf(float(suffix_lse[h, t])) else float(suffix_lse[h, t])
                continue
            parts = [
                (float(part_lse[h, t]), part[t, h].double())
                for part_lse, part in ((prefix_lse, prefix_output), (suffix_lse, suffix_output))
                if not math.isinf(float(part_lse[h, t]))
            ]
            if not parts:
                continue
            m = max(part_lse for part_lse, _ in parts)
            weights = [math.exp(part_lse - m) for part_lse, _ in parts]
            output[t, h] = sum(w * part for w, (_, part) in zip(weights, parts)) / sum(weights)
            lse[h, t] = m + math.log(sum(weights))
    return output, lse
