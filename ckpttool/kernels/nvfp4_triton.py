"""Triton NVFP4 dequant for CUDA. Imported only when a CUDA tensor is dequantized.

The same IEEE operations as the CPU's table (kernels/nvfp4_cpu.py): each code's exact e2m1 value (built
from its bits) times its group's effective scale (the fp32 of scale code / G, or * S2, computed on the
CPU once per tensor: 256 values), one fp32 multiply, rounded once into the output dtype (bf16 with
integer arithmetic, as the CPU). The kernel's value may be 2**-14 times the e2m1 value against a scale
2**14 times larger: the same real product, so the same rounding. A NaN scale code makes its row's
values NaN: refused via first_bad.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ckpttool.kernels import nan_flag
from ckpttool.kernels.scaled_triton import Tile, _store_checked

TILE = Tile(2, 512, 2)
"""rows x values per program (cols / 2 packed bytes), and warps; bench/probes/triton_sweep.py measures others
(on the H100 with the fp16 decode: 1750 GB/s out on [7168, 18432], 4 x 256 x 2 gave 1638, FP8 block 1687)."""


@triton.jit
def _e2m1_f32(code, PRESCALED: tl.constexpr):
    """A 4-bit e2m1 code's exact value as fp32 (code 8 is -0.0), times 2**-14 when PRESCALED (the scales
    carry the 2**14). The code's magnitude bits placed as fp16's top exponent and mantissa bits are that
    fp16's own (0.5 a subnormal), 2**-14 times the e2m1 value; widening fp16 -> fp32 is exact. Five integer
    operations and one conversion: decoding the exponent from bits took 14 and held the kernel at 0.76x FP8
    block's bandwidth (bench/HISTORY.md)."""
    h = ((code & 7) << 9) | ((code & 8) << 12)
    v = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if not PRESCALED:
        v = v * 16384.0
    return v


@triton.jit
def _unsigned_zero(words):
    """ModelOpt's table holds +0.0 for code 8, where compressed-tensors' e2m1 has -0.0: every nibble 8 of
    an int32 word of codes becomes 0 (so its product with any scale is what 0.0 * scale is) and 9..15 keep
    their sign. Per word, not per value: each nibble's magnitude + 7 carries into its bit 3 exactly when the
    magnitude is not 0 (7 + 7 < 16: no carry reaches the next nibble; the top nibble's wraps the int32 as
    the unsigned sum would). Five operations per 8 values; the same per value held the kernel at 0.86-0.94x
    FP8 block's bandwidth (bench/HISTORY.md)."""
    mag = words & 0x77777777
    sign = (mag + 0x77777777) & words & -0x77777778  # -0x77777778 is 0x88888888: each nibble's bit 3
    return mag | sign


@triton.jit(do_not_specialize=["slot", "tag"])
def _nvfp4_kernel(w_ptr, s_ptr, eff_ptr, y_ptr, bad_ptr, slot, tag, M, N, WORDS, GROUPS, SIGNED_ZERO: tl.constexpr,
                  PRESCALED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BF16: tl.constexpr):
    """One program: BM rows x BN values, read as BM x BN/8 little-endian int32 words of packed bytes (value
    8w + k is bits 4k..4k+3 of word w: each byte's low nibble first) and each word's group scale (16 values,
    2 words, a group). Values stay [BM, BN/8, 8] from load to store, as kernels/scaled_triton.py's INT4:
    bytes split with tl.join ran at 0.66x FP8 block's bandwidth, a reshape to [BM, BN] at 0.49-0.83x
    (bench/HISTORY.md)."""
    rows = tl.program_id(axis=0) * BM + tl.arange(0, BM)
    r64 = rows[:, None].to(tl.int64)
    wcols = tl.program_id(axis=1) * (BN // 8) + tl.arange(0, BN // 8)
    wmask = (rows[:, None] < M) & (wcols[None, :] < WORDS)
    words = tl.load(w_ptr + r64 * WORDS + wcols[None, :], mask=wmask, other=0)
    sc = tl.load(s_ptr + r64 * GROUPS + (wcols // 2)[None, :], mask=wmask, other=0x38).to(tl.int32)
    eff = tl.load(eff_ptr + sc)  # [BM, BN/8] fp32: each word's group scale
    if not SIGNED_ZERO:
        words = _unsigned_zero(words)
    nibble = tl.arange(0, 8)
    codes = (words[:, :, None] >> (nibble * 4)[None, None, :]) & 15
    y = _e2m1_f32(codes, PRESCALED) * eff[:, :, None]
    offs = r64[:, :, None] * N + (wcols[None, :, None] * 8 + nibble[None, None, :])
    mask = wmask[:, :, None] & (nibble[None, None, :] < 8)
    _store_checked(y_ptr, bad_ptr, slot, tag, y, offs, rows[:, None, None], mask, BF16)


def dequant(packed: torch.Tensor, codes: torch.Tensor, eff: torch.Tensor, signed_zero: bool,
            out_dtype: torch.dtype, prescaled: bool = False) -> tuple[torch.Tensor, nan_flag.FirstBad]:
    """uint8 packed [M, N/2], uint8 scale codes [M, N/16], fp32 effective scales [256] on one device
    (times 2**14 when `prescaled`: see _e2m1_f32) -> ([M, N] out_dtype, first_bad). Shapes are checked at
    plan time (formats/compressed.py: N is a multiple of 16, so each row is whole int32 words)."""
    packed, codes = packed.contiguous(), codes.contiguous()
    if packed.data_ptr() % 4:  # a view at an odd offset: words need 4-byte alignment
        packed = packed.clone()
    rows, width = packed.shape
    out = torch.empty((rows, width * 2), dtype=out_dtype, device=packed.device)
    bf16 = out_dtype == torch.bfloat16
    grid = (triton.cdiv(rows, TILE.rows), triton.cdiv(width * 2, TILE.cols))

    def run(y: torch.Tensor, bad: nan_flag.FirstBad) -> None:
        if rows and width:
            _nvfp4_kernel[grid](packed.view(torch.int32), codes, eff, y.view(torch.int16) if bf16 else y, bad.flags,
                                bad.slot, bad.tag, rows, width * 2, width // 4, codes.shape[1], SIGNED_ZERO=signed_zero,
                                PRESCALED=prescaled, BM=TILE.rows, BN=TILE.cols, BF16=bf16, num_warps=TILE.warps)

    return out, nan_flag.launched(out, run)
