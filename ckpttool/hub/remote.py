"""A hub repo planned without downloading its weights: its listing, config.json and index (small,
kept in memory) and every safetensors header, read by HTTP range requests through huggingface_hub's
own session, as its `get_safetensors_metadata` does. That helper is not used itself: it saves the
index into the HF cache (nothing outside DST is written unless the user asks for the cache) and
parses headers leniently, where the plan needs the raw header bytes for the strict parser and for
the plan hash, which must equal the hash of planning the downloaded copy.
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_url, try_to_load_from_cache
from huggingface_hub import constants as hf_constants
from huggingface_hub.utils import build_hf_headers, filter_repo_objects, get_session, hf_raise_for_status

from ckpttool.errors import InputError
from ckpttool.hub import guard
from ckpttool.hub.client import HUB_FAILURES, translate
from ckpttool.hub.download import RemoteFile, _validated, is_repo_id
from ckpttool.io.checkpoint import MAX_CONFIG_BYTES, MAX_INDEX_BYTES, Checkpoint
from ckpttool.io.layout import INDEX_NAME
from ckpttool.io.safetensors import MAX_HEADER_BYTES, SafetensorsFile, header_length, loads_strict_json, parse_header

MAX_HEADERS_BYTES = 1 << 30
"""all of a repo's headers together, kept in memory while planning (DeepSeek-V3's 163 add up to about 12 MB)"""
FIRST_RANGE = 100_000  # one request holds the whole header of 97% of hub files (huggingface_hub's figure)
HEADER_WORKERS = 16
SIDE_FILES = ("config.json", INDEX_NAME)  # read at plan time; the other side files are fetched with the weights


@dataclass
class RemoteRepo:
    """One commit of a hub repo as far as planning needs it; nothing of it is on disk."""

    repo_id: str
    revision: str
    commit: str
    files: dict[str, RemoteFile]  # the listing, names validated, after allow/ignore patterns
    token: str | None = None
    side: dict[str, bytes] = field(default_factory=dict)
    headers: dict[str, bytes] = field(default_factory=dict)  # file -> its first 8 + header_size bytes
    requests: int = 0
    rate: float | None = None  # bytes/s of a timed range request, when plan measured one
    header_bytes: int = 0  # announced by the headers fetched so far
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def where(self) -> str:
        return f"{self.repo_id}@{self.revision}"

    def url(self, name: str) -> str:
        return hf_hub_url(self.repo_id, name, revision=self.commit, endpoint=hf_constants.ENDPOINT)

    def http_headers(self) -> dict[str, str]:
        return {**build_hf_headers(token=self.token, library_name="ckpttool"), **guard.IDENTITY}

    def get(self, name: str, start: int = 0, end: int | None = None, cap: int | None = None) -> bytes:
        """Bytes [start, end) of `name` (end None: to its end, at most `cap`), by one range request; the
        listed size and the progress limits hold as for every transfer (hub/guard.py)."""
        headers = self.http_headers()
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        want = (end - start) if end is not None else None if cap is None else cap + 1  # one more: over the cap
        out = bytearray()
        try:
            with get_session().stream("GET", self.url(name), headers=headers,
                                      timeout=hf_constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                hf_raise_for_status(response)
                skip = start if start and response.status_code == 200 else 0  # a server that ignores Range
                for chunk in response.iter_bytes():
                    if skip:
                        cut = min(skip, len(chunk))
                        chunk, skip = chunk[cut:], skip - cut
                    out += chunk
                    if want is not None and len(out) >= want:
                        break
        except HUB_FAILURES as exc:
            raise translate(exc, self.where, False, missing=[name]) from exc
        finally:
            self.requests += 1
        if cap is not None and end is None and len(out) > cap:
            raise InputError(f"{name} is over the {cap}-byte cap for a side file", file=self.url(name),
                             fix="the repo's file is corrupt or hostile; report it to the repo's owner")
        return bytes(out[:want] if want is not None else out)

    def cached(self, name: str) -> Path | None:
        """`name` of this commit in the HF cache, at the listed size; None where it is not there. Looks only."""
        found = try_to_load_from_cache(self.repo_id, name, revision=self.commit)
        if not isinstance(found, str):
            return None
        path = Path(found)
        size = self.files[name].size
        return path if path.is_file() and (size is None or path.stat().st_size == size) else None

    def fetch_header(self, name: str) -> bytes:
        size = self.files[name].size or 0
        label = Path(self.where) / name
        head = self.get(name, 0, min(size, FIRST_RANGE))
        total = 8 + header_length(head, size, label, MAX_HEADER_BYTES)
        with self._lock:
            self.header_bytes += total
            if self.header_bytes > MAX_HEADERS_BYTES:
                raise InputError(f"the repo's safetensors headers announce over {MAX_HEADERS_BYTES} bytes by this "
                                 "file (real repos: tens of megabytes); nothing more of them is fetched", file=label,
                                 fix="the repo is corrupt or hostile; report it to the repo's owner")
        if len(head) < total:
            head += self.get(name, len(head), total)
        if len(head) < total:
            raise InputError(f"the hub sent {len(head)} of the {total} header bytes", file=label,
                             fix="retry; check HF_ENDPOINT and any proxy if it persists")
        return head[:total]


def open_repo(repo_id: str, *, revision: str | None = None, allow_patterns: list[str] | None = None,
              ignore_patterns: list[str] | None = None, token: str | None = None) -> RemoteRepo:
    """The listing, config.json, index and every weight file's header of `repo_id` at `revision`.
    One model_info call (it also resolves the revision, without writing the HF cache's refs)."""
    if not is_repo_id(repo_id):
        raise InputError(f"{repo_id!r} is not a Hub repo id", fix="use namespace/name, e.g. deepseek-ai/DeepSeek-V3")
    where = f"{repo_id}@{revision or 'main'}"
    try:
        info = HfApi(token=token).model_info(repo_id, revision=revision, files_metadata=True)
    except HUB_FAILURES as exc:
        raise translate(exc, where, False) from exc
    listing = _validated({s.rfilename: RemoteFile(s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
                          for s in info.siblings or []}, f"the hub's listing of {repo_id}")
    guard.expect(repo_id, {n: f.size for n, f in listing.items()})  # every transfer below stops at these sizes
    wanted = {n: listing[n] for n in filter_repo_objects(listing, allow_patterns=allow_patterns,
                                                         ignore_patterns=ignore_patterns)}
    repo = RemoteRepo(repo_id, revision or "main", info.sha, wanted, token)
    for name in SIDE_FILES:
        if name in wanted:
            repo.side[name] = repo.get(name, cap=MAX_INDEX_BYTES if name == INDEX_NAME else MAX_CONFIG_BYTES)
    names = _weight_files(repo)
    with ThreadPoolExecutor(HEADER_WORKERS) as pool:
        repo.headers = dict(zip(names, pool.map(repo.fetch_header, names)))
    return repo


def _weight_files(repo: RemoteRepo) -> list[str]:
    """The files whose headers the plan reads: those the index names (its own checks run later, in
    Checkpoint), else the top-level *.safetensors, as a local directory is read."""
    raw = repo.side.get(INDEX_NAME)
    if raw is not None:
        index = loads_strict_json(raw, file=Path(repo.where) / INDEX_NAME, what="index",
                                  fix="the index is corrupt; report it to the repo's owner")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        values = weight_map.values() if isinstance(weight_map, dict) else ()
        return sorted({v for v in values if isinstance(v, str) and v in repo.files})
    return sorted(n for n in repo.files if "/" not in n and n.endswith(".safetensors"))


def measure_rate(repo: RemoteRepo, nbytes: int) -> float | None:
    """Bytes/s of one range request of up to `nbytes` from the largest weight file (read, then dropped)."""
    sizes = {n: repo.files[n].size or 0 for n in repo.headers}
    if not sizes:
        return None
    name = max(sizes, key=sizes.get)
    start = len(repo.headers[name])
    end = min(sizes[name], start + nbytes)
    if end <= start:
        return None
    t = time.perf_counter()
    got = len(repo.get(name, start, end))
    repo.rate = got / max(time.perf_counter() - t, 1e-6)
    return repo.rate


class RemoteCheckpoint(Checkpoint):
    """A Checkpoint whose index, config.json and headers come from a RemoteRepo; `root` is where its
    files will be (DST's staging area when streaming), or only a label in messages (plan)."""

    local = False

    def __init__(self, repo: RemoteRepo, root: Path):
        self.repo = repo
        super().__init__(root)

    def _has(self, name: str) -> bool:
        return name in self.repo.files

    def _json(self, name: str, what: str, cap: int, fix: str, tensor_at=None) -> object:
        raw = self.repo.side.get(name)
        if raw is None:
            raw = self.repo.side[name] = self.repo.get(name, cap=cap)
        return loads_strict_json(raw, file=self.root / name, what=what, fix=fix, tensor_at=tensor_at)

    def top_level_files(self) -> list[str]:
        return sorted(n for n in self.repo.files if "/" not in n)

    def _load_glob(self) -> None:
        names = [n for n in self.top_level_files() if n.endswith(".safetensors")]
        if not names:
            raise InputError(f"{self.repo.where} has no *.safetensors files and no index", file=self.root,
                             fix="pass a repo with safetensors weights (check --include/--exclude patterns)")
        for fname in names:
            self._add_file(fname)

    def _header(self, fname: str) -> SafetensorsFile:
        head = self.repo.headers.get(fname)
        if head is None:
            head = self.repo.headers[fname] = self.repo.fetch_header(fname)
        return parse_header(head[8:], self.repo.files[fname].size or 0, self.root / fname)

    def header_fingerprint(self, fname: str) -> dict:
        return {"size": self.repo.files[fname].size, "header_sha256": hashlib.sha256(self.repo.headers[fname]).hexdigest()}

    def fingerprint(self) -> dict[str, list]:
        """What --resume binds its journal to: each input's identity on the hub (LFS sha256, else git blob
        id) and header, not a local file's times: a streamed input is fetched again, not kept."""
        return {n: [self.repo.files[n].size, None, None, self.repo.files[n].sha256 or self.repo.files[n].blob_id
                    or hashlib.sha256(self.repo.headers[n]).hexdigest()] for n in sorted(self.files)}

    def input_bytes(self) -> int:
        return sum(self.repo.files[n].size or 0 for n in self.files)

    def largest_input(self) -> int:
        return max((self.repo.files[n].size or 0 for n in self.files), default=0)

    def side_bytes(self, names: list[str]) -> int:
        return sum(self.repo.files[n].size or 0 for n in names)



def offline() -> bool:
    """HF_HUB_OFFLINE: no request may be made, so a repo id is read from the HF cache."""
    return hf_constants.is_offline_mode()
