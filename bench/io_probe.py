"""What the output filesystem can do, in the access patterns a conversion uses.

dd measures one stream at a time. A conversion reads its input and writes its output at once, from
several threads, in 8-64 MiB pieces, with periodic fdatasync; and the sandboxes we benchmark on
(gVisor) implement some hints (posix_fadvise, sync_file_range) as no-ops. This probe times:

  write        one stream, 16 MiB writes, fsync at the end (what dd conv=fsync measures)
  write-mt     8 threads pwrite 8 MiB pieces into 8 preallocated files, fdatasync every 1 GiB
  write-mt-sfr the same, each piece followed by sync_file_range(SYNC_FILE_RANGE_WRITE)
  read         one cold stream (page cache dropped first)
  read-mt      8 threads pread 32 MiB pieces of one cold file
  read+write   a cold read stream and a write stream at the same time, each timed on its own
  fadvise      posix_fadvise(WILLNEED) on a cold file, a pause, then a timed read: ~0 s if honoured

    python bench/io_probe.py probe --dir /tmp/probe --gib 8 --json out.json

`write-mt` and `read-write` run one measurement each; bench/run_bench.py's disk step uses them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MiB, GiB = 1 << 20, 1 << 30
_libc = ctypes.CDLL(None, use_errno=True)
SYNC_FILE_RANGE_WRITE = 2


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def sync_file_range(fd: int, offset: int, nbytes: int) -> int:
    """0, or the errno of an unsupported call."""
    rc = _libc.sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(nbytes), SYNC_FILE_RANGE_WRITE)
    return 0 if rc == 0 else ctypes.get_errno()


def timed(fn, *args) -> float:
    t = time.monotonic()
    fn(*args)
    return time.monotonic() - t


def write_stream(path: Path, nbytes: int, block: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            done += os.write(fd, block[: nbytes - done])
        os.fsync(fd)
    finally:
        os.close(fd)


def read_stream(path: Path, piece: int = 16 * MiB) -> int:
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(piece)
    total = 0
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return total


def write_mt(d: Path, nbytes: int, sfr: bool, threads: int = 8, piece: int = 8 * MiB) -> dict:
    """threads pwrite piece-sized blocks into their own preallocated file, fdatasync every 1 GiB
    written in all, as ckpttool's writers and journal commits do."""
    block = os.urandom(piece)
    paths = [d / f"mt{i}.bin" for i in range(threads)]
    per = nbytes // len(paths) // len(block) * len(block)
    fds = []
    for p in paths:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, per)
        fds.append(fd)
    written = [0]
    lock = threading.Lock()
    sfr_err = []

    def worker(i: int) -> None:
        fd, off, since = fds[i], 0, 0
        while off < per:
            os.pwrite(fd, block, off)
            if sfr:
                err = sync_file_range(fd, off, len(block))
                if err:
                    sfr_err.append(err)
            off += len(block)
            since += len(block)
            if since >= GiB // len(paths):
                os.fdatasync(fd)
                since = 0
        with lock:
            written[0] += off

    with ThreadPoolExecutor(len(paths)) as pool:
        list(pool.map(worker, range(len(paths))))
    for fd in fds:
        os.fdatasync(fd)
        os.close(fd)
    for q in paths:
        q.unlink()
    return {"bytes": written[0], "sync_file_range_errno": sorted(set(sfr_err))}


def read_mt(path: Path, threads: int = 8, piece: int = 32 * MiB) -> int:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    offsets = list(range(0, size, piece))

    def one(off: int) -> int:
        return len(os.pread(fd, piece, off))

    try:
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(one, offsets))
    finally:
        os.close(fd)


def probe(d: Path, n: int) -> dict:
    block16 = os.urandom(16 * MiB)
    res: dict = {"uname": platform.uname()._asdict(), "bytes": n, "cores": os.cpu_count(),
                 "mounts": [ln for ln in Path("/proc/mounts").read_text().splitlines() if " / " in ln or "/tmp" in ln],
                 "diskstats": Path("/proc/diskstats").exists()}
    for k in ("dirty_background_ratio", "dirty_ratio", "dirty_expire_centisecs"):
        try:
            res[k] = Path(f"/proc/sys/vm/{k}").read_text().strip()
        except OSError:
            res[k] = None
    A, B = d / "a.bin", d / "b.bin"
    res["drop_caches"] = drop_caches()
    res["write_gbs"] = n / timed(write_stream, A, n, block16) / 1e9
    drop_caches()
    res["read_gbs"] = n / timed(read_stream, A) / 1e9
    drop_caches()
    res["read_mt_gbs"] = n / timed(read_mt, A) / 1e9
    for sfr in (False, True):
        drop_caches()
        t = time.monotonic()
        got = write_mt(d, n, sfr=sfr)
        res[f"write_mt{'_sfr' if sfr else ''}_gbs"] = got["bytes"] / (time.monotonic() - t) / 1e9
        if sfr:
            res["sync_file_range_errno"] = got["sync_file_range_errno"]
    drop_caches()
    res["concurrent"] = read_while_writing(A, B, n)
    B.unlink()
    drop_caches()
    fd = os.open(A, os.O_RDONLY)
    t = time.monotonic()
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    res["fadvise_call_s"] = time.monotonic() - t
    os.close(fd)
    time.sleep(n / 2e9 + 1)  # long enough for the disk to have read it all, if asked to
    res["read_after_willneed_gbs"] = n / timed(read_stream, A) / 1e9
    A.unlink()
    return res


def read_while_writing(src: Path, dst: Path, n: int) -> dict:
    """Read src (cold, if the caller dropped the cache) while writing n bytes to dst with a final
    fsync: does the disk give each stream its solo rate, or do they share one budget?"""
    block16 = os.urandom(16 * MiB)
    times: dict = {}
    got: dict = {}

    def rd() -> None:
        t = time.monotonic()
        got["read"] = read_stream(src)
        times["read"] = time.monotonic() - t

    def wr() -> None:
        times["write"] = timed(write_stream, dst, n, block16)

    t = time.monotonic()
    threads = [threading.Thread(target=rd), threading.Thread(target=wr)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"read_bytes": got["read"], "write_bytes": n, "read_gbs": got["read"] / times["read"] / 1e9,
            "write_gbs": n / times["write"] / 1e9, "total_gbs": (got["read"] + n) / (time.monotonic() - t) / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["probe", "write-mt", "read-write"])
    p.add_argument("--dir", type=Path, required=True, help="scratch directory on the filesystem to measure")
    p.add_argument("--gib", type=float, default=8, help="bytes to write, in GiB")
    p.add_argument("--read", type=Path, help="read-write: the existing file to read while writing")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    n = int(a.gib * GiB) // (16 * MiB) * 16 * MiB
    if a.mode == "probe":
        res = probe(a.dir, n)
    elif a.mode == "write-mt":
        res = write_mt(a.dir, n, sfr=False)
    else:
        if a.read is None:
            p.error("read-write needs --read FILE")
        res = read_while_writing(a.read, a.dir / "rw.bin", n)
        (a.dir / "rw.bin").unlink()
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
