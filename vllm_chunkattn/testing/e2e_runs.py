"""Engine runs of the workloads, one process each, as a user would start them
(`python -m vllm_chunkattn.testing.workload`), and the configurations compared.
A run's record carries what the backend logged about sharing: the whole-run
summary of backend/stats.py, written when the process that runs the model,
a vLLM worker, exits, and each step's tree (runs log at debug level)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from vllm_chunkattn.backend.stats import parse_run_summaries, parse_step_trees, with_run_summary_time
from vllm_chunkattn.kernels import cpu_tuning
from vllm_chunkattn.testing.workload import WORKLOAD_ENGINE_SETTINGS

# name: (model, dtype, block size, KV blocks or None, logprob tolerance, near-tie threshold)
CONFIGS = {
    "float32-gqa-d64-block32-preempt": ("tiny", "float32", 32, 24, 1e-3, 0.0),
    "bfloat16-gqa-d128-block64": ("tiny-d128", "bfloat16", 64, None, 0.15, 0.15),
    "float16-mha-d64-block128": ("tiny-mha", "float16", 128, None, 0.05, 0.05),
}
# The float32 referee of each low-precision configuration (test_e2e.py): the same model and cache.
REFEREE_OF = {name: "float32-" + name.split("-", 1)[1] for name, config in CONFIGS.items() if config[1] != "float32"}
REFEREE_CONFIGS = {REFEREE_OF[name]: (model, "float32", block_size, num_blocks, 1e-3, 0.0)
                   for name, (model, _, block_size, num_blocks, _, _) in CONFIGS.items() if name in REFEREE_OF}
# The speculative-decoding test's: tiny with tied embeddings, whose greedy output
# repeats at times, so that n-gram drafts get accepted as well as rejected.
SPECULATIVE_CONFIGS = {
    "float32-repeats-gqa-d64-block32": ("tiny-repeats", "float32", 32, None, 1e-3, 0.0),
}
# Attention variants (testing/models.py ATTENTION_VARIANTS), run by their own tests.
VARIANT_CONFIGS = {
    "float32-window80-block32": ("tiny-window", "float32", 32, None, 1e-3, 0.0),
    "float32-gemma2-block32": ("tiny-gemma2", "float32", 32, None, 1e-3, 0.0),
    "float32-gemma3-block32": ("tiny-gemma3", "float32", 32, None, 1e-3, 0.0),
    "float32-mistral-block32": ("tiny-mistral", "float32", 32, None, 1e-3, 0.0),
    "float32-bloom-block32": ("tiny-bloom", "float32", 32, None, 1e-3, 0.0),
    "float32-gptoss-block32": ("tiny-gptoss", "float32", 32, None, 1e-3, 0.0),
}


def run_workload(tmp_path_factory, name: str, backend: str, workload: str = "shared-prefix",
                 pensieve: str | None = None, extra_args: tuple[str, ...] = ()) -> dict:
    """`pensieve`: run with the PensieveConnector under this eviction policy;
    `extra_args`: more options of `python -m vllm_chunkattn.testing.workload`."""
    model, dtype, block_size, num_blocks, _, _ = {**CONFIGS, **VARIANT_CONFIGS, **SPECULATIVE_CONFIGS,
                                                 **REFEREE_CONFIGS}[name]
    out = tmp_path_factory.mktemp(name) / f"{workload}-{backend}-{pensieve or 'no-connector'}.json"
    cmd = [sys.executable, "-m", "vllm_chunkattn.testing.workload", "--workload", workload, "--model-name", model,
           "--backend", backend, "--dtype", dtype, "--block-size", str(block_size), "--out", str(out)]
    if pensieve:
        cmd += ["--pensieve", pensieve]
    cmd += extra_args
    # The config's small cache (forcing preemption) is for the workloads without
    # engine settings of their own: the burst needs its whole prompt cached.
    if num_blocks and workload not in WORKLOAD_ENGINE_SETTINGS:
        cmd += ["--num-blocks", str(num_blocks)]
    # Built-in CPU tuning: the tests assert which rows took the tree path, and
    # the reach the engine would measure (kernels/tree_reach.py) is the CPU's.
    env = with_run_summary_time({**os.environ, "VLLM_LOGGING_LEVEL": "DEBUG", cpu_tuning.ENV_VAR: "default"})
    # One rank: the engine in the driver's process (the same engine code without
    # the engine-core process and its IPC), which starts in 4 s instead of 17.
    # The server tests and the parallel runs keep vLLM's processes.
    if "--tensor-parallel-size" not in extra_args and "--pipeline-parallel-size" not in extra_args:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    log = done.stdout + done.stderr
    record = json.loads(out.read_text())
    record["log"] = log
    record["decode_summaries"] = parse_run_summaries(log)
    record["step_trees"] = parse_step_trees(log)
    return record
