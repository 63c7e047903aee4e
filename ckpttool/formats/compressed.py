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


import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats.resolve import Rule
from ckpttool.formats.row import AT_PLAN, BY_ROWS, DROPPED, WHOLE, Chunk, Name, QuantFormat, Side
from ckpttool.kernels import nvfp4_cpu, scaled_cpu

METHOD = "compressed-tensors"
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
                      fix="re-download the checkpoint, or fix config.json's group_size if it is the one that is wrong")


# -- pack-quantized INT4 -------------------------------------------------------------------------------
SHAPE = Side("shape", Name("weight_shape"), ("I64", "I32"), AT_PLAN)


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

    def cuda(c: Chunk, out_dtype):
        from ckpttool.kernels.scaled_triton import dequant_int4

        return dequant_int4(c.values, c.scale, out_dtype)

    def example(dev) -> Chunk:
        import torch

        return Chunk(torch.zeros(1, group // 8, dtype=torch.int32, device=dev), "I32",
                     {"scale": torch.ones(1, 1, dtype=torch.bfloat16, device=dev)}, {"scale": "BF16"})

    return QuantFormat(
        name=f"ct_int4_g{group}", title=f"compressed-tensors pack-quantized INT4 (group {group})",
        values=Name("weight_packed"), value_dtypes=("I32",),
        sides=(Side("scale", Name("weight_scale"), ("BF16",), BY_ROWS), SHAPE),
        check=check, out_shape=lambda s: (s[0], s[1] * 8),
        cpu=lambda c, out, into: scaled_cpu.dequant_int4(c.values, c.scale, "BF16", out), cuda=cuda,
        example=example, keepable=False)


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
        sides=(Side("scale", Name("weight_scale"), ("BF16",), WHOLE, rows=rows), INPUT_SCALE),
        check=check, out_shape=lambda s: s,
        cpu=lambda c, out, into: scaled_cpu.dequant_fp8_rows(c.values, c.scale, c.dtype, "BF16", out), cuda=cuda,
        example=example, keepable=False)


CT_FP8_CHANNEL = _fp8("channel")
CT_FP8_TENSOR = _fp8("tensor")


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


def nvfp4_row(variant: str, *, values: Name, global_leaf: str, dropped: str, **fields) -> QuantFormat:
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
               Side("dropped", Name(dropped), read=DROPPED)),
        check=check_nvfp4, out_shape=lambda s: (s[0], s[1] * 2), cpu=cpu, cuda=cuda, example=example, keepable=False,
        check_global=global_scale_check(variant, global_leaf), **fields)


CT_NVFP4 = nvfp4_row("compressed-tensors", name="ct_nvfp4", title="compressed-tensors nvfp4-pack-quantized NVFP4",
                     values=Name("weight_packed"), global_leaf="weight_global_scale", dropped="input_global_scale")

ROWS = (*CT_INT4.values(), CT_FP8_CHANNEL, CT_FP8_TENSOR, CT_NVFP4)


# -- config.json ------------------------------------------------------------------------------------
def _refuse(what: str, source) -> InputError:
    return InputError(f"compressed-tensors {what} is not a format ckpttool reads", file=source,
                      fix="ckpttool dequantizes compressed-tensors pack-quantized INT4 (symmetric, group), "
                          "float-quantized FP8 (channel or tensor) and nvfp4-pack-quantized; "
                          "load this checkpoint with compressed-tensors itself")


def _row(fmt: object, w: dict, where: str, source) -> QuantFormat:
    """The row for one config group, reading QuantizationArgs with the library's defaults."""
    num_bits, kind = w.get("num_bits", 8), w.get("type", "int")
    symmetric, group = w.get("symmetric", True), w.get("group_size")
    strategy = w.get("strategy") or ("group" if group else "tensor")
    args = f"{where}: format {fmt!r}, {num_bits}-bit {kind}, strategy {strategy}" + (f", group {group}" if group else "")
    if w.get("actorder") not in (None, False) or w.get("block_structure") or w.get("dynamic") not in (None, False):
        raise _refuse(f"{args} with actorder/block_structure/dynamic weights", source)
    if not symmetric:
        raise _refuse(f"{args}, asymmetric (zero points)", source)
    if fmt == "pack-quantized" and (num_bits, kind, strategy) == (4, "int", "group") and group in CT_INT4:
        return CT_INT4[group]
    if fmt == "float-quantized" and (num_bits, kind) == (8, "float") and strategy in ("channel", "tensor"):
        return CT_FP8_CHANNEL if strategy == "channel" else CT_FP8_TENSOR
    if fmt == "nvfp4-pack-quantized" and (num_bits, kind, strategy, group) == (4, "float", "tensor_group", 16):
        return CT_NVFP4
    raise _refuse(args, source)


def declared(quant: dict, source) -> tuple[Rule, ...]:
    """The rules a compressed-tensors quantization_config declares (a row per config group, over its targets,
    less the config's `ignore`); anything else is refused by name."""
    status = quant.get("quantization_status")
    if status != "compressed":
        raise _refuse(f"quantization_status {status!r} (only 'compressed' checkpoints hold packed weights)", source)
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if quant.get(key):
            raise _refuse(f"{key} {quant[key]!r}", source)
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("quantization_config without config_groups", source)
    rules = []
    for name, group in sorted(groups.items()):
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise _refuse(f"config_groups.{name} without weights", source)
        where = f"config_groups.{name}"
        row = _row(group.get("format") or quant.get("format"), group["weights"], where, source)
        rules.append(Rule(row, f"quantization_config.{where}", targets=_strings(group.get("targets"), where, source),
                          ignore=_strings(quant.get("ignore"), "ignore", source)))
    return tuple(rules)


def _strings(value: object, where: str, source) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(f"{where} {value!r} (a list of module names or patterns)", source)
    return tuple(value)
