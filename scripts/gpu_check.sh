#!/usr/bin/env bash
# On a GPU host whose python3 has a CUDA torch (vLLM not needed): build the
# extensions in place, run the GPU tests that need no engine, then the GPU
# kernel benchmark. Logs and results go to $OUT (default results/gpu_check).
#
#   bash scripts/gpu_check.sh                  # tests + benchmark (all grids)
#   GRIDS="table3" bash scripts/gpu_check.sh   # fewer grids
#   SKIP_TESTS=1 / SKIP_BENCH=1                # one half only
#
# Wheels in .whl/ (FlashInfer for the benchmark's cascade column, say) are
# installed into /tmp/site first. docs/cuda.md has the results of a run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: installing .whl/ failed"; exit 1; }
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  nvcc --version | tail -2
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  lscpu | grep -E "Model name|^CPU\(s\)"
} 2>&1 | tee "$OUT/machine.txt"

# Only the GPU's own architecture: a third of the build time of the default list.
arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
start=$SECONDS
TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1
rc=$?
echo "gpu_check: build for sm_${arch/./} rc=$rc in $((SECONDS - start)) s"
[ $rc -eq 0 ] || { tail -60 "$OUT/build.log"; exit $rc; }
$PY -c "import vllm_chunkattn.kernels.ops as o; print('cuda kernels:', o.cuda_kernels_available(), o.CUDA_KERNELS_ERROR)"

status=0
if [ -z "${SKIP_TESTS:-}" ]; then
  start=$SECONDS
  $PY -m pytest tests/gpu -m "not e2e" -v -p no:cacheprovider --junitxml="$OUT/tests_gpu.xml" 2>&1 | tee "$OUT/tests_gpu.log" | tail -80
  rc=${PIPESTATUS[0]}
  echo "gpu_check: tests/gpu (not e2e) rc=$rc in $((SECONDS - start)) s"
  [ $rc -eq 0 ] || status=$rc
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  start=$SECONDS
  # shellcheck disable=SC2086
  $PY -m vllm_chunkattn.bench.kernel_gpu --grids ${GRIDS:-table3 figure3 figure4 multilevel relay} ${BENCH_ARGS:-} \
    --out "$OUT/kernel_gpu" 2>&1 | tee "$OUT/bench.log" | tail -120
  rc=${PIPESTATUS[0]}
  echo "gpu_check: kernel_gpu rc=$rc in $((SECONDS - start)) s"
  [ $rc -eq 0 ] || status=$rc
fi
exit $status
