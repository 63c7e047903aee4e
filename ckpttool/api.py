"""ckpttool as a library: each conversion command as a function, with the command's defaults.

    import ckpttool
    report = ckpttool.convert("./my-model", "./my-model-mp2", mp=2)

Each function builds the same preset recipe the command's flags stand for (recipe.preset) and hands it to
runner.run, so a call writes the bytes the command writes. A failure raises a CkptError (ckpttool.errors)
naming the file, the tensor and the fix, as the command prints it; nothing is printed unless `progress`.
For anything the functions do not cover, build a runner.Request (a recipe, an input, an output) yourself.
"""

from __future__ import annotations

from pathlib import Path

from ckpttool import defaults
from ckpttool.dtypes import torch_installed
from ckpttool.errors import CkptError, RecipeError
from ckpttool.recipe import Recipe, load_recipe, preset
from ckpttool.runner import Request, RunReport, run

Source = str | Path
"""a checkpoint directory, or a hub repo id (`namespace/name[@revision]`) where no such local path exists"""


def convert(src: Source, dst: str | Path, *, mp: int | None = None, dtype: str = "bf16", keep_mtp: bool | None = None,
            verify: bool = False, prompt: str | None = None, prompt_ids: list[int] | None = None,
            max_memory: str | None = None, workers: int | None = None, processes: int | None = None,
            device: str = defaults.DEVICE, max_input_files: int | None = None, revision: str | None = None,
            token: str | None = None, overwrite: bool = False, resume: bool = False,
            progress: bool = False) -> RunReport:
    """`ckpttool convert`: every stage fused in one pass (dequantized to BF16 unless dtype="fp8"; model{i}-mp{N}
    shards with `mp`, else HF layout). `verify` (needs mp and torch) then checks the shards as `--verify` does."""
    if verify and mp is None:
        raise RecipeError("verify loads model-parallel shards", fix="pass mp=N")
    if (prompt is not None or prompt_ids is not None) and not verify:
        raise RecipeError("prompt and prompt_ids are what verify generates from", fix="pass verify=True")
    if verify and not torch_installed():
        raise CkptError("verify needs torch, which the core install of ckpttool leaves out",
                        fix="pip install 'ckpttool[verify]'")
    recipe = preset("convert", dequant=_dequant(dtype), mp=mp, keep_mtp=keep_mtp,
                    verify_device=device if verify else None, verify_prompt=prompt, verify_prompt_ids=prompt_ids,
                    max_memory=max_memory, workers=workers, processes=processes, device=device,
                    max_input_files=max_input_files)
    return _run(recipe, src, dst, hub=True, revision=revision, token=token, overwrite=overwrite, resume=resume,
                progress=progress)


def dequant(src: Source, dst: str | Path, *, keep_mtp: bool | None = None, max_memory: str | None = None,
            workers: int | None = None, processes: int | None = None, device: str = defaults.DEVICE,
            max_input_files: int | None = None, revision: str | None = None, token: str | None = None,
            overwrite: bool = False, resume: bool = False, progress: bool = False) -> RunReport:
    """`ckpttool dequant`: a quantized HF checkpoint to a BF16 HF checkpoint (index and config rewritten)."""
    recipe = preset("dequant", dequant=True, keep_mtp=keep_mtp, max_memory=max_memory, workers=workers,
                    processes=processes, device=device, max_input_files=max_input_files)
    return _run(recipe, src, dst, hub=True, revision=revision, token=token, overwrite=overwrite, resume=resume,
                progress=progress)


def shard(src: Source, dst: str | Path, *, mp: int, dtype: str = "fp8", keep_mtp: bool | None = None,
          max_memory: str | None = None, workers: int | None = None, processes: int | None = None,
          device: str = defaults.DEVICE, max_input_files: int | None = None, revision: str | None = None,
          token: str | None = None, overwrite: bool = False, resume: bool = False,
          progress: bool = False) -> RunReport:
    """`ckpttool shard`: model{i}-mp{N}.safetensors in the family's mp layout, FP8 kept unless dtype="bf16"."""
    recipe = preset("shard", dequant=_dequant(dtype), mp=mp, keep_mtp=keep_mtp, max_memory=max_memory,
                    workers=workers, processes=processes, device=device, max_input_files=max_input_files)
    return _run(recipe, src, dst, hub=True, revision=revision, token=token, overwrite=overwrite, resume=resume,
                progress=progress)


def merge(src: str | Path, dst: str | Path, *, max_shard_size: str = defaults.MAX_SHARD_SIZE,
          max_memory: str | None = None, workers: int | None = None, processes: int | None = None,
          overwrite: bool = False, resume: bool = False, progress: bool = False) -> RunReport:
    """`ckpttool merge`: mp shards back to an HF checkpoint (shard then merge is byte-identical)."""
    recipe = preset("merge", merge_max_shard_size=max_shard_size, max_memory=max_memory, workers=workers,
                    processes=processes)
    return _run(recipe, src, dst, hub=False, overwrite=overwrite, resume=resume, progress=progress)


def plan_report(src: Source, dst: str | Path | None = None, *, mp: int | None = None, dtype: str = "bf16",
                keep_mtp: bool | None = None, recipe: str | Path | None = None, overrides: list[str] = (),
                max_memory: str | None = None, workers: int | None = None, processes: int | None = None,
                max_input_files: int | None = None, revision: str | None = None, token: str | None = None) -> dict:
    """`ckpttool plan --json` (named so because `plan` is the package ckpttool.plan): what convert with the same
    arguments (or a recipe, with `overrides` as --set) would write, the disk and memory it needs, from headers alone;
    `dst` only for its free space."""
    if recipe is not None:
        chosen = load_recipe(recipe, list(overrides))
    else:
        chosen = preset("plan", dequant=_dequant(dtype), mp=mp, keep_mtp=keep_mtp, max_memory=max_memory,
                        workers=workers, processes=processes, max_input_files=max_input_files)
    return run(Request(recipe=chosen, src=src, dst=None if dst is None else Path(dst), hub_input=True, dry_run=True,
                       quiet=True, revision=revision, token=token))


def run_recipe(recipe: str | Path, src: Source, dst: str | Path, *, overrides: list[str] = (),
               revision: str | None = None, token: str | None = None, overwrite: bool = False,
               resume: bool = False, progress: bool = False) -> RunReport:
    """`ckpttool run`: a recipe file or a bundled recipe's name, with `overrides` as --set (`["shard.mp=4"]`)."""
    return _run(load_recipe(recipe, list(overrides)), src, dst, hub=True, revision=revision, token=token,
                overwrite=overwrite, resume=resume, progress=progress)


def _dequant(dtype: str) -> bool:
    if dtype.lower() in ("bf16", "bfloat16"):
        return True
    if dtype.lower() in ("fp8", "keep"):
        return False
    raise RecipeError(f"dtype {dtype!r} is not bf16 or fp8", fix='pass dtype="bf16" or dtype="fp8"')


def _run(recipe: Recipe, src: Source, dst: str | Path, *, hub: bool, revision: str | None = None,
         token: str | None = None, overwrite: bool, resume: bool, progress: bool) -> RunReport:
    return run(Request(recipe=recipe, src=src, dst=Path(dst), hub_input=hub, overwrite=overwrite, resume=resume,
                       quiet=not progress, revision=revision, token=token))
