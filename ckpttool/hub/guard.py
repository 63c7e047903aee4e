"""The limits every transfer from the hub is held to, whoever makes it: ckpttool's own requests (remote.py's
range requests, stream.py's fetches) and huggingface_hub's (download.py's snapshot_download). One pair of
httpx event hooks on huggingface_hub's shared client wraps each response's body as it arrives:

- the body of a file whose listing ckpttool has read (`expect`) stops at the listed size: a Content-Length
  above what is left of the file is refused before any byte is read, a body that runs past it (no
  Content-Length, or a false one) is cut off there with nothing beyond handed to the writer, a 206 must
  start where it was asked to, and an encoded body is refused (file transfers ask for `identity`, so the
  listed size is the byte count on the wire and a compressed body cannot expand past it);
- no transfer may go STALL_SECONDS without MIN_PROGRESS_BYTES arriving: a server that trickles (0.5 B/s
  never trips a read timeout) or stalls is given up, naming the file. A file's clock runs across
  huggingface_hub's own retries of it, which otherwise spent about 67 s on a full stall.

huggingface_hub's client gets no per-call transport, hence hooks on its shared one, added once by
`install` (again if the client was replaced) and inert for any response but a body in flight.
"""

from __future__ import annotations

import os
import re
import threading
import time
from urllib.parse import unquote, urlsplit

import httpx2
from huggingface_hub.utils import get_session

from ckpttool.errors import InputError

STALL_SECONDS = float(os.environ.get("CKPTTOOL_HUB_STALL_S", 30))
"""a transfer that receives fewer than MIN_PROGRESS_BYTES in this long is given up"""
MIN_PROGRESS_BYTES = int(os.environ.get("CKPTTOOL_HUB_MIN_BYTES", 256 << 10))
IDENTITY = {"Accept-Encoding": "identity"}
"""headers of every file transfer: the listed size is then the size on the wire"""
_RESOLVE = re.compile(r".*/(?P<repo>[^/]+/[^/]+)/resolve/[^/]+/(?P<file>.+)")
_RANGE = re.compile(r"bytes=(\d+)-")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

_sizes: dict[tuple[str, str], int | None] = {}
_lock = threading.Lock()
_local = threading.local()


class TransferRefused(InputError):
    """A transfer broke a limit; raised out of the body's iteration, so no byte past it is written."""


def expect(repo_id: str, sizes: dict[str, int | None]) -> None:
    """The listing of `repo_id` (file -> size): its files' transfers are capped at these sizes. Installs the hooks."""
    with _lock:
        _sizes.update({(repo_id, name): size for name, size in sizes.items()})
    install()


def install() -> None:
    """Add the hooks to huggingface_hub's shared client, unless it has them (a new client gets them anew)."""
    client = get_session()
    with _lock:
        hooks = client.event_hooks
        if _on_request not in hooks["request"]:
            client.event_hooks = {**hooks, "request": [*hooks["request"], _on_request],
                                  "response": [*hooks["response"], _on_response]}


class _Transfer:
    """One file's (or one response's) progress clock. Progress is the furthest byte of the file reached, not
    bytes received: a server that answers every retry with the same first megabyte again makes none."""

    def __init__(self, label: str, size: int | None):
        self.label, self.size = label, size
        self.got = self.mark_bytes = 0
        self.mark = time.monotonic()
        self.done = False

    def reached(self, offset: int) -> None:
        self.got = max(self.got, offset)
        now = time.monotonic()
        if self.got - self.mark_bytes >= MIN_PROGRESS_BYTES:
            self.mark, self.mark_bytes = now, self.got
        elif now - self.mark > STALL_SECONDS:
            raise self.stalled()

    def overdue(self) -> bool:
        return time.monotonic() - self.mark > STALL_SECONDS

    def stalled(self) -> TransferRefused:
        return TransferRefused(
            f"the transfer of {self.label} made no progress: {self.got - self.mark_bytes} bytes in the last "
            f"{time.monotonic() - self.mark:.0f} s (under {MIN_PROGRESS_BYTES} in {STALL_SECONDS:g} s); the hub or "
            "the network stalled, so it was given up", file=self.label,
            fix="retry later (a conversion: rerun with --resume, which keeps the work done and continues the file); "
                "on a link that slow, raise CKPTTOOL_HUB_STALL_S")


