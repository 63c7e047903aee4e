"""Planned-layout output: files created at final size in DST/.ckpttool-partial, tensors pwritten at
their offsets, a journal of durable work for --resume, then an atomic publish with a manifest last.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpttool import __version__, faults
from ckpttool.errors import OutputError
from ckpttool.io.hashing import PrefixHasher, sha256_file
from ckpttool.plan import Plan
from ckpttool.timing import Timings

PARTIAL_DIR = ".ckpttool-partial"
JOURNAL = "journal.jsonl"
PLAN_FILE = "plan.json"
MANIFEST = "ckpttool-manifest.json"


def check_destination(src: Path, dst: Path, *, overwrite: bool, resume: bool) -> None:
    """Refuse anything that could lose what the user has: writing into SRC, or into a non-empty
    DST without --overwrite / --resume."""
    src_r, dst_r = src.resolve(), dst.resolve()
    if dst_r == src_r or src_r in dst_r.parents or dst_r in src_r.parents:
        raise OutputError(f"output {dst} overlaps input {src}", fix="choose an output directory outside the input")
    if dst_r.exists() and not dst_r.is_dir():
        raise OutputError("output path exists and is not a directory", file=dst)
    if not dst_r.is_dir():
        return
    existing = [p.name for p in dst_r.iterdir() if p.name != PARTIAL_DIR]
    partial = (dst_r / PARTIAL_DIR).exists()
    if resume:
        if not partial and not (dst_r / MANIFEST).exists():
            raise OutputError("--resume found no interrupted run here", file=dst,
                              fix="run without --resume to start a new conversion")
        return
    if partial and not overwrite:
        raise OutputError("output holds an interrupted run", file=dst / PARTIAL_DIR,
                          fix="add --resume to continue it, or --overwrite to start over")
    if existing and not overwrite:
        raise OutputError(f"output directory is not empty ({len(existing)} entries, e.g. {sorted(existing)[0]!r})",
                          file=dst, fix="choose an empty directory, or add --overwrite to replace ckpttool output there")


def check_free_space(dst: Path, needed: int) -> None:
    probe = dst
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise OutputError(f"needs {needed / 2**30:.2f} GiB free, only {free / 2**30:.2f} GiB available", file=probe,
                          fix="free disk space or choose another output filesystem")


def disk_error(exc: OSError, path: object) -> OutputError:
    if exc.errno == errno.ENOSPC:
        return OutputError("no space left on device", file=path,
                           fix="free disk space, then rerun the same command with --resume")
    return OutputError(f"write failed: {exc.strerror}", file=path, fix="check the output filesystem, then --resume")


class Staging:
    """DST/.ckpttool-partial: output files at their final size, plus plan.json and the journals.

    Rank 0 (or a single process) creates it; under torchrun the other ranks join it, each writing
    its own files and its own journal, so no two processes ever append to the same file.
    """

    def __init__(self, dst: Path, plan: Plan, *, resume: bool, overwrite: bool = False, rank: int = 0,
                 timings: Timings | None = None):
        self.dst = Path(dst)
        self.timings = timings or Timings()
        self.dir = self.dst / PARTIAL_DIR
        self.plan = plan
        self.plan_hash = plan.hash
        self.done: set[tuple[str, str]] = set()
        self.published: set[str] = set()
        plan_path = self.dir / PLAN_FILE
        journal = self.dir / (JOURNAL if rank == 0 else f"journal.{rank}.jsonl")
        if rank == 0 and not (resume and plan_path.exists()):
            if self.dir.exists():
                shutil.rmtree(self.dir)  # only reachable with --overwrite (check_destination)
            self.dir.mkdir(parents=True)
            _atomic_write(plan_path, json.dumps({"plan_hash": self.plan_hash, "plan": plan.to_json()}).encode())
        else:
            previous = json.loads(plan_path.read_text()).get("plan_hash")
            if previous != self.plan_hash:
                raise OutputError("--resume: the interrupted run was planned for different inputs or options",
                                  file=plan_path, fix="rerun with the original arguments, or --overwrite to start over")
            self._load_journals()
        self._journal = open(journal, "ab")
        self.fds: dict[str, int] = {}
        # each output file is hashed while it is written (its contiguous written prefix)
        self._hash_pool = ThreadPoolExecutor(min(16, os.cpu_count() or 1, max(1, len(plan.files))),
                                             thread_name_prefix="ckpttool-sha256")
        self._hashers: dict[str, PrefixHasher] = {}

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
        """Create (or, resuming, reopen) the output files at their final size; `files` limits this
        to one rank's share."""
        for f in self.plan.files:
            if f.name in self.published or (files is not None and f.name not in files):
                continue
            path = self.dir / f.name
            fresh = not path.exists() or path.stat().st_size != f.size
            if fresh:
                self.done = {(fn, t) for fn, t in self.done if fn != f.name}
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fresh:
                    os.ftruncate(fd, 0)
                    _pwrite_all(fd, f.header, 0)
                    os.ftruncate(fd, f.size)
            except OSError as exc:
                os.close(fd)
                raise disk_error(exc, path) from None
            self.fds[f.name] = fd
            if not any(fn == f.name for fn, _ in self.done):  # nothing written by an earlier run
                self._hashers[f.name] = PrefixHasher(path, f.size, self._hash_pool, written_prefix=len(f.header),
                                                     timings=self.timings)

    def pwrite(self, file: str, data, offset: int) -> None:
        try:
            faults.point("pwrite")
            _pwrite_all(self.fds[file], data, offset)
        except OSError as exc:
            raise disk_error(exc, self.dir / file) from None

    def commit(self, entries: list[tuple[str, str]]) -> None:
        """Make written tensors durable, then record them: the journal never runs ahead of the data."""
        with self.timings.activity("fdatasync"):
            for file in sorted({f for f, _ in entries}):
                try:
                    os.fdatasync(self.fds[file])
                except OSError as exc:
                    raise disk_error(exc, self.dir / file) from None
        faults.point("commit")
        self._journal.write(b"".join(json.dumps({"f": f, "t": t}).encode() + b"\n" for f, t in entries))
        self._journal.flush()
        os.fsync(self._journal.fileno())
        self.done.update(entries)

    def written(self, file: str, start: int, end: int) -> None:
        """Bytes [start, end) of `file` hold their final contents (feeds the running sha256)."""
        hasher = self._hashers.get(file)
        if hasher is not None:
            hasher.written(start, end)

    def save_digests(self) -> None:
        """Wait for this process's running hashes and leave each beside its file, for whoever
        publishes (rank 0, or a later --resume: the bytes are deterministic, so a digest stays true)."""
        for name, hasher in self._hashers.items():
            _atomic_write(self.dir / f"{name}.sha256", hasher.result().encode())

    def close_files(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def close(self) -> None:
        self.close_files()
        self._hash_pool.shutdown(wait=True, cancel_futures=True)
        if not self._journal.closed:
            self._journal.close()

    def publish(self, src: Path, *, overwrite: bool, hash_workers: int = 8) -> dict:
        """Move finished files into place, then config/index/copies, then the manifest, last."""
        digests = {}  # hashed while written, by this or another rank
        for f in self.plan.files:
            saved = self.dir / f"{f.name}.sha256"
            if saved.exists():
                digests[f.name] = saved.read_text().strip()
        for f in self.plan.files:
            if f.name in self.published:
                continue
            _fsync(self.dir / f.name)  # written by this or another rank's process
            faults.point("publish")
            os.replace(self.dir / f.name, self.dst / f.name)
            self._journal.write(json.dumps({"published": f.name}).encode() + b"\n")
            self._journal.flush()
            os.fsync(self._journal.fileno())
            self.published.add(f.name)
        self.close()
        aux = []
        if self.plan.config is not None:
            _atomic_write(self.dst / "config.json", (json.dumps(self.plan.config, indent=2) + "\n").encode())
            aux.append("config.json")
        if self.plan.index is not None:
            _atomic_write(self.dst / "model.safetensors.index.json",
                          (json.dumps(self.plan.index, indent=2) + "\n").encode())
            aux.append("model.safetensors.index.json")
        for name in self.plan.copies:
            faults.point("publish")
            _atomic_write(self.dst / name, (src / name).read_bytes())
            aux.append(name)
        names = [f.name for f in self.plan.files] + aux
        with ThreadPoolExecutor(hash_workers) as pool:  # files finished in an earlier run, and aux files
            missing = [n for n in names if n not in digests]
            digests.update(zip(missing, pool.map(lambda n: sha256_file(self.dst / n), missing)))
        previous = read_manifest(self.dst) if overwrite else None
        manifest = {
            "tool": f"ckpttool {__version__}",
            "plan_hash": self.plan_hash,
            "format": self.plan.format,
            "files": {n: {"size": (self.dst / n).stat().st_size, "sha256": digests[n]} for n in names},
        }
        faults.point("manifest")
        _atomic_write(self.dst / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
        if previous:  # --overwrite: shards of an earlier ckpttool run that this one did not produce
            for stale in set(previous.get("files", {})) - set(names):
                (self.dst / stale).unlink(missing_ok=True)
        _fsync(self.dst)
        shutil.rmtree(self.dir)
        return manifest


def read_manifest(dst: Path) -> dict | None:
    path = Path(dst) / MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.ckpttool-tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync(path: Path) -> None:
    """fsync a file or directory by path (a fresh descriptor flushes what any process wrote)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

