"""What a row of the format table says: `QuantFormat`, the tensors it is made of (`Name`, `Side`), what its
kernels receive (`Chunk`), and `Companion` (the mp layout's name for a kept scale). The rows themselves live
beside this module, one file per library that defines them.

A quantized weight is one tensor of packed values plus any number of side tensors, each with a role the
kernels know it by: "scale", "zero" (zero points), "g_idx" (each input column's group), "global" (one fp32
value for the whole tensor), "shape" (the dequantized shape, stored), "dropped" (activation scales, which
mean nothing once the weight is dequantized). Every name derives from the dequantized weight's name by a
`Name`, so no code outside a row spells a format's tensor names.

Streaming: the executor makes the output in runs of its dim-0 rows (`row_align` the smallest run a row can
take). `source_span` says which span of the stored values a run needs: their own dim-0 rows for most
formats, or a span of their last dim where the values are stored transposed and packed along the input
dimension (GPTQ, AWQ: output row n is stored column n). Each side is read whole once per tensor (`WHOLE`:
small, its values checked before any chunk) or the span a run needs (`BY_ROWS`: `Side.rows` along
`Side.axis`), or not at all at execution (`AT_PLAN`: checked at plan time, where `QuantFormat.at_plan` may read
its data and plan the weight with a row made for it; `DROPPED`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ckpttool.dtypes import CARRIERS, dtype_code, torch_dtype

if TYPE_CHECKING:
    import torch

    from ckpttool.kernels.nan_flag import FirstBad

WHOLE, BY_ROWS, AT_PLAN, DROPPED = "whole", "rows", "plan", "drop"
"""how the executor reads a side tensor (see the module docstring)"""
AT_PLAN_BYTES = 1 << 16
"""the most an AT_PLAN side a row reads at plan time (`QuantFormat.at_plan`) may hold: more is refused unread"""


def with_leaf(name: str, leaf: str) -> str:
    """`a.b.weight` -> `a.b.<leaf>`: how a weight's companion tensors are named in most formats."""
    if not name.endswith("weight"):
        raise ValueError(f"{name!r} is not a weight name")
    return name[: -len("weight")] + leaf


@dataclass(frozen=True, slots=True)
class Name:
    """How a stored tensor's name derives from the dequantized weight's: `leaf` replaces its last part
    `weight` (`X.weight` -> `X.weight_scale_inv`, `X.qweight`, `X.scale`), else `text` is appended to it
    (`X` -> `X_blocks`: gpt-oss, whose expert weights have no `.weight`)."""

    text: str
    leaf: bool = True

    def of(self, base: str) -> str:
        return with_leaf(base, self.text) if self.leaf else base + self.text

    def base_of(self, stored: str) -> str | None:
        """The dequantized name `stored` is this member of, or None where it cannot be one."""
        if self.leaf:
            tail = "." + self.text
            return stored[: -len(tail)] + ".weight" if stored.endswith(tail) and len(stored) > len(tail) else None
        if not self.text:
            return stored
        return stored[: -len(self.text)] if stored.endswith(self.text) and len(stored) > len(self.text) else None


def _same_rows(r0: int, r1: int) -> tuple[int, int]:
    return r0, r1


@dataclass(frozen=True, slots=True)
class Side:
    """A tensor stored beside a quantized weight's values."""

    role: str
    name: Name
    dtypes: tuple[str, ...] = ()
    """accepted dtypes (empty for DROPPED: whatever the writer stored)"""
    read: str = WHOLE
    rows: Callable[[int, int], tuple[int, int]] = _same_rows
    """the side's span [a, b) along `axis` that output rows [r0, r1) need (read so for BY_ROWS, sliced so
    from the whole side for WHOLE)"""
    axis: int = 0
    """0: the span is of dim-0 rows; -1: of the last dim (transposed formats)"""
    encoding: str = ""
    """what the bytes mean where the dtype does not say: "e8m0" (a U8 biased power-of-two exponent)"""
    positive: bool = False
    """a scale's values must be > 0, not only finite (DeepSeek's FP8 blocks)"""
    check_values: Callable[[np.ndarray, dict[str, tuple]], str | None] | None = None
    """what is wrong with a WHOLE side's values, given every read side's shape by role (None: nothing): integer
    sides a kernel indexes with (GPTQ's g_idx), checked once per task before any chunk"""

    @property
    def optional(self) -> bool:
        return self.read == DROPPED


