"""The machine's memory bandwidth with N threads, for the ceilings beside a conversion: each thread
copies its own 256 MiB array into another (numpy's copy releases the GIL), REPS times; GB/s counts the
bytes copied (each is read once and written once, so the memory moves at least twice that).

    python -m bench.probes.membw --threads 1,4,8,12,16
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from bench.probes.ram_ceiling import timed_threads


def rate(threads: int, nbytes: int, reps: int) -> float:
    src = [np.ones(nbytes, dtype=np.uint8) for _ in range(threads)]
    dst = [np.ones(nbytes, dtype=np.uint8) for _ in range(threads)]

    def work(i: int) -> None:
        for _ in range(reps):
            np.copyto(dst[i], src[i])

    return threads * reps * nbytes / timed_threads(work, threads) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,4,8,12,16")
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=8)
    a = p.parse_args()
    print(json.dumps({"copy_gb_s": {n: round(max(rate(int(n), a.mib << 20, a.reps) for _ in range(2)), 1)
                                    for n in a.threads.split(",")}}))


if __name__ == "__main__":
    main()
