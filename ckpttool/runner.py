"""One conversion end to end: check DST, plan, preflight, execute, publish. Used by every command."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ckpttool.distributed import Group, assign_files, world
from ckpttool.errors import CkptError, OutputError
from ckpttool.execute import CHUNK_BYTES, execute
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.io.writer import PARTIAL_DIR, Staging, check_destination, check_free_space, read_manifest
from ckpttool.pipeline import Spec, make_plan
from ckpttool.plan import Plan
from ckpttool.progress import Progress
from ckpttool.timing import Timings


SPACE_MARGIN = 64 << 20  # journal, plan.json, index, config and manifest, with room to spare


@dataclass(kw_only=True)
class ExecOptions:
    max_memory: int = 4 << 30
    workers: int = 4
    device: str = "auto"
    overwrite: bool = False
    resume: bool = False
    quiet: bool = False
    chunk_bytes: int = CHUNK_BYTES  # output bytes per streamed run of rows
    wait_for_cuda: bool = False  # else the first chunks run on the CPU while the GPU starts (same bits)


@dataclass
class RunResult:
    plan: Plan
    dst: Path
    seconds: float
    bytes_written: int
    resumed_from: int = 0  # tensors already done by an earlier, interrupted run
    already_complete: bool = False
    timings: Timings | None = None

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
            "already_complete": self.already_complete,
            "plan_hash": self.plan.hash,
            "notes": self.plan.notes,
            **({"timing": self.timings.to_json()} if self.timings is not None else {}),
        }


def plan_only(src: Path, spec: Spec) -> Plan:
    with Checkpoint(src) as ckpt:
        return make_plan(ckpt, spec)


def convert(src: Path, dst: Path, spec: Spec, opts: ExecOptions) -> RunResult:
    """Plan and execute one conversion. Under torchrun each rank writes its share of the files;
    rank 0 sets up the staging directory and publishes, and the result is byte-identical."""
    src, dst = Path(src), Path(dst)
    rank, world_size = world()
    group = Group(rank, world_size)
    try:
        return _convert(src, dst, spec, opts, group)
    finally:
        group.close()


def _convert(src: Path, dst: Path, spec: Spec, opts: ExecOptions, group: Group) -> RunResult:
    started = time.monotonic()
    clock = Timings()
    with Checkpoint(src) as ckpt, clock.phase("total"):
        staging, setup_error, complete = None, None, False
        plan = None
        try:
            if group.rank == 0:
                check_destination(src, dst, overwrite=opts.overwrite, resume=opts.resume)
            with clock.phase("plan"):
                plan = make_plan(ckpt, spec)
            if group.rank == 0:
                complete = _already_complete(dst, plan, opts)
                if not complete and not opts.resume:  # before anything is created; a resume checks what is left
                    check_free_space(dst, sum(f.size for f in plan.files) + SPACE_MARGIN)
                if not complete:
                    dst.mkdir(parents=True, exist_ok=True)
                    staging = Staging(dst, plan, resume=opts.resume, overwrite=opts.overwrite, timings=clock)
        except CkptError as exc:
            setup_error = exc
        if group.share_outcome(setup_error, complete):
            return RunResult(plan, dst, time.monotonic() - started, 0, already_complete=True)
        if staging is None:  # a rank > 0 joins what rank 0 set up
            staging = Staging(dst, plan, resume=True, rank=group.rank, timings=clock)
        mine = assign_files(plan, group.world_size)[group.rank] if group.world_size > 1 else None
        ok = False
        try:
            staging.open_files(mine)
            resumed = len(staging.done)
            todo = sum(p.end - p.start for f in plan.files if f.name not in staging.published
                       and (mine is None or f.name in mine)
                       for p in f.tensors if (f.name, p.tensor.name) not in staging.done)
            if group.rank == 0 and opts.resume:
                check_free_space(dst, todo + SPACE_MARGIN)
            label = "converting" if group.world_size == 1 else f"rank {group.rank}/{group.world_size}"
            with Progress(todo, label, quiet=opts.quiet) as progress, clock.phase("execute"):
                execute(plan, ckpt, staging, max_memory=opts.max_memory, workers=opts.workers,
                        device=opts.device, progress=progress.advance, files=mine, chunk_bytes=opts.chunk_bytes,
                        wait_for_cuda=opts.wait_for_cuda)
            with clock.phase("hash_wait"):
                staging.save_digests()
            ok = True
        finally:
            staging.close_files()
            everyone_ok = group.all_ok(ok)
        try:
            if not everyone_ok:
                raise OutputError("another rank failed; this rank's work is journalled", file=dst / PARTIAL_DIR,
                                  fix="fix the failing rank's error, then rerun the same command with --resume")
            if group.rank == 0:
                with clock.phase("publish"):
                    staging.publish(src, overwrite=opts.overwrite)
        finally:
            staging.close()
        group.all_ok(True)  # nobody returns before the output is published
    return RunResult(plan, dst, time.monotonic() - started, todo, resumed_from=resumed, timings=clock)


def _already_complete(dst: Path, plan, opts: ExecOptions) -> bool:
    """--resume of a run that already published: nothing to do, if it is the same plan."""
    if not opts.resume or (dst / PARTIAL_DIR).exists():
        return False
    manifest = read_manifest(dst)
    if manifest is None or manifest.get("plan_hash") != plan.hash:
        raise OutputError("--resume: the output here was produced by a different plan", file=dst,
                          fix="rerun with the original arguments, or --overwrite to start over")
    return True


def parse_size(text: str | int) -> int:
    """'4GiB', '512MB', '8G', or a plain byte count."""
    if isinstance(text, int):
        return text
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
             "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in units or not num:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 4GiB, 512MiB or a byte count")
    return int(float(num) * units[unit])

