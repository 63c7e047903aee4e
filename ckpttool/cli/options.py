"""Options shared by several commands, so a flag means the same thing everywhere."""

from pathlib import Path
from typing import Annotated, Optional

import typer

Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output; errors are still printed.")]
Json = Annotated[bool, typer.Option("--json", help="Print one machine-readable JSON object on stdout.")]
Src = Annotated[Path, typer.Argument(help="Input checkpoint directory (HF layout: *.safetensors + config.json).")]
Dst = Annotated[Path, typer.Argument(help="Output directory; must be empty or absent (see --overwrite/--resume).")]
Mp = Annotated[Optional[int], typer.Option("--mp", min=1, help="Model-parallel ranks: write model{i}-mp{N}.safetensors.")]
Device = Annotated[str, typer.Option("--device", help="auto | cpu | cuda: where dequant runs, the same bits on each. auto: the CPU (numpy, "
                                                    "no torch import) on 8+ cores, else a GPU if there is one.")]
