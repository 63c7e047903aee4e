"""The plan: every output file, every tensor in it, its offset, and the input bytes that make it.

Built from headers only. Stages (plan/dequant, quantize, shard, rewrite) are pure functions over lists of `TensorPlan`;
`layout()` turns the final list into `OutFile`s with byte offsets, so the executor can create each
file at its final size and pwrite tensors in any order.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace

from ckpttool.version import __version__
from ckpttool.dtypes import itemsize
from ckpttool.layouts.row import Layout

HEADER_ALIGN = 8


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """One output tensor (or, before layout, one tensor flowing through the stages)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: str
    """input tensor name whose bytes this tensor is made from"""
    transform: str | None = None
    """a dequant format (formats.BY_NAME) or a quantize transform (formats.QUANTIZE_TRANSFORMS) applied to `source`"""
    sides: tuple[str, ...] = ()
    """input tensors a dequant transform reads beside `source` (scales, zero points, ...), in the order of its
    row's `read_sides`"""
    narrow: tuple[int, int, int] | None = None
    """(dim, start, length) cut from the (dequantized) source"""
    file: str | None = None
    """output file; stages may set it (HF layout keeps the input file), layout() requires it"""
    parts: tuple[tuple[str, str], ...] = ()
    """merge: (input file, tensor) pieces, concatenated along `concat_dim`, that make this tensor"""
    concat_dim: int = 0
    boxes: tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...] = ()
    """instead of `concat_dim`, for a tensor assembled from boxes (mp ranks, DCP chunks: plan/assemble.py): for each
    part, where its box starts in that stored tensor, the box's size, and where the box lands in this tensor"""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def with_(self, **changes) -> "TensorPlan":
        return replace(self, **changes)


@dataclass(frozen=True, slots=True)
class PlacedTensor:
    tensor: TensorPlan
    start: int  # absolute offset in the output file
    end: int


@dataclass(slots=True)
class OutFile:
    name: str
    header: bytes  # the 8-byte length prefix + JSON header, padded
    tensors: list[PlacedTensor]
    fixed: tuple[tuple[int, bytes], ...] = ()
    """a container's own bytes between and after the tensors (DCP: each chunk's zip framing), at their offsets,
    written with the header when the file is created"""

    @property
    def size(self) -> int:
        return len(self.header) + sum(p.end - p.start for p in self.tensors) + sum(len(b) for _, b in self.fixed)


@dataclass(slots=True)
class Plan:
    """Everything execution needs, and nothing it has to discover."""

    src: str
    files: list[OutFile]
    inputs: dict[str, dict]
    """input file name -> {"size": bytes, "header_sha256": ...}: resume refuses changed inputs"""
    layout: Layout
    """the output's layout row (layouts/table.py): how its files and tensors are named and cut"""
    index: dict | None = None  # HF model.safetensors.index.json contents
    config: dict | None = None  # rewritten config.json
    copies: list[str] = field(default_factory=list)  # other files copied from SRC unchanged
    notes: list[str] = field(default_factory=list)  # what the stages decided (dropped MTP, ...)
    extras: dict[str, bytes] = field(default_factory=dict)
    """other files the layout writes beside the tensor files (DCP's `.metadata`), by name: published with the index"""

    @property
    def format(self) -> str:
        """The output layout's name (`hf`, `mp`, `dcp`), as plans, reports and manifests say it."""
        return self.layout.name

    @property
    def bytes_to_write(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def tensor_count(self) -> int:
        return sum(len(f.tensors) for f in self.files)

    def to_json(self) -> dict:
        return {
            "tool": f"ckpttool {__version__}",
            "src": self.src,
            "format": self.format,
            "inputs": self.inputs,
            "files": [
                {"name": f.name, "size": f.size, "header_bytes": len(f.header),
                 "tensors": [dict(_tensor_json(p.tensor), start=p.start, end=p.end) for p in f.tensors],
                 # only containers with framing of their own have the key: other plans' hashes read as before
                 **({"fixed": [[at, hashlib.sha256(b).hexdigest()] for at, b in f.fixed]} if f.fixed else {})}
                for f in self.files
            ],
            "index": self.index,
            "config": self.config,
            "copies": self.copies,
            "notes": self.notes,
            # only layouts that write extras have the key: other plans (and their hashes) read as before
            **({"extras": {n: hashlib.sha256(b).hexdigest() for n, b in sorted(self.extras.items())}}
               if self.extras else {}),
        }

    @property
    def hash(self) -> str:
        body = self.to_json()
        body.pop("src")  # the same conversion of a moved checkpoint is the same plan
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _tensor_json(t: TensorPlan) -> dict:
    body = asdict(t)
    if not t.parts:  # only merge plans have parts: other plans (and their hashes) read as before
        del body["parts"], body["concat_dim"]
    if not t.boxes:  # only plans from inputs stored in boxes have them
        del body["boxes"]
    return body


def build_header(tensors: list[TensorPlan], metadata: dict[str, str]) -> tuple[bytes, list[PlacedTensor]]:
    """safetensors header for tensors in a deterministic order: widest dtype first (keeps every
    tensor aligned to its element size), then by name."""
    ordered = sorted(tensors, key=lambda t: (-itemsize(t.dtype), t.name))
    entries: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    spans = []
    for t in ordered:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        spans.append((t, offset, offset + t.nbytes))
        offset += t.nbytes
    body = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    body += b" " * (-(8 + len(body)) % HEADER_ALIGN)
    header = len(body).to_bytes(8, "little") + body
    base = len(header)
    return header, [PlacedTensor(t, base + a, base + b) for t, a, b in spans]


def layout(tensors: list[TensorPlan], file_order: list[str]) -> list[OutFile]:
    """Group tensors by their `file` and compute every offset."""
    by_file: dict[str, list[TensorPlan]] = {}
    for t in tensors:
        assert t.file is not None, f"stage left {t.name} without an output file"
        by_file.setdefault(t.file, []).append(t)
    out = []
    for name in sorted(by_file, key=lambda n: (file_order.index(n) if n in file_order else len(file_order), n)):
        header, placed = build_header(by_file[name], {"format": "pt"})
        out.append(OutFile(name, header, placed))
    return out
