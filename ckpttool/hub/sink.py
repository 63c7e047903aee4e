"""The file object a streamed transfer writes into (hub/stream.py): it hashes what passes (LFS sha256, else
the git blob sha1) on a thread of its own, keeps the header bytes, reports progress, and stops the transfer
when the run stops; `problem()` then says what is wrong with the file, if anything."""

from __future__ import annotations

import hashlib
import queue
import threading

from ckpttool import faults
from ckpttool.hub.guard import TransferRefused

HASH_QUEUE = 3  # pieces of up to 10 MB (huggingface_hub's DOWNLOAD_CHUNK_SIZE) waiting to be hashed


class Aborted(Exception):
    """The run is stopping: a download in flight gives up."""


class BackgroundHash:
    """A hashlib object fed on a thread of its own, so that the transfer's thread goes back to the socket
    while each 10 MB piece hashes (sha256: about 1.2 GB/s per core). Hashing inline, a single paced
    connection ran 7-11% below the link's speed while the conversion kept the other cores busy
    (bench/HISTORY.md). At most HASH_QUEUE pieces wait."""

    def __init__(self, h):
        self.h = h
        self._queue: queue.Queue = queue.Queue(maxsize=HASH_QUEUE)
        self._thread = threading.Thread(target=self._run, name="ckpttool-fetch-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            self.h.update(data)

    def update(self, data: bytes) -> None:
        self._queue.put(data)

    def hexdigest(self) -> str:
        self.close()
        return self.h.hexdigest()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


class HashingSink:
    """The file object http_get writes into: hashes (LFS sha256, else git blob sha1, on a thread of its
    own) and keeps the header bytes as they pass, reports progress, and stops the transfer when the run
    stops. Leaving its `with` ends the hashing thread."""

    def __init__(self, f, remote, head_len: int, progress, stopping):
        self.f, self.remote, self.head_len = f, remote, head_len
        self.progress, self.stopping = progress, stopping
        self.pos = 0
        self.h: BackgroundHash | None = None

    def _reset(self) -> None:
        self.close()
        size = self.remote.size or 0
        self.h = BackgroundHash(hashlib.sha256() if self.remote.sha256 else hashlib.sha1(b"blob %d\0" % size))
        self.head = bytearray()

    def close(self) -> None:
        if self.h is not None:
            self.h.close()

    def __enter__(self) -> "HashingSink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def rehash(self) -> int:
        """Hash what the file already holds (an interrupted fetch); position at its end."""
        self._reset()
        self.f.seek(0)
        while chunk := self.f.read(8 << 20):
            self._take(chunk)
        self.pos = self.f.tell()
        return self.pos

    def _take(self, data) -> None:
        # queued for the hashing thread: a copy only of a buffer http_get may reuse (bytes(bytes) is itself)
        self.h.update(bytes(data))
        if len(self.head) < self.head_len:
            self.head += data[: self.head_len - len(self.head)]

    def write(self, data) -> int:
        if self.stopping is not None and self.stopping():
            raise Aborted()
        faults.point("fetch")
        size = self.remote.size
        if size is not None and self.pos + len(data) > size:  # hub/guard.py cuts the body there first
            raise TransferRefused(f"the hub sent more than the listed {size} bytes; nothing past them was written",
                                  fix="check HF_ENDPOINT and any proxy, or report it to the repo's owner")
        self.f.write(data)
        self._take(data)
        self.pos += len(data)
        if self.progress is not None:
            self.progress(len(data))
        return len(data)

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = self.f.seek(pos, whence)
        return self.pos

    def truncate(self, size: int | None = None) -> int:
        """http_get rewinds when a server ignored its Range: hash the prefix kept again."""
        self.f.truncate(self.pos if size is None else size)
        self.f.flush()
        keep = self.pos if size is None else size
        self.rehash()
        self.f.seek(keep)
        self.pos = keep
        return keep

    def flush(self) -> None:
        self.f.flush()

    def problem(self, header: bytes | None) -> str | None:
        self.f.flush()
        want = self.remote.size
        if want is not None and self.pos != want:
            return f"size {self.pos} differs from the hub's {want}"
        if header is not None and bytes(self.head) != header:
            return "its header differs from the one the plan was made from"
        expected = self.remote.sha256 or self.remote.blob_id
        if expected and self.h.hexdigest() != expected:
            how = "sha256" if self.remote.sha256 else "git-sha1"
            return f"{how} {self.h.hexdigest()} differs from the hub's {expected}"
        return None
