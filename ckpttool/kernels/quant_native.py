"""The quantize stage's C loops (kernels/native/quant.c): compressed-tensors' pack-quantized INT4/INT8 of BF16 rows,
the bits of kernels/quant_ct.py's torch operations (tests/test_quantize_native.py holds every group to them), at
several times their rate (bench/RESULTS.md "quantize"). Used where the library is built and the weight is BF16 on
the CPU; otherwise, and for an asymmetric group whose range is 0 (the library divides 0 by 0 there), torch runs.
The C code checks nothing: this wrapper checks dtypes, shapes and strides first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ckpttool.kernels import native

if TYPE_CHECKING:
    import torch

MAX_GROUP = 256  # the C loop's group buffer


def usable(w: torch.Tensor, group: int) -> bool:
    import torch

    return (w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2 and 0 < group <= MAX_GROUP
            and w.shape[1] % group == 0 and native.library() is not None)


def int_group_bf16(w: torch.Tensor, group: int, bits: int, symmetric: bool, codes: bool = True):
    """(packed int32 [M, N * bits / 32] (None without `codes`), BF16 scale [M, N / group], int8 zero [M, N / group]
    or None), or None where some asymmetric group has range 0 (torch then computes the weight)."""
    import torch

    if bits not in (4, 8) or group % (32 // bits) or not usable(w, group):
        raise ValueError(f"int_group_bf16: a 2-D CPU BF16 weight with {group}-column groups, bits 4 or 8, not "
                         f"{w.dtype} {list(w.shape)} on {w.device}, bits {bits}")
    rows, cols = w.shape
    src = np.ascontiguousarray(w.view(torch.int16).numpy()).view(np.uint16)
    packed = np.empty((rows, cols * bits // 32) if codes else (0, 0), dtype=np.uint32)
    scale = np.empty((rows, cols // group), dtype=np.uint16)
    zero = np.empty((rows, cols // group), dtype=np.int8)
    bad = native.library().ckpttool_quant_int_bf16(
        src.ctypes.data, cols, rows, cols, group, bits, int(symmetric), packed.ctypes.data if codes else None,
        packed.shape[1],
        scale.ctypes.data, scale.shape[1], zero.ctypes.data, zero.shape[1])
    if bad >= 0:
        return None
    return (torch.from_numpy(packed.view(np.int32)) if codes else None, torch.from_numpy(scale.view(np.int16)).view(torch.bfloat16),
            None if symmetric else torch.from_numpy(zero))
