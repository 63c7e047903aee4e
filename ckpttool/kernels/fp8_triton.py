"""Triton FP8 block dequant for CUDA. Imported only when a CUDA tensor is dequantized."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ckpttool.kernels import nan_flag

NUM_WARPS = 8
"""Warps per 128x128 tile; bench/probes/triton_sweep.py and bench/probes/nan_variants.py measure others (bench/HISTORY.md)."""


@triton.jit(do_not_specialize=["slot", "tag"])
def _dequant_kernel(x_ptr, s_ptr, y_ptr, bad_ptr, slot, tag, M, N, S_COLS, BLOCK: tl.constexpr, WIDE: tl.constexpr):
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
    # NaN codes refused in this pass, not a second one: each row's NaN test reduced along the row, then one
    # atomic per row, issued only for a row holding one, into this call's cell (kernels/nan_flag.py: no
    # fill launched before). An atomic per value, predicated, ran at 0.80x DeepSeek's kernel on [7168, 2048]
    # (bench/probes/nan_variants.py); this, with 8 warps, at 0.99x, and 1.00x on [7168, 18432].
    hit = tl.max(((x != x) & mask).to(tl.int32), axis=1)
    tl.atomic_max(bad_ptr + slot + tl.zeros([BLOCK], dtype=tl.int32), tag - offs_m.to(tl.int64), mask=hit > 0)
    tl.store(y_ptr + offs, (x * s).to(y_ptr.dtype.element_ty), mask=mask)


def dequant(weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, block: int
            ) -> tuple[torch.Tensor, nan_flag.FirstBad]:
    """(output, first_bad): first_bad records the first row holding a NaN code (kernels/nan_flag.py).
    Nothing here waits for the GPU: the caller reads first_bad when it needs the result anyway. The
    caller (kernels.fp8) has checked shapes and dtypes."""
    weight = weight.contiguous()
    scale = scale.contiguous()
    rows, cols = weight.shape
    out = torch.empty((rows, cols), dtype=out_dtype, device=weight.device)
    grid = (triton.cdiv(rows, block), triton.cdiv(cols, block))

    def run(y: torch.Tensor, bad: nan_flag.FirstBad) -> None:
        _dequant_kernel[grid](weight, scale, y, bad.flags, bad.slot, bad.tag, rows, cols, scale.shape[1],
                              BLOCK=block, WIDE=(rows + block) * (cols + block) >= 2**31, num_warps=NUM_WARPS)

    return out, nan_flag.launched(out, run)
