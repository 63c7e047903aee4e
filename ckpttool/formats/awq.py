"""AWQ (`quant_method: awq`, as autoawq writes it and transformers reads it), one row per (layout, group size),
and the rules such a config declares. 4-bit codes with zero points (`zero_point: true`), F16 scales.

  awq_gemm:g{G}  version gemm: X.qweight I32 [K, N / 8], each word 8 output features in the order
                 [0, 2, 4, 6, 1, 3, 5, 7] (nibble i holds feature 8c + order[i]); X.qzeros I32 [K / G, N / 8] the
                 same way; X.scales F16 [K / G, N] -> X.weight [N, K] (output row n is stored column n / 8:
                 streamed as column spans)
  awq_gemv:g{G}  version gemv: X.qweight I32 [N, K / 8], nibble i holding input k = 8r + i; X.qzeros I32
                 [N, W] and X.scales F16 [N, 8W], W = autoawq's calculate_zeros_width(K, G) (the groups padded
                 to whole words, for G 32 and 64 to 4 and 2 of them) -> X.weight [N, K]

Formula (autoawq's dequantize_gemm, which transformers 5.24 runs through gptqmodel's copy of it): weight[k, n] =
fp16((q[k, n] - z[k // G, n]) * scales[k // G, n]), then one rounding to the output dtype. GEMV has no
dequantization of its own in autoawq (only a CUDA GEMV kernel): its row applies the same formula to the same
codes, zero points and scales as GEMV lays them out (autoawq's WQLinear_GEMV.from_linear packs what
WQLinear_GEMM.from_linear packs, reordered). Refused by name: zero_point false, bits other than 4, versions
gemv_fast, marlin and llm-awq. Shard keeping AWQ: refused.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats.resolve import Rule
from ckpttool.formats.row import BY_ROWS, Chunk, Name, QuantFormat, Side
from ckpttool.kernels import packed

METHOD = "awq"
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""autoawq's AWQ_ORDER: nibble i of a GEMM word holds output feature 8c + ORDER[i]"""
SHIFT_OF_ROW = np.ascontiguousarray(4 * np.argsort(ORDER), dtype=np.int32)
VERSIONS = ("gemm", "gemv")


