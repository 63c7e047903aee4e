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
from ckpttool.io.hashing import sha256_file
from ckpttool.io.layout import INDEX_NAME, MANIFEST, read_manifest


def publish(staging: Staging, src: Path, *, overwrite: bool, hash_workers: int = 8) -> dict:
    """Move finished files into place, then config/index/copies, then the manifest, last."""
    plan, dst = staging.plan, staging.dst
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
        atomic_write(dst / name, (Path(src) / name).read_bytes())
        aux.append(name)
    names = [f.name for f in plan.files] + aux
    with ThreadPoolExecutor(hash_workers) as pool:  # files finished in an earlier run, and aux files
        missing = [n for n in names if n not in digests]
        digests.update(zip(missing, pool.map(lambda n: sha256_file(dst / n), missing)))
    previous = read_manifest(dst) if overwrite else None
    manifest = {
        "tool": f"ckpttool {__version__}",
        "plan_hash": staging.plan_hash,
        "format": plan.format,
        "files": {n: {"size": (dst / n).stat().st_size, "sha256": digests[n]} for n in names},
    }
    faults.point("manifest")
    atomic_write(dst / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    if previous:  # --overwrite: shards of an earlier ckpttool run that this one did not produce
        for stale in set(previous.get("files", {})) - set(names):
            (dst / stale).unlink(missing_ok=True)
    fsync_path(dst)
    shutil.rmtree(staging.dir)
    return manifest


def check_manifest(path: Path) -> dict:
    """Re-hash every published file against ckpttool-manifest.json (`inspect --check`)."""
    from ckpttool.errors import InputError

    manifest = read_manifest(path)
    if manifest is None:
        raise InputError("no ckpttool manifest here", file=path / MANIFEST,
                         fix="--check verifies ckpttool output; this directory was not produced by it")
    results = {}
    for name, want in manifest["files"].items():
        p = path / name
        if not p.is_file():
            results[name] = "missing"
        elif p.stat().st_size != want["size"]:
            results[name] = f"size {p.stat().st_size} != {want['size']}"
        else:
            results[name] = "ok" if sha256_file(p) == want["sha256"] else "sha256 mismatch"
    return {"ok": all(v == "ok" for v in results.values()), "plan_hash": manifest.get("plan_hash"),
            "tool": manifest.get("tool"), "files": results}
