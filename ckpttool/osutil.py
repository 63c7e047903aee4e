"""Two Linux/glibc calls Python's os module lacks, reached through ctypes; each a no-op elsewhere.

- start_writeback: sync_file_range(SYNC_FILE_RANGE_WRITE) starts writing a just-written range to
  disk without waiting for it. Without it the kernel holds dirty pages until the next journal
  commit's fdatasync (or its own thresholds, 10% of RAM), and the disk idled for the first ~2 s of
  every run (bench/RESULTS.md).
- return_freed_buffers: a fixed mmap threshold, so chunk-sized buffers are mmapped and go back to
  the OS when freed. glibc's default raises the threshold after the first free and then keeps freed
  buffers in per-thread arenas: with 8 workers that held ~0.6 GiB of dead chunks in RSS.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_SYNC_FILE_RANGE_WRITE = 2
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 << 20

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
except OSError:  # pragma: no cover - no C library to load
    _libc = None
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int
_mallopt = getattr(_libc, "mallopt", None)
if _mallopt is not None:
    _mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _mallopt.restype = ctypes.c_int


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing [offset, offset+nbytes) of fd out now. A hint: errors are
    ignored, and durability still comes from fdatasync."""
    if _sync_file_range is not None and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def return_freed_buffers() -> bool:
    """Make allocations of MMAP_THRESHOLD bytes and up come from mmap and return on free
    (process-wide; True where glibc took it)."""
    return _mallopt is not None and _mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
