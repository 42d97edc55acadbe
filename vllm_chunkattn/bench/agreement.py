"""The benchmarks' correctness gate: every implementation's output at a point
must match ours within the tolerance of the dtype, or the point's speed is not
reported and the run fails.

Tolerances are max |difference| of the attention output. The benchmarks'
inputs are uniform in [-2, 2] (CPU) or standard normal (GPU), so outputs
(convex combinations of V rows) are at most 2 in magnitude, or a few units:
the half-precision tolerances are about two units in the last place there
(bf16 has 8 significant bits: 2^-6 at 2, fp16 11: 2^-9), and fp32's is far
above its rounding (differences of 1e-6 are typical) and far below any error
a wrong index or a lost chunk makes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_ABS_DIFF: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 4e-3,
}


@dataclass(frozen=True)
class Disagreement:
    point: str  # the benchmark point's label
    impl: str
    reference: str  # the implementation it was compared with (ours)
    max_abs_diff: float
    tolerance: float

    def message(self) -> str:
        return (f"{self.point}: {self.impl} differs from {self.reference} by max |diff| {self.max_abs_diff:.3g} "
                f"> tolerance {self.tolerance:g}")


class DisagreementError(RuntimeError):
    def __init__(self, disagreements: list[Disagreement]):
        self.disagreements = disagreements
        super().__init__("implementations disagree; their speeds are not reported:\n"
                         + "\n".join("  " + d.message() for d in disagreements))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    return (a.float() - b.float()).abs().max().item()


def tolerance(dtype: torch.dtype) -> float:
    if dtype not in MAX_ABS_DIFF:
        raise ValueError(f"no benchmark tolerance for {dtype}; known: {', '.join(map(str, MAX_ABS_DIFF))}")
    return MAX_ABS_DIFF[dtype]


def check(point: str, dtype: torch.dtype, diffs: dict[str, float], reference: str) -> list[Disagreement]:
    """The implementations whose max |diff| against `reference` is over the dtype's tolerance (NaN is over)."""
    tol = tolerance(dtype)
    return [Disagreement(point, impl, reference, diff, tol) for impl, diff in diffs.items() if not diff <= tol]
