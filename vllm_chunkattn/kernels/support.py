"""What the kernels support, per platform: the one table every check reads.

The backend's capability class methods and engine-start validation
(backend/chunk_backend.py), the impl, the kernel wrappers (ops.py) and the
README's support table come from here; tests check the compiled dispatch
tables of csrc/cpu and csrc/cuda against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_chunkattn.install.cuda_toolkit import MIN_COMPUTE_CAPABILITY


@dataclass(frozen=True)
class PlatformSupport:
    platform: str
    head_sizes: tuple[int, ...]
    block_sizes: tuple[int, ...]  # vLLM's block size, our chunk size
    dtypes: tuple[torch.dtype, ...]
    # Which requests take the prefix-tree path (prefix/query_rows.py): those
    # whose new tokens times the GQA group (query rows per KV head) are at
    # most this; the others run the paged prefill. Stacking a shared chunk's
    # rows pays while each request brings few; with many, the prefill's own
    # query tiles already reuse each key and the tree path only adds partial
    # results (`python -m vllm_chunkattn.bench.kernel --grid relay`). The
    # crossover is the device's: the engine measures it at start per layer
    # shape (kernels/tree_reach.py) and uses this value only with
    # CHUNKATTN_CPU_TUNING=default, under pipeline parallelism, and on CUDA
    # when the measurement's batch does not fit in GPU memory.
    tree_max_rows_per_kv_head: int
    # Per node, within that path: a request's own rows form a node over its
    # private chunks (prefix/query_rows.py). Such a node is stacked when the
    # request has at least this many new tokens; with fewer, its chunks are
    # attended row by row in the sequence-first phase. 2: always stacked.
    own_node_min_query_len: int
    # vLLM's sliding-window attention (Mistral, Gemma 2/3, gpt-oss, Phi-3 layers).
    sliding_window: bool
    # Logits soft-capping (Gemma 2): cap * tanh(score / cap).
    logits_soft_cap: bool
    # Learned attention sinks (gpt-oss): one more softmax term per head.
    attention_sinks: bool
    # ALiBi position bias (BLOOM, MPT): slope * (key position - query position).
    alibi: bool
    kv_cache_dtypes: tuple[str, ...] = ("auto",)  # "auto": the model dtype
    min_compute_capability: tuple[int, int] | None = None

    def tree_max_query_len(self, group: int) -> int:
        return tree_max_query_len(self.tree_max_rows_per_kv_head, group)


def tree_max_query_len(max_rows_per_kv_head: int, group: int) -> int:
    """The longest query of a request on the tree path, for GQA group `group` (decodes always)."""
    return max(1, max_rows_per_kv_head // group)


CPU = PlatformSupport(
    platform="CPU",
    head_sizes=(64, 128, 256),
    block_sizes=(32, 64, 128),
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    tree_max_rows_per_kv_head=16,
    # Zen 4, relay shape: unstacking was 0.65x to 0.81x (fp32) and 0.99x to
    # 1.01x (bf16 GQA) of stacking at 2 to 8 new tokens (docs/cpu-kernel-notes.md).
    own_node_min_query_len=2,
    sliding_window=True,
    logits_soft_cap=True,
    attention_sinks=True,
    alibi=True,
)
# Tensor-core MMA (mma.sync) in float16/bfloat16, cp.async: sm_80 and newer.
CUDA = PlatformSupport(
    platform="CUDA",
    head_sizes=(64, 128, 256),
    block_sizes=(16, 32, 64, 128),
    dtypes=(torch.float16, torch.bfloat16),
    # H200, relay grid (16 and 32 heads, GQA 1 and 4, fp16 and bf16): the tree
    # path won every point up to 8 rows per KV head and lost MHA at 16
    # (docs/results/nvidia-h200/relay_*.md): the value for every shape.
    tree_max_rows_per_kv_head=8,
    # H200, relay shape: unstacking was 1.12x to 1.56x faster at 2 and 4 new
    # tokens, 0.74x (MHA) at 8 and 0.67x to 0.97x at 16 (docs/cuda.md).
    own_node_min_query_len=5,
    sliding_window=True,
    logits_soft_cap=True,
    attention_sinks=True,
    alibi=True,
    min_compute_capability=MIN_COMPUTE_CAPABILITY,
)


# The attention variants beyond plain causal softmax: how messages and the README name each flag.
VARIANTS = {"sliding windows": "sliding_window", "logits soft-capping": "logits_soft_cap",
            "attention sinks": "attention_sinks", "ALiBi": "alibi"}


def for_platform(cuda: bool) -> PlatformSupport:
    return CUDA if cuda else CPU


def names(values) -> str:
    """'64, 128, 256' / 'float16, bfloat16': the form every message uses."""
    return ", ".join(str(v).replace("torch.", "") for v in values)


def markdown_rows() -> list[str]:
    """The per-platform rows of the README's support table (a test keeps the README in step)."""
    rows = []
    for what, field in (("head size", "head_sizes"), ("dtype", "dtypes"), ("block (chunk) size", "block_sizes"),
                        ("KV cache dtype (auto: the model dtype)", "kv_cache_dtypes")):
        rows.append(f"| {what} | {names(getattr(CPU, field))} | {names(getattr(CUDA, field))} |")
    for what, field in VARIANTS.items():
        rows.append(f"| {what} | {'yes' if getattr(CPU, field) else 'no'} | {'yes' if getattr(CUDA, field) else 'no'} |")
    major, minor = MIN_COMPUTE_CAPABILITY
    rows.append(f"| device | any x86-64 CPU (AVX2 or AVX-512 kernels when present) | compute capability "
                f"{major}.{minor} and newer |")
    return rows
