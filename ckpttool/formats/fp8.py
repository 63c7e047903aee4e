"""FP8 as transformers reads it (`quant_method: fp8`, its FineGrainedFP8Config) and as vLLM reads AutoFP8's and
fbgemm's, one row per layout; and the rules such a config declares.

  fp8_block:{b0}x{b1}:{float|ue8m0}:{leaf}  X.weight (F8_E4M3) + X.<leaf>, one scale per b0 x b1 block: F32, or
                                           under `scale_fmt: ue8m0` E8M0 bytes (F8_E8M0 or U8; DeepSeek-V3.1's F32
                                           powers of two too). DeepSeek V3 (128x128, `weight_scale_inv`, the
                                           canonical row formats.FP8_BLOCK), V4 (`scale`), V4.1 (32x32), MXFP8
                                           ([1, 32], U8), Mistral Large 4 (`qscale_weight`)
  fp8_tensor:{leaf}                        X.weight + X.<leaf> F32 [] or [1]: one scale for the tensor (AutoFP8 and
                                           vLLM's `weight_scale`, transformers' `weight_scale_inv` without blocks)
  fp8_channel:{leaf}                       X.weight + X.<leaf> F32 [N, 1] or [N]: one scale per output row (fbgemm)

Formula, every row (transformers' Fp8Dequantize._dequantize_one, which defines it): out = round(fp32(code) *
fp32(scale)), one fp32 multiply and one round to nearest even into the output dtype; E8M0 byte k is 2**(k - 127)
(0xFF, NaN in OCP's E8M0, is refused with every non-finite scale). Blocks are counted by ceiling division: for a
weight whose rows are not a multiple of the block, transformers' own dequant (which takes `rows // scale_rows`
rows a block) differs, and DeepSeek's reference scripts agree with us (README, verify/oracle.py).
Activation scales (`input_scale`, `activation_scale`, fbgemm's `input_scale_ub`) are dropped with the
quantization.
"""

from __future__ import annotations

import functools
import re

import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats.blocks import FP8_BLOCK, mxfp4_experts_row
from ckpttool.formats.resolve import Rule
from ckpttool.formats.row import DROPPED, WHOLE, Chunk, Companion, Name, QuantFormat, Side
from ckpttool.kernels import grouped, scaled_cpu
from ckpttool.kernels.fp8 import FP8_DTYPES
from ckpttool.kernels.fp8_cpu import NAN_ABOVE, NaNCodes, dequant_scaled, fp8_values, value_tables
from ckpttool.kernels.fp8_gather import nan_row

METHODS = ("fp8", "fbgemm_fp8")
SCALE_LEAVES = ("weight_scale_inv", "scale", "qscale_weight")
"""where transformers finds an FP8 block scale (its update_weight_conversions renames the last two)"""
_ACTIVATION = ("input_scale", "activation_scale", "input_scale_ub")
E8M0 = ("F8_E8M0", "U8")


def _dropped(*leaves: str) -> tuple[Side, ...]:
    return tuple(Side(leaf, Name(leaf), read=DROPPED) for leaf in leaves)


# -- blocks of any size ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def e8m0_tables(fmt: str, out: str) -> np.ndarray:
    """[256 * 256] output words: entry (k << 8 | code) is FP8 `code` times 2**(k - 127), as value_tables
    computes every product (k = 0xFF gives NaN tables; such scales are refused before a kernel runs)."""
    with np.errstate(over="ignore"):
        scales = np.ldexp(np.float32(1.0), np.arange(256) - 127).astype(np.float32)
    scales[255] = np.nan
    return value_tables(fp8_values(fmt), scales, out).reshape(-1)


