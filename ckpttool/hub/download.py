"""Download stage: fetch exactly the files a recipe needs from the Hugging Face Hub, then prove them.

Built on huggingface_hub (resolve_revision, model_info, snapshot_download, hf_hub_download), so
HF_ENDPOINT, HF_TOKEN or the saved login, HF_HUB_CACHE and HF_HUB_OFFLINE mean what they mean everywhere.
The hub client checks sizes only. Every file it hands back is checked again here: size against the
hub's listing, the strict safetensors header, and with `verify_sha256` the hub's LFS sha256 (git blob
sha1 for small files). A file that fails is deleted, fetched once more, and reported if it fails again;
a bad file is never left under its final name.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, get_cached_repo_tree, hf_hub_download, snapshot_download
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import CachedRepoTreeNotFoundError
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import HFValidationError, filter_repo_objects, validate_repo_id

from ckpttool.errors import InputError, OutputError
from ckpttool.hub import guard
from ckpttool.hub.client import HUB_FAILURES, SilentTqdm, translate
from ckpttool.io.layout import name_problem
from ckpttool.io.safetensors import printable, read_header
from ckpttool.publish.destination import DestinationLock

MARKER = Path(".cache", "ckpttool", "download.json")  # in DST: what was fetched, so offline re-runs can verify
HASH_CHUNK = 4 << 20  # per hashing thread; memory stays max_workers x 4 MiB
REFETCH_ATTEMPTS = 1


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """What the hub says about one file; None where it says nothing (offline, no LFS)."""

    size: int | None = None
    sha256: str | None = None  # LFS files
    blob_id: str | None = None  # git blob sha1, every file


@dataclass(frozen=True, slots=True)
class FileReport:
    name: str
    size: int
    header_checked: bool  # strict safetensors header read
    hash_checked: str | None  # "sha256" | "git-sha1" | None
    refetched: bool


@dataclass(frozen=True, slots=True)
class DownloadResult:
    repo_id: str
    revision: str
    commit: str
    path: Path  # the directory to hand to the pipeline
    files: tuple[FileReport, ...]
    offline: bool
    sha256_requested: bool
    hashed_bytes: int
    hash_seconds: float

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def hash_gbps(self) -> float | None:
        return self.hashed_bytes / self.hash_seconds / 1e9 if self.hashed_bytes and self.hash_seconds > 0 else None

    @property
    def refetched(self) -> list[str]:
        return [f.name for f in self.files if f.refetched]

    def to_json(self) -> dict:
        return {
            "repo_id": self.repo_id, "revision": self.revision, "commit": self.commit, "path": str(self.path),
            "offline": self.offline, "sha256_requested": self.sha256_requested, "total_bytes": self.total_bytes,
            "hashed_bytes": self.hashed_bytes,
            "hash_seconds": round(self.hash_seconds, 6), "hash_gbps": self.hash_gbps, "refetched": self.refetched,
            "files": [{"name": f.name, "size": f.size, "header_checked": f.header_checked,
                       "hash_checked": f.hash_checked, "refetched": f.refetched} for f in self.files],
        }


def resolve_input(value: str | os.PathLike) -> Path | str:
    """A `--input` value: an existing path is a local checkpoint (Path); `namespace/name` is a repo id (str)."""
    path = Path(value).expanduser()
    if path.exists():
        return path
    text = str(value)
    if is_repo_id(text):
        return text
    raise InputError("input is neither an existing directory nor a Hub repo id (namespace/name)", file=text,
                     fix="pass a checkpoint directory that exists, or a repo id such as deepseek-ai/DeepSeek-V3")


def is_repo_id(text: str) -> bool:
    """`namespace/name` as the hub validates it; a bare name is refused, as it is more likely a mistyped path."""
    if text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def download_checkpoint(repo_id: str, dst: str | os.PathLike | None = None, *, revision: str | None = None,
                        allow_patterns: list[str] | str | None = None, ignore_patterns: list[str] | str | None = None,
                        max_workers: int = 8, verify_sha256: bool = False, token: str | None = None,
                        quiet: bool = False) -> DownloadResult:
    """Fetch the matching files of `repo_id` into `dst` (None: the HF cache), verify each, return the report."""
    if not is_repo_id(repo_id):
        raise InputError(f"{repo_id!r} is not a Hub repo id", fix="use namespace/name, e.g. deepseek-ai/DeepSeek-V3")
    if max_workers < 1:
        raise InputError(f"max_workers must be at least 1, got {max_workers}", fix="set max_workers to 1 or more")
    allow, ignore = _as_list(allow_patterns), _as_list(ignore_patterns)
    if dst is None:  # the HF cache: the hub client locks each file there itself
        return _download(repo_id, None, revision, allow, ignore, max_workers, verify_sha256, token, quiet)
    # one run per DST, as for every command that writes one: two downloads into one directory would
    # interleave their partial files and each verify (and delete) what the other is still writing
    lock = DestinationLock(Path(dst), then="a re-run fetches only the files still missing")
    try:
        result = _download(repo_id, Path(dst), revision, allow, ignore, max_workers, verify_sha256, token, quiet)
    except BaseException:
        lock.release(failed=True)
        raise
    lock.release()
    return result


def _download(repo_id: str, dst: Path | None, revision: str | None, allow: list[str] | None,
              ignore: list[str] | None, max_workers: int, verify_sha256: bool, token: str | None,
              quiet: bool) -> DownloadResult:
    local_dir = _check_destination(dst, repo_id) if dst is not None else None
    offline = hf_constants.is_offline_mode()
    api = HfApi(token=token)
    where = f"{repo_id}@{revision or 'main'}"

    try:
        resolved = api.resolve_revision(repo_id, revision=revision, local_files_only=offline, token=token)
        listing = None if offline else _list_remote(api, repo_id, resolved.resolved)
    except HUB_FAILURES as exc:
        raise translate(exc, where, offline) from exc
    commit = resolved.resolved
    if listing is not None:  # each transfer stops at the listed size and gives up when it makes no progress
        guard.expect(repo_id, {n: f.size for n, f in listing.items()})
    root = local_dir or Path(hf_constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") \
        / "snapshots" / commit
    if listing is not None:
        wanted = {n: listing[n] for n in filter_repo_objects(listing, allow_patterns=allow, ignore_patterns=ignore)}
        if not wanted:
            raise InputError(f"no file of {where} matches allow_patterns={allow} ignore_patterns={ignore}",
                             fix="loosen the patterns; `ckpttool download` without them fetches every file")
        if local_dir is not None:  # created only once the hub has answered; the record lets offline runs hash
            local_dir.mkdir(parents=True, exist_ok=True)
            _write_marker(local_dir, repo_id, revision, commit, wanted)

    tqdm_class = SilentTqdm if quiet else None
    try:
        root = Path(snapshot_download(repo_id, revision=resolved, local_dir=local_dir, allow_patterns=allow,
                                      ignore_patterns=ignore, max_workers=max_workers, token=token,
                                      local_files_only=offline, tqdm_class=tqdm_class, headers=guard.IDENTITY))
    except HUB_FAILURES as exc:
        missing = [n for n in wanted if not (root / n).is_file()] if listing is not None else []
        raise translate(exc, where, offline, missing=missing, root=root) from exc
    if listing is None:
        wanted = _offline_expectations(repo_id, commit, local_dir, root, allow, ignore)

    def refetch(name: str) -> None:
        if offline:
            raise InputError("the local copy failed its check and HF_HUB_OFFLINE is set, so it cannot be re-fetched",
                             file=root / name, fix="re-run with network access (unset HF_HUB_OFFLINE)")
        try:
            hf_hub_download(repo_id, name, revision=commit, local_dir=local_dir, force_download=True, token=token,
                            tqdm_class=tqdm_class, headers=guard.IDENTITY)
        except HUB_FAILURES as exc:
            raise translate(exc, where, offline, missing=[name], root=root) from exc

    reports, hashed, seconds = _verify_all(root, wanted, verify_sha256, max_workers, refetch)
    return DownloadResult(repo_id, revision or "main", commit, root, tuple(reports), offline, verify_sha256, hashed,
                          seconds)


# -- listing --------------------------------------------------------------------------------------------

def _list_remote(api: HfApi, repo_id: str, commit: str) -> dict[str, RemoteFile]:
    info = api.model_info(repo_id, revision=commit, files_metadata=True)
    return _validated({s.rfilename: RemoteFile(s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
                       for s in info.siblings or []}, f"the hub's listing of {repo_id}")


def _validated(listing: dict[str, RemoteFile], source: str) -> dict[str, RemoteFile]:
    """Every name from a listing or our marker, before anything is opened or deleted by it: a relative
    path of plain parts (no `..`, `.`, empty part, absolute path, backslash or control character),
    outside the `.cache` folder where the hub client and ckpttool keep their records."""
    for name in listing:
        problem = name_problem(name, subdirs=True)
        if problem is None and name.split("/")[0] == ".cache":
            problem = "is inside .cache, where download records live"
        if problem is not None:
            shown = printable(name) if isinstance(name, str) else repr(name)[:80]
            raise InputError(f"{source} names file {shown!r}, which {problem}", fix="refusing to download a repo "
                             "whose file names point outside the destination; report it to the repo's owner")
    return listing


def _offline_expectations(repo_id: str, commit: str, local_dir: Path | None, root: Path, allow: list[str] | None,
                          ignore: list[str] | None) -> dict[str, RemoteFile]:
    """Offline, the hub cannot be asked: use our own record in DST, else the hub's cached tree, else the files."""
    if local_dir is not None and (record := _read_marker(local_dir)) and record.get("commit") == commit:
        try:
            listing = {n: RemoteFile(**f) for n, f in record["files"].items()}
        except (AttributeError, KeyError, TypeError):
            raise InputError("ckpttool's download record is damaged", file=local_dir / MARKER,
                             fix="delete it and re-run with network access") from None
        listing = _validated(listing, f"the download record {local_dir / MARKER}")
    else:
        try:
            # Sizes only: this view of the cached tree drops the LFS sha256, and for an LFS file blob_id
            # hashes its pointer, not its content.
            listing = _validated({f.path: RemoteFile(f.size) for f in get_cached_repo_tree(
                repo_id, revision=commit, local_dir=local_dir)}, "the hub client's cached listing")
        except CachedRepoTreeNotFoundError:
            listing = {p.relative_to(root).as_posix(): RemoteFile() for p in sorted(root.rglob("*"))
                       if p.is_file() and ".cache" not in p.relative_to(root).parts}
    return {n: listing[n] for n in filter_repo_objects(listing, allow_patterns=allow, ignore_patterns=ignore)}


