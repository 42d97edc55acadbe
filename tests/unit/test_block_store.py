"""The tiers' block stores (cache/block_store.py): round trips, and every way a
block on disk can be bad is reported instead of returned."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os

import pytest
import torch

from vllm_chunkattn.cache.block_store import BadBlock, BlockLayout, DiskStore, HostStore

LAYOUT = BlockLayout(model="test-model", block_size=4,
                     layers=(("float32", (2, 4, 2, 8)), ("float32", (2, 4, 2, 8))))


def key(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def block(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8, generator=g)


def test_layout_sizes_and_fingerprint():
    assert LAYOUT.block_bytes == 2 * 4 * (2 * 4 * 2 * 8)
    assert LAYOUT.fingerprint() != dataclasses.replace(
        LAYOUT, layers=(("bfloat16", (2, 4, 2, 8)), ("float32", (2, 4, 2, 8)))).fingerprint()
    assert LAYOUT.fingerprint() != dataclasses.replace(LAYOUT, model="other").fingerprint()


def test_host_store_round_trip_and_capacity():
    store = HostStore(LAYOUT, capacity_blocks=2)
    store.put(key("a")).copy_(block(1))
    store.put(key("b")).copy_(block(2))
    assert store.free_blocks == 0
    with pytest.raises(RuntimeError, match="full"):
        store.put(key("c"))
    assert torch.equal(store.get(key("a")), block(1))
    store.drop(key("a"))
    store.put(key("c")).copy_(block(3))
    assert torch.equal(store.get(key("c")), block(3)) and torch.equal(store.get(key("b")), block(2))
    with pytest.raises(BadBlock):
        store.get(key("a"))


def test_disk_store_round_trip_and_scan_after_restart(tmp_path):
    store = DiskStore(tmp_path, LAYOUT)
    store.write(key("a"), None, block(1))
    store.write(key("b"), key("a"), block(2))
    restarted = DiskStore(tmp_path, LAYOUT)
    entries = {e.key: e.parent for e in restarted.scan()}
    assert entries == {key("a"): None, key("b"): key("a")}
    out = torch.empty(LAYOUT.block_bytes, dtype=torch.uint8)
    restarted.read_into(key("b"), out)
    assert torch.equal(out, block(2))


def _corrupt_data(path):
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-5])


def _header_only(path):
    path.write_bytes(path.read_bytes()[:20])


@pytest.mark.parametrize("damage, message", [
    (_corrupt_data, "checksum"),
    (_truncate, "bytes of data"),
    (_header_only, "shorter than a block header"),
    (os.unlink, "cannot read"),
])
def test_a_damaged_block_is_reported_not_returned(tmp_path, damage, message):
    store = DiskStore(tmp_path, LAYOUT)
    store.write(key("a"), None, block(1))
    damage(store.path(key("a")))
    out = torch.zeros(LAYOUT.block_bytes, dtype=torch.uint8)
    with pytest.raises(BadBlock, match=message):
        store.read_into(key("a"), out)
    assert not out.any()


def test_another_layouts_or_blocks_file_is_refused(tmp_path):
    ours = DiskStore(tmp_path, LAYOUT)
    foreign = DiskStore(tmp_path, dataclasses.replace(LAYOUT, model="another-model"))
    assert foreign.directory != ours.directory
    foreign.write(key("a"), None, block(1))
    os.replace(foreign.path(key("a")), ours.path(key("a")))
    out = torch.empty(LAYOUT.block_bytes, dtype=torch.uint8)
    with pytest.raises(BadBlock, match="another model"):
        ours.read_into(key("a"), out)
    assert list(ours.scan()) == []
    ours.write(key("b"), None, block(2))
    os.replace(ours.path(key("b")), ours.path(key("c")))
    with pytest.raises(BadBlock, match="another block"):
        ours.read_into(key("c"), out)


def test_a_full_disk_leaves_no_partial_file(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, LAYOUT)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError):
        store.write(key("a"), None, block(1))
    assert list(store.directory.iterdir()) == []
