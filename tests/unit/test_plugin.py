"""Backend registration, selection by name, and refusal of unsupported configurations."""

from __future__ import annotations

import importlib.metadata
import pickle
import subprocess
import sys

import pytest
import torch
from vllm.config.attention import AttentionConfig
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

from vllm_chunkattn.backend import ChunkAttentionBackend, ChunkAttentionImpl
from vllm_chunkattn.plugin import register


@pytest.fixture(autouse=True, scope="module")
def registered():
    register()


def test_entry_point_is_declared():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert names.get("chunk_attention") == "vllm_chunkattn.plugin:register"


@pytest.mark.parametrize("spelling", ["chunk", "CHUNK", "Chunk"])
def test_chunk_selects_our_backend(spelling):
    backend = AttentionConfig(backend=spelling).backend
    assert backend is AttentionBackendEnum.CUSTOM
    assert backend.get_class() is ChunkAttentionBackend


def test_our_log_lines_reach_vllms_handlers():
    import logging

    from vllm.logger import _configure_vllm_root_logger

    from vllm_chunkattn.backend.stats import logger

    _configure_vllm_root_logger()  # what vLLM does at engine start
    assert logger.isEnabledFor(logging.INFO)
    assert logger.name.startswith("vllm.")  # propagates to vLLM's handlers


def test_registering_twice_is_harmless():
    register()
    assert AttentionBackendEnum["CHUNK"].get_class() is ChunkAttentionBackend


def test_selection_unpickles_in_a_process_without_plugins():
    # vLLM pickles the config into the engine-core process before that process
    # loads plugins: the selected member must unpickle there.
    data = pickle.dumps(AttentionConfig(backend="chunk").backend)
    code = (
        "import pickle, sys; from vllm.v1.attention.backends.registry import AttentionBackendEnum as E; "
        "m = pickle.loads(sys.stdin.buffer.read()); assert m is E.CUSTOM, m; print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=120)
    assert done.stdout.strip() == b"ok", done.stderr.decode()[-2000:]


def test_stock_names_still_work():
    assert AttentionConfig(backend="CPU_ATTN").backend is AttentionBackendEnum.CPU_ATTN
    assert AttentionConfig(backend="auto").backend is None


# What vLLM passes (platforms/cuda.py and cpu.py): the selector config plus device_capability.
BASE = dict(AttentionSelectorConfig(head_size=128, dtype=torch.float32, kv_cache_dtype="auto", block_size=64)._asdict(),
            device_capability=None)


def test_supported_configuration_has_no_reasons():
    for head_size in (64, 128, 256):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for block_size in (32, 64, 128):
                cfg = {**BASE, "head_size": head_size, "dtype": dtype, "block_size": block_size}
                assert ChunkAttentionBackend.validate_configuration(**cfg) == []


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"head_size": 80}, "head size 80 (supported: 64, 128, 256)"),
        ({"block_size": 16}, "block size 16 (supported: 32, 64, 128)"),
        ({"dtype": torch.float64}, "dtype float64 (supported: float32, float16, bfloat16)"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype fp8 (supported: auto"),
        ({"use_mla": True}, "MLA (supported: causal decoder self-attention)"),
        ({"attn_type": "encoder_only"}, "attention type encoder_only (supported: decoder self-attention"),
        ({"attn_type": "encoder_decoder"}, "no encoder or cross attention"),
    ],
)
def test_unsupported_configuration_names_what_is_supported(change, expected):
    reasons = ChunkAttentionBackend.validate_configuration(**{**BASE, **change})
    assert len(reasons) == 1 and expected in reasons[0], reasons


IMPL = dict(num_heads=8, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None,
            sliding_window=None, kv_cache_dtype="auto")


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"attn_type": "encoder_decoder"}, "attention type encoder_decoder"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype fp8"),
        ({"head_size": 96}, "head size 96"),
    ],
)
def test_impl_refuses_unsupported_layers(change, expected):
    with pytest.raises(NotImplementedError, match="Supported: causal decoder") as err:
        ChunkAttentionImpl(**{**IMPL, **change})
    assert expected in str(err.value)


def test_sliding_window_is_accepted_on_cpu():
    assert ChunkAttentionBackend.supports_sliding_window()
    assert ChunkAttentionBackend.validate_configuration(**{**BASE, "has_sliding_window": True}) == []
    impl = ChunkAttentionImpl(**{**IMPL, "sliding_window": 256})
    assert impl.sliding_window == 256 and ChunkAttentionImpl(**IMPL).sliding_window == 0


def test_logits_soft_capping_is_accepted_on_cpu():
    assert ChunkAttentionImpl(**{**IMPL, "logits_soft_cap": 50.0}).logits_soft_cap == 50.0
    assert ChunkAttentionImpl(**IMPL).logits_soft_cap == 0.0


def test_sinks_and_alibi_are_accepted_on_cpu():
    assert ChunkAttentionBackend.supports_sink()
    assert ChunkAttentionBackend.validate_configuration(**{**BASE, "has_sink": True}) == []
    sinks = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16), requires_grad=False)
    impl = ChunkAttentionImpl(**{**IMPL, "sinks": sinks, "alibi_slopes": [0.5 ** h for h in range(8)]})
    assert impl.sinks is sinks  # the parameter itself: its weights are loaded after the impl is made
    assert impl.alibi_slopes.dtype == torch.float32 and impl.alibi_slopes.tolist() == [0.5 ** h for h in range(8)]
    assert ChunkAttentionImpl(**IMPL).sinks is None and ChunkAttentionImpl(**IMPL).alibi_slopes is None


def test_impl_accepts_gqa_and_mha():
    ChunkAttentionImpl(**IMPL)
    ChunkAttentionImpl(**{**IMPL, "num_kv_heads": 8})


@pytest.mark.parametrize(
    "argv",
    [["--attention-backend", "chunk"], ["--attention-config", '{"backend": "chunk"}']],
    ids=["attention-backend", "attention-config"],
)
def test_command_line_spellings_select_chunk(argv):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "m", *argv]))
    selected = args.attention_backend or args.attention_config.backend
    if isinstance(selected, str):
        selected = AttentionConfig(backend=selected).backend
    assert selected is AttentionBackendEnum.CUSTOM
