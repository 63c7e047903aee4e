"""Execute a Plan with memory bounded by chunks in flight, never by tensor or model size.

A task is one input tensor (plus its scale) and every output piece made from it. The task streams
its source in runs of dim-0 rows: read the rows, transform them (FP8/MXFP4 dequant, on CPU or
CUDA), and pwrite each piece's share of them at its planned offset. Rows no remaining piece needs
are never read, so a resumed or distributed run reads only what it writes.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ckpttool.accel import CudaTransforms, gpu_present, no_cuda
from ckpttool.errors import InputError
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.io.safetensors import array_from_bytes, itemsize, read_bytes
from ckpttool.io.writer import Staging
from ckpttool.kernels.fp8_cpu import NaNCodes
from ckpttool.plan import PlacedTensor, Plan
from ckpttool.transforms import TRANSFORMS, WHOLE_TENSOR

# Journal granularity: work done since the last commit is redone after a crash.
COMMIT_EVERY_BYTES = int(os.environ.get("CKPTTOOL_JOURNAL_BYTES", 1 << 30))
COMMIT_EVERY_SECONDS = 2.0
CHUNK_BYTES = 32 << 20  # output bytes per streamed run of rows (and per worker's pinned buffer on CUDA)


@dataclass(slots=True)
class Task:
    """All output pieces made from one input tensor (and its scale): read once, write many."""

    source: str
    transform: str | None
    scale: str | None
    out_dtype: str
    pieces: list[tuple[str, PlacedTensor]] = field(default_factory=list)  # (output file, placement)

    def rows(self, ckpt: Checkpoint) -> int:
        """dim-0 length; a scalar counts as one row."""
        shape = ckpt.source(self.source).info.shape
        return shape[0] if shape else 1

    def chunk_rows(self, ckpt: Checkpoint, chunk_bytes: int = CHUNK_BYTES) -> int:
        if self.transform in WHOLE_TENSOR:
            return max(1, self.rows(ckpt))
        info = ckpt.source(self.source).info
        align = TRANSFORMS[self.transform].row_align if self.transform else 1
        if self.transform:
            out_row = TRANSFORMS[self.transform].out_per_source_row(info.shape) * itemsize(self.out_dtype)
        else:
            out_row = math.prod(info.shape[1:]) * itemsize(info.dtype)
        rows = max(1, chunk_bytes // max(out_row, 1)) // align * align
        return max(align, rows)

    def memory(self, ckpt: Checkpoint, chunk_bytes: int = CHUNK_BYTES) -> int:
        """Peak bytes one run of rows needs: the source rows, the transformed rows (and the fp32
        temporary of a dequant), and one contiguous piece copy."""
        info = ckpt.source(self.source).info
        if self.transform in WHOLE_TENSOR:  # the source, its fp32 copy and temporaries, the output
            numel = info.nbytes // itemsize(info.dtype)
            return info.nbytes + numel * 12 + max(p.end - p.start for _, p in self.pieces)
        rows = min(self.chunk_rows(ckpt, chunk_bytes), self.rows(ckpt))
        src = info.nbytes // max(self.rows(ckpt), 1) * rows
        if self.transform is None:
            return 2 * src
        out = TRANSFORMS[self.transform].out_per_source_row(info.shape) * rows
        scale = ckpt.source(self.scale).info.nbytes if self.scale else 0
        return src + scale + out * (2 * itemsize(self.out_dtype) + 4)

    @property
    def nbytes_out(self) -> int:
        return sum(p.end - p.start for _, p in self.pieces)


def make_tasks(plan: Plan, done: set[tuple[str, str]], published: set[str],
               files: set[str] | None = None) -> list[Task]:
    """Group the pieces still to write (optionally only those of `files`) by what they are made from."""
    tasks: dict[tuple, Task] = {}
    for f in plan.files:
        if f.name in published or (files is not None and f.name not in files):
            continue
        for p in f.tensors:
            if (f.name, p.tensor.name) in done:
                continue
            t = p.tensor
            key = (t.source, t.transform, t.scale, t.dtype if t.transform else None)
            tasks.setdefault(key, Task(t.source, t.transform, t.scale, t.dtype)).pieces.append((f.name, p))
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


AUTO_CPU_MIN_CORES = 8
"""`--device auto` dequantizes on the CPU from this many cores up, even beside a GPU: the numpy path
then keeps up with the disk (bench/RESULTS.md, 16 cores: 1.43 GB/s written, at the disk's speed),
and the GPU path first pays for torch's import and CUDA's start (5-14 s on the benchmark machine,
1.5 GB of libraries read, 0.6 GiB more RSS): a 10.9 GB conversion ran 3.2x faster than the
reference with the GPU and 4.7x on the CPU."""


def resolve_device(device: str) -> str:
    """One of cpu, auto (the GPU, looked for while the CPU starts: only on a machine with a GPU
    driver and fewer than AUTO_CPU_MIN_CORES cores; else cpu) or cuda[:N].

    Decided without importing torch: only a run that may use the GPU pays for it, and then on a
    thread of its own (accel.CudaTransforms)."""
    if device == "auto":
        few_cores = (os.cpu_count() or 1) < AUTO_CPU_MIN_CORES
        return "auto" if few_cores and gpu_present() else "cpu"
    if device.startswith("cuda") and not gpu_present():
        raise no_cuda()
    return device


def read_rows(ckpt: Checkpoint, name: str, r0: int, r1: int, into: np.ndarray | None = None) -> np.ndarray:
    """Rows [r0, r1) of dim 0 (the whole tensor for a scalar) as a numpy array in the dtype's
    carrier: one contiguous byte range, read into the front of `into` (a worker's pinned buffer)
    when given."""
    src = ckpt.source(name)
    info = src.info
    if not info.shape:
        return ckpt.read_array(name)
    row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
    nbytes = (r1 - r0) * row_bytes
    out = into[:nbytes] if into is not None and nbytes else None
    buf = read_bytes(ckpt.fd(src.file), info.start + r0 * row_bytes, nbytes, ckpt.root / src.file, out=out)
    return array_from_bytes(buf, info.dtype, (r1 - r0, *info.shape[1:]))


def _needed_rows(task: Task, n_rows: int) -> tuple[int, int]:
    lo, hi = n_rows, 0
    for _, p in task.pieces:
        nar = p.tensor.narrow
        a, b = (nar[1], nar[1] + nar[2]) if nar is not None and nar[0] == 0 else (0, n_rows)
        lo, hi = min(lo, a), max(hi, b)
    return lo, hi


def _check_scale_values(ckpt: Checkpoint, name: str, scale: np.ndarray) -> None:
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        raise InputError("scale holds non-finite or non-positive values", file=ckpt.root / ckpt.source(name).file,
                         tensor=name, fix="the checkpoint is corrupt; re-download this shard")


def run_task(task: Task, ckpt: Checkpoint, staging: Staging, gpu: CudaTransforms | None,
             chunk_bytes: int = CHUNK_BYTES) -> list[tuple[str, PlacedTensor]]:
    """Stream one task's rows: read, transform (on `gpu` when given and started, else the CPU), write."""
    clock = staging.timings
    if task.transform in WHOLE_TENSOR:  # torch code (the quantize kernels), on the whole tensor
        import torch

        with clock.activity("read"):
            x = ckpt.read(task.source)
        with clock.activity("transform"):
            x = WHOLE_TENSOR[task.transform](x)
        with clock.activity("write"):
            for file, placed in task.pieces:
                y = x if placed.tensor.narrow is None else x.narrow(*placed.tensor.narrow)
                staging.pwrite(file, y.contiguous().reshape(-1).view(torch.uint8).numpy(), placed.start)
        return list(task.pieces)
    n_rows = task.rows(ckpt)
    lo, hi = _needed_rows(task, n_rows)
    transform = TRANSFORMS[task.transform] if task.transform else None
    if transform is not None:
        align = transform.row_align
        lo = lo // align * align
    scale_full = None
    if task.scale is not None and transform is not None and transform.name == "fp8_block":
        scale_full = ckpt.read_array(task.scale)  # tiny: one float per 128x128 block
        _check_scale_values(ckpt, task.scale, scale_full)
    step = task.chunk_rows(ckpt, chunk_bytes)
    info = ckpt.source(task.source).info
    scale_dtype = ckpt.source(task.scale).info.dtype if task.scale else None
    scalar = not info.shape
    if transform is not None and not scalar:
        in_row_bytes = info.nbytes // max(n_rows, 1)
        out_row_bytes = transform.out_per_source_row(info.shape) * itemsize(task.out_dtype)
    for r0 in range(lo, hi, step):
        r1 = min(r0 + step, hi)
        with clock.activity("read"):
            pinned = None
            if gpu is not None and transform is not None and not scalar:
                rows_in, rows_out = (r1 - r0) * in_row_bytes, (r1 - r0) * out_row_bytes
                pinned = gpu.staging(max(rows_in, rows_out))
            x = ckpt.read_array(task.source) if scalar else read_rows(ckpt, task.source, r0, r1, pinned)
            if transform is not None:
                s0, s1 = transform.scale_rows(r0, r1)
                scale = scale_full[s0:s1] if scale_full is not None else read_rows(ckpt, task.scale, s0, s1)
        if transform is not None:
            with clock.activity("transform"):
                try:
                    x = (gpu.apply(transform, x, scale, info.dtype, scale_dtype, task.out_dtype) if gpu is not None
                         else transform.cpu(x, scale, info.dtype, task.out_dtype))
                except NaNCodes as exc:  # the kernel saw rows r0.. of the tensor
                    raise NaNCodes(None if exc.row is None else r0 + exc.row,
                                   file=ckpt.root / ckpt.source(task.source).file, tensor=task.source) from None
        with clock.activity("write"):
            _write_rows(task, x, r0, r1, staging)
    return list(task.pieces)


def _write_rows(task: Task, x: np.ndarray, r0: int, r1: int, staging: Staging) -> None:
    """Each piece's share of rows [r0, r1) of the (transformed) source, at its planned offset."""
    for file, placed in task.pieces:
        t = placed.tensor
        row_bytes = (placed.end - placed.start) // t.shape[0] if t.shape and t.shape[0] else 0
        nar = t.narrow
        if not x.ndim:
            y, offset = x, placed.start
        elif nar is None:
            y, offset = x, placed.start + r0 * row_bytes
        elif nar[0] == 0:
            a, b = max(r0, nar[1]), min(r1, nar[1] + nar[2])
            if a >= b:
                continue
            y, offset = x[a - r0: b - r0], placed.start + (a - nar[1]) * row_bytes
        else:
            dim, start, length = nar
            y, offset = x[(slice(None),) * dim + (slice(start, start + length),)], placed.start + r0 * row_bytes
        if y.size:
            staging.pwrite(file, np.ascontiguousarray(y).reshape(-1).view(np.uint8), offset)


class Committer:
    """Journal commits (fdatasync of the written files, then the journal lines) on a thread of their
    own, in order, so a slow flush never stalls scheduling. The first error is re-raised to the caller."""

    def __init__(self, staging: Staging):
        self.staging = staging
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="ckpttool-commit", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (batch := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.staging.commit(batch)
                except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                    self.error = exc

    def submit(self, batch: list[tuple[str, str]]) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(list(batch))

    def close(self) -> None:
        """Wait for every queued commit; raise the first error."""
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def execute(plan: Plan, ckpt: Checkpoint, staging: Staging, *, max_memory: int, workers: int,
            device: str = "auto", progress=None, files: set[str] | None = None,
            chunk_bytes: int = CHUNK_BYTES, wait_for_cuda: bool = False) -> None:
    """Run every task not yet in the journal; commit (fdatasync + journal) in batches. On CUDA the
    first chunks run on the CPU while the GPU starts, unless `wait_for_cuda`."""
    dev = resolve_device(device)
    tasks = make_tasks(plan, staging.done, staging.published, files)
    used = sorted({t.transform for t in tasks if t.transform in TRANSFORMS})
    gpu = CudaTransforms(dev, [TRANSFORMS[n] for n in used], staging.timings) if dev != "cpu" and used else None
    if gpu is not None and wait_for_cuda:
        gpu.wait()
    # walk each input file front to back: cold sequential reads beat output order (18.6 s vs 23.0 s
    # on a 10.9 GB checkpoint, bench/RESULTS.md); output offsets are planned, so bytes are unchanged
    tasks.sort(key=lambda t: (ckpt.source(t.source).file, ckpt.source(t.source).info.start))
    budget = MemoryBudget(max_memory)
    pending: list[tuple[str, str]] = []
    pending_bytes = 0
    last_commit = time.monotonic()
    in_flight: dict[Future, tuple[Task, int]] = {}
    committer = Committer(staging)

    def reap(block: bool) -> None:
        nonlocal pending_bytes, last_commit
        if not in_flight:
            return
        finished, _ = wait(list(in_flight), timeout=None if block else 0, return_when=FIRST_COMPLETED)
        for fut in finished:
            task, held = in_flight.pop(fut)
            budget.release(held)
            written = fut.result()  # re-raises a worker's error here, in the main thread
            for file, placed in written:
                pending.append((file, placed.tensor.name))
                staging.written(file, placed.start, placed.end)
            pending_bytes += task.nbytes_out
            if progress is not None:
                progress(task.nbytes_out)
        if pending and (pending_bytes >= COMMIT_EVERY_BYTES or time.monotonic() - last_commit > COMMIT_EVERY_SECONDS):
            committer.submit(pending)
            pending.clear()
            pending_bytes, last_commit = 0, time.monotonic()

    torch_threads = _share_torch_threads(workers) if any(t.transform in WHOLE_TENSOR for t in tasks) else None
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpttool") as pool:
        failed = False
        try:
            for task in tasks:
                need = task.memory(ckpt, chunk_bytes)
                while in_flight and (len(in_flight) >= workers * 2 or budget.used + min(need, budget.limit) > budget.limit):
                    reap(block=True)
                held = budget.acquire(need)
                in_flight[pool.submit(run_task, task, ckpt, staging, gpu, chunk_bytes)] = (task, held)
                reap(block=False)
            while in_flight:
                reap(block=True)
        except BaseException:
            failed = True
            for fut in in_flight:
                fut.cancel()
            raise
        finally:
            if torch_threads is not None:
                torch_threads()
            # whatever finished cleanly is durable and journalled, so --resume skips it
            for fut, (task, _) in list(in_flight.items()):
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    pending.extend((file, placed.tensor.name) for file, placed in fut.result())
            if pending:
                committer.queue.put(list(pending))
            try:
                committer.close()
            except BaseException:
                if not failed:
                    raise
                # else the error already propagating is the one to report; this work is redone on --resume


def _share_torch_threads(workers: int) -> Callable[[], None]:
    """Whole-tensor transforms run in torch: share the cores between workers instead of
    oversubscribing them. Returns the undo. (numpy transforms are one thread per worker anyway.)"""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    return lambda: torch.set_num_threads(threads)


MAX_DEFAULT_WORKERS = 16


def default_workers() -> int:
    """One worker per core, up to 16: each runs its numpy transforms on one core. With 8 on the
    16-core benchmark machine the workers were busy 98% of a warm run (transform, then writes into
    the page cache) while sha256 and the disk had room (bench/RESULTS.md)."""
    return max(1, min(MAX_DEFAULT_WORKERS, os.cpu_count() or 1))
