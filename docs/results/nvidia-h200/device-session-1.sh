#!/usr/bin/env bash
# Device session 2026-11-26: checklist of docs/cuda.md in one call.
set -uo pipefail
ROOT=$PWD; W=/tmp/w; mkdir -p $W; export PYTHONUNBUFFERED=1
log() { echo "== $(date +%T) +$SECONDS s: $*"; }
snap() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
finish() { log done; snap; }
trap finish EXIT
left() { [ $SECONDS -lt $1 ] || { log "skipping the rest: $SECONDS s used"; exit 0; }; }
arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
log "build main and branch, sm_$arch"
(TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=8 timeout 240 python3 setup.py -q build_ext --inplace >$W/build_main.log 2>&1; echo "main build rc=$?") &
(cd gpu_session/new && TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=8 timeout 240 python3 setup.py -q build_ext --inplace >$W/build_new.log 2>&1; echo "branch build rc=$?") &
wait
log "gpu_check (tests, sanitizer)"
SKIP_BUILD=1 SANITIZE=1 SKIP_BENCH=1 OUT=$W/check timeout 220 bash scripts/gpu_check.sh 2>&1 | grep -E "gpu_check|passed|failed|FAILED|Error|cuda kernels" | tail -20
snap
log "reach"
timeout 60 python3 -m pytest -q -s -p no:cacheprovider tests/gpu -k reach 2>&1 | tee $W/reach.log | grep -E "heads:|passed|failed"
snap; left 330
log "A/B fp16 table3"
(cd gpu_session/new && OLD=$ROOT GRIDS=table3 OUT=$W/ab_fp16 timeout 150 bash scripts/gpu_ab.sh 2>&1 | tail -14)
snap; left 420
log "A/B bf16 GQA 8 table3"
(cd gpu_session/new && OLD=$ROOT GRIDS=table3 BENCH_ARGS="--dtype bfloat16 --kv-heads 8" OUT=$W/ab_bf16 timeout 150 bash scripts/gpu_ab.sh 2>&1 | tail -14)
for cfg in "32 32 float16" "16 16 float16" "32 8 bfloat16" "16 4 bfloat16"; do
  set -- $cfg
  snap; left 490
  log "relay $1/$2 $3"
  timeout 60 python3 -m vllm_chunkattn.bench.kernel_gpu --grids relay --methods chunk chunk_own_stacked chunk_prefill \
    --heads $1 --kv-heads $2 --dtype $3 --out $W/relay3_h$1kv$2_$3 > $W/relay3_h$1kv$2_$3.log 2>&1
  echo "rc=$?"; grep -E "^\| relay" $W/relay3_h$1kv$2_$3.md 2>/dev/null || tail -5 $W/relay3_h$1kv$2_$3.log
done
