"""Merge's unit of work: one output tensor made of its ranks' parts, streamed in runs of rows, each run of
every part concatenated along the split dim and written in place (the other direction from
execute/tasks.py's `Task`). A tensor planned from boxes (`TensorPlan.boxes`: mp ranks re-cut for another mp,
DCP chunks) is the general case: each run of output rows is filled from the rows of every box it crosses, and
a box that spans whole rows on both sides is copied as it is (by the kernel where it can)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ckpttool import defaults
from ckpttool.execute.cuda import CudaTransforms
from ckpttool.dtypes import itemsize
from ckpttool.execute.staging import Staging
from ckpttool.io.checkpoint import ShardFiles
from ckpttool.io.safetensors import TensorInfo
from ckpttool.plan.types import PlacedTensor


@dataclass(slots=True)
class GatherTask:
    """One output tensor concatenated from parts along `concat_dim` (merge): each part is one rank's slice."""

    out_file: str
    placed: PlacedTensor
    parts: list[tuple[str, TensorInfo]]  # (input file, header entry)
    concat_dim: int

    transform = None  # bytes are moved, never transformed

    @property
    def pieces(self) -> list[tuple[str, PlacedTensor]]:
        return [(self.out_file, self.placed)]

    @property
    def nbytes_out(self) -> int:
        return self.placed.end - self.placed.start

    @property
    def files(self) -> tuple[str, ...]:
        """The input files this task reads."""
        return tuple(dict.fromkeys(file for file, _ in self.parts))

    @property
    def read_order(self) -> tuple[str, int]:
        return self.parts[0][0], self.parts[0][1].start

    @property
    def write_order(self) -> int:
        return self.placed.start

    def chunk_rows(self, chunk_bytes: int = defaults.CHUNK_BYTES) -> int:
        shape = self.placed.tensor.shape
        if not shape:
            return 1
        row_bytes = self.nbytes_out // max(shape[0], 1)
        return max(1, chunk_bytes // max(row_bytes, 1))

    def memory(self, chunk_bytes: int = defaults.CHUNK_BYTES) -> int:
        """The parts' rows of one run, and their concatenation (from boxes: a run of output rows, and the widest
        part's rows, read whole even where only a box of them is taken)."""
        shape = self.placed.tensor.shape
        rows = min(self.chunk_rows(chunk_bytes), shape[0] if shape else 1)
        out_row = self.nbytes_out // max(shape[0] if shape else 1, 1)
        if self.placed.tensor.boxes:
            widest = max((info.nbytes // max(info.shape[0] if info.shape else 1, 1) for _, info in self.parts), default=0)
            return (out_row + widest) * rows
        return 2 * out_row * rows

    def row_runs(self, chunk_bytes: int = defaults.CHUNK_BYTES) -> list[tuple[int, int] | None]:
        return [None]  # a merged tensor streams whole, its parts concatenated run by run

    def run(self, inputs: ShardFiles, staging: Staging, gpu: CudaTransforms | None,
            chunk_bytes: int = defaults.CHUNK_BYTES, rows: tuple[int, int] | None = None,
            ) -> list[tuple[str, PlacedTensor]]:
        return run_gather(self, inputs, staging, chunk_bytes)


def run_gather(task: GatherTask, inputs: ShardFiles, staging: Staging,
               chunk_bytes: int = defaults.CHUNK_BYTES) -> list[tuple[str, PlacedTensor]]:
    """Stream one merged tensor: rows of each part (a part's rows are contiguous bytes), concatenated
    along the split dim, written at their offsets. Along dim 0 the parts simply follow each other."""
    clock, placed = staging.timings, task.placed
    shape = placed.tensor.shape
    step = task.chunk_rows(chunk_bytes)
    if placed.tensor.boxes:
        return _run_boxes(task, inputs, staging, step)
    if task.concat_dim == 0 or len(task.parts) == 1 or not shape:
        offset = placed.start
        for file, info in task.parts:
            rows = info.shape[0] if info.shape else 1
            row_bytes = info.nbytes // max(rows, 1)
            for r0 in range(0, rows, step):
                r1 = min(r0 + step, rows)
                with clock.activity("read"):
                    x = inputs.read_rows(file, info, r0, r1)
                with clock.activity("write"):
                    staging.pwrite(task.out_file, x.reshape(-1).view(np.uint8), offset + r0 * row_bytes)
            offset += info.nbytes
        return task.pieces
    row_bytes = task.nbytes_out // shape[0]
    for r0 in range(0, shape[0], step):
        r1 = min(r0 + step, shape[0])
        with clock.activity("read"):
            xs = [inputs.read_rows(file, info, r0, r1) for file, info in task.parts]
        with clock.activity("transform"):
            y = np.concatenate(xs, axis=task.concat_dim)
        with clock.activity("write"):
            staging.pwrite(task.out_file, y.reshape(-1).view(np.uint8), placed.start + r0 * row_bytes)
    return task.pieces


def _run_boxes(task: GatherTask, inputs: ShardFiles, staging: Staging, step: int) -> list[tuple[str, PlacedTensor]]:
    """Fill the output from its boxes: one whose rows are whole on both sides (the same trailing dims) is contiguous
    bytes there and is copied as it is; where any box is narrower, each run of output rows is assembled in memory
    from the rows of every box it crosses (read whole, the box taken from them) and written once."""
    clock, placed = staging.timings, task.placed
    shape, size = placed.tensor.shape, itemsize(placed.tensor.dtype)
    boxes = placed.tensor.boxes
    if not shape:  # a scalar: its one part
        (file, info), = task.parts
        with clock.activity("read"):
            x = inputs.read_from(file, info.name)
        with clock.activity("write"):
            staging.pwrite(task.out_file, x.reshape(-1).view(np.uint8), placed.start)
        return task.pieces
    out_row = math.prod(shape[1:]) * size
    if all(tuple(info.shape[1:]) == tuple(n[1:]) == tuple(shape[1:]) for (_, info), (_, n, _) in zip(task.parts, boxes)):
        for (file, info), (src, n, dst) in zip(task.parts, boxes):
            _copy_rows(task, inputs, staging, file, info, src[0], n[0], placed.start + dst[0] * out_row, step)
        return task.pieces
    for r0 in range(0, shape[0], step):
        r1 = min(r0 + step, shape[0])
        y = np.empty((r1 - r0, *_byte_dims(shape[1:], size)), dtype=np.uint8)
        for (file, info), (src, n, dst) in zip(task.parts, boxes):
            a, b = max(r0, dst[0]), min(r1, dst[0] + n[0])
            if a >= b:
                continue
            with clock.activity("read"):
                x = inputs.read_rows(file, info, src[0] + a - dst[0], src[0] + b - dst[0])
            with clock.activity("transform"):
                x = np.ascontiguousarray(x).view(np.uint8).reshape(b - a, *_byte_dims(info.shape[1:], size))
                take = tuple(slice(s, s + k) for s, k in zip(_byte_at(src[1:], size), _byte_dims(n[1:], size)))
                put = tuple(slice(d, d + k) for d, k in zip(_byte_at(dst[1:], size), _byte_dims(n[1:], size)))
                y[(slice(a - r0, b - r0), *put)] = x[(slice(None), *take)]
        with clock.activity("write"):
            staging.pwrite(task.out_file, y.reshape(-1), placed.start + r0 * out_row)
    return task.pieces


def _byte_dims(dims: tuple[int, ...], size: int) -> tuple[int, ...]:
    """Trailing dims of a run of rows with the last one counted in bytes (a 1-D tensor's rows: one element each)."""
    return (*dims[:-1], dims[-1] * size) if dims else (size,)


def _byte_at(starts: tuple[int, ...], size: int) -> tuple[int, ...]:
    return (*starts[:-1], starts[-1] * size) if starts else (0,)


def _copy_rows(task: GatherTask, inputs: ShardFiles, staging: Staging, file: str, info: TensorInfo, first: int,
               rows: int, offset: int, step: int) -> None:
    """Rows [first, first + rows) of a part, contiguous in it and in the output: in the kernel where it can, else
    read and written a run at a time."""
    row_bytes = info.nbytes // max(info.shape[0], 1)
    with staging.timings.activity("write"):
        if staging.copy_range(task.out_file, inputs.fd(file), info.start + first * row_bytes, rows * row_bytes, offset):
            return
    for r0 in range(first, first + rows, step):
        r1 = min(r0 + step, first + rows)
        with staging.timings.activity("read"):
            x = inputs.read_rows(file, info, r0, r1)
        with staging.timings.activity("write"):
            staging.pwrite(task.out_file, x.reshape(-1).view(np.uint8), offset + (r0 - first) * row_bytes)
