"""Quantization formats, one row each: the one place a format is described.

A dequant row says what the published tensors are called and what dtypes they have, how they are
checked at plan time, how they are dequantized (numpy on the CPU, Triton on CUDA, the same bits) and
how the mp layout names the scale beside a weight. The planner (plan/dequant.py), the executor, the
families' key tables (scale rows are derived from `Companion`) and verify's loaders read these rows;
adding a format is one row here plus its kernel in kernels/.

  fp8_block  W (F8_E4M3) + W_scale_inv (F32, one per 128x128 block)  -> W, same shape (DeepSeek V3/R1)
  mxfp4      W_blocks (U8 [E, R, G, 16]) + W_scales (U8 [E, R, G])   -> W, [E, G*32, R] (gpt-oss experts,
             in the transposed layout transformers' GptOss loads)

Each dequant transform works on a run of dim-0 rows of its source, so the executor can stream any
tensor in bounded chunks: `row_align` is the smallest run it can take (an FP8 scale covers 128 rows),
and `scale_rows` says which rows of the scale tensor those source rows need.

The quantize stage's output formats (fp8_block, int8, int4) are the second table, at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ckpttool.errors import InputError
from ckpttool.kernels import fp8_cpu, mxfp4_cpu
from ckpttool.kernels.fp8 import BLOCK, FP8_DTYPES, check_scale, quantize_fp8_block
from ckpttool.kernels.mxfp4 import VALUES_PER_BLOCK, check_mxfp4
from ckpttool.kernels.quant import INT4_GROUP_SIZES, pack_int4, quantize_int4_grouped, quantize_int8_per_channel

if TYPE_CHECKING:
    import torch

def with_leaf(name: str, leaf: str) -> str:
    """`a.b.weight` -> `a.b.<leaf>`: how a weight's companion tensors are named in every format."""
    if not name.endswith("weight"):
        raise ValueError(f"{name!r} is not a weight name")
    return name[: -len("weight")] + leaf


@dataclass(frozen=True, slots=True)
class Companion:
    """A scale stored beside its weight `X.weight`: `X.<hf_leaf>` in HF checkpoints, `Y.<native_leaf>`
    in the mp layout (Y.weight being the weight's mp name), one value per `block` x `block` weights.
    Key tables derive the scale's row from the weight's row with this, so no code builds the name by
    hand."""

    hf_leaf: str
    native_leaf: str
    block: int

    def scale_range(self, start: int, length: int) -> tuple[int, int]:
        """The (start, length) of scale rows/columns covering weight rows/columns [start, start + length)."""
        return start // self.block, -(-length // self.block)


@dataclass(frozen=True, kw_only=True)
class QuantFormat:
    name: str
    """recorded as TensorPlan.transform"""
    weight_suffix: str
    """appended to the dequantized name to get the stored weight's name"""
    scale_suffix: str
    """appended to the dequantized name to get the stored scales' name"""
    weight_dtypes: tuple[str, ...]
    scale_dtype: str
    check: Callable[[tuple, tuple, str, object], None]
    """(weight shape, scale shape, scale tensor name, file) -> None or InputError"""
    out_shape: Callable[[tuple], tuple]
    companion: Companion | None
    """how the mp layout names the scale when the format is kept (None: the key table lists it)"""
    # execution
    row_align: int
    scale_rows: Callable[[int, int], tuple[int, int]]
    scale_whole: bool
    """the scale is tiny (one value per block): read once per tensor and its values checked"""
    out_per_source_row: Callable[[tuple[int, ...]], int]
    """output elements per source dim-0 row, for sizing chunks"""
    cpu: Callable[[np.ndarray, np.ndarray, str, str], np.ndarray]
    """(source rows, scale rows, source dtype code, output dtype code) -> output rows, in numpy carriers"""
    cuda: Callable[[torch.Tensor, torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor | None]]
    """(source rows, scale rows, output dtype) -> (output rows, first_bad), torch tensors on a CUDA device;
    first_bad: None, or a one-element int32 device tensor with the first row holding a NaN code (the
    row count when there is none), read by the caller when it synchronizes anyway"""
    example: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    """a smallest valid (source, scale) on a device: warms a kernel up before the real data arrives"""


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- fp8_block ---------------------------------------------------------------------------------------
SCALE_SUFFIX = "_scale_inv"
FP8_SCALE = Companion(hf_leaf="weight" + SCALE_SUFFIX, native_leaf="scale", block=BLOCK)


def _check_fp8(w_shape, s_shape, tensor, file) -> None:
    check_scale(w_shape, s_shape, tensor=tensor, file=file)


