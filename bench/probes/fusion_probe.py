"""Does a chunk's output cost less when it is dequantized, hashed and written slice by slice, while
each slice is still in the core's cache, than as one 28 MiB chunk that each step reads from memory
again? No conversion: THREADS threads each dequantize an expert-shaped FP8 chunk ([ROWS, COLS] codes,
in memory) into BF16, hash it with BLAKE3 and pwrite it into FILES files in a tmpfs directory,
until TOTAL GB are written. Prints one JSON object: wall s, CPU s and GB/s of output per mode. --read reads each
chunk's codes from a tmpfs file first, as a conversion does.

    python -m bench.probes.fusion_probe --dir /dev/shm/fp --gb 8 --threads 12 --files 8 --slice-rows 64,128
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
from blake3 import blake3

from ckpttool.kernels import fp8_cpu


def run(directory: Path, total: int, threads: int, files: int, rows: int, cols: int, slice_rows: int,
        hashed: bool, read: bool) -> dict:
    rng = np.random.default_rng(0)
    codes = [rng.integers(0, 0x7E, (rows, cols), dtype=np.uint8) for _ in range(threads)]
    scale = rng.random((-(-rows // 128), -(-cols // 128)), dtype=np.float32) + 0.5
    out_rows = slice_rows or rows
    outs = [np.empty(out_rows * cols * 2, dtype=np.uint8) for _ in range(threads)]
    chunk = rows * cols * 2
    per_thread = total // threads // chunk
    directory.mkdir(parents=True, exist_ok=True)
    fds = [os.open(directory / f"o{i}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) for i in range(files)]
    sharers = threads // files
    for fd in fds:
        os.ftruncate(fd, per_thread * chunk * sharers)
    inputs = []
    if read:  # each thread's chunks of codes in a file of its own, read with pread as a conversion does
        for t in range(threads):
            fd = os.open(directory / f"i{t}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            for k in range(per_thread):
                os.pwrite(fd, codes[t], k * codes[t].nbytes)
            inputs.append(fd)
    fp8_cpu.dequant(codes[0][:out_rows], scale, "F8_E4M3", "BF16", out=outs[0])  # load before timing
    barrier = threading.Barrier(threads + 1)

    def work(t: int) -> None:
        fd, slot = fds[t % files], t // files
        h = blake3()
        src = np.empty_like(codes[t])
        barrier.wait()
        for k in range(per_thread):
            offset = (k * sharers + slot) * chunk
            if read:
                os.preadv(inputs[t], [src], k * src.nbytes)
            for r in range(0, rows, out_rows):
                out = outs[t]
                fp8_cpu.dequant((src if read else codes[t])[r:r + out_rows], scale, "F8_E4M3", "BF16", out=out)
                if hashed:
                    h.update(out)
                os.pwrite(fd, out, offset + r * cols * 2)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for th in ts:
        th.start()
    barrier.wait()
    t0, c0 = time.perf_counter(), os.times()
    for th in ts:
        th.join()
    wall, c1 = time.perf_counter() - t0, os.times()
    for fd in fds + inputs:
        os.close(fd)
    shutil.rmtree(directory)
    written = per_thread * chunk * threads
    return {"wall_s": round(wall, 3), "cpu_s": round(c1.user + c1.system - c0.user - c0.system, 2),
            "gb_s": round(written / wall / 1e9, 2), "gb": round(written / 1e9, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, required=True, help="scratch directory on tmpfs (deleted after)")
    p.add_argument("--gb", type=float, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--files", type=int, default=2)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--cols", type=int, default=7168)
    p.add_argument("--slice-rows", default="128", help="comma-separated slice heights to try beside whole chunks")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--read", action="store_true", help="read each chunk's codes from a tmpfs file first (pread)")
    p.add_argument("--no-nohash", action="store_true", help="skip the runs without the hash")
    a = p.parse_args()
    modes = [0, *map(int, filter(None, a.slice_rows.split(",")))]
    out: dict[str, list] = {}
    for _ in range(a.rounds):
        for hashed in (True,) if a.no_nohash else (True, False):
            for s in modes:
                key = f"{'chunk' if not s else f'slices of {s} rows'}{'' if hashed else ', no hash'}"
                out.setdefault(key, []).append(run(a.dir, int(a.gb * 1e9), a.threads, a.files, a.rows, a.cols, s,
                                                   hashed, a.read))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
