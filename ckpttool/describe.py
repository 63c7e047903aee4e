"""What a safetensors file or a checkpoint directory holds: tensors grouped by name pattern, dtypes,
sizes, model_type and quantization (`ckpttool inspect`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ckpttool.formats import FP8_BLOCK, MXFP4
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.io.safetensors import read_header


def _pattern(name: str) -> str:
    return ".".join("{}" if p.isdigit() else p for p in name.split("."))


def describe(path: Path) -> dict:
    if path.is_file():
        sf = read_header(path)
        tensors = {n: (i.dtype, i.shape, i.nbytes, path.name) for n, i in sf.tensors.items()}
        config: dict = {}
    else:
        with Checkpoint(path) as ckpt:
            tensors = {n: (s.info.dtype, s.info.shape, s.info.nbytes, s.file) for n, s in ckpt.tensors.items()}
            config = ckpt.config
    by_dtype: Counter = Counter()
    bytes_by_dtype: Counter = Counter()
    groups: dict[str, dict] = {}
    for name, (dtype, shape, nbytes, _) in sorted(tensors.items()):
        by_dtype[dtype] += 1
        bytes_by_dtype[dtype] += nbytes
        g = groups.setdefault(_pattern(name), {"count": 0, "dtypes": set(), "shapes": set(), "bytes": 0})
        g["count"] += 1
        g["dtypes"].add(dtype)
        g["shapes"].add(tuple(shape))
        g["bytes"] += nbytes
    scales = sum(n.endswith(FP8_BLOCK.scale_suffix) for n in tensors)
    quant = config.get("quantization_config")
    mxfp4 = sum(n.endswith(MXFP4.weight_suffix) for n in tensors)
    return {
        "path": str(path),
        "files": sorted({f for *_, f in tensors.values()}),
        "tensors": len(tensors),
        "total_bytes": sum(b for _, _, b, _ in tensors.values()),
        "dtypes": {d: {"tensors": by_dtype[d], "bytes": bytes_by_dtype[d]} for d in sorted(by_dtype)},
        "model_type": config.get("model_type"),
        "quantization": {
            "config": quant,
            "fp8_block_weights": scales,
            "mxfp4_blocks": mxfp4,
        },
        "groups": [{"pattern": p, "count": g["count"], "dtypes": sorted(g["dtypes"]),
                    "shapes": [list(s) for s in sorted(g["shapes"])], "bytes": g["bytes"]}
                   for p, g in groups.items()],
        "all": {n: {"dtype": d, "shape": list(s), "bytes": b, "file": f} for n, (d, s, b, f) in sorted(tensors.items())},
    }
