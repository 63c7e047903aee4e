"""`ckpttool demo`: build the bundled tiny FP8 DeepSeek-V3 checkpoint and convert it to --mp 2."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckpttool.cli.options import KeepMtp, Quiet
from ckpttool.errors import OutputError
from ckpttool.families.deepseek.demo import PRESETS, build_checkpoint
from ckpttool.describe import describe
from ckpttool.publish.destination import check_destination
from ckpttool.recipe import preset as recipe_preset
from ckpttool.runner import Request, run


def demo(workdir: Annotated[Path, typer.Argument(help="Where to put the demo input and output.")] = Path("demo-out"),
         preset: Annotated[str, typer.Option("--preset", help=f"The tiny model: {', '.join(PRESETS)}.")] = "tiny-v3",
         mp: Annotated[int, typer.Option("--mp", min=1, help="Model-parallel ranks of the converted output.")] = 2,
         keep_mtp: KeepMtp = None, quiet: Quiet = False) -> None:
    """Build a tiny real FP8 DeepSeek-V3 checkpoint, convert it to BF16 mp shards in one pass, summarize.

    Needs no torch and no download; writes DIR/<preset>-hf (the input) and DIR/<preset>-mp<N>-bf16.

    Example: ckpttool demo ./demo-out --mp 4
    """
    if preset not in PRESETS:
        raise OutputError(f"unknown preset {preset!r}", fix=f"choose one of {', '.join(PRESETS)}")
    src, dst = workdir / f"{preset}-hf", workdir / f"{preset}-mp{mp}-bf16"
    for d in (src, dst):  # the demo has no --overwrite: say what to do instead
        if d.exists() and (not d.is_dir() or any(d.iterdir())):
            raise OutputError("the demo has run here before", file=d,
                              fix=f"remove {workdir}, or pass another directory: ckpttool demo ./demo-2")
    check_destination(src, dst, overwrite=False, resume=False)
    build_checkpoint(src, preset)
    info = describe(src)
    print(f"built {src}: {info['tensors']} tensors, {info['total_bytes'] / 1e6:.1f} MB, "
          + ", ".join(f"{d} x{v['tensors']}" for d, v in info["dtypes"].items()))
    recipe = recipe_preset("demo", dequant=True, mp=mp, keep_mtp=keep_mtp)
    result = run(Request(recipe=recipe, src=src, dst=dst, quiet=quiet)).result
    print(f"converted to {dst} in {result.seconds:.2f}s:")
    for f in result.plan.files:
        print(f"  {f.name}: {len(f.tensors)} tensors, {f.size / 1e6:.2f} MB")
    for note in result.plan.notes:
        print(f"  - {note}")
    print(f"next: ckpttool inspect {dst} --check")
    print(f"      ckpttool verify {dst}   (loads the shards and generates; needs torch: pip install 'ckpttool[verify]')")
