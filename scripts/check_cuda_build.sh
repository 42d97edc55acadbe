#!/usr/bin/env bash
# Builds the project the way a GPU host does, on a machine without a GPU:
# a virtual environment with vLLM's CUDA wheel (and the CUDA torch it pins)
# from PyPI, then `pip install --no-build-isolation -e ".[cuda,test]"` of a
# clone of HEAD. Checks that vllm_chunkattn._C_cuda builds, links against
# libtorch_cuda and loads, that its ops reach torch's dispatcher for CUDA,
# which GPU architectures it holds, and runs the tests that use the CUDA
# build without a GPU. Nothing runs on a GPU.
#
#   bash scripts/check_cuda_build.sh [WORK_DIR]     # default build/cuda-build-check
#
# Needs network access to PyPI, nvcc, and ~10 GB of disk (the CUDA wheels);
# 10 minutes on 2 cores once the wheels are downloaded. Not part of CI for
# that reason. Uncommitted changes are not in the clone: commit first.
# TORCH_CUDA_ARCH_LIST passes through to the build (setup.py).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mkdir -p "${1:-$ROOT/build/cuda-build-check}" && cd "${1:-$ROOT/build/cuda-build-check}" && pwd)
VENV=$WORK/venv
SRC=$WORK/src
VLLM_VERSION=$(grep -o '"vllm>=[0-9.]*' "$ROOT/pyproject.toml" | sed 's/"vllm>=//')
# The machine's pip configuration may point at a local wheel folder of CPU builds.
export PIP_CONFIG_FILE=/dev/null

if [ ! -x "$VENV/bin/python" ]; then
  echo "== virtual environment with vllm==$VLLM_VERSION (CUDA wheel) in $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install --isolated -q "vllm==$VLLM_VERSION" pytest hypothesis setuptools wheel
fi
"$VENV/bin/python" -c "import torch, vllm; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| vllm', vllm.__version__)"

echo "== clone of HEAD ($(git -C "$ROOT" rev-parse --short HEAD)) in $SRC"
rm -rf "$SRC"
git clone -q "$ROOT" "$SRC"

echo "== pip install --no-build-isolation -e .[cuda,test]"
started=$(date +%s)
(cd "$SRC" && "$VENV/bin/python" -m pip install --isolated --no-build-isolation --no-deps -v -e ".[cuda,test]" \
  >"$WORK/install.log" 2>&1) || { tail -40 "$WORK/install.log"; echo "build FAILED (log: $WORK/install.log)"; exit 1; }
grep -hE "^\s*vllm-chunkattn: " "$WORK/install.log" | sort -u || true
echo "built in $(( $(date +%s) - started )) s"

echo "== load"
(cd "$SRC" && "$VENV/bin/python" - <<'EOF'
import torch

from vllm_chunkattn.kernels import ops

assert ops.cuda_kernels_available(), ops.CUDA_KERNELS_ERROR
for op in ("write_kv_cache", "tpp_decode", "paged_prefill"):
    keys = [k for k in ("CPU", "CUDA", "Meta") if torch._C._dispatch_has_kernel_for_dispatch_key(f"chunkattn::{op}", k)]
    assert keys == ["CPU", "CUDA", "Meta"], (op, keys)
print("vllm_chunkattn._C_cuda loaded; chunkattn ops have CPU, CUDA and Meta kernels")
EOF
)

echo "== GPU code in the library"
CUOBJDUMP=$(command -v cuobjdump || ls "$VENV"/lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump 2>/dev/null || true)
if [ -n "$CUOBJDUMP" ]; then
  lib=$(ls "$SRC"/vllm_chunkattn/_C_cuda*.so)
  echo "SASS: $("$CUOBJDUMP" --list-elf "$lib" | grep -o 'sm_[0-9a-z]*' | sort -u | tr '\n' ' ')"
  echo "PTX:  $("$CUOBJDUMP" --list-ptx "$lib" 2>/dev/null | grep -o 'sm_[0-9a-z]*' | sort -u | tr '\n' ' ')"
else
  echo "cuobjdump not found: architectures not listed"
fi

echo "== tests that use the CUDA build without a GPU"
(cd "$SRC" && "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/cuda/test_cuda_config.py tests/unit/test_fake_ops.py \
  tests/cuda/test_kernel_gpu_bench.py tests/cuda/test_cuda_toolkit.py tests/gpu)
