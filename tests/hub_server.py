"""A small real Hugging Face Hub on 127.0.0.1, for driving the real huggingface_hub client in tests.

It serves one directory per repo at one commit, through the endpoints huggingface_hub 2.4 calls for a
download (read from its installed source):

  GET  /api/models/{repo}[/revision/{rev}]     model info: sha + siblings (size, blobId, lfs.sha256 with ?blobs=1)
  GET  /api/models/{repo}/tree/{rev}[/{path}]  tree listing (snapshot_download lists files with it)
  HEAD /{repo}/resolve/{rev}/{path}            ETag, X-Repo-Commit, Content-Length; LFS: X-Linked-Etag/-Size
  GET  /{repo}/resolve/{rev}/{path}            the bytes, with Range (206) unless told to ignore it

It never advertises Xet (no X-Xet-Hash, no xetHash), so the client stays on plain HTTP. Faults are
switched on per file: cut a transfer at a byte offset, stall it until released, serve corrupt bytes,
ignore Range; or answer as a hostile hub would (`hostile`: an endless body, a false Content-Length, a
trickle, a gzip bomb, a wrong Content-Range); `throttle` caps the rate of all transfers together. Every request is logged; unknown
paths answer 404 and are listed in `unknown`.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt")  # what a real repo's .gitattributes sends to LFS
STALL_LIMIT_S = 30.0  # a stalled transfer gives up on its own, so a broken test cannot hang the server
SEND_BYTES = 64 * 1024
"""a body goes out in pieces of this much, each paced by `throttle`. 1 MiB pieces were tried for the
overlap bench: an unthrottled 10.87 GB download took 52 s on the 16-core device against 24-28 s with
these (bench/HISTORY.md)."""


@dataclass(frozen=True, slots=True)
class RepoEntry:
    path: str
    data: bytes
    blob_id: str  # git blob sha1 of what git stores: the content, or for LFS files the pointer
    sha256: str | None  # LFS files only: sha256 of the content

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id


@dataclass(slots=True)
class Repo:
    repo_id: str
    commit: str
    files: dict[str, RepoEntry]
    revisions: dict[str, str]
    token: str | None = None  # when set, the repo is private: requests need `Authorization: Bearer <token>`


@dataclass(slots=True)
class Request:
    method: str
    path: str  # unquoted, without the query
    range: str | None
    authorization: str | None
    status: int = 0
    sent: int = 0  # body bytes written before the response ended (a cut transfer shows here)


@dataclass(slots=True)
class _Faults:
    cuts: dict[str, list[int]] = field(default_factory=dict)  # file -> byte offsets, each fires once
    stall_at: dict[str, int] = field(default_factory=dict)
    corrupt: dict[str, list] = field(default_factory=dict)  # file -> [offset, remaining times (None: always)]
    honor_range: bool = True
    hostile: dict[str, tuple[str, int]] = field(default_factory=dict)  # file -> (how, n): see HubServer.hostile


_POINTER_SIZE = 134  # bytes of an LFS pointer file for a sha256 oid and a small size


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load_repo(repo_id: str, root: Path, *, revisions: tuple[str, ...] = ("main",), token: str | None = None) -> Repo:
    """Snapshot every file under `root` as one commit of `repo_id` (the commit id hashes the content)."""
    files = {}
    for path in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        if rel.endswith(LFS_SUFFIXES):
            sha256 = hashlib.sha256(data).hexdigest()
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n"
            files[rel] = RepoEntry(rel, data, git_blob_sha1(pointer.encode()), sha256)
        else:
            files[rel] = RepoEntry(rel, data, git_blob_sha1(data), None)
    commit = hashlib.sha1("".join(f"{e.path}:{e.blob_id}\n" for e in files.values()).encode()).hexdigest()
    return Repo(repo_id, commit, files, {rev: commit for rev in revisions}, token)


class HubServer:
    """`with HubServer([repo]) as hub:` serves on hub.url until the block ends. Several Repos of one repo_id
    are commits of that repo, each answering to its own revisions (load_repo's `revisions`); the first one's
    token guards them all."""

    def __init__(self, repos: list[Repo]):
        self.repos: dict[str, Repo] = {}
        self.commits: dict[str, list[Repo]] = {}
        for r in repos:
            self.repos.setdefault(r.repo_id, r)
            self.commits.setdefault(r.repo_id, []).append(r)
        self.log: list[Request] = []
        self.unknown: list[str] = []
        self.stalled = threading.Event()  # set when a stalled transfer reaches its offset
        self._release = threading.Event()
        self._faults = _Faults()
        self._lock = threading.Lock()
        self._rate: float | None = None  # bytes/s over all transfers together (throttle)
        self._next_send = 0.0
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._release.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    # -- fault switches -------------------------------------------------------------------------------
    def cut(self, path: str, *offsets: int) -> None:
        """Close the connection once the body of `path` reaches each offset (each cut fires once)."""
        with self._lock:
            self._faults.cuts[path] = sorted(offsets)

    def stall(self, path: str, offset: int) -> None:
        """Send `path` up to `offset`, set `stalled`, and hold the connection until release() or close()."""
        with self._lock:
            self._faults.stall_at[path] = offset

    def release(self) -> None:
        with self._lock:
            self._faults.stall_at.clear()
        self._release.set()

    def corrupt(self, path: str, offset: int, times: int | None = None) -> None:
        """Flip one byte of `path` at `offset` in the next `times` GETs (None: every GET); size unchanged."""
        with self._lock:
            self._faults.corrupt[path] = [offset, times]

    def throttle(self, bytes_per_s: float | None) -> None:
        """Send file bodies at most this fast, all connections together (a link of that speed); None: no limit."""
        with self._lock:
            self._rate, self._next_send = bytes_per_s, time.monotonic()

    def _pace(self, n: int) -> None:
        with self._lock:
            if self._rate is None:
                return
            now = time.monotonic()
            at = max(now, self._next_send)
            self._next_send = at + n / self._rate
        if at > now:
            time.sleep(at - now)

    def hostile(self, path: str, how: str, n: int = 0) -> None:
        """Answer GETs of `path` as a hostile hub: `endless` (no Content-Length, the file then zeros until the
        client hangs up), `overlong` (Content-Length and body n bytes past the file), `trickle` (the first n
        bytes, then one byte every 2 s), `stall` (the first n bytes, then nothing until release() or close(),
        every time, a range request too), `gzip` (Content-Encoding gzip of the file followed by n zero bytes), `wrong-range` (a range request answered from byte 0 with a 206 saying so)."""
        with self._lock:
            self._faults.hostile[path] = (how, n)

    def ignore_range(self, ignore: bool = True) -> None:
        with self._lock:
            self._faults.honor_range = not ignore

    def reset(self) -> None:
        """No faults, empty log: the state each test starts from."""
        self._release.set()  # free any transfer still held by an earlier stall
        with self._lock:
            self._faults = _Faults()
            self.log.clear()
            self.unknown.clear()
        self.stalled.clear()
        self._release = threading.Event()

    def requests(self, method: str | None = None, contains: str = "") -> list[Request]:
        with self._lock:
            return [r for r in self.log if (method is None or r.method == method) and contains in r.path]

    def gets(self, filename: str) -> list[Request]:
        return [r for r in self.requests("GET", "/resolve/") if r.path.endswith("/" + filename)]

    # -- used by the handler --------------------------------------------------------------------------
    def _body_plan(self, path: str, start: int, end: int) -> tuple[int | None, bool, tuple[int, int] | None]:
        """For a GET of bytes [start, end): (stop offset or None, stall?, (flip offset, xor) or None)."""
        with self._lock:
            f = self._faults
            stop = next((o for o in f.cuts.get(path, []) if start < o < end), None)
            if stop is not None:
                f.cuts[path].remove(stop)
            stall = path in f.stall_at and start < f.stall_at[path] < end
            if stall:
                stop = f.stall_at[path]
            flip = None
            if path in f.corrupt:
                offset, times = f.corrupt[path]
                if times is None or times > 0:
                    flip = (offset, 0xFF)
                    if times is not None:
                        f.corrupt[path][1] = times - 1
            return stop, stall, flip


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"  # keep-alive and Range, as the real hub
    timeout = 20  # a client that goes away never pins a server thread for long

    def log_message(self, format, *args) -> None:  # noqa: A002 - quiet test output
        pass

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        path = unquote(split.path)
        self.req = Request(method, path, self.headers.get("Range"), self.headers.get("Authorization"))
        with self.hub._lock:
            self.hub.log.append(self.req)
        query = parse_qs(split.query)
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", split.path):
            self._model_info(unquote(m[1]), unquote(m[2] or "main"), query)
        elif m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", split.path):
            self._tree(unquote(m[1]), unquote(m[2]), unquote(m[3] or ""), query)
        elif m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", split.path):
            self._resolve(unquote(m[1]), unquote(m[2]), unquote(m[3]), send_body=method == "GET")
        else:
            with self.hub._lock:
                self.hub.unknown.append(f"{method} {self.path}")
            self._error(404, "EntryNotFound", "unknown endpoint")

    # -- endpoints ------------------------------------------------------------------------------------
    def _repo_at(self, repo_id: str, revision: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}"):
            self._error(401, "RepoNotFound", "Repository not found")  # the hub's answer for missing and private
            return None
        repo = next((r for r in self.hub.commits[repo_id] if revision in r.revisions or revision == r.commit), None)
        if repo is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def _model_info(self, repo_id: str, revision: str, query: dict) -> None:
        repo = self._repo_at(repo_id, revision)
        if repo is None:
            return
        blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
        siblings = []
        for e in repo.files.values():
            sib: dict = {"rfilename": e.path}
            if blobs:
                sib.update(size=len(e.data), blobId=e.blob_id)
                if e.sha256:
                    sib["lfs"] = {"size": len(e.data), "sha256": e.sha256, "pointerSize": _POINTER_SIZE}
            siblings.append(sib)
        self._json({"_id": repo.commit[:24], "id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.commit,
                    "private": repo.token is not None, "disabled": False, "gated": False, "siblings": siblings})

    def _tree(self, repo_id: str, revision: str, prefix: str, query: dict) -> None:
        repo = self._repo_at(repo_id, revision)
        if repo is None:
            return
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        base = prefix.rstrip("/") + "/" if prefix else ""
        entries, folders = [], set()
        for e in repo.files.values():
            if not e.path.startswith(base):
                continue
            parts = e.path[len(base):].split("/")
            for depth in range(1, len(parts)):
                folder = base + "/".join(parts[:depth])
                if (recursive or depth == 1) and folder not in folders:
                    folders.add(folder)
                    entries.append({"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(),
                                    "size": 0, "path": folder})
            if len(parts) == 1 or recursive:
                item = {"type": "file", "oid": e.blob_id, "size": len(e.data), "path": e.path}
                if e.sha256:
                    item["lfs"] = {"oid": e.sha256, "size": len(e.data), "pointerSize": _POINTER_SIZE}
                entries.append(item)
        self._json(entries)

    def _resolve(self, repo_id: str, revision: str, filename: str, *, send_body: bool) -> None:
        repo = self._repo_at(repo_id, revision)
        if repo is None:
            return
        entry = repo.files.get(filename)
        if entry is None:
            self._error(404, "EntryNotFound", f"{filename} does not exist", commit=repo.commit)
            return
        size = len(entry.data)
        start, end, status = 0, size, 200
        hostile = self.hub._faults.hostile.get(filename)
        if hostile is not None and send_body and (hostile[0] == "stall"
                                                  or (hostile[0] == "wrong-range") == ("Range" in self.headers)):
            self._hostile(entry, *hostile)
            return
        rng = self.headers.get("Range")
        if rng and self.hub._faults.honor_range:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if m is None or int(m[1]) >= size:
                self._error(416, None, "Range Not Satisfiable", extra={"Content-Range": f"bytes */{size}"})
                return
            start, end, status = int(m[1]), min(size, int(m[2]) + 1) if m[2] else size, 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{entry.etag}"')
        self.send_header("X-Repo-Commit", repo.commit)
        if entry.sha256:
            self.send_header("X-Linked-Etag", f'"{entry.sha256}"')
            self.send_header("X-Linked-Size", str(size))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        self.req.status = status
        if send_body:
            self._send_body(entry, start, end)

    def _send_body(self, entry: RepoEntry, start: int, end: int) -> None:
        stop, stall, flip = self.hub._body_plan(entry.path, start, end)
        data = entry.data
        if flip is not None and start <= flip[0] < end:
            data = bytearray(data)
            data[flip[0]] ^= flip[1]
        last = end if stop is None else stop
        view = memoryview(data)[start:last]
        try:
            for i in range(0, len(view), SEND_BYTES):
                piece = view[i:i + SEND_BYTES]
                self.hub._pace(len(piece))
                self.wfile.write(piece)
                self.req.sent += len(piece)
            self.wfile.flush()
            if stall:
                self.hub.stalled.set()
                self.hub._release.wait(STALL_LIMIT_S)
        except OSError:  # the client went away (killed in a test): nothing more to send
            pass
        if stop is not None:
            # Promised more than we sent: closing now is what a dropped connection looks like to the client.
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _hostile(self, entry: RepoEntry, how: str, n: int) -> None:
        data = entry.data
        headers = {"Content-Type": "application/octet-stream", "ETag": f'"{entry.etag}"'}
        status, body = 200, data
        if how == "overlong":
            body = data + b"\0" * n
            headers["Content-Length"] = str(len(body))
        elif how == "gzip":
            import gzip

            body = gzip.compress(data + b"\0" * n, 9)
            headers.update({"Content-Encoding": "gzip", "Content-Length": str(len(body))})
        elif how == "wrong-range":
            status = 206
            headers.update({"Content-Range": f"bytes 0-{len(data) - 1}/{len(data)}", "Content-Length": str(len(data))})
        elif how in ("trickle", "stall"):
            headers["Content-Length"] = str(len(data))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        if "Content-Length" not in headers:  # the body ends when the connection does
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.req.status = status
        deadline = time.monotonic() + STALL_LIMIT_S
        try:
            if how in ("trickle", "stall"):
                self.wfile.write(data[:n])
                self.wfile.flush()
                self.req.sent = n
                if how == "stall":
                    self.hub.stalled.set()
                    self.hub._release.wait(STALL_LIMIT_S)
                for i in range(n, len(data) if how == "trickle" else n):
                    if time.monotonic() > deadline or self.hub._release.wait(2.0):
                        break
                    self.wfile.write(data[i:i + 1])
                    self.wfile.flush()
                    self.req.sent += 1
            else:
                self.wfile.write(body)
                self.req.sent = len(body)
                while how == "endless" and time.monotonic() < deadline:  # until the client hangs up
                    self.wfile.write(b"\0" * SEND_BYTES)
                    self.req.sent += SEND_BYTES
            self.wfile.flush()
        except OSError:
            pass
        self.close_connection = True

    # -- responses ------------------------------------------------------------------------------------
    def _json(self, payload: object) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.req.status = 200
        if self.command != "HEAD":
            self.wfile.write(body)
            self.req.sent = len(body)

    def _error(self, status: int, code: str | None, message: str, *, commit: str | None = None,
               extra: dict | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.req.status = status
        if self.command != "HEAD":
            self.wfile.write(body)
