"""The torch distributed checkpoint layout (DCP: `.metadata` + `*.distcp`), as an input (as an output: dcp_out.py).

Read without torch (io/dcp.py): each model tensor is its chunks, one byte range each in a `.distcp` file, which a
plan gathers per output tensor (plan/assemble.py, execute/gather.py) as it gathers mp ranks: streaming, memory a
run of rows. Names are HF names, as trainers on transformers models save them, bare or under one `model.` prefix
(a state dict of {"model": ..., "optim": ...}); optimizer and trainer state (and every entry that is not a tensor)
is left out and the plan says so. The config is the model's HF config.json beside `.metadata`.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ckpttool.dtypes import itemsize
from ckpttool.errors import InputError
from ckpttool.io.checkpoint import Checkpoint, Piece, ShardFiles, SourceTensor, read_config
from ckpttool.io.dcp import METADATA, chunk_range, read_metadata
from ckpttool.io.safetensors import SafetensorsFile, TensorInfo, check_tensor_name
from ckpttool.layouts import dcp_out
from ckpttool.layouts.row import Layout

NOT_MODEL = ("optim", "optimizer", "optimizers", "optimizer_state", "optim_state", "lr_scheduler", "lr_schedulers",
             "scheduler", "schedulers", "dataloader", "train_state", "trainer_state", "rng", "rng_state", "step",
             "epoch", "extra_state")
"""first name components of a trainer's state dict that are not the model's weights"""
WRAPPER = "model."
"""the prefix a trainer's {"model": model.state_dict(), ...} puts before the model's own names"""


def model_names(fqns: list[str]) -> tuple[str, dict[str, str]]:
    """(prefix stripped, {HF name: fqn}) of the entries that are model weights: under `model.` where the state dict
    wraps the model (its names then start `model.model.` or `model.lm_head.`), else every name whose first
    component is not trainer state."""
    wrapped = any(n.startswith(WRAPPER + "model.") or n.startswith(WRAPPER + "lm_head.") for n in fqns)
    prefix = WRAPPER if wrapped else ""
    return prefix, {n[len(prefix):]: n for n in fqns if n.startswith(prefix) and n.split(".")[0] not in NOT_MODEL}


class DcpCheckpoint(Checkpoint):
    """A DCP read as the HF checkpoint it holds: a tensor stored as one chunk is one byte range (read like an HF
    tensor); one stored as several is the `pieces` of its chunks."""

    layout = None  # set below, once the row exists

    def __init__(self, root: Path | str, config: Path | None = None):
        root = Path(root)
        ShardFiles.__init__(self, root)
        md = read_metadata(root)
        prefix, names = model_names(sorted(md.tensors))
        left = sorted(set(md.tensors) - set(names.values())) + md.other
        for fname in md.files:
            path = root / fname
            if not path.is_file() or path.is_symlink():
                raise InputError(".metadata names a chunk file that is missing (or not a regular file)", file=path,
                                 fix="copy the whole DCP directory: every .distcp file .metadata names")
            self.files[fname] = SafetensorsFile(path, -8, {})  # no header: its data starts at byte 0
        self.tensors: dict[str, SourceTensor] = {}
        for name, fqn in sorted(names.items()):
            check_tensor_name(name, root / METADATA)
            t = md.tensors[fqn]
            size, pieces = itemsize(t.dtype), []
            for c in t.chunks:
                start = chunk_range(self.fd(c.file), root / c.file, fqn, c, t.dtype, size)
                info = TensorInfo(f"{name}@{','.join(map(str, c.offset))}", t.dtype, c.size, start,
                                  start + size * _numel(c.size))
                self.files[c.file].tensors[info.name] = info
                pieces.append(Piece(c.file, info.name, c.offset, info))
            if len(pieces) == 1:
                p = pieces[0]
                self.tensors[name] = SourceTensor(p.file, TensorInfo(name, t.dtype, t.shape, p.info.start, p.info.end))
            else:
                self.tensors[name] = SourceTensor(pieces[0].file, TensorInfo(name, t.dtype, t.shape, 0,
                                                                             size * _numel(t.shape)), tuple(pieces))
        if not self.tensors:
            raise InputError(f"the DCP holds no model weights (its entries: {', '.join(sorted(md.tensors)[:4])}...)",
                             file=root / METADATA, fix="point at a DCP saved from the model's state dict")
        chunks = sum(len(s.pieces) or 1 for s in self.tensors.values())
        self.notes = [f"read a torch distributed checkpoint: {len(self.tensors)} tensors from {chunks} chunks in "
                      f"{len(md.files)} .distcp files"]
        if prefix:
            self.notes.append(f"read the names under `{prefix}` as the model's")
        if left:
            shown = ", ".join(left[:3]) + (", ..." if len(left) > 3 else "")
            self.notes.append(f"left out {len(left)} state-dict entries that are not model weights (optimizer and "
                              f"trainer state): {shown}")
        config_path = Path(config) if config else root / "config.json"
        self.config = read_config(config_path, missing_fix="put the model's HF config.json beside .metadata, or pass --config PATH")
        self._metadata_sha = hashlib.sha256((root / METADATA).read_bytes()).hexdigest()

    def header_fingerprint(self, fname: str) -> dict:
        """A .distcp file has no header of its own: its size and the metadata that says what it holds."""
        return {"size": os.stat(self.root / fname).st_size, "header_sha256": self._metadata_sha}

    def top_level_files(self) -> list[str]:
        return [n for n in super().top_level_files() if n != METADATA]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _holds(path: Path) -> bool:
    return (path / METADATA).is_file() and any(p.suffix == ".distcp" for p in path.iterdir())


def _open(path: Path, config=None) -> DcpCheckpoint:
    return DcpCheckpoint(path, config)


def _listing(path: Path) -> tuple:
    """Every stored chunk: the file holding it, the tensor, dtype, the chunk's size and bytes."""
    md = read_metadata(path)
    entries = [(c.file, t.fqn, t.dtype, c.size, itemsize(t.dtype) * _numel(c.size))
               for t in md.tensors.values() for c in t.chunks]
    config = read_config(path / "config.json") if (path / "config.json").is_file() else {}
    return None, entries, config


DCP = Layout(
    name="dcp", title="torch distributed checkpoint", per_rank=True, native_names=False, suffix=".distcp",
    keeps_mtp=lambda family: True, place=dcp_out.place, lay_out=dcp_out.lay_out, index=lambda files, family: None,
    extras=dcp_out.extras, holds=_holds, open=_open, listing=_listing,
    read_back="convert reads a DCP as it is: ckpttool convert DCP_DIR HF_DIR",
    verify="verify loads model-parallel shards: convert the DCP with --mp N first",
)
DcpCheckpoint.layout = DCP
