"""Publish a finished staging directory: move each output file into DST, then write config.json, the
index and the files copied from SRC, then the manifest, last. Until the manifest exists the output is
not complete; a publish interrupted at any point continues with --resume."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpttool import __version__, faults
from ckpttool.execute.staging import Staging, atomic_write, fsync_path
from ckpttool.errors import CkptError, InputError
from ckpttool.io.hashing import ALGORITHM, file_digest
from ckpttool.io.layout import (INDEX_NAME, MANIFEST, check_output_names, is_own_regular_file, manifest_digest,
                                name_problem, read_manifest)
from ckpttool.io.safetensors import printable


def publish(staging: Staging, src: Path, *, overwrite: bool, hash_workers: int = 8) -> dict:
    """Move finished files into place, then config/index/copies, then the manifest, last."""
    plan, dst = staging.plan, staging.dst
    check_output_names([f.name for f in plan.files], plan.copies, source=dst)
    digests = staging.saved_digests()  # hashed while written, by this or another rank
    for f in plan.files:
        if f.name in staging.published:
            continue
        fsync_path(staging.dir / f.name)  # written by this or another rank's process
        faults.point("publish")
        os.replace(staging.dir / f.name, dst / f.name)
        staging.mark_published(f.name)
    staging.close()
    aux = []
    if plan.config is not None:
        atomic_write(dst / "config.json", (json.dumps(plan.config, indent=2) + "\n").encode())
        aux.append("config.json")
    if plan.index is not None:
        atomic_write(dst / INDEX_NAME, (json.dumps(plan.index, indent=2) + "\n").encode())
        aux.append(INDEX_NAME)
    for name in plan.copies:
        faults.point("publish")
        source = Path(src) / name
        copied = not os.path.islink(dst / name) and (dst / name).is_file()
        if os.path.exists(source) or not copied:  # else an interrupted publish copied it before it went
            atomic_write(dst / name, copy_from=source)  # streamed, never read whole
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
    atomic_write(dst / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    if previous:  # --overwrite: files of an earlier ckpttool run that this one did not produce
        remove_stale(dst, previous["files"], keep=set(names))
    fsync_path(dst)
    shutil.rmtree(staging.dir)
    return manifest


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
