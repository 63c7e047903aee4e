"""A checkpoint directory: its index, every file's header, config.json, and lazy tensor reads.

Validation happens here, before any weight is read: the index may only name plain relative paths
to regular files inside the directory, and index and shards must agree tensor for tensor.
Symlinks are followed, wherever they point: the Hugging Face cache stores every shard as a symlink
into ../../blobs, and whoever can plant a symlink in the directory already controls its contents.
What the index *text* says is not trusted the same way (it travels with a download), so `..`,
absolute paths and odd names there are errors.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import numpy as np

from ckpttool.dtypes import itemsize
from ckpttool.errors import InputError
from ckpttool.io.layout import INDEX_NAME, MP_FILE
from ckpttool.io.safetensors import (
    SafetensorsFile,
    TensorInfo,
    array_from_bytes,
    check_tensor_name,
    loads_strict_json,
    printable,
    refuse_gguf_dir,
    tensor_from_bytes,
)
from ckpttool.io.shards import MAX_TENSORS, Piece, ShardFiles, SourceTensor  # noqa: F401 - their home before io/shards.py

MAX_INDEX_BYTES = 256 * 1024 * 1024  # DeepSeek-V3's index is ~9 MB for 92k tensors
MAX_CONFIG_BYTES = 16 * 1024 * 1024
_FIX_INDEX = "the index is corrupt or hostile; re-download model.safetensors.index.json"
_FIX_CONFIG = "fix or re-download config.json (it must be one JSON object)"


class Checkpoint(ShardFiles):
    """An HF checkpoint: every shard's header, resolved through the index when there is one, each
    tensor name in exactly one file, and config.json."""

    def __init__(self, root: Path | str):
        super().__init__(root)
        self.tensors: dict[str, SourceTensor] = {}
        index_path = self.root / INDEX_NAME
        if self._has(INDEX_NAME):  # a dangling symlink is an error below, not "no index"
            self._load_indexed(index_path)
        else:
            self._load_glob()
        self.config = self._load_config()

    # -- where the side files come from: the directory (hub.remote.RemoteCheckpoint: the hub) ------
    def _has(self, name: str) -> bool:
        return os.path.lexists(self.root / name)

    def _json(self, name: str, what: str, cap: int, fix: str, tensor_at=None) -> object:
        return _read_json(self.root / name, what, cap, fix, tensor_at=tensor_at)

    def side_object(self, name: str, *, fix: str) -> dict | None:
        """A small JSON object beside the weights (ModelOpt's hf_quant_config.json), local or on the hub
        alike, or None when there is none."""
        if not self._has(name):
            return None
        value = self._json(name, name, MAX_CONFIG_BYTES, fix)
        if not isinstance(value, dict):
            raise InputError(f"{name} is a JSON {type(value).__name__}, not an object", file=self.root / name, fix=fix)
        return value

    def top_level_files(self) -> list[str]:
        """Names of the regular files beside the weights (what a conversion may copy)."""
        return [p.name for p in sorted(self.root.iterdir()) if p.is_file()]

    # -- loading -----------------------------------------------------------------------------------
    def _load_indexed(self, index_path: Path) -> None:
        index = self._json(INDEX_NAME, "index", MAX_INDEX_BYTES, _FIX_INDEX,
                           tensor_at=lambda path, key: key if path == ("weight_map",) else None)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise InputError("index has no non-empty weight_map object", file=index_path,
                             fix="regenerate the index or remove it to use every *.safetensors file")
        for name, fname in weight_map.items():
            check_tensor_name(name, index_path)
            if not isinstance(fname, str):
                raise InputError(f"weight_map value {_short_repr(fname)} is not a file name", file=index_path,
                                 tensor=name, fix=_FIX_INDEX)
        for fname in sorted(set(weight_map.values())):
            self._add_file(self._safe_relative(fname, index_path))
        for name, fname in weight_map.items():
            if name not in self.files[fname].tensors:
                raise InputError(f"index maps tensor to {fname!r}, which does not hold it", file=self.root / fname,
                                 tensor=name, fix="the index and shards disagree; re-download the checkpoint")
        for fname, sf in self.files.items():
            for name in sf.tensors:
                mapped = weight_map.get(name)
                if mapped != fname:
                    where = "does not map it" if mapped is None else f"maps it to {mapped!r}"
                    raise InputError(f"tensor is in this shard but the index {where}", file=sf.path, tensor=name,
                                     fix="the index and shards disagree; regenerate model.safetensors.index.json "
                                         "or re-download the checkpoint")

    def _load_glob(self) -> None:
        names = sorted(p.name for p in self.root.glob("*.safetensors"))
        if not names:
            refuse_gguf_dir(self.root)
            raise InputError("no *.safetensors files and no index", file=self.root,
                             fix="point at the directory that holds the model's safetensors shards")
        if all(MP_FILE.fullmatch(n) for n in names):  # ranks of one model, whose names repeat across files
            raise InputError(f"this is ckpttool's model-parallel output ({', '.join(names[:2])}, ...), not an HF "
                             f"checkpoint", file=self.root, fix=f"merge it back first: ckpttool merge {self.root} "
                             f"HF_DIR, then convert HF_DIR (it loads as it is with ckpttool verify {self.root})")
        for fname in names:
            self._add_file(fname)

    def _safe_relative(self, fname: str, index_path: Path) -> str:
        """A shard name from the index: a relative path of plain components, to a file that exists."""
        parts = fname.split("/")
        if (not fname or os.path.isabs(fname) or "\\" in fname or printable(fname) != fname
                or any(part in ("", ".", "..") for part in parts)):
            raise InputError(f"index points at {printable(fname)!r}, which is not a plain path inside the checkpoint "
                             "directory", file=index_path, fix=f"{_FIX_INDEX}: shard names must be plain relative paths")
        if not self._has(fname):
            raise InputError(f"index names shard {fname!r}, which is missing", file=index_path,
                             fix="finish the download (or re-download) so every shard is present")
        return fname

    def _add_file(self, fname: str) -> SafetensorsFile:
        sf = super()._add_file(fname)
        for name, info in sf.tensors.items():
            if name in self.tensors:
                raise InputError(f"tensor appears in two shards ({self.tensors[name].file} and {fname})",
                                 file=self.root / fname, tensor=name,
                                 fix="remove the stray shard or add a model.safetensors.index.json that picks one")
            self.tensors[name] = SourceTensor(fname, info)
        return sf

    def _load_config(self) -> dict:
        if not self._has("config.json"):
            return {}
        return _config_object(self._json("config.json", "config.json", MAX_CONFIG_BYTES, _FIX_CONFIG),
                              self.root / "config.json")

    def split(self, name: str, parts: list[tuple[str, tuple[int, ...]]]) -> None:
        """Read one tensor as consecutive parts of its bytes (C order), each under its own name and
        shape, in place of the whole: how a stacked expert tensor ([E, 2I, H]) is read as per-expert
        weights. The parts must cover the tensor exactly and their names be new."""
        src = self.tensors[name]
        offset, dtype = src.info.start, src.info.dtype
        views = {}
        for part, shape in parts:
            if part in self.tensors or part in views:
                raise InputError(f"checkpoint holds both a stacked tensor and {part!r}, which it also holds",
                                 file=self.root / src.file, tensor=name,
                                 fix="the checkpoint mixes stacked and per-expert layouts; re-download it")
            end = offset + math.prod(shape) * itemsize(dtype)
            views[part] = SourceTensor(src.file, TensorInfo(part, dtype, tuple(shape), offset, end))
            offset = end
        if offset != src.info.end:
            raise InputError(f"the parts cover {offset - src.info.start} of its {src.info.nbytes} bytes",
                             file=self.root / src.file, tensor=name)
        del self.tensors[name]
        self.tensors.update(views)

    def info(self, fname: str, name: str) -> TensorInfo:
        src = self.tensors.get(name)
        return src.info if src is not None and src.file == fname and not src.pieces else super().info(fname, name)

    # -- reading -----------------------------------------------------------------------------------
    def source(self, name: str) -> SourceTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise InputError("tensor not found in the checkpoint", file=self.root, tensor=name) from None

    def read(self, name: str):
        """Read one tensor into fresh memory as a torch tensor."""
        src = self.source(name)
        return tensor_from_bytes(self.read_from(src.file, name), src.info.dtype, src.info.shape)

    def read_array(self, name: str) -> np.ndarray:
        """`read` as a numpy array in the dtype's carrier (dtypes.CARRIERS): no torch."""
        src = self.source(name)
        if src.pieces:  # stored in boxes (plan-time reads of small tensors: scales)
            return self.read_pieces(src)
        return array_from_bytes(self.read_from(src.file, name), src.info.dtype, src.info.shape)

    @property
    def total_bytes(self) -> int:
        return sum(t.info.nbytes for t in self.tensors.values())


def read_json_object(path: Path, what: str, fix: str) -> dict:
    """A small JSON side file (tokenizer_config.json, ...), strictly: regular, bounded, one object."""
    value = _read_json(path, what, MAX_CONFIG_BYTES, fix)
    if not isinstance(value, dict):
        raise InputError(f"{what} is a JSON {type(value).__name__}, not an object", file=path, fix=fix)
    return value


def read_config(path: Path, *, missing_fix: str = "copy the checkpoint's config.json beside its safetensors files") -> dict:
    """A config.json, strictly: present, a regular file of bounded size, one JSON object."""
    if not os.path.lexists(path):
        raise InputError("config.json is missing", file=path, fix=missing_fix)
    return _config_object(_read_json(path, "config.json", MAX_CONFIG_BYTES, _FIX_CONFIG), path)


def _config_object(config: object, path: Path) -> dict:
    if not isinstance(config, dict):
        raise InputError(f"config.json is a JSON {type(config).__name__}, not an object", file=path, fix=_FIX_CONFIG)
    return config


def _short_repr(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_json(path: Path, what: str, cap: int, fix: str, *, tensor_at=None) -> object:
    """Read a small JSON side file strictly: regular file, bounded size, strict JSON."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{what} is not a regular file", file=path, fix=fix)
        if st.st_size > cap:
            raise InputError(f"{what} is {st.st_size} bytes, over the {cap}-byte cap", file=path, fix=fix)
        with open(path, "rb") as f:
            raw = f.read(cap + 1)
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror or exc}", file=path,
                         fix="check that it exists and is readable") from None
    return loads_strict_json(raw, file=path, what=what, fix=fix, tensor_at=tensor_at)
