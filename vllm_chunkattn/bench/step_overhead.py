"""Per-step cost of the decode path, as an engine step pays it: the metadata
builder once (ChunkAttentionMetadataBuilder.build: tree lookup, decode plan),
then the attention of every layer (ChunkAttentionImpl.forward), for a deep
model, timed apart. No vLLM engine is started: the builder gets a
CommonAttentionMetadata of a pure-decode batch, as vLLM's runner builds it,
and a stand-in for the few VllmConfig fields it reads.

Batches (the kernel benchmark's shape: 32 query and KV heads of 128, blocks of 64):
    shared     32 requests, 2048 shared prompt tokens + 128 private each
    unshared   32 requests of 2176 tokens sharing nothing

The layers share one KV-cache tensor (a real model has one per layer): the
cache of a batch is larger than the last-level cache either way, so each
layer still streams it from memory, and the step's memory stays small.

Only the backend's vLLM-facing classes are used (builder, impl, metadata),
so the same file measures any checkout, e.g. this branch against its base:

    git worktree add /tmp/before <base commit> && (cd /tmp/before && python setup.py -q build_ext --inplace)
    PYTHONPATH=/tmp/before python vllm_chunkattn/bench/step_overhead.py --out before.json
    PYTHONPATH=.           python vllm_chunkattn/bench/step_overhead.py --out after.json

(run the file by path: `python -m` would import this checkout's package).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

import vllm_chunkattn
from vllm_chunkattn.backend import ChunkAttentionMetadataBuilder
from vllm_chunkattn.backend.impl import ChunkAttentionImpl
from vllm_chunkattn.testing.paged_cases import num_blocks_needed, shared_prefix

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StepShape:
    layers: int
    heads: int
    kv_heads: int
    head_size: int
    block_size: int
    batch: int
    context: int  # tokens per request, the new one included
    dtype: str


@dataclass(frozen=True)
class StepTiming:
    batch_name: str
    shared_tokens: int
    build_ms: float  # median builder.build() per step
    layers_ms: float  # median attention of all layers per step
    per_layer_ms: float
    build_ms_min: float
    layers_ms_min: float


def builder_config(shape: StepShape) -> SimpleNamespace:
    """The VllmConfig fields the builder reads, for a model of `shape`."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=shape.batch),
        compilation_config=SimpleNamespace(max_cudagraph_capture_size=0),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        model_config=SimpleNamespace(get_num_attention_heads=lambda parallel_config: shape.heads,
                                     served_model_name="step-overhead"),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1, data_parallel_rank=0),
        speculative_config=None,
    )


def decode_metadata(table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> CommonAttentionMetadata:
    """A pure-decode step's common metadata, as vLLM's runner fills it on the CPU."""
    batch = int(seq_lens.numel())
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32)
    last = seq_lens.long() - 1  # the new token's position
    slots = table.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size + last % block_size
    return CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens,
        num_reqs=batch,
        num_actual_tokens=batch,
        max_query_len=1,
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=table,
        slot_mapping=slots,
        seq_lens_cpu_upper_bound=seq_lens,
    )


def time_step(shape: StepShape, shared: int, repeats: int, name: str) -> StepTiming:
    dtype = DTYPES[shape.dtype]
    table, seq_lens = shared_prefix(shape.batch, shape.context, shared, shape.block_size)
    spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=shape.kv_heads, head_size=shape.head_size,
                             dtype=dtype)
    layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(shape.layers)]
    builder = ChunkAttentionMetadataBuilder(spec, layer_names, builder_config(shape), torch.device("cpu"))
    impl = ChunkAttentionImpl(shape.heads, shape.head_size, shape.head_size**-0.5, shape.kv_heads, None, None, "auto")
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(num_blocks_needed(table), shape.kv_heads, shape.block_size, 2 * shape.head_size,
                           generator=gen).to(dtype)
    query = torch.randn(shape.batch, shape.heads, shape.head_size, generator=gen).to(dtype)
    key = value = torch.empty(shape.batch, shape.kv_heads, shape.head_size, dtype=dtype)  # forward does not read them
    output = torch.empty_like(query)
    common = decode_metadata(table, seq_lens, shape.block_size)

    def step() -> tuple[float, float]:
        started = time.perf_counter()
        metadata = builder.build(0, common)
        built = time.perf_counter()
        for _ in range(shape.layers):
            impl.forward(None, query, key, value, kv_cache, metadata, output)
        return (built - started) * 1e3, (time.perf_counter() - built) * 1e3

    step()  # warm-up: builds the tree (later steps look it up, as steady decoding does)
    builds, layers = zip(*(step() for _ in range(repeats)))
    return StepTiming(
        batch_name=name,
        shared_tokens=shared,
        build_ms=statistics.median(builds),
        layers_ms=statistics.median(layers),
        per_layer_ms=statistics.median(layers) / shape.layers,
        build_ms_min=min(builds),
        layers_ms_min=min(layers),
    )


def checkout_description() -> str:
    root = Path(vllm_chunkattn.__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown commit"
    return f"{root} ({commit})"


def main(argv: list[str] | None = None) -> list[StepTiming]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--shared", type=int, default=2048, help="shared prompt tokens of the shared batch")
    parser.add_argument("--private", type=int, default=128, help="private tokens per request")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="a tiny step, to check that it runs")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.batch, args.shared, args.private, args.repeats = 4, 4, 128, 64, 2
    shape = StepShape(layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_size=args.head_size,
                      block_size=args.block_size, batch=args.batch, context=args.shared + args.private,
                      dtype=args.dtype)
    print(f"code: {checkout_description()}; torch threads {torch.get_num_threads()}; "
          f"CPU kernels {torch.ops.chunkattn.cpu_isa()}", flush=True)
    print(f"step: {asdict(shape)}", flush=True)
    results = []
    for name, shared in (("shared", args.shared), ("unshared", 0)):
        timing = time_step(shape, shared, args.repeats, name)
        results.append(timing)
        print(f"{name:9s} build {timing.build_ms:8.3f} ms   {shape.layers} layers {timing.layers_ms:9.2f} ms   "
              f"per layer {timing.per_layer_ms:7.3f} ms   (min build {timing.build_ms_min:.3f}, "
              f"min layers {timing.layers_ms_min:.2f})", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"code": checkout_description(), "shape": asdict(shape),
                                        "threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
                                        "results": [asdict(r) for r in results]}, indent=2))
    return results


if __name__ == "__main__":
    main()
