"""A torch distributed checkpoint (DCP) read without torch and without unpickling anything blindly.

A DCP directory is `.metadata` (a pickle of torch.distributed.checkpoint's `Metadata`: each state-dict entry's
dtype, size and chunks, and where each chunk is stored) and `*.distcp` files. torch's FileSystemWriter stores each
tensor chunk as a `torch.save` archive at the chunk's offset in a `.distcp` file: an uncompressed zip whose
`data/<key>` member holds the chunk's raw bytes, and whose `data.pkl` says the storage key, dtype, size and
stride. Both pickles are read by a restricted unpickler that admits the DCP metadata classes, torch's dtypes, Size,
layout and tensor-rebuild names as inert records, plain containers, and refuses every other global by name; every
name in them (state-dict keys, file names) is untrusted and checked. A chunk is then one byte range of one file:
the zip's central directory and local header locate its data, and the pickle's storage offset, size and stride
must say it is the whole chunk in C order, so readers copy rows from it like from a safetensors tensor.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from ckpttool.errors import InputError
from ckpttool.io.layout import check_name
from ckpttool.io.safetensors import check_tensor_name, printable

METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # ~100 bytes a chunk: millions of chunks
MAX_ITEM_PICKLE = 1 << 16  # a chunk's data.pkl is ~160 bytes
_FIX = "the DCP is corrupt, hostile or not written by torch.distributed.checkpoint's FileSystemWriter"

TORCH_DTYPES = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32",
                "float64": "F64", "double": "F64", "int64": "I64", "long": "I64", "int32": "I32", "int": "I32",
                "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
                "float8_e5m2": "F8_E5M2", "uint16": "U16", "uint32": "U32", "uint64": "U64"}
"""torch dtype name -> safetensors dtype code"""
_STORAGES = {"BFloat16Storage": "BF16", "HalfStorage": "F16", "FloatStorage": "F32", "DoubleStorage": "F64",
             "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
             "ByteStorage": "U8", "BoolStorage": "BOOL", "Float8_e4m3fnStorage": "F8_E4M3",
             "Float8_e5m2Storage": "F8_E5M2", "UInt16Storage": "U16", "UInt32Storage": "U32", "UInt64Storage": "U64"}


class Record:
    """An object of an admitted class: its fields as attributes, nothing else runs."""

    kind = "Record"

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots)
        if isinstance(state, dict):
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str) and k != "kind"})
        else:  # TensorProperties: (dtype, layout, requires_grad, memory format, pin_memory)
            self.state = state

    def __repr__(self) -> str:
        return f"{self.kind}({self.__dict__})"


class Dtype(str):
    """A torch dtype, by its name."""


def _record(name: str) -> type:
    return type(name, (Record,), {"kind": name})


_ADMITTED: dict[tuple[str, str], object] = {
    **{("torch.distributed.checkpoint.metadata", n): _record(n)
       for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta")},
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): lambda value: ("memory_format", value),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _record("_StorageInfo"),
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): lambda name: ("layout", name),
    ("torch._utils", "_rebuild_tensor_v2"): lambda *args: ("tensor", args),
    ("collections", "OrderedDict"): dict,
    **{("pathlib", n): (lambda *parts: "/".join(map(str, parts)))
       for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")},
    **{("torch", n): Dtype(n) for n in TORCH_DTYPES},
    **{("torch", n): ("storage type", code) for n, code in _STORAGES.items()},
}
"""(module, name) -> what that global reads as; any other global is refused"""


class _Restricted(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path):
        super().__init__(io.BytesIO(data))
        self.path = path

    def find_class(self, module: str, name: str):
        found = _ADMITTED.get((module, name))
        if found is None:
            raise InputError(f"the pickle names {printable(module)}.{printable(name)}, which is not a "
                             "torch.distributed.checkpoint metadata class; it is not unpickled", file=self.path, fix=_FIX)
        return found

    def persistent_load(self, pid):  # a torch.save archive's storage: ('storage', type, key, location, numel)
        return ("persistent", pid)


def restricted_loads(data: bytes, path: Path) -> object:
    try:
        return _Restricted(data, path).load()
    except InputError:
        raise
    except Exception as exc:  # a malformed pickle: whatever the opcode machinery raises
        raise InputError(f"cannot read the pickle: {type(exc).__name__}: {printable(str(exc))[:200]}",
                         file=path, fix=_FIX) from None


@dataclass(frozen=True)
class Chunk:
    """One stored box of a tensor: its offset and size in the whole tensor, and where its bytes are."""

    offset: tuple[int, ...]
    size: tuple[int, ...]
    file: str
    item_start: int
    """the torch.save archive's first byte in `file`"""
    item_length: int


