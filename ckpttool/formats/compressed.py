"""compressed-tensors' formats (what llm-compressor saves; config.json `quantization_config` with
`quant_method: compressed-tensors`), one row each, and how the config names them.

  ct_int4_g{G}    W.weight_packed (I32 [M, N/8]) + W.weight_scale (BF16 [M, N/G]) + W.weight_shape (I64 [2])
                  -> W.weight [M, N]: `pack-quantized`, symmetric INT4 in groups of G (Kimi-K2-Thinking: G=32)
  ct_fp8_channel  W.weight (F8_E4M3 [M, N]) + W.weight_scale (BF16 [M, 1])   `float-quantized`, per channel
  ct_fp8_tensor   W.weight (F8_E4M3 [M, N]) + W.weight_scale (BF16 [1])      `float-quantized`, per tensor
  ct_nvfp4        W.weight_packed (U8 [M, N/2]) + W.weight_scale (F8_E4M3 [M, N/16])
                  + W.weight_global_scale (F32 [1]) -> W.weight [M, N]: `nvfp4-pack-quantized`

`input_scale` / `input_global_scale` (static activation scales) are dropped with the quantization.
Formulas: kernels/scaled_cpu.py (INT4, FP8) and kernels/nvfp4_cpu.py (NVFP4), each compressed-tensors'
own `decompress` bit for bit.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats import compressed_int
from ckpttool.formats.blocks import mxfp4_rows
from ckpttool.formats.compressed_int import SCALE_DTYPES, SHAPE, int_row
from ckpttool.formats.row import BY_ROWS, DROPPED, WHOLE, Chunk, Name, QuantFormat, Side
from ckpttool.kernels import grouped, nvfp4_cpu, scaled_cpu, window
from ckpttool.kernels.fp8_cpu import NAN_ABOVE, NaNCodes, dequant_scaled, fp8_library_tables

INT4_GROUPS = (16, 32, 64, 128, 256)
"""group sizes of the pack-quantized rows (llm-compressor's W4A16 uses 128, Kimi-K2-Thinking 32)"""
NVFP4_GROUP = nvfp4_cpu.GROUP


def _two_d(w_shape, what: str, tensor: str, file) -> None:
    if len(w_shape) != 2:
        raise InputError(f"{what} weight must be 2-D, got shape {list(w_shape)}", file=file, tensor=tensor,
                         fix="stacked 3-D experts are not a compressed-tensors layout ckpttool reads")


def _scale_mismatch(s_shape, w_shape, want, why: str, tensor: str, file) -> InputError:
    return InputError(f"scale shape {list(s_shape)} does not match weight shape {list(w_shape)}: expected "
                      f"{list(want)} ({why})", file=file, tensor=tensor,
                      fix="re-download the checkpoint, or fix config.json's quantization_config if it is the one that is "
                          "wrong")


# -- pack-quantized INT4, symmetric, in groups (issue 16's rows; the others: formats/compressed_int.py) ------


def _int4(group: int) -> QuantFormat:
    def check(w_shape, sides, names, file) -> None:
        s_shape, tensor = sides["scale"], names["scale"]
        _two_d(w_shape, "pack-quantized", tensor, file)
        cols = w_shape[1] * 8
        if cols % group:
            raise InputError(f"weight_packed {list(w_shape)} holds {cols} values a row, not a multiple of the "
                             f"group size {group}", file=file, tensor=tensor,
                             fix="check config.json's group_size; ckpttool reads whole groups only")
        if tuple(s_shape) != (w_shape[0], cols // group):
            raise _scale_mismatch(s_shape, w_shape, (w_shape[0], cols // group),
                                  f"one scale per {group} values: config.json group_size", tensor, file)

    def cpu(c: Chunk, out: str, into) -> np.ndarray:
        if c.side_dtypes["scale"] == "F16":  # the library's fp16 product: rounded to fp16 first (kernels/window.py)
            codes = c.values.view(np.uint8).reshape(c.values.shape[0], -1)
            return window.dequant(codes, c.scale, "F16", None, bits=4, group=group, out=out)
        return scaled_cpu.dequant_int4(c.values, c.scale, c.side_dtypes["scale"], out)

    def cuda(c: Chunk, out_dtype):
        if c.side_dtypes["scale"] != "BF16":  # the Triton kernel reads BF16 scales: the CPU's tables, gathered
            return int_row("pack", 4, "group", group, False, False).cuda(c, out_dtype)
        from ckpttool.kernels.scaled_triton import dequant_int4

        return dequant_int4(c.values, c.scale, out_dtype)

    def example(dev) -> Chunk:
        import torch

        return Chunk(torch.zeros(1, group // 8, dtype=torch.int32, device=dev), "I32",
                     {"scale": torch.ones(1, 1, dtype=torch.bfloat16, device=dev)}, {"scale": "BF16"})

    return QuantFormat(
        name=f"ct_int4_g{group}", title=f"compressed-tensors pack-quantized INT4 (group {group})",
        values=Name("weight_packed"), value_dtypes=("I32",),
        sides=(Side("scale", Name("weight_scale"), SCALE_DTYPES, BY_ROWS), SHAPE),
        check=check, out_shape=lambda s: (s[0], s[1] * 8), cpu=cpu, cuda=cuda, example=example, keepable=False)


CT_INT4 = {g: _int4(g) for g in INT4_GROUPS}


# -- float-quantized FP8 -------------------------------------------------------------------------------
INPUT_SCALE = Side("dropped", Name("input_scale"), read=DROPPED)
"""a static activation scale: meaningless once the weight is dequantized"""


def _fp8(strategy: str) -> QuantFormat:
    def want(w_shape) -> tuple:
        return (w_shape[0], 1) if strategy == "channel" else (1,)

    def check(w_shape, sides, names, file) -> None:
        s_shape, tensor = sides["scale"], names["scale"]
        _two_d(w_shape, "float-quantized", tensor, file)
        if tuple(s_shape) != want(w_shape):
            raise _scale_mismatch(s_shape, w_shape, want(w_shape), f"config.json strategy {strategy}", tensor, file)

    def cuda(c: Chunk, out_dtype):
        if c.side_dtypes["scale"] != "BF16":  # the Triton kernel reads BF16 scales: the CPU's tables, gathered
            return _fp8_tables_cuda(c, out_dtype, lambda index, rows: index.reshape(-1, 1).expand(rows, 1), 0)
        from ckpttool.kernels.scaled_triton import dequant_fp8_rows

        return dequant_fp8_rows(c.values, c.scale, out_dtype)

    def example(dev) -> Chunk:
        import torch

        return Chunk(torch.zeros(1, 2, dtype=torch.float8_e4m3fn, device=dev), "F8_E4M3",
                     {"scale": torch.ones(1, 1, dtype=torch.bfloat16, device=dev)}, {"scale": "BF16"})

    rows = (lambda r0, r1: (r0, r1)) if strategy == "channel" else (lambda r0, r1: (0, 1))
    return QuantFormat(
        name=f"ct_fp8_{strategy}", title=f"compressed-tensors float-quantized FP8 (per {strategy})",
        values=Name("weight"), value_dtypes=("F8_E4M3",),
        sides=(Side("scale", Name("weight_scale"), SCALE_DTYPES, WHOLE, rows=rows), INPUT_SCALE),
        check=check, out_shape=lambda s: s,
        cpu=lambda c, out, into: scaled_cpu.dequant_fp8_rows(c.values, c.scale, c.dtype, c.side_dtypes["scale"], out),
        cuda=cuda, example=example, keepable=False)


CT_FP8_CHANNEL = _fp8("channel")
CT_FP8_TENSOR = _fp8("tensor")


def _fp8_tables_cuda(c: Chunk, out_dtype, which_of, group: int):
    """FP8 codes gathered on the GPU from the CPU's tables (one per distinct scale, the library's product):
    which_of(each scale's table index as a torch tensor, rows) -> [rows, groups] table indices."""
    import torch

    from ckpttool.dtypes import dtype_code

    codes = c.values.view(torch.uint8)
    scale = c.scale.cpu()
    scale = scale.view(torch.int16).numpy().view(np.uint16) if scale.dtype == torch.bfloat16 else scale.numpy()
    values, index = scaled_cpu.distinct(np.ascontiguousarray(scale))
    sdt = c.side_dtypes["scale"]
    table = fp8_library_tables(c.dtype, scaled_cpu.scale_f32(values, sdt), sdt, dtype_code(out_dtype))
    table = np.ascontiguousarray(table).reshape(-1)
    tables = torch.from_numpy(table.view(table.dtype.str.replace("u", "i"))).to(codes.device)
    which = which_of(torch.from_numpy(index).to(codes.device), codes.shape[0])
    return grouped.gather_torch(codes, which, tables, group or max(codes.shape[1], 1)).view(out_dtype), None


def _fp8_blocks(b0: int, b1: int, group: bool) -> QuantFormat:
    """float-quantized FP8 with one scale per b0 x b1 block (strategy block, `block_structure` [b0, b1]; a last
    block may be partial, as the library pads), or per group of b1 values of a row (strategy group, b0 = 1)."""
    def check(w_shape, sides, names, file) -> None:
        s_shape, tensor = sides["scale"], names["scale"]
        _two_d(w_shape, "float-quantized", tensor, file)
        if group and w_shape[1] % b1:
            raise InputError(f"the weight holds {w_shape[1]} values a row, not a multiple of the group size {b1}",
                             file=file, tensor=tensor, fix="check config.json's group_size")
        want = (-(-w_shape[0] // b0), -(-w_shape[1] // b1))
        if tuple(s_shape) != want:
            why = f"group_size {b1}" if group else f"block_structure [{b0}, {b1}]"
            raise _scale_mismatch(s_shape, w_shape, want, f"config.json {why}", tensor, file)

    def cpu(c: Chunk, out: str, into) -> np.ndarray:
        codes = c.values
        rows, cols = codes.shape
        sdt = c.side_dtypes["scale"]
        if out == "BF16" and sdt != "F16":  # computed per element: a lookup per group (fp8_cpu.dequant_scaled)
            result = np.empty((rows, cols), dtype=np.uint16) if into is None else into.view(np.uint16).reshape(rows, cols)
            if dequant_scaled(codes, scaled_cpu.scale_f32(c.scale, sdt), c.dtype, sdt, out, result, b0=b0, group=b1):
                return result
        values, index = scaled_cpu.distinct(np.ascontiguousarray(c.scale))
        table = np.ascontiguousarray(fp8_library_tables(c.dtype, scaled_cpu.scale_f32(values, sdt), sdt,
                                                        out)).reshape(-1)
        result = np.empty((rows, cols), dtype=table.dtype) if into is None else \
            into.view(table.dtype).reshape(rows, cols)
        if result.size:  # NaN codes refused (scales are finite: checked before any chunk)
            bad = grouped.gather_fp8(codes, np.ascontiguousarray(index[np.arange(rows) // b0]), table, b1, result,
                                     NAN_ABOVE[c.dtype])
            if bad >= 0:
                raise NaNCodes(bad)
        return result

    def cuda(c: Chunk, out_dtype):
        import torch

        return _fp8_tables_cuda(c, out_dtype, lambda index, rows: index[torch.arange(rows, device=index.device) // b0],
                                b1)

    def example(dev) -> Chunk:
        import torch

        return Chunk(torch.zeros(b0, b1, dtype=torch.float8_e4m3fn, device=dev), "F8_E4M3",
                     {"scale": torch.ones(1, 1, dtype=torch.bfloat16, device=dev)}, {"scale": "BF16"})

    return QuantFormat(
        name=f"ct_fp8_group:{b1}" if group else f"ct_fp8_block:{b0}x{b1}",
        title="compressed-tensors float-quantized FP8 " + (f"(group {b1})" if group else f"({b0}x{b1} blocks)"),
        values=Name("weight"), value_dtypes=("F8_E4M3",),
        sides=(Side("scale", Name("weight_scale"), SCALE_DTYPES, BY_ROWS, rows=lambda r0, r1: (r0 // b0, -(-r1 // b0))),
               INPUT_SCALE),
        check=check, out_shape=lambda s: s, row_align=b0, cpu=cpu, cpu_into=True, cuda=cuda, example=example,
        keepable=False)


@functools.lru_cache(maxsize=None)
def fp8_block_row(b0: int, b1: int) -> QuantFormat:
    return _fp8_blocks(b0, b1, False)


@functools.lru_cache(maxsize=None)
def fp8_group_row(group: int) -> QuantFormat:
    return _fp8_blocks(1, group, True)


# -- nvfp4-pack-quantized -------------------------------------------------------------------------------
def check_nvfp4(w_shape, sides, names, file) -> None:
    """packed U8 [M, N/2] and F8_E4M3 scales [M, N/16] (shared by ModelOpt's spelling)."""
    s_shape, tensor = sides["scale"], names["scale"]
    _two_d(w_shape, "NVFP4", tensor, file)
    cols = w_shape[1] * 2
    if cols % NVFP4_GROUP:
        raise InputError(f"packed NVFP4 weight {list(w_shape)} holds {cols} values a row, not a multiple of "
                         f"{NVFP4_GROUP}", file=file, tensor=tensor, fix="NVFP4 has one scale per 16 values; "
                         "the checkpoint is not NVFP4 as published")
    if tuple(s_shape) != (w_shape[0], cols // NVFP4_GROUP):
        raise _scale_mismatch(s_shape, w_shape, (w_shape[0], cols // NVFP4_GROUP), "one scale per 16 values",
                              tensor, file)


def global_scale_check(variant: str, what: str):
    """What is wrong with a tensor's global scale (its `what`), as QuantFormat.check_global wants it."""
    def check(g: float) -> str | None:
        if not (np.isfinite(g) and g > 0):
            return f"{what} {g!r} is not a finite positive number"
        if not np.isfinite(nvfp4_cpu.block_scales(variant, g)[:0x7F]).all():  # codes 0..0x7E: the finite ones
            return f"{what} {g!r} makes the block scales overflow float32"
        return None
    return check


def nvfp4_row(variant: str, *, values: Name, global_leaf: str, dropped: str, also_dropped: tuple[str, ...] = (),
              **fields) -> QuantFormat:
    def cpu(c: Chunk, out: str, into):
        bad = nvfp4_cpu.nan_scale_rows(c.scale)
        if bad.size:
            from ckpttool.kernels.fp8_cpu import NaNCodes

            raise NaNCodes(int(bad[0]))
        return nvfp4_cpu.dequant(c.values, c.scale, variant, c.global_scale, out)

    def cuda(c: Chunk, out_dtype):
        from ckpttool.kernels.nvfp4 import dequant_nvfp4_cuda

        return dequant_nvfp4_cuda(c.values, c.scale, variant, c.global_scale, out_dtype)

    def example(dev) -> Chunk:
        import torch

        return Chunk(torch.zeros(1, 8, dtype=torch.uint8, device=dev), "U8",
                     {"scale": torch.ones(1, 1, dtype=torch.float32, device=dev).to(torch.float8_e4m3fn)},
                     {"scale": "F8_E4M3"})

    return QuantFormat(
        values=values, value_dtypes=("U8",),
        sides=(Side("scale", Name("weight_scale"), ("F8_E4M3",), BY_ROWS), Side("global", Name(global_leaf), ("F32",)),
               Side("dropped", Name(dropped), read=DROPPED),
               *(Side(leaf, Name(leaf), read=DROPPED) for leaf in also_dropped)),
        check=check_nvfp4, out_shape=lambda s: (s[0], s[1] * 2), cpu=cpu, cuda=cuda, example=example, keepable=False,
        check_global=global_scale_check(variant, global_leaf), **fields)


CT_NVFP4 = nvfp4_row("compressed-tensors", name="ct_nvfp4", title="compressed-tensors nvfp4-pack-quantized NVFP4",
                     values=Name("weight_packed"), global_leaf="weight_global_scale", dropped="input_global_scale")


# -- mxfp4-pack-quantized: DeepSeek-V4's experts' layout and arithmetic (formats/blocks.py) -----------------
CT_MXFP4 = mxfp4_rows(name="ct_mxfp4", title="compressed-tensors mxfp4-pack-quantized MXFP4",
                      values=Name("weight_packed"), value_dtypes=("U8",), leaf="weight_scale")
"""MXFP4PackedCompressor.decompress: e2m1 codes (code 8 is -0.0) times 2 ** (e - 127) in bf16; every product
is exact there (at most two significant bits times a power of two no smaller than 2 ** -127), so it is the
pair table of kernels/mxfp4_cpu.py, rounded once into the output dtype"""

ROWS = (*CT_INT4.values(), CT_FP8_CHANNEL, CT_FP8_TENSOR, CT_NVFP4, CT_MXFP4)
_NAMED = {"ct_fp8_block": (re.compile(r"(\d+)x(\d+)"), lambda m: fp8_block_row(int(m[1]), int(m[2]))),
          "ct_fp8_group": (re.compile(r"(\d+)"), lambda m: fp8_group_row(int(m[1])))}


def named(name: str) -> QuantFormat | None:
    """The row a plan's transform name stands for, among the rows made for a config's parameters."""
    kind, _, args = name.partition(":")
    if kind in _NAMED and (m := _NAMED[kind][0].fullmatch(args)) and all(int(v) > 0 for v in m.groups()):
        return _NAMED[kind][1](m)
    return compressed_int.named(name)
