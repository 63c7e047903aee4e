"""The names ckpttool gives its own files, spelled once: the mp layout's `model{rank}-mp{N}.safetensors`
(written by `shard` / `convert --mp N`, read back by `merge` and `verify`), the manifest every output
carries, and the staging directory a run writes into before it publishes."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from ckpttool.errors import InputError, OutputError
from ckpttool.io.safetensors import printable

MP_FILE = re.compile(r"model(\d+)-mp(\d+)\.safetensors")
MANIFEST = "ckpttool-manifest.json"
"""tool version, plan hash, size and hash (blake3; sha256 in older ones) of every file: written last, when an
output is complete"""
PARTIAL_DIR = ".ckpttool-partial"
"""DST/.ckpttool-partial: output files at their final size, the plan and the journal, until publish"""
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
PLAN_FILE = "plan.json"
"""in the staging dir: the plan hash, the plan and the inputs' fingerprint, for --resume"""
JOURNAL = "journal.jsonl"
STREAM_INPUT, STREAM_FETCH = "input", "fetch"
"""in the staging dir, converting straight from the hub: verified input files, and files being fetched"""
OWN_NAMES = frozenset({MANIFEST, PARTIAL_DIR, INDEX_NAME, CONFIG_NAME})
"""names in DST that ckpttool itself writes, whatever the plan says"""
OUTPUT_SUFFIX = ".safetensors"


def name_problem(name: object, *, subdirs: bool = False) -> str | None:
    """Why `name` (from an index, a listing or a manifest) is not a plain relative name we could
    have written, or None. With `subdirs`, `a/b` is allowed (hub listings); never `..`, `.`, empty
    parts, absolute paths, backslashes, NUL or characters that print as something else."""
    if not isinstance(name, str) or not name:
        return "is not a non-empty string"
    if printable(name) != name or "\\" in name or "\0" in name:
        return "holds control, format or backslash characters"
    if os.path.isabs(name) or name.startswith("/"):
        return "is an absolute path"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' component"
    if len(parts) > 1 and not subdirs:
        return "names a file in a subfolder"
    return None


def check_name(name: object, *, source: object, what: str = "file name", subdirs: bool = False,
               fix: str = "the file is corrupt or hostile; names must be plain relative names inside the directory") -> str:
    """`name` itself if it is a plain relative name (see name_problem), else an InputError naming `source`."""
    problem = name_problem(name, subdirs=subdirs)
    if problem is not None:
        shown = printable(name) if isinstance(name, str) else repr(name)[:80]
        raise InputError(f"{what} {shown!r} {problem}", file=source, fix=fix)
    return name


def check_output_names(files: list[str], copies: list[str], *, source: object, inputs: object = (),
                       suffix: str = OUTPUT_SUFFIX) -> None:
    """The names a plan will write into DST: plain `*.safetensors` names (so none can be our journal,
    plan, digest or temp files), unique, and none a name of ours or a file copied from SRC; and no
    input shard (`inputs`) copied as if it were a side file."""
    fix = ("rename the input's shards to plain *.safetensors names in the checkpoint's top folder "
           "(and fix model.safetensors.index.json to match)")
    seen: set[str] = set()
    for name in files:
        check_name(name, source=source, what="output file", fix=fix)
        if not name.endswith(suffix) or name in OWN_NAMES or name.startswith(".") or name in seen:
            raise InputError(f"output file {printable(name)!r} would collide with another output or a file "
                             f"ckpttool writes (outputs must be distinct plain *{suffix} names)",
                             file=source, fix=fix)
        seen.add(name)
    for name in copies:
        check_name(name, source=source, what="file copied from the input")
        if name in seen or name in inputs or name in OWN_NAMES - {CONFIG_NAME} or name.startswith("."):
            raise InputError(f"input file {printable(name)!r} has the name of an output ckpttool writes",
                             file=source, fix="rename or remove that file from the input directory")
        seen.add(name)


def is_own_regular_file(path: Path, size: int) -> bool:
    """`path` is a regular file (not a symlink), with one link, of `size` bytes: what we write."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_size == size


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
    """DST's manifest (None where there is none): a JSON object whose `files` maps plain names to
    {size, blake3} (or {size, sha256}, as older versions wrote). Anything else is an InputError; names are
    not trusted until check_name."""
    path = Path(dst) / MANIFEST
    if not os.path.lexists(path):
        return None
    fix = "the manifest is damaged; remove it (and re-run with --overwrite) or re-run the conversion"
    try:
        with open(path, "rb") as f:
            raw = f.read(64 << 20)
        manifest = json.loads(raw)
    except OSError as exc:
        raise OutputError(f"cannot read the manifest: {exc.strerror or exc}", file=path, fix=fix) from None
    except (ValueError, RecursionError):
        raise InputError("the manifest is not valid JSON", file=path, fix=fix) from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and manifest_digest(v) is not None
            for v in files.values()):
        raise InputError("the manifest has no `files` object of {size, blake3} (or {size, sha256}) entries",
                         file=path, fix=fix + "; a newer ckpttool may know its hash")
    return manifest


def manifest_digest(entry: dict) -> tuple[str, str] | None:
    """(algorithm, hex digest) of a manifest entry: blake3, or the sha256 of older manifests."""
    for algorithm in ("blake3", "sha256"):
        if isinstance(entry.get(algorithm), str):
            return algorithm, entry[algorithm]
    return None
