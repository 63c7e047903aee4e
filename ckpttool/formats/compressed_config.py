"""Which rows a compressed-tensors `quantization_config` declares (`quant_method: compressed-tensors`): one per
config group, over its `targets`, less the config's `ignore`, each read as the library's QuantizationArgs reads its
`weights` (its defaults: 8-bit int, symmetric, strategy from group_size). The rows are in formats/compressed.py and
formats/compressed_int.py; anything else is refused by name, saying what the config asks for.
"""

from __future__ import annotations

from ckpttool.errors import InputError
from ckpttool.formats.compressed import (CT_FP8_CHANNEL, CT_FP8_TENSOR, CT_INT4, CT_MXFP4, CT_NVFP4, fp8_block_row,
                                         fp8_group_row)
from ckpttool.formats.compressed_int import int_row
from ckpttool.formats.resolve import Rule
from ckpttool.formats.row import QuantFormat

METHOD = "compressed-tensors"
_ACTORDER = {None: False, False: False, "weight": False, "static": False, "group": True, "dynamic": True, True: True}
"""actorder -> whether the weights carry a group index: `weight`/`static` reorder only during calibration and store
the tensors of no act-order; `group` (`dynamic`, `true` in configs before 0.12) stores weight_g_idx"""
_INT_FORMATS = {"pack-quantized": ("pack", (4, 8)), "int-quantized": ("int", (8,)), "naive-quantized": ("int", (8,))}
_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


def _refuse(what: str, source) -> InputError:
    return InputError(f"compressed-tensors {what} is not a format ckpttool reads", file=source,
                      fix="ckpttool dequantizes compressed-tensors pack-quantized INT4 and INT8 and int-quantized INT8 "
                          "(group, channel or tensor; zero points; act-order), float-quantized FP8 (channel, tensor, "
                          "group or block), nvfp4-pack-quantized and mxfp4-pack-quantized; load this checkpoint with "
                          "compressed-tensors itself")


def _block(value: object) -> tuple[int, int] | None:
    """block_structure as QuantizationArgs accepts it: [rows, cols] of positive ints, or "RxC"."""
    if isinstance(value, str):
        value = value.split("x")
        if not all(v.isdigit() for v in value):
            return None
        value = [int(v) for v in value]
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int and v > 0 for v in value):
        return value[0], value[1]
    return None


def _row(fmt: object, w: dict, where: str, source) -> QuantFormat:
    """The row for one config group's weights."""
    num_bits, kind = w.get("num_bits", 8), w.get("type", "int")
    symmetric, group = w.get("symmetric", True), w.get("group_size")
    strategy = w.get("strategy") or ("tensor" if group is None else "channel" if group == -1 else "group")
    actorder = w.get("actorder")
    args = f"{where}: format {fmt!r}, {num_bits}-bit {kind}, strategy {strategy}" + (
        f", group {group}" if strategy in ("group", "tensor_group") else "") + ("" if symmetric else ", zero points")
    if w.get("dynamic") not in (None, False):
        raise _refuse(f"{args} with dynamic weights (no stored scales)", source)
    if not isinstance(actorder, (str, bool, type(None))) or actorder not in _ACTORDER:
        raise _refuse(f"{args}, actorder {actorder!r}", source)
    gidx = _ACTORDER[actorder]
    if type(num_bits) is not int or type(symmetric) is not bool or (group is not None and type(group) is not int):
        raise _refuse(f"{args} (num_bits, symmetric and group_size must be an int, a bool and an int)", source)
    grouped = strategy == "group" and group is not None and group > 0
    if gidx and not grouped:
        raise _refuse(f"{args}, actorder {actorder!r} without groups", source)
    if fmt in _INT_FORMATS and kind == "int" and num_bits in _INT_FORMATS[fmt][1] and \
            (grouped or strategy in ("channel", "tensor")):
        storage = _INT_FORMATS[fmt][0]
        if (storage, num_bits, symmetric, gidx) == ("pack", 4, True, False) and grouped and group in CT_INT4:
            return CT_INT4[group]  # issue 16's rows, under their names
        return int_row(storage, num_bits, strategy, group if grouped else 0, not symmetric, gidx)
    if fmt in _FLOAT_FORMATS and (num_bits, kind, symmetric, gidx) == (8, "float", True, False):
        if strategy in ("channel", "tensor"):
            return CT_FP8_CHANNEL if strategy == "channel" else CT_FP8_TENSOR
        if grouped:
            return fp8_group_row(group)
        if strategy == "block" and (block := _block(w.get("block_structure"))):
            return fp8_block_row(*block)
        raise _refuse(f"{args}, block_structure {w.get('block_structure')!r}", source)
    if symmetric and not gidx:
        if fmt == "nvfp4-pack-quantized" and (num_bits, kind, strategy, group) == (4, "float", "tensor_group", 16):
            return CT_NVFP4
        if fmt == "mxfp4-pack-quantized" and (num_bits, kind, strategy, group) == (4, "float", "group", 32):
            return CT_MXFP4
    raise _refuse(args, source)


def declared(quant: dict, source) -> tuple[Rule, ...]:
    """The rules a compressed-tensors quantization_config declares; anything else is refused by name."""
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
