"""FP8 e4m3 128x128 block (de)quantization: numpy on CPU, Triton on CUDA, the same bits.

Dequant is `bf16(float32(w) * scale[i // 128, j // 128])`: one fp32 multiply, one round to
nearest even, on either device (the CPU kernel is numpy: kernels/fp8_cpu.py). Triton is imported
only when a CUDA tensor arrives, and torch only when one of these functions is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpttool.errors import InputError
from ckpttool.dtypes import dtype_code, torch_dtype
from ckpttool.kernels.fp8_cpu import BLOCK, OUT_DTYPES, NaNCodes, dequant as _dequant_cpu

if TYPE_CHECKING:
    import torch

    from ckpttool.kernels.nan_flag import FirstBad

FP8_MAX = 448.0
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")


def scale_shape(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, int]:
    rows, cols = shape
    return (-(-rows // block), -(-cols // block))


def check_scale(weight_shape, scale_shape_, *, tensor: str, file: object = None, block: int = BLOCK) -> None:
    """A mis-shaped scale is an error naming the tensor, never a silent broadcast."""
    if len(weight_shape) != 2:
        raise InputError(f"FP8 block weight must be 2-D, got shape {list(weight_shape)}", file=file, tensor=tensor)
    want = scale_shape(tuple(weight_shape), block)
    if tuple(scale_shape_) != want:
        raise InputError(
            f"scale shape {list(scale_shape_)} does not match weight shape {list(weight_shape)}: "
            f"expected {list(want)} for {block}x{block} blocks",
            file=file, tensor=tensor, fix="re-download the checkpoint; the scale does not belong to this weight",
        )


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None,
                      *, block: int = BLOCK) -> torch.Tensor:
    """Dequantize an FP8 [M, N] weight with its [ceil(M/b), ceil(N/b)] fp32 scale (to bf16 by default).
    NaN codes are an error (NaNCodes, naming the first bad row) on either device."""
    y, first_bad = dequant_fp8_block_lazy(weight, scale, out_dtype, block=block)
    if first_bad is not None and (row := first_bad.row()) is not None:
        raise NaNCodes(row)
    return y


def dequant_fp8_block_lazy(weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype | None = None,
                           *, block: int = BLOCK) -> tuple[torch.Tensor, FirstBad | None]:
    """`dequant_fp8_block` without waiting for the GPU: on CUDA, returns (output, first_bad), the record of
    the first row holding a NaN code (kernels/nan_flag.py) for the caller to read when it synchronizes
    anyway, on the same device and stream and before it changes `weight` (first_bad holds the inputs and
    the output until then); on the CPU the check has run (first_bad is None)."""
    import torch

    out_dtype = out_dtype or torch.bfloat16
    check_scale(weight.shape, scale.shape, tensor="<weight>", block=block)
    fmt = dtype_code(weight.dtype)
    if fmt not in FP8_DTYPES:
        raise InputError(f"expected an FP8 weight, got {weight.dtype}")
    if scale.dtype != torch.float32:  # each no-op .to() is a microsecond or two of a small tensor's call
        scale = scale.float()
    if weight.is_cuda:
        from ckpttool.kernels import fp8_triton

        if scale.device != weight.device:
            scale = scale.to(weight.device)
        return fp8_triton.dequant(weight, scale, out_dtype, block)
    out = dtype_code(out_dtype)
    if out not in OUT_DTYPES:
        raise InputError(f"FP8 dequant writes one of {[str(torch_dtype(c)) for c in OUT_DTYPES]}, not {out_dtype}")
    y = _dequant_cpu(weight.contiguous().view(torch.uint8).numpy(), scale.contiguous().numpy(), fmt, out,
                     block=block)
    return torch.from_numpy(y).view(out_dtype), None


def quantize_fp8_block(weight: torch.Tensor, *, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16/FP32 [M, N] -> (float8_e4m3fn weight, fp32 scale) with scale = amax / 448 per block.

    An all-zero block gets scale 1.0 rather than the 0/0 NaN of the naive formula.
    """
    import torch

    rows, cols = weight.shape
    mb, nb = scale_shape((rows, cols), block)
    padded = torch.zeros((mb * block, nb * block), dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.view(mb, block, nb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).view(mb * block, nb * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()