# -- verification ---------------------------------------------------------------------------------------

def _verify_all(root: Path, wanted: dict[str, RemoteFile], verify_hash: bool, workers: int,
                refetch) -> tuple[list[FileReport], int, float]:
    """Check every file in parallel; re-fetch failures once; raise if any still fails (after deleting it)."""
    names = sorted(wanted)
    hashed, seconds, refetched = 0, 0.0, set()
    results: dict[str, tuple[str | None, FileReport]] = {}
    pending = names
    for attempt in range(REFETCH_ATTEMPTS + 1):
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            checked = list(pool.map(lambda n: _check_file(root / n, n, wanted[n], verify_hash), pending))
        elapsed = time.perf_counter() - start
        round_hashed = sum(r.size for _, r in checked if r.hash_checked)
        hashed, seconds = hashed + round_hashed, seconds + (elapsed if round_hashed else 0.0)
        results.update(zip(pending, checked))
        pending = [n for n in pending if results[n][0] is not None]
        if not pending:
            break
        for name in pending:  # all of them first: a failed re-fetch must not leave another bad file behind
            _discard(root / name)
        if attempt == REFETCH_ATTEMPTS:
            break
        for name in pending:
            refetched.add(name)
            refetch(name)
    if pending:
        problems = "; ".join(f"{n}: {results[n][0]}" for n in pending)
        raise InputError(f"{len(pending)} file(s) failed verification after {REFETCH_ATTEMPTS} re-fetch "
                         f"and were deleted ({problems})", file=root / pending[0],
                         fix="the hub copy or the network path is corrupt: retry later, or check HF_ENDPOINT and "
                             "any proxy between you and the hub")
    reports = [FileReport(n, r.size, r.header_checked, r.hash_checked, n in refetched) for n in names
               for r in [results[n][1]]]
    return reports, hashed, seconds


