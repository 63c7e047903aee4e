"""A CPU run's output files dealt to forked processes, each with its own interpreter lock.

One process's workers take turns on Python's GIL between their reads, dequant calls, writes and
hashes: on the 16-core device twelve workers kept twelve cores busy and sixteen no more, and the same
conversion in four forked processes of four workers took 0.73-0.97x the time (bench/HISTORY.md). So from
8 cores up, into tmpfs (defaults.layout), the run forks: this process stays rank 0, sets up the staging directory,
then forks ranks 1..n-1 before any thread of its own starts. Each rank converts its share of the output
files (distributed.assign_files) exactly as a torchrun rank does: its own journal, its own files' hashes
left beside them. Rank 0 publishes once every rank has finished. Tensors never cross processes, so the
bytes are those of a single process.

Each child reports through a pipe: progress as it goes, a heartbeat every HEARTBEAT_S, then its timings or
its error (a CkptError keeps its message, file, tensor and fix; an OSError its errno and file; a signal
which one). A child that dies without a word (a signal, the OOM killer), or goes CKPTTOOL_RANK_TIMEOUT_S without one
(stopped by SIGSTOP, hung), fails the run naming its rank; the work it journalled stands, for --resume. A
child dies with its parent (PR_SET_PDEATHSIG), and a failing parent kills its children before it reports.
A rank that fails sets ForkedRanks.abort, which rank 0's execute raises at once rather than finish its own
share first.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from ckpttool import defaults, faults, settings
from ckpttool.errors import CkptError, InputError, OutputError, PlanError, RecipeError, Stopped
from ckpttool.execute.device import resolve_device
from ckpttool.execute.executor import execute
from ckpttool.execute.staging import Staging
from ckpttool.plan.types import Plan
from ckpttool.timing import Timings

_LENGTH = struct.Struct("<Q")
HEARTBEAT_S = 1.0
"""a child says it is alive this often, whatever its work is doing"""
_KINDS = (InputError, PlanError, OutputError, RecipeError, CkptError)
"""the error classes a child's CkptError is rebuilt as in the parent (the first it is an instance of)"""


Share = Callable[[int, Callable[[int], None]], dict]
"""a rank's work: (rank, progress callback taking bytes written) -> its timings as Timings.to_json()"""


def layout(plan: Plan, device: str, workers: int | None, processes: int | None, *, one_process: bool,
           to_memory: bool, files: set[str] | None = None, share: int = 1) -> tuple[str, int, int]:
    """(device, processes, workers in each) of a run writing into tmpfs or not (`to_memory`; defaults.layout:
    by default it splits only into tmpfs), of `files` (a torchrun rank's share) or every file, on this node's
    cores shared by `share` torchrun ranks. Only a CPU run splits: `auto` is decided here, as execute would, so
    every process converts on the CPU; a run from the hub (its fetcher, `one_process`) stays one process, and so
    does one beside other Python threads: a lock one of them held at fork time would be held forever in the
    child (a library caller's threads, torch's)."""
    if device == "auto" and resolve_device(device, plan.bytes_to_write) == "cpu":
        device = "cpu"
    split = device == "cpu" and not one_process and can_fork() and threading.active_count() == 1
    count = len(plan.files) if files is None else len(files)
    processes, workers = defaults.layout(count, workers, processes, can_split=split, to_memory=to_memory, share=share)
    return device, processes, workers


def rank_share(rank0: Staging, plan: Plan, inputs, shares: list[set[str]], device: str, workers: int,
               max_memory: int, chunk_bytes: int, journal_tag: str = "") -> Share:
    """What forked rank r runs: join the staging directory rank 0 set up (`rank0`, as the fork left it),
    convert its share of the files, shares[r], as a torchrun rank would (its own journal, named
    `journal_tag` + r so that the forks of several torchrun ranks never share one; its files' hashes left
    beside them), and return its timings."""

    def share(rank: int, progress: Callable[[int], None]) -> dict:
        inputs.reopen()  # descriptors (and read leases, io/mapped.py) of this process's own
        clock = Timings()
        staging = rank0.fork_rank(f"{journal_tag}{rank}", clock)
        try:
            staging.open_files(shares[rank])
            with clock.phase("execute"):
                execute(plan, inputs, staging, max_memory=max_memory, workers=workers, device=device,
                        progress=progress, files=shares[rank], chunk_bytes=chunk_bytes)
            staging.save_digests()
        finally:
            staging.close()
        return clock.to_json()

    return share


