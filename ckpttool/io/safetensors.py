"""Strict safetensors reader: headers without data, then tensors by pread.

Stricter than the reference parser wherever that is safer: duplicate JSON keys, NaN/Infinity
literals, gaps, overlaps and trailing bytes are all errors, because each one means the file is not
what its header says. Every failure is an InputError naming the file (and tensor) and the fix;
no other exception escapes `read_header`, whatever the bytes (tests/test_fuzz_parser.py).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ckpttool.dtypes import CARRIERS, ITEMSIZES, itemsize, torch_dtype
from ckpttool.errors import _BAD_NAME_CATEGORIES, InputError, _escape, printable  # noqa: F401 (printable: re-exported)

MAX_HEADER_BYTES = 100_000_000  # the reference implementation's own cap (decimal, not 100 MiB)
MAX_ELEMENTS = 1 << 48  # far above any real tensor; bounds every dimension and the shape's product
MAX_NDIM = 64  # real tensors have <= 8 dims; a longer shape list is a corrupt header, not a tensor
MAX_TENSORS_PER_FILE = 1 << 17
"""a header listing more is refused before it is parsed: real files hold at most tens of thousands (an FP8
MoE shard of 50 GB with weights and scales per expert, ~40k), and 10^6 tiny tensors took 29 s and 1.0 GB
of RSS to parse (issue 39); at this cap the parse takes about 1-2 s and 130 MB on the 2-core box"""
MAX_HEADER_ITEMS = 16 * MAX_TENSORS_PER_FILE
"""JSON values in a header (bounded from above by its commas): what else could fill 100 MB of header with
millions of objects (metadata, long shapes) is refused before parsing too"""
# Unicode categories rejected in tensor names: controls (C0, DEL, C1), format characters (bidi
# overrides, zero-width, BOM), lone surrogates (unencodable; would break every writer) and the
# line/paragraph separators. Names are ASCII in every published checkpoint.

@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of one file: absolute byte range [start, end) in that file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class SafetensorsFile:
    path: Path
    header_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.header_size


def _short(value: object, limit: int = 120) -> str:
    """repr() bounded in length: a hostile header must not turn into a megabyte error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _DupDict(dict):
    """A JSON object that had a repeated key; the value kept is the first, the key is remembered."""

    duplicate: str = ""


class _NonFinite(ValueError):
    pass


def _duplicates_recorder(found: list) -> Callable[[list], dict]:
    """The object_pairs_hook of one parse: a dict at C speed, and where a key repeats a _DupDict, noted in
    `found`. Recorded rather than raised here: the hook cannot see where in the document it is, and the
    error should name the tensor whose entry repeats a key (see _find_duplicate)."""

    def hook(pairs: list[tuple[str, object]]) -> dict:
        obj = dict(pairs)
        if len(obj) == len(pairs):
            return obj
        seen: set = set()
        obj = _DupDict()
        for key, value in pairs:
            if key in seen:
                obj.duplicate = key
                break
            seen.add(key)
            obj[key] = value
        found.append(obj)
        return obj

    return hook


