"""The staging directory DST/.ckpttool-partial: output files created at their final size (header and a container's
framing written), tensors pwritten at their planned offsets, and a journal of durable work for --resume. publish/
turns a finished one into the output."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from ckpttool import defaults, faults
from ckpttool.errors import OutputError
from ckpttool.execute.osutil import rename_noreplace
from ckpttool.io.hashing import ALGORITHM, PrefixHasher
from ckpttool.io.safetensors import printable
from ckpttool.io.layout import JOURNAL, PARTIAL_DIR, PLAN_FILE
from ckpttool.plan.types import Plan
from ckpttool.timing import Timings

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


NO_SPACE_FIX = ("free space on that filesystem, then rerun the same command with --resume: the work journalled in "
                "DST/.ckpttool-partial stands, and the free-space check then counts only what is left to write")


def disk_error(exc: OSError, path: object) -> OutputError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutputError(f"no space left on device ({exc.strerror})", file=path, fix=NO_SPACE_FIX)
    return OutputError(f"write failed: {exc.strerror}", file=path, fix="check the output filesystem, then --resume")


class CommitRequest:
    """A wish, from outside the executor, that finished work be journalled now rather than at the next
    timed commit: hub/stream.py's fetcher asks while it waits for an input file to be freed, which
    happens only once that file's tensors are journalled. A Future, so the executor can wait on it
    beside its tasks and wake at once; cleared by each commit, so a waiter that still needs one asks again."""

    def __init__(self):
        self._lock = threading.Lock()
        self.future: Future = Future()

    def ask(self) -> None:
        with self._lock:
            if not self.future.done():
                self.future.set_result(None)

    def asked(self) -> bool:
        return self.future.done()

    def clear(self) -> None:
        with self._lock:
            if self.future.done():
                self.future = Future()


class Staging:
    """DST/.ckpttool-partial: output files at their final size, plus plan.json and the journals.

    Rank 0 (or a single process) creates it; under torchrun the other ranks join it, each writing
    its own files and its own journal, so no two processes ever append to the same file.
    """

    def __init__(self, dst: Path, plan: Plan, *, resume: bool, overwrite: bool = False, rank: int = 0,
                 timings: Timings | None = None, inputs: dict | None = None, dst_before: dict | None = None):
        self.dst = Path(dst)
        self.timings = timings or Timings()
        self.dir = self.dst / PARTIAL_DIR
        self.plan = plan
        self.plan_hash = plan.hash
        self.done: set[tuple[str, str]] = set()
        self.published: set[str] = set()
        self.dst_before = dst_before or {}
        """DST's entries when the run began (publish.destination.snapshot): all publish may replace"""
        plan_path = self.dir / PLAN_FILE
        journal = self.dir / (JOURNAL if rank == 0 else f"journal.{rank}.jsonl")
        if os.path.islink(self.dir):
            raise OutputError("the staging directory is a symlink; ckpttool never creates one", file=self.dir,
                              fix="remove it (it is not ckpttool's), then run again")
        if rank == 0 and not (resume and plan_path.exists()):
            # --overwrite, or a --resume of a run killed before its plan was saved: start afresh
            if self.dir.exists():
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True)
            atomic_write(plan_path, json.dumps({"plan_hash": self.plan_hash, "resume_key": resume_key(plan),
                                                "inputs": inputs, "dst_before": self.dst_before,
                                                "plan": plan.to_json()}).encode())
        else:
            self.dst_before = self._check_resumable(plan_path, inputs).get("dst_before") or {}
            self._load_journals()
        self._open(journal)

    def fork_rank(self, rank: int | str, timings: Timings) -> "Staging":
        """This staging as forked rank `rank` joins it (execute/forked.py; under torchrun `<rank>.<fork>`): the
        plan, its check and the journals read so far are this process's own, so only the rank's journal, files
        and hashes are new."""
        joined = object.__new__(Staging)
        joined.dst, joined.timings, joined.dir, joined.plan, joined.plan_hash = (
            self.dst, timings, self.dir, self.plan, self.plan_hash)
        joined.done, joined.published = set(self.done), set(self.published)
        joined._open(self.dir / f"journal.{rank}.jsonl")
        return joined

    def _open(self, journal: Path) -> None:
        self.journal_path = journal
        try:
            self._journal = os.open(journal, os.O_RDWR | os.O_APPEND | os.O_CREAT | NOFOLLOW, 0o644)
            end = os.fstat(self._journal).st_size
            if end and os.pread(self._journal, 1, end - 1) != b"\n":
                self._append(b"\n")  # a line torn by a kill or a full disk stays apart from the next one
        except OSError as exc:
            raise disk_error(exc, journal) from None
        self.fds: dict[str, int] = {}
        # each output file is hashed while it is written (its contiguous written prefix)
        self._hash_pool = ThreadPoolExecutor(min(16, defaults.cores(), max(1, len(self.plan.files))),
                                             thread_name_prefix="ckpttool-hash")
        self._hashers: dict[str, PrefixHasher] = {}
        self.on_commit: Callable[[list[tuple[str, str]]], None] | None = None
        """told of every batch once it is journalled (hub/stream.py deletes the inputs nothing needs any more)"""
        self.commit_request = CommitRequest()

    def _append(self, data: bytes) -> None:
        """Append to this process's journal and make it durable; a full disk is an error naming the journal.
        Written with os.write, not through a buffer that would try the lost bytes again at close."""
        try:
            faults.point("journal")
            view = memoryview(data)
            while len(view):
                view = view[os.write(self._journal, view):]
            os.fsync(self._journal)
        except OSError as exc:
            raise disk_error(exc, self.journal_path) from None

    def _check_resumable(self, plan_path: Path, inputs: dict | None) -> dict:
        """The interrupted run planned the same thing from the same input bytes (by each input file's
        size, mtime, ctime and sampled content), else --resume would mix old and new tensors."""
        fix = "rerun with the original arguments and inputs, or --overwrite to start over"
        try:
            saved = json.loads(plan_path.read_bytes())
        except (OSError, ValueError):
            raise OutputError("--resume: the interrupted run's plan.json is unreadable", file=plan_path,
                              fix="--overwrite to start over") from None
        if not isinstance(saved, dict) or saved.get("resume_key") != resume_key(self.plan):
            raise OutputError("--resume: the interrupted run was planned for different inputs or options",
                              file=plan_path, fix=fix)
        if inputs is not None and saved.get("inputs") != inputs:
            raise _inputs_changed(saved.get("inputs") or {}, inputs, plan_path)
        return saved

    def _load_journals(self) -> None:
        for path in sorted(self.dir.glob("journal*.jsonl")):
            for line in path.read_bytes().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a line torn by a kill: that work is simply redone
                if "published" in entry:
                    self.published.add(entry["published"])
                else:
                    self.done.add((entry["f"], entry["t"]))

    def open_files(self, files: set[str] | None = None) -> None:
        """Create (or, resuming, reopen) the output files at their final size; `files`: one rank's share."""
        for f in self.plan.files:
            if f.name in self.published or (files is not None and f.name not in files):
                continue
            path = self.dir / f.name
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o644)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise OutputError("a staged output file is a symlink; ckpttool never creates one", file=path,
                                      fix="delete the staging directory (or --overwrite) and run again") from None
                raise disk_error(exc, path) from None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # a hard link would write into its other name
                os.close(fd)
                raise OutputError("a staged output file is not a regular file with one link; ckpttool never creates "
                                  "that", file=path, fix="delete the staging directory (or --overwrite) and run again")
            fresh = st.st_size != f.size
            if fresh:
                self.done = {(fn, t) for fn, t in self.done if fn != f.name}
            try:
                if fresh:
                    os.ftruncate(fd, 0)
                    for at, data in ((0, f.header), *f.fixed):  # a container's framing (DCP) in offset order
                        pwrite_all(fd, data, at)
                    os.ftruncate(fd, f.size)
            except OSError as exc:
                os.close(fd)
                raise disk_error(exc, path) from None
            self.fds[f.name] = fd
            if not any(fn == f.name for fn, _ in self.done):  # nothing written by an earlier run
                hasher = self._hashers[f.name] = PrefixHasher(path, f.size, self._hash_pool,
                                                              written_prefix=len(f.header), timings=self.timings)
                for at, data in f.fixed:
                    hasher.written(at, at + len(data))

    def pwrite(self, file: str, data, offset: int) -> None:
        """Write `data` (final bytes) at `offset`; the file's running hash takes it from memory when
        it extends the hashed prefix."""
        try:
            faults.point("pwrite")
            pwrite_all(self.fds[file], data, offset)
        except OSError as exc:
            raise disk_error(exc, self.dir / file) from None
        hasher = self._hashers.get(file)
        if hasher is not None:
            nbytes = memoryview(data).nbytes
            if hasher.offer(offset, data):
                self.timings.count("hash_bytes_from_memory", nbytes)
            hasher.written(offset, offset + nbytes)

    def copy_range(self, file: str, src_fd: int, src_offset: int, nbytes: int, offset: int) -> bool:
        """Copy nbytes of an input at src_offset to `offset` of `file` inside the kernel (copy_file_range:
        no bytes through Python; on filesystems that support it, shared extents). False, having
        written nothing, where the kernel cannot (an older kernel across filesystems, no syscall, an
        input shorter than planned): the caller reads and writes instead, which names the problem."""
        if not hasattr(os, "copy_file_range"):
            return False
        fd, done = self.fds[file], 0
        try:
            faults.point("pwrite")
            while done < nbytes:
                n = os.copy_file_range(src_fd, fd, nbytes - done, src_offset + done, offset + done)
                if n == 0:
                    return False if not done else self._short(file)
                done += n
            self.written(file, offset, offset + nbytes)
        except OSError as exc:
            if not done and exc.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF):
                return False
            raise disk_error(exc, self.dir / file) from None
        return True

    def _short(self, file: str) -> bool:
        raise OutputError("an input ended while being copied", file=self.dir / file,
                          fix="the input changed during the run; check it, then rerun with --resume")

    def commit(self, entries: list[tuple[str, str]]) -> None:
        """Make written tensors durable, then record them: the journal never runs ahead of the data."""
        with self.timings.activity("fdatasync"):
            for file in sorted({f for f, _ in entries}):
                try:
                    os.fdatasync(self.fds[file])
                except OSError as exc:
                    raise disk_error(exc, self.dir / file) from None
        faults.point("commit")
        self._append(b"".join(json.dumps({"f": f, "t": t}).encode() + b"\n" for f, t in entries))
        self.done.update(entries)
        if self.on_commit is not None:
            self.on_commit(entries)

    def still_to_allocate(self) -> int:
        """Bytes the output files still need on disk: each staged file's size less what is allocated to it
        (files are sparse until written; a file already published needs nothing). What a resumed run's
        free-space check counts: the bytes an interrupted run wrote are on disk, journalled or not."""
        need = 0
        for f in self.plan.files:
            if f.name in self.published:
                continue
            try:
                st = os.lstat(self.dir / f.name)
            except FileNotFoundError:
                need += f.size
                continue
            need += max(0, f.size - st.st_blocks * 512) if stat.S_ISREG(st.st_mode) else f.size
        return need

    def written(self, file: str, start: int, end: int) -> None:
        """Bytes [start, end) of `file` hold their final contents (feeds the running hash). Said of each
        piece as it lands, not of a tensor once it is whole: a large tensor split over every mp file (an
        attention projection) then no longer holds each file's hash back until it is done (with 16 workers
        on the 2-core box that left most of the hashing for after the last write; bench/HISTORY.md)."""
        hasher = self._hashers.get(file)
        if hasher is not None:
            hasher.written(start, end)

    def save_digests(self) -> None:
        """Wait for this process's running hashes and leave each beside its file, for whoever
        publishes (rank 0, or a later --resume: the bytes are deterministic, so a digest stays true)."""
        for name, hasher in self._hashers.items():
            atomic_write(self.dir / f"{name}.{ALGORITHM}", hasher.result().encode())

    def close_files(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def close(self) -> None:
        self.close_files()
        self._hash_pool.shutdown(wait=True, cancel_futures=True)
        if self._journal >= 0:
            os.close(self._journal)
            self._journal = -1

    def saved_digests(self) -> dict[str, str]:
        """The running hashes left beside their files, by this or another rank's process."""
        digests = {}
        for f in self.plan.files:
            saved = self.dir / f"{f.name}.{ALGORITHM}"  # another hash's (an older version's) is redone
            if saved.exists():
                digests[f.name] = saved.read_text().strip()
        return digests

    def mark_published(self, name: str) -> None:
        """Journal that `name` has been moved into DST (a resumed publish skips it)."""
        self._append(json.dumps({"published": name}).encode() + b"\n")
        self.published.add(name)


def _inputs_changed(old: dict, new: dict, plan_path: Path) -> OutputError:
    """Why --resume refuses inputs that differ from the interrupted run's, and how to go on. A file put back
    (restored after a truncation, copied in again) has a new ctime whatever its bytes, and nothing proves
    its bytes are those the journalled tensors were made from, so the way on is to start over."""
    changed = sorted(n for n in set(old) | set(new) if old.get(n) != new.get(n))
    fields = ("size", "mtime", "ctime", "content")
    parts, put_back = [], 0
    for n in changed:
        a, b = old.get(n) or [None] * 4, new.get(n) or [None] * 4
        diff = [k for k, x, y in zip(fields, a, b) if x != y]
        same_bytes = n in old and n in new and "size" not in diff and "content" not in diff
        put_back += same_bytes
        parts.append(f"{printable(n)}: {', '.join(diff)}" + (" (same size and sampled bytes: put back?)"
                                                               if same_bytes else ""))
    shown = "; ".join(parts[:3]) + (f"; and {len(parts) - 3} more" if len(parts) > 3 else "")
    why = ("a file put back (restored or copied in again) always has a new ctime, and --resume cannot prove its "
           "bytes are those the journalled work was made from" if put_back else "the input is not the one the "
           "journalled work was made from")
    return OutputError(f"--resume: input file(s) changed since the interrupted run ({shown})", file=plan_path,
                       fix=f"{why}: rerun the same command with --overwrite instead of --resume to convert from the "
                           "start (the interrupted run's work is discarded)")


def resume_key(plan: Plan) -> str:
    """What journalled work depends on: the plan without the side files copied at publish (they are
    read then, so one that changed or went missing since does not invalidate the tensors written)."""
    body = plan.to_json()
    body.pop("src", None)
    body.pop("copies", None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def atomic_write(path: Path, data: bytes | None = None, *, copy_from: Path | None = None, replace: bool = True) -> None:
    """Write `data` (or stream the file `copy_from`) to `path` through a fresh temp file beside it,
    created exclusively under a random name (so a planted symlink is never followed), fsynced, then
    renamed over `path` (a rename replaces a symlink there, never its target). With `replace` False
    the rename fails with FileExistsError where `path` exists, in one step (osutil.rename_noreplace)."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".ckpttool-tmp", dir=path.parent)
    except OSError as exc:
        raise disk_error(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            if copy_from is None:
                f.write(data)
            else:
                with open(copy_from, "rb") as src:
                    shutil.copyfileobj(src, f, 8 << 20)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        (os.replace if replace else rename_noreplace)(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, FileExistsError) and not replace:
            raise
        if copy_from is not None and isinstance(exc, FileNotFoundError) and exc.filename == str(copy_from):
            raise OutputError("a file to copy from the input is gone", file=copy_from,
                              fix="restore it in the input directory, then rerun with --resume") from None
        raise disk_error(exc, path) from None


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (a fresh descriptor flushes what any process wrote)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

