"""A multi-level shared-prefix dataset for `vllm bench serve --dataset-name custom`.

Every prompt is: one system prompt (shared by all requests), then the
document of its group (shared by the group), then a question of its own.
The KV of such a workload is a tree two levels deep; a single common prefix
(what a one-level cascade exploits) covers only the system prompt.

Prompts are sized in real tokens of the served model's tokenizer: each part
is built from words whose token counts are known, and the finished prompt is
re-tokenised to check that it is exactly system + document + question, so
the shared parts really are shared token for token (hence block for block).

    python -m vllm_chunkattn.bench.tree_dataset MODEL_DIR out.jsonl --num-prompts 96
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_chunkattn.testing.workload import WORDS


@dataclass(frozen=True)
class TreeShape:
    system_tokens: int = 1024
    num_groups: int = 4
    document_tokens: int = 1024
    question_tokens: int = 32
    output_tokens: int = 128


class _Segments:
    """Text of an exact token count. The tokenizers of our models split text
    at spaces and newlines before merging, so the tokens of `" word"` pieces
    and of a leading header just add up; `build` checks it anyway."""

    def __init__(self, tokenizer, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.cost = {w: self.count(" " + w) for w in WORDS}
        self.single = [w for w, c in self.cost.items() if c == 1]
        if not self.single:
            raise ValueError("the tokenizer has no single-token word to pad prompts with")

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def build(self, header: str, n_tokens: int) -> str:
        text = header
        left = n_tokens - self.count(header + "\n")
        if left < 0:
            raise ValueError(f"{n_tokens} tokens cannot hold the header {header!r}")
        while left > 0:
            word = self.rng.choice(WORDS)
            if self.cost[word] > left:
                word = self.rng.choice(self.single)
            text += " " + word
            left -= self.cost[word]
        text += "\n"
        if self.count(text) != n_tokens:
            raise AssertionError(f"segment has {self.count(text)} tokens, wanted {n_tokens}")
        return text


def tree_prompts(tokenizer, shape: TreeShape, num_prompts: int, seed: int = 0) -> list[dict]:
    """`num_prompts` records `{"prompt", "output_tokens", "group", "prompt_tokens"}`,
    groups dealt round-robin (vLLM's custom dataset shuffles them with --seed)."""
    rng = random.Random(seed)
    segments = _Segments(tokenizer, rng)
    system = segments.build("System: you are a careful assistant. Rules and examples:", shape.system_tokens)
    documents = [segments.build(f"Document {g}:", shape.document_tokens) for g in range(shape.num_groups)]
    system_ids = tokenizer.encode(system, add_special_tokens=False).ids
    document_ids = [tokenizer.encode(d, add_special_tokens=False).ids for d in documents]
    records = []
    for i in range(num_prompts):
        g = i % shape.num_groups
        question = segments.build(f"Question {i}:", shape.question_tokens)
        prompt = system + documents[g] + question
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        # The point of the dataset: the shared parts tokenise identically inside every prompt.
        if ids[: len(system_ids) + len(document_ids[g])] != system_ids + document_ids[g]:
            raise AssertionError(f"prompt {i}: the shared prefix does not tokenise as shared")
        if len(ids) != shape.system_tokens + shape.document_tokens + shape.question_tokens:
            raise AssertionError(f"prompt {i} has {len(ids)} tokens")
        records.append({"prompt": prompt, "output_tokens": shape.output_tokens, "group": g, "prompt_tokens": len(ids)})
    return records


def load_tokenizer(model_dir: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


def write_tree_dataset(model_dir: str, path: str | Path, shape: TreeShape, num_prompts: int, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = tree_prompts(load_tokenizer(model_dir), shape, num_prompts, seed)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vllm_chunkattn.bench.tree_dataset", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="model directory (its tokenizer.json sizes the prompts)")
    ap.add_argument("out", help="JSONL file to write")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    for field, value in asdict(TreeShape()).items():
        ap.add_argument("--" + field.replace("_", "-"), type=int, default=value)
    args = ap.parse_args(argv)
    shape = TreeShape(**{f: getattr(args, f) for f in asdict(TreeShape())})
    print(write_tree_dataset(args.model, args.out, shape, args.num_prompts, args.seed))


if __name__ == "__main__":
    main()