def _find_duplicate(doc: object) -> tuple[tuple[str, ...], str] | None:
    """(path of keys to the object, repeated key) of some object with a repeated key, or None."""
    stack: list[tuple[tuple[str, ...], object]] = [((), doc)]
    while stack:  # iterative: the document may be nested as deep as the parser allowed
        path, node = stack.pop()
        if isinstance(node, _DupDict):
            return path, node.duplicate
        if isinstance(node, dict):
            stack.extend(((*path, k), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((path, v) for v in node)
    return None


def _reject_constant(literal: str) -> float:
    raise _NonFinite(f"non-standard literal {literal} (JSON has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(f"number {text[:40]} overflows to infinity")
    return value


def loads_strict_json(text: str | bytes, *, file: object, what: str, fix: str,
                      tensor_at: Callable[[tuple[str, ...], str], str | None] | None = None) -> object:
    """json.loads without Python's leniencies: duplicate keys (json keeps the last silently),
    NaN/Infinity literals and overflowing floats are errors; so are invalid UTF-8, a BOM and nesting
    deep enough to exhaust the recursion limit. Every failure is an InputError about `what` in
    `file`; `tensor_at(path, key)` says which tensor, if any, a repeated key belongs to."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        if text.startswith("\ufeff"):
            raise InputError(f"{what} starts with a byte-order mark (BOM), which JSON forbids", file=file, fix=fix)
        found: list = []
        doc = json.loads(text, object_pairs_hook=_duplicates_recorder(found), parse_constant=_reject_constant,
                         parse_float=_finite_float)
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 (bad byte at offset {exc.start})", file=file, fix=fix) from None
    except RecursionError:
        raise InputError(f"{what} nests JSON too deeply to be real", file=file, fix=fix) from None
    except ValueError as exc:  # JSONDecodeError, _NonFinite, int digit limit
        reason = str(exc).split(";")[0][:200]  # drop CPython's "use sys.set_int_max_str_digits()" advice
        raise InputError(f"{what} is not valid JSON: {reason}", file=file, fix=fix) from None
    found = _find_duplicate(doc) if found else None  # the walk only where a key did repeat
    if found is not None:
        path, key = found
        where = f" inside {' -> '.join(_short(k, 60) for k in path)}" if path else ""
        tensor = tensor_at(path, key) if tensor_at else None
        raise InputError(f"{what} repeats key {_short(key)}{where}; JSON readers disagree on which one wins",
                         file=file, tensor=None if tensor is None else printable(tensor), fix=fix)
    return doc


def _is_printable_name(name: str) -> bool:
    if name.isascii():  # every published checkpoint's names: printable ASCII is exactly 0x20-0x7e
        return name.isprintable() and bool(name)
    return bool(name) and all(unicodedata.category(c) not in _BAD_NAME_CATEGORIES for c in name)


def check_tensor_name(name: object, file: object) -> str:
    """Tensor names become output header keys and log lines: reject anything that could smuggle
    control characters, unencodable text or a path into them."""
    fix = "the file is corrupt or hostile; re-download it from a trusted source"
    if not isinstance(name, str) or not name:
        raise InputError(f"tensor name {name!r} is not a non-empty string", file=file, fix=fix)
    if not _is_printable_name(name):
        bad = next(c for c in name if unicodedata.category(c) in _BAD_NAME_CATEGORIES)
        raise InputError(f"tensor name {name!r} contains control/format character U+{ord(bad):04X}", file=file,
                         tensor=printable(name), fix=fix)
    if "/" in name or "\\" in name:
        raise InputError("tensor name contains a path separator", file=file, tensor=name, fix=fix)
    return name


_REDOWNLOAD = "the file is corrupt or not safetensors; re-download it"


def read_header(path: Path | str, *, max_header_bytes: int = MAX_HEADER_BYTES) -> SafetensorsFile:
    """Parse and validate a safetensors header; reads no tensor data.

    On success the tensors' byte ranges tile [8 + header_size, file size) exactly and each range is
    exactly numel x itemsize long, so any tensor can be read and viewed without further checks.
    """
    path = Path(path)
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block forever, a device never ends
            raise InputError("not a regular file", file=path,
                             fix="point at the .safetensors file itself (symlinks to regular files are fine)")
        size = st.st_size
        with open(path, "rb") as f:
            head = f.read(8)
            header_size = header_length(head, size, path, max_header_bytes)
            raw = f.read(header_size)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}", file=path,
                         fix="check that the file exists and is readable") from None
    if len(raw) != header_size:
        raise InputError("file shrank while its header was read", file=path, fix="wait for the download to finish")
    return parse_header(raw, size, path)


GGUF_MAGIC = b"GGUF"
"""the first bytes of every GGUF file (llama.cpp's format)"""


def gguf_error(path: object) -> InputError:
    """What a GGUF file given as a checkpoint is refused with: what it is, and how to get safetensors."""
    return InputError("this is a GGUF file (llama.cpp's format), not a safetensors checkpoint", file=path,
                      fix="ckpttool reads safetensors checkpoints: download the model's original safetensors repository "
                          "(not its GGUF one), or load this file with transformers (from_pretrained(..., "
                          "gguf_file=...) dequantizes it) and save_pretrained it as safetensors")


def refuse_gguf_dir(directory: Path) -> None:
    """A directory of GGUF files (and no safetensors) is refused as GGUF, not as an empty checkpoint."""
    if gguf := sorted(p for p in directory.glob("*") if p.suffix.lower() == ".gguf"):
        raise gguf_error(gguf[0])


def is_gguf(path: Path) -> bool:
    """Whether a path is a GGUF file: its magic (a regular file), or its name where it cannot be read."""
    try:
        if stat.S_ISREG(path.stat().st_mode):
            with open(path, "rb") as f:
                return f.read(4) == GGUF_MAGIC
    except OSError:
        pass
    return path.suffix.lower() == ".gguf"


def header_length(head: bytes, size: int, path: object, max_header_bytes: int = MAX_HEADER_BYTES) -> int:
    """The JSON header's length from a file's first 8 bytes, checked against the cap and the file's size."""
    if head[:4] == GGUF_MAGIC:  # its version would read as a header length past any cap
        raise gguf_error(path)
    if len(head) < 8:
        raise InputError(f"file is {size} bytes, shorter than the 8-byte header length", file=path,
                         fix="the file is truncated; re-download it")
    (header_size,) = struct.unpack("<Q", head[:8])
    if header_size > max_header_bytes:
        raise InputError(f"header length {header_size} exceeds the {max_header_bytes}-byte cap", file=path,
                         fix=_REDOWNLOAD)
    if 8 + header_size > size:
        raise InputError(f"header length {header_size} runs past the end of the {size}-byte file",
                         file=path, fix="the file is truncated; re-download it")
    return header_size


def parse_header(raw: bytes, size: int, path: Path) -> SafetensorsFile:
    """The checks of read_header on a header already in memory (`raw`: the JSON after the 8-byte
    length) of a file of `size` bytes: how a header fetched by a range request is read."""
    header_size = len(raw)
    if not raw.startswith(b"{"):  # every writer emits '{' first; a BOM or leading junk means another format
        raise InputError(f"header does not start with '{{' (starts with {_short(raw[:8])})", file=path,
                         fix=_REDOWNLOAD)
    _check_bulk(raw, path)
    header = loads_strict_json(raw, file=path, what="header", fix=_REDOWNLOAD, tensor_at=_header_tensor_at)
    if not isinstance(header, dict):
        raise InputError(f"header is a JSON {type(header).__name__}, not an object", file=path, fix=_REDOWNLOAD)

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"__metadata__ must map strings to strings, got {_short(metadata)}", file=path,
                         fix="the header is corrupt; re-download the file (or re-save it with string metadata)")
    for text in (*metadata, *metadata.values()):
        _check_encodable(text, path)

    data_start = 8 + header_size
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        check_tensor_name(name, path)
        tensors[name] = _parse_entry(name, entry, data_start, path)
    _check_layout(tensors, data_start, size, path)
    return SafetensorsFile(path=path, header_size=header_size, tensors=tensors, metadata=metadata)


def _check_bulk(raw: bytes, path: Path) -> None:
    """Refuse, before parsing, a header whose parse alone would take seconds and gigabytes. Both counts are
    upper bounds found at memchr speed: every tensor entry holds one `"data_offsets"` key (the same bytes in a
    string would be escaped), and every JSON value but the first in a container follows a comma."""
    tensors = raw.count(b'"data_offsets"')
    if tensors > MAX_TENSORS_PER_FILE:
        raise InputError(f"header lists {tensors} tensors, over the {MAX_TENSORS_PER_FILE} one file may hold "
                         "(real checkpoints hold at most tens of thousands per file); it was not parsed", file=path,
                         fix="the file is corrupt or hostile: re-download it, or re-save the model in more files")
    items = raw.count(b",")
    if items > MAX_HEADER_ITEMS:
        raise InputError(f"header holds about {items} JSON values, over the {MAX_HEADER_ITEMS} a header of "
                         f"{MAX_TENSORS_PER_FILE} tensors could need; it was not parsed", file=path, fix=_REDOWNLOAD)


def _header_tensor_at(path: tuple[str, ...], key: str) -> str | None:
    """A repeated top-level key is a tensor name; a repeated field belongs to the tensor above it."""
    owner = path[0] if path else key
    return None if owner == "__metadata__" else owner


def _check_encodable(text: str, path: Path) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON \ud800 escape: no writer can emit it
        raise InputError(f"__metadata__ holds unencodable text {_short(text)}", file=path, fix=_REDOWNLOAD) from None


def _parse_entry(name: str, entry: object, data_start: int, path: Path) -> TensorInfo:
    fix = "the header is corrupt; re-download the file"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise InputError(f"header entry must have exactly dtype, shape and data_offsets, got {_short(got)}",
                         file=path, tensor=name, fix=fix)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ITEMSIZES:
        raise InputError(f"unknown dtype {_short(dtype)}", file=path, tensor=name,
                         fix=f"supported dtypes: {', '.join(ITEMSIZES)}; re-download or convert the file")
    # type() is int, not isinstance: JSON true/false arrive as bool, which isinstance counts as int
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise InputError(f"shape {_short(shape)} is not a list of non-negative integers", file=path, tensor=name,
                         fix=fix)
    if len(shape) > MAX_NDIM or any(d > MAX_ELEMENTS for d in shape):
        raise InputError(f"shape {_short(shape)} has too many or too large dimensions", file=path, tensor=name,
                         fix=fix)
    numel = 1
    for d in shape:  # each factor is <= 2**48, so the running product stays small until it trips
        numel *= d
        if numel > MAX_ELEMENTS:
            raise InputError(f"shape {_short(shape)} overflows: more than 2**48 elements", file=path, tensor=name,
                             fix=fix)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise InputError(f"data_offsets {_short(offsets)} must be two integers 0 <= begin <= end", file=path,
                         tensor=name, fix=fix)
    begin, end = offsets
    want = numel * itemsize(dtype)
    if end - begin != want:
        raise InputError(f"byte length {end - begin} != {want} for shape {list(shape)} of {dtype}", file=path,
                         tensor=name, fix=fix)
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_layout(tensors: dict[str, TensorInfo], data_start: int, size: int, path: Path) -> None:
    """Tensor byte ranges must tile the data section exactly: no gap, no overlap, no trailing bytes."""
    cursor, previous = data_start, None
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start < cursor:
            raise InputError(f"data overlaps tensor {previous!r}", file=path, tensor=info.name,
                             fix="the header is corrupt; re-download the file")
        if info.start > cursor:
            raise InputError(f"{info.start - cursor} unaccounted bytes before this tensor's data", file=path,
                             tensor=info.name, fix="the header is corrupt; re-download the file")
        if info.end > size:
            raise InputError(f"data ends at byte {info.end} but the file has {size} bytes", file=path,
                             tensor=info.name, fix="the file is truncated; re-download it")
        cursor, previous = info.end, info.name
    if cursor < size:
        raise InputError(f"{size - cursor} trailing bytes after the last tensor", file=path,
                         fix="the file is corrupt or was appended to; re-download it")


def read_bytes(fd: int, start: int, nbytes: int, path: object = None, out: np.ndarray | None = None) -> np.ndarray:
    """pread exactly nbytes (looping over short reads), into `out` (a uint8 array of nbytes, e.g.
    pinned memory) or a fresh uninitialised buffer (a bytearray would be zero-filled first: a
    wasted pass over every byte read)."""
    buf = np.empty(nbytes, dtype=np.uint8) if out is None else out
    view = memoryview(buf)
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], start + done)
        if got == 0:
            raise InputError(f"unexpected end of file at byte {start + done}", file=path,
                             fix="the file changed or was truncated while reading; re-download it")
        done += got
    return buf


def array_from_bytes(buf: np.ndarray, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """A uint8 buffer as a numpy array of `shape` in the dtype's carrier (see CARRIERS): no copy."""
    return buf.view(CARRIERS[dtype]).reshape(shape)


def tensor_from_bytes(buf, dtype: str, shape: tuple[int, ...]):
    """A buffer as a torch tensor of `dtype` and `shape`: no copy."""
    import torch

    tdtype = torch_dtype(dtype)
    if len(buf) == 0:
        return torch.empty(shape, dtype=tdtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(tdtype).reshape(shape)
