"""NVFP4 dequant on CUDA (kernels/nvfp4_triton.py): the effective block scales of one tensor (256 fp32
values, kernels/nvfp4_cpu.block_scales: the CPU's own division or multiplication) are computed once on
the CPU and copied to the device; the kernel multiplies each e2m1 value by its group's, as the CPU's
table does (where the formula is written down)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from ckpttool.kernels import nvfp4_cpu
from ckpttool.kernels.nan_flag import FirstBad


PRESCALE = np.float32(2**14)
"""the kernel's e2m1 values come 2**-14 times too small (nvfp4_triton._e2m1_f32); the scales carry it"""


@functools.lru_cache(maxsize=64)
def _device_scales(variant: str, global_scale: float, device: torch.device) -> tuple[torch.Tensor, bool]:
    """The 256 effective scales on the device, times 2**14 unless that would overflow one (then the kernel
    multiplies each value by 2**14 itself). A power of two: the product with the kernel's value is exact."""
    eff = nvfp4_cpu.block_scales(variant, global_scale)
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = eff * PRESCALE
    prescaled = bool(np.array_equal(np.isfinite(scaled), np.isfinite(eff)))
    return torch.from_numpy((scaled if prescaled else eff).copy()).to(device), prescaled


def dequant_nvfp4_cuda(packed: torch.Tensor, scale: torch.Tensor, variant: str, global_scale: float,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, FirstBad]:
    """uint8 [M, N/2] and F8_E4M3 scales [M, N/16] on a CUDA device -> ([M, N], first_bad): first_bad
    records the first row whose scales hold a NaN code (kernels/nan_flag.py), for the caller to read."""
    from ckpttool.kernels import nvfp4_triton

    eff, prescaled = _device_scales(variant, float(global_scale), packed.device)
    return nvfp4_triton.dequant(packed, scale.view(torch.uint8), eff, variant == "compressed-tensors", out_dtype,
                                prescaled)