def _fp8_cuda(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    from ckpttool.kernels.fp8 import dequant_fp8_block_lazy

    return dequant_fp8_block_lazy(x, scale, out_dtype)


def _fp8_example(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return torch.zeros(BLOCK, BLOCK, dtype=torch.float8_e4m3fn, device=dev), torch.ones(1, 1, device=dev)


FP8_BLOCK = QuantFormat(
    name="fp8_block", weight_suffix="", scale_suffix=SCALE_SUFFIX, weight_dtypes=FP8_DTYPES, scale_dtype="F32",
    check=_check_fp8, out_shape=lambda shape: shape, companion=FP8_SCALE,
    row_align=BLOCK, scale_rows=lambda r0, r1: (r0 // BLOCK, -(-r1 // BLOCK)), scale_whole=True,
    out_per_source_row=lambda shape: _prod(shape[1:]),
    cpu=fp8_cpu.dequant, cuda=_fp8_cuda, example=_fp8_example,
)


# -- mxfp4: experts [E, OUT, G, 16] + [E, OUT, G] -> [E, OUT, IN] -> transformers' [E, IN, OUT] -------------
def _check_mxfp4(b_shape, s_shape, tensor, file) -> None:
    if len(b_shape) != 4:
        raise InputError(f"MXFP4 expert blocks must be [E, R, G, 16], got {list(b_shape)}", file=file, tensor=tensor)
    check_mxfp4(b_shape, s_shape, tensor=tensor, file=file)


def _mxfp4_cpu(blocks: np.ndarray, scales: np.ndarray, dtype: str, out: str) -> np.ndarray:
    return np.ascontiguousarray(mxfp4_cpu.dequant(blocks, scales, out).transpose(0, 2, 1))


def _mxfp4_cuda(blocks: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.Tensor, None]:
    from ckpttool.kernels.mxfp4 import dequant_mxfp4

    return dequant_mxfp4(blocks, scales, out_dtype).transpose(1, 2).contiguous(), None  # no NaN: a table gather


def _mxfp4_example(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    return (torch.zeros(1, 1, 1, 16, dtype=torch.uint8, device=dev),
            torch.full((1, 1, 1), 127, dtype=torch.uint8, device=dev))


MXFP4 = QuantFormat(
    name="mxfp4", weight_suffix="_blocks", scale_suffix="_scales", weight_dtypes=("U8",), scale_dtype="U8",
    check=_check_mxfp4, out_shape=lambda s: (s[0], s[2] * VALUES_PER_BLOCK, s[1]), companion=None,
    row_align=1, scale_rows=lambda r0, r1: (r0, r1), scale_whole=False,
    out_per_source_row=lambda shape: _prod(shape[1:]) * 2,  # [.., G, 16] bytes -> G * 32 values
    cpu=_mxfp4_cpu, cuda=_mxfp4_cuda, example=_mxfp4_example,
)

DEQUANT_FORMATS: tuple[QuantFormat, ...] = (FP8_BLOCK, MXFP4)
BY_NAME: dict[str, QuantFormat] = {f.name: f for f in DEQUANT_FORMATS}
COMPANIONS: tuple[Companion, ...] = tuple(f.companion for f in DEQUANT_FORMATS if f.companion is not None)


def declares_fp8_block(quant: object, source: object) -> bool:
    """Whether a config.json's quantization_config says FP8 e4m3 128x128 blocks; any other is refused."""
    if not quant:
        return False
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8" \
            or list(quant.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise InputError(f"unsupported quantization_config {quant!r}", file=source,
                         fix="verify loads BF16 weights or FP8 e4m3 with 128x128 block scales")
    return True


# -- the quantize stage's outputs ----------------------------------------------------------------------
QUANTIZE_FORMATS = ("fp8_block", "int8", "int4")
CKPTTOOL_QUANTIZATION = "ckpttool_quantization"  # config.json key of int8/int4 outputs (quantized_config)
INT8_SCALES = "scales"  # gpt-fast's WeightOnlyInt8Linear: X.scales [M], the source dtype
INT4_SCALES_AND_ZEROS = "scales_and_zeros"  # gpt-fast's int4: X.scales_and_zeros BF16 [N/g, M, 2]

FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [BLOCK, BLOCK]}
"""DeepSeek-V3's quantization_config: transformers' FineGrainedFP8 and our dequant read it."""


def _int4(group_size: int, part: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(w: torch.Tensor) -> torch.Tensor:
        q, scales_and_zeros = quantize_int4_grouped(w, group_size)
        return pack_int4(q) if part == 0 else scales_and_zeros
    return run


QUANTIZE_TRANSFORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quantize_fp8_block": lambda w: quantize_fp8_block(w)[0],
    "quantize_fp8_block_scale": lambda w: quantize_fp8_block(w)[1],
    "quantize_int8": lambda w: quantize_int8_per_channel(w)[0],
    "quantize_int8_scales": lambda w: quantize_int8_per_channel(w)[1],
    **{f"quantize_int4_g{g}": _int4(g, 0) for g in INT4_GROUP_SIZES},
    **{f"quantize_int4_g{g}_scales_and_zeros": _int4(g, 1) for g in INT4_GROUP_SIZES},
}
"""Transforms of a whole source tensor (no scale input; outputs not row-aligned with the source:
quantized values and their block/channel/group scales): read once, applied once (in torch, imported
only then), pieces narrowed."""


def quantized_config(config: dict, fmt: str, group_size: int) -> dict:
    """fp8_block: DeepSeek's quantization_config, so loaders treat the output as block FP8. int8/int4
    have no transformers quantizer that reads gpt-fast's layout: they are described under
    `ckpttool_quantization` instead, which no loader mistakes for a method it knows."""
    config = dict(config)
    if fmt == "fp8_block":
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    else:
        config.pop("quantization_config", None)
        config[CKPTTOOL_QUANTIZATION] = {"format": fmt, "scheme": "gpt-fast weight-only",
                                           **({"group_size": group_size} if fmt == "int4" else {})}
    return config