def _on_request(request: httpx2.Request) -> None:
    if request.method != "GET":
        return
    m = _RESOLVE.fullmatch(urlsplit(str(request.url)).path)
    key = (unquote(m["repo"]), unquote(m["file"])) if m else None
    with _lock:
        known = key in _sizes
        size = _sizes.get(key)
    current = getattr(_local, "transfer", None)
    if known:  # a retry of the same file keeps its clock
        if current is None or current.done or current.label != f"{key[0]}/{key[1]}":
            _local.transfer = _Transfer(f"{key[0]}/{key[1]}", size)
    elif "/api/" in request.url.path or m is not None:
        _local.transfer = None  # a request of its own, not a redirect's next hop


def _on_response(response: httpx2.Response) -> None:
    request = response.request
    transfer = getattr(_local, "transfer", None) if request.method == "GET" else None
    if transfer is None or response.is_redirect or response.status_code >= 400:
        response.stream = _Guarded(response.stream, _Transfer(str(request.url), None), 0, None)
        return
    allowed, start = None, 0
    if transfer.size is not None:
        if response.status_code == 206:
            start = _checked_range(response, transfer)
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding != "identity":
            raise TransferRefused(f"the hub sent {transfer.label} {encoding}-encoded although the transfer asked for "
                                  "identity; its size on the wire would not be its listed size", file=transfer.label,
                                  fix="check HF_ENDPOINT and any proxy between you and the hub")
        allowed = transfer.size - start
        length = response.headers.get("Content-Length")
        if length is not None and (not length.isdigit() or int(length) > allowed):
            raise TransferRefused(f"the hub announced a body of {length} bytes for {transfer.label}, but only "
                                  f"{allowed} of its listed {transfer.size} are left from byte {start}; nothing of "
                                  "it was written", file=transfer.label, fix=_FIX_HOSTILE)
    response.stream = _Guarded(response.stream, transfer, start, allowed)


_FIX_HOSTILE = ("the hub (or a proxy) answers against its own listing: check HF_ENDPOINT and any proxy, "
                "or report it to the repo's owner")


def _checked_range(response: httpx2.Response, transfer: _Transfer) -> int:
    asked = _RANGE.match(response.request.headers.get("Range", ""))
    got = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
    start = int(asked[1]) if asked else 0
    if got is None or int(got[1]) != start or (got[3] != "*" and int(got[3]) != transfer.size):
        raise TransferRefused(f"the hub answered a range request for {transfer.label} from byte {start} with "
                              f"Content-Range {response.headers.get('Content-Range')!r} (listed size {transfer.size})",
                              file=transfer.label, fix=_FIX_HOSTILE)
    return start


class _Guarded(httpx2.SyncByteStream):
    """A response body from byte `start` of its file, held to its transfer's limits: at most `allowed` bytes,
    and progress."""

    def __init__(self, inner, transfer: _Transfer, start: int, allowed: int | None):
        self.inner, self.transfer, self.start, self.allowed = inner, transfer, start, allowed
        self.sent = 0
        self.timed_out = False

    def __iter__(self):
        chunks = iter(self.inner)
        while True:
            try:
                chunk = next(chunks)
            except StopIteration:
                self.transfer.done = True
                return
            except httpx2.TimeoutException as exc:
                if self.transfer.overdue():
                    raise self.transfer.stalled() from exc
                self.timed_out = True
                raise  # huggingface_hub retries it; the file's clock goes on
            if self.allowed is not None and self.sent + len(chunk) > self.allowed:
                t = self.transfer
                raise TransferRefused(f"the hub sent more of {t.label} than its listed {t.size} bytes; the transfer "
                                      f"was stopped there and nothing past it was written", file=t.label,
                                      fix=_FIX_HOSTILE)
            self.sent += len(chunk)
            self.transfer.reached(self.start + self.sent)
            yield chunk

    def close(self) -> None:
        # a body left early (a header range read) ends its clock; only a timed-out one is retried on it
        self.transfer.done = self.transfer.done or not self.timed_out
        self.inner.close()
