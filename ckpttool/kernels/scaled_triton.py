"""Triton kernels for compressed-tensors' INT4 (`pack-quantized`) and FP8 (`float-quantized`) dequant.
Imported only when a CUDA tensor is dequantized. The same IEEE operations as kernels/scaled_cpu.py: the
code's exact value times its fp32 scale (one multiply, no fused add), rounded once into the output
dtype; a NaN result is refused through `first_bad` (kernels/nan_flag.py), as kernels/fp8_triton.py does."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ckpttool.kernels import nan_flag


class Tile(NamedTuple):
    """One program's share of the output: rows x values, and the warps that run it."""
    rows: int
    cols: int
    warps: int


TILES = {"int4": Tile(4, 256, 2), "fp8_rows": Tile(16, 256, 4)}
"""Per kernel; bench/probes/triton_sweep.py measures the alternatives (bench/HISTORY.md)."""


@triton.jit
def _flag_nan(bad_ptr, slot, tag, y, rows, mask):
    """Record every row holding a NaN in this call's cell, bad_ptr[slot] (kernels/nan_flag.py: the largest
    `tag - row` wins, the smallest row): lanes without one issue no atomic. rows and mask broadcast to y's
    shape. Not the FP8 block kernel's row reduction: here it held INT4 and NVFP4 at 0.60-0.82x FP8 block's
    bandwidth (bench/HISTORY.md)."""
    r = rows.to(tl.int64) + tl.zeros_like(y).to(tl.int64)
    tl.atomic_max(bad_ptr + slot + tl.zeros_like(y).to(tl.int32), tag - r, mask=(y != y) & mask)


@triton.jit
def _bf16_bits_to_f32(bits):
    """bf16 bits (int16) -> their exact fp32 value, by moving the bits: no conversion instruction whose
    handling of subnormals could differ from numpy's."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round_bf16(y):
    """fp32 -> bf16 bits (int16), round to nearest even with integer arithmetic on the fp32 bits, as
    kernels/fp8_cpu.round_to_bf16 does (NaN is refused before it matters)."""
    u = y.to(tl.int32, bitcast=True)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _store_checked(y_ptr, bad_ptr, slot, tag, y, offs, rows, mask, BF16: tl.constexpr):
    """Refuse NaN rows (first_bad), then store y: bf16 rounded by _round_bf16, else y_ptr's dtype."""
    _flag_nan(bad_ptr, slot, tag, y, rows, mask)
    if BF16:
        tl.store(y_ptr + offs, _round_bf16(y), mask=mask)
    else:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["slot", "tag"])
def _int4_kernel(w_ptr, s_ptr, y_ptr, bad_ptr, slot, tag, M, N, WORDS, S_COLS, GROUP: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BF16: tl.constexpr):
    """One program: BM rows x BN values, from BM x BN/8 words (each loaded once) and each word's group
    scale. Values stay [BM, BN/8, 8] (word, nibble) from load to store: a reshape to [BM, BN] moved them
    between threads and held the kernel at 0.82x FP8 block's bandwidth (bench/HISTORY.md)."""
    rows = tl.program_id(axis=0) * BM + tl.arange(0, BM)
    r64 = rows[:, None].to(tl.int64)
    wcols = tl.program_id(axis=1) * (BN // 8) + tl.arange(0, BN // 8)
    wmask = (rows[:, None] < M) & (wcols[None, :] < WORDS)
    words = tl.load(w_ptr + r64 * WORDS + wcols[None, :], mask=wmask, other=0)
    s = _bf16_bits_to_f32(tl.load(s_ptr + r64 * S_COLS + (wcols // (GROUP // 8))[None, :], mask=wmask, other=0))
    nibble = tl.arange(0, 8)
    # value 8w + k is bits 4k..4k+3 of word w, biased by 8
    q = ((words[:, :, None] >> (nibble * 4)[None, None, :]) & 15) - 8
    y = q.to(tl.float32) * s[:, :, None]
    offs = r64[:, :, None] * N + (wcols[None, :, None] * 8 + nibble[None, None, :])
    mask = wmask[:, :, None] & (nibble[None, None, :] < 8)
    _store_checked(y_ptr, bad_ptr, slot, tag, y, offs, rows[:, None, None], mask, BF16)


@triton.jit(do_not_specialize=["slot", "tag"])
def _fp8_rows_kernel(x_ptr, s_ptr, y_ptr, bad_ptr, slot, tag, M, N, S_STRIDE, BM: tl.constexpr, BN: tl.constexpr,
                     BF16: tl.constexpr):
    rows = tl.program_id(axis=0) * BM + tl.arange(0, BM)
    cols = tl.program_id(axis=1) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = _bf16_bits_to_f32(tl.load(s_ptr + rows * S_STRIDE, mask=rows < M, other=0))
    y = x * s[:, None]
    _store_checked(y_ptr, bad_ptr, slot, tag, y, offs, rows[:, None], mask, BF16)


def _launch(kernel, tile: Tile, rows: int, cols: int, out_dtype: torch.dtype, device, *args, **consts):
    out = torch.empty((rows, cols), dtype=out_dtype, device=device)
    bf16 = out_dtype == torch.bfloat16
    grid = (triton.cdiv(rows, tile.rows), triton.cdiv(cols, tile.cols))

    def run(y: torch.Tensor, bad: nan_flag.FirstBad) -> None:
        if rows and cols:
            kernel[grid](*args[:2], y.view(torch.int16) if bf16 else y, bad.flags, bad.slot, bad.tag, rows, cols,
                         *args[2:], BM=tile.rows, BN=tile.cols, BF16=bf16, num_warps=tile.warps, **consts)

    return out, nan_flag.launched(out, run)


def dequant_int4(packed: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, nan_flag.FirstBad]:
    """int32 [M, N/8] and bf16 group scales [M, G] -> ([M, N] out_dtype, first_bad). Shapes are checked at
    plan time (formats/compressed.py)."""
    packed, scale = packed.contiguous(), scale.contiguous().view(torch.int16)
    rows, words = packed.shape
    cols = words * 8
    return _launch(_int4_kernel, TILES["int4"], rows, cols, out_dtype, packed.device, packed, scale, words, scale.shape[1],
                   GROUP=cols // max(scale.shape[1], 1))


def dequant_fp8_rows(codes: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
                     ) -> tuple[torch.Tensor, nan_flag.FirstBad]:
    """float8 [M, N] and a scale per row ([M, 1]) or per tensor ([1]) -> ([M, N] out_dtype, first_bad)."""
    codes, scale = codes.contiguous(), scale.contiguous().view(torch.int16).reshape(-1)
    rows, cols = codes.shape
    return _launch(_fp8_rows_kernel, TILES["fp8_rows"], rows, cols, out_dtype, codes.device, codes, scale,
                   1 if scale.numel() == rows and rows != 1 else 0)
