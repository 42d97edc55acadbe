"""Offline, deterministic toy Llama models for tests, demos and benchmarks.

No model hub is reachable where this project is tested, so every model is
generated locally: a byte-level BPE tokenizer trained on a synthetic English
corpus plus random (but carefully scaled) Llama weights. Results are cached on
disk; ``ensure_model("tiny")`` returns a directory that vLLM loads directly.

    python -m vllm_chunkattn.testing.models [NAME ...] [--root DIR]

The weights are scaled so that greedy output is varied and depends on every
prompt token (see the gains below), which also makes it chaotic: bf16 rounding
alone changes a greedy continuation within a few tokens. Compare attention
backends token-for-token in float32 only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

# Bump when the generator changes in a way that alters the files it writes;
# the stamp is part of the cache directory name, so stale caches are ignored.
GENERATOR_VERSION = 1

# name: hidden, heads, head_dim, kv_heads, layers, intermediate, max_positions
SPECS: dict[str, dict[str, int]] = {
    name: dict(zip(("hidden_size", "num_attention_heads", "head_dim",
                    "num_key_value_heads", "num_hidden_layers",
                    "intermediate_size", "max_position_embeddings"), row))
    for name, row in {
        "tiny":      (256, 4, 64, 2, 2, 512, 4096),     # GQA, for tests
        "tiny-mha":  (256, 4, 64, 4, 2, 512, 4096),     # MHA
        "tiny-d128": (512, 4, 128, 2, 2, 1024, 4096),   # GQA, head_dim 128
        "tiny-window": (256, 4, 64, 2, 2, 512, 4096),   # tiny with a sliding-window layer (below)
        "tiny-gemma2": (256, 4, 64, 2, 2, 512, 4096),   # vLLM's Gemma 2: window, soft-capping (below)
        "bench":     (2048, 16, 128, 16, 2, 1024, 8192),  # Llama-2-7B attention, small MLP
        # The serving benchmark's default: shaped like a served model (Llama-3-8B
        # scaled down: GQA 4:1, head_dim 128, MLP 3.5x hidden), so attention's
        # share of a step is not inflated.
        "bench-gqa": (2048, 16, 128, 4, 4, 7168, 16384),
    }.items()
}

# Attention beyond plain causal, as config.json keys vLLM's Llama reads: an
# 80-token window (not a whole number of chunks) on the first layer, global
# attention on the second, as Gemma 2 / gpt-oss interleave them.
# "tiny-gemma2" is vLLM's Gemma 2 implementation (its norms, tied embeddings
# and scaling) with that interleaving and logits soft-capping; its cap of 2 is
# far below Gemma 2's 50 so that it changes these small random scores.
ATTENTION_VARIANTS: dict[str, dict] = {
    "tiny-window": {"sliding_window": 80, "layer_types": ["sliding_attention", "full_attention"]},
    "tiny-gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "sliding_window": 80,
                    "layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 2.0,
                    "final_logit_softcapping": None, "query_pre_attn_scalar": 64,
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
}

# What the benchmarks' --model-name choices are, for their help texts.
BENCH_MODELS = {
    "bench-gqa": "Llama-3-8B's shape scaled down: GQA 4:1, MLP 3.5x hidden, 4 layers",
    "bench": "MHA, 2 layers, small MLP: attention is a larger share of a step",
    "tiny": "the test model, for quick runs",
}


def add_model_arguments(parser, default: str) -> None:
    """--model and --model-name for a benchmark whose generated model defaults to `default`."""
    parser.add_argument("--model", help="model directory (default: the generated model --model-name)")
    parser.add_argument("--model-name", choices=list(BENCH_MODELS),
                        help="generated model (vllm_chunkattn/testing/models.py) when --model is not given; "
                        + "; ".join(f"{name}{' (default)' if name == default else ''}: {what}"
                                    for name, what in BENCH_MODELS.items())
                        + "; --quick runs tiny")


MAX_VOCAB = 2000  # upper bound: the corpus runs out of merges at 1695 tokens
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>", "<pad>"]  # ids 0..3, in this order
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Init scales: embedding std, then gains in units of 1/sqrt(fan_in). With the
# HF default (std 0.02 everywhere) attention is near-uniform and contributes
# almost nothing, so changing the start of a 300-token prompt never changed
# the greedy continuation, i.e. an attention bug could go unnoticed. Large q/k
# make attention peaky and content-dependent (any token, however far back, can
# dominate a head), large v/o let attention outweigh the residual embedding,
# and a large lm_head spreads logits (std ~4) so argmax follows the context.
EMBED_STD = 1.0
QK_GAIN = 3.0
VO_GAIN = 2.0
MLP_GAIN = 1.0
LM_HEAD_GAIN = 4.0

_SUBJECTS = ("the old man|a young girl|my neighbor|the teacher|our captain|"
             "the small dog|a tired traveler|the engineer|her brother|the king|"
             "every student|the baker|a quiet child|the doctor|his mother|"
             "the farmer|a stranger|the pilot|the queen|their friend").split("|")
_VERBS = ("walked to|looked at|talked about|wrote a letter to|dreamed of|"
          "ran toward|painted|carried|remembered|forgot|visited|built|"
          "searched for|sang about|watched|cleaned|opened|closed|found|"
          "followed|climbed|crossed|borrowed|returned|described").split("|")
_OBJECTS = ("the river|a red house|the mountain|an empty station|the garden|"
            "a wooden bridge|the market|a broken clock|the library|the ocean|"
            "a yellow boat|the forest|the castle|a cold kitchen|the village|"
            "the window|a long road|the desert|an old piano|the harbor|"
            "the system|a computer|the server|a small machine|the network").split("|")
_TAILS = ("in the morning|after the rain|before dinner|at midnight|"
          "on a sunny day|during the long winter|without a word|"
          "with great care|because it was late|while the birds sang|"
          "for the first time|again and again|as the sun went down|"
          "and then smiled|but nobody noticed|so everyone cheered").split("|")
_OPENERS = ["Once upon a time,", "Yesterday", "Later that year", "Suddenly",
            "In the end", "Long ago", "Every summer", "Perhaps", "Meanwhile",
            "The system prompt says that", "According to the report,",
            "Please note that", "Question: why", "Answer:", "Hello! Today"]

# A little real prose so the vocabulary holds common English words rather
# than mostly digit strings (the templated sentences alone are too narrow).
_PROSE = """\
The harbor town woke slowly. Fishermen pulled their nets from the grey water
while gulls argued over scraps, and a bakery on the corner filled the street
with the smell of warm bread. Nobody there had ever seen a computer, yet the
old lighthouse keeper kept careful notes of every ship, every storm and every
strange light that appeared over the sea. She believed that patience was the
most valuable tool a person could own, more useful than money or luck.
Scientists measure the world in numbers, but writers measure it in stories.
A good explanation should be simple enough for a child and precise enough for
an expert. When you cannot understand a problem, divide it into smaller pieces,
solve each piece, and check whether the answers still agree with each other.
Memory is expensive, so engineers share whatever they can: two requests that
begin with the same instructions may reuse the same cached computation, which
saves both time and energy. Questions remain, of course. How large should each
chunk be? What happens when thousands of users arrive at once? Which parts of
the work can run in parallel, and which must wait for the others to finish?
In spring the valley turns green, rivers swell with melted snow, and farmers
hurry to plant barley, potatoes, beans and onions before the summer heat.
Children play football in the square until their parents call them home for
supper; afterwards grandmother tells the same legend about the dragon beneath
the mountain, and everyone pretends they have never heard it before.
Thank you for your message. I would be happy to help you plan the journey,
compare prices, reserve a hotel room, or translate a short letter. Please tell
me which city you would like to visit, how many people are travelling, and
whether you prefer trains, buses, or flying. Remember to bring a passport, a
warm jacket, comfortable shoes, an umbrella and a little patience.
Ancient libraries preserved manuscripts about astronomy, medicine, geometry,
music, agriculture, philosophy and law; scholars copied them by candlelight.
My favourite recipe needs flour, sugar, butter, eggs, vanilla, cinnamon, honey,
lemons and a pinch of salt. Mix gently, bake for forty minutes, then cool.
The orchestra rehearsed a difficult symphony: violins, cellos, trumpets, flutes,
drums and a nervous young pianist who practised quietly every single evening.
Weather report: cloudy mornings, scattered showers, strong northern winds, and
temperatures falling below freezing overnight across the eastern provinces.
The committee discussed budgets, salaries, elections, hospitals, schools, roads
and electricity, but postponed every decision until the following Thursday.
Monday, Tuesday, Wednesday, Friday, Saturday and Sunday; January, February,
March, April, May, June, July, August, September, October, November, December.
Colours: purple, orange, silver, golden, crimson, turquoise, violet and brown.
Animals: elephant, tiger, rabbit, horse, monkey, penguin, whale, spider, eagle.
To install the software, download the package, verify its signature, extract
the archive, run the configuration script, and restart the service carefully.
Error: connection refused. Retrying in five seconds. Warning: disk almost full.
Justice, freedom, honesty, courage, kindness and curiosity are human virtues
that philosophers have debated since the earliest civilizations began writing.
"""


def _corpus(n_sentences: int = 6000, seed: int = 0) -> list[str]:
    """Deterministic, varied English-like sentences (plus numbers/punctuation)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        s = (f"{rng.choice(_OPENERS)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
             f"{rng.choice(_OBJECTS)} {rng.choice(_TAILS)}")
        if rng.random() < 0.1:
            s += f", and paid {rng.randint(1, 99)} coins on day {rng.randint(1, 31)}"
        s += rng.choice([".", ".", "!", "?", "...", "; it was true."])
        lines.append(s[0].upper() + s[1:])
    return lines + _PROSE.splitlines() * 20


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MAX_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
        # Every byte is in the vocab, so no input ever maps to <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Prepend <s> like Llama tokenizers do, so plain prompts start with BOS.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    return tok


