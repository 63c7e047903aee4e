"""The quantize stage's C loops (kernels/native/quant.c): compressed-tensors' pack-quantized INT4/INT8, NVFP4 and
MXFP4 of BF16 rows,
the bits of kernels/quant_ct.py's torch operations (tests/test_quantize_native.py holds every group to them), at
several times their rate (bench/RESULTS.md "quantize"). Used where the library is built and the weight is BF16 on
the CPU; otherwise, and for an asymmetric group whose range is 0 (the library divides 0 by 0 there), torch runs.
The C code checks nothing: this wrapper checks dtypes, shapes and strides first."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ckpttool.kernels import native, quant_ct

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


def fp4_bf16(w: torch.Tensor, mx: bool, global_scale: float = 1.0, codes: bool = True):
    """(packed E2M1 bytes [M, N / 2] (None without `codes`), scale bytes [M, N / group]: NVFP4's e4m3 codes (group
    16, under `global_scale`) or MXFP4's E8M0 (group 32))."""
    import torch

    group = 32 if mx else 16
    if not usable(w, group):
        raise ValueError(f"fp4_bf16: a 2-D CPU BF16 weight with {group}-column groups, not {w.dtype} "
                         f"{list(w.shape)} on {w.device}")
    rows, cols = w.shape
    src = np.ascontiguousarray(w.view(torch.int16).numpy()).view(np.uint16)
    packed = np.empty((rows, cols // 2) if codes else (0, 0), dtype=np.uint8)
    scale = np.empty((rows, cols // group), dtype=np.uint8)
    native.library().ckpttool_quant_fp4_bf16(src.ctypes.data, cols, rows, cols, int(mx), float(global_scale),
                                             packed.ctypes.data if codes else None, packed.shape[1],
                                             scale.ctypes.data, scale.shape[1])
    return torch.from_numpy(packed) if codes else None, torch.from_numpy(scale)


def int_outputs(w: torch.Tensor, leaf: str | None, bits: int, symmetric: bool) -> dict | None:
    """formats/outputs.py's pack-quantized outputs by leaf (every one, or `leaf`'s: a scale's task computes no codes)
    from the C loops; None where torch computes them (not BF16 on the CPU, no library, a range-0 asymmetric group)."""
    import torch

    if not usable(w, 128):
        return None
    got = int_group_bf16(w, 128, bits, symmetric, codes=leaf in (None, "weight_packed"))
    if got is None:
        return None
    packed, scale, zero = got
    out = {"weight_packed": packed, "weight_scale": scale,
           "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if not symmetric and leaf in (None, "weight_zero_point"):
        out["weight_zero_point"] = quant_ct.pack_to_int32(zero, bits, packed_dim=0)
    return out if leaf is None else {leaf: out[leaf]}


def fp4_outputs(w: torch.Tensor, leaf: str | None, mx: bool, global_scale=None) -> dict | None:
    """formats/outputs.py's NVFP4 (under `global_scale`, a float32 [1] tensor) or MXFP4 outputs by leaf from the C
    loops; None where torch computes them."""
    import torch

    if leaf not in (None, "weight_packed", "weight_scale") or not usable(w, 32 if mx else 16):
        return None
    packed, code = fp4_bf16(w, mx, 1.0 if mx else float(global_scale), codes=leaf != "weight_scale")
    if mx and bool((code == 255).any()):
        return None  # a scale of 2**128 (a group near BF16's largest): torch writes what its int cast of inf gives
    out = {"weight_packed": packed, "weight_scale": code if mx else code.view(torch.float8_e4m3fn)}
    if not mx:
        out["weight_global_scale"] = global_scale
    return out if leaf is None else {leaf: out[leaf]}
