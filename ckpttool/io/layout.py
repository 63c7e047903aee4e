"""The names ckpttool gives its own files, spelled once: the mp layout's `model{rank}-mp{N}.safetensors`
(written by `shard` / `convert --mp N`, read back by `merge` and `verify`), the manifest every output
carries, and the staging directory a run writes into before it publishes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ckpttool.errors import InputError

MP_FILE = re.compile(r"model(\d+)-mp(\d+)\.safetensors")
MANIFEST = "ckpttool-manifest.json"
"""tool version, plan hash, size and sha256 of every file: written last, when an output is complete"""
PARTIAL_DIR = ".ckpttool-partial"
"""DST/.ckpttool-partial: output files at their final size, the plan and the journal, until publish"""
INDEX_NAME = "model.safetensors.index.json"


def mp_file(rank: int, mp: int) -> str:
    return f"model{rank}-mp{mp}.safetensors"


def find_mp(directory: Path, mp: int | None = None) -> int:
    """The N of the `model{i}-mp{N}.safetensors` in `directory` (or check the given one): all N files
    present, no rank beyond them."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError("directory does not exist", file=directory,
                         fix="pass the output directory of `ckpttool shard` / `convert --mp N`")
    found = {(int(m[1]), int(m[2])) for p in directory.iterdir() if (m := MP_FILE.fullmatch(p.name))}
    sizes = sorted({n for _, n in found})
    if not sizes:
        raise InputError("no model{i}-mp{N}.safetensors files", file=directory,
                         fix="pass the output directory of `ckpttool shard` / `convert --mp N`")
    if mp is None:
        if len(sizes) > 1:
            raise InputError(f"shards for several mp sizes {sizes}", file=directory,
                             fix="keep one set of shards per directory (verify also takes --mp N to choose one)")
        mp = sizes[0]
    missing = [mp_file(r, mp) for r in range(mp) if (r, mp) not in found]
    if missing:
        raise InputError(f"missing shard(s) {', '.join(missing)}", file=directory,
                         fix="the conversion did not finish; convert again into an empty directory")
    extra = sorted(mp_file(r, n) for r, n in found if n == mp and r >= mp)
    if extra:
        raise InputError(f"unexpected shard(s) {', '.join(extra)}", file=directory)
    return mp


def read_manifest(dst: Path) -> dict | None:
    path = Path(dst) / MANIFEST
    if not path.exists():
        return None
    return json.loads(path.read_text())
