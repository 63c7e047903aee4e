"""Exact repacks, as rows the executor runs like a dequant: a quantized weight's stored values and sides in, the
codes (or the scales) of FP8 blocks out, never a rounded value (kernels/repack.py says why each value is exact,
and refuses the block where one is not).

A repack of weight X into FP8 b0 x b1 blocks makes two tensors from the same stored values, each a row of its own:
  repack:codes:{b0}x{b1}:{source row}             X.weight F8_E4M3, the source's dequantized shape, streamed in runs
                                                  of whole source and target blocks
  repack:scale:{b0}x{b1}:{source row}@{tensor}    the scale [ceil(N/b0), ceil(K/b1)] in the source scale's dtype, one
                                                  run over the whole tensor: it checks every value, and names the
                                                  tensor (from the row's name) and the block it refuses
`SOURCES` lists the source rows a repack reads; each output row keeps its source's values and sides, so the
planner's sides and the executor's reads are the source's own:
  mxfp4_experts   DeepSeek-V4's MXFP4 experts: E2M1 + E8M0 per 32 -> power-of-two scales (ue8m0)
  mxfp4           gpt-oss's stacked MXFP4 experts X_blocks [E, R, G, 16] + X_scales [E, R, G] -> X F8_E4M3
                  [E, R, G*32] + X_scale_inv F8_E8M0 [E, ceil(R/b0), ceil(G*32/b1)], each expert its own blocks, in
                  the stored (output-rows) orientation transformers' FP8Experts allocates; formats/fp8_experts.py
                  reads them back
  fp8_block       FP8 blocks of another size: E8M0 (or power-of-two F32) scales -> each new block's ue8m0 scale
                  from its exact values; float scales -> the largest source scale the new block covers, the codes
                  rescaled by powers of two (splitting 128x128 into 32x32: the same codes, the scale repeated)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats.blocks import FP8_BLOCK, MXFP4, mxfp4_experts_row
from ckpttool.formats.fp8_experts import EXPERTS_SCALE
from ckpttool.formats.fp8 import block_row
from ckpttool.formats.compressed import CT_NVFP4
from ckpttool.formats.modelopt import MODELOPT_NVFP4
from ckpttool.formats.row import WHOLE, Chunk, Name, QuantFormat, Side, via_cpu
from ckpttool.kernels import repack

WHOLE_TENSOR = 1 << 40
"""row_align of the scale row: one run covers every row, so block indices it reports are the tensor's"""
SLAB_VALUES = 4 << 20
"""values the scale row regroups at once (in slabs of whole blocks, so its temporaries stay bounded)"""



@dataclass(frozen=True)
class Source:
    """How a repack reads one kind of source row: the row from its name's parameters, and a run's exact content as
    `(codes, scale)` of FP8 blocks of `dst` (scale: exponents where `pow2`, else F32 values)."""

    row: Callable[[str], QuantFormat | None]
    pow2: Callable[[str], bool]
    regroup: Callable[[str, Chunk, tuple[int, int]], tuple[np.ndarray, np.ndarray]]
    align: Callable[[str], int]
    stacked: bool = False
    """experts stacked along dim 0, each blocked on its own: a scale row per expert (else per b0 source rows)"""
    codes_shape: Callable[[QuantFormat, tuple], tuple] = lambda src, shape: tuple(src.out_shape(shape))
    names: Callable[[object], tuple[str, str]] = lambda m: (m.values, m.members["scale"])
    """a Match -> (the codes' name, the scale's name)"""
    scale_dtype: Callable[[str], str] = lambda stored: stored
    """the source scale's dtype -> the repacked scale's"""
    config: Callable[[dict, tuple[int, int]], dict] | None = None
    """(the source's quantization_config, the block) -> the output's, where the source is not a transformers FP8
    config (whose `weight_block_size` the repack rewrites, plan/repack.py)"""
    mp_refusal: str | None = None
    """why the repacked weights cannot be cut per rank (`--mp`), None where the mp layout cuts them as it cuts FP8
    blocks"""

    def scale_rows(self, b0: int) -> int:
        """Source rows (dim 0) a scale row covers."""
        return 1 if self.stacked else b0

    def scale_shape(self, codes: tuple, block: tuple[int, int]) -> tuple[int, ...]:
        return (codes[0], *scale_shape(codes[1:], block)) if self.stacked else scale_shape(codes, block)


