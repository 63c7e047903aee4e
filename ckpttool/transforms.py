"""Execution-time tensor transforms, by the name a stage records in TensorPlan.transform.

Each transform works on a run of dim-0 rows of its source, so the executor can stream any tensor in
bounded chunks: `row_align` is the smallest run it can take (an FP8 scale covers 128 rows), and
`scale_rows` says which rows of the scale tensor those source rows need.

Two implementations of each, with the same bits: `cpu` on numpy arrays (dtype codes, bf16 carried
as uint16; no torch import, which costs seconds at every start), and `cuda` on torch tensors of a
CUDA device (Triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ckpttool.kernels import fp8_cpu, mxfp4_cpu
from ckpttool.kernels.fp8_cpu import BLOCK

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Transform:
    name: str
    row_align: int
    scale_rows: Callable[[int, int], tuple[int, int]]
    cpu: Callable[[np.ndarray, np.ndarray, str, str], np.ndarray]
    """(source rows, scale rows, source dtype code, output dtype code) -> output rows, in numpy carriers"""
    cuda: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    """(source rows, scale rows, output dtype) -> output rows, torch tensors on a CUDA device"""
    out_per_source_row: Callable[[tuple[int, ...]], int]
    """output elements per source dim-0 row, for sizing chunks"""
    example: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    """a smallest valid (source, scale) on a device: warms a kernel up before the real data arrives"""


def _fp8_cuda(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    from ckpttool.kernels.fp8 import dequant_fp8_block

    return dequant_fp8_block(x, scale, out_dtype)


def _fp8_example(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return torch.zeros(BLOCK, BLOCK, dtype=torch.float8_e4m3fn, device=dev), torch.ones(1, 1, device=dev)


# MXFP4 experts: [E, OUT, G, 16] + [E, OUT, G] -> [E, OUT, IN] -> transformers' [E, IN, OUT]
def _mxfp4_cpu(blocks: np.ndarray, scales: np.ndarray, dtype: str, out: str) -> np.ndarray:
    return np.ascontiguousarray(mxfp4_cpu.dequant(blocks, scales, out).transpose(0, 2, 1))


def _mxfp4_cuda(blocks: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    from ckpttool.kernels.mxfp4 import dequant_mxfp4

    return dequant_mxfp4(blocks, scales, out_dtype).transpose(1, 2).contiguous()


def _mxfp4_example(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return (torch.zeros(1, 1, 1, 16, dtype=torch.uint8, device=dev),
            torch.full((1, 1, 1), 127, dtype=torch.uint8, device=dev))


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


TRANSFORMS: dict[str, Transform] = {
    "fp8_block": Transform(
        name="fp8_block", row_align=BLOCK,
        scale_rows=lambda r0, r1: (r0 // BLOCK, -(-r1 // BLOCK)),
        cpu=fp8_cpu.dequant, cuda=_fp8_cuda,
        out_per_source_row=lambda shape: _prod(shape[1:]),
        example=_fp8_example,
    ),
    "mxfp4": Transform(
        name="mxfp4", row_align=1,
        scale_rows=lambda r0, r1: (r0, r1),
        cpu=_mxfp4_cpu, cuda=_mxfp4_cuda,
        out_per_source_row=lambda shape: _prod(shape[1:]) * 2,  # [.., G, 16] bytes -> G * 32 values
        example=_mxfp4_example,
    ),
}


from ckpttool.stages.quantize import QUANTIZE_TRANSFORMS  # noqa: E402

WHOLE_TENSOR: dict[str, Callable[[torch.Tensor], torch.Tensor]] = dict(QUANTIZE_TRANSFORMS)
"""Transforms of a whole source tensor (no scale input; outputs not row-aligned with the source:
quantized values and their block/channel/group scales): read once, applied once (in torch, imported
only then), pieces narrowed."""