def _build_weights(spec: dict, vocab: int, seed: int, variant: dict) -> dict:
    import numpy as np

    gemma = variant.get("model_type") == "gemma2"  # norms scale by 1 + weight; two more per layer; tied lm_head

    rng = np.random.default_rng(seed)

    def rand(rows: int, cols: int, gain: float) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(gain / cols ** 0.5)

    h, inter = spec["hidden_size"], spec["intermediate_size"]
    q_out = spec["num_attention_heads"] * spec["head_dim"]
    kv_out = spec["num_key_value_heads"] * spec["head_dim"]
    ones = np.zeros(h, dtype=np.float32) if gemma else np.ones(h, dtype=np.float32)
    w = {"model.embed_tokens.weight": rand(vocab, h, EMBED_STD * h ** 0.5)}  # std EMBED_STD
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones
        w[p + "post_attention_layernorm.weight"] = ones
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = ones
            w[p + "post_feedforward_layernorm.weight"] = ones
        w[p + "self_attn.q_proj.weight"] = rand(q_out, h, QK_GAIN)
        w[p + "self_attn.k_proj.weight"] = rand(kv_out, h, QK_GAIN)
        w[p + "self_attn.v_proj.weight"] = rand(kv_out, h, VO_GAIN)
        w[p + "self_attn.o_proj.weight"] = rand(h, q_out, VO_GAIN)
        w[p + "mlp.gate_proj.weight"] = rand(inter, h, MLP_GAIN)
        w[p + "mlp.up_proj.weight"] = rand(inter, h, MLP_GAIN)
        w[p + "mlp.down_proj.weight"] = rand(h, inter, MLP_GAIN)
    w["model.norm.weight"] = ones
    lm_head = rand(vocab, h, LM_HEAD_GAIN)
    # Zero logits for special tokens: random logits have std ~LM_HEAD_GAIN, so
    # the max over the vocab is far above 0 and greedy decoding never emits
    # EOS/PAD early; generations always run to max_tokens.
    lm_head[: len(SPECIAL_TOKENS)] = 0.0
    if gemma:  # the logits come from the embeddings: zero the special tokens' rows there
        w["model.embed_tokens.weight"][: len(SPECIAL_TOKENS)] = 0.0
    else:
        w["lm_head.weight"] = lm_head
    return w


