"""Is the other vCPU an SMT sibling? Time FMA-bound work (single-thread sgemm) and a memory-bound copy on CPU 0,
alone and with a sched_yield spinner (as vLLM's engine core waits for its worker) or a pure spin on CPU 1."""
import os, subprocess, sys, time
os.environ["OMP_NUM_THREADS"] = "1"
import numpy as np
os.sched_setaffinity(0, {0})
a = np.random.rand(512, 512).astype(np.float32); b = np.random.rand(512, 512).astype(np.float32)
big = np.random.rand(64 << 20 >> 2).astype(np.float32); dst = np.empty_like(big)
def gemm():
    t = time.perf_counter()
    for _ in range(40): a @ b
    return (time.perf_counter() - t) * 1e3
def copy():
    t = time.perf_counter()
    for _ in range(10): np.copyto(dst, big)
    return (time.perf_counter() - t) * 1e3
SPIN = {"yield": "import os\nos.sched_setaffinity(0,{1})\nwhile True: os.sched_yield()",
        "spin": "import os\nos.sched_setaffinity(0,{1})\nx=0\nwhile True: x+=1"}
for rep in range(3):
    for load in ("none", "yield", "spin"):
        p = subprocess.Popen([sys.executable, "-c", SPIN[load]]) if load != "none" else None
        time.sleep(0.3)
        g = min(gemm() for _ in range(3)); c = min(copy() for _ in range(3))
        if p: p.kill(); p.wait()
        print(f"rep {rep} other cpu {load:5s}: sgemm {g:7.1f} ms ({40*2*512**3/g/1e6:.0f} GFLOP/s)  copy {c:7.1f} ms", flush=True)
