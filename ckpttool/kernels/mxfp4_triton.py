"""Triton MXFP4 dequant for CUDA. Imported only when a CUDA tensor is dequantized.

The kernel does no floating-point arithmetic: each byte of blocks and its row's e8m0 scale index
the same precomputed pair table the CPU path uses (see ckpttool.kernels.mxfp4), so its output bits
equal the CPU's by construction.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_ROWS_PER_PROGRAM = 64  # 64 rows x 16 bytes = 1 KiB of blocks in, 64 x 16 words out per program


@triton.jit
def _gather_pairs_kernel(blocks_ptr, scales_ptr, table_ptr, words_ptr, n_rows, ROWS: tl.constexpr,
                         BYTES: tl.constexpr):
    rows = tl.program_id(axis=0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BYTES)
    row_ok = rows < n_rows
    offs = rows[:, None] * BYTES + cols[None, :]
    mask = row_ok[:, None]
    byte = tl.load(blocks_ptr + offs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(scales_ptr + rows, mask=row_ok, other=0).to(tl.int32)
    idx = (scale[:, None] << 8) | byte
    words = tl.load(table_ptr + idx, mask=mask, other=0)
    tl.store(words_ptr + offs, words, mask=mask)


def gather_pairs(blocks: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """words[r, j] = table[scales[r] << 8 | blocks[r, j]] over rows = prod(scales.shape).

    The caller (kernels.mxfp4.dequant_mxfp4) has checked shapes, dtypes and devices.
    """
    rows = math.prod(scales.shape)
    blocks = blocks.contiguous()
    scales = scales.contiguous()
    table = table.to(blocks.device)
    words = torch.empty((rows, blocks.shape[-1]), dtype=table.dtype, device=blocks.device)
    if rows == 0:
        return words
    grid = (triton.cdiv(rows, _ROWS_PER_PROGRAM),)
    _gather_pairs_kernel[grid](blocks, scales, table, words, rows, ROWS=_ROWS_PER_PROGRAM,
                               BYTES=blocks.shape[-1])
    return words
