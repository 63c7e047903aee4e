"""A directory ckpttool wrote, read back (`merge`): every file read from it is held to the manifest beside
it, so a rank file of another conversion (the same architecture has the same names, shapes and sizes)
or a file changed since is refused instead of merged. Names, sizes and the small side files are checked
when the directory is opened; each shard's hash once, before its first byte is read (hashed in parallel:
the same read again, at about 4 GB/s per core for BLAKE3). A directory without a manifest (DeepSeek's own
convert.py writes none) is read unchecked, and the plan says so."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpttool import defaults
from ckpttool.errors import InputError, printable
from ckpttool.io.hashing import file_digest
from ckpttool.io.layout import MANIFEST, MP_FILE, manifest_digest, read_manifest

_FIX = ("merge shards of one conversion, as it wrote them (the manifest lists them); to merge shards that no longer "
        "match it on purpose, move ckpttool-manifest.json out of the directory: they are then read unchecked")


class Listed:
    """The manifest of `root` as far as the files `names` go (None: `root` has no manifest)."""

    def __init__(self, root: Path, names: list[str]):
        self.root = Path(root)
        manifest = read_manifest(self.root)  # a damaged one is an error, not "unchecked"
        self.manifest = manifest
        if manifest is None:
            return
        files = manifest["files"]
        self.plan_hash = str(manifest.get("plan_hash", "?"))
        for name in names:
            if name not in files:
                raise InputError(f"{name} is not listed in the manifest beside it (plan {self.plan_hash[:12]}): the "
                                 "conversion that wrote the other files did not write it", file=self.root / name,
                                 fix=_FIX)
            size = (self.root / name).stat().st_size
            if size != files[name]["size"]:
                raise InputError(f"{name} is {size} bytes, the manifest beside it records {files[name]['size']}",
                                 file=self.root / name, fix=_FIX)
        mine = {n for n in files if MP_FILE.fullmatch(n)}
        if mine - set(names):
            absent = sorted(mine - set(names))
            raise InputError(f"the manifest lists {printable(absent[0])}"
                             f"{f' and {len(absent) - 1} more' if len(absent) > 1 else ''}, which this merge would "
                             "not read: the shards here are not the set it describes", file=self.root / MANIFEST,
                             fix=_FIX)

    def check(self, names: list[str]) -> None:
        """Hash `names` (in parallel) and compare each with its manifest entry."""
        if self.manifest is None or not names:
            return
        entries = self.manifest["files"]
        with ThreadPoolExecutor(max(1, min(len(names), defaults.cores()))) as pool:
            got = list(pool.map(lambda n: file_digest(self.root / n, manifest_digest(entries[n])[0]), names))
        for name, digest in zip(names, got):
            algorithm, want = manifest_digest(entries[name])
            if digest != want:
                raise InputError(f"{name}'s {algorithm} {digest[:16]}... differs from {want[:16]}... in the manifest "
                                 f"beside it (plan {self.plan_hash[:12]}): it is not the file that conversion wrote "
                                 "(another conversion's, or changed since)", file=self.root / name, fix=_FIX)

    @property
    def note(self) -> str:
        if self.manifest is None:
            return f"no {MANIFEST} beside the shards: read without checking them against one"
        return f"every file read is checked against {MANIFEST} beside the shards (plan {self.plan_hash[:12]})"
