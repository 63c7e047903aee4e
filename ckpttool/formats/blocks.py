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
from ckpttool.formats.row import BY_ROWS, WHOLE, Chunk, Companion, Name, QuantFormat, Side
from ckpttool.kernels import fp8_cpu, mxfp4_cpu
from ckpttool.kernels.fp8 import BLOCK, FP8_DTYPES, check_scale
from ckpttool.kernels.mxfp4 import VALUES_PER_BLOCK, check_mxfp4

if TYPE_CHECKING:
    import torch

    from ckpttool.kernels.nan_flag import FirstBad


# -- fp8_block ---------------------------------------------------------------------------------------
SCALE_SUFFIX = "_scale_inv"
FP8_SCALE = Companion(hf_leaf="weight" + SCALE_SUFFIX, native_leaf="scale", block=BLOCK)


def _check_fp8(w_shape, sides, names, file) -> None:
    check_scale(w_shape, sides["scale"], tensor=names["scale"], file=file)


def _fp8_cpu(c: Chunk, out: str, into: np.ndarray | None) -> np.ndarray:
    return fp8_cpu.dequant(c.values, c.scale, c.dtype, out, out=into)


def _fp8_cuda(c: Chunk, out_dtype: torch.dtype) -> tuple[torch.Tensor, FirstBad | None]:
    from ckpttool.kernels.fp8 import dequant_fp8_block_lazy

    return dequant_fp8_block_lazy(c.values, c.scale, out_dtype)


def _fp8_example(dev: torch.device) -> Chunk:
    import torch

    return Chunk(torch.zeros(BLOCK, BLOCK, dtype=torch.float8_e4m3fn, device=dev), "F8_E4M3",
                 {"scale": torch.ones(1, 1, device=dev)}, {"scale": "F32"})


FP8_BLOCK = QuantFormat(
    name="fp8_block", title="DeepSeek FP8 128x128 blocks", values=Name("weight"), value_dtypes=FP8_DTYPES,
    sides=(Side("scale", Name(FP8_SCALE.hf_leaf), ("F32",), WHOLE, rows=lambda r0, r1: (r0 // BLOCK, -(-r1 // BLOCK)),
                positive=True),),
    check=_check_fp8, out_shape=lambda shape: shape, companion=FP8_SCALE,
    row_align=BLOCK, out_per_source_row=lambda shape: math.prod(shape[1:]),
    cpu=_fp8_cpu, cpu_into=True, cuda=_fp8_cuda, example=_fp8_example,
)


# -- mxfp4: experts [E, OUT, G, 16] + [E, OUT, G] -> [E, OUT, IN] -> transformers' [E, IN, OUT] -------------
def _check_mxfp4(b_shape, sides, names, file) -> None:
    if len(b_shape) != 4:
        raise InputError(f"MXFP4 expert blocks must be [E, R, G, 16], got {list(b_shape)}", file=file,
                         tensor=names["scale"])
    check_mxfp4(b_shape, sides["scale"], tensor=names["scale"], file=file)


def _mxfp4_cpu(c: Chunk, out: str, into: np.ndarray | None) -> np.ndarray:
    return np.ascontiguousarray(mxfp4_cpu.dequant(c.values, c.scale, out).transpose(0, 2, 1))


def _mxfp4_cuda(c: Chunk, out_dtype: torch.dtype) -> tuple[torch.Tensor, None]:
    from ckpttool.kernels.mxfp4 import dequant_mxfp4

    return dequant_mxfp4(c.values, c.scale, out_dtype).transpose(1, 2).contiguous(), None  # a table gather: no NaN


def _mxfp4_example(dev: torch.device) -> Chunk:
    import torch

    return Chunk(torch.zeros(1, 1, 1, 16, dtype=torch.uint8, device=dev), "U8",
                 {"scale": torch.full((1, 1, 1), 127, dtype=torch.uint8, device=dev)}, {"scale": "U8"})


MXFP4 = QuantFormat(
    name="mxfp4", title="MXFP4 (gpt-oss)", values=Name("_blocks", leaf=False), value_dtypes=("U8",),
    sides=(Side("scale", Name("_scales", leaf=False), ("U8",), read=BY_ROWS, encoding="e8m0"),),
    check=_check_mxfp4, out_shape=lambda s: (s[0], s[2] * VALUES_PER_BLOCK, s[1]),
    out_per_source_row=lambda shape: math.prod(shape[1:]) * 2,  # [.., G, 16] bytes -> G * 32 values
    cpu=_mxfp4_cpu, cpu_compiled=False, cuda=_mxfp4_cuda, example=_mxfp4_example,
)
