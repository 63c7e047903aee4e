"""The one entry point of every conversion command: a Request in, a report out.

    SRC or repo id --(hub/)--> plan/ --> execute/ --> publish/ --(verify/)--> report

`run(request)` owns the orchestration: the dry run (the plan and its disk and memory estimate), hub
inputs, the conversion itself (under torchrun each rank writes its share of the files and rank 0
publishes) and the verify stage. The CLI only turns flags into a Request and prints the report.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ckpttool import defaults
from ckpttool.errors import CkptError, InputError, OutputError, RecipeError
from ckpttool.execute.distributed import Group, assign_files, launched_by_torchrun, local_world_size, world
from ckpttool.execute.executor import execute
from ckpttool.execute.forked import ForkedRanks, layout, rank_share
from ckpttool.execute.osutil import in_memory_fs
from ckpttool.execute.staging import Staging
from ckpttool.execute.tasks import make_tasks
from ckpttool.io.layout import PARTIAL_DIR, STREAM_FETCH, STREAM_INPUT, check_output_names
from ckpttool.io.safetensors import gguf_error, is_gguf
from ckpttool.plan.build import Spec
from ckpttool.plan.merge import MergeSpec
from ckpttool.plan.types import Plan
from ckpttool.progress import Progress
from ckpttool.publish.destination import (
    SPACE_MARGIN,
    DestinationLock,
    allocated,
    already_complete,
    check_destination,
    check_free_space,
    check_outside,
    existing_ancestor,
    free_space,
    snapshot,
)
from ckpttool.publish.publish import publish
from ckpttool.recipe import INPUT, DownloadStage, Execution, Recipe
from ckpttool.timing import Timings
from ckpttool.verify.preflight import check_prompt_source, input_reference

Job = Spec | MergeSpec


@dataclass(kw_only=True)
class ExecOptions:
    max_memory: int = defaults.parse_size(defaults.MAX_MEMORY)
    workers: int | None = None  # in all processes; None: defaults.layout's
    processes: int | None = None  # forked processes sharing the output files; None: defaults.layout's
    device: str = defaults.DEVICE
    overwrite: bool = False
    resume: bool = False
    quiet: bool = False
    chunk_bytes: int = defaults.CHUNK_BYTES  # output bytes per streamed run of rows
    max_input_files: int = defaults.MAX_INPUT_FILES  # converting from a repo id: input files on disk at once
    wait_for_cuda: bool = False  # else the first chunks run on the CPU while the GPU starts (same bits)

    @classmethod
    def from_recipe(cls, ex: Execution, **flags) -> "ExecOptions":
        return cls(max_memory=defaults.parse_size(ex.max_memory), workers=ex.workers, processes=ex.processes,
                   device=ex.device, **flags)


@dataclass(kw_only=True)
class Request:
    """What a command asks for: a recipe (a command's flags are a preset recipe), input and output."""

    recipe: Recipe
    src: str | Path | None  # a directory (or, with hub_input, a hub repo id)
    dst: Path | None
    hub_input: bool = False  # `run -i`, convert, dequant, shard, plan: a src that is not a local directory is a repo id
    overwrite: bool = False
    resume: bool = False
    dry_run: bool = False
    quiet: bool = False  # no progress output (a report is still returned)
    revision: str | None = None  # a repo id's branch, tag or commit (--revision); over the recipe's download.revision
    token: str | None = None  # the hub token (--token); never in a recipe, a plan or a report
    config: Path | None = None  # the model's config.json to read instead of the one beside SRC's tensors (--config)


NUMPY_LOOPS = ("dequantized on the CPU by numpy's loops, about 3x slower than compiled ones: no C compiler was "
               "found at install and numba is not in use (install gcc and reinstall, or pip install 'ckpttool[fast]')")


@dataclass
class RunResult:
    plan: Plan
    dst: Path
    seconds: float
    bytes_written: int
    resumed_from: int = 0  # tensors already done by an earlier, interrupted run
    already_complete: bool = False
    timings: Timings | None = None
    download: dict | None = None  # converting from a repo id: what was fetched, how fast, the peak disk
    processes: int = 1  # forked processes that shared the output files (defaults.layout)

    @property
    def warnings(self) -> list[str]:
        """What the user should know about how the run went (the report prints them, --json carries them)."""
        if self.timings is not None and self.timings.counts.get("chunks_by_cpu_loops_numpy"):
            return [NUMPY_LOOPS]
        return []

    def summary(self) -> dict:
        return {
            "output": str(self.dst),
            "format": self.plan.format,
            "files": [f.name for f in self.plan.files],
            "tensors": self.plan.tensor_count,
            "bytes_written": self.bytes_written,
            "seconds": round(self.seconds, 3),
            "gb_per_s": round(self.bytes_written / max(self.seconds, 1e-9) / 1e9, 3),
            "resumed_tensors": self.resumed_from,
            "processes": self.processes,
            "already_complete": self.already_complete,
            "plan_hash": self.plan.hash,
            "notes": self.plan.notes,
            "warnings": self.warnings,
            **({"timing": self.timings.to_json()} if self.timings is not None else {}),
            **({"download": self.download} if self.download is not None else {}),
        }


@dataclass
class RunReport:
    """A finished run: the conversion's result and, with a verify stage, verify's report."""

    recipe: str
    result: RunResult
    verify: object | None = None  # verify.run.VerifyReport
    reference_skipped: str | None = None  # why a verify stage did not compare with the input

    @property
    def ok(self) -> bool:
        return self.verify is None or bool(self.verify.ok)

    def to_json(self) -> dict:
        report = {"ok": self.ok, "recipe": self.recipe, **self.result.summary()}
        if self.verify is not None:
            report["verify"] = self.verify.to_json()
        if self.reference_skipped:
            report["verify_reference_skipped"] = self.reference_skipped
        return report


def run(request: Request) -> RunReport | dict:
    """Do what the request asks: with dry_run the plan report (a dict), else convert, publish and
    (with a verify stage) verify, returning the run's report."""
    recipe = request.recipe
    job = recipe.job(request.config)
    src = resolve_input(recipe, request.src, quiet=request.quiet, stream=isinstance(job, Spec),
                        revision=request.revision, token=request.token) if request.hub_input else Path(request.src)
    if request.config is not None and not isinstance(src, Path):
        raise RecipeError("--config is read for a local input; a hub repo's config.json is its own", fix="drop --config")
    if request.dry_run:
        return plan_report(src, job, recipe, request.dst)
    if request.dst is None:
        raise RecipeError("no output given", fix="pass --output DST")
    if (verify := recipe.stage("verify")) is not None and verify.prompt_ids is None:
        check_prompt_source(src if isinstance(src, Path) else set(src.files))
    opts = ExecOptions.from_recipe(recipe.execution, overwrite=request.overwrite, resume=request.resume,
                                   quiet=request.quiet)
    if (dl := recipe.stage("download")) is not None:
        opts.max_input_files = dl.max_input_files
    report = RunReport(recipe.name, convert(src, request.dst, job, opts))
    verify = recipe.stage("verify")
    if verify is not None and (launched_by_torchrun() or world()[0] == 0):  # CKPTTOOL_NODES: node 0 verifies
        from ckpttool.verify.run import run_verify  # torch loads only when a verify stage runs

        reference, skipped = verify.reference, None
        if reference == INPUT and not isinstance(src, Path):
            reference, skipped = None, "the input was streamed from the hub and deleted as it was converted"
        elif reference == INPUT:
            reference, skipped = input_reference(src)
        report.verify = run_verify(request.dst, reference=reference, prompt=verify.prompt,
                                   prompt_ids=verify.prompt_ids, max_new_tokens=verify.max_new_tokens,
                                   device=verify.device, dtype=verify.dtype, tolerance=verify.tolerance)
        report.reference_skipped = skipped
    return report


def reports_here() -> bool:
    """Under torchrun only rank 0 prints a report (every rank returns one)."""
    return world()[0] == 0


def resolve_input(recipe: Recipe, src: str | Path | None, *, quiet: bool, stream: bool = False,
                  revision: str | None = None, token: str | None = None):
    """An input that is a directory or a hub repo id (`namespace/name[@revision]`), decided by what exists
    on disk and by the recipe. A local directory is used as it is. A repo id is taken when the recipe has a
    download stage, or when it looks like one and nothing of that path exists locally; anything else is a
    missing local directory, and the error says so. A repo id is streamed (`stream`: the job can be;
    returns the hub.remote.RemoteRepo, planned from headers), or, with `download: {cache: true}`, offline,
    with the hub unreachable or for merge, read from the HF cache (downloaded first) in place."""
    if src is None:
        raise RecipeError("no input given", fix="pass --input SRC (a directory or a hub repo id)")
    text = str(src)
    local = Path(text).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        if is_gguf(local):
            raise gguf_error(local)
        raise InputError("input is not a directory", file=local,
                         fix="pass the checkpoint directory (the one holding config.json and *.safetensors)")
    dl = recipe.stage("download")
    path_like = text.startswith((".", "/", "~")) or local.parent.exists() and local.parent != Path(".")
    if dl is None and (path_like or text.partition("@")[0].count("/") != 1):
        raise InputError("input directory does not exist", file=local,
                         fix="check the path; a hub repo id (namespace/name) is downloaded only when no such "
                             "local path exists or the recipe has a download stage")
    from ckpttool.hub import remote, source  # huggingface_hub loads only for hub inputs

    dl = dl or DownloadStage()
    repo_id, revision = source.pick_revision(text, revision, dl.revision)
    stream = stream and not dl.cache
    if stream and not remote.offline() and world()[1] > 1:
        raise RecipeError("converting straight from the hub runs in one process, not under torchrun",
                          fix="`ckpttool download` first and convert the directory, or set download.cache: true")
    return source.open_input(repo_id, revision=revision, token=token, allow_patterns=dl.allow_patterns,
                             ignore_patterns=dl.ignore_patterns, max_workers=dl.max_workers,
                             verify_sha256=dl.verify_sha256, stream=stream, quiet=quiet)


def plan_report(src, job: Job, recipe: Recipe, dst: Path | None) -> dict:
    """The plan, what it will write, and the disk and peak memory it needs: from headers alone (a
    hub.remote.RemoteRepo's too, with the disk of streaming it and of downloading it first)."""
    budget = defaults.parse_size(recipe.execution.max_memory)
    streamed = not isinstance(src, Path)
    with _open_inputs(src, job) as inputs:
        plan = job.plan(inputs)
        ex = recipe.execution
        _, processes, workers = layout(plan, ex.device, ex.workers, ex.processes, one_process=streamed,
                                       to_memory=dst is not None and in_memory_fs(existing_ancestor(dst)))
        workers *= processes
        check_output_names([f.name for f in plan.files], plan.copies, source=src, inputs=inputs.files,
                           suffix=plan.layout.suffix)
        task_mem = sorted((t.memory() for t in make_tasks(plan, inputs, set(), set())), reverse=True)
    peak = min(budget, sum(task_mem[:workers])) if task_mem else 0
    peak = max(peak, task_mem[0] if task_mem else 0)
    aux = len(json.dumps(plan.index or {})) + len(json.dumps(plan.config or {}))
    aux += inputs.side_bytes(plan.copies) if streamed else sum((Path(plan.src) / n).stat().st_size
                                                                for n in plan.copies)
    free = None if dst is None else free_space(dst)
    report = {
        "recipe": recipe.name, "src": plan.src, "format": plan.format, "plan_hash": plan.hash,
        "files": [{"name": f.name, "tensors": len(f.tensors), "bytes": f.size} for f in plan.files],
        "tensors": plan.tensor_count, "bytes_to_write": plan.bytes_to_write,
        "disk_needed": plan.bytes_to_write + aux, "disk_free": free,
        "max_memory": budget, "peak_memory_expected": peak, "largest_task_bytes": task_mem[0] if task_mem else 0,
        "processes": processes, "workers": workers,
        "copies": plan.copies, "notes": plan.notes,
    }
    if streamed:
        from ckpttool.hub.schedule import stream_plan

        dl = recipe.stage("download") or DownloadStage()
        report["hub"] = stream_plan(inputs, plan, report["disk_needed"], dl.max_input_files)
    return report


def _open_inputs(src, job: Job, staging_dir: Path | None = None, opts: ExecOptions | None = None):
    """The job's inputs: a local directory, or a hub repo planned from its headers (streamed into
    `staging_dir` when converting)."""
    if isinstance(src, Path):
        return job.open(src)
    from ckpttool.hub.remote import RemoteCheckpoint
    from ckpttool.hub.stream import StreamingCheckpoint

    if staging_dir is None:
        return RemoteCheckpoint(src, Path(src.where))
    return StreamingCheckpoint(src, staging_dir, max_files=opts.max_input_files)


def convert(src, dst: Path, job: Job, opts: ExecOptions) -> RunResult:
    """Plan and execute one job (a conversion or a merge) from a directory or a hub.remote.RemoteRepo
    (streamed). Under torchrun each rank writes its share of the files; rank 0 sets up the staging
    directory and publishes, and the result is byte-identical."""
    src, dst = (Path(src) if isinstance(src, (str, os.PathLike)) else src), Path(dst)
    rank, world_size = world()
    group = Group(rank, world_size)
    locks: list[DestinationLock] = []  # rank 0's lock on DST, held until it has published (or failed)
    try:
        result = _convert(src, dst, job, opts, group, locks)
    except BaseException:
        for lock in locks:
            lock.release(failed=True)
        raise
    finally:
        group.close()
    for lock in locks:
        lock.release()
    return result


def _convert(src, dst: Path, job: Job, opts: ExecOptions, group: Group, locks: list) -> RunResult:
    started = time.monotonic()
    clock = Timings()
    streamed = not isinstance(src, Path)  # a hub.remote.RemoteRepo, fetched into DST's staging area
    local_src = None if streamed else src
    download = None
    with _open_inputs(src, job, dst / PARTIAL_DIR, opts) as inputs, clock.phase("total"):
        src = inputs.root  # where the files are read (streamed: DST/.ckpttool-partial/input)
        staging, setup_error, complete = None, None, False
        plan = None
        try:
            if group.rank == 0:  # one run per DST; a refusal reaches every rank like any set-up error
                check_destination(local_src, dst, overwrite=opts.overwrite, resume=opts.resume)  # before DST is made
                locks.append(DestinationLock(dst))
                check_destination(local_src, dst, overwrite=opts.overwrite, resume=opts.resume)  # as the lock found it
            with clock.phase("plan"):
                plan = job.plan(inputs)
            check_output_names([f.name for f in plan.files], plan.copies, source=src, inputs=inputs.files,
                               suffix=plan.layout.suffix)
            if group.rank == 0:
                check_outside(dst, inputs.paths() + ([] if streamed else [src / n for n in plan.copies]))
                complete = already_complete(dst, plan.hash, opts.resume)
                copies = (inputs.side_bytes(plan.copies) + inputs.disk_reserve(plan) if streamed else
                          sum(os.stat(src / n).st_size for n in plan.copies if (src / n).exists()))
                if not complete and not (opts.resume and (dst / PARTIAL_DIR).exists()):  # before writing
                    check_free_space(dst, sum(f.size for f in plan.files) + copies + SPACE_MARGIN)
                if not complete:
                    staging = Staging(dst, plan, resume=opts.resume, overwrite=opts.overwrite, timings=clock,
                                      inputs=inputs.fingerprint(), dst_before=snapshot(dst))
        except CkptError as exc:
            setup_error = exc
        if group.share_outcome(setup_error, complete):
            return RunResult(plan, dst, time.monotonic() - started, 0, already_complete=True)
        if staging is None:  # a rank > 0 joins what rank 0 set up
            staging = Staging(dst, plan, resume=True, rank=group.rank, timings=clock, inputs=inputs.fingerprint())
        # under torchrun this rank's share of the files, which it splits over forked processes as one machine does
        rank_files = assign_files(plan, group.world_size)[group.rank] if group.world_size > 1 else None
        device, processes, workers = layout(plan, opts.device, opts.workers, opts.processes, one_process=streamed,
                                            to_memory=in_memory_fs(dst), files=rank_files, share=local_world_size())
        mine = rank_files
        ranks: ForkedRanks | None = None
        ok = False
        try:
            if processes > 1:  # before this process starts a thread (staging.open_files starts the hashes)
                shares = assign_files(plan, processes, among=rank_files)
                mine = shares[0]
                tag = f"{group.rank}." if group.world_size > 1 else ""
                ranks = ForkedRanks(processes, rank_share(staging, plan, inputs, shares, device, workers,
                                                          opts.max_memory // processes, opts.chunk_bytes, tag),
                                    dst / PARTIAL_DIR)
            staging.open_files(mine)
            resumed = len(staging.done)
            counted = rank_files  # the progress shown is of this node's files, forked processes' too
            todo = sum(p.end - p.start for f in plan.files if f.name not in staging.published
                       and (counted is None or f.name in counted)
                       for p in f.tensors if (f.name, p.tensor.name) not in staging.done)
            if group.rank == 0 and opts.resume:  # what an interrupted run wrote, journalled or not, needs no room
                present = sum(allocated(dst / PARTIAL_DIR / d) for d in (STREAM_INPUT, STREAM_FETCH)) if streamed else 0
                check_free_space(dst, staging.still_to_allocate() + max(0, copies - present) + SPACE_MARGIN,
                                 what="what the interrupted run has left to write")
            label = job.label if group.world_size == 1 else f"rank {group.rank}/{group.world_size}"
            with Progress(todo, label, quiet=opts.quiet) as progress, clock.phase("execute"):
                if streamed:
                    inputs.start(progress.add_row("downloading", inputs.plan_fetches(staging, mine)))
                if ranks is not None:
                    ranks.forward(progress.advance)
                execute(plan, inputs, staging, max_memory=opts.max_memory // processes, workers=workers,
                        device=device, progress=progress.advance, files=mine, chunk_bytes=opts.chunk_bytes,
                        wait_for_cuda=opts.wait_for_cuda, abort=ranks.abort if ranks is not None else None)
                if streamed:
                    download = inputs.finish()
                if ranks is not None:
                    for report in ranks.wait():
                        clock.merge(report)
            with clock.phase("hash_wait"):
                staging.save_digests()
            ok = True
        except BaseException:
            if ranks is not None:
                ranks.kill()
            raise
        finally:
            staging.close_files()
            everyone_ok = group.all_ok(ok, clock)  # rank 0's clock also gets every rank's timeline
        try:
            if not everyone_ok:
                raise OutputError("another rank failed; this rank's work is journalled", file=dst / PARTIAL_DIR,
                                  fix="fix the failing rank's error, then rerun the same command with --resume")
            if group.rank == 0:
                with clock.phase("publish"):
                    publish(staging, src, overwrite=opts.overwrite)
        finally:
            staging.close()
        group.all_ok(True)  # nobody returns before the output is published
    return RunResult(plan, dst, time.monotonic() - started, todo, resumed_from=resumed, timings=clock,
                     download=download, processes=processes)
