"""FP8 e4m3 128x128 block (de)quantization: torch on CPU, Triton on CUDA, the same bits.

Dequant is `bf16(float32(w) * scale[i // 128, j // 128])`: one fp32 multiply, one round to
nearest even, on either device. Triton is imported only when a CUDA tensor arrives.
"""

from __future__ import annotations

import numpy as np
import torch

from ckpttool.errors import InputError

BLOCK = 128
FP8_MAX = 448.0
_ROWS_PER_CHUNK = 1024  # bounds the fp32 temporary on CPU to 1024 x N x 4 bytes


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


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                      *, block: int = BLOCK) -> torch.Tensor:
    """Dequantize an FP8 [M, N] weight with its [ceil(M/b), ceil(N/b)] fp32 scale."""
    check_scale(weight.shape, scale.shape, tensor="<weight>", block=block)
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise InputError(f"expected an FP8 weight, got {weight.dtype}")
    scale = scale.to(torch.float32)
    if weight.is_cuda:
        from ckpttool.kernels import fp8_triton

        return fp8_triton.dequant(weight, scale.to(weight.device), out_dtype, block)
    return _dequant_cpu(weight, scale, out_dtype, block)


_VALUE_TABLES: dict[torch.dtype, np.ndarray] = {}


def _values(dtype: torch.dtype) -> np.ndarray:
    """The 256 float32 values an FP8 byte can hold: a gather from this is exact and, on CPU, about
    twice as fast as torch's element-wise fp8 -> fp32 cast."""
    table = _VALUE_TABLES.get(dtype)
    if table is None:
        table = _VALUE_TABLES[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float32).numpy()
    return table


def _dequant_cpu(weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, block: int) -> torch.Tensor:
    rows, cols = weight.shape
    out = torch.empty((rows, cols), dtype=out_dtype)
    table = _values(weight.dtype)
    codes = weight.contiguous().view(torch.uint8).numpy()
    step = max(block, (_ROWS_PER_CHUNK // block) * block)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        x = torch.from_numpy(np.take(table, codes[r0:r1]))  # exact fp32 values of the FP8 codes
        s = scale[r0 // block: -(-r1 // block)]
        if (r1 - r0) % block == 0 and cols % block == 0:
            # one fp32 multiply per element, broadcast over each 128x128 block
            x.view(s.shape[0], block, s.shape[1], block).mul_(s[:, None, :, None])
        else:  # ragged edge: expand the scale to the chunk's shape instead
            x.mul_(s.repeat_interleave(block, dim=0)[: r1 - r0].repeat_interleave(block, dim=1)[:, :cols])
        out[r0:r1] = x
    return out


def quantize_fp8_block(weight: torch.Tensor, *, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16/FP32 [M, N] -> (float8_e4m3fn weight, fp32 scale) with scale = amax / 448 per block.

    An all-zero block gets scale 1.0 rather than the 0/0 NaN of the naive formula.
    """
    rows, cols = weight.shape
    mb, nb = scale_shape((rows, cols), block)
    padded = torch.zeros((mb * block, nb * block), dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.view(mb, block, nb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).view(mb * block, nb * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()
