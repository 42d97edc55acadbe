"""Decode-step wall time of the step profile's 4 x 8192 batches, unprofiled, with the engine in its own processes
(as `vllm serve` runs it: MULTIPROCESSING=1) or in-process (0, one thread), and the requests in a given order:
ORDER=mod (request i behind prefix i mod 4, the default), grouped (i // 8), or an integer (grouped, then
random.shuffle'd with that seed, as vllm bench serve's prefix_repetition dataset orders its requests).

    [ORDER=mod] [MML=10240] [NTOK=33] python engine_processes.py chunk|stock 1|0 8192
(MML: vLLM serve's --max-model-len of the serving runs; NTOK: output tokens of the timed runs, 129 for the
serving runs' 128 decode steps)
"""
import json, os, statistics, sys, time

def main():
    backend, mp, shared = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = mp
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import torch
    if mp == "0":
        torch.set_num_threads(1)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_chunkattn.testing.models import ensure_model
    eng = dict(model=ensure_model("bench-gqa"), dtype="float32", block_size=64, max_num_seqs=32, enforce_eager=True,
               seed=0, max_model_len=int(os.environ.get("MML", shared + 256)), enable_prefix_caching=True)
    if backend == "chunk":
        eng["attention_backend"] = "chunk"
    llm = LLM(**eng)
    vocab = llm.get_tokenizer().vocab_size
    prefixes = [torch.randint(4, vocab, (shared,), generator=torch.Generator().manual_seed(1 + p)).tolist() for p in range(4)]
    for p in prefixes:
        llm.generate([TokensPrompt(prompt_token_ids=p)], SamplingParams(max_tokens=1), use_tqdm=False)
    order = os.environ.get("ORDER", "mod")
    if order == "mod":
        owner = [i % 4 for i in range(32)]
    elif order == "grouped":
        owner = [i // 8 for i in range(32)]
    else:  # shuffled like vllm bench serve's prefix_repetition (random.shuffle of prefix-grouped requests)
        import random
        owner = [i // 8 for i in range(32)]
        random.Random(int(order)).shuffle(owner)
    print("ORDER", order, owner, flush=True)
    def run(seed, n):
        g = torch.Generator().manual_seed(seed)
        prompts = [TokensPrompt(prompt_token_ids=prefixes[owner[i]] + torch.randint(4, vocab, (32,), generator=g).tolist()) for i in range(32)]
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
        return (time.perf_counter() - t) * 1e3
    run(1, 33)
    N = int(os.environ.get("NTOK", 33))
    b = [run(10 + i, 1) for i in range(3)]
    d = [run(20 + i, N) for i in range(3)]
    step = (statistics.median(d) - statistics.median(b)) / (N - 1)
    print("MPSTEP " + json.dumps(dict(backend=backend, mp=mp, shared=shared, burst=b, with_decode=d, step_ms=step, order=order)), flush=True)

if __name__ == "__main__":
    main()