def zeros_width(k: int, group: int) -> int:
    """autoawq's calculate_zeros_width: the qzeros words of a GEMV row (its groups padded)."""
    multiplier = 1 if group >= 128 else {64: 2, 32: 4}[group]
    return -(-(-(-(k // group) // 8)) // multiplier) * multiplier


def _refuse_shape(role: str, got, want, why: str, names, file) -> InputError:
    return InputError(f"{role} shape {list(got)} does not match: expected {list(want)} ({why})", file=file,
                      tensor=names.get(role), fix="re-download the checkpoint, or fix config.json's "
                      "quantization_config (group_size, version)")


def _gemm_check(group: int):
    def check(w_shape, sides, names, file) -> None:
        if len(w_shape) != 2:
            raise _refuse_shape("values", w_shape, ["K", "N / 8"], "AWQ GEMM qweight is 2-D", names, file)
        k, n = w_shape[0], w_shape[1] * 8
        g = 1 if group == -1 else group
        if group != -1 and k % group:
            raise _refuse_shape("scale", sides["scale"], [k // group, n], f"{k} inputs are not whole groups of "
                                f"{group}", names, file)
        why = f"qweight {list(w_shape)}: {k} inputs in groups of {group}, {n} outputs"
        groups = 1 if group == -1 else k // g
        for role, want in (("scale", (groups, n)), ("zero", (groups, n // 8))):
            if tuple(sides[role]) != want:
                raise _refuse_shape(role, sides[role], want, why, names, file)
    return check


def _gemv_check(group: int):
    def check(w_shape, sides, names, file) -> None:
        if len(w_shape) != 2:
            raise _refuse_shape("values", w_shape, ["N", "K / 8"], "AWQ GEMV qweight is 2-D", names, file)
        n, k = w_shape[0], w_shape[1] * 8
        g = k if group == -1 else group
        if k % g or (g < 128 and g not in (32, 64)):
            raise _refuse_shape("scale", sides["scale"], ["N", "8 W"], f"{k} inputs in groups of {g}: autoawq's GEMV "
                                "takes whole groups of 32, 64 or 128 and more", names, file)
        width = zeros_width(k, g)
        why = f"qweight {list(w_shape)}: {k} inputs in groups of {g}, the zero points padded to {width} words"
        for role, want in (("scale", (n, width * 8)), ("zero", (n, width))):
            if tuple(sides[role]) != want:
                raise _refuse_shape(role, sides[role], want, why, names, file)
    return check


def _gemm_prepare(c: Chunk, k: int, group: int, out: str):
    z = packed.unpack(c.sides["zero"], 4, ORDER)  # [groups, rows]
    table, off = packed.tables(c.scale.view(np.uint16).T, z.T, 4, out)
    return table, off, packed.contiguous_groups(k, k if group == -1 else group)


def _gemv_prepare(c: Chunk, k: int, group: int, out: str):
    g = k if group == -1 else group
    count = k // g
    z = packed.unpack(c.sides["zero"], 4)[:, :count]
    table, off = packed.tables(c.scale.view(np.uint16)[:, :count], z, 4, out)
    return table, off, packed.contiguous_groups(k, g), packed.contiguous_groups(k // 8, g // 8)


def _result(into, rows: int, k: int, out: str) -> np.ndarray:
    dtype = packed.carrier(out)
    return np.empty((rows, k), dtype=dtype) if into is None else into.view(dtype).reshape(rows, k)


def _cpu(gemv: bool, group: int):
    def cpu(c: Chunk, out: str, into: np.ndarray | None) -> np.ndarray:
        words = np.ascontiguousarray(c.values)
        if gemv:
            rows, k = words.shape[0], words.shape[1] * 8
            result = _result(into, rows, k, out)
            if result.size and packed.computed():
                packed.bcast(words, np.ascontiguousarray(c.scale).view(np.uint16),
                             np.ascontiguousarray(c.sides["zero"]).view(np.uint32), k if group == -1 else group, out,
                             result)
            elif result.size:
                table, off, by_col, by_word = _gemv_prepare(c, k, group, out)
                packed.cols(words, False, 4, off, by_word, by_col, table, result)
            return result
        k, rows = words.shape[0], words.shape[1] * 8
        result = _result(into, rows, k, out)
        if result.size and packed.computed():
            packed.rows8(words, SHIFT_OF_ROW, np.ascontiguousarray(c.scale).view(np.uint16),
                         np.ascontiguousarray(c.sides["zero"]).view(np.uint32), out, result)
        elif result.size:
            table, off, by_col = _gemm_prepare(c, k, group, out)
            packed.rows(words, SHIFT_OF_ROW, off, by_col, table, result)
        return result
    return cpu


def _cuda(gemv: bool, group: int):
    def cuda(c: Chunk, out_dtype):
        import torch

        from ckpttool.dtypes import dtype_code

        host = Chunk(None, c.dtype, {r: v.cpu().numpy() for r, v in c.sides.items()}, c.side_dtypes)
        out = dtype_code(out_dtype)
        if gemv:
            k = c.values.shape[1] * 8
            table, off, by_col, _ = _gemv_prepare(host, k, group, out)
            codes = packed.unpack_torch(c.values, 4)
        else:
            k = c.values.shape[0]
            table, off, by_col = _gemm_prepare(host, k, group, out)
            codes = packed.unpack_torch(c.values.T.contiguous(), 4, ORDER)  # [C, K * 8]: row c's 8 features
            codes = codes.reshape(c.values.shape[1], k, 8).permute(0, 2, 1).reshape(-1, k)
        dev = c.values.device
        signed = torch.from_numpy(table.view(table.dtype.str.replace("u", "i"))).to(dev)
        y = packed.gather_torch(codes, torch.from_numpy(off).to(dev), torch.from_numpy(np.array(by_col)).to(dev), signed)
        return y.view(out_dtype), None
    return cuda


@functools.lru_cache(maxsize=None)
def awq_row(version: str, group: int) -> QuantFormat:
    """The row of AWQ `version` (gemm or gemv) 4-bit codes in groups of `group` (-1: one group)."""
    gemv = version == "gemv"

    def example(dev) -> Chunk:
        import torch

        g = 128 if group == -1 else group
        if gemv:
            w = zeros_width(g, g)
            return Chunk(torch.zeros(8, g // 8, dtype=torch.int32, device=dev), "I32",
                         {"scale": torch.ones(8, 8 * w, dtype=torch.float16, device=dev),
                          "zero": torch.zeros(8, w, dtype=torch.int32, device=dev)}, {"scale": "F16", "zero": "I32"})
        return Chunk(torch.zeros(g, 1, dtype=torch.int32, device=dev), "I32",
                     {"scale": torch.ones(1, 8, dtype=torch.float16, device=dev),
                      "zero": torch.zeros(1, 1, dtype=torch.int32, device=dev)}, {"scale": "F16", "zero": "I32"})

    if gemv:
        sides = (Side("scale", Name("scales"), ("F16",), BY_ROWS), Side("zero", Name("qzeros"), ("I32",), BY_ROWS))
        extra = dict(check=_gemv_check(group), out_shape=lambda s: (s[0], s[1] * 8))
    else:
        sides = (Side("scale", Name("scales"), ("F16",), BY_ROWS, axis=-1),
                 Side("zero", Name("qzeros"), ("I32",), BY_ROWS, rows=lambda r0, r1: (r0 // 8, -(-r1 // 8)), axis=-1))
        extra = dict(check=_gemm_check(group), out_shape=lambda s: (s[1] * 8, s[0]), row_align=8,
                     source_span=lambda r0, r1, shape: (-1, r0 // 8, -(-r1 // 8)))
    return QuantFormat(
        name=f"awq_{version}:g{group}", title=f"AWQ {version.upper()} 4-bit (group {group})",
        values=Name("qweight"), value_dtypes=("I32",), sides=sides, cpu=_cpu(gemv, group), cpu_into=True,
        cuda=_cuda(gemv, group), example=example, keepable=False, **extra)


_NAME = re.compile(r"awq_(gemm|gemv):g(-1|[1-9]\d*)")


def named(name: str) -> QuantFormat | None:
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    return awq_row(m[1], int(m[2])) if m else None


# -- config.json ------------------------------------------------------------------------------------------
def _refuse(what: str, source) -> InputError:
    return InputError(f"AWQ quantization_config {what} is not a layout ckpttool reads", file=source,
                      fix="ckpttool reads AWQ 4-bit with zero points, version gemm or gemv; dequantize this "
                          "checkpoint with the library that wrote it")


def declared(quant: dict, source) -> tuple[Rule, ...]:
    """The rule of an AWQ quantization_config, read as transformers' AwqConfig reads it (`version` or `format`,
    `bits` or autoawq's `w_bit`, `group_size` or `q_group_size`, `zero_point`, `modules_to_not_convert`)."""
    version = quant.get("version") or quant.get("format") or "gemm"
    bits = quant.get("bits", quant.get("w_bit", 4))
    group = quant.get("group_size", quant.get("q_group_size", 128))
    if not isinstance(version, str) or version.lower() not in VERSIONS:
        raise _refuse(f"version {version!r}", source)
    if bits != 4 or isinstance(bits, bool):
        raise _refuse(f"bits {bits!r}", source)
    if quant.get("zero_point", True) is not True:
        raise _refuse(f"zero_point {quant.get('zero_point')!r} (scales without zero points)", source)
    if quant.get("backend") == "llm-awq":
        raise _refuse("backend 'llm-awq'", source)
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0 and group % 8 == 0):
        raise _refuse(f"group_size {group!r}", source)
    ignore = tuple(v for v in (quant.get("modules_to_not_convert") or []) if isinstance(v, str))
    return (Rule(awq_row(version.lower(), group), "quantization_config", ignore=ignore),)
