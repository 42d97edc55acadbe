"""The CUDA merge_attn_states kernel (csrc/cuda/merge_attn_states.cu), executed
on the CPU by the SIMT emulator (tests/cuda/emulator), against the float64
oracle (reference.merge_attn_states): random shapes in both CUDA dtypes,
strided outputs and log-sum-exps, empty parts (-inf and +inf) and
prefill_tokens_with_context."""

from __future__ import annotations

import ctypes

import pytest
import torch

from emulator import build as emu_build
from vllm_chunkattn.kernels import support
from vllm_chunkattn.testing import reference

_reason = emu_build.missing_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"cannot build the CUDA emulator: {_reason}")

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
INF = float("inf")


@pytest.fixture(scope="module")
def emu():
    return emu_build.load()


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None and t.numel() else 0)


def emu_merge(emu, output, prefix, prefix_lse, suffix, suffix_lse, output_lse, tokens_with_context):
    lse_strides = output_lse.stride() if output_lse is not None else (0, 0)
    strides = (output.stride(0), output.stride(1), prefix.stride(0), prefix.stride(1), suffix.stride(0),
               suffix.stride(1), *prefix_lse.stride(), *suffix_lse.stride(), *lse_strides)
    err = emu.emu_merge_attn_states(
        int(output.dtype == torch.bfloat16), _ptr(output), _ptr(prefix), _ptr(prefix_lse), _ptr(suffix),
        _ptr(suffix_lse), _ptr(output_lse), output.shape[0], output.shape[1], output.shape[2], tokens_with_context,
        (ctypes.c_int64 * len(strides))(*strides),
    )
    assert err is None, err.decode()


# (seed, num_tokens, num_heads, head_size, dtype, tokens_with_context, token-major lse, padded heads)
CASES = [
    (0, 7, 3, 64, torch.float16, 7, False, False),
    (1, 5, 4, 128, torch.bfloat16, 3, True, False),
    (2, 9, 2, 256, torch.float16, 0, False, True),
    (3, 1, 5, 40, torch.bfloat16, 1, True, True),  # a head size that is not a multiple of 32 lanes
    (4, 6, 1, 128, torch.bfloat16, 6, False, True),
]


@pytest.mark.parametrize("seed,num_tokens,num_heads,head_size,dtype,tokens_with_context,token_major,padded", CASES)
def test_merge_attn_states_emulated(emu, seed, num_tokens, num_heads, head_size, dtype, tokens_with_context,
                                    token_major, padded):
    assert dtype in support.CUDA.dtypes
    gen = torch.Generator().manual_seed(seed)
    width = head_size + 8 if padded else head_size
    prefix, suffix = (torch.randn(num_tokens, num_heads, width, generator=gen).to(dtype)[..., :head_size]
                      for _ in range(2))

    def lse():
        values = torch.randn(num_heads, num_tokens, generator=gen) * 4
        marks = torch.rand(num_heads, num_tokens, generator=gen)
        values[marks < 0.2] = -INF
        values[(marks >= 0.2) & (marks < 0.3)] = INF
        return values.transpose(0, 1).contiguous().transpose(0, 1) if token_major else values

    prefix_lse, suffix_lse = lse(), lse()
    output = torch.full((num_tokens, num_heads, width), float("nan")).to(dtype)[..., :head_size]
    output_lse = torch.full((num_heads, num_tokens), float("nan"))
    emu_merge(emu, output, prefix, prefix_lse, suffix, suffix_lse, output_lse, tokens_with_context)

    expected, expected_lse = reference.merge_attn_states(prefix, prefix_lse, suffix, suffix_lse, tokens_with_context)
    assert not torch.isnan(output).any() and not torch.isnan(output_lse).any()
    torch.testing.assert_close(output.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(torch.isinf(output_lse), torch.isinf(expected_lse))
    finite = ~torch.isinf(expected_lse)
    torch.testing.assert_close(output_lse[finite].double(), expected_lse[finite], atol=1e-5, rtol=1e-5)


def test_merge_attn_states_emulated_without_output_lse(emu):
    gen = torch.Generator().manual_seed(9)
    prefix, suffix = (torch.randn(4, 2, 64, generator=gen).half() for _ in range(2))
    prefix_lse, suffix_lse = torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen)
    output = torch.empty_like(prefix)
    emu_merge(emu, output, prefix, prefix_lse, suffix, suffix_lse, None, 4)
    expected, _ = reference.merge_attn_states(prefix, prefix_lse, suffix, suffix_lse)
    torch.testing.assert_close(output.double(), expected, atol=TOL[torch.float16], rtol=TOL[torch.float16])
