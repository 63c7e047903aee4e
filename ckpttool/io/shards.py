"""Safetensors files of one directory read as tensors: each file's header, one shared read-only descriptor
per file, thread-safe reads of a (file, tensor), and where an input tensor lives (`SourceTensor`): one byte range
of one file, or, for a checkpoint stored cut per rank (mp shards, DCP chunks), the boxes (`Piece`) it is
assembled from. The base of io/checkpoint.Checkpoint and of the per-rank layouts' inputs (ckpttool/layouts)."""

from __future__ import annotations

import hashlib
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ckpttool.dtypes import itemsize
from ckpttool.errors import InputError
from ckpttool.io import mapped
from ckpttool.io.safetensors import SafetensorsFile, TensorInfo, array_from_bytes, read_bytes, read_header

MAX_TENSORS = 1 << 20
"""tensors over all of a checkpoint's files: DeepSeek-V3 lists about 92,000 (weights and scales), Kimi-K2 about
140,000; each costs about 1 KB while planned"""
FINGERPRINT_SAMPLES, FINGERPRINT_BLOCK = 16, 4096  # 17 reads of 4 KiB per input file: cheap even on a cold disk


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of a tensor stored on its own: `name` in `file` (an mp rank's tensor, a DCP chunk), whose bytes
    (`info`, C order, shape the box's size) hold the elements starting at `offset` of the whole tensor."""

    file: str
    name: str
    offset: tuple[int, ...]
    info: TensorInfo


@dataclass(frozen=True, slots=True)
class SourceTensor:
    """Where an input tensor lives: file name relative to the checkpoint dir, and its header entry. A tensor
    stored in boxes (`pieces`: mp ranks, DCP chunks) has `info` for its dtype and whole shape only, and is
    read by assembling them (plan/assemble.py); `file` is then its first piece's."""

    file: str
    info: TensorInfo
    pieces: tuple[Piece, ...] = ()


class ShardFiles:
    """safetensors files of one directory, by file name: their headers, one shared read-only
    descriptor each, and thread-safe reads of a (file, tensor) (pread: the page cache does the rest).

    The base of Checkpoint, and on its own the input of `merge`, whose mp shards repeat tensor names."""

    local = True
    """the files are in `root` now (hub.remote.RemoteCheckpoint: headers from the hub, files later)"""

    def __init__(self, root: Path | str, names: tuple[str, ...] | list[str] = (), *, before_read=None,
                 notes: list[str] | None = None):
        self.root = Path(root)
        if self.local and not self.root.is_dir():
            raise InputError("checkpoint directory does not exist", file=self.root,
                             fix="pass a directory holding *.safetensors (and config.json)")
        self.files: dict[str, SafetensorsFile] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.tensor_count = 0
        self._before_read = before_read
        """called once, before the first file is opened for reading (merge: io.listed's hash check)"""
        self.notes = notes or []
        """what the plan should say about how these files were read"""
        mapped.install()  # SIGIO, for the read leases of mapped reads (from the main thread only)
        for fname in names:
            self._add_file(fname)

    def _add_file(self, fname: str) -> SafetensorsFile:
        sf = self.files[fname] = self._header(fname)
        self.tensor_count += len(sf.tensors)
        if self.tensor_count > MAX_TENSORS:
            raise InputError(f"the checkpoint's headers list over {MAX_TENSORS} tensors by this file (the largest "
                             "real checkpoints list about 150,000); planning them would exhaust memory",
                             file=self.root / fname, fix="the checkpoint is corrupt or hostile; re-download it")
        return sf

    def _header(self, fname: str) -> SafetensorsFile:
        return read_header(self.root / fname)

    def header_fingerprint(self, fname: str) -> dict:
        """Its size and the sha256 of its header: what a plan records of each input file."""
        sf = self.files[fname]
        with open(sf.path, "rb") as f:
            header = f.read(sf.data_start)
        return {"size": sf.path.stat().st_size, "header_sha256": hashlib.sha256(header).hexdigest()}

    def fd(self, fname: str) -> int:
        """A read-only descriptor for one shard, opened once and shared (pread is thread-safe)."""
        with self._lock:
            fd = self._fds.get(fname)
            if fd is None:
                check, self._before_read = self._before_read, None
                if check is not None:
                    check()
                fd = self._fds[fname] = os.open(self.root / fname, os.O_RDONLY)
                mapped.watch(fd, self.root / fname)
        mapped.check(fd)  # another process began to change it: its next read is an error naming it
        return fd

    def info(self, fname: str, name: str) -> TensorInfo:
        return self.files[fname].tensors[name]

    def read_from(self, fname: str, name: str) -> np.ndarray:
        """One tensor's bytes, into fresh memory."""
        info = self.info(fname, name)
        return read_bytes(self.fd(fname), info.start, info.nbytes, self.root / fname)

    def read_pieces(self, src: SourceTensor) -> np.ndarray:
        """A tensor stored in boxes, assembled in memory as a numpy array in the dtype's carrier."""
        dtype, shape = src.info.dtype, src.info.shape
        out = array_from_bytes(np.empty(math.prod(shape) * itemsize(dtype), dtype=np.uint8), dtype, shape)
        for p in src.pieces:
            box = tuple(slice(o, o + k) for o, k in zip(p.offset, p.info.shape))
            out[box] = array_from_bytes(read_bytes(self.fd(p.file), p.info.start, p.info.nbytes, self.root / p.file),
                                        dtype, p.info.shape)
        return out

    def read_rows(self, fname: str, info: TensorInfo, r0: int, r1: int, into: np.ndarray | None = None, *,
                  mapped: bool = False) -> np.ndarray:
        """Rows [r0, r1) of dim 0 (the whole tensor for a scalar) as a numpy array in the dtype's
        carrier: one contiguous byte range, read into the front of `into` (a worker's reusable or
        pinned buffer) when given, or with `mapped` a read-only view of a mapping (`mapped_range`)."""
        if not info.shape:
            return array_from_bytes(self.read_from(fname, info.name), info.dtype, info.shape)
        row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
        nbytes = (r1 - r0) * row_bytes
        if mapped and nbytes:
            buf = self.mapped_range(fname, info.start + r0 * row_bytes, nbytes)
            return array_from_bytes(buf, info.dtype, (r1 - r0, *info.shape[1:]))
        out = into[:nbytes] if into is not None and nbytes else None
        buf = read_bytes(self.fd(fname), info.start + r0 * row_bytes, nbytes, self.root / fname, out=out)
        return array_from_bytes(buf, info.dtype, (r1 - r0, *info.shape[1:]))

    def read_cols(self, fname: str, info: TensorInfo, c0: int, c1: int) -> np.ndarray:
        """Columns [c0, c1) of the last dim (every row of the dims before it) as a numpy array in the dtype's
        carrier: one pread per row, since the columns are strided in the file. For formats packed along the
        input dimension (GPTQ, AWQ), whose output rows are the stored columns."""
        *lead, cols = info.shape
        size = itemsize(info.dtype)
        rows, width = math.prod(lead), (c1 - c0) * size
        buf = np.empty(rows * width, dtype=np.uint8)
        fd = self.fd(fname)
        for r in range(rows):
            read_bytes(fd, info.start + (r * cols + c0) * size, width, self.root / fname, out=buf[r * width:(r + 1) * width])
        return array_from_bytes(buf, info.dtype, (*lead, c1 - c0))

    def mapped_range(self, fname: str, start: int, nbytes: int) -> np.ndarray:
        """Bytes [start, start + nbytes) of a file as a read-only view of a mapping of just that range, no
        copy: for an input in RAM (tmpfs), where a pread is only a memcpy out of the page cache. Its page
        table entries are filled in one call (MAP_POPULATE), not one fault per 64 KiB, and it is unmapped
        when the last view of it goes, so the process's RSS holds the chunks in flight and no more (the
        file's pages stay in the page cache).

        On the 16-core device this took a RAM-to-RAM conversion's execute phase from 2.11-2.18 s to 1.90-1.97 s,
        its CPU time from 32-34 to 28-29 s and its wall time to 0.91-0.98x (bench/HISTORY.md). A mapping of the
        whole file instead, released range by range, kept the pages the kernel maps around each range's ends
        (fault-around): its RSS grew with the model. A file is mapped only under a read lease, so another
        process truncating it cannot end this one with SIGBUS; without one it is read with pread (io/mapped.py)."""
        return mapped.mapped_range(self.fd(fname), self.root / fname, start, nbytes)

    def reopen(self) -> None:
        """In a forked child: descriptors of its own, for leases of its own (a lease belongs to one open file
        description, and the parent's stay with the parent)."""
        mapped.forget_inherited()
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def paths(self) -> list[Path]:
        return [self.root / fname for fname in sorted(self.files)]

    def fingerprint(self) -> dict[str, list]:
        """What --resume binds its journal to: each input file's size, mtime, ctime (which no one can
        set back) and sha256 of its header and FINGERPRINT_SAMPLES blocks spread over its data."""
        out = {}
        for fname in sorted(self.files):
            fd = self.fd(fname)
            st = os.fstat(fd)
            h = hashlib.sha256()
            size = st.st_size
            offsets = {0, *(size * i // FINGERPRINT_SAMPLES for i in range(1, FINGERPRINT_SAMPLES)),
                       max(0, size - FINGERPRINT_BLOCK)}
            for off in sorted(offsets):
                h.update(os.pread(fd, FINGERPRINT_BLOCK, off))
            h.update(os.pread(fd, min(self.files[fname].data_start, 1 << 24), 0))
            out[fname] = [size, st.st_mtime_ns, st.st_ctime_ns, h.hexdigest()]
        return out

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                mapped.forget(fd)
                os.close(fd)
            self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


