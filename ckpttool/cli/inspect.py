"""`ckpttool inspect PATH`: what a file or checkpoint holds, and (--check) whether it is intact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ckpttool.cli.options import Json, Quiet
from ckpttool.errors import InputError, printable
from ckpttool.describe import describe
from ckpttool.formats import FP8_BLOCK, MXFP4
from ckpttool.publish.publish import check_manifest


def inspect(path: Annotated[Path, typer.Argument(help="A .safetensors file or a checkpoint directory.")],
            tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor, not just the patterns.")] = False,
            check: Annotated[bool, typer.Option("--check", help="Re-verify ckpttool output against its manifest.")] = False,
            quiet: Quiet = False, json_: Json = False) -> None:
    """Show tensors, dtypes, shapes, sizes and quantization; --check re-hashes a ckpttool output.

    With --check, -q prints only the files that fail and the verdict.

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
                if quiet and status == "ok":
                    continue
                print(f"  {'ok ' if status == 'ok' else 'BAD'} {printable(name)}" + ("" if status == "ok" else f": {status}"))
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
    # a per-rank layout by its name and ranks (`mp8 shards`, `dcp2 shards`), any other by its files
    layout = f"{info['layout']}{info['mp']} shards" if info["mp"] else f"{len(info['files'])} files"
    names = f" ({info['names']} names)" if info["names"] != info["tensors"] else ""
    print(f"{info['path']}: {info['tensors']} tensors{names} in {layout}, {info['total_bytes'] / 1e9:.3f} GB"
          + (f", model_type {info['model_type']}" if info["model_type"] else ""))
    for d, v in info["dtypes"].items():
        print(f"  {d:<8} {v['tensors']:>7} tensors  {v['bytes'] / 1e9:10.3f} GB")
    q = info["quantization"]
    kinds = [f"{q[key]} {what}" for key, what in (("fp8_block_weights", "FP8 block-scaled weights"),
                                                 ("mxfp4_blocks", "MXFP4 block tensors"),
                                                 ("int8_weights", "int8 weights"), ("int4_weights", "int4 weights"))
             if q[key]]
    kinds += [f"{n} {title} weights" for title, n in q["formats"].items() if title not in (
        FP8_BLOCK.title, MXFP4.title)]  # (counted above, as before)
    if q["unsupported"]:
        kinds.append(f"UNSUPPORTED: {q['unsupported']}")
    if q["config"] or kinds:
        print(f"quantization: {json.dumps(q['config']) if q['config'] else 'no quantization config'}"
              + (f"; {', '.join(kinds)}" if kinds else ""))
    rows = info["all"].items() if tensors else [(g["pattern"], g) for g in info["groups"]]
    for name, v in rows:
        if tensors:
            print(f"  {printable(name)}  {v['dtype']} {v['shape']}  {v['bytes']} B  [{printable(v['file'])}]")
        else:
            shapes = " | ".join(str(s) for s in v["shapes"][:3]) + (" ..." if len(v["shapes"]) > 3 else "")
            print(f"  {printable(name)}  x{v['count']}  {'/'.join(v['dtypes'])} {shapes}")
