#!/usr/bin/env bash
# Before/after of a CUDA kernel change on a GPU host, in one run: builds this
# checkout and an older copy of it (OLD: a folder with that checkout's
# csrc, setup.py, pyproject.toml, README.md and vllm_chunkattn, e.g. from
# `git worktree add`), then runs the GPU kernel benchmark with each,
# alternating (old, new, old, new), and prints the medians side by side.
#
#   OLD=/tmp/old bash scripts/gpu_ab.sh
#   OLD=/tmp/old BENCH_ARGS="--dtype bfloat16 --kv-heads 8" bash scripts/gpu_ab.sh
#
# Results: $OUT/ab.md and the runs' JSON in $OUT/ab.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OLD:?set OLD to the folder of the older checkout}"
OUT=${OUT:-results/gpu_ab}
RUNS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
arch=$(python3 -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
half=$(( $(nproc) / 2 ))
(cd "$OLD" && TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=$half python3 setup.py -q build_ext --inplace >"$OUT/build_old.log" 2>&1) &
TORCH_CUDA_ARCH_LIST=$arch MAX_JOBS=$half python3 setup.py -q build_ext --inplace >"$OUT/build_new.log" 2>&1 \
  || { echo "build of this checkout failed, see $OUT/build_new.log"; exit 1; }
wait $! || { echo "build of $OLD failed, see $OUT/build_old.log"; exit 1; }
for rep in 1 2; do
  for version in old new; do
    dir=$PWD; [ $version = old ] && dir=$OLD
    # cd: `python -m` puts the working directory first on sys.path.
    # shellcheck disable=SC2086
    (cd "$dir" && PYTHONPATH=$dir python3 -m vllm_chunkattn.bench.kernel_gpu --grids ${GRIDS:-table3 figure4 multilevel} \
      --methods chunk sdpa ${BENCH_ARGS:-} --out "$RUNS/${version}_$rep" >"$RUNS/${version}_$rep.log" 2>&1) \
      || { echo "benchmark ($version, run $rep) failed:"; tail -20 "$RUNS/${version}_$rep.log"; exit 1; }
  done
done
python3 - "$RUNS" <<'PY' | tee "$OUT/ab.md"
import json, statistics, sys
from pathlib import Path
times = {}
for f in sorted(Path(sys.argv[1]).glob("*.json")):
    version = f.stem.split("_")[0]
    for r in json.loads(f.read_text())["rows"]:
        point = (r["grid"], r["batch"], r["prompt"], r["shared"], r["completion"])
        for method, t in r["times_us"].items():
            times.setdefault(point, {}).setdefault((version, method), []).append(t)
print("| grid | b | n_p | n_s | n_c | before (us) | after (us) | sdpa (us) | before / sdpa | after / sdpa |")
print("|---|---|---|---|---|---|---|---|---|---|")
for point, t in times.items():
    old, new = statistics.median(t["old", "chunk"]), statistics.median(t["new", "chunk"])
    sdpa = statistics.median(t["old", "sdpa"] + t["new", "sdpa"])
    print(f"| {' | '.join(map(str, point))} | {old:.1f} | {new:.1f} | {sdpa:.1f} | {old / sdpa:.3f} | {new / sdpa:.3f} |")
PY
tar czf "$OUT/ab.tgz" -C "$RUNS" .