def _mxfp4(args: str, c: Chunk, dst: tuple[int, int]):
    return repack.mxfp4_to_fp8(np.asarray(c.values), np.asarray(c.scale), dst)


def _fp8_params(args: str) -> tuple[int, int, str]:
    """fp8_block's name parameters: `{b0}x{b1}:{fmt}:{leaf}` (empty: DeepSeek-V3's 128x128 float)."""
    if not args:
        return 128, 128, "float"
    size, fmt, _ = args.split(":")
    b0, b1 = size.split("x")
    return int(b0), int(b1), fmt


def _fp8_row(args: str) -> QuantFormat | None:
    if not args:
        return FP8_BLOCK
    b0, b1, fmt = _fp8_params(args)
    return block_row(b0, b1, fmt, args.split(":")[2])


def _scale_values(c: Chunk) -> np.ndarray:
    s = np.asarray(c.scale)
    if c.side_dtypes.get("scale") in ("F8_E8M0", "U8"):
        return np.ldexp(np.float32(1.0), s.view(np.uint8).astype(np.int32) - 127).astype(np.float32)
    return s.astype(np.float32)


def _fp8(args: str, c: Chunk, dst: tuple[int, int]):
    b0, b1, fmt = _fp8_params(args)
    codes, scale = np.asarray(c.values).view(np.uint8), _scale_values(c)
    scale = scale[: -(-codes.shape[0] // b0)]
    if fmt == "ue8m0":
        return repack.fp8_regroup_pow2(codes, scale, (b0, b1), dst)
    return repack.fp8_regroup_float(codes, scale, (b0, b1), dst)


def _gpt_oss(args: str, c: Chunk, dst: tuple[int, int]):
    return repack.mxfp4_stacked_to_fp8(np.asarray(c.values).view(np.uint8), np.asarray(c.scale).view(np.uint8), dst)


def _gpt_oss_config(quant: dict, block: tuple[int, int]) -> dict:
    """transformers' FineGrainedFP8Config of E8M0 blocks, the modules the MXFP4 config left alone still left."""
    out = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
           "weight_block_size": list(block)}
    keep = quant.get("modules_to_not_convert")
    return {**out, "modules_to_not_convert": list(keep)} if isinstance(keep, list) else out


SOURCES: dict[str, Source] = {
    "mxfp4_experts": Source(mxfp4_experts_row, lambda args: True, _mxfp4, lambda args: 1),
    "fp8_block": Source(_fp8_row, lambda args: _fp8_params(args)[2] == "ue8m0", _fp8,
                        lambda args: _fp8_params(args)[0]),
    "mxfp4": Source(lambda args: MXFP4 if not args else None, lambda args: True, _gpt_oss, lambda args: 1,
                    stacked=True, codes_shape=lambda src, s: (s[0], s[1], s[2] * s[3] * 2),
                    names=lambda m: (m.base, m.base + EXPERTS_SCALE), scale_dtype=lambda stored: "F8_E8M0",
                    config=_gpt_oss_config,
                    mp_refusal="gpt-oss's mp layout and verify's gpt-oss model hold its experts as MXFP4 blocks or "
                               "BF16, not as stacked FP8 experts (and no engine loads gpt-oss's FP8 experts: "
                               "transformers' FP8Experts refuses their biases)"),
}
"""the source rows a repack reads, by the kind their names begin with"""


def _split(name: str) -> tuple[Source | None, str]:
    kind, _, args = name.partition(":")
    return SOURCES.get(kind), args


def source_of(row: QuantFormat) -> Source | None:
    """The repack source a row is read as, or None: not repackable."""
    return _split(row.name)[0]


def repackable(row: QuantFormat) -> bool:
    return source_of(row) is not None


def block_of(row: QuantFormat) -> tuple[int, int] | None:
    """An FP8 block row's block (a repack into the same block has nothing to do); None for other sources."""
    kind, _, args = row.name.partition(":")
    return _fp8_params(args)[:2] if kind == "fp8_block" else None


@functools.lru_cache(maxsize=None)
def codes_row(b0: int, b1: int, source: str) -> QuantFormat:
    kind, args = _split(source)
    src, block = kind.row(args), (b0, b1)

    def cpu(c: Chunk, out: str, into) -> np.ndarray:
        try:
            return kind.regroup(args, c, block)[0]
        except repack.Inexact:  # the scale row, which sees the whole tensor, names the tensor and block
            return np.zeros(kind.codes_shape(src, np.asarray(c.values).shape), dtype=np.uint8)

    align = math.lcm(kind.scale_rows(b0), kind.align(args))
    return replace(src, name=f"repack:codes:{b0}x{b1}:{source}", title=f"{src.title} -> FP8 {b0}x{b1} (exact)",
                   out_shape=lambda s: kind.codes_shape(src, s), row_align=align, cpu=cpu, cpu_into=False,
                   cuda=via_cpu(cpu), keepable=False, companion=None)


@functools.lru_cache(maxsize=None)
def scale_row(b0: int, b1: int, source: str, tensor: str) -> QuantFormat:
    kind, args = _split(source)
    src, block, pow2 = kind.row(args), (b0, b1), kind.pow2(args)
    per = kind.scale_rows(b0)

    def cpu(c: Chunk, out: str, into) -> np.ndarray:
        values = np.asarray(c.values)
        step = math.lcm(per, kind.align(args))
        step *= max(1, SLAB_VALUES // max(1, step * math.prod(values.shape[1:])))
        parts = []
        for a in range(0, values.shape[0], step):  # slabs of whole blocks: bounded temporaries, one read
            b = min(a + step, values.shape[0])
            sides = {s.role: c.sides[s.role][slice(*s.rows(a, b))] for s in src.read_sides if s.role in c.sides}
            try:
                parts.append(kind.regroup(args, Chunk(values[a:b], c.dtype, sides, c.side_dtypes), block)[1])
            except repack.Inexact as exc:
                raise InputError(f"cannot repack exactly: {exc.moved(a // per)}", tensor=tensor,
                                 fix="keep this weight in its format (or dequantize it to BF16); ckpttool never "
                                     "rounds a value in a repack") from None
        scale = np.concatenate(parts, axis=0)
        if not pow2:
            return scale.astype(np.float32)
        if out in ("F8_E8M0", "U8"):
            return (scale + 127).astype(np.uint8)
        return np.ldexp(np.float32(1.0), scale).astype(np.float32)  # F32 powers of two (DeepSeek-V3.1)

    sides = tuple(replace(s, read=WHOLE, rows=lambda r0, r1, s=s: s.rows(r0 * per, r1 * per))
                  if s in src.read_sides else s for s in src.sides)
    return replace(src, name=f"repack:scale:{b0}x{b1}:{source}@{tensor}",
                   title=f"{src.title} -> FP8 {b0}x{b1} scales (exact)", sides=sides,
                   out_shape=lambda s: kind.scale_shape(kind.codes_shape(src, s), block), row_align=WHOLE_TENSOR,
                   source_span=lambda r0, r1, shape: (0, r0 * per, min(r1 * per, shape[0])), cpu=cpu,
                   cpu_into=False, cuda=via_cpu(cpu), keepable=False, companion=None)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def named(name: str) -> QuantFormat | None:
    """The row a plan's transform name stands for."""
    kind, _, rest = name.partition(":")
    if kind != "repack":
        return None
    part, _, rest = rest.partition(":")
    if part == "nvfp4-codes":
        return nvfp4_codes_row(rest) if rest in NVFP4_ROWS else None
    if part == "nvfp4-global":
        source, at, tensor = rest.partition("@")
        return nvfp4_global_row(source, tensor) if source in NVFP4_ROWS and at else None
    size, _, source = rest.partition(":")
    b0, _, b1 = size.partition("x")
    if not (b0.isdigit() and b1.isdigit() and int(b0) > 0 and int(b1) > 0) or \
            _split(source.partition("@")[0])[0] is None:
        return None
    if part == "codes":
        return codes_row(int(b0), int(b1), source)
    source, at, tensor = source.partition("@")
    return scale_row(int(b0), int(b1), source, tensor) if part == "scale" and at else None


# -- NVFP4 between its two libraries ------------------------------------------------------------------------
NVFP4_ROWS = {"modelopt_nvfp4": (MODELOPT_NVFP4, "modelopt", "weight", "weight_scale_2", ()),
              "ct_nvfp4": (CT_NVFP4, "compressed-tensors", "weight_packed", "weight_global_scale", (1,))}
"""row name -> (row, the variant kernels/nvfp4_cpu.py names, values leaf, per-tensor scale leaf, its shape): the
same E2M1 codes and F8_E4M3 scales, the per-tensor scale multiplying (ModelOpt) or dividing (compressed-tensors)"""


def nvfp4_other(row: QuantFormat) -> str | None:
    """The other library's row name for an NVFP4 row, or None."""
    return next((n for n in NVFP4_ROWS if n != row.name), None) if row.name in NVFP4_ROWS else None


@functools.lru_cache(maxsize=None)
def nvfp4_codes_row(source: str) -> QuantFormat:
    src, _, _, _, _ = NVFP4_ROWS[source]
    to = NVFP4_ROWS[nvfp4_other(src)][1]

    def cpu(c: Chunk, out: str, into) -> np.ndarray:
        return repack.nvfp4_codes(np.asarray(c.values), to)

    return replace(src, name=f"repack:nvfp4-codes:{source}", title=f"{src.title} -> {to} NVFP4 codes",
                   out_shape=lambda s: tuple(s), row_align=1, cpu=cpu, cpu_into=False, cuda=via_cpu(cpu),
                   companion=None)


@functools.lru_cache(maxsize=None)
def nvfp4_global_row(source: str, tensor: str) -> QuantFormat:
    """The other library's per-tensor scale, made from the weight's F8_E4M3 scales (the values read) and its
    per-tensor scale (the side); refused, naming the tensor and the first block, where none gives the same bits."""
    src, variant, _, global_leaf, _ = NVFP4_ROWS[source]
    _, to_variant, _, _, shape = NVFP4_ROWS[nvfp4_other(src)]

    def cpu(c: Chunk, out: str, into) -> np.ndarray:
        codes = np.asarray(c.values).view(np.uint8)
        x, bad = repack.nvfp4_global(codes, variant, c.global_scale, to_variant)
        if x is None:
            where = np.argwhere(codes == bad)[0]
            raise InputError(f"cannot repack exactly: no {to_variant} per-tensor scale gives scale code {bad:#04x} "
                             f"(first at block [{int(where[0])}, {int(where[1])}]) the block scale {variant}'s "
                             f"{global_leaf} {c.global_scale!r} gives it", tensor=tensor,
                             fix="keep the checkpoint in its format, or dequantize it; ckpttool never rounds a value "
                                 "in a repack")
        return np.asarray(x, dtype=np.float32).reshape(shape)

    return QuantFormat(
        name=f"repack:nvfp4-global:{source}@{tensor}", title=f"{src.title} -> {to_variant} per-tensor scale",
        values=Name("weight_scale"), value_dtypes=("F8_E4M3",), sides=(Side("global", Name(global_leaf), ("F32",)),),
        check=lambda *a: None, out_shape=lambda s: shape, row_align=WHOLE_TENSOR,
        source_span=lambda r0, r1, s: (0, 0, s[0]), cpu=cpu, cuda=via_cpu(cpu), example=src.example,
        keepable=False, check_global=src.check_global)