@dataclass(slots=True)
class Chunk:
    """What a kernel is given: a run of the values' rows and, per role, the side rows that run needs (or the
    whole side). numpy arrays in their dtype's carrier on the CPU, torch tensors on CUDA."""

    values: Any
    dtype: str
    sides: dict[str, Any] = field(default_factory=dict)
    side_dtypes: dict[str, str] = field(default_factory=dict)
    global_scale: float = 1.0

    @property
    def scale(self) -> Any:
        return self.sides["scale"]


@dataclass(frozen=True, slots=True)
class Companion:
    """A scale stored beside its weight `X.weight`: `X.<hf_leaf>` in HF checkpoints, `Y.<native_leaf>`
    in the mp layout (Y.weight being the weight's mp name), one value per `block` x `block` weights.
    Key tables derive the scale's row from the weight's row with this, so no code builds the name by
    hand."""

    hf_leaf: str
    native_leaf: str
    block: int

    def scale_range(self, start: int, length: int) -> tuple[int, int]:
        """The (start, length) of scale rows/columns covering weight rows/columns [start, start + length)."""
        return start // self.block, -(-length // self.block)


CpuKernel = Callable[[Chunk, str, "np.ndarray | None"], np.ndarray]
"""(chunk, output dtype code, buffer to write into or None) -> output rows in the output's numpy carrier"""
CudaKernel = Callable[[Chunk, "torch.dtype"], "tuple[torch.Tensor, FirstBad | None]"]
"""(chunk on a CUDA device, output dtype) -> (output rows, first_bad): None, or the record of the first row
holding a NaN (kernels/nan_flag.py), read by the caller when it synchronizes anyway"""


@dataclass(frozen=True, kw_only=True)
class QuantFormat:
    name: str
    """recorded as TensorPlan.transform"""
    title: str
    """what `inspect` and errors call it: the library and its format name"""
    values: Name
    value_dtypes: tuple[str, ...]
    sides: tuple[Side, ...]
    check: Callable[[tuple, dict[str, tuple], dict[str, str], object], None]
    """(values shape, side role -> shape, side role -> tensor name, file) -> None or InputError"""
    out_shape: Callable[[tuple], tuple]
    companion: Companion | None = None
    """how the mp layout names the scale when the format is kept (None: the key table lists it)"""
    # execution
    row_align: int = 1
    """output rows per smallest run (an FP8 block's 128 rows, or one packed word's worth of rows)"""
    source_span: Callable[[int, int, tuple], tuple[int, int, int]] = lambda r0, r1, shape: (0, r0, r1)
    """(output rows r0, r1, values shape) -> (axis, a, b): the span of the stored values they are made from,
    along dim 0 (axis 0) or the last dim (axis -1)"""
    cpu: CpuKernel
    cpu_into: bool = False
    """`cpu` writes into a given buffer (the executor passes each worker's reusable one)"""
    cuda: CudaKernel
    example: Callable[[torch.device], Chunk]
    """a smallest valid chunk on a device: warms a kernel up before the real data arrives"""
    check_global: Callable[[float], str | None] = lambda g: None
    """what is wrong with a "global" side's value (None: nothing)"""
    cpu_compiled: bool = True
    """`cpu` runs compiled loops where they are built (kernels/native, numba); False: numpy's only, counted as
    `chunks_by_cpu_loops_numpy_only` in a run's timing (every row has compiled loops now)"""
    keepable: bool = True
    """whether a plan may keep the format (shard without dequant): False where ckpttool cannot split it"""
    at_plan: Callable[[tuple, dict[str, tuple], dict[str, np.ndarray], dict[str, str], object], QuantFormat] | None \
        = None
    """where the data of the AT_PLAN sides decide the row (bitsandbytes' quant state holds the shape, the block
    size, the nested offset): (values shape, role -> shape, role -> an AT_PLAN side's values (at most
    AT_PLAN_BYTES each, read by the planner), role -> stored name, file) -> the row this one weight is planned
    with, named by what it read so BY_NAME finds it again; an InputError for bad data. None: every weight the
    row claims is planned with the row itself."""
    check_sides: Callable[[dict[str, np.ndarray]], str | None] = lambda sides: None
    """what is wrong with a run's side values taken together, checked before any kernel sees them (bitsandbytes'
    double-quant absmax, rebuilt from two sides, must be finite); None: nothing"""
    prepass: Callable[[Chunk], float] | None = None
    """a statistic the kernel needs from the whole tensor (NVFP4's global scale: the tensor's amax), one float a run
    of the values' rows, combined by max over every run of the tensor before any run is transformed and given to
    the kernel as `Chunk.global_scale`: a first pass over the source in bounded runs (execute/tasks.py); None:
    no first pass"""

    def side(self, role: str) -> Side:
        return next(s for s in self.sides if s.role == role)

    @property
    def read_sides(self) -> tuple[Side, ...]:
        """The sides the executor reads, in the order TensorPlan.sides names them."""
        return tuple(s for s in self.sides if s.read in (WHOLE, BY_ROWS))

    def members(self, base: str) -> dict[str, str]:
        """role -> stored name of every side of weight `base` (the values' name is `values.of(base)`)."""
        return {s.role: s.name.of(base) for s in self.sides}


