"""Before anything is written: where a run may write (never into SRC, never over what the user has),
the lock that keeps one run per DST, how much free space it needs, and whether an earlier run
already produced this output."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path

from ckpttool.errors import OutputError
from ckpttool.io.layout import MANIFEST, PARTIAL_DIR, read_manifest
from ckpttool.io.safetensors import printable

SPACE_MARGIN = 64 << 20
"""journal, plan.json, index, config and manifest, with room to spare"""


def _ids(path: Path) -> list[tuple[int, int]]:
    """(device, inode) of `path` (resolved) and of every directory above it: what `path` is inside,
    whatever names, symlinks or bind mounts lead there."""
    out = []
    for p in [path.resolve(), *path.resolve().parents]:
        try:
            st = os.stat(p)
        except OSError:
            continue
        out.append((st.st_dev, st.st_ino))
    return out


def check_outside(dst: Path, inputs: list[Path]) -> None:
    """Refuse when any input file (followed through symlinks) lives inside DST, or DST inside a
    directory an input lives in and would be replaced: compared by device and inode, so a bind mount
    or a symlink into DST is caught as well as a plain path."""
    if not dst.exists():
        return
    st = os.stat(dst)
    dst_id = (st.st_dev, st.st_ino)
    for path in inputs:
        if dst_id in _ids(path):
            raise OutputError(f"input file {printable(str(path))!r} lives inside the output directory (by symlink, "
                              "bind mount or path); writing there would destroy the input", file=dst,
                              fix="choose an output directory that holds none of the input's files")


def check_destination(src: Path | None, dst: Path, *, overwrite: bool, resume: bool) -> None:
    """Refuse anything that could lose what the user has: writing into SRC (by path, symlink or bind
    mount: device and inode), or into a non-empty DST without --overwrite / --resume. --resume where
    nothing was started (no staging dir, no manifest) simply starts. `src` None: the input streams
    from the hub into DST's own staging area."""
    if src is not None and src.exists():
        src_id = _ids(src)[0]
        if src_id in _ids(existing_ancestor(dst)) or (dst.exists() and _ids(dst)[0] in _ids(src)):
            raise OutputError(f"output {dst} overlaps input {src}", fix="choose an output directory outside the input")
    if dst.exists() and not dst.is_dir():
        raise OutputError("output path exists and is not a directory", file=dst)
    if not dst.is_dir():
        return
    partial_path = dst / PARTIAL_DIR
    if os.path.islink(partial_path) or (partial_path.exists() and not partial_path.is_dir()):
        raise OutputError("the staging path is a symlink or not a directory; ckpttool never creates that",
                          file=partial_path, fix="remove it (it is not ckpttool's), then run again")
    existing = [p.name for p in dst.iterdir() if p.name != PARTIAL_DIR]
    partial = partial_path.exists()
    if resume and (partial or os.path.lexists(dst / MANIFEST)):
        return
    if partial and not overwrite:
        raise OutputError("output holds an interrupted run", file=partial_path,
                          fix="add --resume to continue it, or --overwrite to start over")
    if existing and not overwrite:
        raise OutputError(f"output directory is not empty ({len(existing)} entries, e.g. "
                          f"{printable(sorted(existing)[0])!r})",
                          file=dst, fix="choose an empty directory, or add --overwrite to replace ckpttool output there")


class DestinationLock:
    """An exclusive flock on the DST directory itself for the run's lifetime: a second run on the same
    directory (under any path, bind mounts included: the lock is on the inode) fails at once.
    `then` ends the refusal's fix: what the user does once the other run is over."""

    def __init__(self, dst: Path, *, then: str = "use --resume to continue its work"):
        self.dst = dst
        self.created = not dst.exists()
        try:
            dst.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise OutputError(f"cannot create or open the output directory: {exc.strerror or exc}", file=dst,
                              fix="check the path and its permissions, or choose another output directory") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self.fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                raise OutputError("another ckpttool run is using this output directory (it holds the "
                                  "directory's exclusive lock)", file=dst,
                                  fix=f"wait for it to finish (or stop it), then run again; {then}") from None
            raise OutputError(f"cannot lock the output directory: {exc.strerror or exc}", file=dst) from None

    def release(self, *, failed: bool = False) -> None:
        if self.fd < 0:
            return
        if failed and self.created:  # a run refused before writing leaves no empty directory behind
            try:
                os.rmdir(self.dst)
            except OSError:
                pass
        os.close(self.fd)
        self.fd = -1


def snapshot(dst: Path) -> dict[str, list[int]]:
    """DST's top-level entries as the run begins (name -> [device, inode, size, mtime_ns]): what publish may
    replace (with --overwrite, an earlier output). Anything else there at publish was put there during the
    run by someone else, and is never replaced (publish.py)."""
    out = {}
    try:
        names = os.listdir(dst)
    except FileNotFoundError:
        return out
    for name in names:
        if name != PARTIAL_DIR:
            try:
                out[name] = identity(os.lstat(dst / name))
            except FileNotFoundError:
                pass
    return out


def identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def existing_ancestor(path: Path) -> Path:
    """`path`, or its nearest parent that exists: where a DST that is not made yet will live."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_space(dst: Path) -> int:
    """Free bytes on the filesystem DST is (or will be) on."""
    return shutil.disk_usage(existing_ancestor(dst)).free


def allocated(folder: Path) -> int:
    """Bytes allocated to the files under `folder` (0 where there is none), links not followed."""
    total = 0
    for top, _, files in os.walk(folder, followlinks=False):
        for name in files:
            try:
                total += os.lstat(os.path.join(top, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def check_free_space(dst: Path, needed: int, *, what: str = "the output") -> None:
    probe = existing_ancestor(dst)
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise OutputError(f"needs {_size(needed)} free for {what}, only {_size(free)} available", file=probe,
                          fix="free disk space or choose another output filesystem")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 1 << 30 else f"{n / 2**20:.1f} MiB"


def already_complete(dst: Path, plan_hash: str, resume: bool) -> bool:
    """--resume of a run that already published: nothing to do, if it is the same plan. --resume
    where nothing was published or staged: not complete (the run simply starts)."""
    if not resume or (dst / PARTIAL_DIR).exists():
        return False
    manifest = read_manifest(dst)
    if manifest is None:
        return False
    if manifest.get("plan_hash") != plan_hash:
        raise OutputError("--resume: the output here was produced by a different plan", file=dst,
                          fix="rerun with the original arguments, or --overwrite to start over")
    return True
