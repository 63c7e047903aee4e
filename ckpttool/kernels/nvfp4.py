"""NVFP4 dequant on CUDA: the CPU's per-tensor pair table (kernels/nvfp4_cpu.py, where the formula is)
copied to the device once per (variant, global scale, dtype), then the MXFP4 gather kernel with 8 bytes
(16 values) per scale. No floating-point arithmetic runs on the device, so its bits are the CPU's."""

from __future__ import annotations

import functools

import torch

from ckpttool.dtypes import dtype_code
from ckpttool.kernels import nvfp4_cpu


@functools.lru_cache(maxsize=32)
def _device_table(variant: str, global_scale: float, out: str, device: torch.device) -> torch.Tensor:
    table = nvfp4_cpu.table(variant, global_scale, out)
    return torch.from_numpy(table.view(table.dtype.str.replace("u", "i"))).to(device)


def dequant_nvfp4_cuda(packed: torch.Tensor, scale: torch.Tensor, variant: str, global_scale: float,
                       out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [M, N/2] and F8_E4M3 scales [M, N/16] on a CUDA device -> ([M, N], first_bad): first_bad is
    the first row whose scales hold a NaN code (M when none), left on the device for the caller."""
    from ckpttool.kernels import mxfp4_triton

    rows, width = packed.shape
    groups = width // nvfp4_cpu.BYTES_PER_GROUP
    codes = scale.view(torch.uint8).reshape(rows, groups)
    table = _device_table(variant, float(global_scale), dtype_code(out_dtype), packed.device)
    words = mxfp4_triton.gather_pairs(packed.reshape(rows, groups, nvfp4_cpu.BYTES_PER_GROUP), codes, table)
    bad = ((codes & 0x7F) == 0x7F).any(dim=1)
    index = torch.arange(rows, device=packed.device, dtype=torch.int32)
    first_bad = torch.where(bad, index, torch.full_like(index, rows)).amin(dim=0, keepdim=True) if rows else \
        torch.zeros(1, dtype=torch.int32, device=packed.device)
    return words.view(out_dtype).reshape(rows, width * 2), first_bad
