"""The workloads of the serving benchmark, as `vllm bench serve` dataset options.

Each workload is one of vLLM's own datasets (or our tree JSONL read by its
`custom` dataset); the benchmark never generates requests itself, so both
servers get exactly the requests `vllm bench serve --seed` makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_chunkattn.bench.tree_dataset import TreeShape, write_tree_dataset


@dataclass(frozen=True)
class Workload:
    name: str
    description: str  # one line for the table
    dataset_args: tuple[str, ...]  # `vllm bench serve` options choosing and shaping the dataset
    prompt_tokens: int  # per request, for the report
    shared_tokens: int  # prompt tokens shared with other requests (n_s in the paper)
    output_tokens: int
    num_prompts_multiple: int = 1  # prefix_repetition makes num_prompts // num_prefixes per prefix
    num_prompts: int | None = None  # a fixed number of requests (a burst); None: the run's --num-prompts
    tree: TreeShape | None = field(default=None)  # set: the dataset file is made by `prepare`
    # Before each timed run, the same requests with one output token each (`warm_up_args`): the prefixes
    # are in the prefix cache when timing starts, as on a server whose system prompts are hot. Without
    # it a run starts from an empty prefix cache and computes every distinct prefix once, in both servers
    # (but the first: the timed run sends it alone before timing, serve.bench_command).
    warm: bool = False
    # The project's targets, checked in the report; None: no target.
    min_throughput_ratio: float | None = None  # chunk/stock output tokens/s at max concurrency
    max_p90_latency_ratio: float | None = None  # chunk/stock p90 normalised latency there
    max_ttft_ratio: float | None = None  # chunk/stock mean and p90 TTFT there

    def bench_args(self, dataset_dir: Path) -> list[str]:
        args = list(self.dataset_args)
        if self.tree is not None:
            args += ["--dataset-path", str(self.dataset_path(dataset_dir))]
        return args

    def warm_up_args(self, dataset_dir: Path) -> list[str]:
        """bench_args with one output token per request: the output length draws nothing from the
        datasets' random generators, so these are the timed run's prompts."""
        return list(_with_output_len(self, 1)) + self.bench_args(dataset_dir)[len(self.dataset_args):]

    def dataset_path(self, dataset_dir: Path) -> Path:
        return Path(dataset_dir) / f"{self.name}.jsonl"

    def prepare(self, model: str, dataset_dir: Path, num_prompts: int, seed: int) -> None:
        if self.tree is not None:
            write_tree_dataset(model, self.dataset_path(dataset_dir), self.tree, num_prompts, seed)


def prefix_repetition(name: str, prefix: int, suffix: int, num_prefixes: int, output: int) -> Workload:
    return Workload(
        name=name,
        description=f"{num_prefixes} system prompts of {prefix} tokens, {suffix}-token suffixes",
        dataset_args=(
            "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(prefix),
            "--prefix-repetition-suffix-len", str(suffix),
            "--prefix-repetition-num-prefixes", str(num_prefixes),
            "--prefix-repetition-output-len", str(output),
        ),
        prompt_tokens=prefix + suffix, shared_tokens=prefix, output_tokens=output,
        num_prompts_multiple=num_prefixes,
    )


def tree(name: str, shape: TreeShape) -> Workload:
    return Workload(
        name=name,
        description=(f"system {shape.system_tokens} + {shape.num_groups} documents of {shape.document_tokens}"
                     f" + {shape.question_tokens}-token questions"),
        # The prompts are complete; a chat template would only wrap them.
        dataset_args=("--dataset-name", "custom", "--skip-chat-template", "--custom-output-len", "-1"),
        prompt_tokens=shape.system_tokens + shape.document_tokens + shape.question_tokens,
        shared_tokens=shape.system_tokens + shape.document_tokens, output_tokens=shape.output_tokens,
        tree=shape,
    )


def random_no_prefix(name: str, input_len: int, output: int) -> Workload:
    return Workload(
        name=name,
        description=f"random {input_len}-token prompts, nothing shared",
        dataset_args=(
            "--dataset-name", "random",
            "--random-input-len", str(input_len),
            "--random-output-len", str(output),
            "--random-prefix-len", "0",
            "--random-range-ratio", "0",
        ),
        prompt_tokens=input_len, shared_tokens=0, output_tokens=output,
    )


def _with_output_len(w: Workload, n: int) -> tuple[str, ...]:
    """w's dataset options with n output tokens (for the tree dataset, instead of the file's own)."""
    args = list(w.dataset_args)
    for flag in ("--prefix-repetition-output-len", "--random-output-len", "--custom-output-len"):
        if flag in args:
            args[args.index(flag) + 1] = str(n)
    return tuple(args)


def workloads(quick: bool) -> dict[str, Workload]:
    """The full set (bench model) or the CI set (tiny model, short prompts;
    CI checks correctness only, so it sets no speed targets)."""
    def warm(w: Workload) -> Workload:
        return replace(w, name=f"{w.name}-warm", warm=True, description=f"{w.description}, cached before timing")

    if quick:
        repetition_256 = prefix_repetition("prefix_repetition-256", 256, 16, 2, 32)
        chosen = [
            repetition_256,
            warm(repetition_256),
            tree("tree", TreeShape(system_tokens=128, num_groups=2, document_tokens=128,
                                   question_tokens=16, output_tokens=32)),
            random_no_prefix("random-256", 256, 32),
        ]
    else:
        # Targets: chunk/stock output throughput at max concurrency 32 on the default model (issue 12),
        # and TTFT (mean and p90) no worse than stock everywhere.
        def shared(w: Workload, min_ratio: float | None) -> list[Workload]:
            """The workload at its output length and at 64 and 256 output tokens (the target is the first's)."""
            return [replace(w, min_throughput_ratio=min_ratio, max_ttft_ratio=1.0)] + [
                replace(w, name=f"{w.name}-out{n}", output_tokens=n, max_ttft_ratio=1.0,
                        dataset_args=_with_output_len(w, n), tree=replace(w.tree, output_tokens=n) if w.tree else None)
                for n in (64, 256)
            ]

        repetition_2048 = shared(prefix_repetition("prefix_repetition-2048", 2048, 32, 4, 128), 1.15)
        repetition_8192 = replace(prefix_repetition("prefix_repetition-8192", 8192, 32, 4, 128),
                                  min_throughput_ratio=2.0, max_ttft_ratio=1.0)
        chosen = [
            *repetition_2048,
            warm(repetition_2048[0]),
            repetition_8192,
            warm(repetition_8192),
            *shared(tree("tree", TreeShape(system_tokens=1024, num_groups=4, document_tokens=1024,
                                           question_tokens=32, output_tokens=128)), 1.15),
            replace(random_no_prefix("random-1024", 1024, 128), min_throughput_ratio=1.0, max_ttft_ratio=1.0),
            # 32 requests at once behind one 2048-token prefix that is already cached (the timed run sends
            # the first prompt alone before timing, serve.bench_command): what users feel first is the TTFT.
            replace(prefix_repetition("burst-2048", 2048, 64, 1, 64), num_prompts=32, max_ttft_ratio=1.0,
                    description="a burst of 32 requests behind one cached 2048-token prefix, 64-token suffixes"),
        ]
    return {w.name: w for w in chosen}
