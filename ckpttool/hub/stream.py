"""Convert while downloading, on bounded disk: the input of `convert REPO_ID DST` streams through DST.

Files are fetched in the order the executor consumes them (its tasks in read order), at most K on
disk at once (the one arriving included), into DST/.ckpttool-partial/fetch/, hashed as they arrive.
Only once verified (the hub's size, the header bytes the plan was made from, the LFS sha256 or git
sha1) is a file moved to .../input/, where the executor's reads wait for it; a file that fails is
deleted and fetched once more, never converted. When every tensor read from a file is durable (in
the journal) the file is deleted, so no --resume needs it again; a fetcher waiting for room asks
for that commit at once rather than at the next timed one; an interrupted fetch is continued
with a range request after its prefix is hashed again. Files this commit already has in the HF
cache are read where they are: never copied, never deleted. Nothing outside DST is written.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

from huggingface_hub.file_download import http_get

from ckpttool.errors import InputError, OutputError
from ckpttool.execute.staging import Staging, disk_error
from ckpttool.hub import guard
from ckpttool.hub.client import HUB_FAILURES, SilentTqdm, translate
from ckpttool.hub.remote import RemoteCheckpoint, RemoteRepo
from ckpttool.hub.schedule import most_live, reads, schedule
from ckpttool.hub.sink import Aborted, HashingSink
from ckpttool.io.layout import STREAM_FETCH, STREAM_INPUT
from ckpttool.plan.types import Plan

NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
REFETCH_ATTEMPTS = 1


class StreamingCheckpoint(RemoteCheckpoint):
    """A RemoteCheckpoint whose files arrive while the executor runs (see the module docstring)."""

    def __init__(self, repo: RemoteRepo, staging_dir: Path, *, max_files: int):
        super().__init__(repo, Path(staging_dir) / STREAM_INPUT)
        self.fetch_dir = Path(staging_dir) / STREAM_FETCH
        self.max_files = max_files
        self.in_place = {n: p for n in self.files if (p := repo.cached(n)) is not None}
        guard.expect(repo.repo_id, {n: f.size for n, f in repo.files.items()})  # transfers stop at the listed sizes
        self._cond = threading.Condition()
        self._ready: dict[str, threading.Event] = {}
        self._errors: dict[str, BaseException] = {}
        self._users: dict[str, set[tuple[str, str]]] = {}
        self._reads: dict[tuple[str, str], tuple[str, ...]] = {}
        self._order: list[str] = []
        self._copies: list[str] = []
        self._resident = self._active = 0
        self._busy_since = 0.0
        self._closing = False
        self._thread: threading.Thread | None = None
        self._progress: Callable[[int], None] = lambda n: None
        self._ask_commit: Callable[[], None] = lambda: None
        self.files_needed_at_once = self.k = 0
        self.stats = {"bytes_fetched": 0, "download_seconds": 0.0, "files_fetched": 0, "files_reused": 0,
                      "refetched": [], "peak_disk_bytes": 0, "room_wait_seconds": 0.0}
        # seconds since start() of each input file's events, where overlap is lost (bench/hub_stream_bench.py):
        # room (waited for room from), fetch (started), ready (verified), read (first opened), freed
        self._t0 = time.monotonic()
        self.timeline: dict[str, dict[str, float]] = {}

    # -- what the executor sees ----------------------------------------------------------------------
    def paths(self) -> list[Path]:
        """The user's files this run reads (HF cache entries read in place), which DST must not hold."""
        return [self.in_place[n] for n in sorted(self.in_place)]

    def fd(self, fname: str) -> int:
        if fname not in self.in_place:
            self._wait(fname)
        with self._lock:
            fd = self._fds.get(fname)
            if fd is None:
                self._event(fname, "read")
                fd = self._fds[fname] = os.open(self.in_place.get(fname, self.root / fname), os.O_RDONLY)
            return fd

    def _wait(self, fname: str) -> None:
        ready = self._ready.get(fname)
        if ready is None:
            raise OutputError("the executor read an input file the stream did not plan to fetch", file=self.root / fname,
                              fix="report this as a ckpttool bug; rerun with --resume")
        while not ready.wait(0.5):
            if self._closing:
                raise Aborted()
        if fname in self._errors:
            raise self._errors[fname]

    # -- set-up ---------------------------------------------------------------------------------------
    def disk_reserve(self, plan: Plan) -> int:
        """Room for the input files on disk at once beside the output: the free-space check's share."""
        tasks, first, last = schedule(plan, self)
        streamed = [f for f in first if f not in self.in_place]
        k = max(self.max_files, most_live(first, last, streamed))
        return sum(sorted((self.repo.files[f].size or 0 for f in streamed), reverse=True)[:k])

    def plan_fetches(self, staging: Staging, files: set[str] | None = None) -> int:
        """What the executor will read, in its order; returns the bytes still to fetch."""
        tasks, first, last = schedule(staging.plan, self, staging.done, staging.published, files)
        for task in tasks:
            files = reads(task)
            for out, placed in task.pieces:
                self._reads[(out, placed.tensor.name)] = files
                for f in files:
                    self._users.setdefault(f, set()).add((out, placed.tensor.name))
        self._order = [f for f in first if f not in self.in_place]
        self.files_needed_at_once = most_live(first, last, self._order)
        self.k = max(self.max_files, self.files_needed_at_once)
        self._copies = list(staging.plan.copies)
        staging.on_commit = self.durable
        self._ask_commit = staging.commit_request.ask
        for d in (self.root, self.fetch_dir):
            if os.path.islink(d):
                raise OutputError("a staging folder is a symlink; ckpttool never creates one", file=d,
                                  fix="delete DST/.ckpttool-partial (or --overwrite) and run again")
            d.mkdir(parents=True, exist_ok=True)
        keep = set(self._order) | set(self._copies)
        for folder in (self.root, self.fetch_dir):  # an interrupted run's files that nothing reads any more
            for path in _files_under(folder):
                if path.relative_to(folder).as_posix() not in keep:
                    path.unlink()
        self._ready = {f: threading.Event() for f in self._order}
        return sum(self.repo.files[f].size or 0 for f in self._order)

    def start(self, progress: Callable[[int], None] | None = None) -> None:
        self._progress = progress or self._progress
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ckpttool-fetch", daemon=True)
        self._thread.start()

    def durable(self, entries: list[tuple[str, str]]) -> None:
        """Staging.on_commit: these tensors are journalled; delete each streamed file no tensor still needs."""
        freed = []
        with self._cond:
            for key in entries:
                for f in self._reads.pop(key, ()):
                    users = self._users.get(f)
                    if users is not None and key in users:
                        users.discard(key)
                        if not users and f in self._ready:
                            freed.append(f)
        if not freed:
            with self._cond:  # a fetcher waiting for room asks for the next commit
                self._cond.notify_all()
        for f in freed:
            self._event(f, "freed")
            self._sample_disk()
            with self._lock:
                fd = self._fds.pop(f, None)
            if fd is not None:
                os.close(fd)
            (self.root / f).unlink(missing_ok=True)
            with self._cond:
                self._resident -= 1
                self._cond.notify_all()

    def finish(self) -> dict:
        """Wait for the fetcher (the side files publish copies); raise what it failed with; the report."""
        if self._thread is not None:
            self._thread.join()
        for name in self._copies:
            if name in self._errors:
                raise self._errors[name]
        self._sample_disk()
        return self.report()

    def report(self) -> dict:
        s = self.stats
        seconds = s["download_seconds"]
        return {**s, "download_seconds": round(seconds, 3), "room_wait_seconds": round(s["room_wait_seconds"], 3),
                "timeline": self.timeline, "repo_id": self.repo.repo_id, "commit": self.repo.commit,
                "download_gb_per_s": round(s["bytes_fetched"] / seconds / 1e9, 3) if seconds > 0 else None,
                "files_in_place": sorted(self.in_place), "max_input_files": self.k,
                "input_files_needed_at_once": self.files_needed_at_once}

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        super().close()

    # -- the fetcher ----------------------------------------------------------------------------------
    def _run(self) -> None:
        for name in self._copies:  # small; publish copies them from here
            self._guarded(name, self._side_file)
        # one file at a time, in order: parallel transfers would share the link, so the file the
        # executor waits for would land later; the next file arrives while this one converts (on the
        # 2-core box the difference was within noise, bench/HISTORY.md)
        for name in self._order:
            with self._cond:
                # the file to free may only be waiting for its tensors' journal entries: ask for that
                # commit now, not within CKPTTOOL_JOURNAL_SECONDS, which held this transfer (bench/HISTORY.md)
                waited = time.monotonic()
                if self._resident >= self.k:
                    self._event(name, "room")
                while self._resident >= self.k and not self._closing:
                    self._ask_commit()
                    self._cond.wait()
                if self._closing:
                    break
                self._resident += 1
                self.stats["room_wait_seconds"] += time.monotonic() - waited
            self._event(name, "fetch")
            self._guarded(name, self._obtain)

    def _guarded(self, name: str, fetch: Callable[[str], None]) -> None:
        try:
            fetch(name)
        except BaseException as exc:  # noqa: BLE001 - raised in the thread that reads the file
            self._errors[name] = exc if not isinstance(exc, Aborted) else OutputError(
                "the run stopped while this file was being fetched", file=self.root / name,
                fix="rerun the same command with --resume")
        finally:
            if name in self._ready:
                self._event(name, "ready")
                self._ready[name].set()
            self._sample_disk()

    def _side_file(self, name: str) -> None:
        final = self.root / name
        cached = self.repo.cached(name)
        if cached is not None:  # the HF cache has it: a local copy of a small file, no request
            final.parent.mkdir(parents=True, exist_ok=True)
            final.unlink(missing_ok=True)
            shutil.copyfile(cached, final)
        self._obtain(name)

    def _obtain(self, name: str) -> None:
        """A verified copy of `name` at input/`name`: kept from an interrupted run, else fetched."""
        final, part = self.root / name, self.fetch_dir / name
        if os.path.lexists(final):
            if self._check_whole(final, name) is None:
                self.stats["files_reused"] += name in self._ready  # input files; side files are not counted
                return
            final.unlink()
        problem = None
        for attempt in range(REFETCH_ATTEMPTS + 1):
            problem = self._download(name, part, resume=attempt == 0)
            if problem is None:
                final.parent.mkdir(parents=True, exist_ok=True)
                os.replace(part, final)
                self.stats["files_fetched"] += name in self._ready
                return
            part.unlink(missing_ok=True)
            self.stats["refetched"].append(name)
        raise InputError(f"{name} failed verification after {REFETCH_ATTEMPTS} re-fetch ({problem}); it was deleted "
                         "and nothing was converted from it", file=self.repo.url(name),
                         fix="the hub copy or the network path is corrupt: retry later (--resume keeps the work "
                             "done), or check HF_ENDPOINT and any proxy between you and the hub")

    def _download(self, name: str, part: Path, *, resume: bool) -> str | None:
        """Fetch `name` into `part` (continuing what is there when `resume`); what is wrong with it, or None."""
        part.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(part, os.O_RDWR | os.O_CREAT | NOFOLLOW | (0 if resume else os.O_TRUNC), 0o644)
        with os.fdopen(fd, "r+b") as f:
            with HashingSink(f, self.repo.files[name], len(self.repo.headers.get(name, b"")), self._downloaded,
                              lambda: self._closing) as sink:
                have = sink.rehash()
                if have > (self.repo.files[name].size or 0):
                    f.truncate(0)
                    have = sink.rehash()
                self._busy(+1)
                try:
                    http_get(self.repo.url(name), sink, resume_size=have, headers=self.repo.http_headers(),
                             expected_size=self.repo.files[name].size, displayed_filename=name, tqdm_class=SilentTqdm)
                except Aborted:
                    raise
                except OSError as exc:
                    if "Consistency check failed" in str(exc):
                        return "truncated transfer: " + str(exc).splitlines()[0]
                    if exc.errno is not None:  # writing the file, not the transfer
                        raise disk_error(exc, part) from None
                    raise translate(exc, self.repo.where, False, missing=[name]) from exc
                except HUB_FAILURES as exc:
                    raise translate(exc, self.repo.where, False, missing=[name]) from exc
                finally:
                    self._busy(-1)
                return sink.problem(self.repo.headers.get(name))

    def _check_whole(self, path: Path, name: str) -> str | None:
        with open(path, "rb") as f, HashingSink(f, self.repo.files[name], len(self.repo.headers.get(name, b"")),
                                                 None, None) as sink:
            sink.rehash()
            return sink.problem(self.repo.headers.get(name))

    def _downloaded(self, n: int) -> None:
        with self._cond:
            self.stats["bytes_fetched"] += n
        self._progress(n)

    def _busy(self, delta: int) -> None:
        with self._cond:
            now = time.monotonic()
            if self._active == 0 and delta > 0:
                self._busy_since = now
            self._active += delta
            if self._active == 0:
                self.stats["download_seconds"] += now - self._busy_since

    def _event(self, name: str, what: str) -> None:
        self.timeline.setdefault(name, {})[what] = round(time.monotonic() - self._t0, 3)

    def _sample_disk(self) -> None:
        """Bytes allocated under DST now (sparse output files count what is written): the peak is reported."""
        used = sum(p.lstat().st_blocks * 512 for p in _files_under(self.root.parent.parent))
        with self._cond:
            self.stats["peak_disk_bytes"] = max(self.stats["peak_disk_bytes"], used)


def _files_under(folder: Path) -> list[Path]:
    """Regular files and links under `folder`, without following a link anywhere."""
    out = []
    for top, dirs, files in os.walk(folder, followlinks=False):
        out.extend(Path(top) / n for n in files)
        out.extend(Path(top) / d for d in dirs if os.path.islink(Path(top) / d))
    return out
