"""Quantization formats, one row each: the one place a format is described.

A dequant row (row.QuantFormat) says what the published tensors are called and what dtypes they have,
how they are checked at plan time, how they are dequantized (numpy on the CPU, Triton on CUDA, the
same bits), which tensors beside the weight it reads or drops, and how the mp layout names the scale
beside a kept weight. The planner (plan/dequant.py), the executor, the families' key tables (scale rows
are derived from `Companion`) and verify's loaders read these rows; adding a format is one row (in the
module of the library that defines it) plus its kernel in kernels/, and a line in `declared_formats`
if a new quant_method names it.

  blocks.py      fp8_block (DeepSeek V3/R1), mxfp4 (gpt-oss experts)
  compressed.py  compressed-tensors: pack-quantized INT4, float-quantized FP8 (channel, tensor, group, block),
                 NVFP4, MXFP4; compressed_int.py its other integer rows (zero points, INT8, act-order);
                 compressed_config.py which rows its quantization_config declares
  modelopt.py    NVIDIA ModelOpt NVFP4, FP8 per tensor and per channel, MIXED_PRECISION of them
  gptq.py        GPTQ (gptqmodel, AutoGPTQ): 4/8-bit codes packed along the input dim, zero points, g_idx
  awq.py         AWQ (autoawq): GEMM and GEMV 4-bit layouts
  bnb.py         bitsandbytes 4-bit (NF4, FP4, double quant) and LLM.int8()
  foreign.py     other libraries' quant_methods (HQQ, EETQ, torchao, Quark, ...), refused by name

Each dequant transform works on a run of dim-0 rows of its source, so the executor can stream any
tensor in bounded chunks: `row_align` is the smallest run it can take (an FP8 scale covers 128 rows),
and `scale_rows` says which rows of the scale tensor those source rows need.

The quantize stage's output formats are the second table: formats/outputs.py (outputs_stream.py the rows of
those that stream; repack.py the exact repacks between quantized formats).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

from ckpttool.errors import InputError
from ckpttool.formats import (awq, bnb, compressed, compressed_config, foreign, fp8, fp8_experts, gptq, modelopt,
                              outputs_stream, repack)
from ckpttool.formats.blocks import FP8_BLOCK, FP8_SCALE, MXFP4, SCALE_SUFFIX  # noqa: F401 - the table's rows
from ckpttool.formats.resolve import Match, Rule, resolve  # noqa: F401 - re-exported
from ckpttool.formats.row import Chunk, Companion, QuantFormat, with_leaf  # noqa: F401 - re-exported
from ckpttool.formats.outputs import CKPTTOOL_QUANTIZATION, FP8_QUANTIZATION_CONFIG  # noqa: F401 - re-exported
from ckpttool.formats.outputs import FORMATS as QUANTIZE_FORMATS  # noqa: F401 - re-exported
from ckpttool.formats.outputs import QUANTIZE_TRANSFORMS  # noqa: F401 - re-exported
from ckpttool.kernels.fp8 import BLOCK, FP8_DTYPES  # noqa: F401 - FP8_DTYPES re-exported

DEQUANT_FORMATS: tuple[QuantFormat, ...] = (FP8_BLOCK, MXFP4, *compressed.ROWS, *modelopt.ROWS, *bnb.ROWS)
"""the rows of fixed parameters; the others are made for a config's (formats/fp8.py: FP8 blocks of any size)"""
COMPANIONS: tuple[Companion, ...] = tuple(dict.fromkeys(f.companion for f in DEQUANT_FORMATS if f.companion is not None))
UNDECLARED = (Rule(FP8_BLOCK, "(no quantization_config)"), Rule(MXFP4, "(no quantization_config)"))
"""what a checkpoint without a quantization config may hold (as before configs named them)"""
HF_QUANT_CONFIG = modelopt.HF_QUANT_CONFIG
DECLARED_BY: dict[str, Callable[[dict, object], tuple[Rule, ...]]] = {
    **{method: (lambda quant, path: fp8.declared(quant, path) + fp8_experts.declared(quant, path))
       for method in fp8.METHODS},
    "mxfp4": lambda quant, path: (Rule(MXFP4, "quantization_config"),),
    compressed_config.METHOD: compressed_config.declared,
    gptq.METHOD: gptq.declared,
    awq.METHOD: awq.declared,
    bnb.METHOD: bnb.declared,
}
"""quantization_config's quant_method -> the rules it declares, read as that library reads its config: a row
each (ModelOpt, which may also speak through hf_quant_config.json, is read before this table)"""
SUPPORTED_METHODS = (*DECLARED_BY, modelopt.METHOD)
NAMED = (fp8.named, fp8_experts.named, compressed.named, gptq.named, awq.named, bnb.named, repack.named,
         outputs_stream.named)
