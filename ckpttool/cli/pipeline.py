"""dequant, shard, convert, run, plan, merge: presets of one recipe pipeline, not separate code paths.

Each command turns its flags into a Request (recipe.preset, or a recipe file), hands it to
runner.run, and prints the report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpttool import defaults
from ckpttool.cli.options import (
    ConfigOpt,
    Device,
    DryRun,
    Dst,
    Json,
    KeepMtp,
    LayoutOpt,
    MaxInputFiles,
    MaxMemory,
    Mp,
    Overwrite,
    Processes,
    Quiet,
    Resume,
    Revision,
    Src,
    Token,
    Workers,
    require_torch,
    verbose,
)
from ckpttool.cli.verify import parse_ids
from ckpttool.errors import RecipeError
from ckpttool.recipe import Recipe, bundled_recipes, load_recipe, preset
from ckpttool.runner import Request, RunReport, reports_here, run as run_request

DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="bf16: dequantize FP8 weights; fp8: keep them (with split scales).")]
VerifyOpt = Annotated[bool, typer.Option("--verify", help="After publishing, run `ckpttool verify` on the output.")]
PromptOpt = Annotated[Optional[str], typer.Option(
    "--prompt", help="--verify: text to continue, tokenized with the output's tokenizer.json (default 'hello world').")]
PromptIdsOpt = Annotated[Optional[str], typer.Option(
    "--prompt-ids", help="--verify: token ids to continue instead of --prompt, e.g. 0,5,9 (for a checkpoint "
                         "without tokenizer.json).")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override a recipe key: shard.mp=4, execution.workers=8.")]


def _dequant_flag(dtype: str | None, default: bool) -> bool:
    if dtype is None:
        return default
    if dtype.lower() in ("bf16", "bfloat16"):
        return True
    if dtype.lower() in ("fp8", "keep"):
        return False
    raise RecipeError(f"--dtype {dtype!r} is not bf16 or fp8", fix="use --dtype bf16 or --dtype fp8")


def _execute(recipe: Recipe, src: str | Path | None, dst: Path | None, *, overwrite: bool = False,
             resume: bool = False, quiet: bool = False, as_json: bool = False, dry_run: bool = False,
             hub_input: bool = False, revision: str | None = None, token: str | None = None,
             config: Path | None = None) -> None:
    if not reports_here():
        quiet, as_json = True, False
    report = run_request(Request(recipe=recipe, src=src, dst=dst, hub_input=hub_input, overwrite=overwrite,
                                 resume=resume, dry_run=dry_run, quiet=quiet or as_json, revision=revision,
                                 token=token, config=config))
    if dry_run:
        _print_plan(report, as_json)
        return
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    elif not quiet:
        _print_result(report)
    if not report.ok:
        raise typer.Exit(1)


def _print_result(report: RunReport) -> None:
    result = report.result
    if result.already_complete:
        print(f"{result.dst}: already complete (plan {result.plan.hash[:12]}), nothing to do")
        return
    gb = result.bytes_written / 1e9
    print(f"wrote {len(result.plan.files)} files, {result.plan.tensor_count} tensors, {gb:.3f} GB to {result.dst} "
          f"in {result.seconds:.2f}s ({result.summary()['gb_per_s']:.2f} GB/s"
          f"{f', {result.processes} processes' if result.processes > 1 else ''})")
    if result.resumed_from:
        print(f"resumed: {result.resumed_from} tensors were already done")
    if result.download is not None:
        print(_download_line(result.download))
    for note in result.plan.notes:
        print(f"  - {note}")
    for warning in result.warnings:
        print(f"  - {warning}")
    if report.verify is not None:  # each check and what it found, not just the verdict
        print(report.verify.render(result.dst))
    if report.reference_skipped:
        print(f"  (not compared with the input: {report.reference_skipped})")
    if verbose() and result.timings is not None:  # ckpttool -v: where the time went
        timing = result.timings.to_json()
        print("  time: " + ", ".join(f"{k} {v:.2f}s" for k, v in timing["phases_s"].items()))
        print("  thread-seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in timing["thread_s"].items()))


def _print_plan(rep: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(rep, indent=2))
        return
    print(f"plan {rep['plan_hash'][:12]}  ({rep['recipe']}: {rep['src']} -> {rep['format']} layout)")
    width = max(len(f["name"]) for f in rep["files"]) if rep["files"] else 10
    for f in rep["files"]:
        print(f"  {f['name']:<{width}}  {f['tensors']:>6} tensors  {f['bytes'] / 1e9:10.3f} GB")
    print(f"  {'total':<{width}}  {rep['tensors']:>6} tensors  {rep['bytes_to_write'] / 1e9:10.3f} GB to write")
    free = "" if rep["disk_free"] is None else f", {rep['disk_free'] / 1e9:.1f} GB free"
    print(f"disk needed: {rep['disk_needed'] / 1e9:.3f} GB{free}")
    print(f"memory: budget {rep['max_memory'] / 2**30:.2f} GiB, expected peak for tensors in flight "
          f"{rep['peak_memory_expected'] / 2**30:.3f} GiB (largest task {rep['largest_task_bytes'] / 2**20:.1f} MiB; "
          f"{rep['workers']} workers" + (f" in {rep['processes']} processes)" if rep['processes'] > 1 else ")"))
    if rep.get("hub"):
        print(_hub_plan_lines(rep["hub"]))
    if rep["copies"]:
        print(f"copied unchanged: {', '.join(rep['copies'])}")
    for note in rep["notes"]:
        print(f"  - {note}")


def _download_line(d: dict) -> str:
    rate = f" at {d['download_gb_per_s']:.2f} GB/s" if d["download_gb_per_s"] else ""
    line = (f"streamed from {d['repo_id']}: fetched {d['files_fetched']} files, {d['bytes_fetched'] / 1e9:.3f} GB{rate}; "
            f"peak disk {d['peak_disk_bytes'] / 1e9:.3f} GB (at most {d['max_input_files']} input files at once)")
    if d["files_in_place"]:
        line += f"; {len(d['files_in_place'])} files read in place from the HF cache"
    if d["refetched"]:
        line += f"; re-fetched after a failed check: {', '.join(d['refetched'])}"
    return line


def _hub_plan_lines(h: dict) -> str:
    eta = f", about {h['expected_download_seconds']:.0f}s at the measured {h['download_rate'] / 1e6:.0f} MB/s" \
        if h["download_rate"] else ""
    return "\n".join([
        f"from {h['repo_id']} (commit {h['commit'][:12]}): {h['input_files']} input files, "
        f"{h['bytes_to_fetch'] / 1e9:.3f} GB to fetch{eta}",
        f"disk needed streaming (output + at most {h['max_input_files']} input files): "
        f"{h['disk_needed_streaming'] / 1e9:.3f} GB; downloading first: {h['disk_needed_download_first'] / 1e9:.3f} GB"])


def dequant(src: Src, dst: Dst, dtype: DtypeOpt = "bf16", keep_mtp: KeepMtp = None, max_memory: MaxMemory = None,
            workers: Workers = None, processes: Processes = None, device: Device = defaults.DEVICE,
            max_input_files: MaxInputFiles = None, revision: Revision = None, token: Token = None, config: ConfigOpt = None,
            overwrite: Overwrite = False, resume: Resume = False, dry_run: DryRun = False, quiet: Quiet = False,
            json_: Json = False) -> None:
    """Quantized HF checkpoint -> BF16 HF checkpoint (index, config and tokenizer rewritten/copied).

    Reads the formats README's formats table lists: FP8, MXFP4, compressed-tensors, ModelOpt, GPTQ, AWQ.

    Example: ckpttool dequant ./DeepSeek-V3 ./DeepSeek-V3-bf16
    """
    if not _dequant_flag(dtype, True):
        raise RecipeError("dequant writes bf16; --dtype fp8 would be a plain copy", fix="use --dtype bf16")
    recipe = preset("dequant", dequant=True, keep_mtp=keep_mtp, max_memory=max_memory, workers=workers,
                    processes=processes, device=device, max_input_files=max_input_files)
    _execute(recipe, src, dst, overwrite=overwrite, resume=resume, quiet=quiet, as_json=json_, dry_run=dry_run,
             hub_input=True, revision=revision, token=token, config=config)


def shard(src: Src, dst: Dst, mp: Annotated[int, typer.Option("--mp", min=1, help="Model-parallel ranks.")],
          dtype: DtypeOpt = None, keep_mtp: KeepMtp = None, max_memory: MaxMemory = None, workers: Workers = None,
          processes: Processes = None, device: Device = defaults.DEVICE, max_input_files: MaxInputFiles = None,
          revision: Revision = None, token: Token = None, config: ConfigOpt = None, overwrite: Overwrite = False, resume: Resume = False,
          dry_run: DryRun = False, quiet: Quiet = False, json_: Json = False) -> None:
    """HF checkpoint (or mp shards of another N) -> model{i}-mp{N}.safetensors shards (FP8 kept unless --dtype bf16).

    The reference DeepSeek layout (or the family's own mp layout); FP8 weights stay FP8 with split
    scales, like the reference convert.py, unless --dtype bf16. Given ckpttool's mp shards, they are
    re-cut for N ranks in one pass, the same bytes as merge then shard.

    Example: ckpttool shard ./DeepSeek-V3 ./DeepSeek-V3-mp8 --mp 8
    """
    recipe = preset("shard", dequant=_dequant_flag(dtype, False), mp=mp, keep_mtp=keep_mtp, max_memory=max_memory,
                    workers=workers, processes=processes, device=device, max_input_files=max_input_files)
    _execute(recipe, src, dst, overwrite=overwrite, resume=resume, quiet=quiet, as_json=json_, dry_run=dry_run,
             hub_input=True, revision=revision, token=token, config=config)


def convert(src: Src, dst: Dst, mp: Mp = None, dtype: DtypeOpt = "bf16", keep_mtp: KeepMtp = None,
            verify: VerifyOpt = False, prompt: PromptOpt = None, prompt_ids: PromptIdsOpt = None,
            max_memory: MaxMemory = None, workers: Workers = None,
            processes: Processes = None, device: Device = defaults.DEVICE, max_input_files: MaxInputFiles = None,
            revision: Revision = None, token: Token = None, config: ConfigOpt = None, overwrite: Overwrite = False, resume: Resume = False,
            dry_run: DryRun = False, quiet: Quiet = False, json_: Json = False, layout: LayoutOpt = None) -> None:
    """All stages fused in one pass: FP8 HF straight to BF16 mp shards, no intermediate copy.

    From a hub repo id the input streams through DST: each file is fetched in the order the
    conversion reads it, verified, converted and deleted, so the disk holds the output and at most
    --max-input-files input files. Files already in the HF cache are read there, in place.

    SRC may be ckpttool's mp shards: `convert MP_DIR DST --mp M` re-cuts them for M ranks in one
    streaming pass, byte for byte what merge then shard writes (FP8 weights stay FP8: --dtype fp8).

    SRC may be a torch distributed checkpoint (.metadata + *.distcp, the model's config.json beside it):
    its chunks are assembled per output tensor in the same pass; optimizer state is left out.

    Example: ckpttool convert ./DeepSeek-V3 ./DeepSeek-V3-mp8-bf16 --mp 8 --dtype bf16 --verify

    Example: ckpttool convert deepseek-ai/DeepSeek-V3 ./v3-mp8 --mp 8 --max-input-files 2

    --layout dcp writes a torch distributed checkpoint (needs torch): --mp N chunks it as N FSDP2 ranks would.

    Example: ckpttool convert ./v3-mp8 ./v3-mp4 --mp 4

    Example: ckpttool convert ./Llama-3-8B ./llama-dcp --layout dcp --mp 8
    """
    if verify and (mp is None or layout not in (None, "mp")):
        raise RecipeError("--verify loads model-parallel shards", fix="add --mp N (and no --layout)")
    if (prompt is not None or prompt_ids is not None) and not verify:
        raise RecipeError("--prompt and --prompt-ids are what --verify generates from", fix="add --verify")
    if verify:
        require_torch("convert --verify", "verify")
    recipe = _convert_recipe("convert", mp, dtype, keep_mtp, device if verify else None, max_memory, workers, device,
                             max_input_files, processes, prompt=prompt,
                             prompt_ids=None if prompt_ids is None else parse_ids(prompt_ids), layout=layout)
    _execute(recipe, src, dst, overwrite=overwrite, resume=resume, quiet=quiet, as_json=json_, dry_run=dry_run,
             hub_input=True, revision=revision, token=token, config=config)


def _convert_recipe(name: str, mp: int | None, dtype: str | None, keep_mtp: bool | None, verify_device: str | None,
                    max_memory: str | None, workers: int | None, device: str, max_input_files: int | None,
                    processes: int | None = None, *, prompt: str | None = None,
                    prompt_ids: list[int] | None = None, layout: str | None = None) -> Recipe:
    """convert's flags as a recipe; `plan` takes the same flags and defaults, so it previews convert."""
    return preset(name, dequant=_dequant_flag(dtype, True), mp=mp, keep_mtp=keep_mtp, verify_device=verify_device,
                  verify_prompt=prompt, verify_prompt_ids=prompt_ids, max_memory=max_memory, workers=workers,
                  processes=processes, device=device, max_input_files=max_input_files, layout=layout)


def merge(src: Annotated[Path, typer.Argument(help="Directory of model{i}-mp{N}.safetensors shards and config.json.")],
          dst: Dst,
          max_shard_size: Annotated[str, typer.Option(
              "--max-shard-size", help="Largest output file before splitting into model-0000i-of-0000n "
                                       f"(the default is transformers'; {defaults.SIZE_UNITS}).")] = defaults.MAX_SHARD_SIZE,
          max_memory: MaxMemory = None, workers: Workers = None, processes: Processes = None,
          overwrite: Overwrite = False, resume: Resume = False, dry_run: DryRun = False, quiet: Quiet = False,
          json_: Json = False) -> None:
    """mp shards (any layout ckpttool writes: DeepSeek, dense; BF16 or FP8 with scales) -> HF checkpoint.

    The same key table read backwards: split tensors are concatenated, replicated ones taken once, experts
    gathered from their ranks, FP8 `.scale` back to `weight_scale_inv`. shard then merge is byte-identical.
    Beside ckpttool's manifest, every shard is checked against it (size, then hash before it is read): a rank
    file of another conversion is refused. Shards without a manifest are read unchecked.

    Example: ckpttool merge ./llama-mp4 ./llama-hf
    """
    recipe = preset("merge", merge_max_shard_size=max_shard_size, max_memory=max_memory, workers=workers,
                    processes=processes)
    _execute(recipe, src, dst, overwrite=overwrite, resume=resume, quiet=quiet, as_json=json_, dry_run=dry_run)


def run(recipe_path: Annotated[Path, typer.Argument(
            metavar="RECIPE", help="A recipe file, or a bundled recipe's name: " + ", ".join(bundled_recipes()) + ".")],
        input_: Annotated[Optional[str], typer.Option(
            "--input", "-i", help="Input directory; or a hub repo id (namespace/name), downloaded when the recipe has a "
                                  "download stage or no such local path exists.")] = None,
        output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Output directory.")] = None,
        set_: SetOpt = None, revision: Revision = None, token: Token = None, config: ConfigOpt = None, overwrite: Overwrite = False,
        resume: Resume = False, dry_run: DryRun = False, quiet: Quiet = False, json_: Json = False) -> None:
    """Run a YAML recipe: its download, dequant, shard and verify stages, each optional, in one pass.

    Example: ckpttool run deepseek-v3-mp8-bf16 -i ./DeepSeek-V3 -o ./v3-mp4 --set shard.mp=4
    """
    recipe = load_recipe(recipe_path, set_ or [])
    _execute(recipe, input_, output, overwrite=overwrite, resume=resume, quiet=quiet, as_json=json_, dry_run=dry_run,
             hub_input=True, revision=revision, token=token, config=config)


def plan(src: Src, dst: Annotated[Optional[Path], typer.Argument(help="Output directory (for the free-space check).")] = None,
         mp: Mp = None, dtype: DtypeOpt = "bf16", keep_mtp: KeepMtp = None,
         recipe_path: Annotated[Optional[str], typer.Option(
             "--recipe", help="Plan a recipe (a file or a bundled recipe's name) instead of flags.")] = None,
         set_: SetOpt = None, max_memory: MaxMemory = None, workers: Workers = None, processes: Processes = None,
         max_input_files: MaxInputFiles = None, revision: Revision = None, token: Token = None, config: ConfigOpt = None,
         quiet: Quiet = False, json_: Json = False, layout: LayoutOpt = None) -> None:
    """Print what `convert` with the same flags would write, from headers alone.

    The same flags and defaults as convert (BF16 unless --dtype fp8; `convert ... --dry-run` prints the
    same plan): files, tensors, bytes to write, disk and memory needed. Reads no weights. For a hub
    repo id the headers come by range requests: also the disk of streaming the input and of
    downloading it first, and the expected download time at a measured rate.

    Example: ckpttool plan ./DeepSeek-V3 --mp 8            (what `ckpttool convert ./DeepSeek-V3 out --mp 8` writes)

    Example: ckpttool plan deepseek-ai/DeepSeek-V3 --mp 8  (from the hub, before downloading anything)
    """
    if recipe_path is not None:
        recipe = load_recipe(recipe_path, set_ or [])
    else:
        recipe = _convert_recipe("plan", mp, dtype, keep_mtp, None, max_memory, workers, defaults.DEVICE,
                                 max_input_files, processes, layout=layout)
    _execute(recipe, src, dst, quiet=quiet, as_json=json_, dry_run=True, hub_input=True, revision=revision,
             token=token, config=config)
