"""`ckpttool demo`: build the bundled tiny FP8 DeepSeek-V3 checkpoint and convert it to --mp 2."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckpttool.cli.options import Quiet
from ckpttool.errors import OutputError
from ckpttool.families.deepseek.demo import PRESETS, build_checkpoint
from ckpttool.describe import describe
from ckpttool.publish.destination import check_destination
from ckpttool.recipe import preset as recipe_preset
from ckpttool.runner import Request, run


def demo(workdir: Annotated[Path, typer.Argument(help="Where to put the demo input and output.")] = Path("demo-out"),
         preset: Annotated[str, typer.Option("--preset", help=f"One of: {', '.join(PRESETS)}.")] = "tiny-v3",
         mp: Annotated[int, typer.Option("--mp", min=1)] = 2,
         quiet: Quiet = False) -> None:
    """Build a tiny real FP8 DeepSeek-V3 checkpoint, convert it to BF16 --mp 2 in one pass, summarize.

    Example: ckpttool demo ./demo-out
    """
    if preset not in PRESETS:
        raise OutputError(f"unknown preset {preset!r}", fix=f"choose one of {', '.join(PRESETS)}")
    src, dst = workdir / f"{preset}-hf", workdir / f"{preset}-mp{mp}-bf16"
    check_destination(src, dst, overwrite=False, resume=False)
    if src.exists() and any(src.iterdir()):
        raise OutputError("demo input already exists", file=src, fix="remove the demo directory or pass another one")
    build_checkpoint(src, preset)
    info = describe(src)
    print(f"built {src}: {info['tensors']} tensors, {info['total_bytes'] / 1e6:.1f} MB, "
          + ", ".join(f"{d} x{v['tensors']}" for d, v in info["dtypes"].items()))
    result = run(Request(recipe=recipe_preset("demo", dequant=True, mp=mp), src=src, dst=dst, quiet=quiet)).result
    print(f"converted to {dst} in {result.seconds:.2f}s:")
    for f in result.plan.files:
        print(f"  {f.name}: {len(f.tensors)} tensors, {f.size / 1e6:.2f} MB")
    for note in result.plan.notes:
        print(f"  - {note}")
    print(f"next: ckpttool inspect {dst} --check ; ckpttool verify {dst}")
