"""The formats ckpttool dequantized first: DeepSeek's FP8 128x128 blocks and gpt-oss' MXFP4 experts, and
DeepSeek-V4's MXFP4 experts.

  fp8_block      W (F8_E4M3) + W_scale_inv (F32, one per 128x128 block)  -> W, same shape (DeepSeek V3/R1)
  mxfp4          W_blocks (U8 [E, R, G, 16]) + W_scales (U8 [E, R, G])   -> W, [E, G*32, R] (gpt-oss experts,
                 in the transposed layout transformers' GptOss loads)
  mxfp4_experts  W.weight (I8 [N, K/2], two e2m1 codes a byte, low nibble first) + W.<leaf> (E8M0 [N, K/32])
                 -> W.weight [N, K] (DeepSeek-V4's routed experts, `expert_dtype: fp4`; formats/fp8.py declares it)

MXFP4 values are e2m1(code) * 2**(e - 127), exact, rounded once into the output dtype: transformers'
`convert_moe_packed_tensors` (gpt-oss) and its Fp8Dequantize of int8 experts (DeepSeek-V4) compute the same
numbers (kernels/mxfp4.py).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from ckpttool.dtypes import CARRIERS
from ckpttool.errors import InputError
from ckpttool.formats.row import BY_ROWS, WHOLE, Chunk, Companion, Name, QuantFormat, Side
from ckpttool.kernels import fp8_cpu, grouped, mxfp4_cpu
from ckpttool.kernels.fp8 import BLOCK, FP8_DTYPES, check_scale
from ckpttool.kernels.mxfp4 import VALUES_PER_BLOCK, check_mxfp4

if TYPE_CHECKING:
    import torch

    from ckpttool.kernels.nan_flag import FirstBad


# -- fp8_block ---------------------------------------------------------------------------------------
SCALE_SUFFIX = "_scale_inv"
FP8_SCALE = Companion(hf_leaf="weight" + SCALE_SUFFIX, native_leaf="scale", block=BLOCK)


def _check_fp8(w_shape, sides, names, file) -> None:
    check_scale(w_shape, sides["scale"], tensor=names["scale"], file=file)


def _fp8_cpu(c: Chunk, out: str, into: np.ndarray | None) -> np.ndarray:
    return fp8_cpu.dequant(c.values, c.scale, c.dtype, out, out=into)


def _fp8_cuda(c: Chunk, out_dtype: torch.dtype) -> tuple[torch.Tensor, FirstBad | None]:
    from ckpttool.kernels.fp8 import dequant_fp8_block_lazy

    return dequant_fp8_block_lazy(c.values, c.scale, out_dtype)


def _fp8_example(dev: torch.device) -> Chunk:
    import torch

    return Chunk(torch.zeros(BLOCK, BLOCK, dtype=torch.float8_e4m3fn, device=dev), "F8_E4M3",
                 {"scale": torch.ones(1, 1, device=dev)}, {"scale": "F32"})


FP8_BLOCK = QuantFormat(
    name="fp8_block", title="DeepSeek FP8 128x128 blocks", values=Name("weight"), value_dtypes=FP8_DTYPES,
    sides=(Side("scale", Name(FP8_SCALE.hf_leaf), ("F32",), WHOLE, rows=lambda r0, r1: (r0 // BLOCK, -(-r1 // BLOCK)),
                positive=True),),
    check=_check_fp8, out_shape=lambda shape: shape, companion=FP8_SCALE,
    row_align=BLOCK,
    cpu=_fp8_cpu, cpu_into=True, cuda=_fp8_cuda, example=_fp8_example,
)


# -- mxfp4: experts [E, OUT, G, 16] + [E, OUT, G] -> [E, OUT, IN] -> transformers' [E, IN, OUT] -------------
def _check_mxfp4(b_shape, sides, names, file) -> None:
    if len(b_shape) != 4:
        raise InputError(f"MXFP4 expert blocks must be [E, R, G, 16], got {list(b_shape)}", file=file,
                         tensor=names["scale"])
    check_mxfp4(b_shape, sides["scale"], tensor=names["scale"], file=file)


def _mxfp4_cpu(c: Chunk, out: str, into: np.ndarray | None) -> np.ndarray:
    return mxfp4_cpu.dequant_transposed(c.values, c.scale, out, into)[0]


def _mxfp4_cuda(c: Chunk, out_dtype: torch.dtype) -> tuple[torch.Tensor, None]:
    from ckpttool.kernels.mxfp4 import dequant_mxfp4

    return dequant_mxfp4(c.values, c.scale, out_dtype).transpose(1, 2).contiguous(), None  # a table gather: no NaN


def _mxfp4_example(dev: torch.device) -> Chunk:
    import torch

    return Chunk(torch.zeros(1, 1, 1, 16, dtype=torch.uint8, device=dev), "U8",
                 {"scale": torch.full((1, 1, 1), 127, dtype=torch.uint8, device=dev)}, {"scale": "U8"})


MXFP4 = QuantFormat(
    name="mxfp4", title="MXFP4 (gpt-oss)", values=Name("_blocks", leaf=False), value_dtypes=("U8",),
    sides=(Side("scale", Name("_scales", leaf=False), ("U8",), read=BY_ROWS, encoding="e8m0"),),
    check=_check_mxfp4, out_shape=lambda s: (s[0], s[2] * VALUES_PER_BLOCK, s[1]),
    cpu=_mxfp4_cpu, cpu_into=True, cuda=_mxfp4_cuda, example=_mxfp4_example,
)


# -- mxfp4_experts: DeepSeek-V4's routed experts, [N, K/2] bytes + [N, K/32] E8M0 -> [N, K] --------------------
def _check_experts(w_shape, sides, names, file) -> None:
    if len(w_shape) != 2 or w_shape[1] % (VALUES_PER_BLOCK // 2):
        raise InputError(f"MXFP4 expert weight {list(w_shape)} must be [N, K/2] with K a multiple of "
                         f"{VALUES_PER_BLOCK}", file=file, tensor=names["scale"])
    want = (w_shape[0], w_shape[1] * 2 // VALUES_PER_BLOCK)
    if tuple(sides["scale"]) != want:
        raise InputError(f"scale shape {list(sides['scale'])} does not match weight shape {list(w_shape)}: "
                         f"expected {list(want)} (one E8M0 scale per {VALUES_PER_BLOCK} values)", file=file,
                         tensor=names["scale"], fix="re-download the checkpoint; the scale does not belong to this weight")


def _experts_cpu(c: Chunk, out: str, into: np.ndarray | None) -> np.ndarray:
    table = mxfp4_cpu.pair_table(out)
    rows, width = c.values.shape
    words = np.empty((rows, width), dtype=table.dtype)
    grouped.gather(c.values.view(np.uint8), np.ascontiguousarray(c.scale.view(np.uint8)), table,
                   VALUES_PER_BLOCK // 2, words)
    return words.view(CARRIERS[out]).reshape(rows, width * 2)


def _experts_cuda(c: Chunk, out_dtype: torch.dtype) -> tuple[torch.Tensor, None]:
    import torch

    from ckpttool.kernels.mxfp4 import dequant_mxfp4

    rows, width = c.values.shape
    blocks = c.values.view(torch.uint8).reshape(rows, -1, VALUES_PER_BLOCK // 2)
    return dequant_mxfp4(blocks, c.scale.view(torch.uint8), out_dtype).reshape(rows, width * 2), None


def _experts_example(dev: torch.device) -> Chunk:
    import torch

    return Chunk(torch.zeros(1, 16, dtype=torch.int8, device=dev), "I8",
                 {"scale": torch.full((1, 1), 127, dtype=torch.uint8, device=dev)}, {"scale": "U8"})


def mxfp4_rows(*, name: str, title: str, values: Name, value_dtypes: tuple[str, ...], leaf: str) -> QuantFormat:
    """A row of MXFP4 stored by output rows: [N, K/2] bytes (two e2m1 codes, low nibble first) and E8M0 scales
    `X.<leaf>` [N, K/32] (DeepSeek-V4's experts; compressed-tensors' mxfp4-pack-quantized)."""
    return QuantFormat(
        name=name, title=title, values=values, value_dtypes=value_dtypes,
        sides=(Side("scale", Name(leaf), ("F8_E8M0", "U8"), BY_ROWS, encoding="e8m0"),),
        check=_check_experts, out_shape=lambda s: (s[0], s[1] * 2), cpu=_experts_cpu, cuda=_experts_cuda,
        example=_experts_example, keepable=False)


@functools.lru_cache(maxsize=None)
def mxfp4_experts_row(leaf: str) -> QuantFormat:
    """DeepSeek-V4's MXFP4 routed experts, their E8M0 scales named `X.<leaf>`."""
    return mxfp4_rows(name=f"mxfp4_experts:{leaf}", title="MXFP4 experts (DeepSeek-V4)", values=Name("weight"),
                      value_dtypes=("I8",), leaf=leaf)
