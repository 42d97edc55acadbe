#!/usr/bin/env bash
# Device session 2026-11-27: the sequence-first phase in attend()'s group layout (two KV stages)
# against main (gpu_session/old): build both, GPU tests + compute-sanitizer on the new build,
# table3 A/B fp16 MHA and bf16 GQA 8, per-kernel split of the unshared decode, reach.
set -uo pipefail
ROOT=$PWD; W=/tmp/w; mkdir -p $W; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
log() { echo "== $(date +%T) +$SECONDS s: $*"; }
snap() { tar czf $OUT/all.tgz -C $W . 2>/dev/null; }
trap 'log done; snap' EXIT
left() { [ $SECONDS -lt $1 ] || { log "skipping the rest: $SECONDS s used"; exit 0; }; }
arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv > $W/machine.txt; lscpu | grep -E "Model name|^CPU\(s\)" >> $W/machine.txt
log "build new and old, sm_$arch"
(TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=8 timeout 240 python3 setup.py -q build_ext --inplace >$W/build_new.log 2>&1; echo "new build rc=$?") &
(cd gpu_session/old && TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=8 timeout 240 python3 setup.py -q build_ext --inplace >$W/build_old.log 2>&1; echo "old build rc=$?") &
wait
for d in . gpu_session/old; do cuobjdump -res-usage $d/vllm_chunkattn/_C_cuda*.so 2>/dev/null | grep -A1 "tpp_attend" | grep -o "REG:[0-9]* STACK:[0-9]* SHARED:[0-9]*" | sort | uniq -c | sed "s|^|$d |"; done
log "gpu_check (tests, sanitizer) on new"
SKIP_BUILD=1 SANITIZE=1 SKIP_BENCH=1 OUT=$W/check timeout 200 bash scripts/gpu_check.sh 2>&1 | grep -E "gpu_check|passed|failed|FAILED|Error|cuda kernels" | tail -20
snap; left 330
log "A/B fp16 MHA table3"
OLD=$ROOT/gpu_session/old GRIDS=table3 OUT=$W/ab_fp16 timeout 120 bash scripts/gpu_ab.sh 2>&1 | tail -14
snap; left 400
log "A/B bf16 GQA 8 table3"
OLD=$ROOT/gpu_session/old GRIDS=table3 BENCH_ARGS="--dtype bfloat16 --kv-heads 8" OUT=$W/ab_bf16 timeout 120 bash scripts/gpu_ab.sh 2>&1 | tail -14
snap; left 440
log "unshared decode per kernel, new"
timeout 40 python3 docs/results/nvidia-h200/unshared_kernel_split.py > $W/unshared-kernel-split.txt 2>&1; tail -12 $W/unshared-kernel-split.txt
snap; left 470
log "reach"
timeout 50 python3 -m pytest -q -s -p no:cacheprovider tests/gpu -k reach 2>&1 | tee $W/reach.log | grep -E "heads:|passed|failed"
