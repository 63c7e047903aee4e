"""compressed-tensors' integer weights beyond issue 16's symmetric INT4 groups: zero points (asymmetric), 8-bit
packing (W8A16), `int-quantized` INT8 (W8A8), per-channel and per-tensor scales, act-order group indices, and
scales in the model's dtype (BF16, F16 or F32). One family of rows, named by their parameters:

  ct_int:{pack|int}:{bits}:{group<G>|channel|tensor}:{sym|asym}[:gidx]

  pack  W.weight_packed (I32 [M, N * bits / 32]: value j of a row is bits `bits * (j mod 32/bits)`.. of word
        j * bits / 32, stored as q + 2^(bits-1)) + W.weight_shape (I64 [2])
  int   W.weight (I8 [M, N]: q itself)
  W.weight_scale    [M, N / G] (group), [M, 1] (channel) or [1] (tensor), BF16, F16 or F32
  W.weight_zero_point (asym)  pack: I32 [M * bits / 32, N / G], packed along dim 0 (pack_to_int32(z, bits,
        packed_dim=0): row 8k + m's zero code in word k, as z + 2^(bits-1)), or I8 [1] per tensor (the library packs
        group and channel zero points only); int: I8 in the scale's shape
  W.weight_g_idx (gidx, `actorder: group`)  I32 [N]: column j's group (compressed-tensors up to 0.12 wrote it)
  W.input_scale, W.input_zero_point (static activations): dropped

Formula (compressed-tensors 0.20 `_dequantize`: `x_q.to(scale.dtype) - zero_point.to(scale.dtype)`, times the
scale, in the scale's dtype; every q - z is exact there): out = round_out(round_sdt((q - z) * s)), round_sdt the
fp16 rounding for F16 scales and nothing for BF16 and F32 ones (kernels/fp8_cpu.library_tables); with a group
index, column j uses group g_idx[j]: what compressed-tensors 0.12 computed by sorting the columns by g_idx, in
groups of group_size, and putting them back (so each group must hold group_size columns; 0.20 refuses
actorder group, and tests/ct_builders.py checks the formula against 0.20's own decompress of the sorted columns). A
g_idx holding -1 (never set by GPTQ) is ignored, as that library ignored it. The kernel: kernels/window.py.
"""

from __future__ import annotations

import functools
import re
import sys

import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats.row import AT_PLAN, BY_ROWS, DROPPED, WHOLE, Chunk, Name, QuantFormat, Side
from ckpttool.kernels import window

SCALE_DTYPES = ("BF16", "F16", "F32")
SHAPE = Side("shape", Name("weight_shape"), ("I64", "I32"), AT_PLAN)
_ALL = (0, sys.maxsize)


def _zero_codes(c: Chunk, bits: int, rows: int) -> np.ndarray | None:
    """The chunk's zero codes (offset binary, [rows or 1, groups]), or None for a symmetric row."""
    zero = c.sides.get("zero")
    if zero is None:
        return None
    if c.side_dtypes.get("zero") == "I8":  # as stored: int-quantized, or a per-tensor one (the library packs no other)
        codes = zero.view(np.int8).astype(np.int16) + (1 << (bits - 1))
        return codes if codes.ndim == 2 else codes.reshape(1, -1)
    groups = zero.shape[1]
    b = zero.view(np.uint8).reshape(zero.shape[0], groups, 4)  # each little-endian word's bytes
    if bits == 4:
        b = np.stack((b & 15, b >> 4), axis=-1).reshape(zero.shape[0], groups, 8)
    return np.ascontiguousarray(b.transpose(0, 2, 1)).reshape(-1, groups)[:rows]


def _gidx(c: Chunk) -> np.ndarray | None:
    g = c.sides.get("g_idx")
    if g is None or (g < 0).any():  # -1: GPTQ never ran; compressed-tensors then reads columns in order
        return None
    return np.ascontiguousarray(g, dtype=np.int32)


def _cpu(storage: str, bits: int, group: int):
    def cpu(c: Chunk, out: str, into) -> np.ndarray:
        codes = c.values.view(np.uint8)
        rows = codes.shape[0]
        if storage == "pack":
            codes = codes.reshape(rows, -1)
        cols = codes.shape[1] * (2 if bits == 4 else 1)
        scale = c.scale.reshape(1, -1) if c.scale.ndim < 2 else c.scale
        return window.dequant(codes, scale, c.side_dtypes["scale"], _zero_codes(c, bits, rows), bits=bits,
                              group=group or cols, out=out, flip=0x80 if storage == "int" else 0, gidx=_gidx(c))
    return cpu


