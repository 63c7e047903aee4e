"""What a row of the format table says: `QuantFormat` (and `Companion`, the mp layout's name for a
kept scale). The rows themselves live beside this module, one file per library that defines them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    import torch

    from ckpttool.kernels.nan_flag import FirstBad


def with_leaf(name: str, leaf: str) -> str:
    """`a.b.weight` -> `a.b.<leaf>`: how a weight's companion tensors are named in every format."""
    if not name.endswith("weight"):
        raise ValueError(f"{name!r} is not a weight name")
    return name[: -len("weight")] + leaf


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


@dataclass(frozen=True, kw_only=True)
class QuantFormat:
    name: str
    """recorded as TensorPlan.transform"""
    title: str
    """what `inspect` and errors call it: the library and its format name"""
    weight_suffix: str
    """appended to the dequantized name to get the stored weight's name"""
    scale_suffix: str
    """appended to the dequantized name to get the stored scales' name"""
    weight_dtypes: tuple[str, ...]
    scale_dtype: str
    check: Callable[[tuple, tuple, str, object], None]
    """(weight shape, scale shape, scale tensor name, file) -> None or InputError"""
    out_shape: Callable[[tuple], tuple]
    companion: Companion | None
    """how the mp layout names the scale when the format is kept (None: the key table lists it)"""
    # execution
    row_align: int
    scale_rows: Callable[[int, int], tuple[int, int]]
    scale_whole: bool
    """the scale is tiny (one value per block): read once per tensor and its values checked"""
    out_per_source_row: Callable[[tuple[int, ...]], int]
    """output elements per source dim-0 row, for sizing chunks"""
    cpu: Callable[[np.ndarray, np.ndarray, str, str], np.ndarray]
    """(source rows, scale rows, source dtype code, output dtype code) -> output rows, in numpy carriers"""
    cuda: Callable[[torch.Tensor, torch.Tensor, torch.dtype], tuple[torch.Tensor, FirstBad | None]]
    """(source rows, scale rows, output dtype) -> (output rows, first_bad), the rows on a CUDA device;
    first_bad: None, or the record of the first row holding a NaN (kernels/nan_flag.py), read by the
    caller when it synchronizes anyway"""
    example: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    """a smallest valid (source, scale) on a device: warms a kernel up before the real data arrives"""
    # tensors beside the weight other than its scale, named by leaf (`X.weight` -> `X.<leaf>`)
    global_leaf: str | None = None
    """one fp32 value for the whole tensor that the kernels take as `global_scale` (NVFP4)"""
    check_global: Callable[[float], str | None] = lambda g: None
    """what is wrong with a global scale's value (None: nothing)"""
    shape_leaf: str | None = None
    """the dequantized shape stored as a tensor (compressed-tensors' `weight_shape`): checked at plan time"""
    cpu_compiled: bool = True
    """`cpu` runs compiled loops where they are built (kernels/native, numba); False: numpy's only (MXFP4),
    counted as `chunks_by_cpu_loops_numpy_only` in a run's timing"""
    dropped_leaves: tuple[str, ...] = ()
    """activation scales: meaningless once the weight is BF16, dropped with it when present"""
    keepable: bool = True
    """whether a plan may keep the format (shard without dequant): False where ckpttool cannot split it"""

    def base_of(self, stored_weight: str) -> str:
        """The dequantized name of a stored weight name (`X.weight_packed` -> `X.weight`)."""
        return stored_weight[: len(stored_weight) - len(self.weight_suffix)] if self.weight_suffix else stored_weight

    def besides(self, base: str) -> dict[str, str]:
        """name -> role ("global", "shape", "dropped") of the tensors stored beside weight `base`."""
        out = {}
        if self.global_leaf:
            out[with_leaf(base, self.global_leaf)] = "global"
        if self.shape_leaf:
            out[with_leaf(base, self.shape_leaf)] = "shape"
        for leaf in self.dropped_leaves:
            out[with_leaf(base, leaf)] = "dropped"
        return out

    def bind(self, global_scale: float) -> "QuantFormat":
        """This row with one tensor's global scale given to both kernels."""
        return replace(self, cpu=partial(self.cpu, global_scale=global_scale),
                       cuda=partial(self.cuda, global_scale=global_scale))
