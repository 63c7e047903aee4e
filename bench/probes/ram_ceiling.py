"""Ceilings for a RAM-to-RAM conversion (issue 17): how fast plain Python threads write into tmpfs,
and how fast one thread hashes, on this machine, now. Prints one JSON object.

    python bench/probes/ram_ceiling.py --dir /dev/shm/ceil --gb 18 --threads 1,4,16

write_gbps[N]: N threads each pwrite 8 MiB pieces (of one random buffer) into their own fresh file,
total --gb decimal GB, files deleted after each N (tmpfs: every byte is a page allocated, zeroed and
copied into, as the conversion's output is). hash_gbps: one thread, 256 MiB in memory, 8 MiB updates. shared_write_gbps: --shared THREADS:FILES, threads
sharing each file (a conversion's 16 workers write 8 mp files), by each of --via (shared_write_rate says how).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import shutil
import threading
import time
from pathlib import Path

PIECE = 8 << 20


def timed_threads(worker, threads: int) -> float:
    """Seconds for `threads` threads running worker(i) to finish."""
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


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

    seconds = timed_threads(worker, threads)
    shutil.rmtree(directory)
    return per * threads * PIECE / seconds / 1e9


MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault a range in, writable, in one call (an error, not SIGBUS, on failure)
CPU_SECONDS: dict[tuple[int, int, str], float] = {}
"""process CPU seconds (user + system) of each shared_write_rate call"""
VIAS = ("pwrite", "locked-pwrite", "mmap", "fallocate+pwrite", "mapped", "mapped+populate", "fallocate+mapped")


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)  # ctypes calls release the GIL
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def shared_write_rate(directory: Path, total: int, threads: int, files: int, via: str) -> float:
    """`threads` threads write 8 MiB pieces into `files` files of the final size (ftruncate first, as
    the conversion's staging does), the pieces of each file interleaved between its threads, by `via`:
    - "pwrite": every write takes the file's inode lock (tmpfs serialises writers to one file), and
      allocates and zeroes its pages under it;
    - "locked-pwrite": the same, each file's writers queued on a Python lock first, so only one thread
      at a time is in the kernel for a file (the others sleep rather than spin on the inode lock);
    - "mmap": each thread maps each piece's region, copies, unmaps (a fault per page, and a TLB
      shootdown per unmap);
    - "fallocate+pwrite": each file's pages allocated first (one thread per file, inside the time),
      then pwrite, which then only copies under the lock;
    - "mapped": one shared mapping per file for the whole run, numpy copies into it (a fault per page);
    - "mapped+populate": the same, each piece's range faulted in by one madvise first;
    - "fallocate+mapped": pages allocated first, then copies into the mappings."""
    import numpy as np

    if threads % files:
        raise SystemExit(f"--shared {threads}:{files}: threads must be a multiple of files (each file's pieces are "
                         "dealt out between its threads)")
    directory.mkdir(parents=True, exist_ok=True)
    data = np.frombuffer(os.urandom(PIECE), dtype=np.uint8)
    per_file = total // files // (PIECE * (threads // files)) * PIECE * (threads // files)
    fds = []
    for i in range(files):
        fd = os.open(directory / f"s{i}", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, per_file)
        fds.append(fd)
    sharers = threads // files
    maps = [mmap.mmap(fd, per_file) for fd in fds] if via.endswith(("mapped", "populate")) else []
    views = [np.frombuffer(m, dtype=np.uint8) for m in maps]
    libc = _libc() if via == "mapped+populate" else None
    locks = [threading.Lock() for _ in range(files)]

    def worker(t: int) -> None:
        fd, slot = fds[t % files], t // files
        offsets = range(slot * PIECE, per_file, sharers * PIECE)
        if via == "locked-pwrite":  # one writer per file at a time, the others asleep on a lock
            for off in offsets:
                with locks[t % files]:
                    os.pwrite(fd, data, off)
        elif via.endswith("pwrite"):
            for off in offsets:
                os.pwrite(fd, data, off)
        elif via == "mmap":
            for off in offsets:
                with mmap.mmap(fd, PIECE, offset=off) as m:
                    m[:] = data
        else:
            view = views[t % files]
            for off in offsets:
                if libc is not None:
                    addr = view[off:].ctypes.data
                    if libc.madvise(ctypes.c_void_p(addr), PIECE, MADV_POPULATE_WRITE):
                        raise OSError(ctypes.get_errno(), "madvise")
                view[off:off + PIECE] = data

    def allocate(i: int) -> None:
        os.posix_fallocate(fds[i], 0, per_file)

    t0, cpu0 = time.perf_counter(), os.times()
    if via.startswith("fallocate"):
        timed_threads(allocate, files)
    timed_threads(worker, threads)
    seconds, cpu1 = time.perf_counter() - t0, os.times()
    CPU_SECONDS[(threads, files, via)] = round(cpu1.user + cpu1.system - cpu0.user - cpu0.system, 2)
    views.clear()  # release the mappings before closing them
    for m in maps:
        m.close()
    for fd in fds:
        os.close(fd)
    shutil.rmtree(directory)
    return per_file * files / seconds / 1e9


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
    p.add_argument("--shared", default="16:8,16:16", type=lambda v: [tuple(map(int, x.split(":"))) for x in v.split(",")],
                   help="THREADS:FILES pairs: threads sharing files, written with pwrite and through mappings")
    p.add_argument("--via", default="pwrite,mmap", help=f"how the shared files are written: of {','.join(VIAS)}")
    a = p.parse_args()
    writes = {int(n): round(write_rate(a.dir, int(a.gb * 1e9), int(n)), 2) for n in a.threads.split(",")}
    shared = {f"{n} threads, {f} files, {via}": round(shared_write_rate(a.dir, int(a.gb * 1e9), n, f, via), 2)
              for n, f in a.shared for via in a.via.split(",")}
    print(json.dumps({"write_gbps": writes, "shared_write_gbps": shared,
                      "shared_write_cpu_s": {f"{n} threads, {f} files, {via}": c for (n, f, via), c in CPU_SECONDS.items()},
                      "hash_gbps_one_thread": hash_rates(),
                      "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
