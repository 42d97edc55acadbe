#!/usr/bin/env bash
# Sets everything up if needed, then serves a shared-prefix workload through
# `vllm serve --attention-backend chunk` on the embedded model and reports.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/shared_prefix_demo.py "$@"
