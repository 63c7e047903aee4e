"""Before anything is written: where a run may write (never into SRC, never over what the user has),
how much free space it needs, and whether an earlier run already produced this output."""

from __future__ import annotations

import shutil
from pathlib import Path

from ckpttool.errors import OutputError
from ckpttool.io.layout import MANIFEST, PARTIAL_DIR, read_manifest

SPACE_MARGIN = 64 << 20
"""journal, plan.json, index, config and manifest, with room to spare"""


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


def already_complete(dst: Path, plan_hash: str, resume: bool) -> bool:
    """--resume of a run that already published: nothing to do, if it is the same plan."""
    if not resume or (dst / PARTIAL_DIR).exists():
        return False
    manifest = read_manifest(dst)
    if manifest is None or manifest.get("plan_hash") != plan_hash:
        raise OutputError("--resume: the output here was produced by a different plan", file=dst,
                          fix="rerun with the original arguments, or --overwrite to start over")
    return True
