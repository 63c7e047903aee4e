"""What a safetensors file or a checkpoint directory holds: tensors grouped by name pattern, dtypes,
sizes, model_type and quantization (`ckpttool inspect`).

A directory is read as the layout row that holds it says (ckpttool/layouts: HF, an index or *.safetensors,
each tensor name in one file; per-rank layouts such as `model{i}-mp{N}.safetensors`, where split and replicated
tensors repeat their name in every rank's file). A per-rank directory is read as its rank files, so a repeated
name is expected there, not an error; its tensor entries are keyed `file:name`."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ckpttool.errors import InputError
from ckpttool.formats import (CKPTTOOL_QUANTIZATION, FP8_SCALE, HF_QUANT_CONFIG, INT4_SCALES_AND_ZEROS, INT8_SCALES,
                              MXFP4, declared_rules)
from ckpttool.io.checkpoint import read_config, read_json_object
from ckpttool.io.safetensors import read_header
from ckpttool.formats.resolve import members_of
from ckpttool.layouts.table import of_directory
from ckpttool.plan.dequant import matches
from ckpttool.plan.types import TensorPlan

# (file, tensor name, dtype, shape, bytes)
Entry = tuple[str, str, str, tuple[int, ...], int]


def _pattern(name: str) -> str:
    return ".".join("{}" if p.isdigit() else p for p in name.split("."))


def _entries(path: Path):
    """(layout row or None for a file, ranks, entries, config.json) of a file or a directory."""
    if path.is_file():
        sf = read_header(path)
        return None, None, [(path.name, n, i.dtype, tuple(i.shape), i.nbytes) for n, i in sf.tensors.items()], {}
    row = of_directory(path)
    ranks, entries, config = row.listing(path)
    return row, ranks, entries, config


def _count_leaf(names: set[str], leaf: str) -> int:
    return sum(n.endswith("." + leaf) for n in names)


def _ours(path: Path, row, config: dict) -> str | None:
    """The format of ckpttool's own gpt-fast int8/int4 output (config.json `ckpttool_quantization`, beside a file
    too), or None: other libraries' `scales` (GPTQ, AWQ) are not ckpttool's int8, whatever their leaf names."""
    if row is None and (path.parent / "config.json").is_file():
        try:
            config = read_config(path.parent / "config.json")
        except InputError:
            return None
    ours = config.get(CKPTTOOL_QUANTIZATION)
    return ours.get("format") if isinstance(ours, dict) else None


def _formats(path: Path, row, entries: list[Entry], config: dict) -> tuple[dict[str, int], str | None, set[str]]:
    """{format title: weights in it} by the rows the config declares (HF names), or why they are refused, and the
    names of the tensors those weights are made of."""
    if row is not None and row.native_names:
        return {}, None, set()
    root = path if path.is_dir() else path.parent
    try:
        hf_quant = (read_json_object(root / HF_QUANT_CONFIG, HF_QUANT_CONFIG, "re-download it")
                    if (root / HF_QUANT_CONFIG).is_file() and row is not None else None)
        rules = declared_rules(config.get("quantization_config"), hf_quant, root / "config.json",
                               root / HF_QUANT_CONFIG)
        tensors = [TensorPlan(n, d, s, source=n) for _, n, d, s, _ in entries]
        found = matches(tensors, rules)
        counts: Counter = Counter(m.row.title for m in found.values())
    except InputError as exc:
        return {}, exc.message, set()
    return dict(sorted(counts.items())), None, members_of(found)


def describe(path: Path) -> dict:
    row, mp, entries, config = _entries(path)
    native = row is not None and row.native_names
    entries.sort(key=lambda e: (e[1], e[0]))
    names = {e[1] for e in entries}
    by_dtype: Counter = Counter()
    bytes_by_dtype: Counter = Counter()
    groups: dict[str, dict] = {}
    for _, name, dtype, shape, nbytes in entries:
        by_dtype[dtype] += 1
        bytes_by_dtype[dtype] += nbytes
        g = groups.setdefault(_pattern(name), {"count": 0, "dtypes": set(), "shapes": set(), "bytes": 0})
        g["count"] += 1
        g["dtypes"].add(dtype)
        g["shapes"].add(shape)
        g["bytes"] += nbytes
    # FP8 block weights: one scale per weight, `X.weight_scale_inv` in HF files, `Y.scale` in mp files
    fp8 = _count_leaf(names, FP8_SCALE.native_leaf if native else FP8_SCALE.hf_leaf)
    formats, refused, members = _formats(path, row, entries, config)
    per_rank = row is not None and row.per_rank
    ours = _ours(path, row, config)
    return {
        "path": str(path),
        "layout": "file" if row is None else row.name,
        "layout_title": "safetensors file" if row is None else row.title,
        "mp": mp,
        "files": sorted({e[0] for e in entries}),
        "tensors": len(entries),
        "names": len(names),
        "total_bytes": sum(e[4] for e in entries),
        "dtypes": {d: {"tensors": by_dtype[d], "bytes": bytes_by_dtype[d]} for d in sorted(by_dtype)},
        "model_type": config.get("model_type"),
        "quantization": {
            "config": config.get("quantization_config") or config.get(CKPTTOOL_QUANTIZATION),
            "formats": formats,
            "unsupported": refused,
            "fp8_block_weights": fp8,
            "mxfp4_blocks": sum(MXFP4.values.base_of(n) is not None for n in names),
            # ckpttool's own gpt-fast outputs only: never GPTQ's or AWQ's `scales`
            "int8_weights": _count_leaf(names - members, INT8_SCALES) if ours == "int8" else 0,
            "int4_weights": _count_leaf(names - members, INT4_SCALES_AND_ZEROS) if ours == "int4" else 0,
        },
        "groups": [{"pattern": p, "count": g["count"], "dtypes": sorted(g["dtypes"]),
                    "shapes": [list(s) for s in sorted(g["shapes"])], "bytes": g["bytes"]}
                   for p, g in groups.items()],
        "all": {(f"{f}:{n}" if per_rank else n): {"dtype": d, "shape": list(s), "bytes": b, "file": f}
                for f, n, d, s, b in entries},
    }
