"""What CPU this is: the facts that decide which kernels run and how fast.

`cpu_description()` is read from /proc/cpuinfo and sysfs. It keys the CPU
tuning cache (`cpu_tuning.py`: tile sizes measured on one CPU are not valid on
another) and is the CPU part of every benchmark's machine record
(`vllm_chunkattn.bench.machine`). `CacheFlusher` evicts its caches before a
timed call (the tile tuning's and the kernel benchmark's).
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

# /proc/cpuinfo flags that decide which kernels run and how fast they can be.
FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16")


def cpu_description(online_cpus: int | None = None) -> dict:
    """Vendor, name, family/model/stepping, flags of interest and cache sizes, JSON-ready."""
    info = _cpuinfo()
    flags = set(info.get("flags", "").split())
    return {
        "cpu_vendor": info.get("vendor_id"),
        "cpu_model_name": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_family": int(info["cpu family"]) if "cpu family" in info else None,
        "cpu_model": int(info["model"]) if info.get("model", "").isdigit() else None,
        "cpu_stepping": int(info["stepping"]) if info.get("stepping", "").isdigit() else None,
        "cpu_flags": {flag: flag in flags for flag in FLAGS_OF_INTEREST},
        "caches": cache_sizes(online_cpus or os.cpu_count() or 1),
    }


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _cpu_count_in(cpu_list: str) -> int:
    """Number of CPUs in a sysfs list such as "0-3,8"."""
    count = 0
    for part in cpu_list.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            count += int(hi) - int(lo) + 1
        elif part:
            count += 1
    return count


def _size_kib(text: str) -> int:
    """KiB in a sysfs cache size such as "48K" or "32M"."""
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip())
    if not match:
        raise ValueError(f"cache size {text!r}")
    return int(match.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[match.group(2)] // 1024


class CacheFlusher:
    """Evicts the caches by writing a buffer of twice their total size (L2 and up, at least 64 MiB).

    Timing a kernel after it leaves its inputs where serving does: between two
    calls of a layer, the other layers' weights and KV pass through the caches,
    so a step finds its KV in memory, not in the L3. Kernel parameters chosen on
    warm caches can be the wrong ones there (how far ahead to prefetch)."""

    def __init__(self, caches: dict[str, dict[str, int]] | None = None):
        import torch

        caches = cache_sizes(os.cpu_count() or 1) if caches is None else caches
        self.buffer = torch.zeros(max(64 << 20, 2 * outer_cache_bytes(caches)), dtype=torch.uint8)

    def __call__(self) -> None:
        self.buffer.add_(1)


def outer_cache_bytes(caches: dict[str, dict[str, int]]) -> int:
    """Bytes of all caches beyond L1d (every instance of L2 and up): what a buffer must outgrow to be read
    from memory, or to leave nothing of a kernel's inputs cached."""
    return sum(c["kib"] * c["instances"] for name, c in caches.items() if name != "L1d") * 1024


def cache_sizes(online_cpus: int) -> dict[str, dict[str, int]]:
    """{"L1d"|"L2"|"L3": {"kib": size of one instance, "instances": how many}} from sysfs."""
    sizes: dict[str, dict[str, int]] = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            kib = _size_kib((index / "size").read_text())
            sharing = _cpu_count_in((index / "shared_cpu_list").read_text())
        except (OSError, ValueError):
            continue
        if kind == "Instruction":
            continue
        name = "L1d" if level == 1 else f"L{level}"
        sizes[name] = {"kib": kib, "instances": max(1, online_cpus // max(1, sharing))}
    return sizes