@dataclass(frozen=True)
class DcpTensor:
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class DcpMetadata:
    tensors: dict[str, DcpTensor]
    other: list[str]
    """state-dict entries that are not tensors (BytesStorageMetadata: a step count, an RNG state, ...)"""
    files: list[str]


def read_metadata(root: Path) -> DcpMetadata:
    """`.metadata` read by the restricted unpickler and checked: names plain, chunks inside their tensor, tiling
    it exactly, each stored in a `.distcp` file of this directory."""
    path = root / METADATA
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode):
            raise InputError(".metadata is not a regular file", file=path, fix=_FIX)
        if st.st_size > MAX_METADATA_BYTES:
            raise InputError(f".metadata is {st.st_size} bytes, over the {MAX_METADATA_BYTES}-byte cap", file=path, fix=_FIX)
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read .metadata: {exc.strerror or exc}", file=path, fix=_FIX) from None
    md = restricted_loads(data, path)
    sd = getattr(md, "state_dict_metadata", None) if getattr(md, "kind", "") == "Metadata" else None
    storage = getattr(md, "storage_data", None)
    if not isinstance(sd, dict) or not isinstance(storage, dict):
        raise InputError("the pickle is not a DCP Metadata with state_dict_metadata and storage_data (a DCP saved "
                         "with another storage writer?)", file=path, fix=_FIX)
    where: dict[tuple[str, tuple], object] = {}
    for index, info in storage.items():
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        if getattr(index, "kind", "") != "MetadataIndex" or getattr(info, "kind", "") != "_StorageInfo":
            raise InputError("a storage_data entry is not a MetadataIndex -> _StorageInfo", file=path, fix=_FIX)
        if getattr(info, "transform_descriptors", None):
            raise InputError(f"chunk of {printable(str(fqn))!r} is stored through transforms "
                             f"{printable(repr(info.transform_descriptors))[:80]} (compressed?), which are not read",
                             file=path, fix="save the DCP without storage transforms (no compression)")
        where[fqn, tuple(offset) if isinstance(offset, tuple) else None] = info
    tensors, other, files = {}, [], set()
    for fqn, entry in sd.items():
        check_tensor_name(fqn, path)
        if getattr(entry, "kind", "") == "BytesStorageMetadata":
            other.append(fqn)
            continue
        if getattr(entry, "kind", "") != "TensorStorageMetadata":
            raise InputError(f"state-dict entry is a {type(entry).__name__}, not tensor or bytes metadata",
                             file=path, tensor=fqn, fix=_FIX)
        tensors[fqn] = t = _tensor(fqn, entry, where, path)
        files.update(c.file for c in t.chunks)
    return DcpMetadata(tensors, sorted(other), sorted(files))


def _tensor(fqn: str, entry, where: dict, path: Path) -> DcpTensor:
    props = getattr(entry, "properties", None)
    state = getattr(props, "state", None)
    dtype = state[0] if isinstance(state, tuple) and state else getattr(props, "dtype", None)
    layout = state[1] if isinstance(state, tuple) and len(state) > 1 else getattr(props, "layout", ("layout", "torch.strided"))
    if not isinstance(dtype, Dtype) or dtype not in TORCH_DTYPES:
        raise InputError(f"dtype {printable(repr(dtype))[:60]} is not one ckpttool reads", file=path, tensor=fqn, fix=_FIX)
    if layout != ("layout", "torch.strided"):
        raise InputError(f"layout {printable(repr(layout))[:60]} is not a dense (strided) tensor", file=path, tensor=fqn,
                         fix="save dense tensors: sparse tensors have no HF safetensors form")
    shape = _dims(getattr(entry, "size", None), path, fqn, "size")
    chunks = getattr(entry, "chunks", None)
    if not isinstance(chunks, list) or not chunks:
        raise InputError("tensor has no chunks", file=path, tensor=fqn, fix=_FIX)
    out = []
    for c in chunks:
        offset, size = _dims(getattr(c, "offsets", None), path, fqn, "chunk offsets"), _dims(getattr(c, "sizes", None), path, fqn, "chunk sizes")
        if len(offset) != len(shape) or len(size) != len(shape) or any(o + k > n for o, k, n in zip(offset, size, shape)):
            raise InputError(f"chunk at {list(offset)} of size {list(size)} is not inside the tensor's {list(shape)}",
                             file=path, tensor=fqn, fix=_FIX)
        info = where.get((fqn, offset))
        if info is None:
            raise InputError(f"no storage_data entry holds the chunk at {list(offset)}", file=path, tensor=fqn, fix=_FIX)
        name = check_name(getattr(info, "relative_path", None), source=path, what="chunk file", fix=_FIX)
        start, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not name.endswith(".distcp") or not all(isinstance(v, int) and v >= 0 for v in (start, length)):
            raise InputError(f"chunk at {list(offset)} is stored at {printable(name)!r} [{start}, +{length}), not a "
                             "byte range of a .distcp file", file=path, tensor=fqn, fix=_FIX)
        out.append(Chunk(offset, size, name, start, length))
    _check_tiling(fqn, shape, out, path)
    return DcpTensor(fqn, TORCH_DTYPES[dtype], shape, tuple(sorted(out, key=lambda c: c.offset)))


