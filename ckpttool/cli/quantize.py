"""quantize: a BF16/F16/F32 HF checkpoint -> the format an engine loads (a preset of the recipe pipeline)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ckpttool import defaults
from ckpttool.cli.options import (
    Device,
    DryRun,
    Dst,
    Json,
    KeepMtp,
    MaxInputFiles,
    MaxMemory,
    Overwrite,
    Processes,
    Quiet,
    Resume,
    Revision,
    Src,
    Token,
    Workers,
)
from ckpttool.cli.pipeline import _execute
from ckpttool.formats.outputs import FORMATS
from ckpttool.recipe import preset

ToOpt = Annotated[str, typer.Option(
    "--to", help="Output format: " + ", ".join(FORMATS) + " (README \"Output formats\" says what each writes).")]
GroupOpt = Annotated[int, typer.Option("--group-size", help="int4 (gpt-fast) only: 32, 64, 128 or 256.")]
MpOpt = Annotated[Optional[int], typer.Option(
    "--mp", min=1, help="Also shard into model{i}-mp{N} files: fp8-block-deepseek (from BF16, or an exact repack "
                        "into 128x128 blocks: DeepSeek-V4 as DeepSeek's V4 model loads it) and fp8-128x128; the "
                        "others, and gpt-oss's FP8 experts, are refused by name.")]


def quantize(src: Src, dst: Dst, to: ToOpt, group_size: GroupOpt = 128, mp: MpOpt = None, keep_mtp: KeepMtp = None,
             max_memory: MaxMemory = None, workers: Workers = None, processes: Processes = None,
             device: Device = defaults.DEVICE, max_input_files: MaxInputFiles = None, revision: Revision = None,
             token: Token = None, overwrite: Overwrite = False, resume: Resume = False, dry_run: DryRun = False,
             quiet: Quiet = False, json_: Json = False) -> None:
    """BF16/F16/F32 HF checkpoint -> quantized HF checkpoint in a format engines load (--to).

    The family's linear projections are quantized (never embeddings, norms, routers or heads); config.json's
    quantization_config is written as the format's library writes it.

    compressed-tensors (vLLM, SGLang, transformers): w4a16, w4a16-asym, w8a16, fp8-channel, fp8-block, nvfp4a16,
    mxfp4; DeepSeek's FP8 blocks: fp8-block-deepseek (alias fp8_block); gpt-fast's int8 / int4.

    A quantized SRC is repacked exactly instead, never through BF16 and never rounding a value (a block it cannot
    hold is refused by name): MXFP4 experts (DeepSeek-V4, gpt-oss) into FP8 blocks with fp8-block-deepseek, fp8-32x32,
    fp8-128x128 or fp8-1x128; FP8 blocks of one size into another with the same; ModelOpt NVFP4 into
    compressed-tensors' with nvfp4a16, and back with modelopt-nvfp4.

    With --mp N, a repack into FP8 128x128 blocks is cut per rank in the same pass (the shards `shard --mp N` makes
    of its HF output): ckpttool quantize ./DeepSeek-V4-Flash ./V4-fp8-mp8 --to fp8-block-deepseek --mp 8

    Example: ckpttool quantize ./Qwen3-8B ./Qwen3-8B-w4a16 --to w4a16
    """
    recipe = preset("quantize", quantize={"format": to, "group_size": group_size}, mp=mp, keep_mtp=keep_mtp,
                    max_memory=max_memory, workers=workers, processes=processes, device=device,
                    max_input_files=max_input_files)
    _execute(recipe, src, dst, overwrite=overwrite, resume=resume, quiet=quiet, as_json=json_, dry_run=dry_run,
             hub_input=True, revision=revision, token=token)
