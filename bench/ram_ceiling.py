"""Ceilings for a RAM-to-RAM conversion (issue 17): how fast plain Python threads write into tmpfs,
and how fast one thread hashes, on this machine, now. Prints one JSON object.

    python bench/ram_ceiling.py --dir /dev/shm/ceil --gb 18 --threads 1,4,16

write_gbps[N]: N threads each pwrite 8 MiB pieces (of one random buffer) into their own fresh file,
total --gb decimal GB, files deleted after each N (tmpfs: every byte is a page allocated, zeroed and
copied into, as the conversion's output is). hash_gbps: one thread, 256 MiB in memory, 8 MiB updates.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

PIECE = 8 << 20


def write_rate(directory: Path, total: int, threads: int) -> float:
    directory.mkdir(parents=True, exist_ok=True)
    data = memoryview(os.urandom(PIECE))
    per = total // threads // PIECE

    def worker(i: int) -> None:
        fd = os.open(directory / f"w{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for k in range(per):
                os.pwrite(fd, data, k * PIECE)
        finally:
            os.close(fd)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    seconds = time.perf_counter() - t0
    shutil.rmtree(directory)
    return per * threads * PIECE / seconds / 1e9


def hash_rates() -> dict[str, float]:
    buf = memoryview(os.urandom(256 << 20))
    makers = {"sha256": hashlib.sha256}
    try:
        from blake3 import blake3

        makers["blake3"] = blake3
    except ImportError:
        pass
    out = {}
    for name, make in makers.items():
        best = 0.0
        for _ in range(3):
            h, t0 = make(), time.perf_counter()
            for o in range(0, len(buf), PIECE):
                h.update(buf[o:o + PIECE])
            h.digest()
            best = max(best, len(buf) / (time.perf_counter() - t0) / 1e9)
        out[name] = round(best, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="scratch directory on tmpfs (deleted after)")
    p.add_argument("--gb", type=float, default=8, help="decimal GB written per thread count")
    p.add_argument("--threads", default="1,4,16")
    a = p.parse_args()
    writes = {int(n): round(write_rate(a.dir, int(a.gb * 1e9), int(n)), 2) for n in a.threads.split(",")}
    print(json.dumps({"write_gbps": writes, "hash_gbps_one_thread": hash_rates(), "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
