"""malloc_trim, which Python's os module lacks, reached through ctypes; a no-op off glibc.

release_free_memory hands memory glibc keeps in its arenas after frees back to the OS. The
executor calls it once, when the GPU takes over from the CPU transforms that ran while CUDA
started: their dead fp32 temporaries otherwise stay in RSS underneath the new pinned buffers.

Two alternatives went to the device together and were dropped together (bench/RESULTS.md,
commit 210c9b8): a fixed mmap threshold (every chunk buffer mmapped and returned on free) brought
peak RSS from 1.9 to 1.4 GiB but its page faults nearly doubled hashing's CPU time; and
sync_file_range write-behind on every piece started the disk ~1.5 s earlier, but page-cache
writes then took 2.6x the thread time (blocked in it) and the disk sustained 1.4-1.7 GB/s instead
of 1.8-2.2. That run was slower (2.9x vs 3.4x the reference); it could not tell the two apart.
"""

from __future__ import annotations

import ctypes
import ctypes.util

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
except OSError:  # pragma: no cover - no C library to load
    _libc = None
_malloc_trim = getattr(_libc, "malloc_trim", None)
if _malloc_trim is not None:
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int


def release_free_memory() -> bool:
    """Return free heap memory to the OS (glibc; True where it released some)."""
    return _malloc_trim is not None and _malloc_trim(0) == 1
