"""The manifest's hash of an output file, computed while it is being written.

Tensors land out of order, but roughly by ascending offset; each file's hasher consumes the
contiguous written prefix as it grows, so the manifest costs no second pass over the output at the
end. Bytes written right at the hashed prefix are hashed from the writer's buffer (`offer`); the
rest (pieces that landed out of order, and the kernel's copy_file_range copies, which never pass
through user memory) is hashed on a pool thread through a read-only mapping of the file, not a
pread into a buffer: on tmpfs that copy cost as much CPU as blake3 itself, and mapping took 11% off
a `shard`'s CPU time on the 2-core box.

The hash is BLAKE3 (256-bit, the hex digest `b3sum FILE` prints): cryptographic like sha256, and on
one core of the 2-core box 4.3 GB/s against sha256's 1.8 (OpenSSL with SHA-NI); xxh3-128 ran 28.5
but is no defence against a tampered file. Manifests written before carry sha256, still checked as
such (`sha256sum`).
"""

from __future__ import annotations

import hashlib
import heapq
import mmap
import os
import threading
import time
from concurrent.futures import Executor
from pathlib import Path

READ_BYTES = 8 << 20
CATCH_UP_BYTES = 64 << 20
CATCH_UP_SECONDS = 1.0
"""a writer whose piece lands this close past the hashed prefix, right at the written one, waits for the
file's hashing thread to get there and hashes its piece itself (PrefixHasher.offer)"""
ALGORITHM = "blake3"
"""the hash new manifests record, and its key in each file's entry"""
ALGORITHMS = ("blake3", "sha256")
"""the hashes a manifest may carry (older manifests: sha256)"""


def new_hash(algorithm: str = ALGORITHM):
    """A new hash object. BLAKE3 on one thread per file: its own thread pool (`max_threads=AUTO`) spun on
    cores the workers needed, 8-10 CPU seconds more for the same wall time on the 16-core device
    (bench/HISTORY.md). The wait for the hashes at the end of a run had two causes, both met elsewhere: a
    large tensor streamed by one worker held every file's hashed prefix back (execute/executor.py runs a
    tensor's runs of rows on several workers), and a worker on every core left the hashes behind, to
    re-read what they missed (defaults.workers)."""
    if algorithm == "blake3":
        from blake3 import blake3

        return blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown hash {algorithm!r}; one of {ALGORITHMS}")


_blocks = threading.local()


def _block() -> memoryview:
    """This thread's read buffer, reused. A fresh 8 MiB bytes object per pread costs an allocation
    and, whenever malloc maps it anew, first-touch page faults on as many bytes as the output has
    (with a fixed mmap threshold that doubled hashing's CPU time on the device)."""
    buf = getattr(_blocks, "buf", None)
    if buf is None:
        buf = _blocks.buf = memoryview(bytearray(READ_BYTES))
    return buf


class PrefixHasher:
    def __init__(self, path: Path, size: int, pool: Executor, written_prefix: int = 0, timings=None,
                 algorithm: str = ALGORITHM):
        self.path, self.size, self.pool = path, size, pool
        self.timings = timings
        self._sha = new_hash(algorithm)
        self._hashed = 0  # bytes fed to the hash
        self._frontier = written_prefix  # bytes known written from offset 0
        self._ranges: list[tuple[int, int]] = []  # written ranges beyond the frontier (a heap)
        self._lock = threading.Condition()  # notified whenever a hashing run ends
        self._running = False
        self.done = threading.Event()
        self.digest: str | None = None
        self.error: BaseException | None = None
        self._schedule()

    def written(self, start: int, end: int) -> None:
        with self._lock:
            heapq.heappush(self._ranges, (start, end))
            while self._ranges and self._ranges[0][0] <= self._frontier:
                self._frontier = max(self._frontier, heapq.heappop(self._ranges)[1])
        self._schedule()

    def offer(self, start: int, data) -> bool:
        """`data` was just written at `start`: hash it from memory if it extends the hashed prefix and
        no other thread is hashing this file (else it is re-read later). Returns whether it was.

        Where every byte before `start` is written but the file's hashing thread is still re-reading up
        to it (at most CATCH_UP_BYTES), the writer waits for it rather than leave its piece to be re-read
        too: otherwise a hash that fell behind once stayed behind, re-reading every later piece while
        writers kept landing theirs just past it (0.2-3.7 of 18.46 GB from memory in such runs, against
        13 otherwise: bench/HISTORY.md). The wait is bounded by that thread's own progress, which needs
        no other writer."""
        with self._lock:
            if self._hashed < start == self._frontier and start - self._hashed <= CATCH_UP_BYTES:
                self._lock.wait_for(lambda: self._hashed >= start and not self._running or self.error is not None,
                                    timeout=CATCH_UP_SECONDS)
            if self._running or start != self._hashed or self.error is not None:
                return False
            self._running = True
        started = time.perf_counter()
        try:
            self._sha.update(data)
            self._hashed += memoryview(data).nbytes
            self._finish_if_complete()
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.error = exc
            self.done.set()
        finally:
            with self._lock:
                self._running = False
                self._lock.notify_all()
            if self.timings is not None:
                self.timings.add("hash", time.perf_counter() - started)
        self._schedule()
        return True

    def _finish_if_complete(self) -> None:
        if self._hashed >= self.size and not self.done.is_set():
            self.digest = self._sha.hexdigest()
            self.done.set()

    def _schedule(self) -> None:
        with self._lock:
            if self._running or self._hashed >= self._frontier and self._hashed < self.size:
                return
            self._running = True
        self.pool.submit(self._advance)

    def _advance(self) -> None:
        try:
            # The written range is hashed through read-only mappings of the file: the page cache's
            # own pages, coherent with the writers, with no copy into a buffer (a pread's copy cost a
            # shard on tmpfs 9% of its CPU). Never a buffered reader: its read-ahead past the
            # frontier would keep bytes that are not written yet.
            started = time.perf_counter()
            fd = os.open(self.path, os.O_RDONLY)
            try:
                if os.fstat(fd).st_size < self.size:  # a mapping past the end would fault (SIGBUS)
                    raise OSError(f"{self.path} is shorter than its planned {self.size} bytes")
                while True:
                    with self._lock:
                        target = self._frontier
                        if self._hashed >= target:
                            self._running = False
                            self._lock.notify_all()
                            break
                    while self._hashed < target:
                        end = min(self._hashed + READ_BYTES, target)
                        self._hash_window(fd, self._hashed, end)
                        self._hashed = end
            finally:
                os.close(fd)
                if self.timings is not None:
                    self.timings.add("hash", time.perf_counter() - started)
            self._finish_if_complete()
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.error = exc
            self.done.set()
            with self._lock:
                self._lock.notify_all()  # a writer waiting to hash its piece gives up at once

    def _hash_window(self, fd: int, start: int, end: int) -> None:
        """Hash bytes [start, end) through a mapping of just that window, unmapped at once: one
        mapping of the whole file would keep every page hashed so far in this process's RSS (page
        cache, but counted), which would then grow with the output."""
        base = start - start % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(fd, end - base, prot=mmap.PROT_READ, offset=base) as mapped, memoryview(mapped) as view:
            self._sha.update(view[start - base:])

    def result(self) -> str:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.digest


def file_digest(path: Path, algorithm: str = ALGORITHM, chunk: int = READ_BYTES) -> str:
    h = new_hash(algorithm)
    view = _block() if chunk == READ_BYTES else memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def sha256_file(path: Path, chunk: int = READ_BYTES) -> str:
    return file_digest(path, "sha256", chunk)
