"""malloc_trim and statfs's filesystem type, which Python's os module lacks, reached through ctypes;
no-ops off glibc/Linux.

release_free_memory hands memory glibc keeps in its arenas after frees back to the OS. The
executor calls it once, when the GPU takes over from the CPU transforms that ran while CUDA
started: their dead fp32 temporaries otherwise stay in RSS underneath the new pinned buffers.

Two alternatives went to the device together and were dropped together (bench/HISTORY.md,
commit 210c9b8): a fixed mmap threshold (every chunk buffer mmapped and returned on free) brought
peak RSS from 1.9 to 1.4 GiB but its page faults nearly doubled hashing's CPU time; and
sync_file_range write-behind on every piece started the disk ~1.5 s earlier, but page-cache
writes then took 2.6x the thread time (blocked in it) and the disk sustained 1.4-1.7 GB/s instead
of 1.8-2.2. That run was slower (2.9x vs 3.4x the reference); it could not tell the two apart.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
except OSError:  # pragma: no cover - no C library to load
    _libc = None
_malloc_trim = getattr(_libc, "malloc_trim", None)
if _malloc_trim is not None:
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int


def release_free_memory() -> bool:
    """Return free heap memory to the OS (glibc; True where it released some)."""
    return _malloc_trim is not None and _malloc_trim(0) == 1


_statfs = getattr(_libc, "statfs", None)
_MEMORY_FS = {0x01021994, 0x858458F6}  # TMPFS_MAGIC, RAMFS_MAGIC


def in_memory_fs(path) -> bool:
    """Whether `path` is on tmpfs or ramfs (Linux statfs f_type, the first word of struct statfs on
    every architecture); False where that cannot be told."""
    if _statfs is None:
        return False
    buf = (ctypes.c_long * 32)()  # struct statfs is 120 bytes on 64-bit Linux
    try:
        if _statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
            return False
    except (OSError, ValueError, TypeError):
        return False
    return (buf[0] & 0xFFFFFFFF) in _MEMORY_FS


_renameat2 = getattr(_libc, "renameat2", None)
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1


def rename_noreplace(src, dst) -> None:
    """Rename `src` to `dst` unless `dst` exists (FileExistsError), in one step where the kernel and the
    filesystem can (renameat2 RENAME_NOREPLACE: Linux 3.15+, glibc 2.28+), else by a hard link (which fails
    on an existing name) and an unlink, else, last, a check and a rename."""
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, 0):
            raise OSError(err, os.strerror(err), str(dst))
    try:
        os.link(src, dst)
    except FileExistsError:
        raise
    except OSError:
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst)) from None
        os.rename(src, dst)
        return
    os.unlink(src)