def _block_cpu(block: tuple[int, int]):
    def cpu(c: Chunk, out: str, into: np.ndarray | None) -> np.ndarray:
        codes, scale = c.values, c.scale
        rows, cols = codes.shape
        result = np.empty((rows, cols), dtype=np.dtype(f"u{2 if out != 'F32' else 4}")) if into is None \
            else into.view(np.dtype(f"u{2 if out != 'F32' else 4}")).reshape(rows, cols)
        if not result.size:
            return result
        # computed per element (BF16: a lookup per group, 2x the tables' gather), or for F32 out where a table per
        # scale would cost more than its elements (1x128, 1x32, 32x32 F32 blocks)
        e8m0 = c.side_dtypes["scale"] in E8M0
        if (out == "BF16" or (not e8m0 and scale.size * 256 * 8 > result.size)) and dequant_scaled(
                codes, _E8M0_F32[scale.view(np.uint8)] if e8m0 else scale, c.dtype, "F32", out, result, b0=block[0],
                group=block[1]):
            return result
        bad = nan_row(codes, NAN_ABOVE[c.dtype])
        if bad >= 0:
            raise NaNCodes(bad)
        block_rows = np.arange(rows) // block[0]
        if c.side_dtypes["scale"] in E8M0:
            which, tables = np.ascontiguousarray(scale.view(np.uint8)[block_rows]), e8m0_tables(c.dtype, out)
        else:
            index, tables = _distinct_tables(scale, c.dtype, out)
            which = np.ascontiguousarray(index[block_rows])
        grouped.gather(codes, which, tables, block[1], result)
        return result
    return cpu


with np.errstate(over="ignore"):
    _E8M0_F32 = np.ldexp(np.float32(1.0), np.arange(256) - 127).astype(np.float32)
_E8M0_F32[255] = np.nan  # refused by the scale check before a kernel runs (dequant_scaled then declines)


def _distinct_tables(scale: np.ndarray, fmt: str, out: str) -> tuple[np.ndarray, np.ndarray]:
    """(each element's index into the tables, the tables): one per distinct F32 scale, as value_tables makes them."""
    values, index = scaled_cpu.distinct(scale)
    return index, value_tables(fp8_values(fmt), values.astype(np.float32), out).reshape(-1)


def _gather_cuda(codes, which, table: np.ndarray, group: int, out_dtype):
    """The CPU's tables gathered on the GPU (kernels/grouped.gather_torch): the same bits by construction."""
    import torch

    tables = torch.from_numpy(table.view(table.dtype.str.replace("u", "i"))).to(codes.device)
    return grouped.gather_torch(codes, which, tables, group).view(out_dtype), None  # NaN codes: the CPU's test only


def _block_cuda(block: tuple[int, int]):
    def cuda(c: Chunk, out_dtype):
        import torch

        from ckpttool.dtypes import dtype_code

        codes = c.values.view(torch.uint8)
        block_rows = torch.arange(codes.shape[0], device=codes.device) // block[0]
        if c.side_dtypes["scale"] in E8M0:
            return _gather_cuda(codes, c.scale.view(torch.uint8)[block_rows], e8m0_tables(c.dtype, dtype_code(out_dtype)),
                                block[1], out_dtype)
        index, table = _distinct_tables(c.scale.cpu().numpy(), c.dtype, dtype_code(out_dtype))
        return _gather_cuda(codes, torch.from_numpy(index).to(codes.device)[block_rows], table, block[1], out_dtype)
    return cuda


