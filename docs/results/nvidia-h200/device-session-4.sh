#!/usr/bin/env bash
# Device session 2026-11-27, call 2: after the fix of prepare_kernel (opt-in per shared-memory size):
# build, GPU tests + compute-sanitizer, the relay grid with the group layout.
set -uo pipefail
ROOT=$PWD; W=/tmp/w2; mkdir -p $W; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
log() { echo "== $(date +%T) +$SECONDS s: $*"; }
snap() { tar czf $OUT/all2.tgz -C $W . 2>/dev/null; }
trap 'log done; snap' EXIT
left() { [ $SECONDS -lt $1 ] || { log "skipping the rest: $SECONDS s used"; exit 0; }; }
log "gpu_check: build, tests, sanitizer"
SANITIZE=1 SKIP_BENCH=1 MAX_JOBS=16 OUT=$W/check timeout 280 bash scripts/gpu_check.sh 2>&1 | grep -E "gpu_check|passed|failed|FAILED|Error|cuda kernels" | tail -20
snap; left 250
for cfg in "32 32 float16" "32 8 bfloat16" "16 16 float16" "16 4 bfloat16"; do
  set -- $cfg
  snap; left 330
  log "relay $1/$2 $3"
  timeout 60 python3 -m vllm_chunkattn.bench.kernel_gpu --grids relay --methods chunk chunk_prefill \
    --heads $1 --kv-heads $2 --dtype $3 --out $W/relay4_h$1kv$2_$3 > $W/relay4_h$1kv$2_$3.log 2>&1
  echo "rc=$?"; grep -E "^\| relay" $W/relay4_h$1kv$2_$3.md 2>/dev/null || tail -5 $W/relay4_h$1kv$2_$3.log
done
