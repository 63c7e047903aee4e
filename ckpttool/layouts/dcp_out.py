"""A torch distributed checkpoint as an output (`convert SRC DST --layout dcp [--mp N]`).

What torch's FileSystemWriter writes, planned ahead: one `__{r}_0.distcp` file per rank, each tensor cut along dim 0
into N chunks as FSDP2 cuts it (torch.chunk's sizes; scalars and tensors of fewer rows than ranks on the first
ranks), every chunk stored as a `torch.save` archive: an uncompressed zip whose framing (data.pkl, byteorder,
version, the central directory) is known from the chunk's dtype and shape alone and is written as the file's fixed
bytes (`OutFile.fixed`), its data member 64-byte aligned where the executor writes the chunk's rows like any
tensor's. The data member's CRC is left 0, as torch.save writes it with `compute_crc32` off; torch.load does not
check it. `.metadata` (the pickle DCP's loader reads) is made by torch's own classes: writing a DCP needs torch
(`pip install 'ckpttool[dcp]'`); reading one does not.
"""

from __future__ import annotations

import math
import struct
import zlib

from ckpttool.dtypes import torch_dtype
from ckpttool.errors import PlanError
from ckpttool.io.dcp import METADATA
from ckpttool.plan.types import OutFile, PlacedTensor, TensorPlan

ALIGN = 64
ARCHIVE = "archive"
MAX_CHUNK = 0xFFFFFFFF - (1 << 20)  # plain zip sizes; a larger chunk would need zip64 records
_STORAGE = {code: name for name, code in {
    "BFloat16Storage": "BF16", "HalfStorage": "F16", "FloatStorage": "F32", "DoubleStorage": "F64",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8",
    "BoolStorage": "BOOL", "Float8_e4m3fnStorage": "F8_E4M3", "Float8_e5m2Storage": "F8_E5M2"}.items()}


def rank_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def place(tensors: list[TensorPlan], family, cfg, ranks: int | None, files_of: dict, input_files) -> list[TensorPlan]:
    n, out = ranks or 1, []
    for t in tensors:
        if t.dtype not in _STORAGE:
            raise PlanError(f"{t.dtype} has no torch.save storage type ckpttool writes", tensor=t.name,
                            fix="convert to BF16 (--dtype bf16) or write HF")
        rows = t.shape[0] if t.shape else 0
        if n == 1 or rows == 0:
            out.append(t.with_(file=rank_file(0)))
            continue
        step = -(-rows // n)  # torch.chunk: ceil(rows / n) rows each, the last ranks fewer or none
        for r in range(n):
            first, length = r * step, min(step, rows - r * step)
            if length > 0:
                out.append(t.with_(shape=(length, *t.shape[1:]), narrow=(0, first, length), file=rank_file(r)))
    for t in out:
        if t.nbytes > MAX_CHUNK:
            raise PlanError(f"a chunk of {t.nbytes} bytes needs zip64 records, which ckpttool does not write",
                            tensor=t.name, fix="cut it into smaller chunks with a larger --mp")
    return out


def lay_out(tensors: list[TensorPlan], file_order: list[str]) -> list[OutFile]:
    by_file: dict[str, list[TensorPlan]] = {}
    for t in tensors:
        by_file.setdefault(t.file, []).append(t)
    files = []
    for name in sorted(by_file, key=lambda f: int(f.split("_")[2])):
        at, placed, fixed = 0, [], []
        for t in sorted(by_file[name], key=lambda t: (t.name, t.narrow or ())):
            pad = -at % ALIGN
            head, tail = item_framing(t)
            fixed.append((at, b"\0" * pad + head))
            start = at + pad + len(head)
            placed.append(PlacedTensor(t, start, start + t.nbytes))
            fixed.append((start + t.nbytes, tail))
            at = start + t.nbytes + len(tail)
        first = fixed.pop(0)[1]  # the first item's head is the file's header
        files.append(OutFile(name, first, placed, tuple(fixed)))
    return files


def item_framing(t: TensorPlan) -> tuple[bytes, bytes]:
    """A chunk's torch.save archive around its data: the local records before the data member, and the version
    record, the central directory and the end record after it. Offsets are the archive's own."""
    shape = tuple(t.shape)
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    records = [("data.pkl", _tensor_pickle(_STORAGE[t.dtype], math.prod(shape), shape, stride)),
               ("byteorder", b"little"), ("data/0", None), ("version", b"3\n")]
    head, tail, central, at = bytearray(), bytearray(), bytearray(), 0
    past_data = False  # records after the data member go after the chunk's bytes
    for name, data in records:
        full = f"{ARCHIVE}/{name}".encode()
        n = t.nbytes if data is None else len(data)
        crc = 0 if data is None else zlib.crc32(data)
        extra = b""
        if data is None:  # pad the local header so the data starts 64-byte aligned in the archive
            pad = -(at + 30 + len(full) + 4) % ALIGN
            extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB", as torch pads
        local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, n, n, len(full), len(extra)) + full + extra
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, crc, n, n, len(full), 0, 0, 0,
                               0, 0, at) + full
        if data is None:
            head += local  # the data member's bytes follow: the executor writes them
            past_data = True
        else:
            (tail if past_data else head).extend(local + data)
        at += len(local) + n
    cd_at = at
    tail += central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(records), len(records), len(central), cd_at, 0)
    return bytes(head), bytes(tail)


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n) if n < 1 << 31 else b"\x8a\x08" + struct.pack("<q", n)


