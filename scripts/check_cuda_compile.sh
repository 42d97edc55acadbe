#!/usr/bin/env bash
# Compile-only check of csrc/cuda for sm_80 and sm_90 (no GPU needed); see
# scripts/check_cuda_compile.py. Uses $PYTHON (default: python3) for torch's include paths.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/check_cuda_compile.py" "$@"