def _hf_files(spec: dict, vocab: int, variant: dict) -> dict[str, dict]:
    """config / generation_config / tokenizer_config, written by hand so that
    generating a model needs neither torch nor transformers (and the files do
    not depend on which transformers version happens to be installed)."""
    ids = dict(bos_token_id=0, eos_token_id=1, pad_token_id=3)
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", **spec,
        vocab_size=vocab, hidden_act="silu", rms_norm_eps=1e-5,
        # Both spellings: transformers >= 5 reads rope_parameters, 4.x rope_theta.
        rope_theta=10000.0, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        initializer_range=0.02, use_cache=True, torch_dtype="float32", **ids)
    config.update(variant)
    tokenizer_config = dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", pad_token="<pad>", model_max_length=1 << 20,
        clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE)
    return {"config.json": config, "generation_config.json": ids,
            "tokenizer_config.json": tokenizer_config}


def _cache_key(name: str) -> str:
    # Hash every input, so editing a spec, a gain or the corpus also
    # invalidates the cache without remembering to bump GENERATOR_VERSION.
    blob = json.dumps([GENERATOR_VERSION, SPECS[name], ATTENTION_VARIANTS.get(name), MAX_VOCAB, EMBED_STD,
                       QK_GAIN, VO_GAIN, MLP_GAIN, LM_HEAD_GAIN, SPECIAL_TOKENS,
                       CHAT_TEMPLATE, _corpus()], sort_keys=True)
    return f"{name}-g{GENERATOR_VERSION}-{hashlib.sha1(blob.encode()).hexdigest()[:8]}"


