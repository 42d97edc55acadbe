"""vLLM general-plugin entry point: makes `--attention-backend chunk` select
our backend, `"kv_connector": "PensieveConnector"` our KV connector, and
`"eviction_policy": "pensieve"` our policy for vLLM's OffloadingConnector, in
every process vLLM starts (API server, engine core, workers).

Why `CUSTOM` and not a new enum member: vLLM pickles its config (which holds
the selected `AttentionBackendEnum` member) before the engine-core process
loads plugins. A member created at run time unpickles by value and fails
there; `CUSTOM` is a static member, so it round-trips. We register our class
as CUSTOM's implementation and add `CHUNK` as an alias name of that member,
so the name users type parses to it.
"""

from __future__ import annotations

import logging

from vllm_chunkattn import BACKEND_NAME
from vllm_chunkattn.metrics import init_metrics_dir

BACKEND_CLASS = "vllm_chunkattn.backend.chunk_backend.ChunkAttentionBackend"

# Under "vllm.": vLLM configures handlers for its own logger hierarchy only
# (lazily, at engine start), so a logger outside it would print nothing at INFO.
logger = logging.getLogger("vllm.chunkattn")


def register() -> None:
    from vllm.v1.attention.backends.registry import (
        _ATTN_OVERRIDES,
        AttentionBackendEnum,
        register_backend,
    )

    custom = AttentionBackendEnum.CUSTOM
    taken_by = _ATTN_OVERRIDES.get(custom)
    if taken_by not in (None, BACKEND_CLASS):
        raise RuntimeError(
            f"vllm-chunkattn cannot register its attention backend: another plugin "
            f"already registered {taken_by} as the CUSTOM attention backend"
        )
    register_backend(custom, BACKEND_CLASS)
    AttentionBackendEnum._member_map_.setdefault(BACKEND_NAME, custom)
    _register_kv_connector()
    _warn_if_cpu_platform_unpatched()
    # Where the workers' prefix-tree series go, for this process's /metrics.
    init_metrics_dir()


def _register_kv_connector() -> None:
    """`--kv-transfer-config '{"kv_connector": "PensieveConnector", ...}'`, and Pensieve's policy for
    vLLM's OffloadingConnector, `"eviction_policy": "pensieve"` (vllm_chunkattn/cache)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_chunkattn.cache import CONNECTOR_CLASS, CONNECTOR_NAME, offload_policy

    if CONNECTOR_NAME not in KVConnectorFactory._registry:  # register_connector raises on a second call
        module, _, class_name = CONNECTOR_CLASS.rpartition(".")
        KVConnectorFactory.register_connector(CONNECTOR_NAME, module, class_name)
    offload_policy.register()


def _warn_if_cpu_platform_unpatched() -> None:
    # Unpatched, vLLM's CPU platform silently falls back to CPU_ATTN when
    # `chunk` is selected, and a seeded request kills the engine on its first
    # chunked prefill step; say so loudly instead of letting it pass.
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import importlib.util

    # String checks on the sources, not `patch --dry-run` nor an import of the
    # (heavy) model runner: this runs in every vLLM process.
    marks = {"vllm.platforms.cpu": "selected_backend.is_overridden()",
             "vllm.v1.worker.gpu_model_runner": "_discarded_cpu_generator_states"}
    unpatched = []
    for module, mark in marks.items():
        path = importlib.util.find_spec(module).origin
        with open(path) as f:
            if mark not in f.read():
                unpatched.append(module)
    if unpatched:
        logger.warning(
            "vllm-chunkattn: the installed vLLM is not patched (%s), so on CPU "
            "`--attention-backend chunk` may fall back to CPU_ATTN and seeded requests "
            "may stop the engine. Run `python -m vllm_chunkattn.install.patching apply` "
            "once in this environment.", ", ".join(unpatched)
        )
