#!/usr/bin/env bash
# On a GPU host whose python3 has a CUDA torch (vLLM not needed): build the
# extensions in place, run the GPU tests that need no engine, then the GPU
# kernel benchmark. Logs and results go to $OUT (default results/gpu_check).
#
#   bash scripts/gpu_check.sh                  # tests + benchmark (all grids)
#   GRIDS="table3" bash scripts/gpu_check.sh   # fewer grids
#   SKIP_TESTS=1 / SKIP_BENCH=1                # one half only
#   SKIP_BUILD=1                               # reuse the extensions built in place
#   SANITIZE=1                                 # + compute-sanitizer memcheck / racecheck over a subset
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
# SKIP_BUILD=1 reuses the extensions already built in place (a second run on the same host).
if [ -z "${SKIP_BUILD:-}" ]; then
  arch=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  start=$SECONDS
  TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1
  rc=$?
  echo "gpu_check: build for sm_${arch/./} rc=$rc in $((SECONDS - start)) s"
  [ $rc -eq 0 ] || { tail -60 "$OUT/build.log"; exit $rc; }
fi
$PY -c "import vllm_chunkattn.kernels.ops as o; print('cuda kernels:', o.cuda_kernels_available(), o.CUDA_KERNELS_ERROR)"

status=0
if [ -z "${SKIP_TESTS:-}" ]; then
  start=$SECONDS
  $PY -m pytest tests/gpu -m "not e2e" -v -p no:cacheprovider --junitxml="$OUT/tests_gpu.xml" 2>&1 | tee "$OUT/tests_gpu.log" | tail -80
  rc=${PIPESTATUS[0]}
  echo "gpu_check: tests/gpu (not e2e) rc=$rc in $((SECONDS - start)) s"
  [ $rc -eq 0 ] || status=$rc
fi

if [ -n "${SANITIZE:-}" ]; then
  # Each tensor its own allocation, so that memcheck sees every out-of-bounds access (and
  # so no CUDA-graph capture: without the caching allocator it cannot allocate while capturing).
  for check in "memcheck:variants or several_tokens or engine_steps or in_graph_buffers" "racecheck:several_tokens and dtype0 or engine_steps and dtype1"; do
    tool=${check%%:*}
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool "$tool" --error-exitcode 3 \
      $PY -m pytest -q -p no:cacheprovider tests/gpu -m "not e2e" -k "${check#*:}" >>"$OUT/compute-sanitizer.log" 2>&1
    rc=$?
    echo "gpu_check: compute-sanitizer $tool rc=$rc ($(grep -E 'passed|failed' "$OUT/compute-sanitizer.log" | tail -1))"
    [ $rc -eq 0 ] || status=$rc
  done
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