def bad_row(side: Side, values: np.ndarray, dtype: str) -> int | None:
    """The first dim-0 row of a side tensor's values holding a NaN or an infinity (or, for a side that must
    be positive, a value <= 0), or None. Integer sides (zero points, group indices) have none. Every
    format's scales are checked by this one function before a kernel sees them."""
    floats = side_floats(values, side.encoding if dtype == "U8" and side.encoding else dtype)
    if floats is None:
        return None
    flat = floats.reshape(floats.shape[0], -1) if floats.ndim else floats.reshape(1, 1)
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(flat) | ((flat <= 0) if side.positive else False)
    rows = np.flatnonzero(bad.any(axis=1))
    return int(rows[0]) if rows.size else None


def side_floats(values: np.ndarray, kind: str) -> np.ndarray | None:
    """A side tensor's values as float32 for checking them, by dtype code or encoding (E8M0: NaN for 0xFF,
    1.0 for every other byte, which all stand for finite powers of two); None for integer data."""
    from ckpttool.kernels.fp8_cpu import fp8_values

    if kind == "BF16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    if kind in ("F16", "F32", "F64"):
        return values.astype(np.float32, copy=False)
    if kind in ("F8_E4M3", "F8_E5M2"):
        return fp8_values(kind)[values]
    if kind in ("e8m0", "F8_E8M0"):  # a biased exponent; 0xFF is NaN (OCP microscaling)
        return np.where(values == 0xFF, np.float32(np.nan), np.float32(1.0))
    return None


def via_cpu(cpu):
    """A row's CUDA function that runs its CPU function on the host: the same bits, where a GPU kernel would buy
    nothing (a repack moves bytes) or is not proven yet (the quantize rows' torch ops on CUDA)."""
    def run(c: Chunk, out_dtype):
        import torch

        host = Chunk(_host(c.values, c.dtype), c.dtype, {k: _host(v, c.side_dtypes[k]) for k, v in c.sides.items()},
                     c.side_dtypes, c.global_scale)
        out = np.ascontiguousarray(cpu(host, dtype_code(out_dtype) or "", None))
        if out.dtype.kind == "u" and out.itemsize > 1:  # torch's uint16..64 support few operations: the same bytes
            out = out.view(f"i{out.itemsize}")
        return torch.from_numpy(out).to(c.values.device), None
    return run


def _host(t, dtype: str) -> np.ndarray:
    """A device tensor back in its CPU carrier (numpy has no bfloat16 or float8: their bits as integers)."""
    ints = torch_dtype(f"I{8 * t.element_size()}")
    return t.cpu().view(ints).numpy().view(CARRIERS[dtype])
