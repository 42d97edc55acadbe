"""Where a tier keeps KV block data: a host-memory pool and a directory on disk.

A stored block is one KV-cache block of every attention layer, packed into one
byte row (``BlockLayout``). Both stores are plain containers keyed by the
block's chain key (conversation_tree.py); which blocks they keep is the tree's
and the policy's business.

Every block on disk carries its chain key, its parent's key, the fingerprint
of the layout that wrote it (model, block size, the layers' dtypes and shapes) and
a checksum of its data. A block whose file is missing, short, corrupted or
written by another model or layout is reported as ``BadBlock``, never returned:
its tokens are recomputed instead. The headers let a restarted server rebuild
its index of the directory without reading the data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

BlockKey = bytes
KEY_BYTES = 32  # sha256 chain keys


class BadBlock(Exception):
    """A stored block that cannot be used; the reason is the message."""


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """What one stored block holds: one KV-cache block of each attention layer.

    `layers[i]` is layer i's (dtype name, shape of one block's data); the row
    is those tensors' bytes, in order. `model` names the weights and
    `kv_format` whatever else decides what the bytes mean (attention backend,
    platform, vLLM version): blocks written under another identity are never
    read back."""

    model: str
    block_size: int
    layers: tuple[tuple[str, tuple[int, ...]], ...]
    kv_format: str = ""

    @property
    def layer_bytes(self) -> list[int]:
        return [getattr(torch, dtype).itemsize * math.prod(shape) for dtype, shape in self.layers]

    @property
    def block_bytes(self) -> int:
        return sum(self.layer_bytes)

    def fingerprint(self) -> bytes:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).digest()


class HostStore:
    """A fixed pool of block rows in host memory, apart from vLLM's KV cache."""

    def __init__(self, layout: BlockLayout, capacity_blocks: int):
        if capacity_blocks < 1:
            raise ValueError(f"a host tier needs at least one block; got {capacity_blocks}")
        self.layout = layout
        self.capacity = capacity_blocks
        self.rows = torch.empty(capacity_blocks, layout.block_bytes, dtype=torch.uint8)
        self._slot_of: dict[BlockKey, int] = {}
        self._free = list(range(capacity_blocks - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._slot_of

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def put_slot(self, key: BlockKey) -> int:
        """The row index to write block `key` into (a new slot, or its old one)."""
        slot = self._slot_of.get(key)
        if slot is None:
            if not self._free:
                raise RuntimeError("host tier full: evict before storing")
            slot = self._slot_of[key] = self._free.pop()
        return slot

    def slot(self, key: BlockKey) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            raise BadBlock("not in the host tier")
        return slot

    def put(self, key: BlockKey) -> torch.Tensor:
        return self.rows[self.put_slot(key)]

    def get(self, key: BlockKey) -> torch.Tensor:
        return self.rows[self.slot(key)]

    def drop(self, key: BlockKey) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free.append(slot)


@dataclasses.dataclass(frozen=True)
class DiskEntry:
    key: BlockKey
    parent: BlockKey | None  # None: the first block of a prompt
    mtime: float


class DiskStore:
    """One file per block under `directory/<layout fingerprint>/`.

    File: header (magic, layout fingerprint, key, parent key, data length,
    blake2b of the data), then the data. Writes go to a temporary name and are
    renamed into place, so a crash never leaves a half-written block under a
    real name; readers check everything before returning data."""

    MAGIC = b"CHKVBLK1"
    _HEADER = struct.Struct(f"<8s32s{KEY_BYTES}s{KEY_BYTES}sQ16s")
    _NO_PARENT = b"\0" * KEY_BYTES

    def __init__(self, directory: str | os.PathLike, layout: BlockLayout):
        self.layout = layout
        self._fingerprint = layout.fingerprint()
        self.directory = Path(directory) / self._fingerprint.hex()[:16]
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # the writer thread and readers share the temp-name counter
        self._temp_counter = 0

    def path(self, key: BlockKey) -> Path:
        return self.directory / f"{key.hex()}.kv"

    def write(self, key: BlockKey, parent: BlockKey | None, data: torch.Tensor) -> None:
        """Stores one block's row (raises OSError when the disk is full; nothing is left behind then)."""
        payload = data.contiguous().view(torch.uint8).numpy().tobytes()
        if len(payload) != self.layout.block_bytes:
            raise ValueError(f"a block of this layout has {self.layout.block_bytes} bytes; got {len(payload)}")
        header = self._HEADER.pack(self.MAGIC, self._fingerprint, key, parent or self._NO_PARENT, len(payload),
                                   hashlib.blake2b(payload, digest_size=16).digest())
        with self._lock:
            self._temp_counter += 1
            temp = self.directory / f".{key.hex()}.{os.getpid()}.{self._temp_counter}.tmp"
        try:
            with open(temp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(temp, self.path(key))
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def read_into(self, key: BlockKey, out: torch.Tensor) -> None:
        """Fills `out` (a uint8 row of the layout's size) with the block, or raises BadBlock."""
        try:
            raw = self.path(key).read_bytes()
        except OSError as e:
            raise BadBlock(f"cannot read {self.path(key)}: {e.strerror or e}") from None
        header, payload = self._parse(raw, key)
        if hashlib.blake2b(payload, digest_size=16).digest() != header[5]:
            raise BadBlock(f"{self.path(key)}: checksum mismatch")
        out.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def _parse(self, raw: bytes, key: BlockKey | None) -> tuple[tuple, bytes]:
        if len(raw) < self._HEADER.size:
            raise BadBlock("shorter than a block header")
        header = self._HEADER.unpack_from(raw)
        magic, fingerprint, stored_key, _, length, _ = header
        if magic != self.MAGIC:
            raise BadBlock("not a block file")
        if fingerprint != self._fingerprint:
            raise BadBlock("written by another model, dtype or KV layout")
        if key is not None and stored_key != key:
            raise BadBlock("holds another block")
        payload = raw[self._HEADER.size:]
        if length != self.layout.block_bytes or len(payload) != length:
            raise BadBlock(f"{len(payload)} bytes of data, expected {self.layout.block_bytes}")
        return header, payload

    def drop(self, key: BlockKey) -> None:
        self.path(key).unlink(missing_ok=True)

    def scan(self) -> Iterator[DiskEntry]:
        """The blocks a previous run left, from their headers (data unchecked;
        read_into checks it). Files that are not this layout's blocks are skipped."""
        for path in self.directory.glob("*.kv"):
            try:
                with open(path, "rb") as f:
                    head = f.read(self._HEADER.size)
                magic, fingerprint, key, parent, _, _ = self._HEADER.unpack(head)
                mtime = path.stat().st_mtime
            except (OSError, struct.error):
                continue
            if magic != self.MAGIC or fingerprint != self._fingerprint or path.name != f"{key.hex()}.kv":
                continue
            yield DiskEntry(key, None if parent == self._NO_PARENT else parent, mtime)
