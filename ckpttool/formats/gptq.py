"""GPTQ (`quant_method: gptq`, as gptqmodel, AutoGPTQ and optimum write it), one row per (bits, group size,
checkpoint_format, desc_act), and the rules such a config declares.

  gptq:b{4|8}:g{G|-1}:{gptq|gptq_v2}[:desc_act]
      X.qweight I32 [K * bits / 32, N]  codes packed along the input dim, lowest bits first
      X.qzeros  I32 [groups, N * bits / 32]  zero points packed along N; checkpoint_format gptq (v1) stores
                zero - 1, which gptqmodel undoes by adding 0x11111111 (8 bits: 0x01010101) to each word, carries
                and all (convert_gptq_v1_to_v2_format), and so do we
      X.scales  F16 [groups, N]
      X.g_idx   I32 [K]  each input column's group: honoured as stored under desc_act; without it, it must be
                k // group_size, since GPTQ's other kernels (exllama, marlin) assume so
  -> X.weight [N, K], nn.Linear's layout: output row n is stored column n (streamed as column spans).

Formula (gptqmodel's TorchLinear.dequantize_weight, what transformers 5.24 runs on a CPU): weight[k, n] =
fp16(scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])), then one rounding to the output dtype. gptqmodel
needs torch >= 2.14 and will not install beside this project's torch, so the tests copy its pack and dequantize
as the spec (tests/gptq_builders.py, checked against gptqmodel itself where it imports). sym does not change
the arithmetic (symmetric checkpoints store their constant zero points too). Refused by name: bits 2, 3 and
5-7, the marlin/bitblas/qqq/gptq_p checkpoint formats, pack_dtype other than int32, per-module `dynamic`
overrides. Shard keeping GPTQ: refused (packed groups are not cut per rank).
"""

from __future__ import annotations

import functools
import re

import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats.resolve import Rule
from ckpttool.formats.row import BY_ROWS, WHOLE, Chunk, Name, QuantFormat, Side
from ckpttool.kernels import packed

METHOD = "gptq"
FORMATS = ("gptq", "gptq_v2")
V1_OFFSET = {4: 0x11111111, 8: 0x01010101}
"""what gptqmodel adds to each v1 qzeros word (zero - 1 stored) to make it v2"""


