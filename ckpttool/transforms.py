"""Execution-time tensor transforms, by the name a stage records in TensorPlan.transform.

Each transform works on a run of dim-0 rows of its source, so the executor can stream any tensor in
bounded chunks: `row_align` is the smallest run it can take (an FP8 scale covers 128 rows), and
`scale_rows` says which rows of the scale tensor those source rows need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ckpttool.kernels.fp8 import BLOCK, dequant_fp8_block
from ckpttool.kernels.mxfp4 import dequant_mxfp4


@dataclass(frozen=True)
class Transform:
    name: str
    row_align: int
    scale_rows: Callable[[int, int], tuple[int, int]]
    apply: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    out_per_source_row: Callable[[tuple[int, ...]], int]
    """output elements per source dim-0 row, for sizing chunks"""
    example: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    """a smallest valid (source, scale) on a device: warms a kernel up before the real data arrives"""


def _fp8_block(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return dequant_fp8_block(x, scale, out_dtype)


def _mxfp4_transposed(blocks: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # [E, OUT, G, 16] + [E, OUT, G] -> [E, OUT, IN] -> transformers' BF16 [E, IN, OUT]
    return dequant_mxfp4(blocks, scales, out_dtype).transpose(1, 2).contiguous()


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


TRANSFORMS: dict[str, Transform] = {
    "fp8_block": Transform(
        name="fp8_block", row_align=BLOCK,
        scale_rows=lambda r0, r1: (r0 // BLOCK, -(-r1 // BLOCK)),
        apply=_fp8_block,
        out_per_source_row=lambda shape: _prod(shape[1:]),
        example=lambda dev: (torch.zeros(BLOCK, BLOCK, dtype=torch.float8_e4m3fn, device=dev),
                             torch.ones(1, 1, device=dev)),
    ),
    "mxfp4": Transform(
        name="mxfp4", row_align=1,
        scale_rows=lambda r0, r1: (r0, r1),
        apply=_mxfp4_transposed,
        out_per_source_row=lambda shape: _prod(shape[1:]) * 2,  # [.., G, 16] bytes -> G * 32 values
        example=lambda dev: (torch.zeros(1, 1, 1, 16, dtype=torch.uint8, device=dev),
                             torch.full((1, 1, 1), 127, dtype=torch.uint8, device=dev)),
    ),
}


from ckpttool.stages.quantize import QUANTIZE_TRANSFORMS  # noqa: E402

WHOLE_TENSOR: dict[str, Callable[[torch.Tensor], torch.Tensor]] = dict(QUANTIZE_TRANSFORMS)
"""Transforms of a whole source tensor (no scale input; outputs not row-aligned with the source:
quantized values and their block/channel/group scales): read once, applied once, pieces narrowed."""
