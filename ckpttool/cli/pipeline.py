"""dequant, shard, convert, run, plan: presets of one recipe pipeline, not separate code paths."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpttool.cli.app import app
from ckpttool.cli.options import Device, Dst, Json, Mp, Quiet, Src
from ckpttool.distributed import world
from ckpttool.errors import RecipeError
from ckpttool.execute import default_workers
from ckpttool.plan import Plan
from ckpttool.recipe import Recipe, load_recipe, validate_recipe
from ckpttool.runner import ExecOptions, RunResult, convert, parse_size, plan_only

MaxMemory = Annotated[Optional[str], typer.Option("--max-memory", help="Memory budget for tensors in flight, e.g. 8GiB (default 4GiB).")]
Workers = Annotated[Optional[int], typer.Option("--workers", min=1, help="Parallel tensor workers (default: cores, at most 16).")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace ckpttool output already in DST.")]
Resume = Annotated[bool, typer.Option("--resume", help="Continue an interrupted run in DST; byte-identical result.")]
KeepMtp = Annotated[bool, typer.Option("--keep-mtp", help="Keep multi-token-prediction layers (dropped by default).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the plan and exit; reads no weights.")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="bf16: dequantize FP8 weights; fp8: keep them (with split scales).")]
VerifyOpt = Annotated[bool, typer.Option("--verify", help="After publishing, run `ckpttool verify` on the output.")]


def _recipe_for(name: str, *, dequant: bool, mp: int | None, keep_mtp: bool, max_memory: str | None,
                workers: int | None, device: str, verify: bool = False) -> Recipe:
    stages: list[dict] = []
    if dequant:
        stages.append({"dequant": {"dtype": "bf16"}})
    if mp is not None:
        stages.append({"shard": {"mp": mp}})
    if not stages:
        stages.append({"dequant": {"dtype": "bf16"}})
    if verify:
        stages.append({"verify": {"device": device}})
    execution = {"device": device, "workers": workers or default_workers()}
    if max_memory:
        execution["max_memory"] = max_memory
    return validate_recipe({"name": name, "mtp": "keep" if keep_mtp else "drop", "stages": stages,
                            "execution": execution}, f"ckpttool {name}")


def _dequant_flag(dtype: str | None, default: bool) -> bool:
    if dtype is None:
        return default
    if dtype.lower() in ("bf16", "bfloat16"):
        return True
    if dtype.lower() in ("fp8", "keep"):
        return False
    raise RecipeError(f"--dtype {dtype!r} is not bf16 or fp8", fix="use --dtype bf16 or --dtype fp8")


def _execute(recipe: Recipe, src: Path, dst: Path, *, overwrite: bool, resume: bool, quiet: bool, as_json: bool,
             dry_run: bool) -> None:
    spec = recipe.spec()
    if world()[0] != 0:  # under torchrun only rank 0 reports
        quiet, as_json = True, False
    if dry_run:
        _print_plan(plan_only(src, spec), recipe, dst, as_json)
        return
    ex = recipe.execution
    opts = ExecOptions(max_memory=parse_size(ex.max_memory), workers=ex.workers, device=ex.device,
                       overwrite=overwrite, resume=resume, quiet=quiet or as_json)
    result = convert(src, dst, spec, opts)
    report = {"ok": True, "recipe": recipe.name, **result.summary()}
    verify = recipe.stage("verify")
    if verify is not None:
        from ckpttool.verify import run_verify

        vr = run_verify(dst, reference=verify.reference, prompt=verify.prompt, prompt_ids=verify.prompt_ids,
                        max_new_tokens=verify.max_new_tokens, device=verify.device, dtype=verify.dtype,
                        tolerance=verify.tolerance)
        report["verify"] = vr.to_json()
        report["ok"] = bool(vr.ok)
    if as_json:
        print(json.dumps(report, indent=2))
    elif not quiet:
        _print_result(result, report)
    if not report["ok"]:
        raise typer.Exit(1)


def _print_result(result: RunResult, report: dict) -> None:
    if result.already_complete:
        print(f"{result.dst}: already complete (plan {result.plan.hash[:12]}), nothing to do")
        return
    gb = result.bytes_written / 1e9
    print(f"wrote {len(result.plan.files)} files, {result.plan.tensor_count} tensors, {gb:.3f} GB to {result.dst} "
          f"in {result.seconds:.2f}s ({report['gb_per_s']:.2f} GB/s)")
    if result.resumed_from:
        print(f"resumed: {result.resumed_from} tensors were already done")
    for note in result.plan.notes:
        print(f"  - {note}")
    if "verify" in report:
        print(f"verify: {'PASS' if report['ok'] else 'FAIL'}")


def _plan_report(plan: Plan, recipe: Recipe, dst: Path | None) -> dict:
    from ckpttool.execute import make_tasks
    from ckpttool.io.checkpoint import Checkpoint

    budget = parse_size(recipe.execution.max_memory)
    with Checkpoint(plan.src) as ckpt:
        task_mem = sorted((t.memory(ckpt) for t in make_tasks(plan, set(), set())), reverse=True)
    peak = min(budget, sum(task_mem[: recipe.execution.workers])) if task_mem else 0
    peak = max(peak, task_mem[0] if task_mem else 0)
    aux = len(json.dumps(plan.index or {})) + len(json.dumps(plan.config or {}))
    aux += sum((Path(plan.src) / n).stat().st_size for n in plan.copies)
    free = None
    if dst is not None:
        probe = Path(dst)
        while not probe.exists():
            probe = probe.parent
        free = shutil.disk_usage(probe).free
    return {
        "recipe": recipe.name, "src": plan.src, "format": plan.format, "plan_hash": plan.hash,
        "files": [{"name": f.name, "tensors": len(f.tensors), "bytes": f.size} for f in plan.files],
        "tensors": plan.tensor_count, "bytes_to_write": plan.bytes_to_write,
        "disk_needed": plan.bytes_to_write + aux, "disk_free": free,
        "max_memory": budget, "peak_memory_expected": peak, "largest_task_bytes": task_mem[0] if task_mem else 0,
        "copies": plan.copies, "notes": plan.notes,
    }


def _print_plan(plan: Plan, recipe: Recipe, dst: Path | None, as_json: bool) -> None:
    rep = _plan_report(plan, recipe, dst)
    if as_json:
        print(json.dumps(rep, indent=2))
        return
    print(f"plan {rep['plan_hash'][:12]}  ({recipe.name}: {plan.src} -> {plan.format} layout)")
    width = max(len(f["name"]) for f in rep["files"]) if rep["files"] else 10
    for f in rep["files"]:
        print(f"  {f['name']:<{width}}  {f['tensors']:>6} tensors  {f['bytes'] / 1e9:10.3f} GB")
    print(f"  {'total':<{width}}  {rep['tensors']:>6} tensors  {rep['bytes_to_write'] / 1e9:10.3f} GB to write")
    free = "" if rep["disk_free"] is None else f", {rep['disk_free'] / 1e9:.1f} GB free"
    print(f"disk needed: {rep['disk_needed'] / 1e9:.3f} GB{free}")
    print(f"memory: budget {rep['max_memory'] / 2**30:.2f} GiB, expected peak for tensors in flight "
          f"{rep['peak_memory_expected'] / 2**30:.3f} GiB (largest task {rep['largest_task_bytes'] / 2**20:.1f} MiB)")
    if plan.copies:
        print(f"copied unchanged: {', '.join(plan.copies)}")
    for note in plan.notes:
        print(f"  - {note}")


@app.command()
def dequant(src: Src, dst: Dst, dtype: DtypeOpt = "bf16", keep_mtp: KeepMtp = False, max_memory: MaxMemory = None,
            workers: Workers = None, device: Device = "auto", overwrite: Overwrite = False, resume: Resume = False,
            dry_run: DryRun = False, quiet: Quiet = False, json_: Json = False) -> None:
    """FP8 HF checkpoint -> BF16 HF checkpoint (index, config and tokenizer rewritten/copied).

    Example: ckpttool dequant ./DeepSeek-V3 ./DeepSeek-V3-bf16
    """
    if not _dequant_flag(dtype, True):
        raise RecipeError("dequant writes bf16; --dtype fp8 would be a plain copy", fix="use --dtype bf16")
    recipe = _recipe_for("dequant", dequant=True, mp=None, keep_mtp=keep_mtp, max_memory=max_memory,
                         workers=workers, device=device)
    _execute(recipe, src, dst, overwrite=overwrite, resume=resume, quiet=quiet, as_json=json_, dry_run=dry_run)


@app.command()
def shard(src: Src, dst: Dst, mp: Annotated[int, typer.Option("--mp", min=1, help="Model-parallel ranks.")],
          dtype: DtypeOpt = None, keep_mtp: KeepMtp = False, max_memory: MaxMemory = None, workers: Workers = None,
          device: Device = "auto", overwrite: Overwrite = False, resume: Resume = False, dry_run: DryRun = False,
          quiet: Quiet = False, json_: Json = False) -> None:
    """HF checkpoint -> model{i}-mp{N}.safetensors in the reference DeepSeek layout. FP8 stays FP8 (with
    split scales, like the reference convert.py) unless --dtype bf16.

    Example: ckpttool shard ./DeepSeek-V3 ./DeepSeek-V3-mp8 --mp 8
    """
    recipe = _recipe_for("shard", dequant=_dequant_flag(dtype, False), mp=mp, keep_mtp=keep_mtp,
                         max_memory=max_memory, workers=workers, device=device)
    _execute(recipe, src, dst, overwrite=overwrite, resume=resume, quiet=quiet, as_json=json_, dry_run=dry_run)


@app.command("convert")
def convert_cmd(src: Src, dst: Dst, mp: Mp = None, dtype: DtypeOpt = "bf16", keep_mtp: KeepMtp = False,
                verify: VerifyOpt = False, max_memory: MaxMemory = None, workers: Workers = None,
                device: Device = "auto", overwrite: Overwrite = False, resume: Resume = False,
                dry_run: DryRun = False, quiet: Quiet = False, json_: Json = False) -> None:
    """All stages fused in one pass: FP8 HF straight to BF16 mp shards, no intermediate copy.

    Example: ckpttool convert ./DeepSeek-V3 ./DeepSeek-V3-mp8-bf16 --mp 8 --dtype bf16 --verify
    """
    if verify and mp is None:
        raise RecipeError("--verify loads model-parallel shards", fix="add --mp N")
    recipe = _recipe_for("convert", dequant=_dequant_flag(dtype, True), mp=mp, keep_mtp=keep_mtp,
                         max_memory=max_memory, workers=workers, device=device, verify=verify)
    _execute(recipe, src, dst, overwrite=overwrite, resume=resume, quiet=quiet, as_json=json_, dry_run=dry_run)


SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override a recipe key: shard.mp=4, execution.workers=8.")]


def _resolve_input(recipe: Recipe, input_: str | None, quiet: bool) -> Path:
    if input_ is None:
        raise RecipeError("no input given", fix="pass --input SRC (a directory or a hub repo id)")
    local = Path(input_).expanduser()
    if local.is_dir():
        return local
    from ckpttool.io import hub

    dl = recipe.stage("download")
    kwargs = dl.model_dump() if dl is not None else {}
    return Path(hub.download_checkpoint(input_, quiet=quiet, **kwargs).path)


@app.command()
def run(recipe_path: Annotated[Path, typer.Argument(metavar="RECIPE.yaml", help="Recipe file (see recipes/).")],
        input_: Annotated[Optional[str], typer.Option("--input", "-i", help="Input dir, or a hub repo id to download.")] = None,
        output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory.")] = None,
        set_: SetOpt = None, overwrite: Overwrite = False, resume: Resume = False, dry_run: DryRun = False,
        quiet: Quiet = False, json_: Json = False) -> None:
    """Run a YAML recipe: its download, dequant, shard and verify stages, each optional, in one pass.

    Example: ckpttool run recipes/deepseek-v3-mp8-bf16.yaml -i deepseek-ai/DeepSeek-V3 -o ./v3-mp8 --set shard.mp=4
    """
    recipe = load_recipe(recipe_path, set_ or [])
    src = _resolve_input(recipe, input_, quiet or json_)
    if output is None and not dry_run:
        raise RecipeError("no output given", fix="pass --output DST")
    _execute(recipe, src, output, overwrite=overwrite, resume=resume, quiet=quiet, as_json=json_, dry_run=dry_run)


@app.command()
def plan(src: Src, dst: Annotated[Optional[Path], typer.Argument(help="Output directory (for the free-space check).")] = None,
         mp: Mp = None, dtype: DtypeOpt = None, keep_mtp: KeepMtp = False,
         recipe_path: Annotated[Optional[Path], typer.Option("--recipe", help="Plan a recipe instead of flags.")] = None,
         set_: SetOpt = None, max_memory: MaxMemory = None, workers: Workers = None, json_: Json = False) -> None:
    """Print the plan (files, tensors, bytes to write, disk and memory needed) from headers alone.

    Example: ckpttool plan ./DeepSeek-V3 --mp 8 --dtype bf16
    """
    if recipe_path is not None:
        recipe = load_recipe(recipe_path, set_ or [])
    else:
        recipe = _recipe_for("plan", dequant=_dequant_flag(dtype, mp is None), mp=mp, keep_mtp=keep_mtp,
                             max_memory=max_memory, workers=workers, device="auto")
    _print_plan(plan_only(src, recipe.spec()), recipe, dst, json_)

