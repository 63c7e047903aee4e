"""Triton NVFP4 dequant for CUDA. Imported only when a CUDA tensor is dequantized.

The same IEEE operations as the CPU's table (kernels/nvfp4_cpu.py): each code's exact e2m1 value (built
from its bits) times its group's effective scale (the fp32 of scale code / G, or * S2, computed on the
CPU once per tensor: 256 values), one fp32 multiply, rounded once into the output dtype (bf16 with
integer arithmetic, as the CPU). A NaN scale code makes its row's values NaN: refused via first_bad.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ckpttool.kernels.scaled_triton import Tile, _flag_nan, _round_bf16

TILE = Tile(32, 256, 4)
"""rows x values per program (cols / 2 packed bytes), and warps; bench/triton_sweep.py measures others."""


@triton.jit
def _e2m1_f32(code, SIGNED_ZERO: tl.constexpr):
    """A 4-bit e2m1 code's exact value as fp32, from bits: 0, 0.5, then 2**(e - 1) * (1 + m / 2)."""
    mag = code & 7
    bits = tl.where(mag >= 2, ((126 + (mag >> 1)) << 23) | ((mag & 1) << 22), tl.where(mag == 1, 0x3F000000, 0))
    sign = (code & 8) << 28
    if not SIGNED_ZERO:  # ModelOpt's table holds +0.0 for code 8
        sign = tl.where(mag == 0, 0, sign)
    return (bits | sign).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_kernel(p_ptr, s_ptr, eff_ptr, y_ptr, bad_ptr, M, N, BYTES, GROUPS, SIGNED_ZERO: tl.constexpr,
                  BM: tl.constexpr, BB: tl.constexpr, BF16: tl.constexpr):
    """One program: BM rows x BB packed bytes, kept [BM, BB, 2] (byte, nibble) from load to store: no
    reshape moves values between threads (as kernels/scaled_triton.py's INT4)."""
    rows = tl.program_id(axis=0) * BM + tl.arange(0, BM)
    r64 = rows[:, None].to(tl.int64)
    bcols = tl.program_id(axis=1) * BB + tl.arange(0, BB)
    bmask = (rows[:, None] < M) & (bcols[None, :] < BYTES)
    packed = tl.load(p_ptr + r64 * BYTES + bcols[None, :], mask=bmask, other=0).to(tl.int32)
    codes = tl.join(packed & 15, packed >> 4)  # [BM, BB, 2]: low nibble first
    sc = tl.load(s_ptr + r64 * GROUPS + (bcols // 8)[None, :], mask=bmask, other=0x38).to(tl.int32)  # 8 bytes a group
    eff = tl.load(eff_ptr + sc)  # [BM, BB] fp32: each byte's group scale
    y = _e2m1_f32(codes, SIGNED_ZERO) * eff[:, :, None]
    half = tl.arange(0, 2)
    offs = r64[:, :, None] * N + (bcols[None, :, None] * 2 + half[None, None, :])
    mask = bmask[:, :, None] & (half[None, None, :] < 2)
    _flag_nan(bad_ptr, y, rows[:, None, None], mask)
    if BF16:
        tl.store(y_ptr + offs, _round_bf16(y), mask=mask)
    else:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def dequant(packed: torch.Tensor, codes: torch.Tensor, eff: torch.Tensor, signed_zero: bool,
            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 packed [M, N/2], uint8 scale codes [M, N/16], fp32 effective scales [256] on one device
    -> ([M, N] out_dtype, first_bad). Shapes are checked at plan time (formats/compressed.py)."""
    packed, codes = packed.contiguous(), codes.contiguous()
    rows, width = packed.shape
    out = torch.empty((rows, width * 2), dtype=out_dtype, device=packed.device)
    first_bad = torch.full((1,), rows, dtype=torch.int32, device=packed.device)
    bf16 = out_dtype == torch.bfloat16
    if rows and width:
        bm, bb = TILE.rows, TILE.cols // 2
        grid = (triton.cdiv(rows, bm), triton.cdiv(width, bb))
        _nvfp4_kernel[grid](packed, codes, eff, out.view(torch.int16) if bf16 else out, first_bad, rows, width * 2,
                            width, codes.shape[1], SIGNED_ZERO=signed_zero, BM=bm, BB=bb, BF16=bf16,
                            num_warps=TILE.warps)
    return out, first_bad