def _check_file(path: Path, name: str, expected: RemoteFile, verify_hash: bool) -> tuple[str | None, FileReport]:
    """(problem or None, report) for one downloaded file."""
    report = FileReport(name, 0, False, None, False)
    if not path.is_file():
        return "missing after download", report
    size = path.stat().st_size
    report = FileReport(name, size, False, None, False)
    if expected.size is not None and size != expected.size:
        return f"size {size} differs from the hub's {expected.size}", report
    header = name.endswith(".safetensors")
    if header:
        try:
            read_header(path)
        except InputError as exc:
            return f"safetensors check failed: {exc.message}", report
    how = None
    if verify_hash and expected.sha256:
        how, digest, want = "sha256", _file_digest(path, hashlib.sha256()), expected.sha256
    elif verify_hash and expected.blob_id:  # not LFS (an LFS blob_id hashes the pointer)
        how, digest, want = "git-sha1", _file_digest(path, hashlib.sha1(b"blob %d\0" % size)), expected.blob_id
    if how and digest != want:
        return f"{how} {digest} differs from the hub's {want}", FileReport(name, size, header, None, False)
    return None, FileReport(name, size, header, how, False)


def _file_digest(path: Path, h) -> str:
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])  # hashlib drops the GIL on large updates, so files hash in parallel
    return h.hexdigest()


