"""Execute a Plan: a worker pool under a memory budget reads each input tensor once, transforms it
and pwrites every output piece made from it. Memory is bounded by tensors in flight, not model size.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from ckpttool.errors import InputError
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.io.safetensors import DTYPES, itemsize
from ckpttool.io.writer import Staging
from ckpttool.kernels.fp8 import dequant_fp8_block
from ckpttool.plan import PlacedTensor, Plan

# Journal granularity: work done since the last commit is redone after a crash.
COMMIT_EVERY_BYTES = int(os.environ.get("CKPTTOOL_JOURNAL_BYTES", 1 << 30))
COMMIT_EVERY_SECONDS = 2.0


@dataclass(slots=True)
class Task:
    """All output pieces made from one input tensor (and its scale): read once, write many."""

    source: str
    scale: str | None
    out_dtype: str
    pieces: list[tuple[str, PlacedTensor]] = field(default_factory=list)  # (output file, placement)

    def memory(self, ckpt: Checkpoint) -> int:
        src = ckpt.source(self.source).info
        numel = src.nbytes // itemsize(src.dtype)
        need = src.nbytes
        if self.scale is not None:
            need += ckpt.source(self.scale).info.nbytes + numel * (itemsize(self.out_dtype) + 4)
        return need + max(p.end - p.start for _, p in self.pieces)

    @property
    def nbytes_out(self) -> int:
        return sum(p.end - p.start for _, p in self.pieces)


def make_tasks(plan: Plan, done: set[tuple[str, str]], published: set[str]) -> list[Task]:
    tasks: dict[tuple, Task] = {}
    for f in plan.files:
        if f.name in published:
            continue
        for p in f.tensors:
            if (f.name, p.tensor.name) in done:
                continue
            t = p.tensor
            key = (t.source, t.scale, t.dtype if t.scale else None)
            tasks.setdefault(key, Task(t.source, t.scale, t.dtype)).pieces.append((f.name, p))
    # input order: sequential reads through each input file, page-cache friendly
    return list(tasks.values())


class MemoryBudget:
    """Bytes in flight. A task larger than the whole budget still runs, alone."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.cond = threading.Condition()

    def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        with self.cond:
            self.cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        return n

    def release(self, n: int) -> None:
        with self.cond:
            self.used -= n
            self.cond.notify_all()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for but no CUDA device is available",
                         fix="use --device cpu (the same bits, computed by torch on the CPU)")
    return torch.device(device)


def run_task(task: Task, ckpt: Checkpoint, staging: Staging, device: torch.device) -> list[tuple[str, str]]:
    x = ckpt.read(task.source)
    if task.scale is not None:
        scale = ckpt.read(task.scale)
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            src = ckpt.source(task.scale)
            raise InputError("scale holds non-finite or non-positive values", file=ckpt.root / src.file,
                             tensor=task.scale, fix="the checkpoint is corrupt; re-download this shard")
        out_dtype = DTYPES[task.out_dtype][0]
        if device.type == "cuda":
            x = dequant_fp8_block(x.to(device, non_blocking=True), scale.to(device), out_dtype).cpu()
        else:
            x = dequant_fp8_block(x, scale, out_dtype)
    written = []
    for file, placed in task.pieces:
        y = x if placed.tensor.narrow is None else x.narrow(*placed.tensor.narrow)
        y = y.contiguous()
        staging.pwrite(file, y.reshape(-1).view(torch.uint8).numpy(), placed.start)
        written.append((file, placed.tensor.name))
    return written


def execute(plan: Plan, ckpt: Checkpoint, staging: Staging, *, max_memory: int, workers: int,
            device: str = "auto", progress=None) -> None:
    """Run every task not yet in the journal; commit (fdatasync + journal) in batches."""
    dev = resolve_device(device)
    tasks = make_tasks(plan, staging.done, staging.published)
    budget = MemoryBudget(max_memory)
    pending: list[tuple[str, str]] = []
    pending_bytes = 0
    last_commit = time.monotonic()
    in_flight: dict[Future, tuple[Task, int]] = {}

    def reap(block: bool) -> None:
        nonlocal pending_bytes, last_commit
        if not in_flight:
            return
        finished, _ = wait(list(in_flight), timeout=None if block else 0, return_when=FIRST_COMPLETED)
        for fut in finished:
            task, held = in_flight.pop(fut)
            budget.release(held)
            pending.extend(fut.result())  # re-raises a worker's error here, in the main thread
            pending_bytes += task.nbytes_out
            if progress is not None:
                progress(task.nbytes_out)
        if pending and (pending_bytes >= COMMIT_EVERY_BYTES or time.monotonic() - last_commit > COMMIT_EVERY_SECONDS):
            staging.commit(pending)
            pending.clear()
            pending_bytes, last_commit = 0, time.monotonic()

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpttool") as pool:
        try:
            for task in tasks:
                need = task.memory(ckpt)
                while in_flight and (len(in_flight) >= workers * 2 or budget.used + min(need, budget.limit) > budget.limit):
                    reap(block=True)
                held = budget.acquire(need)
                in_flight[pool.submit(run_task, task, ckpt, staging, dev)] = (task, held)
                reap(block=False)
            while in_flight:
                reap(block=True)
        except BaseException:
            for fut in in_flight:
                fut.cancel()
            raise
        finally:
            # whatever finished cleanly is durable and journalled, so --resume skips it
            for fut, (task, _) in list(in_flight.items()):
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    pending.extend(fut.result())
            if pending:
                try:
                    staging.commit(pending)
                except OSError:
                    pass  # the original error is the one to report; this work is redone on --resume


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))
