"""Workloads, and a runner that serves one through one vLLM engine and
records what came out.

The workload has prefixes shared at several levels, as LLM services see them:
one system prompt for every request, then per group a shared document, then
a unique question. It also has a prompt that is an exact prefix of another,
prompts shorter than one chunk, and different output lengths, so requests
join and leave the running batch at different times. Its counterpart shares
no prefix at all (distinct first words), so nothing may be shared.

    python -m vllm_chunkattn.testing.workload --backend chunk --out results.json

runs it in a fresh process (vLLM engines are best kept one per process) and
writes tokens, top logprobs and engine counters as JSON. The tests run it for
stock vLLM and for `chunk` and compare; the demo prints what happened.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

from vllm_chunkattn.cache.conversation_tree import POLICIES

WORDS = (
    "river stone light garden window paper market engine winter harbour signal "
    "orange quiet careful bridge letter silver morning station forest number "
    "table island yellow ticket doctor circle mountain pocket thunder valley "
    "history kitchen planet lantern meadow copper whisper journey anchor"
).split()


@dataclass
class Request:
    prompt: str | list[int]  # text, or token ids
    max_tokens: int
    group: str  # which shared prefix it belongs to, for the report
    n: int = 1  # parallel samples; n > 1 samples at temperature 1 with `seed`, others are greedy
    seed: int | None = None


def random_token_ids(rng: random.Random, n: int, vocab_size: int = 1700) -> list[int]:
    """n ordinary token ids: none of the low ones (special tokens) or the top of
    the vocabulary (the embedded models have about 1700 tokens)."""
    return [rng.randrange(100, vocab_size - 100) for _ in range(n)]


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def shared_prefix_workload(
    num_groups: int = 3,
    per_group: int = 4,
    system_words: int = 120,
    document_words: int = 80,
    seed: int = 0,
) -> list[Request]:
    rng = random.Random(seed)
    system = "System: you are a careful assistant. " + _text(rng, system_words) + "\n"
    requests = []
    for g in range(num_groups):
        document = f"Document {g}: " + _text(rng, document_words) + "\n"
        for r in range(per_group):
            question = f"Question {g}.{r}: " + _text(rng, 5 + 3 * r) + "?\n"
            requests.append(Request(system + document + question, 8 + 5 * ((g + r) % 4), f"doc{g}"))
    # A prompt that is an exact prefix of another one (the system prompt itself).
    requests.append(Request(system, 12, "system-only"))
    # Prompts shorter than one chunk, sharing nothing.
    requests += [Request(f"Hello {w}", 10, "short") for w in ("river", "stone", "planet")]
    return requests


def distinct_prompts_workload(num_requests: int = 4, words: int = 40, seed: int = 2) -> list[Request]:
    """Prompts of a few chunks each that differ from their first word on, so no
    two share a KV block; as many as decode together (max_num_seqs)."""
    rng = random.Random(seed)
    first_words = rng.sample(WORDS, num_requests)
    return [Request(f"{first} " + _text(rng, words), 12, "distinct") for first in first_words]


def burst_workload(num_requests: int = 32, system_chunks: int = 47, block_size: int = 32,
                   seed: int = 3) -> list[Request]:
    """A burst: requests that share a system prompt and arrive together, each
    with a few tokens of its own (RelayAttention's prompt phase). The prompt
    is token ids, exactly `system_chunks` whole chunks (1504 tokens at block
    32), so that once the first request is scheduled the others hit all of
    it in the same step, while the first computes it, and have only their own
    3 to 8 tokens left: few enough for the tree path."""
    rng = random.Random(seed)
    system = random_token_ids(rng, system_chunks * block_size)
    return [Request(system + random_token_ids(rng, 3 + i % 6), 8 + i % 5, "burst") for i in range(num_requests)]


def parallel_sampling_workload(n: int = 4, block_size: int = 32, seed: int = 4) -> list[Request]:
    """Two prompts, each sampled n times (`SamplingParams.n`, seeded so both
    backends draw the same tokens). vLLM runs the n samples as n requests on
    the prompt's blocks: one prompt ends inside a chunk (5 whole chunks and 5
    tokens: the later samples hit all 5 chunks and prefill only the 5 tokens),
    the other on a chunk boundary (7 whole chunks: vLLM caps a prefix hit at
    the prompt's length minus one, so each later sample recomputes the 7th
    chunk into a block of its own, and the samples share only the first 6)."""
    rng = random.Random(seed)
    inside = random_token_ids(rng, 5 * block_size + 5)
    boundary = random_token_ids(rng, 7 * block_size)
    return [Request(inside, 12, "n-inside-chunk", n=n, seed=10), Request(boundary, 12, "n-chunk-boundary", n=n, seed=20)]


def chat_conversations() -> list[list[dict]]:
    """Two conversations that share a system message, for the chat endpoint."""
    rng = random.Random(1)
    system = {"role": "system", "content": "You answer briefly. " + _text(rng, 60)}
    return [
        [system, {"role": "user", "content": "Tell me about the " + _text(rng, 6)}],
        [system, {"role": "user", "content": "Where is the " + _text(rng, 4) + "?"}],
    ]


CHAT_MAX_TOKENS = 16


@dataclass
class EngineSettings:
    model: str
    backend: str = "chunk"  # "chunk" or "stock" (vLLM's default CPU_ATTN)
    dtype: str = "float32"
    block_size: int = 32
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 256  # small, so long prompts are prefilled in chunks
    num_blocks: int | None = None  # small, to force preemption and recompute
    max_model_len: int = 2048
    logprobs: int = 2
    speculative_tokens: int = 0  # > 0: n-gram speculative decoding proposing this many tokens per step
    pensieve_policy: str | None = None  # the PensieveConnector's eviction policy; None: no connector
    pensieve_host_gib: float = 0.05
    pensieve_disk_dir: str | None = None  # the connector's disk tier; None: host tier only
    pensieve_pinned_prompts: tuple[str, ...] = ()  # files of prompts the connector computes at start and keeps
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # "mp" or "ray"; None: vLLM's choice


def make_llm(settings: EngineSettings):
    """One engine as the settings say (prefix caching on, eager, seeded)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    extra = {} if settings.backend == "stock" else {"attention_backend": settings.backend}
    max_model_len = settings.max_model_len
    if settings.num_blocks is not None:
        extra["num_gpu_blocks_override"] = settings.num_blocks
        # vLLM refuses a max_model_len that the blocks cannot hold.
        max_model_len = min(max_model_len, (settings.num_blocks - 1) * settings.block_size)
    if settings.speculative_tokens:
        extra["speculative_config"] = {"method": "ngram", "num_speculative_tokens": settings.speculative_tokens,
                                       "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    if settings.distributed_executor_backend:
        extra["distributed_executor_backend"] = settings.distributed_executor_backend
    world = settings.tensor_parallel_size * settings.pipeline_parallel_size
    if world > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM's CPU build binds each rank to a NUMA node of its own unless told which cores
        # to use; on a one-node machine, give each rank an equal share of this process's cores.
        cpus = sorted(os.sched_getaffinity(0))
        per_rank = max(1, len(cpus) // world)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, cpus[rank * per_rank : (rank + 1) * per_rank] or cpus[-1:])) for rank in range(world))
    if settings.pensieve_policy:
        extra["kv_transfer_config"] = {
            "kv_connector": "PensieveConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"host_cache_gib": settings.pensieve_host_gib,
                                          "eviction_policy": settings.pensieve_policy}}
        if settings.pensieve_disk_dir:
            extra["kv_transfer_config"]["kv_connector_extra_config"]["disk_cache_dir"] = settings.pensieve_disk_dir
        if settings.pensieve_pinned_prompts:
            extra["kv_transfer_config"]["kv_connector_extra_config"]["pinned_prompts"] = list(
                settings.pensieve_pinned_prompts)
    return LLM(
        model=settings.model,
        dtype=settings.dtype,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
        **extra,
    )


def run_offline(settings: EngineSettings, requests: list[Request], chat: list[list[dict]] | None = None) -> dict:
    """Serve `requests` (then the `chat` conversations, if any) through one
    engine; tokens, logprobs and counters."""
    from vllm import SamplingParams

    started = time.perf_counter()
    llm = make_llm(settings)
    engine_start_s = time.perf_counter() - started
    params = [
        SamplingParams(n=r.n, temperature=1.0 if r.n > 1 else 0.0, seed=r.seed, max_tokens=r.max_tokens,
                       logprobs=settings.logprobs, ignore_eos=True)
        for r in requests
    ]
    started = time.perf_counter()
    prompts = [r.prompt if isinstance(r.prompt, str) else {"prompt_token_ids": r.prompt} for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - started
    chat_outputs = llm.chat(
        chat, SamplingParams(temperature=0.0, max_tokens=CHAT_MAX_TOKENS, ignore_eos=True), use_tqdm=False,
    ) if chat else []
    results = []
    for req, out in zip(requests, outputs):
        for completion in out.outputs:  # one result per sample
            top = [
                sorted(((lp.logprob, tok) for tok, lp in step.items()), reverse=True)
                for step in completion.logprobs
            ]
            results.append(
                {
                    "group": req.group,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "prompt_token_ids": list(out.prompt_token_ids),
                    "tokens": list(completion.token_ids),
                    "text": completion.text,
                    "top_logprobs": [[[tok, lp] for lp, tok in step] for step in top],
                }
            )
    return {
        "settings": asdict(settings),
        "engine_start_s": engine_start_s,
        "generate_s": generate_s,
        "counters": _counters(llm),
        "results": results,
        "chat": [out.outputs[0].text for out in chat_outputs],
    }


CONVERSATIONS, TURNS = 4, 3


def conversation_openings(rng: random.Random) -> list[list[int]]:
    """The conversations' first prompts (150 random tokens each), drawn first
    from the generator that then draws their later user messages."""
    return [random_token_ids(rng, 150) for _ in range(CONVERSATIONS)]


def run_conversations(settings: EngineSettings, seed: int = 0) -> dict:
    """Closed-loop chats: each turn resends the conversation so far (its
    earlier prompts and the engine's own answers) plus a new user message.
    The conversations take turns, so with a small KV cache each one's history
    is evicted by the others' before its next turn. One result per turn, in
    order, with what the PensieveConnector reported loading."""
    from vllm import SamplingParams

    llm = make_llm(settings)
    rng = random.Random(seed)
    history = conversation_openings(rng)
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=settings.logprobs, ignore_eos=True)
    results = []
    for turn in range(TURNS):
        for conversation in range(CONVERSATIONS):
            out = llm.generate([{"prompt_token_ids": history[conversation]}], [params], use_tqdm=False)[0]
            completion = out.outputs[0]
            top = [max(step.values(), key=lambda lp: lp.logprob).logprob for step in completion.logprobs]
            loaded = (out.kv_transfer_params or {}).get("pensieve") or {}
            results.append({"group": f"conversation {conversation} turn {turn}",
                            "prompt_tokens": len(history[conversation]), "tokens": list(completion.token_ids),
                            "top1_logprobs": top, "cached_tokens": out.num_cached_tokens,
                            "host_loaded_tokens": loaded.get("host_loaded_tokens"),
                            "disk_loaded_tokens": loaded.get("disk_loaded_tokens")})
            history[conversation] = (history[conversation] + list(completion.token_ids)
                                     + random_token_ids(rng, 40))
    return {"settings": asdict(settings), "counters": _counters(llm), "results": results}


def _counters(llm) -> dict:
    wanted = {"vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries",
              "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
              "vllm:spec_decode_num_accepted_tokens"}
    counters = {}
    for metric in llm.get_metrics():
        if metric.name in wanted:
            counters[metric.name] = getattr(metric, "value", None)
    return counters


# name: (requests, chat conversations or None)
WORKLOADS = {
    "shared-prefix": (shared_prefix_workload, chat_conversations),
    "distinct-prompts": (distinct_prompts_workload, None),
    "burst": (burst_workload, None),
    "speculative": (shared_prefix_workload, None),
    "parallel-sampling": (parallel_sampling_workload, None),
    "parallel-sampling-chunked": (parallel_sampling_workload, None),
}
# Engine settings a workload needs unless given: the burst arrives in one step;
# "speculative" is the shared-prefix workload under n-gram speculative decoding;
# the n samples of one prompt run together, apart from the other prompt's; "chunked", their prompts
# are prefilled 64 tokens a step, so seeded requests sample tokens that vLLM discards.
WORKLOAD_ENGINE_SETTINGS = {"burst": {"max_num_seqs": 32, "max_num_batched_tokens": 2048},
                            "speculative": {"speculative_tokens": 3},
                            "parallel-sampling": {"max_num_seqs": 4},
                            "parallel-sampling-chunked": {"max_num_seqs": 4, "max_num_batched_tokens": 64},
                            # 24 blocks of 32 tokens in vLLM's cache and a host tier of 32 blocks of the tiny
                            # model (64 KiB each): both hold fewer than the conversations' 36 full blocks.
                            "conversations": {"num_blocks": 24, "pensieve_host_gib": 32 * 64 / 2**20}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a workload through one vLLM engine.")
    parser.add_argument("--workload", default="shared-prefix", choices=[*WORKLOADS, "conversations"])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    parser.add_argument("--backend", default="chunk", choices=["chunk", "stock"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the workload's, else 4")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the workload's, else 256")
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--model-name", default="tiny", help="embedded model to use when --model is not given")
    parser.add_argument("--pensieve", default=None, choices=list(POLICIES),
                        help="keep conversations' KV in the PensieveConnector's host tier, under this eviction policy")
    parser.add_argument("--pensieve-disk-dir", default=None, help="with --pensieve: the connector's disk tier")
    parser.add_argument("--pensieve-pinned-prompt", action="append", default=[],
                        help="with --pensieve: a file of a prompt to pin (text, or a .json list of token ids); "
                             "repeatable")
    parser.add_argument("--pensieve-host-gib", type=float, default=None,
                        help="with --pensieve: the host tier's size (default: the workload's, else 0.05)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                        help="how vLLM runs its workers (default: vLLM's choice)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.model is None:
        from vllm_chunkattn.testing.models import ensure_model

        args.model = ensure_model(args.model_name)
    given = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
             "num_blocks": args.num_blocks, "pensieve_host_gib": args.pensieve_host_gib}
    engine = {**WORKLOAD_ENGINE_SETTINGS.get(args.workload, {}), **{k: v for k, v in given.items() if v is not None}}
    settings = EngineSettings(model=args.model, backend=args.backend, dtype=args.dtype, block_size=args.block_size,
                              pensieve_policy=args.pensieve, pensieve_disk_dir=args.pensieve_disk_dir,
                              pensieve_pinned_prompts=tuple(args.pensieve_pinned_prompt),
                              tensor_parallel_size=args.tensor_parallel_size,
                              pipeline_parallel_size=args.pipeline_parallel_size,
                              distributed_executor_backend=args.distributed_executor_backend, **engine)
    if args.workload == "conversations":
        record = run_conversations(settings)
    else:
        make_requests, make_chat = WORKLOADS[args.workload]
        record = run_offline(settings, make_requests(), make_chat() if make_chat else None)
    with open(args.out, "w") as f:
        json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
