"""What a dequant task reads for a run of output rows: the span of the stored values its format names
(`QuantFormat.source_span`: dim-0 rows, or last-dim columns where the values are stored transposed), and
each side tensor, whole once per tensor or the span a run needs (`Side.rows` along `Side.axis`). Every
scale is checked by the one function the format table gives (formats.row.bad_row) before a kernel sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats import Chunk, QuantFormat
from ckpttool.formats.row import BY_ROWS, Side, bad_row
from ckpttool.io.checkpoint import ShardFiles
from ckpttool.io.safetensors import TensorInfo, array_from_bytes


@dataclass(frozen=True, slots=True)
class SideInput:
    """A tensor a dequant transform reads beside its values: its row's description, name, file and header."""

    side: Side
    name: str
    file: str
    info: TensorInfo


def read_span(inputs: ShardFiles, file: str, info: TensorInfo, axis: int, a: int, b: int, *,
              into: np.ndarray | None = None, mapped: bool = False) -> np.ndarray:
    """[a, b) of a tensor along dim 0 (into a buffer or through a mapping, as ShardFiles.read_rows) or along
    its last dim (ShardFiles.read_cols)."""
    if axis == 0 or not info.shape:
        return inputs.read_rows(file, info, a, b, into, mapped=mapped)
    return inputs.read_cols(file, info, a, b)


def _along(values: np.ndarray, axis: int, a: int, b: int) -> np.ndarray:
    return values[a:b] if axis == 0 else values[..., a:b]


def checked(inputs: ShardFiles, source: str, side: SideInput, values: np.ndarray, first: int = 0) -> np.ndarray:
    """A side tensor's values (a span of them from `first`), refused if a scale holds a NaN or an infinity."""
    bad = bad_row(side.side, values, side.info.dtype)
    if bad is not None:
        what = "non-finite or non-positive values" if side.side.positive else "NaN or infinite values"
        raise InputError(f"{side.side.role} {side.name!r} holds {what} (first in row {first + bad})",
                         file=inputs.root / side.file, tensor=source,
                         fix="the checkpoint is corrupt; re-download this shard")
    return values


class SideReader:
    """The side tensors of one task: the whole ones read (and checked) once, the others per run."""

    def __init__(self, inputs: ShardFiles, source: str, fmt: QuantFormat, sides: tuple[SideInput, ...]):
        self.inputs, self.source, self.sides = inputs, source, sides
        self.whole: dict[str, np.ndarray] = {}
        self.global_scale = 1.0
        shapes = {s.side.role: tuple(s.info.shape) for s in sides}
        for s in sides:
            if s.side.read == BY_ROWS:
                continue
            values = array_from_bytes(inputs.read_from(s.file, s.name), s.info.dtype, s.info.shape)
            if s.side.role == "global":  # the row's own check, which says what a global scale must be
                self.global_scale = float(values.reshape(-1)[0])
                problem = fmt.check_global(self.global_scale)
                if problem:
                    raise InputError(problem, file=inputs.root / s.file, tensor=s.name,
                                     fix="the checkpoint is corrupt; re-download this shard")
            else:  # a scalar is one row (a per-tensor scale stored as a 0-d tensor)
                self.whole[s.side.role] = checked(inputs, source, s, values.reshape(values.shape or (1,)))
                problem = s.side.check_values(values, shapes) if s.side.check_values else None
                if problem:
                    raise InputError(problem, file=inputs.root / s.file, tensor=s.name,
                                     fix="the checkpoint is corrupt or not what config.json says; re-download it")

    def chunk(self, values: np.ndarray, dtype: str, r0: int, r1: int) -> Chunk:
        """Output rows [r0, r1)'s chunk: the stored values they are made from and the side spans they need."""
        sides = {}
        for s in self.sides:
            if s.side.role == "global":
                continue
            a, b = s.side.rows(r0, r1)
            if s.side.read == BY_ROWS:
                span = read_span(self.inputs, s.file, s.info, s.side.axis, a, b)
                sides[s.side.role] = checked(self.inputs, self.source, s, span, a if s.side.axis == 0 else 0)
            else:
                sides[s.side.role] = _along(self.whole[s.side.role], s.side.axis, a, b)
        return Chunk(values, dtype, sides, {s.side.role: s.info.dtype for s in self.sides}, self.global_scale)