"""the modules whose rows are made for a config's parameters: each rebuilds a row from the name a plan records"""


class _Rows(Mapping[str, QuantFormat]):
    """Every row by the name a plan records (TensorPlan.transform): the fixed rows, then the rows a name's
    parameters make (`fp8_block:32x32:ue8m0:scale`), so the executor finds any row a plan could name."""

    def __init__(self, rows: tuple[QuantFormat, ...]):
        self._fixed = {r.name: r for r in rows}

    def __getitem__(self, name: str) -> QuantFormat:
        row = self._fixed.get(name) or (_named(name) if isinstance(name, str) else None)
        if row is None:
            raise KeyError(name)
        return row

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._fixed or _named(name) is not None)

    def __iter__(self):
        return iter(self._fixed)

    def __len__(self) -> int:
        return len(self._fixed)


def _named(name: str) -> QuantFormat | None:
    return next((row for make in NAMED if (row := make(name)) is not None), None)


BY_NAME: Mapping[str, QuantFormat] = _Rows(DEQUANT_FORMATS)


def declared_rules(quant: object, hf_quant: dict | None, config_path: object,
                   hf_quant_path: object = None) -> tuple[Rule, ...]:
    """The rules config.json's quantization_config (and ModelOpt's hf_quant_config.json, if present)
    declare, read as the library that wrote them reads them. Any other method or format is refused by
    name: a plan never passes weights through under a quantization_config it does not understand."""
    if quant is not None and not isinstance(quant, dict):
        raise InputError(f"quantization_config is {type(quant).__name__}, not an object", file=config_path,
                         fix="config.json is damaged; re-download it")
    method = (quant or {}).get("quant_method")
    if hf_quant is not None or method == modelopt.METHOD:
        return modelopt.declared(quant, hf_quant, config_path, hf_quant_path)
    if not quant:
        return UNDECLARED
    if isinstance(method, str) and method in DECLARED_BY:
        return DECLARED_BY[method](quant, config_path)
    if isinstance(method, str) and method in foreign.FOREIGN:
        raise foreign.refusal(method, config_path)
    raise InputError(f"quantization_config quant_method {method!r} is not a format ckpttool reads", file=config_path,
                     fix=f"ckpttool reads quant_method {', '.join(map(repr, SUPPORTED_METHODS))}; "
                         "dequantize this checkpoint with the library that wrote it")


def declares_fp8_block(quant: object, source: object) -> bool:
    """Whether a config.json's quantization_config says FP8 e4m3 128x128 blocks; any other is refused."""
    if not quant:
        return False
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8" \
            or list(quant.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise InputError(f"unsupported quantization_config {quant!r}", file=source,
                         fix="verify loads BF16 weights or FP8 e4m3 with 128x128 block scales")
    return True


# -- the quantize stage's outputs: formats/outputs.py's table (imported above), and the names describe reads --
INT8_SCALES = "scales"  # gpt-fast's WeightOnlyInt8Linear: X.scales [M], the source dtype (describe counts them)
INT4_SCALES_AND_ZEROS = "scales_and_zeros"  # gpt-fast's int4: X.scales_and_zeros BF16 [N/g, M, 2]
