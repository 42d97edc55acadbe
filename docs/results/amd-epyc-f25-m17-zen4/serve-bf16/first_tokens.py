"""First-token logprobs of bench-gqa under (backend, dtype); writes JSON. Usage: backend dtype out"""
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
import numpy as np
from vllm_chunkattn.testing.models import ensure_model
def main():
    backend, dtype, out = sys.argv[1:4]
    extra = {} if backend == "stock" else {"attention_backend": backend}
    llm = LLM(model=ensure_model("bench-gqa"), dtype=dtype, block_size=64, max_model_len=4096, enable_prefix_caching=True,
              enforce_eager=True, seed=0, max_num_seqs=32, **extra)
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 1600, 2048).tolist()
    prompts = [TokensPrompt(prompt_token_ids=prefix + rng.integers(100, 1600, 64).tolist()) for _ in range(16)]
    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=20)
    llm.generate(prompts[:1], sp)  # caches the prefix
    res = llm.generate(prompts, sp)
    data = [[{str(t): lp.logprob for t, lp in step.items()} for step in r.outputs[0].logprobs] for r in res]
    json.dump({"tokens": [list(r.outputs[0].token_ids) for r in res], "logprobs": data}, open(out, "w"))


if __name__ == "__main__":
    main()