def groups_of(k: int, group: int) -> int:
    return 1 if group == -1 else -(-k // group)


def _refuse_shape(what: str, names, file, fix: str = "re-download the checkpoint, or fix config.json's "
                  "quantization_config (bits, group_size)") -> InputError:
    return InputError(what, file=file, tensor=names.get("scale"), fix=fix)


def _check(bits: int, group: int):
    per = 32 // bits

    def check(w_shape, sides, names, file) -> None:
        if len(w_shape) != 2:
            raise _refuse_shape(f"GPTQ qweight must be 2-D, got shape {list(w_shape)}", names, file)
        k, n = w_shape[0] * per, w_shape[1]
        if n % per:
            raise _refuse_shape(f"GPTQ weight has {n} output features, not a multiple of {per}: its qzeros "
                                "words would be part padding, which ckpttool does not read", names, file,
                                fix="dequantize this checkpoint with gptqmodel itself")
        g = groups_of(k, group)
        want = {"scale": (g, n), "zero": (g, n // per), "g_idx": (k,)}
        for role, shape in want.items():
            if tuple(sides[role]) != shape:
                raise InputError(f"{role} shape {list(sides[role])} does not match qweight {list(w_shape)}: expected "
                                 f"{list(shape)} for {bits}-bit codes in groups of {group} ({k} inputs, {n} outputs)",
                                 file=file, tensor=names[role], fix="re-download the checkpoint, or fix config.json's "
                                 "quantization_config (bits, group_size)")
    return check


def _g_idx_check(bits: int, group: int, desc_act: bool):
    def check(values: np.ndarray, shapes: dict[str, tuple]) -> str | None:
        count = shapes["scale"][0]
        g = values.astype(np.int64, copy=False)
        if g.size and (int(g.min()) < 0 or int(g.max()) >= count):
            bad = int(np.flatnonzero((g < 0) | (g >= count))[0])
            return f"g_idx[{bad}] is {int(g[bad])}, outside the {count} groups of scales"
        if not desc_act and group != -1 and not np.array_equal(g, np.arange(g.size) // group):
            bad = int(np.flatnonzero(g != np.arange(g.size) // group)[0])
            return (f"g_idx[{bad}] is {int(g[bad])}, not {bad} // {group}, while quantization_config says desc_act "
                    "false: GPTQ's kernels disagree on such a checkpoint (some read g_idx, some k // group_size)")
        return None
    return check


def _prepare(c: Chunk, bits: int, version: str, out: str):
    """(tables, off [rows, groups], group of each word or None, group of each column) for a chunk."""
    zeros = c.sides["zero"].view(np.uint32)
    if version == "gptq":
        zeros = zeros + np.uint32(V1_OFFSET[bits])  # wraps as torch's int32 add does
    z = packed.unpack(zeros, bits)  # [groups, rows]
    table, off = packed.tables(c.scale.view(np.uint16).T, z.T, bits, out)
    g_idx = np.ascontiguousarray(c.sides["g_idx"], dtype=np.int32)
    per = 32 // bits
    by_word = g_idx.reshape(-1, per)
    word_groups = np.ascontiguousarray(by_word[:, 0]) if (by_word == by_word[:, :1]).all() else None
    return table, off, word_groups, g_idx


def _cpu(bits: int, version: str):
    def cpu(c: Chunk, out: str, into: np.ndarray | None) -> np.ndarray:
        words = np.ascontiguousarray(c.values)
        rows, k = words.shape[1], words.shape[0] * (32 // bits)
        dtype = packed.carrier(out)
        result = np.empty((rows, k), dtype=dtype) if into is None else into.view(dtype).reshape(rows, k)
        if result.size and packed.computed():
            scales = np.ascontiguousarray(c.scale).view(np.uint16)
            zeros, add = np.ascontiguousarray(c.sides["zero"]).view(np.uint32), V1_OFFSET[bits] if version == "gptq" else 0
            g_idx = np.ascontiguousarray(c.sides["g_idx"], dtype=np.int32)
            contiguous = bits == 4 and k % scales.shape[0] == 0 and \
                np.array_equal(g_idx, packed.contiguous_groups(k, k // scales.shape[0]))
            if not (contiguous and packed.shuffled(words, scales, zeros, add, out, result)):
                packed.lanes(words, bits, scales, zeros, add, g_idx, out, result)
        elif result.size:
            table, off, word_groups, g_idx = _prepare(c, bits, version, out)
            packed.cols(words, True, bits, off, word_groups, g_idx, table, result)
        return result
    return cpu


def _cuda(bits: int, version: str):
    def cuda(c: Chunk, out_dtype):
        import torch

        from ckpttool.dtypes import dtype_code

        host = Chunk(None, c.dtype, {r: v.cpu().numpy() for r, v in c.sides.items()}, c.side_dtypes)
        table, off, _, g_idx = _prepare(host, bits, version, dtype_code(out_dtype))
        dev = c.values.device
        signed = torch.from_numpy(table.view(table.dtype.str.replace("u", "i"))).to(dev)
        codes = packed.unpack_torch(c.values.T.contiguous(), bits)
        y = packed.gather_torch(codes, torch.from_numpy(off).to(dev), torch.from_numpy(g_idx).to(dev), signed)
        return y.view(out_dtype), None
    return cuda


@functools.lru_cache(maxsize=None)
def gptq_row(bits: int, group: int, version: str, desc_act: bool) -> QuantFormat:
    """The row of GPTQ `bits`-bit codes in groups of `group` (-1: one group), checkpoint_format `version`."""
    per = 32 // bits

    def example(dev) -> Chunk:
        import torch

        k = per * max(1, group if group > 0 else 1)
        return Chunk(torch.zeros(k // per, per, dtype=torch.int32, device=dev), "I32",
                     {"scale": torch.ones(1, per, dtype=torch.float16, device=dev),
                      "zero": torch.zeros(1, 1, dtype=torch.int32, device=dev),
                      "g_idx": torch.zeros(k, dtype=torch.int32, device=dev)},
                     {"scale": "F16", "zero": "I32", "g_idx": "I32"})

    return QuantFormat(
        name=f"gptq:b{bits}:g{group}:{version}" + (":desc_act" if desc_act else ""),
        title=f"GPTQ {bits}-bit (group {group}, {version}{', desc_act' if desc_act else ''})",
        values=Name("qweight"), value_dtypes=("I32",),
        sides=(Side("scale", Name("scales"), ("F16",), BY_ROWS, axis=-1),
               Side("zero", Name("qzeros"), ("I32",), BY_ROWS, rows=lambda r0, r1: (r0 // per, -(-r1 // per)), axis=-1),
               Side("g_idx", Name("g_idx"), ("I32", "I64"), WHOLE, rows=lambda r0, r1: (0, None),
                    check_values=_g_idx_check(bits, group, desc_act))),
        check=_check(bits, group), out_shape=lambda s: (s[1], s[0] * per), row_align=per,
        source_span=lambda r0, r1, shape: (-1, r0, r1), cpu=_cpu(bits, version), cpu_into=True,
        cuda=_cuda(bits, version), example=example, keepable=False)


_NAME = re.compile(r"gptq:b(4|8):g(-1|[1-9]\d*):(gptq|gptq_v2)(:desc_act)?")


def named(name: str) -> QuantFormat | None:
    """The row a plan's transform name stands for, or None."""
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    return gptq_row(int(m[1]), int(m[2]), m[3], bool(m[4])) if m else None


# -- config.json ------------------------------------------------------------------------------------------
def _refuse(what: str, source) -> InputError:
    return InputError(f"GPTQ quantization_config {what} is not a layout ckpttool reads", file=source,
                      fix="ckpttool reads GPTQ with bits 4 or 8, checkpoint_format gptq or gptq_v2, int32 words and "
                          "no per-module `dynamic` overrides; dequantize this checkpoint with gptqmodel itself")


def declared(quant: dict, source) -> tuple[Rule, ...]:
    """The rule of a GPTQ quantization_config, read as gptqmodel's QuantizeConfig reads it (`checkpoint_format`,
    or `format` in newer configs; group_size -1 for one group; desc_act)."""
    bits, group = quant.get("bits"), quant.get("group_size", 128)
    fmt = quant.get("checkpoint_format") or quant.get("format") or "gptq"
    if bits not in (4, 8) or isinstance(bits, bool):
        raise _refuse(f"bits {bits!r}", source)
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
        raise _refuse(f"group_size {group!r}", source)
    if not isinstance(fmt, str) or fmt.lower() not in FORMATS:
        raise _refuse(f"checkpoint_format {fmt!r}", source)
    if quant.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise _refuse(f"pack_dtype {quant.get('pack_dtype')!r}", source)
    if quant.get("dynamic"):
        raise _refuse(f"dynamic {quant['dynamic']!r} (per-module bits or group sizes)", source)
    desc_act = quant.get("desc_act", False)
    if not isinstance(desc_act, bool):
        raise _refuse(f"desc_act {desc_act!r}", source)
    return (Rule(gptq_row(bits, group, fmt.lower(), desc_act), "quantization_config"),)
