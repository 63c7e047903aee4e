"""Triton FP8 block dequant for CUDA. Imported only when a CUDA tensor is dequantized."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4
"""Warps per 128x128 tile; bench/triton_sweep.py measures others (bench/RESULTS.md)."""


@triton.jit
def _dequant_kernel(x_ptr, s_ptr, y_ptr, bad_ptr, M, N, S_COLS, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    pid_m = tl.program_id(axis=0)
    pid_n = tl.program_id(axis=1)
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    if WIDE:  # 64-bit offsets cost address arithmetic: only where M * N needs them
        offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    else:
        offs = offs_m[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    s = tl.load(s_ptr + pid_m * S_COLS + pid_n)
    # NaN codes refused in this pass, not a second one: the first bad row, kept by an atomic that only
    # the lanes holding a NaN issue (predicated off elsewhere: no reduction over the tile)
    rows = offs_m[:, None] + tl.zeros([BLOCK, BLOCK], dtype=tl.int32)
    tl.atomic_min(bad_ptr + tl.zeros([BLOCK, BLOCK], dtype=tl.int32), rows, mask=(x != x) & mask)
    tl.store(y_ptr + offs, (x * s).to(y_ptr.dtype.element_ty), mask=mask)


def dequant(weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, block: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, first_bad): first_bad is a one-element int32 device tensor holding the first row with
    a NaN code, or the row count when there is none. Nothing here waits for the GPU: the caller reads
    first_bad when it needs the result anyway. The caller (kernels.fp8) has checked shapes and dtypes."""
    weight = weight.contiguous()
    scale = scale.contiguous()
    rows, cols = weight.shape
    out = torch.empty((rows, cols), dtype=out_dtype, device=weight.device)
    first_bad = torch.full((1,), rows, dtype=torch.int32, device=weight.device)
    grid = (triton.cdiv(rows, block), triton.cdiv(cols, block))
    _dequant_kernel[grid](weight, scale, out, first_bad, rows, cols, scale.shape[1], BLOCK=block,
                          WIDE=(rows + block) * (cols + block) >= 2**31, num_warps=NUM_WARPS)
    return out, first_bad
