"""Runs the shared-prefix workload (vllm_chunkattn.testing.workload) through one vLLM
engine on a GPU and writes tokens and top logprobs as JSON, for
test_gpu_e2e.py. One engine per process:

    python tests/gpu/gpu_workload.py --backend FLASH_ATTN --dtype float16 --block-size 16 --out a.json
    python tests/gpu/gpu_workload.py --backend chunk --cuda-graphs ... --out b.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True, help="chunk or a vLLM backend name (FLASH_ATTN)")
    ap.add_argument("--model-name", default="tiny")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cuda-graphs", action="store_true", help="let vLLM capture CUDA graphs (default: eager)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from vllm import LLM, SamplingParams

    from vllm_chunkattn.testing.models import ensure_model
    from vllm_chunkattn.testing.workload import shared_prefix_workload

    requests = shared_prefix_workload(num_groups=4, per_group=6)
    started = time.perf_counter()
    llm = LLM(
        model=ensure_model(args.model_name),
        dtype=args.dtype,
        block_size=args.block_size,
        attention_backend=args.backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=256,  # long prompts are prefilled in chunks
        max_model_len=2048,
        enable_prefix_caching=True,
        enforce_eager=not args.cuda_graphs,
        gpu_memory_utilization=0.35,
        seed=0,
    )
    engine_start_s = time.perf_counter() - started
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens + 24, logprobs=2, ignore_eos=True)
              for r in requests]
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    results = []
    for out in outputs:
        completion = out.outputs[0]
        top = [sorted(((lp.logprob, tok) for tok, lp in step.items()), reverse=True) for step in completion.logprobs]
        results.append({
            "prompt_tokens": len(out.prompt_token_ids),
            "tokens": list(completion.token_ids),
            "top_logprobs": [[[tok, lp] for lp, tok in step] for step in top],
        })
    with open(args.out, "w") as f:
        json.dump({"engine_start_s": engine_start_s, "results": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