def _block_check(block: tuple[int, int]):
    def check(w_shape, sides, names, file) -> None:
        if len(w_shape) != 2:
            raise InputError(f"FP8 block weight must be 2-D, got shape {list(w_shape)}", file=file,
                             tensor=names["scale"])
        want = (-(-w_shape[0] // block[0]), -(-w_shape[1] // block[1]))
        if tuple(sides["scale"]) != want:
            raise InputError(f"scale shape {list(sides['scale'])} does not match weight shape {list(w_shape)}: "
                             f"expected {list(want)} for {block[0]}x{block[1]} blocks", file=file,
                             tensor=names["scale"],
                             fix="re-download the checkpoint, or fix config.json's weight_block_size")
    return check


@functools.lru_cache(maxsize=None)
def block_row(b0: int, b1: int, scale_fmt: str, leaf: str) -> QuantFormat:
    """The row of FP8 blocks of b0 x b1 with scales `X.<leaf>` (FP8_BLOCK itself for DeepSeek-V3's)."""
    if (b0, b1, scale_fmt, leaf) == (128, 128, "float", "weight_scale_inv"):
        return FP8_BLOCK
    block = (b0, b1)

    def example(dev) -> Chunk:
        import torch

        return Chunk(torch.zeros(b0, b1, dtype=torch.float8_e4m3fn, device=dev), "F8_E4M3",
                     {"scale": torch.ones(1, 1, device=dev)}, {"scale": "F32"})

    companion = mp_companion(block, leaf)
    return QuantFormat(
        name=f"fp8_block:{b0}x{b1}:{scale_fmt}:{leaf}",
        title=f"FP8 {b0}x{b1} blocks" + (" (E8M0 scales)" if scale_fmt == "ue8m0" else ""),
        values=Name("weight"), value_dtypes=FP8_DTYPES,
        sides=(Side("scale", Name(leaf), ("F32", *E8M0) if scale_fmt == "ue8m0" else ("F32",), WHOLE,
                    rows=lambda r0, r1: (r0 // b0, -(-r1 // b0)), encoding="e8m0", positive=True),
               *_dropped("activation_scale")),
        check=_block_check(block), out_shape=lambda s: s, row_align=b0, cpu=_block_cpu(block), cpu_into=True,
        cuda=_block_cuda(block), example=example, keepable=companion is not None, companion=companion)


MP_BLOCKS = {(FP8_BLOCK.companion.block,) * 2: FP8_BLOCK.companion}
"""block -> the mp layout's companion of such a block's scale: `X.<leaf>` <-> `Y.scale` (DeepSeek's model and its
convert.py keep FP8 128x128 weights beside their scale, F32 or E8M0, per rank). The key tables' scale rows and the
shard stage's cuts are of one block, 128x128: a weight of other blocks (V4.1's 32x32, 1x128) is dequantized or
kept in the HF layout, never cut per rank."""
MP_SCALE_LEAVES = (FP8_BLOCK.companion.hf_leaf, "scale")
"""the scale leaves the families' key tables name (the companions' `weight_scale_inv`, DeepSeek-V4's `scale`); a
scale stored under another (Mistral Large 4's `qscale_weight`) has no mp row"""


def mp_companion(block: tuple[int, int], leaf: str) -> Companion | None:
    """How the mp layout names the scale of FP8 `block` blocks stored as `X.<leaf>`, or None where it cannot."""
    row = MP_BLOCKS.get(tuple(block))
    if row is None or leaf not in MP_SCALE_LEAVES:
        return None
    return Companion(hf_leaf=leaf, native_leaf=row.native_leaf, block=row.block)


# -- one scale per tensor or per row ---------------------------------------------------------------------
def _scaled_check(per: str):
    def check(w_shape, sides, names, file) -> None:
        s_shape = tuple(sides["scale"])
        ok = s_shape in ((), (1,)) if per == "tensor" else s_shape in ((w_shape[0],), (w_shape[0], 1))
        if len(w_shape) != 2 or not ok:
            want = "[] or [1]" if per == "tensor" else f"[{w_shape[0]}] or [{w_shape[0]}, 1]"
            raise InputError(f"scale shape {list(s_shape)} for weight {list(w_shape)}: expected {want} (one scale "
                             f"per {per})", file=file, tensor=names["scale"],
                             fix="re-download the checkpoint, or fix config.json's quantization_config")
    return check


def _scaled_cpu(c: Chunk, out: str, into) -> np.ndarray:
    scale = c.scale.reshape(-1, 1) if c.scale.ndim < 2 else c.scale
    return scaled_cpu.dequant_fp8_rows(c.values, scale, c.dtype, c.side_dtypes["scale"], out)


def _scaled_cuda(c: Chunk, out_dtype):
    """One table per distinct F32 scale, gathered on the GPU (the Triton rows kernel reads BF16 scales only)."""
    import torch

    from ckpttool.dtypes import dtype_code

    codes = c.values.view(torch.uint8)
    index, table = _distinct_tables(c.scale.reshape(-1).cpu().numpy(), c.dtype, dtype_code(out_dtype))
    which = torch.from_numpy(index).to(codes.device).reshape(-1, 1).expand(codes.shape[0], 1)
    return _gather_cuda(codes, which, table, max(codes.shape[1], 1), out_dtype)


@functools.lru_cache(maxsize=None)
def scaled_row(per: str, leaf: str) -> QuantFormat:
    """FP8 with one F32 scale per tensor or per output row, named `X.<leaf>`."""
    def example(dev) -> Chunk:
        import torch

        return Chunk(torch.zeros(1, 2, dtype=torch.float8_e4m3fn, device=dev), "F8_E4M3",
                     {"scale": torch.ones(1, 1, dtype=torch.float32, device=dev)}, {"scale": "F32"})

    rows = (lambda r0, r1: (r0, r1)) if per == "channel" else (lambda r0, r1: (0, 1))
    return QuantFormat(
        name=f"fp8_{per}:{leaf}", title=f"FP8 per {per}", values=Name("weight"), value_dtypes=FP8_DTYPES,
        sides=(Side("scale", Name(leaf), ("F32",), WHOLE, rows=rows), *_dropped(*_ACTIVATION)),
        check=_scaled_check(per), out_shape=lambda s: s, cpu=_scaled_cpu, cuda=_scaled_cuda, example=example,
        keepable=False)


_NAMED = {"fp8_block": re.compile(r"(\d+)x(\d+):(float|ue8m0):(\w+)"), "fp8_tensor": re.compile(r"(\w+)"),
          "fp8_channel": re.compile(r"(\w+)"), "mxfp4_experts": re.compile(r"(\w+)")}


def named(name: str) -> QuantFormat | None:
    """The row a plan's transform name stands for (the rows here are made for each config's parameters)."""
    kind, _, args = name.partition(":")
    m = _NAMED[kind].fullmatch(args) if kind in _NAMED else None
    if m is None:
        return None
    if kind == "fp8_block":
        return block_row(int(m[1]), int(m[2]), m[3], m[4])
    if kind == "mxfp4_experts":
        return mxfp4_experts_row(m[1])
    return scaled_row(kind.removeprefix("fp8_"), m[1])


# -- config.json ------------------------------------------------------------------------------------------
EXPERTS = "re:.*\\.experts\\.\\d+\\."
"""routed experts, one module each (`...mlp.experts.7.gate_proj`, DeepSeek's `...ffn.experts.7.w1`)"""


def _refuse(what: str, source) -> InputError:
    return InputError(f"quantization_config {what} is not a layout ckpttool reads", file=source,
                      fix="ckpttool reads quant_method fp8 with weight_block_size [rows, cols] or none, scale_fmt "
                          "float or ue8m0 and expert_dtype fp8 or fp4, and fbgemm_fp8; dequantize this "
                          "checkpoint with the library that wrote it")


def declared(quant: dict, source) -> tuple[Rule, ...]:
    """The rules of a transformers FP8 config (`fp8`, `fbgemm_fp8`), read as its quantizer reads them: blocks
    of weight_block_size (absent: 128x128, transformers' default, or one scale per tensor as AutoFP8 writes),
    scale_fmt, expert_dtype fp4 (MXFP4 routed experts), and the modules it leaves out."""
    ignore = tuple(v for key in ("modules_to_not_convert", "ignored_layers")
                   for v in (quant.get(key) or []) if isinstance(v, str))
    origin = "quantization_config"
    if quant.get("quant_method") == "fbgemm_fp8":
        return (Rule(scaled_row("channel", "weight_scale"), origin, ignore=ignore),)
    scale_fmt = quant.get("scale_fmt", "float")
    expert_dtype = quant.get("expert_dtype", "fp8")
    if scale_fmt not in ("float", "ue8m0") or expert_dtype not in ("fp8", "fp4") or quant.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"scale_fmt {scale_fmt!r}, expert_dtype {expert_dtype!r}, fmt {quant.get('fmt')!r}", source)
    block = quant.get("weight_block_size")
    if block is None:
        rules = [Rule(scaled_row("tensor", leaf), origin, ignore=ignore) for leaf in ("weight_scale", "weight_scale_inv")]
        if "weight_block_size" not in quant:  # transformers' default, where AutoFP8 means one scale per tensor
            rules.append(Rule(block_row(128, 128, scale_fmt, "weight_scale_inv"), origin, ignore=ignore))
    elif isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
        rules = [Rule(block_row(block[0], block[1], scale_fmt, leaf), origin, ignore=ignore) for leaf in SCALE_LEAVES]
    else:
        raise _refuse(f"weight_block_size {block!r}", source)
    if expert_dtype == "fp4":
        rules = [Rule(r.row, r.origin, ignore=(*ignore, EXPERTS)) for r in rules]
        rules += [Rule(mxfp4_experts_row(leaf), f"{origin} expert_dtype fp4", targets=(EXPERTS,), ignore=ignore)
                  for leaf in SCALE_LEAVES]
    return tuple(rules)
