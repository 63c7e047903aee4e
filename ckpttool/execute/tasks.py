"""The units of work the executor schedules, and how each one streams its bytes.

A `Task` is one input tensor (plus the tensors its format stores beside it) and every output piece made from it. It streams its
source in runs of dim-0 rows: read the rows, transform them (FP8/MXFP4 dequant, on CPU or CUDA), and
pwrite each piece's share of them at its planned offset. Each run of rows (one chunk) is a work item
of its own (`Task.row_runs`), so several workers stream one large tensor at once. Rows no remaining
piece needs are never read, so a resumed or distributed run reads only what it writes.

A `GatherTask` (execute/gather.py) is the other direction: merge's output tensor made of its ranks'
parts.

Inputs are addressed by (file, tensor) through io.checkpoint.ShardFiles, so a Checkpoint (names
resolved through its index) and a set of mp shards (names repeated per rank) read the same way.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from ckpttool import defaults
from ckpttool.dtypes import itemsize
from ckpttool.execute.cuda import CudaTransforms
from ckpttool.execute.gather import GatherTask
from ckpttool.execute.osutil import in_memory_fs
from ckpttool.execute.staging import Staging
from ckpttool.execute.reads import SideInput, SideReader, read_span
from ckpttool.formats import BY_NAME, QUANTIZE_TRANSFORMS
from ckpttool.io.checkpoint import ShardFiles
from ckpttool.io.safetensors import TensorInfo
from ckpttool.kernels import fp8_gather
from ckpttool.kernels.fp8_cpu import NaNCodes
from ckpttool.kernels.quant import NonFinite
from ckpttool.plan.types import PlacedTensor, Plan



@dataclass(slots=True)
class Task:
    """All output pieces made from one input tensor (and the tensors beside it): read once, write many."""

    source: str
    file: str  # the input file holding `source`
    info: TensorInfo
    transform: str | None
    sides: tuple[SideInput, ...]
    out_dtype: str
    pieces: list[tuple[str, PlacedTensor]] = field(default_factory=list)  # (output file, placement)

    @property
    def files(self) -> tuple[str, ...]:
        """The input files this task reads."""
        return tuple(dict.fromkeys((self.file, *(s.file for s in self.sides))))

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape of what the task makes (its pieces narrow it): the dequantized shape, or the source's."""
        fmt = BY_NAME.get(self.transform) if self.transform else None
        return tuple(fmt.out_shape(self.info.shape)) if fmt is not None else tuple(self.info.shape)

    @property
    def rows(self) -> int:
        """Output dim-0 length (the source's, but for a transposed format); a scalar counts as one row."""
        shape = self.out_shape
        return shape[0] if shape else 1

    def out_row_bytes(self) -> int:
        return math.prod(self.out_shape[1:]) * itemsize(self.out_dtype if self.transform else self.info.dtype)

    def chunk_rows(self, chunk_bytes: int = defaults.CHUNK_BYTES) -> int:
        if self.transform in QUANTIZE_TRANSFORMS:
            return max(1, self.rows)
        fmt = BY_NAME[self.transform] if self.transform else None
        align = fmt.row_align if fmt else 1
        # bounded by what a run reads as well as what it writes (a quantize row's scale output is tiny per row,
        # the weight rows it reads are not)
        row_bytes = max(self.out_row_bytes(), self.info.nbytes // max(self.rows, 1), 1)
        rows = max(1, chunk_bytes // row_bytes) // align * align
        return max(align, rows)

    def memory(self, chunk_bytes: int = defaults.CHUNK_BYTES) -> int:
        """Peak bytes one run of rows needs: the source rows, the transformed rows (and the fp32
        temporary of a dequant), and one contiguous piece copy."""
        info = self.info
        if self.transform in QUANTIZE_TRANSFORMS:  # the source, its fp32 copy and temporaries, the output
            numel = info.nbytes // itemsize(info.dtype)
            return info.nbytes + numel * 12 + max(p.end - p.start for _, p in self.pieces)
        rows = min(self.chunk_rows(chunk_bytes), self.rows)
        src = info.nbytes // max(self.rows, 1) * rows
        if self.transform is None:
            return 2 * src
        out = math.prod(self.out_shape[1:]) * rows
        sides = sum(s.info.nbytes for s in self.sides)  # whole, at most (a run's span of them, for BY_ROWS sides)
        return src + sides + out * (2 * itemsize(self.out_dtype) + 4)

    @property
    def nbytes_out(self) -> int:
        return sum(p.end - p.start for _, p in self.pieces)

    @property
    def read_order(self) -> tuple[str, int]:
        return self.file, self.info.start

    @property
    def write_order(self) -> int:
        """Where its first piece lands (mp files order their tensors alike)."""
        return self.pieces[0][1].start

    def row_runs(self, chunk_bytes: int = defaults.CHUNK_BYTES) -> list[tuple[int, int] | None]:
        """The runs of rows (one chunk each) the executor schedules as work items of their own, so that
        several workers stream one large tensor at once; [None] where the task runs whole (a
        quantize transform, a scalar)."""
        if self.transform in QUANTIZE_TRANSFORMS or not self.info.shape:
            return [None]
        lo, hi = _needed_rows(self)
        step = self.chunk_rows(chunk_bytes)
        return [(r, min(r + step, hi)) for r in range(lo, hi, step)] or [None]

    def run(self, inputs: ShardFiles, staging: Staging, gpu: CudaTransforms | None,
            chunk_bytes: int = defaults.CHUNK_BYTES, rows: tuple[int, int] | None = None,
            ) -> list[tuple[str, PlacedTensor]]:
        return run_task(self, inputs, staging, gpu, chunk_bytes, rows)


def run_order(tasks: list, inputs: ShardFiles) -> list:
    """Sort `tasks` into the order the executor submits them, which is also the order a hub stream
    (hub/schedule.py) fetches input files in: the two must agree, or the stream waits for room that the
    executor frees only after reading a file still to come (a deadlock on tmpfs, 2026-11-23).

    Each input file front to back: cold sequential reads beat output order (18.6 s vs 23.0 s on a
    10.9 GB checkpoint, bench/HISTORY.md). Only a local input in RAM (tmpfs) has no seek to save: there
    output order lets each file's hash take most pieces from the writer's memory instead of re-reading
    them (1.15 of 1.85 GB vs 0.05 GB, 2-core box). Output offsets are planned, so bytes are unchanged."""
    by_write = _in_ram(inputs)
    tasks.sort(key=(lambda t: t.write_order) if by_write else (lambda t: t.read_order))
    return tasks


def _in_ram(inputs: ShardFiles) -> bool:
    """Whether the input is a local directory on tmpfs or ramfs (not a hub stream, whose files come and go)."""
    return inputs.local and in_memory_fs(inputs.root)


def make_tasks(plan: Plan, inputs: ShardFiles, done: set[tuple[str, str]], published: set[str],
               files: set[str] | None = None) -> list[Task | GatherTask]:
    """Group the pieces still to write (optionally only those of `files`) by what they are made from."""
    tasks: dict[tuple, Task] = {}
    gathers: list[GatherTask] = []
    for f in plan.files:
        if f.name in published or (files is not None and f.name not in files):
            continue
        for p in f.tensors:
            if (f.name, p.tensor.name) in done:
                continue
            t = p.tensor
            if t.parts:
                gathers.append(GatherTask(f.name, p, [(file, inputs.info(file, name)) for file, name in t.parts],
                                          t.concat_dim))
                continue
            key = (t.source, t.transform, t.sides, t.dtype if t.transform else None)
            task = tasks.get(key)
            if task is None:
                src = inputs.source(t.source)
                roles = BY_NAME[t.transform].read_sides if t.transform in BY_NAME else ()
                sides = tuple(SideInput(side, name, (s := inputs.source(name)).file, s.info)
                              for side, name in zip(roles, t.sides))
                task = tasks[key] = Task(t.source, src.file, src.info, t.transform, sides, t.dtype)
            task.pieces.append((f.name, p))
    return [*tasks.values(), *gathers]


_scratch = threading.local()


def scratch(slot: str, nbytes: int) -> np.ndarray:
    """This worker thread's reusable uint8 buffer `slot`, at least nbytes (CPU path). A fresh array
    per chunk is one malloc'd mmap (chunks are 32 MiB), page-faulted and zeroed by the kernel every
    time: clear_page alone was 5% of a 2-core tmpfs run's CPU. One per slot and thread: workers x
    one chunk's input and output, what the memory budget allows in flight anyway."""
    buf = getattr(_scratch, slot, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        setattr(_scratch, slot, buf)
    return buf[:nbytes]


def _needed_rows(task: Task) -> tuple[int, int]:
    """The dim-0 rows [lo, hi) some remaining piece needs, lo aligned down to the format's row blocks."""
    n_rows = task.rows
    lo, hi = n_rows, 0
    for _, p in task.pieces:
        nar = p.tensor.narrow
        a, b = (nar[1], nar[1] + nar[2]) if nar is not None and nar[0] == 0 else (0, n_rows)
        lo, hi = min(lo, a), max(hi, b)
    fmt = BY_NAME.get(task.transform) if task.transform else None
    return (lo // fmt.row_align * fmt.row_align if fmt else lo), hi


def run_task(task: Task, inputs: ShardFiles, staging: Staging, gpu: CudaTransforms | None,
             chunk_bytes: int = defaults.CHUNK_BYTES, rows: tuple[int, int] | None = None,
             ) -> list[tuple[str, PlacedTensor]]:
    """Stream one task's rows (only those in `rows`, one of `Task.row_runs`, when given): read, transform
    (on `gpu` when given and started, else the CPU), write."""
    clock = staging.timings
    info = task.info
    if task.transform in QUANTIZE_TRANSFORMS:  # torch code (the quantize kernels), on the whole tensor
        import torch

        from ckpttool.io.safetensors import tensor_from_bytes

        with clock.activity("read"):
            x = tensor_from_bytes(inputs.read_from(task.file, task.source), info.dtype, info.shape)
        with clock.activity("transform"):
            try:
                x = QUANTIZE_TRANSFORMS[task.transform](x)
            except NonFinite as exc:
                raise exc.moved(0, file=inputs.root / task.file, tensor=task.source) from None
        with clock.activity("write"):
            for file, placed in task.pieces:
                y = x if placed.tensor.narrow is None else x.narrow(*placed.tensor.narrow)
                staging.pwrite(file, y.contiguous().reshape(-1).view(torch.uint8).numpy(), placed.start)
        return list(task.pieces)
    if task.transform is None and info.shape and _copy_pieces(task, inputs, staging, rows):
        return list(task.pieces)
    n_rows = task.rows
    lo, hi = rows if rows is not None else _needed_rows(task)
    fmt = BY_NAME[task.transform] if task.transform else None
    sides = SideReader(inputs, task.source, fmt, task.sides) if fmt is not None else None
    if fmt is not None and fmt.prepass is not None:
        sides.global_scale = _prepass(task, inputs, fmt, chunk_bytes, gpu is None and _in_ram(inputs))
    step = task.chunk_rows(chunk_bytes)
    scalar = not info.shape
    in_row_bytes = info.nbytes // max(n_rows, 1)
    out_row_bytes = task.out_row_bytes()
    # a kernel that can writes into this thread's reusable buffer (only without a GPU: its pinned buffers
    # are the reusable ones there)
    into = gpu is None and fmt is not None and not scalar and fmt.cpu_into
    # on the CPU from an input in RAM, rows are read through the file's mapping, not copied out of it
    mapped = gpu is None and not scalar and _in_ram(inputs)
    for r0 in range(lo, hi, step):
        r1 = min(r0 + step, hi)
        with clock.activity("read"):
            buf = None
            if gpu is not None and fmt is not None and not scalar:
                rows_in, rows_out = (r1 - r0) * in_row_bytes, (r1 - r0) * out_row_bytes
                buf = gpu.staging(max(rows_in, rows_out))
            elif gpu is None and not scalar and not mapped:
                buf = scratch("in", (r1 - r0) * in_row_bytes)
            axis, a, b = fmt.source_span(r0, r1, info.shape) if fmt is not None else (0, r0, r1)
            x = read_span(inputs, task.file, info, axis, a, b, into=buf, mapped=mapped)
            if mapped and axis == 0:
                clock.count("chunks_read_mapped")
            if fmt is not None:
                chunk = sides.chunk(x, info.dtype, r0, r1)
        if fmt is not None:
            if gpu is None:
                clock.count(f"chunks_by_cpu_loops_{fp8_gather.cpu_loops() if fmt.cpu_compiled else 'numpy_only'}")
            with clock.activity("transform"):
                try:
                    if gpu is not None:
                        x = gpu.apply(fmt, chunk, task.out_dtype)
                    else:
                        x = fmt.cpu(chunk, task.out_dtype, scratch("out", (r1 - r0) * out_row_bytes) if into else None)
                    del chunk
                except NaNCodes as exc:  # the kernel saw rows r0.. of the tensor
                    raise NaNCodes(None if exc.row is None else r0 + exc.row,
                                   file=inputs.root / task.file, tensor=task.source) from None
                except NonFinite as exc:  # a quantize row saw source rows a.. (formats/outputs_stream.py)
                    raise exc.moved(a, file=inputs.root / task.file, tensor=task.source) from None
        with clock.activity("write"):
            _write_rows(task, x, r0, r1, staging)
        del x  # a mapped chunk is unmapped here, its last view gone
    return list(task.pieces)


_PREPASSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""a run's inputs -> {(file, tensor, the statistic): its value}: every output of one weight (NVFP4's codes, scales
and global scale share one statistic) needs the same, computed once per process and run"""


def _prepass(task: Task, inputs: ShardFiles, fmt, chunk_bytes: int, mapped: bool) -> float:
    """The row's whole-tensor statistic (QuantFormat.prepass): max over bounded runs of the source's rows."""
    known = _PREPASSED.setdefault(inputs, {})
    key = (task.file, task.source, fmt.prepass)
    if key in known:
        return known[key]
    from ckpttool.formats.row import Chunk

    info = task.info
    rows = info.shape[0] if info.shape else 1
    step = max(1, chunk_bytes // max(1, info.nbytes // max(rows, 1)))
    top = -math.inf
    for a in range(0, rows, step):
        b = min(a + step, rows)
        x = read_span(inputs, task.file, info, 0, a, b, mapped=mapped)
        try:
            top = max(top, fmt.prepass(Chunk(x, info.dtype)))
        except NonFinite as exc:
            raise exc.moved(a, file=inputs.root / task.file, tensor=task.source) from None
        del x
    known[key] = top
    return top


def _copy_pieces(task: Task, inputs: ShardFiles, staging: Staging, rows: tuple[int, int] | None = None) -> bool:
    """A byte-moving task whose every piece is a run of whole rows of its source (no split along a
    later dim) is copied by the kernel, piece by piece (Staging.copy_range), each piece's share of
    `rows` when given. False where a piece is not contiguous in the source or the kernel cannot copy:
    the rows are then read and written."""
    info = task.info
    row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
    a, b = rows if rows is not None else (0, info.shape[0])
    ranges = []
    for file, placed in task.pieces:
        nar = placed.tensor.narrow
        if nar is not None and nar[0] != 0:
            return False
        first, n = (0, info.shape[0]) if nar is None else (nar[1], nar[2])
        lo, hi = max(first, a), min(first + n, b)
        if lo < hi:
            ranges.append((file, info.start + lo * row_bytes, (hi - lo) * row_bytes,
                           placed.start + (lo - first) * row_bytes))
    src_fd = inputs.fd(task.file)
    with staging.timings.activity("write"):
        for file, src, nbytes, dst in ranges:
            if nbytes and not staging.copy_range(file, src_fd, src, nbytes, dst):
                return False  # the read-and-write path redoes every piece: the same bytes again
    return True


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
