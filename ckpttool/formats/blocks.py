"""The formats ckpttool dequantized first: DeepSeek's FP8 128x128 blocks and gpt-oss' MXFP4 experts.

  fp8_block  W (F8_E4M3) + W_scale_inv (F32, one per 128x128 block)  -> W, same shape (DeepSeek V3/R1)
  mxfp4      W_blocks (U8 [E, R, G, 16]) + W_scales (U8 [E, R, G])   -> W, [E, G*32, R] (gpt-oss experts,
             in the transposed layout transformers' GptOss loads)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats.row import Companion, QuantFormat
from ckpttool.kernels import fp8_cpu, mxfp4_cpu
from ckpttool.kernels.fp8 import BLOCK, FP8_DTYPES, check_scale
from ckpttool.kernels.mxfp4 import VALUES_PER_BLOCK, check_mxfp4

if TYPE_CHECKING:
    import torch

    from ckpttool.kernels.nan_flag import FirstBad


# -- fp8_block ---------------------------------------------------------------------------------------
SCALE_SUFFIX = "_scale_inv"
FP8_SCALE = Companion(hf_leaf="weight" + SCALE_SUFFIX, native_leaf="scale", block=BLOCK)


def _check_fp8(w_shape, s_shape, tensor, file) -> None:
    check_scale(w_shape, s_shape, tensor=tensor, file=file)


def _fp8_cuda(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
              ) -> tuple[torch.Tensor, FirstBad | None]:
    from ckpttool.kernels.fp8 import dequant_fp8_block_lazy

    return dequant_fp8_block_lazy(x, scale, out_dtype)


def _fp8_example(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return torch.zeros(BLOCK, BLOCK, dtype=torch.float8_e4m3fn, device=dev), torch.ones(1, 1, device=dev)


FP8_BLOCK = QuantFormat(
    name="fp8_block", title="DeepSeek FP8 128x128 blocks", weight_suffix="", scale_suffix=SCALE_SUFFIX, weight_dtypes=FP8_DTYPES, scale_dtype="F32",
    check=_check_fp8, out_shape=lambda shape: shape, companion=FP8_SCALE,
    row_align=BLOCK, scale_rows=lambda r0, r1: (r0 // BLOCK, -(-r1 // BLOCK)), scale_whole=True,
    out_per_source_row=lambda shape: math.prod(shape[1:]),
    cpu=fp8_cpu.dequant, cuda=_fp8_cuda, example=_fp8_example,
)


# -- mxfp4: experts [E, OUT, G, 16] + [E, OUT, G] -> [E, OUT, IN] -> transformers' [E, IN, OUT] -------------
def _check_mxfp4(b_shape, s_shape, tensor, file) -> None:
    if len(b_shape) != 4:
        raise InputError(f"MXFP4 expert blocks must be [E, R, G, 16], got {list(b_shape)}", file=file, tensor=tensor)
    check_mxfp4(b_shape, s_shape, tensor=tensor, file=file)


def _mxfp4_cpu(blocks: np.ndarray, scales: np.ndarray, dtype: str, out: str) -> np.ndarray:
    return np.ascontiguousarray(mxfp4_cpu.dequant(blocks, scales, out).transpose(0, 2, 1))


def _mxfp4_cuda(blocks: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, None]:
    from ckpttool.kernels.mxfp4 import dequant_mxfp4

    return dequant_mxfp4(blocks, scales, out_dtype).transpose(1, 2).contiguous(), None  # no NaN: a table gather


def _mxfp4_example(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return (torch.zeros(1, 1, 1, 16, dtype=torch.uint8, device=dev),
            torch.full((1, 1, 1), 127, dtype=torch.uint8, device=dev))


MXFP4 = QuantFormat(
    name="mxfp4", title="MXFP4 (gpt-oss)", weight_suffix="_blocks", scale_suffix="_scales", weight_dtypes=("U8",), scale_dtype="U8",
    check=_check_mxfp4, out_shape=lambda s: (s[0], s[2] * VALUES_PER_BLOCK, s[1]), companion=None,
    row_align=1, scale_rows=lambda r0, r1: (r0, r1), scale_whole=False,
    out_per_source_row=lambda shape: math.prod(shape[1:]) * 2,  # [.., G, 16] bytes -> G * 32 values
    cpu=_mxfp4_cpu, cpu_compiled=False, cuda=_mxfp4_cuda, example=_mxfp4_example,
)
