"""The PensieveConnector's parts that run without an engine: its options, the
chain keys, and the worker's copies between vLLM's KV cache and host rows."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_chunkattn.cache.connector import BlockCopy, PensieveConfig, PensieveMetadata, _Worker, chain_keys


def test_options_are_validated_with_what_is_supported():
    assert PensieveConfig.from_extra_config({}) == PensieveConfig()
    assert PensieveConfig.from_extra_config({"host_cache_gib": 0.5, "eviction_policy": "lru"}).host_blocks(1 << 20) == 512
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys \\['disk'\\]"):
        PensieveConfig.from_extra_config({"disk": "/tmp"})
    with pytest.raises(ValueError, match="eviction_policy must be one of \\['lru', 'pensieve'\\]"):
        PensieveConfig.from_extra_config({"eviction_policy": "fifo"})
    with pytest.raises(ValueError, match="positive number of GiB"):
        PensieveConfig.from_extra_config({"host_cache_gib": 0})


def test_chain_keys_name_whole_prefixes_and_extend_incrementally():
    tokens = list(range(100, 200))
    keys = chain_keys(tokens, 16)
    assert len(keys) == 6  # full blocks only
    assert chain_keys(tokens[:40], 16) == keys[:2]
    assert chain_keys(tokens, 16, start=2, parent=keys[1]) == keys[2:]
    other = chain_keys([7] + tokens[1:], 16)
    assert all(a != b for a, b in zip(keys, other))  # a different first token changes every later key


def _worker(num_blocks=6, host_gib=1e-3):
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(model="m"),
                                   cache_config=types.SimpleNamespace(block_size=4))
    worker = _Worker(PensieveConfig(host_cache_gib=host_gib), config)
    g = torch.Generator().manual_seed(0)
    # Two layers of different dtypes and shapes, blocks first, as vLLM hands them over.
    caches = {"layer0": torch.randn(num_blocks, 2, 4, 16, generator=g),
              "layer1": torch.randn(num_blocks, 4, 8, generator=g).to(torch.bfloat16)}
    block_bytes = sum(kv[0].numel() * kv.element_size() for kv in caches.values())
    worker.register_kv_caches(caches, num_blocks, block_bytes)
    return worker, caches


def test_blocks_go_to_host_rows_and_come_back_into_other_blocks():
    worker, caches = _worker()
    original = {name: kv.clone() for name, kv in caches.items()}
    worker.meta = PensieveMetadata(stores=[BlockCopy(b"a", 1), BlockCopy(b"b", 4)], finished_after_store=["r1"])
    worker.run_step()
    assert worker.get_finished({"r0"}) is None and worker.get_finished({"r1"}) == {"r1"}
    # Evict a, store c from block 2, load b into block 0 and c into block 5, in one step.
    worker.meta = PensieveMetadata(evictions=[b"a"], stores=[BlockCopy(b"c", 2)],
                                   loads=[BlockCopy(b"b", 0), BlockCopy(b"c", 5)])
    worker.run_step()
    for name, kv in caches.items():
        assert torch.equal(kv[0], original[name][4]) and torch.equal(kv[5], original[name][2])
        assert torch.equal(kv[1:5], original[name][1:5])
    assert b"a" not in worker.store and len(worker.store) == 2


def test_a_cache_whose_blocks_are_not_the_first_dimension_is_refused():
    worker, _ = _worker()
    with pytest.raises(ValueError, match="blocks must be its first dimension"):
        worker.register_kv_caches({"layer0": torch.zeros(2, 6, 4, 16)}, 6, 2 * 4 * 16 * 4)