def default_root() -> Path:
    if env := os.environ.get("VLLM_CHUNKATTN_MODEL_DIR"):
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file():  # running from a source checkout
        return repo / ".models"
    return Path.home() / ".cache" / "vllm_chunkattn" / "models"


def ensure_model(name: str = "tiny", root: str | None = None) -> str:
    """Return the path of model ``name``, generating it on first use."""
    if name not in SPECS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(SPECS)}")
    root_dir = Path(root).expanduser() if root else default_root()
    final = root_dir / _cache_key(name)
    if final.is_dir():  # only ever created by an atomic rename, so complete
        return str(final)

    from safetensors.numpy import save_file

    root_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root_dir))
    try:
        tok = _build_tokenizer()
        tok.save(str(tmp / "tokenizer.json"))
        vocab = tok.get_vocab_size()
        for fname, content in _hf_files(SPECS[name], vocab, ATTENTION_VARIANTS.get(name, {})).items():
            (tmp / fname).write_text(json.dumps(content, indent=2) + "\n")
        # A fixed seed per name: same files on every machine and every run.
        seed = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)
        save_file(_build_weights(SPECS[name], vocab, seed, ATTENTION_VARIANTS.get(name, {})),
                  str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # mkdtemp (and safetensors) create private files; the cache may be shared.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race with a concurrent builder
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m vllm_chunkattn.testing.models",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=["tiny"], metavar="NAME",
                    help=f"models to build (default: tiny); one of {', '.join(SPECS)}")
    ap.add_argument("--root", help="cache directory (default: $VLLM_CHUNKATTN_MODEL_DIR, "
                    "else <checkout>/.models, else ~/.cache/vllm_chunkattn/models)")
    args = ap.parse_args(argv)
    for name in args.names:
        if name not in SPECS:
            ap.error(f"unknown model {name!r}; known: {', '.join(SPECS)}")
        print(ensure_model(name, args.root))


if __name__ == "__main__":
    main()