def _discard(path: Path) -> None:
    """Remove a bad file (its name validated: inside the download root); in the HF cache the snapshot
    entry is a symlink, so remove its blob too, but only a blob in that repo's cache folder."""
    if path.is_symlink():
        blob = path.resolve()
        path.unlink()
        blobs = Path(hf_constants.HF_HUB_CACHE).resolve()
        if blobs in blob.parents and blob.parent.name == "blobs":
            blob.unlink(missing_ok=True)
    else:
        path.unlink(missing_ok=True)


# -- destination ----------------------------------------------------------------------------------------

def _check_destination(dst: Path, repo_id: str) -> Path:
    if dst.exists() and not dst.is_dir():
        raise OutputError("destination exists and is not a directory", file=dst, fix="choose a directory path")
    if dst.is_dir() and any(dst.iterdir()):
        record = _read_marker(dst)
        if record is None and not (dst / ".cache" / "huggingface").is_dir():
            raise OutputError("destination is not empty and holds no earlier download", file=dst,
                              fix="choose an empty or absent directory, or the directory of an earlier download")
        if record is not None and record.get("repo_id") != repo_id:
            raise OutputError(f"destination holds a download of {record.get('repo_id')}, not {repo_id}", file=dst,
                              fix="choose another directory; one directory holds one repo")
    return dst.resolve()


def _read_marker(dst: Path) -> dict | None:
    try:
        record = json.loads((dst / MARKER).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _write_marker(dst: Path, repo_id: str, revision: str | None, commit: str, files: dict[str, RemoteFile]) -> None:
    record = {"repo_id": repo_id, "revision": revision or "main", "commit": commit,
              "files": {n: {"size": f.size, "sha256": f.sha256, "blob_id": f.blob_id} for n, f in sorted(files.items())}}
    path = dst / MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def _as_list(patterns: list[str] | str | None) -> list[str] | None:
    if patterns is None:
        return None
    return [patterns] if isinstance(patterns, str) else list(patterns)
