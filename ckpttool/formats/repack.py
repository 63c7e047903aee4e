"""Exact repacks, as rows the executor runs like a dequant: a quantized weight's stored values and sides in, the
codes (or the scales) of another quantized format out, never a rounded value (kernels/repack.py says why each
value is exact, and refuses the block where one is not).

A repack of weight X makes two tensors from the same stored values, each a row of its own:
  repack:codes:{b0}x{b1}:{source row}             X.weight F8_E4M3, the source's dequantized shape, streamed in runs
                                                  of b0 rows (a block's rows are all in one run)
  repack:scale:{b0}x{b1}:{source row}@{tensor}    X.<scale leaf> E8M0 [ceil(N/b0), ceil(K/b1)], one run over the
                                                  whole tensor: it checks every value, and names the tensor
                                                  (from the row's name) and the block it refuses
`SOURCES` lists the source rows a repack reads (MXFP4 stored by rows: DeepSeek-V4's experts); each output row
keeps its source's values and sides, so the planner's sides and the executor's reads are the source's own.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Callable

import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats.blocks import mxfp4_experts_row
from ckpttool.formats.row import WHOLE, Chunk, QuantFormat
from ckpttool.kernels import repack

SOURCES: dict[str, Callable[[str], QuantFormat]] = {"mxfp4_experts": mxfp4_experts_row}
"""the source rows whose weights repack into FP8 blocks (MXFP4 [N, K/2] + E8M0 [N, K/32] by rows), by the kind
their names begin with, each rebuilt from its name's parameters"""
WHOLE_TENSOR = 1 << 40
"""row_align of the scale row: one run covers every row, so block indices it reports are the tensor's"""


def repackable(row: QuantFormat) -> bool:
    return row.name.partition(":")[0] in SOURCES


def _source(name: str) -> QuantFormat:
    kind, _, args = name.partition(":")
    return SOURCES[kind](args)


def _values(c: Chunk) -> np.ndarray:
    return repack.mxfp4_values(np.asarray(c.values), np.asarray(c.scale))


def _via_cpu(cpu):
    """CUDA: the same bits through the CPU kernel (a repack moves bytes; it has no arithmetic worth a GPU)."""
    def run(c: Chunk, out_dtype):
        import torch

        host = Chunk(c.values.cpu().numpy(), c.dtype, {k: v.cpu().numpy() for k, v in c.sides.items()},
                     c.side_dtypes, c.global_scale)
        out = cpu(host, "", None)
        return torch.from_numpy(out).to(c.values.device), None
    return run


@functools.lru_cache(maxsize=None)
def codes_row(b0: int, b1: int, source: str) -> QuantFormat:
    src = _source(source)
    block = (b0, b1)

    def cpu(c: Chunk, out: str, into) -> np.ndarray:
        values = _values(c)
        try:
            return repack.fp8_codes(values, repack.block_exponents(values, block), block)
        except repack.Inexact:  # the scale row, which sees the whole tensor, names the tensor and block
            return np.zeros(values.shape, dtype=np.uint8)

    return replace(src, name=f"repack:codes:{b0}x{b1}:{source}", title=f"{src.title} -> FP8 {b0}x{b1} (exact)",
                   row_align=b0, cpu=cpu, cpu_into=False, cuda=_via_cpu(cpu), keepable=False, companion=None)


@functools.lru_cache(maxsize=None)
def scale_row(b0: int, b1: int, source: str, tensor: str) -> QuantFormat:
    src = _source(source)
    block = (b0, b1)

    def cpu(c: Chunk, out: str, into) -> np.ndarray:
        values = _values(c)
        exps = repack.block_exponents(values, block)
        try:
            repack.fp8_codes(values, exps, block)
        except repack.Inexact as exc:
            raise InputError(f"cannot repack exactly: {exc}", tensor=tensor,
                             fix="keep this weight in its format (or dequantize it to BF16); ckpttool never rounds "
                                 "a value in a repack") from None
        return (exps + 127).astype(np.uint8)

    sides = tuple(replace(s, read=WHOLE, rows=lambda r0, r1: (r0 * b0, r1 * b0)) for s in src.sides)
    return replace(src, name=f"repack:scale:{b0}x{b1}:{source}@{tensor}", title=f"{src.title} -> E8M0 {b0}x{b1} scales",
                   sides=sides, out_shape=lambda s: scale_shape(src.out_shape(s), block), row_align=WHOLE_TENSOR,
                   source_span=lambda r0, r1, shape: (0, r0 * b0, min(r1 * b0, shape[0])), cpu=cpu, cpu_into=False,
                   cuda=_via_cpu(cpu), keepable=False, companion=None)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def named(name: str) -> QuantFormat | None:
    """The row a plan's transform name stands for."""
    kind, _, rest = name.partition(":")
    if kind != "repack":
        return None
    part, _, rest = rest.partition(":")
    size, _, source = rest.partition(":")
    b0, _, b1 = size.partition("x")
    if not (b0.isdigit() and b1.isdigit() and int(b0) > 0 and int(b1) > 0) or \
            source.partition("@")[0].partition(":")[0] not in SOURCES:
        return None
    if part == "codes":
        return codes_row(int(b0), int(b1), source)
    source, at, tensor = source.partition("@")
    return scale_row(int(b0), int(b1), source, tensor) if part == "scale" and at else None
