"""How the CPU FP8 block dequant (kernels/fp8_cpu.dequant, numba gather) scales with threads, with no
I/O: each of N threads dequantizes an expert-shaped chunk ([ROWS, 7168] FP8 codes and their 128x128
scales, in memory) into its own reused output buffer, REPS times. Prints one JSON object: GB/s of BF16
output per thread count, total and per thread.

    python -m bench.probes.gather_scaling --threads 1,4,8,12,16 --rows 2048
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np

from ckpttool.kernels import fp8_cpu


def rate(threads: int, rows: int, cols: int, reps: int) -> float:
    rng = np.random.default_rng(0)
    codes = [rng.integers(0, 0x7E, (rows, cols), dtype=np.uint8) for _ in range(threads)]
    scale = rng.random((-(-rows // 128), -(-cols // 128)), dtype=np.float32) + 0.5
    outs = [np.empty(rows * cols * 2, dtype=np.uint8) for _ in range(threads)]
    fp8_cpu.dequant(codes[0], scale, "F8_E4M3", "BF16", out=outs[0])  # compile or load before timing
    barrier = threading.Barrier(threads + 1)

    def work(i: int) -> None:
        barrier.wait()
        for _ in range(reps):
            fp8_cpu.dequant(codes[i], scale, "F8_E4M3", "BF16", out=outs[i])

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return threads * reps * rows * cols * 2 / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,4,8,12,16")
    p.add_argument("--rows", type=int, default=2048, help="rows per chunk (7168 columns): 2048 is 28 MiB of BF16")
    p.add_argument("--cols", type=int, default=7168)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    out = {}
    for n in map(int, a.threads.split(",")):
        total = rate(n, a.rows, a.cols, a.reps)
        out[n] = {"gbps": round(total, 2), "per_thread": round(total / n, 2)}
    print(json.dumps({"rows": a.rows, "cols": a.cols, "gbps_out": out}))


if __name__ == "__main__":
    main()
