"""Publish a finished staging directory: move each output file into DST, then write config.json, the
index and the files copied from SRC, then the manifest, last. Until the manifest exists the output is
not complete; a publish interrupted at any point continues with --resume."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpttool import faults
from ckpttool.execute.osutil import rename_noreplace
from ckpttool.execute.staging import Staging, atomic_write, fsync_path
from ckpttool.errors import CkptError, InputError, OutputError
from ckpttool.io.hashing import ALGORITHM, file_digest
from ckpttool.io.layout import (INDEX_NAME, MANIFEST, check_output_names, is_own_regular_file, manifest_digest,
                                name_problem, read_manifest)
from ckpttool.io.safetensors import printable
from ckpttool.publish.destination import identity
from ckpttool.version import __version__


def publish(staging: Staging, src: Path, *, overwrite: bool, hash_workers: int = 8) -> dict:
    """Move finished files into place, then config/index/copies, then the manifest, last. Nothing is put
    over a file someone else created in DST during the run (`_may_replace`)."""
    plan, dst = staging.plan, staging.dst
    check_output_names([f.name for f in plan.files], plan.copies, source=dst, suffix=plan.layout.suffix)
    digests = staging.saved_digests()  # hashed while written, by this or another rank
    for f in plan.files:
        if f.name in staging.published:
            continue
        if not (staging.dir / f.name).exists() and _moved_here(dst / f.name, f.size, digests.get(f.name)):
            staging.mark_published(f.name)  # moved by a publish killed before it could journal so
            continue
        fsync_path(staging.dir / f.name)  # written by this or another rank's process
        faults.point("publish")
        replace = _may_replace(staging, f.name)
        try:
            (os.replace if replace else rename_noreplace)(staging.dir / f.name, dst / f.name)
        except FileExistsError:
            raise _not_ours(dst / f.name) from None
        staging.mark_published(f.name)
    aux = []
    if plan.config is not None:
        _write(staging, "config.json", (json.dumps(plan.config, indent=2) + "\n").encode())
        aux.append("config.json")
    if plan.index is not None:
        _write(staging, INDEX_NAME, (json.dumps(plan.index, indent=2) + "\n").encode())
        aux.append(INDEX_NAME)
    for name, data in sorted(plan.extras.items()):  # a layout's own side files (a DCP's .metadata)
        _write(staging, name, data)
        aux.append(name)
    for name in plan.copies:
        faults.point("publish")
        source = Path(src) / name
        copied = not os.path.islink(dst / name) and (dst / name).is_file()
        if os.path.exists(source) or not copied:  # else an interrupted publish copied it before it went
            _write(staging, name, copy_from=source)  # streamed, never read whole
        aux.append(name)
    names = [f.name for f in plan.files] + aux
    with ThreadPoolExecutor(hash_workers) as pool:  # files finished in an earlier run, and aux files
        missing = [n for n in names if n not in digests]
        digests.update(zip(missing, pool.map(lambda n: file_digest(dst / n), missing)))
    previous = _previous_manifest(dst) if overwrite else None
    manifest = {
        "tool": f"ckpttool {__version__}",
        "plan_hash": staging.plan_hash,
        "format": plan.format,
        "files": {n: {"size": (dst / n).stat().st_size, ALGORITHM: digests[n]} for n in names},
    }
    faults.point("manifest")
    _write(staging, MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    staging.close()
    if previous:  # --overwrite: files of an earlier ckpttool run that this one did not produce
        remove_stale(dst, previous["files"], keep=set(names))
    fsync_path(dst)
    shutil.rmtree(staging.dir)
    return manifest


def _moved_here(path: Path, size: int, digest: str | None) -> bool:
    return digest is not None and is_own_regular_file(path, size) and file_digest(path) == digest


def _write(staging: Staging, name: str, data: bytes | None = None, *, copy_from: Path | None = None) -> None:
    """A side file of the output (config, index, a copy, the manifest) into DST, journalled as published."""
    path = staging.dst / name
    same = (lambda: path.read_bytes() == data) if data is not None else (lambda: filecmp.cmp(path, copy_from, False))
    try:
        atomic_write(path, data, copy_from=copy_from, replace=_may_replace(staging, name, same))
    except FileExistsError:
        raise _not_ours(path) from None
    staging.mark_published(name)


def _may_replace(staging: Staging, name: str, same=None) -> bool:
    """Whether publish may put `name` over what DST holds under it: nothing there (False: placed so that a
    file appearing meanwhile is not replaced either), or a file this run published (an interrupted publish),
    or one that was there unchanged when the run began (an earlier output, with --overwrite), or one holding
    exactly the bytes to be written (`same`: an older version's interrupted publish). Anything else was
    created during the run by someone else: refused, never replaced."""
    path = staging.dst / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if name in staging.published or identity(st) == staging.dst_before.get(name):
        return True
    try:
        if same is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and same():
            return True
    except OSError:
        pass
    raise _not_ours(path)


def _not_ours(path: Path) -> OutputError:
    return OutputError(f"{printable(path.name)} appeared in the output directory during the run; ckpttool never "
                       "replaces a file it did not write", file=path,
                       fix="move that file out of the output directory, then rerun the same command with --resume "
                           "(the finished output waits in DST/.ckpttool-partial)")


def _previous_manifest(dst: Path) -> dict | None:
    """The manifest being replaced; a damaged one proves nothing, so nothing is deleted on its word."""
    try:
        return read_manifest(dst)
    except CkptError:
        return None


def remove_stale(dst: Path, listed: dict, *, keep: set[str]) -> list[str]:
    """Delete what an earlier manifest lists and this run does not produce, only where we can prove
    we wrote it: a plain name (no path, no `..`, not one of ours), a regular file with one link (never
    a symlink's target), and the size and hash the manifest recorded. Anything else stays."""
    removed = []
    for name in sorted(set(listed) - keep):
        if name_problem(name) is not None or name == MANIFEST or name.startswith("."):
            continue
        path, want = dst / name, listed[name]
        algorithm, digest = manifest_digest(want)
        if not is_own_regular_file(path, want["size"]) or file_digest(path, algorithm) != digest:
            continue
        os.unlink(path)
        removed.append(name)
    return removed


def check_manifest(path: Path) -> dict:
    """Re-hash every published file against ckpttool-manifest.json (`inspect --check`)."""
    manifest = read_manifest(path)
    if manifest is None:
        raise InputError("no ckpttool manifest here", file=path / MANIFEST,
                         fix="--check verifies ckpttool output; this directory was not produced by it")
    results = {}
    for name, want in manifest["files"].items():
        p = path / name
        if name_problem(name) is not None:
            results[printable(name)] = "not a plain file name (not something ckpttool writes)"
        elif not p.is_file():
            results[name] = "missing"
        elif p.stat().st_size != want["size"]:
            results[name] = f"size {p.stat().st_size} != {want['size']}"
        else:
            algorithm, digest = manifest_digest(want)
            results[name] = "ok" if file_digest(p, algorithm) == digest else f"{algorithm} mismatch"
    return {"ok": all(v == "ok" for v in results.values()), "plan_hash": manifest.get("plan_hash"),
            "tool": manifest.get("tool"), "files": results}
