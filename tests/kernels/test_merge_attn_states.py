"""merge_attn_states (the compiled CPU op, its wrapper and the PyTorch fallback)
against the float64 oracle (reference.merge_attn_states), on random shapes, dtypes and layouts,
with empty parts (lse = -inf, and +inf as FlashAttention-2 writes it), and
against vLLM's own merge_attn_states on the same arguments.

Tolerances (elementwise, torch.testing, against the float64 result):
    float32   atol 1e-5, rtol 1e-5 (a few fp32 roundings of the weights)
    float16   atol 2e-3, rtol 2e-3 (the output's own rounding: 2^-11 relative)
    bfloat16  atol 1.6e-2, rtol 1.6e-2 (2^-8 relative)
    lse       atol 1e-5, rtol 1e-5 (float32 in and out); infinities exact
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_chunkattn.kernels import ops
from vllm_chunkattn.kernels import torch_fallback
from vllm_chunkattn.testing import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
INF = float("inf")

IMPLEMENTATIONS = {
    "compiled": torch.ops.chunkattn.merge_attn_states,
    "wrapper": ops.merge_attn_states,
    "fallback": torch_fallback.merge_attn_states,
}

SETTINGS = settings(
    max_examples=int(os.environ.get("CHUNKATTN_TEST_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _random_lse(gen, num_heads, num_tokens, empty_share, layout):
    """[H, T] float32: normal values at a random scale, some -inf and +inf."""
    lse = torch.randn(num_heads, num_tokens, generator=gen) * 4
    marks = torch.rand(num_heads, num_tokens, generator=gen)
    lse[marks < empty_share] = -INF
    lse[(marks >= empty_share) & (marks < 1.5 * empty_share)] = INF
    if layout == "token-major":  # a [T, H] tensor seen as [H, T], as a backend's output often is
        return lse.transpose(0, 1).contiguous().transpose(0, 1)
    return lse


def _outputs(gen, num_tokens, num_heads, head_size, dtype, padded):
    """[T, H, D] in dtype; with `padded`, a head-strided view into a wider tensor."""
    width = head_size + 8 if padded else head_size
    full = torch.randn(num_tokens, num_heads, width, generator=gen).to(dtype)
    return full[..., :head_size]


def _check(out, lse, expected_out, expected_lse, dtype):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), expected_out, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    if lse is not None:
        assert torch.equal(torch.isinf(lse), torch.isinf(expected_lse)), "empty rows must get lse -inf"
        assert (lse[torch.isinf(lse)] < 0).all()
        finite = ~torch.isinf(expected_lse)
        torch.testing.assert_close(lse[finite].double(), expected_lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    num_tokens=st.integers(0, 9),
    num_heads=st.integers(1, 5),
    head_size=st.sampled_from([8, 40, 64, 128, 256]),
    dtype=st.sampled_from(DTYPES),
    empty_share=st.sampled_from([0.0, 0.2, 0.6]),
    lse_layout=st.sampled_from(["head-major", "token-major"]),
    padded=st.booleans(),
    with_output_lse=st.booleans(),
    tokens_with_context=st.one_of(st.none(), st.integers(0, 10)),
)
def test_merge_matches_float64(implementation, seed, num_tokens, num_heads, head_size, dtype, empty_share,
                               lse_layout, padded, with_output_lse, tokens_with_context):
    gen = torch.Generator().manual_seed(seed)
    prefix = _outputs(gen, num_tokens, num_heads, head_size, dtype, padded)
    suffix = _outputs(gen, num_tokens, num_heads, head_size, dtype, padded)
    prefix_lse = _random_lse(gen, num_heads, num_tokens, empty_share, lse_layout)
    suffix_lse = _random_lse(gen, num_heads, num_tokens, empty_share, lse_layout)
    output = _outputs(gen, num_tokens, num_heads, head_size, dtype, padded).fill_(float("nan"))
    output_lse = torch.full((num_heads, num_tokens), float("nan")) if with_output_lse else None

    IMPLEMENTATIONS[implementation](output, prefix, prefix_lse, suffix, suffix_lse, output_lse, tokens_with_context)

    expected_out, expected_lse = reference.merge_attn_states(prefix, prefix_lse, suffix, suffix_lse, tokens_with_context)
    _check(output, output_lse, expected_out, expected_lse, dtype)


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_parts(implementation, dtype):
    """An empty part (lse -inf or +inf) leaves the other part as it is; two empty parts give 0 and -inf."""
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randn(3, 2, 64, generator=gen).to(dtype)
    suffix = torch.randn(3, 2, 64, generator=gen).to(dtype)
    prefix_lse = torch.tensor([[-INF, 0.5, -INF], [INF, 1.0, INF]])
    suffix_lse = torch.tensor([[0.25, -INF, -INF], [2.0, INF, -INF]])
    output = torch.full_like(prefix, float("nan"))
    output_lse = torch.full((2, 3), float("nan"))
    IMPLEMENTATIONS[implementation](output, prefix, prefix_lse, suffix, suffix_lse, output_lse)
    for h, t in ((0, 0), (1, 0)):  # prefix empty
        assert torch.equal(output[t, h], suffix[t, h])
        assert output_lse[h, t] == suffix_lse[h, t]
    for h, t in ((0, 1), (1, 1)):  # suffix empty
        assert torch.equal(output[t, h], prefix[t, h])
        assert output_lse[h, t] == prefix_lse[h, t]
    for h in (0, 1):  # both empty
        assert torch.equal(output[2, h], torch.zeros_like(output[2, h]))
        assert output_lse[h, 2] == -INF


@pytest.mark.parametrize("implementation", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_agrees_with_vllm(implementation, dtype):
    """Same arguments, same result as vLLM's merge_attn_states on the CPU platform."""
    from vllm.v1.attention.ops.merge_attn_states import _merge_attn_states_torch

    gen = torch.Generator().manual_seed(11)
    num_tokens, num_heads, head_size = 6, 4, 128
    prefix = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    suffix = torch.randn(num_tokens, num_heads, head_size, generator=gen).to(dtype)
    prefix_lse = _random_lse(gen, num_heads, num_tokens, 0.2, "head-major")
    suffix_lse = _random_lse(gen, num_heads, num_tokens, 0.2, "head-major")
    ours, theirs = torch.empty_like(prefix), torch.empty_like(prefix)
    ours_lse, theirs_lse = torch.empty(num_heads, num_tokens), torch.empty(num_heads, num_tokens)
    IMPLEMENTATIONS[implementation](ours, prefix, prefix_lse, suffix, suffix_lse, ours_lse, 4)
    _merge_attn_states_torch(theirs, prefix, prefix_lse, suffix, suffix_lse, theirs_lse, 4)
    torch.testing.assert_close(ours.float(), theirs.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(ours_lse, theirs_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda args: args.__setitem__(1, args[1][:, :, :32]), "shape"),
        (lambda args: args.__setitem__(2, args[2].double()), "float32"),
        (lambda args: args.__setitem__(4, args[4][:, :2]), "num_heads, num_tokens"),
        (lambda args: args.__setitem__(3, args[3].half()), "dtype"),
    ],
)
def test_compiled_op_rejects_bad_arguments(change, message):
    args = [torch.empty(3, 2, 64), torch.zeros(3, 2, 64), torch.zeros(2, 3), torch.zeros(3, 2, 64), torch.zeros(2, 3)]
    change(args)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.chunkattn.merge_attn_states(*args)
