"""The HF layout: safetensors files and model.safetensors.index.json, every tensor whole in one file under its HF
name. A conversion of an HF checkpoint keeps its input's file names; one from a per-rank layout (mp shards, a
DCP) names its files as transformers does (`model.safetensors`, or `model-0000i-of-0000n.safetensors` past the
shard size), as `merge` always has."""

from __future__ import annotations

from pathlib import Path

from ckpttool import defaults
from ckpttool.io.checkpoint import Checkpoint, read_config
from ckpttool.io.layout import INDEX_NAME, MP_FILE
from ckpttool.layouts.row import Layout, no_extras
from ckpttool.plan.rewrite import hf_index
from ckpttool.plan.types import OutFile, TensorPlan, build_header, layout

MAX_SHARD_BYTES = defaults.parse_size(defaults.MAX_SHARD_SIZE)


def natural(name: str) -> tuple:
    """`model.layers.2` before `model.layers.10`: files fill layer by layer."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def files_by_size(tensors: list[TensorPlan], max_bytes: int = MAX_SHARD_BYTES) -> list[OutFile]:
    """transformers' file names: `model.safetensors`, or `model-0000i-of-0000n.safetensors`, each file filled in
    the given tensor order up to `max_bytes`."""
    groups: list[list[TensorPlan]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    n = len(groups)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    files = []
    for name, group in zip(names, groups):
        header, placed = build_header([t.with_(file=name) for t in group], {"format": "pt"})
        files.append(OutFile(name, header, placed))
    return files


def _place(tensors: list[TensorPlan], family, cfg, ranks: int | None, files_of: dict, input_files) -> list[TensorPlan]:
    """Each tensor whole under its HF name: in its input file where the input is HF, else in transformers' files
    (given file names here, laid out by size in `_lay_out`)."""
    if input_files is not None:
        return tensors
    return [t.with_(file=None) for t in sorted(tensors, key=lambda t: natural(t.name))]


def _lay_out(tensors: list[TensorPlan], file_order: list[str]) -> list[OutFile]:
    if tensors and tensors[0].file is None:
        return files_by_size(tensors)
    return layout(tensors, file_order)


def _holds(path: Path) -> bool:
    return path.is_dir()


def _open(path: Path, config=None) -> Checkpoint:
    ckpt = Checkpoint(path)
    if config is not None:  # --config: the model's config.json from elsewhere
        ckpt.config = read_config(Path(config))
    return ckpt


def _listing(path: Path) -> tuple:
    with Checkpoint(path) as ckpt:
        entries = [(s.file, n, s.info.dtype, tuple(s.info.shape), s.info.nbytes) for n, s in ckpt.tensors.items()]
        return None, entries, ckpt.config


def is_hf_directory(path: Path) -> bool:
    """An HF checkpoint (an index, or safetensors files that are not all mp rank files)."""
    if (path / INDEX_NAME).exists():
        return True
    names = [p.name for p in path.glob("*.safetensors")]
    return bool(names) and not all(MP_FILE.fullmatch(n) for n in names)


HF = Layout(
    name="hf", title="HF safetensors", per_rank=False, native_names=False, suffix=".safetensors",
    keeps_mtp=lambda family: True,  # vLLM and SGLang use them for speculative decoding
    place=_place, lay_out=_lay_out, index=lambda files, family: hf_index(files, family.buffers), extras=no_extras,
    holds=_holds, open=_open, listing=_listing,
    read_back="it is already an HF checkpoint: convert, dequant or shard read it as it is",
    verify="verify loads model-parallel shards: convert it with --mp N first (`ckpttool convert SRC DST --mp 1`)",
)
