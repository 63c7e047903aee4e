"""Mapped reads of an input in RAM that another process cannot turn into SIGBUS.

A read-only mapping of a tmpfs file saves the copy a pread makes (execute/tasks.py maps an input in RAM),
but a file truncated while a mapping of it is read kills the process with SIGBUS, naming nothing (once
in about 40 tries in issue 39). Python cannot catch SIGBUS (its handler runs later, on the main thread,
while the faulting instruction faults again), so it is prevented instead: a file is mapped only under a
read lease (fcntl F_SETLEASE), which makes another process's truncate(2), or open(2) for writing, wait
(non-blocking opens, like coreutils' truncate, fail) until this process lets go. The kernel says so
with SIGIO; the handler marks the file as changing, no new mapping of it is made (the next read of it
fails naming it), and the lease is released once the last view of it goes, so the other process waits
only for the chunks in flight, never past /proc/sys/fs/lease-break-time (45 s).

Every local input takes its lease when it is opened (before the run reads a byte), so a change by another
process during the run ends the run at the file's next read, naming it, whether its reads are mappings or
preads. Without a lease (a file this user does not own, a file already open for writing, a filesystem
without leases, or a ShardFiles made off the main thread, where no SIGIO handler can be set) a file is
read with pread, which names a file that shrank, and is never mapped.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import signal
import threading
import weakref
from pathlib import Path

import numpy as np

from ckpttool.errors import InputError
from ckpttool.io.safetensors import read_bytes

MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Linux: fill a new mapping's page table entries as it is made (elsewhere 0: each page faults in on first touch)"""
_F_SETLEASE, _F_GETLEASE = getattr(fcntl, "F_SETLEASE", None), getattr(fcntl, "F_GETLEASE", None)
_SIGIO = getattr(signal, "SIGIO", None)


class _Lease:
    __slots__ = ("fd", "path", "views", "changing", "held")

    def __init__(self, fd: int, path: Path, held: bool):
        self.fd, self.path, self.held = fd, path, held
        self.views = 0
        self.changing = False


_leases: dict[int, _Lease] = {}  # fd -> its lease (held or not) in this process
_lock = threading.Lock()
"""never waited for by the SIGIO handler or a view's end (either may run in a thread that holds it): they
leave their work to whoever holds it, in _gone and `changing`"""
_gone: list[_Lease] = []  # one entry per view ended, counted off under _lock
_installed = False


def install() -> bool:
    """Take SIGIO, where a lease break is announced: from the main thread, where its default (ending the
    process) is still set. Whether leases can be used in this process."""
    global _installed
    if _installed or _F_SETLEASE is None or _SIGIO is None:
        return _installed
    if threading.current_thread() is threading.main_thread() and signal.getsignal(_SIGIO) == signal.SIG_DFL:
        signal.signal(_SIGIO, _on_sigio)
        _installed = True
    return _installed


def _on_sigio(signum, frame) -> None:
    """A lease is being broken: which one F_GETLEASE says (it reports the target, F_UNLCK, during a break)."""
    for lease in list(_leases.values()):
        if lease.held and not lease.changing:
            try:
                breaking = fcntl.fcntl(lease.fd, _F_GETLEASE) == fcntl.F_UNLCK
            except OSError:
                breaking = True
            if breaking:
                lease.changing = True
    _settle()


def _settle() -> None:
    """Count off ended views and release the leases due, unless another thread (or this one, interrupted by
    the handler) holds the lock: it does so before it lets go."""
    if _lock.acquire(blocking=False):
        try:
            _release_due()
        finally:
            _lock.release()


def _release_due() -> None:
    while _gone:
        _gone.pop().views -= 1
    for lease in _leases.values():
        if lease.held and lease.changing and lease.views == 0:
            try:
                fcntl.fcntl(lease.fd, _F_SETLEASE, fcntl.F_UNLCK)
            except OSError:
                pass
            lease.held = False


def _lease_for(fd: int, path: Path) -> _Lease:
    lease = _leases.get(fd)
    if lease is None:
        held = False
        if _installed:
            try:
                fcntl.fcntl(fd, _F_SETLEASE, fcntl.F_RDLCK)
                held = True
            except OSError:  # EAGAIN: open for writing somewhere; EACCES: not ours; EINVAL: no leases here
                pass
        lease = _leases[fd] = _Lease(fd, path, held)
    return lease


def watch(fd: int, path: Path) -> None:
    """Take a read lease on an input as it is opened (io/checkpoint.py): from then on another process that
    truncates it or opens it for writing waits for this one, which stops reading the file (`check`)."""
    with _lock:
        _lease_for(fd, path)


def check(fd: int) -> None:
    """Raise, naming the file, if another process began to change it since it was opened (a lease break)."""
    lease = _leases.get(fd)
    if lease is not None and lease.changing:
        _settle()
        raise _changing(lease.path)


def _changing(path: Path) -> InputError:
    return InputError("the file is being written or truncated by another process while this run reads it; the "
                      "tensors journalled so far were read before that", file=path,
                      fix="let that process finish, then rerun the same command with --overwrite (--resume cannot "
                          "trust an input that changed)")


def mapped_range(fd: int, path: Path, start: int, nbytes: int) -> np.ndarray:
    """Bytes [start, start + nbytes) of the file open at `fd`, as a read-only view of a mapping of just that
    range, no copy, while this process holds a read lease on it; else (no lease) read with pread. A file
    another process began to change is an error naming it."""
    with _lock:
        _release_due()
        lease = _lease_for(fd, path)
        changing = lease.changing
        held = lease.held and not changing
        if held:
            lease.views += 1
        _release_due()
    if _gone:  # a view that ended while the lock was held here
        _settle()
    if changing:
        raise _changing(path)
    if not held:
        return read_bytes(fd, start, nbytes, path)
    try:
        size = os.fstat(fd).st_size
        if start + nbytes > size:
            raise InputError(f"unexpected end of file at byte {size}", file=path,
                             fix="the file changed or was truncated while reading; re-download it")
        first = start - start % mmap.ALLOCATIONGRANULARITY
        window = _Window(fd, start + nbytes - first, flags=mmap.MAP_SHARED | MAP_POPULATE, prot=mmap.PROT_READ,
                         offset=first)
    except BaseException:
        _view_gone(lease)
        raise
    weakref.finalize(window, _view_gone, lease)  # when the last view of it goes, before it is unmapped
    return np.frombuffer(window, np.uint8, nbytes, start - first)


class _Window(mmap.mmap):
    """A mapping whose end can be watched (weakref.finalize)."""


def _view_gone(lease: _Lease) -> None:
    _gone.append(lease)
    _settle()


def forget(fd: int) -> None:
    """`fd` is being closed: its lease, held or not, goes with it."""
    with _lock:
        _leases.pop(fd, None)


def forget_inherited() -> None:
    """In a forked child: the leases are the parent's (on descriptions it keeps open); this process takes its own."""
    with _lock:
        _leases.clear()