def _str(s: str) -> bytes:
    return b"X" + struct.pack("<I", len(s)) + s.encode()


def _tuple(values) -> bytes:
    return b"(" + b"".join(_int(v) for v in values) + b"t"


def _tensor_pickle(storage: str, numel: int, shape: tuple, stride: tuple) -> bytes:
    """torch.save's data.pkl for one tensor over the whole of storage '0' (protocol 2, as torch writes it)."""
    return (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(" + b"(" + _str("storage") + f"ctorch\n{storage}\n".encode()
            + _str("0") + _str("cpu") + _int(numel) + b"tQ" + _int(0) + _tuple(shape) + _tuple(stride)
            + b"\x89ccollections\nOrderedDict\n)RtR.")


def extras(files: list[OutFile], tensors: list[TensorPlan]) -> dict[str, bytes]:
    """`.metadata`: every tensor's dtype, whole shape and chunks, and each chunk's archive's byte range."""
    try:
        import pickle

        import torch
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                           TensorProperties, TensorStorageMetadata)
    except ImportError:
        raise PlanError("writing a DCP's .metadata needs torch", fix="pip install 'ckpttool[dcp]'") from None
    chunks: dict[str, list] = {}
    for f in files:
        for p in f.tensors:
            head, tail = item_framing(p.tensor)
            chunks.setdefault(p.tensor.name, []).append((p.tensor, f.name, p.start - len(head),
                                                         len(head) + p.tensor.nbytes + len(tail)))
    state, storage = {}, {}
    for name, found in sorted(chunks.items()):
        found.sort(key=lambda c: c[0].narrow or ())
        t0 = found[0][0]
        rows = sum(t.shape[0] for t, *_ in found) if t0.narrow else None
        shape = (rows, *t0.shape[1:]) if rows is not None else t0.shape
        metas = []
        for i, (t, fname, start, length) in enumerate(found):
            offset = tuple((t.narrow[1] if t.narrow and d == 0 else 0) for d in range(len(shape)))
            metas.append(ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(t.shape)))
            storage[MetadataIndex(name, torch.Size(offset), i)] = _StorageInfo(fname, start, length)
        props = TensorProperties(dtype=torch_dtype(t0.dtype))
        state[name] = TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=metas)
    md = Metadata(state_dict_metadata=state, planner_data={n: (n,) for n in state}, storage_data=storage)
    return {METADATA: pickle.dumps(md)}
