#!/usr/bin/env bash
# Device session 2026-11-26, call 2: tpp_attend_kernel at >= 4 blocks per SM (registers <= 128),
# and with it the split count of the best wave efficiency, against main.
set -uo pipefail
ROOT=$PWD; W=/tmp/w2; mkdir -p $W; export PYTHONUNBUFFERED=1
log() { echo "== $(date +%T) +$SECONDS s: $*"; }
snap() { tar czf $OUT/all2.tgz -C $W . 2>/dev/null; }
trap 'log done; snap' EXIT
left() { [ $SECONDS -lt $1 ] || { log "skipping the rest: $SECONDS s used"; exit 0; }; }
arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
log "build main, mb4, mb4s"
for d in . gpu_session/mb4 gpu_session/mb4s; do
  (cd $d && TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=6 timeout 300 python3 setup.py -q build_ext --inplace >$W/build_$(basename $d).log 2>&1; echo "$d build rc=$?") &
done
wait
for d in . gpu_session/mb4; do cuobjdump -res-usage $d/vllm_chunkattn/_C_cuda*.so 2>/dev/null | grep -A1 "tpp_attend" | grep -o "REG:[0-9]* STACK:[0-9]*" | sort | uniq -c | sed "s|^|$d |"; done
log "variant decode tests"
(cd gpu_session/mb4s && PYTHONPATH=$ROOT/gpu_session/mb4s timeout 90 python3 -m pytest -q -p no:cacheprovider tests/gpu -m "not e2e" -k "decode or engine" 2>&1 | tail -2) 2>/dev/null || true
snap; left 300
for v in mb4 mb4s; do for args in "" "--dtype bfloat16 --kv-heads 8"; do
  left 480
  log "A/B main vs $v $args"
  (cd gpu_session/$v && OLD=$ROOT GRIDS="table3" BENCH_ARGS="$args" OUT=$W/ab_${v}_${args:+bf16} timeout 120 bash scripts/gpu_ab.sh 2>&1 | tail -12 | cut -d'|' -f3-4,7-)
  snap
done; done
