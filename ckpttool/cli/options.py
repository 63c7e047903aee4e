"""Options shared by several commands, so a flag means the same thing (and shows the same default)
everywhere. Defaults come from ckpttool/defaults.py."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpttool import defaults
from ckpttool.dtypes import torch_installed
from ckpttool.errors import CkptError

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def require_torch(what: str, extra: str) -> None:
    """The core install has no torch: a command that needs it says which extra brings it."""
    if not torch_installed():
        raise CkptError(f"{what} needs torch, which the core install of ckpttool leaves out",
                        fix=f"pip install 'ckpttool[{extra}]' (on a machine without a GPU, first "
                            f"pip install torch --index-url {TORCH_CPU_INDEX})")

Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output; errors are still printed.")]
Json = Annotated[bool, typer.Option("--json", help="Print one machine-readable JSON object on stdout.")]
Src = Annotated[Path, typer.Argument(help="Input checkpoint directory (HF layout: *.safetensors + config.json), or a "
                                          "hub repo id (namespace/name) to convert straight from the hub.")]
Dst = Annotated[Path, typer.Argument(help="Output directory; must be empty or absent (see --overwrite/--resume).")]
LayoutOpt = Annotated[Optional[str], typer.Option("--layout", help="Output layout: hf, mp or dcp (a torch "
                                                  "distributed checkpoint; needs torch). Default: mp with --mp N, else hf.")]
Mp = Annotated[Optional[int], typer.Option("--mp", min=1, help="Model-parallel ranks: write model{i}-mp{N}.safetensors.")]
Device = Annotated[str, typer.Option("--device", help="auto | cpu | cuda: where dequant runs, the same bits on each. auto: the CPU (numpy, "
                                                    "no torch import), unless a GPU is there and the job is big for "
                                                    "the cores (from about 29 GB of output on 2 cores, 520 GB on 4; "
                                                    "never on 8+).")]
MaxMemory = Annotated[Optional[str], typer.Option(
    "--max-memory", help=f"Memory budget for tensors in flight, e.g. 8GiB (default {defaults.MAX_MEMORY}; "
                         f"{defaults.SIZE_UNITS}).")]
Workers = Annotated[Optional[int], typer.Option(
    "--workers", min=1,
    help=f"Parallel tensor workers, in all processes (default: in one process one per core this process may use "
         f"up to 12, then all cores but 4, at most {defaults.MAX_WORKERS}; split over processes, one per core, but "
         f"one core of every process given more than {defaults.CORES_PER_PROCESS} left to its hash threads).")]
Processes = Annotated[Optional[int], typer.Option(
    "--processes", min=1,
    help=f"Processes sharing the output files, each with its own Python interpreter lock (default, writing into "
         f"tmpfs: one per {defaults.CORES_PER_PROCESS} cores from {defaults.FORK_FROM_CORES} cores up, at most "
         f"{defaults.MAX_PROCESSES} and one per output file; else one. Always one on the GPU, from the hub, under "
         f"torchrun or off Linux). The same bytes either way.")]
MaxInputFiles = Annotated[Optional[int], typer.Option(
    "--max-input-files", min=1, help="Input from a hub repo id: files on disk at once, each deleted once converted "
                                     f"(default {defaults.MAX_INPUT_FILES}; raised where the plan needs more at once).")]
Revision = Annotated[Optional[str], typer.Option(
    "--revision", help="A hub input's branch, tag or commit (default main; also SRC@revision, as namespace/name@v1.0).")]
Token = Annotated[Optional[str], typer.Option(
    "--token", help="Hub token for a private or gated repo (default: HF_TOKEN or the saved `hf auth login` token).")]
ConfigOpt = Annotated[Optional[Path], typer.Option(
    "--config", help="The model's HF config.json, for an input without one beside its tensors (a torch distributed "
    "checkpoint written by a trainer); read instead of the input's own.")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace ckpttool output already in DST.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run in DST; byte-identical result.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan and exit; reads no weights.")]
KeepMtp = Annotated[Optional[bool], typer.Option(
    "--keep-mtp/--drop-mtp", show_default=False,
    help="Keep or drop multi-token-prediction layers (default: kept in HF outputs; in mp shards as the "
         "reference layout has them: dropped for DeepSeek-V3, kept for V4).")]


def verbose() -> bool:
    """Whether `ckpttool -v` (the root option) was given: read from the root context of the click that
    typer runs on (typer >= 0.23 vendors its own, which plain `click.get_current_context` cannot see)."""
    import importlib

    click_core = typer.Context.__mro__[1].__module__  # typer's click.core, vendored or not
    ctx = importlib.import_module(click_core.rsplit(".", 1)[0] + ".globals").get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx is not None else None
    return bool(obj and obj.get("verbose"))
