"""Merge's unit of work: one output tensor made of its ranks' parts, streamed in runs of rows, each run of
every part concatenated along the split dim and written in place (the other direction from
execute/tasks.py's `Task`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ckpttool import defaults
from ckpttool.execute.cuda import CudaTransforms
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
        """The parts' rows of one run, and their concatenation."""
        shape = self.placed.tensor.shape
        rows = min(self.chunk_rows(chunk_bytes), shape[0] if shape else 1)
        return 2 * (self.nbytes_out // max(shape[0] if shape else 1, 1)) * rows

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
