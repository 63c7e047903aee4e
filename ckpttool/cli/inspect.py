"""`ckpttool inspect PATH`: what a file or checkpoint holds, and (--check) whether it is intact."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from ckpttool.cli.app import app
from ckpttool.cli.options import Json
from ckpttool.errors import InputError
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.io.safetensors import read_header
from ckpttool.io.hashing import sha256_file
from ckpttool.io.writer import MANIFEST, read_manifest


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
    scales = sum(n.endswith("_scale_inv") for n in tensors)
    quant = config.get("quantization_config")
    mxfp4 = sum(n.endswith("_blocks") for n in tensors)
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


def check_manifest(path: Path) -> dict:
    """Re-hash every published file against ckpttool-manifest.json."""
    manifest = read_manifest(path)
    if manifest is None:
        raise InputError("no ckpttool manifest here", file=path / MANIFEST,
                         fix="--check verifies ckpttool output; this directory was not produced by it")
    results = {}
    for name, want in manifest["files"].items():
        p = path / name
        if not p.is_file():
            results[name] = "missing"
        elif p.stat().st_size != want["size"]:
            results[name] = f"size {p.stat().st_size} != {want['size']}"
        else:
            results[name] = "ok" if sha256_file(p) == want["sha256"] else "sha256 mismatch"
    return {"ok": all(v == "ok" for v in results.values()), "plan_hash": manifest.get("plan_hash"),
            "tool": manifest.get("tool"), "files": results}


@app.command()
def inspect(path: Annotated[Path, typer.Argument(help="A .safetensors file or a checkpoint directory.")],
            tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor, not just the patterns.")] = False,
            check: Annotated[bool, typer.Option("--check", help="Re-verify ckpttool output against its manifest.")] = False,
            json_: Json = False) -> None:
    """Show tensors, dtypes, shapes, sizes and quantization; --check re-hashes a ckpttool output.

    Example: ckpttool inspect ./DeepSeek-V3-mp8 --check
    """
    if not path.exists():
        raise InputError("path does not exist", file=path, fix="pass a .safetensors file or a checkpoint directory")
    if check:
        if not path.is_dir():
            raise InputError("--check needs the output directory", file=path)
        rep = check_manifest(path)
        if json_:
            print(json.dumps(rep, indent=2))
        else:
            for name, status in rep["files"].items():
                print(f"  {'ok ' if status == 'ok' else 'BAD'} {name}" + ("" if status == "ok" else f": {status}"))
            print(f"{'intact' if rep['ok'] else 'DAMAGED'}: {path} (plan {str(rep['plan_hash'])[:12]})")
        if not rep["ok"]:
            raise typer.Exit(1)
        return
    info = describe(path)
    if not tensors:
        info.pop("all")
    if json_:
        print(json.dumps(info, indent=2))
        return
    print(f"{info['path']}: {info['tensors']} tensors in {len(info['files'])} files, {info['total_bytes'] / 1e9:.3f} GB"
          + (f", model_type {info['model_type']}" if info["model_type"] else ""))
    for d, v in info["dtypes"].items():
        print(f"  {d:<8} {v['tensors']:>7} tensors  {v['bytes'] / 1e9:10.3f} GB")
    q = info["quantization"]
    if q["config"] or q["fp8_block_weights"] or q["mxfp4_blocks"]:
        print(f"quantization: {json.dumps(q['config']) if q['config'] else 'no quantization_config'}; "
              f"{q['fp8_block_weights']} FP8 block-scaled weights, {q['mxfp4_blocks']} MXFP4 block tensors")
    rows = info["all"].items() if tensors else [(g["pattern"], g) for g in info["groups"]]
    for name, v in rows:
        if tensors:
            print(f"  {name}  {v['dtype']} {v['shape']}  {v['bytes']} B  [{v['file']}]")
        else:
            shapes = " | ".join(str(s) for s in v["shapes"][:3]) + (" ..." if len(v["shapes"]) > 3 else "")
            print(f"  {name}  x{v['count']}  {'/'.join(v['dtypes'])} {shapes}")