def _cuda(storage: str, bits: int, group: int):
    def cuda(c: Chunk, out_dtype):
        import torch

        from ckpttool.dtypes import dtype_code
        from ckpttool.kernels.scaled_cpu import distinct, scale_f32

        codes = c.values.view(torch.uint8).reshape(c.values.shape[0], -1)
        rows, cols = codes.shape[0], codes.shape[1] * (2 if bits == 4 else 1)
        scale = c.scale.reshape(1, -1) if c.scale.ndim < 2 else c.scale
        values, which = distinct(np.ascontiguousarray(_to_numpy(scale)))
        table = window.tables(scale_f32(values, c.side_dtypes["scale"]), c.side_dtypes["scale"], bits,
                              dtype_code(out_dtype))
        numpy_sides = Chunk(None, c.dtype, {k: _to_numpy(v) for k, v in c.sides.items()}, c.side_dtypes)
        zero = _zero_codes(numpy_sides, bits, rows)
        offs = window.offsets(np.broadcast_to(which, (rows, which.shape[-1])), (1 << (bits - 1)) if zero is None
                              else zero, bits)
        gidx = _gidx(numpy_sides)
        dev = codes.device
        words = window.gather_torch(codes, torch.from_numpy(offs).to(dev),
                                    torch.from_numpy(table.view(table.dtype.str.replace("u", "i"))).to(dev),
                                    group=group or cols, nibbles=bits == 4, flip=0x80 if storage == "int" else 0,
                                    gidx=None if gidx is None else torch.from_numpy(gidx).to(dev))
        return words.view(out_dtype), None  # finite scales (bad_row) and integer codes: no NaN
    return cuda


