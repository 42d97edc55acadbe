"""Offline, deterministic toy Llama models for tests, demos and benchmarks.

No model hub is reachable where this project is tested, so every model is
generated locally: a byte-level BPE tokenizer trained on a synthetic English
corpus plus random (but carefully scaled) Llama weights, or weights for one of
the other vLLM model implementations in ATTENTION_VARIANTS. Results are cached on
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
GENERATOR_VERSION = 2

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
        "tiny-gemma3": (256, 4, 64, 2, 2, 512, 4096),   # vLLM's Gemma 3: window, q/k norms, two rope thetas
        "tiny-mistral": (256, 4, 64, 2, 2, 512, 4096),  # tiny as Mistral: a window on every layer
        "tiny-bloom": (256, 4, 64, 4, 2, 1024, 4096),   # vLLM's BLOOM: ALiBi, MHA (its MLP is 4x hidden)
        "tiny-gptoss": (256, 4, 64, 2, 2, 256, 4096),   # vLLM's gpt-oss: sinks, window, MoE (4 experts, top 2)
        "tiny-repeats": (256, 4, 64, 2, 2, 512, 4096),  # tiny, tied embeddings: greedy output repeats at times
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
# The other entries are further vLLM model implementations, each for the
# attention it brings: Gemma 3 (q/k norms, a rope theta per layer type),
# Mistral (with no layer_types vLLM gives every layer the window), BLOOM
# (ALiBi slopes instead of rope) and gpt-oss (a learned sink logit per head,
# the window on even layers as vLLM hard-codes it, YaRN rope, MoE MLP).
ATTENTION_VARIANTS: dict[str, dict] = {
    "tiny-window": {"sliding_window": 80, "layer_types": ["sliding_attention", "full_attention"]},
    "tiny-gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "sliding_window": 80,
                    "layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 2.0,
                    "final_logit_softcapping": None, "query_pre_attn_scalar": 64,
                    "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    "tiny-gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "sliding_window": 80,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                    # transformers 4.x spells the two thetas so
                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "query_pre_attn_scalar": 64, "hidden_activation": "gelu_pytorch_tanh",
                    "tie_word_embeddings": True},
    "tiny-mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 80},
    "tiny-bloom": {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "layer_norm_epsilon": 1e-5,
                   "apply_residual_connection_post_layernorm": False, "tie_word_embeddings": True},
    # Not an attention variant: the speculative-decoding test's model (TIED_REPEAT_EMBED_STD below).
    "tiny-repeats": {"tie_word_embeddings": True},
    "tiny-gptoss": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "sliding_window": 80,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "num_local_experts": 4, "num_experts_per_tok": 2, "attention_bias": True,
                    "swiglu_limit": 7.0,
                    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                        "original_max_position_embeddings": 4096}},
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
# "tiny-repeats": Llama with tied embeddings of this std (no TIED_EMBED_RMS
# scaling). A token's own embedding then often outscores the context, so
# greedy output repeats a token or a short run now and then, and n-gram
# speculative decoding gets some drafts accepted (a quarter of the draft
# tokens on the shared-prefix workload) and others rejected, while attention
# still moves the logprobs. Larger stds repeat one token forever.
TIED_REPEAT_EMBED_STD = 0.5

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
    """Random weights named and shaped as the variant's model type's HF
    checkpoints are (what vLLM's load_weights for it reads)."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def rand(rows: int, cols: int, gain: float) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(gain / cols ** 0.5)

    build = {"bloom": _bloom_weights, "gpt_oss": _gptoss_weights}.get(variant.get("model_type"), _llama_weights)
    return build(spec, vocab, variant, rng, rand)


def _no_special_logits(out_embedding) -> None:
    """Zero logits for special tokens: random logits have std ~LM_HEAD_GAIN, so
    the max over the vocab is far above 0 and greedy decoding never emits
    EOS/PAD early; generations always run to max_tokens. With tied embeddings
    the output embedding is the input one, so those tokens also embed to zero
    (harmless: every norm here has an epsilon)."""
    out_embedding[: len(SPECIAL_TOKENS)] = 0.0


# Tied embeddings: a token's logit is its embedding's dot product with the
# final hidden state, which holds the current token's own embedding (the
# residual stream starts with it). With that embedding as large as attention's
# share, the current token outscores the rest and greedy output repeats it.
# So the tied models scale their embeddings into the residual stream to
# EMBED_STD / LM_HEAD_GAIN, and scale the logits' side (Gemma's final norm,
# BLOOM's raw embeddings, which a LayerNorm takes into the stream) to keep
# logits at std ~LM_HEAD_GAIN.
TIED_EMBED_RMS = EMBED_STD / LM_HEAD_GAIN


def _llama_weights(spec: dict, vocab: int, variant: dict, rng, rand) -> dict:
    """Llama, Mistral, Gemma 2 and Gemma 3 (norms scale by 1 + weight, two more
    norms per layer, tied lm_head; Gemma 3 also RMS-normalizes q and k)."""
    import numpy as np

    model_type = variant.get("model_type", "llama")
    gemma = model_type in ("gemma2", "gemma3_text")
    gemma3 = model_type == "gemma3_text"
    h, inter, head_dim = spec["hidden_size"], spec["intermediate_size"], spec["head_dim"]
    q_out = spec["num_attention_heads"] * head_dim
    kv_out = spec["num_key_value_heads"] * head_dim

    def norm(gain: float, n: int = h) -> np.ndarray:  # a norm's weight scaling by `gain`
        return np.full(n, gain - 1.0 if gemma else gain, dtype=np.float32)

    ones = norm(1.0)
    tied_llama = variant.get("tie_word_embeddings", False) and not gemma
    # Gemma multiplies embeddings by sqrt(hidden) on the way in.
    embed_std = TIED_EMBED_RMS / h ** 0.5 if gemma else TIED_REPEAT_EMBED_STD if tied_llama else EMBED_STD
    w = {"model.embed_tokens.weight": rand(vocab, h, embed_std * h ** 0.5)}  # std embed_std
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones
        # Gemma's post-norms take attention's and the MLP's outputs to rms 1;
        # these scale them back to what Llama's are with these gains.
        w[p + "post_attention_layernorm.weight"] = norm(VO_GAIN ** 2) if gemma else ones
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = ones
            w[p + "post_feedforward_layernorm.weight"] = norm(MLP_GAIN ** 2)
        if gemma3:
            # q and k are normalized to rms 1 per head, which would undo QK_GAIN
            # (and leave attention near-uniform): their norms put it back.
            w[p + "self_attn.q_norm.weight"] = norm(QK_GAIN, head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(QK_GAIN, head_dim)
        w[p + "self_attn.q_proj.weight"] = rand(q_out, h, QK_GAIN)
        w[p + "self_attn.k_proj.weight"] = rand(kv_out, h, QK_GAIN)
        w[p + "self_attn.v_proj.weight"] = rand(kv_out, h, VO_GAIN)
        w[p + "self_attn.o_proj.weight"] = rand(h, q_out, VO_GAIN)
        w[p + "mlp.gate_proj.weight"] = rand(inter, h, MLP_GAIN)
        w[p + "mlp.up_proj.weight"] = rand(inter, h, MLP_GAIN)
        w[p + "mlp.down_proj.weight"] = rand(h, inter, MLP_GAIN)
    # Gemma's logits: final hidden state (rms: this gain) . embedding (std embed_std).
    w["model.norm.weight"] = norm(LM_HEAD_GAIN / (embed_std * h ** 0.5)) if gemma else ones
    lm_head = rand(vocab, h, LM_HEAD_GAIN)  # drawn even when tied, so later draws stay put
    if gemma or tied_llama:  # vLLM would load an lm_head.weight into the tied embedding
        _no_special_logits(w["model.embed_tokens.weight"])
    else:
        _no_special_logits(lm_head)
        w["lm_head.weight"] = lm_head
    return w


def _bloom_weights(spec: dict, vocab: int, variant: dict, rng, rand) -> dict:
    """BLOOM: LayerNorms with biases (also one on the embeddings), a fused qkv
    with biases, a plain GELU MLP of 4x hidden, lm_head tied to the embeddings."""
    import numpy as np

    h, heads, head_dim = spec["hidden_size"], spec["num_attention_heads"], spec["head_dim"]
    assert heads * head_dim == h and spec["intermediate_size"] == 4 * h, "BLOOM derives both from hidden_size"
    zeros = lambda n: np.zeros(n, dtype=np.float32)  # noqa: E731

    def ln(gain: float = 1.0) -> dict:
        return {"weight": np.full(h, gain, dtype=np.float32), "bias": zeros(h)}

    # The embeddings are drawn as an lm_head (logits std ~LM_HEAD_GAIN with a
    # unit ln_f); a LayerNorm takes them into the residual stream, at
    # TIED_EMBED_RMS.
    w = {"transformer.word_embeddings.weight": rand(vocab, h, LM_HEAD_GAIN)}
    w.update({f"transformer.word_embeddings_layernorm.{k}": v for k, v in ln(TIED_EMBED_RMS).items()})
    for i in range(spec["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        # HF's fused qkv rows are per head: (heads, q/k/v, head_dim); vLLM regroups them.
        q, k, v = (rand(h, h, gain).reshape(heads, 1, head_dim, h) for gain in (QK_GAIN, QK_GAIN, VO_GAIN))
        w[p + "self_attention.query_key_value.weight"] = np.concatenate([q, k, v], axis=1).reshape(3 * h, h)
        w[p + "self_attention.query_key_value.bias"] = zeros(3 * h)
        w[p + "self_attention.dense.weight"] = rand(h, h, VO_GAIN)
        w[p + "self_attention.dense.bias"] = zeros(h)
        w[p + "mlp.dense_h_to_4h.weight"] = rand(4 * h, h, MLP_GAIN)
        w[p + "mlp.dense_h_to_4h.bias"] = zeros(4 * h)
        w[p + "mlp.dense_4h_to_h.weight"] = rand(h, 4 * h, MLP_GAIN)
        w[p + "mlp.dense_4h_to_h.bias"] = zeros(h)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w.update({f"{p}{norm}.{k}": v for k, v in ln().items()})
    w.update({f"transformer.ln_f.{k}": v for k, v in ln().items()})
    _no_special_logits(w["transformer.word_embeddings.weight"])
    return w


def _gptoss_weights(spec: dict, vocab: int, variant: dict, rng, rand) -> dict:
    """gpt-oss, unquantized: attention with biases and a sink logit per head;
    a routed MoE whose experts are stacked as (in, out) matrices, gate and up
    fused (HF interleaves their columns; random weights need not care)."""
    import numpy as np

    h, inter, head_dim = spec["hidden_size"], spec["intermediate_size"], spec["head_dim"]
    heads, experts = spec["num_attention_heads"], variant["num_local_experts"]
    q_out, kv_out = heads * head_dim, spec["num_key_value_heads"] * head_dim
    ones = np.ones(h, dtype=np.float32)
    zeros = lambda *shape: np.zeros(shape, dtype=np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": rand(vocab, h, EMBED_STD * h ** 0.5)}
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones
        w[p + "post_attention_layernorm.weight"] = ones
        for proj, rows, cols, gain in (("q", q_out, h, QK_GAIN), ("k", kv_out, h, QK_GAIN),
                                       ("v", kv_out, h, VO_GAIN), ("o", h, q_out, VO_GAIN)):
            w[p + f"self_attn.{proj}_proj.weight"] = rand(rows, cols, gain)
            w[p + f"self_attn.{proj}_proj.bias"] = zeros(rows)
        # A sink is one more logit in each head's softmax, with no value; it
        # takes a share of the weight only if it is near the logsumexp of the
        # q.k logits. Those have std ~QK_GAIN**2 (more with YaRN's scaling),
        # their logsumexp over a few hundred keys ~4x that: sinks around it
        # take none, part or all of a head's weight depending on the query.
        w[p + "self_attn.sinks"] = (4.0 + rng.standard_normal(heads, dtype=np.float32)) * np.float32(QK_GAIN ** 2)
        w[p + "mlp.router.weight"] = rand(experts, h, MLP_GAIN)
        w[p + "mlp.router.bias"] = zeros(experts)
        w[p + "mlp.experts.gate_up_proj"] = np.stack([rand(2 * inter, h, MLP_GAIN).T for _ in range(experts)])
        w[p + "mlp.experts.gate_up_proj_bias"] = zeros(experts, 2 * inter)
        w[p + "mlp.experts.down_proj"] = np.stack([rand(h, inter, MLP_GAIN).T for _ in range(experts)])
        w[p + "mlp.experts.down_proj_bias"] = zeros(experts, h)
    w["model.norm.weight"] = ones
    w["lm_head.weight"] = rand(vocab, h, LM_HEAD_GAIN)
    _no_special_logits(w["lm_head.weight"])
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
                       QK_GAIN, VO_GAIN, MLP_GAIN, LM_HEAD_GAIN, TIED_REPEAT_EMBED_STD, SPECIAL_TOKENS,
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