def can_fork() -> bool:
    """Forked ranks are used on Linux only (macOS forbids much after fork; Windows has no fork)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


class ForkedRanks:
    """Ranks 1..n-1 of this run, each a forked child running `share`. Fork only from a process whose only
    thread is the main one (a lock held by another thread at fork time would never be released in the child).

    A thread per child reads its messages and, once its pipe closes, reaps it. A child that ends without
    finishing its share sets `abort` to its error at once, so rank 0 stops its own share (execute's `abort`)
    rather than finish it first."""

    def __init__(self, n: int, share: Share, where: Path):
        if threading.active_count() > 1:
            raise RuntimeError(f"forking ranks with {threading.active_count()} threads running")
        self.where = where
        self.abort: Future = Future()
        """set to the first failed rank's error"""
        self.children: dict[int, tuple[int, int]] = {}  # rank -> (pid, read end of its pipe)
        self.reports: dict[int, dict] = {}
        self.failed: dict[int, BaseException] = {}
        self._readers: list[threading.Thread] = []
        self._lock = threading.Lock()
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        for rank in range(1, n):
            try:
                r, w = os.pipe()
                pid = os.fork()
            except OSError as exc:  # a process or file limit (a container's pids.max)
                self.kill()
                raise OutputError(f"could not start conversion process rank {rank} of {n}: {exc.strerror or exc}",
                                  file=where, fix="rerun with --processes 1 (or fewer), adding --resume") from None
            if pid == 0:  # the child: never returns
                os.close(r)
                _child(rank, w, share, parent)
            os.close(w)
            self.children[rank] = (pid, r)

    def forward(self, progress: Callable[[int], None] | None) -> None:
        """Read every child's messages on a thread each, passing its progress on to `progress`."""
        for rank, (pid, fd) in self.children.items():
            t = threading.Thread(target=self._read, args=(rank, pid, fd, progress), name=f"ckpttool-rank{rank}",
                                 daemon=True)
            t.start()
            self._readers.append(t)

    def _read(self, rank: int, pid: int, fd: int, progress: Callable[[int], None] | None) -> None:
        said, silent = None, None
        buf = bytearray()
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        heard = tick = time.monotonic()
        limit = settings.get("CKPTTOOL_RANK_TIMEOUT_S")  # a child silent this long is ended and fails the run
        try:
            while True:
                ready = poller.poll(int(HEARTBEAT_S * 1000))
                now = time.monotonic()
                if now - tick > 3 * HEARTBEAT_S:  # this process was itself stopped (Ctrl-Z): not the child's silence
                    heard = now
                tick = now
                if not ready:
                    if now - heard > limit:
                        silent = now - heard
                        break
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                heard = now
                buf += chunk
                while len(buf) >= _LENGTH.size and len(buf) >= _LENGTH.size + (n := _LENGTH.unpack_from(buf)[0]):
                    kind, value = pickle.loads(bytes(buf[_LENGTH.size:_LENGTH.size + n]))
                    del buf[:_LENGTH.size + n]
                    if kind == "progress":
                        if progress is not None:
                            progress(value)
                    elif kind == "done":
                        self.reports[rank] = value
                    elif kind != "alive":
                        said = value
        except Exception:  # noqa: BLE001 - a message cut short by the child's death
            pass
        finally:
            os.close(fd)
        state = _state(pid) if silent is not None else None
        if silent is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        status = _reap(pid)
        if rank in self.reports:
            return
        error = (self._silent(rank, pid, silent, state) if silent is not None
                 else _rebuild(rank, said) if said is not None else self._died(rank, status))
        with self._lock:
            self.failed[rank] = error
            if not self.abort.done():
                self.abort.set_exception(error)

    def _silent(self, rank: int, pid: int, seconds: float, state: str | None) -> CkptError:
        how = "has been stopped (SIGSTOP)" if state in ("T", "t") else "has sent nothing (hung?)"
        return OutputError(f"conversion process rank {rank} (pid {pid}) {how} for {seconds:.0f} s, past the "
                           f"{settings.get('CKPTTOOL_RANK_TIMEOUT_S'):g} s liveness limit; it was ended and the run stopped; the work it "
                           "journalled stands", file=self.where,
                           fix="rerun the same command with --resume (a rank stopped on purpose must be continued, "
                               "kill -CONT, within CKPTTOOL_RANK_TIMEOUT_S)")

    def _died(self, rank: int, status: int | None) -> CkptError:
        how = ("ended" if status is None else f"was killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
               else f"exited with status {os.waitstatus_to_exitcode(status)}")
        return OutputError(f"conversion process rank {rank} {how} without finishing its share; the work it "
                           "journalled stands", file=self.where,
                           fix="rerun the same command with --resume (if the OOM killer stopped it, lower "
                               "--max-memory or --workers)")

    def wait(self) -> list[dict]:
        """Wait for every child; raise the first failed rank's error. Returns their timings."""
        if not self._readers:
            self.forward(None)
        for t in self._readers:
            t.join()
        self.children.clear()
        if self.abort.done():
            self.abort.result()  # the first failure
        for rank in sorted(self.failed):
            raise self.failed[rank]
        return [self.reports[r] for r in sorted(self.reports)]

    def kill(self) -> None:
        """Stop every child at once (this process is failing) and reap it."""
        with self._lock:
            if not self.abort.done():  # the pipes close now: this process's failure, not the children's
                self.abort.set_result(None)
        for pid, _ in self.children.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not self._readers:
            for pid, fd in self.children.values():
                os.close(fd)
                _reap(pid)
        for t in self._readers:
            t.join(timeout=10)
        self.children.clear()


def _state(pid: int) -> str | None:
    """The process's state letter in /proc (T: stopped), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _reap(pid: int) -> int | None:
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return None


def _child(rank: int, fd: int, share: Share, parent: int) -> None:
    code = 1
    lock = threading.Lock()  # the heartbeat's thread and this one write whole messages to one pipe

    def send(kind: str, value) -> None:
        with lock:
            _send(fd, kind, value)

    try:
        _die_with(parent)
        faults.RANK = rank
        threading.Thread(target=_heartbeat, args=(send,), name="ckpttool-heartbeat", daemon=True).start()

        def progress(n: int) -> None:
            send("progress", n)

        report = share(rank, progress)
        send("done", report)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        try:
            send("error", _payload(exc))
        except BaseException:  # noqa: BLE001 - the parent then reports a silent death
            pass
    finally:
        os._exit(code)  # no atexit, no finalizers: the parent's objects (its lock, its journal) are its own


def _heartbeat(send: Callable[[str, object], None]) -> None:
    """Tell the parent this process is alive (and not stopped) every HEARTBEAT_S, until the pipe closes."""
    while True:
        time.sleep(HEARTBEAT_S)
        try:
            send("alive", None)
        except OSError:
            return


def _die_with(parent: int) -> None:
    """Ask the kernel to SIGKILL this child when its parent dies, so no orphan goes on writing."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        pass
    if os.getppid() != parent:  # the parent died before the request took
        os._exit(1)


def _send(fd: int, kind: str, value) -> None:
    data = pickle.dumps((kind, value))
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while len(view):
        view = view[os.write(fd, view):]


def _payload(exc: BaseException) -> tuple:
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C reaches every process of the terminal's group
        return ("signal", signal.SIGINT)
    if isinstance(exc, Stopped):
        return ("signal", exc.signum)
    if isinstance(exc, CkptError):
        kind = next(k for k in _KINDS if isinstance(exc, k))
        return "ckpt", kind, exc.message, exc.file, exc.tensor, exc.fix
    if isinstance(exc, OSError):  # e.g. a full disk where no CkptError names it: the parent's CLI does
        return "os", exc.errno, exc.strerror, exc.filename
    return "bug", f"{type(exc).__name__}: {str(exc)[:300]}", "".join(traceback.format_exception(exc))


def _rebuild(rank: int, payload: tuple) -> BaseException:
    if payload[0] == "signal":
        return Stopped(payload[1], f"conversion process rank {rank}")
    if payload[0] == "ckpt":
        _, kind, message, file, tensor, fix = payload
        return kind(message, file=file, tensor=tensor, fix=fix)
    if payload[0] == "os":
        return OSError(*payload[1:3], payload[3]) if payload[3] is not None else OSError(*payload[1:3])
    error = RuntimeError(f"conversion process rank {rank} failed: {payload[1]}")
    error.add_note(f"rank {rank}'s traceback:\n{payload[2]}")  # shown with CKPTTOOL_DEBUG=1
    return error