def _to_numpy(t) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _check(storage: str, bits: int, strategy: str, group: int, asym: bool, gidx: bool):
    per = 32 // bits

    def check(w_shape, sides, names, file) -> None:
        tensor = names["scale"]
        if len(w_shape) != 2:
            raise InputError(f"{storage}-quantized weight must be 2-D, got shape {list(w_shape)}", file=file,
                             tensor=tensor, fix="stacked 3-D experts are not a compressed-tensors layout ckpttool reads")
        rows, cols = w_shape[0], w_shape[1] * (per if storage == "pack" else 1)
        if group and cols % group:
            raise InputError(f"the weight holds {cols} values a row, not a multiple of the group size {group}",
                             file=file, tensor=tensor, fix="check config.json's group_size; ckpttool reads whole groups")
        groups = cols // group if group else 1
        want = {"group": (rows, groups), "channel": (rows, 1), "tensor": (1,)}[strategy]
        _expect(sides["scale"], want, "scale", f"weight {list(w_shape)} with config.json strategy {strategy}"
                + (f", group_size {group}" if group else ""), tensor, file)
        if asym and "zero" in sides:
            packed = storage == "pack" and strategy != "tensor"
            zero = (-(-rows // per), groups) if packed else want
            _expect(sides["zero"], zero, "zero point", "one per scale" + (f", {per} to an int32 word along the rows"
                                                                          if packed else ""), names["zero"], file)
        if gidx and "g_idx" in sides:
            _expect(sides["g_idx"], (cols,), "g_idx", "one group index per input column", names["g_idx"], file)
    return check


def _expect(shape, want: tuple, what: str, why: str, tensor: str, file) -> None:
    if tuple(shape) != tuple(want):
        raise InputError(f"{what} shape {list(shape)}, expected {list(want)} ({why})", file=file, tensor=tensor,
                         fix="re-download the checkpoint, or fix config.json's quantization_config if it is wrong")


def _zero_in_range(bits: int):
    """An unpacked (I8) zero point must be a `bits`-bit integer: no dtype says so."""
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1

    def check(values: np.ndarray, shapes: dict[str, tuple]) -> str | None:
        z = values.view(np.int8).reshape(-1)
        bad = z[(z < lo) | (z > hi)]
        return f"zero point {int(bad[0])} is outside the {bits}-bit range [{lo}, {hi}]" if bad.size else None
    return check


def _groups_of(group: int):
    """An act-order g_idx must put group_size columns in each of the scale's groups (or be unset: -1)."""
    def check(g: np.ndarray, shapes: dict[str, tuple]) -> str | None:
        if (g == -1).all():
            return None
        groups = shapes["scale"][-1]
        if g.min() < 0 or g.max() >= groups:
            return f"g_idx holds {int(g.min() if g.min() < 0 else g.max())}, outside the {groups} groups"
        counts = np.bincount(g.astype(np.int64), minlength=groups)
        if (counts != group).any():
            k = int(np.flatnonzero(counts != group)[0])
            return (f"g_idx puts {int(counts[k])} columns in group {k}: compressed-tensors reads act-order groups of "
                    f"exactly group_size {group} columns")
        return None
    return check


def _example(storage: str, bits: int, strategy: str, group: int, asym: bool, gidx: bool):
    def example(dev) -> Chunk:
        import torch

        cols = group or 32
        values = (torch.zeros(1, cols * bits // 32, dtype=torch.int32, device=dev) if storage == "pack"
                  else torch.zeros(1, cols, dtype=torch.int8, device=dev))
        sides = {"scale": torch.ones(1, 1, dtype=torch.bfloat16, device=dev)}
        dtypes = {"scale": "BF16"}
        if asym:
            sides["zero"] = torch.zeros(1, 1, dtype=torch.int32 if storage == "pack" and strategy != "tensor"
                                        else torch.int8, device=dev)
        if gidx:
            sides["g_idx"] = torch.zeros(cols, dtype=torch.int32, device=dev)
        return Chunk(values, "I32" if storage == "pack" else "I8", sides, dtypes)
    return example


@functools.lru_cache(maxsize=None)
def int_row(storage: str, bits: int, strategy: str, group: int, asym: bool, gidx: bool) -> QuantFormat:
    """compressed-tensors integer weights: `pack`-quantized (bits 4 or 8) or `int`-quantized (8), in groups of
    `group` (strategy group), per channel or per tensor, with zero points (`asym`) and an act-order group index."""
    per = 32 // bits
    tensor = strategy == "tensor"
    rows = (lambda r0, r1: (0, 1)) if tensor else (lambda r0, r1: (r0, r1))
    sides = [Side("scale", Name("weight_scale"), SCALE_DTYPES, WHOLE if tensor else BY_ROWS, rows=rows)]
    if asym:
        if storage == "pack" and not tensor:
            sides.append(Side("zero", Name("weight_zero_point"), ("I32",), BY_ROWS,
                              rows=lambda r0, r1: (r0 // per, -(-r1 // per))))
        else:
            sides.append(Side("zero", Name("weight_zero_point"), ("I8",), WHOLE if tensor else BY_ROWS, rows=rows,
                              check_values=_zero_in_range(bits) if bits < 8 else None))
    if gidx:
        sides.append(Side("g_idx", Name("weight_g_idx"), ("I32", "I64"), WHOLE, rows=lambda r0, r1: _ALL,
                          axis=-1, check_values=_groups_of(group)))
    if storage == "pack":
        sides.append(SHAPE)
    sides += [Side(leaf, Name(leaf), read=DROPPED) for leaf in ("input_scale", "input_zero_point")]
    what = f"{strategy} {group}" if group else f"per {strategy}"
    return QuantFormat(
        name=f"ct_int:{storage}:{bits}:{strategy}{group or ''}:{'asym' if asym else 'sym'}" + (":gidx" if gidx else ""),
        title=f"compressed-tensors {storage}-quantized INT{bits} ({what}" + (", zero points" if asym else "")
              + (", act-order g_idx" if gidx else "") + ")",
        values=Name("weight_packed" if storage == "pack" else "weight"),
        value_dtypes=("I32",) if storage == "pack" else ("I8",), sides=tuple(sides),
        check=_check(storage, bits, strategy, group, asym, gidx),
        out_shape=(lambda s: (s[0], s[1] * per)) if storage == "pack" else (lambda s: tuple(s)),
        row_align=per if asym and storage == "pack" and not tensor else 1,
        cpu=_cpu(storage, bits, group), cuda=_cuda(storage, bits, group),
        example=_example(storage, bits, strategy, group, asym, gidx), keepable=False)


_NAME = re.compile(r"ct_int:(pack|int):(4|8):(?:(group)(\d+)|(channel|tensor)):(sym|asym)(:gidx)?")


def named(name: str) -> QuantFormat | None:
    m = _NAME.fullmatch(name)
    if m is None or (m[1] == "int" and m[2] != "8"):
        return None
    return int_row(m[1], int(m[2]), m[3] or m[5], int(m[4] or 0), m[6] == "asym", m[7] is not None)