def _dims(value, path: Path, fqn: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40
                                               for v in value):
        raise InputError(f"{what} {printable(repr(value))[:60]} is not a tuple of sizes", file=path, tensor=fqn, fix=_FIX)
    return value


def _check_tiling(fqn: str, shape: tuple, chunks: list[Chunk], path: Path) -> None:
    """The chunks cover the tensor exactly once: as many elements as it has, no two overlapping."""
    if sum(math.prod(c.size) for c in chunks) != math.prod(shape):
        raise InputError(f"its chunks hold {sum(math.prod(c.size) for c in chunks)} elements, the tensor "
                         f"{list(shape)} has {math.prod(shape)}", file=path, tensor=fqn, fix=_FIX)
    for i, a in enumerate(chunks):
        for b in chunks[i + 1:]:
            if all(x < y + m and y < x + k for x, k, y, m in zip(a.offset, a.size, b.offset, b.size)) and math.prod(a.size):
                raise InputError(f"chunks at {list(a.offset)} and {list(b.offset)} overlap", file=path, tensor=fqn, fix=_FIX)


def chunk_range(fd: int, path: Path, fqn: str, chunk: Chunk, dtype: str, itemsize: int) -> int:
    """Where a chunk's bytes start in its file: the torch.save archive at its range, located through the zip's
    central directory, its data.pkl read by the restricted unpickler and held to the metadata (dtype, sizes, C
    order from storage offset 0, the whole storage), and the member stored uncompressed inside the range."""
    end = chunk.item_start + chunk.item_length
    if end > os.fstat(fd).st_size:
        raise InputError(f"chunk at {list(chunk.offset)} is stored at [{chunk.item_start}, {end}), past the file's end",
                         file=path, tensor=fqn, fix="the file is truncated: copy or save it again")
    members = _zip_members(fd, path, fqn, chunk)
    pkl = [n for n in members if n.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise InputError(f"chunk at {list(chunk.offset)} is not a torch.save archive (no data.pkl)", file=path,
                         tensor=fqn, fix=_FIX)
    prefix = pkl[0][: -len("data.pkl")]
    at, n = _member(fd, path, fqn, chunk, members[pkl[0]])
    if n > MAX_ITEM_PICKLE:
        raise InputError(f"chunk's data.pkl is {n} bytes", file=path, tensor=fqn, fix=_FIX)
    if f"{prefix}byteorder" in members:
        b_at, b_n = _member(fd, path, fqn, chunk, members[f"{prefix}byteorder"])
        if os.pread(fd, min(b_n, 16), b_at) != b"little":
            raise InputError("chunk was saved big-endian", file=path, tensor=fqn, fix="save it on a little-endian machine")
    rebuilt = restricted_loads(os.pread(fd, n, at), path)
    nbytes = math.prod(chunk.size) * itemsize
    want_stride = tuple(math.prod(chunk.size[d + 1:]) for d in range(len(chunk.size)))
    try:
        tag, (persistent, storage_offset, size, stride, *_rest) = rebuilt
        _, (kind, (_, code), key, _location, numel) = persistent
        assert tag == "tensor" and kind == "storage" and isinstance(key, str)
    except (TypeError, ValueError, AssertionError):
        raise InputError("chunk's data.pkl is not one tensor's rebuild", file=path, tensor=fqn, fix=_FIX) from None
    if code != dtype or tuple(size) != chunk.size or storage_offset != 0 or numel * itemsize != nbytes:
        raise InputError(f"chunk at {list(chunk.offset)} holds {code} {list(size)} (storage offset {storage_offset}, "
                         f"{numel} elements), the metadata says {dtype} {list(chunk.size)}", file=path, tensor=fqn, fix=_FIX)
    if math.prod(chunk.size) > 1 and tuple(s for s, k in zip(stride, size) if k > 1) != tuple(
            s for s, k in zip(want_stride, size) if k > 1):
        raise InputError(f"chunk at {list(chunk.offset)} is stored with strides {list(stride)}, not in C order "
                         f"(a transposed view saved as it was)", file=path, tensor=fqn,
                         fix="save contiguous tensors (.contiguous() before dcp.save)")
    data = members.get(f"{prefix}data/{key}")
    if data is None:
        raise InputError(f"chunk's archive has no data/{printable(key)}", file=path, tensor=fqn, fix=_FIX)
    at, n = _member(fd, path, fqn, chunk, data)
    if n != nbytes:
        raise InputError(f"chunk's data holds {n} bytes, its {dtype} {list(chunk.size)} take {nbytes}", file=path,
                         tensor=fqn, fix=_FIX)
    return at


def _zip_members(fd: int, path: Path, fqn: str, chunk: Chunk) -> dict[str, tuple[int, int, int]]:
    """name -> (local header offset, compressed size, method) from the archive's central directory."""
    base, length = chunk.item_start, chunk.item_length
    tail_n = min(length, 22 + 0xFFFF + 20)
    tail = os.pread(fd, tail_n, base + length - tail_n)
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0 or len(tail) - eocd < 22:
        raise InputError(f"chunk at {list(chunk.offset)}: no zip end record in its byte range", file=path,
                         tensor=fqn, fix=_FIX)
    count, cd_size, cd_off = struct.unpack_from("<10xHII", tail, eocd)
    if 0xFFFFFFFF in (cd_size, cd_off) or count == 0xFFFF:  # zip64: the locator just before the end record
        loc = eocd - 20
        if loc < 0 or tail[loc:loc + 4] != b"PK\x06\x07":
            raise InputError("chunk's zip64 locator is missing", file=path, tensor=fqn, fix=_FIX)
        (rec_off,) = struct.unpack_from("<Q", tail, loc + 8)
        rec = os.pread(fd, 56, base + rec_off) if rec_off + 56 <= length else b""
        if rec[:4] != b"PK\x06\x06":
            raise InputError("chunk's zip64 end record is missing", file=path, tensor=fqn, fix=_FIX)
        count, cd_size, cd_off = struct.unpack_from("<QQQ", rec, 24)
    if cd_off + cd_size > length or count > 4096 or cd_size > 1 << 20:
        raise InputError("chunk's zip directory lies outside its byte range", file=path, tensor=fqn, fix=_FIX)
    cd = os.pread(fd, cd_size, base + cd_off)
    out, at = {}, 0
    for _ in range(count):
        if cd[at:at + 4] != b"PK\x01\x02" or at + 46 > len(cd):
            raise InputError("chunk's zip directory is corrupt", file=path, tensor=fqn, fix=_FIX)
        method, csize, usize, nlen, elen, clen = struct.unpack_from("<HxxxxxxxxIIHHH", cd, at + 10)
        (lho,) = struct.unpack_from("<I", cd, at + 42)
        name = cd[at + 46:at + 46 + nlen].decode("utf-8", "replace")
        extra = cd[at + 46 + nlen:at + 46 + nlen + elen]
        if 0xFFFFFFFF in (csize, usize, lho):  # zip64 extra field: the 8-byte values of the fields that overflowed
            big = _zip64_extra(extra)
            usize = big.pop(0) if usize == 0xFFFFFFFF and big else usize
            csize = big.pop(0) if csize == 0xFFFFFFFF and big else csize
            lho = big.pop(0) if lho == 0xFFFFFFFF and big else lho
        out[name] = (lho, csize, method if usize == csize else -1)
        at += 46 + nlen + elen + clen
    return out


def _zip64_extra(extra: bytes) -> list[int]:
    at = 0
    while at + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, at)
        if tag == 1:
            return list(struct.unpack_from(f"<{size // 8}Q", extra, at + 4))
        at += 4 + size
    return []


def _member(fd: int, path: Path, fqn: str, chunk: Chunk, member: tuple[int, int, int]) -> tuple[int, int]:
    """(absolute offset of a stored member's bytes, their count), inside the chunk's byte range."""
    lho, size, method = member
    if method != 0:
        raise InputError("chunk's archive member is compressed", file=path, tensor=fqn, fix=_FIX)
    head = os.pread(fd, 30, chunk.item_start + lho) if lho + 30 <= chunk.item_length else b""
    if head[:4] != b"PK\x03\x04":
        raise InputError("chunk's zip local header is missing", file=path, tensor=fqn, fix=_FIX)
    nlen, elen = struct.unpack_from("<HH", head, 26)
    start = lho + 30 + nlen + elen
    if start + size > chunk.item_length:
        raise InputError("chunk's data runs past its byte range", file=path, tensor=fqn, fix=_FIX)
    return chunk.item_start + start, size
