"""The quantize stage's output formats, one row each: what `ckpttool quantize --to FORMAT` writes per weight.

A row (`Target`) says which tensors it writes beside (or instead of) `X.weight`: their leaves, dtypes and
shapes; how it computes them from the BF16/F16/F32 weight (torch, kernels/quant_ct.py for compressed-tensors,
kernels/fp8.py and kernels/quant.py for DeepSeek's blocks and gpt-fast's layouts); which weight shapes it
refuses and why; the `quantization_config` it writes; whether `shard` can cut its output per rank; and which
exact repacks of an already quantized checkpoint it takes (plan/repack.py). The planner (plan/quantize.py), the
executor (each planned tensor's transform by name: streamed rows through formats/outputs_stream.py, whole-tensor
ones through `QUANTIZE_TRANSFORMS`) and the CLI's `--to` choices read this table; nothing else names a format.

  w4a16, w4a16-asym, w8a16   compressed-tensors pack-quantized INT4/INT8, groups of 128 (presets W4A16,
                             W4A16_ASYM, W8A16)
  fp8-channel, fp8-block     compressed-tensors float-quantized FP8 per row / 128x128 blocks (FP8_DYNAMIC,
                             FP8_BLOCK: their activations dynamic)
  nvfp4a16, mxfp4            compressed-tensors nvfp4-pack-quantized (NVFP4A16) / mxfp4-pack-quantized (MXFP4A16)
  fp8-block-deepseek         DeepSeek-V3's FP8 128x128 blocks with F32 `weight_scale_inv` (alias fp8_block)
  int8, int4                 gpt-fast's weight-only layouts (no engine loads them; config.json says so)
  fp8-32x32, fp8-128x128,    repacks only: FP8 blocks of that size from MXFP4 experts or FP8 blocks of another
  fp8-1x128, modelopt-nvfp4  size (DeepSeek-V4's and gpt-oss's MXFP4 experts); ModelOpt NVFP4 from compressed-tensors'
                             (nvfp4a16 takes ModelOpt's the other way)

The compressed-tensors rows write what the library's own `ModelCompressor.compress_model` writes for the same
weights under that preset with min-max statistics and no calibration data, byte for byte, and its
`quantization_config` as `update_config` writes it (tests/test_quantize_targets.py holds them to it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ckpttool.formats.fp8 import mp_companion
from ckpttool.kernels import quant_ct, quant_native
from ckpttool.kernels.fp8 import BLOCK, quantize_fp8_block, scale_shape
from ckpttool.kernels.quant import (INT4_GROUP_SIZES, check_finite, pack_int4, quantize_int4_grouped,
                                    quantize_int8_per_channel)

if TYPE_CHECKING:
    import torch

CKPTTOOL_QUANTIZATION = "ckpttool_quantization"  # config.json key of int8/int4 outputs
CT_VERSION = "0.20.0"
"""the compressed-tensors release whose bytes and config the compressed-tensors rows reproduce"""
EMBEDDING_LEAVES = ("embed_tokens", "tok_embeddings", "wte", "wpe", "word_embeddings", "embed_positions")
"""module names of 2-D weights that are embeddings, not Linear layers: left out of compressed-tensors' `ignore`
(the library lists only modules of a type it quantized)"""


@dataclass(frozen=True, slots=True)
class Output:
    """One tensor a row writes per weight `X.weight`: `X.<leaf>`, its dtype (None: the weight's) and shape, and
    how it streams (formats/outputs_stream.py): each of its rows made from `per_row` rows of the weight, in runs of
    `align` of its rows; `per_row` 0: made from the weight's shape alone; None: from the whole weight at once."""

    leaf: str
    dtype: str | None
    shape: Callable[[int, int], tuple[int, ...]]
    transform: str  # the plan's name for it (TensorPlan.transform), unique over the table
    per_row: int | None = None
    align: int = 1
    stat: bool = False
    """made from the weight's whole-tensor statistic alone (`Target.prepass`: NVFP4's global scale)"""

    def transform_for(self, rows: int, cols: int) -> str:
        """The plan's transform name for a [rows, cols] weight (an output made from the shape alone says it)."""
        return f"{self.transform}:{rows}x{cols}" if self.per_row == 0 else self.transform


@dataclass(frozen=True, kw_only=True)
class Target:
    name: str
    title: str
    outputs: tuple[Output, ...]
    compute: Callable[..., dict[str, torch.Tensor]]
    """(weight rows, leaf=None) -> the outputs by leaf: all of them, or at least `leaf` (what its task needs:
    a scale's task computes no codes)"""
    refuses: Callable[[int, int], str | None]  # why a [rows, cols] weight cannot be written, or None
    config: Callable[[dict, list[str]], dict]  # (config.json, modules left unquantized) -> the output's
    mp: bool = False  # shard can cut the output per rank (the mp layout has a companion for its scale)
    mp_refusal: str = "its scales are not laid out per rank"
    aliases: tuple[str, ...] = ()
    library: str = ""  # what defines the bytes (README's table)
    repacks_to_fp8_blocks: bool = False  # quantized weights with an exact repack into FP8 blocks take it
    # (plan/repack.py)
    repack_block: tuple[int, int] | None = None  # the blocks a repack writes (None: the config's weight_block_size)
    repack_only: bool = False  # takes quantized checkpoints only (`refuses` says so for a float weight)
    repacks_nvfp4_from: str | None = None  # the other library's NVFP4 row whose weights repack into this one
    prepass: Callable[[torch.Tensor], float] | None = None
    """a statistic of the whole weight the outputs need (NVFP4: its amax), as the max of this over runs of its
    rows, computed in a first pass (formats/outputs_stream.py, execute/tasks.py) and given to `compute` as `stat`"""
    transforms: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for out in self.outputs:
            if out.per_row is None:  # the others are rows the executor streams (formats/outputs_stream.py)
                self.transforms[out.transform] = (lambda leaf: lambda w: self._whole(w, leaf))(out.leaf)

    def _whole(self, w: torch.Tensor, leaf: str) -> torch.Tensor:
        check_finite(w)
        return self.compute(w, leaf)[leaf]


# -- compressed-tensors --------------------------------------------------------------------------------
def _ct_config(preset: dict, fmt: str) -> Callable[[dict, list[str]], dict]:
    def write(config: dict, ignored: list[str]) -> dict:
        config = dict(config)
        config.pop(CKPTTOOL_QUANTIZATION, None)
        group = {"format": fmt, "input_activations": preset.get("input_activations"), "output_activations": None,
                 "targets": ["Linear"], "weights": preset["weights"]}
        config["quantization_config"] = {
            "config_groups": {"group_0": group}, "format": fmt, "global_compression_ratio": None, "ignore": ignored,
            "kv_cache_scheme": None, "moe_sparsity_config": None, "quant_method": "compressed-tensors",
            "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}, "version": CT_VERSION}
        return config
    return write


def _divides(what: str, size: int, axis: str = "cols") -> Callable[[int, int], str | None]:
    def why(rows: int, cols: int) -> str | None:
        n = cols if axis == "cols" else rows
        return None if n % size == 0 else f"{what} needs {'input features' if axis == 'cols' else 'rows'} ({n}) " \
                                          f"divisible by {size}"
    return why


def _both(*checks):
    return lambda rows, cols: next((why for c in checks if (why := c(rows, cols))), None)


def _int_weights(bits: int, symmetric: bool) -> dict:
    return {"dynamic": False, "group_size": 128, "num_bits": bits, "strategy": "group", "symmetric": symmetric,
            "type": "int"}


def _pack_int(bits: int, symmetric: bool) -> Callable[..., dict]:
    def compute(w: torch.Tensor, leaf: str | None = None) -> dict:
        import torch

        if leaf == "weight_shape":
            return {leaf: torch.tensor(list(w.shape), dtype=torch.int64)}
        if (out := quant_native.int_outputs(w, leaf, bits, symmetric)) is not None:  # C loops, the same bits
            return out
        scale, zero = quant_ct.qparams(*quant_ct.min_max(w, "group", 128), kind="int", bits=bits, symmetric=symmetric)
        if leaf == "weight_scale":
            return {leaf: scale}
        if leaf == "weight_zero_point":
            return {leaf: quant_ct.pack_to_int32(zero, bits, packed_dim=0)}
        q = quant_ct.quantize_grouped(w, scale, None if symmetric else zero, 128, kind="int", bits=bits,
                                      dtype=torch.int8)
        out = {"weight_packed": quant_ct.pack_to_int32(q, bits), "weight_scale": scale,
               "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
        if not symmetric:
            out["weight_zero_point"] = quant_ct.pack_to_int32(zero, bits, packed_dim=0)
        return out
    return compute


def _pack_int_target(name: str, bits: int, symmetric: bool, title: str) -> Target:
    outs = [Output("weight_packed", "I32", lambda r, c: (r, c * bits // 32), f"quantize:{name}:packed", 1),
            Output("weight_scale", None, lambda r, c: (r, c // 128), f"quantize:{name}:scale", 1),
            Output("weight_shape", "I64", lambda r, c: (2,), f"quantize:{name}:shape", 0)]
    if not symmetric:  # packed along the rows: 32 / bits of them a word
        outs.append(Output("weight_zero_point", "I32", lambda r, c: (-(-r * bits // 32), c // 128),
                           f"quantize:{name}:zero_point", 32 // bits))
    return Target(name=name, title=title, outputs=tuple(outs), compute=_pack_int(bits, symmetric),
                  refuses=_divides(title, 128), config=_ct_config({"weights": _int_weights(bits, symmetric)},
                                                                  "pack-quantized"),
                  mp_refusal="packed int32 words and their groups are not cut per rank",
                  library="compressed-tensors 0.20 `PackedQuantizationCompressor`")


_FP8_WEIGHTS = {"dynamic": False, "group_size": None, "num_bits": 8, "symmetric": True, "type": "float"}


def _fp8(strategy: str) -> Callable[..., dict]:
    def compute(w: torch.Tensor, leaf: str | None = None) -> dict:
        import torch

        stats = quant_ct.min_max(w, "channel") if strategy == "channel" else \
            quant_ct.min_max(w, "block", block=(BLOCK, BLOCK))
        scale, _ = quant_ct.qparams(*stats, kind="float", bits=8)
        if leaf == "weight_scale":
            return {leaf: scale}
        if strategy == "channel":
            q = quant_ct.quantize(w, scale, None, kind="float", bits=8, dtype=torch.float8_e4m3fn)
        else:
            q = quant_ct.quantize_blocks(w, scale, (BLOCK, BLOCK), kind="float", bits=8, dtype=torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": scale}
    return compute


def _fp4(mx: bool) -> Callable[..., dict]:
    def compute(w: torch.Tensor, leaf: str | None = None, stat: float | None = None) -> dict:
        """stat: the whole weight's amax where `w` is a run of its rows (NVFP4's global scale needs it)."""
        import torch

        if mx and (out := quant_native.fp4_outputs(w, leaf, True)) is not None:  # C loops, the same bits
            return out
        if mx:
            scale, _ = quant_ct.qparams(*quant_ct.min_max(w, "group", 32), kind="float", bits=4,
                                        scale_dtype=torch.uint8, mx=True)
            if leaf == "weight_scale":
                return {leaf: quant_ct.mx_scale_code(scale)}
            return {"weight_packed": quant_ct.quantize_fp4_grouped(w, scale, 32),
                    "weight_scale": quant_ct.mx_scale_code(scale)}
        gs = quant_ct.global_scale_fp4(w if stat is None else torch.tensor([stat], dtype=w.dtype, device=w.device))
        if leaf == "weight_global_scale":
            return {leaf: gs}
        if (out := quant_native.fp4_outputs(w, leaf, False, gs)) is not None:
            return out
        scale, _ = quant_ct.qparams(*quant_ct.min_max(w, "group", 16), kind="float", bits=4,
                                    scale_dtype=torch.float8_e4m3fn, global_scale=gs)
        if leaf == "weight_scale":
            return {leaf: scale.to(torch.float8_e4m3fn)}
        return {"weight_packed": quant_ct.quantize_fp4_grouped(w, scale, 16, gs),
                "weight_scale": scale.to(torch.float8_e4m3fn),
                "weight_global_scale": gs}
    return compute


def _amax(w: torch.Tensor) -> float:
    """max |w| of a run of rows, exact as a Python float (a BF16, F16 or F32 value is an fp64 value)."""
    check_finite(w)
    return float(w.abs().amax()) if w.numel() else 0.0


_FP4_WEIGHTS = {"dynamic": False, "num_bits": 4, "symmetric": True, "type": "float"}

CT_TARGETS = (
    _pack_int_target("w4a16", 4, True, "compressed-tensors W4A16 (INT4, group 128)"),
    _pack_int_target("w4a16-asym", 4, False, "compressed-tensors W4A16_ASYM (INT4 with zero points, group 128)"),
    _pack_int_target("w8a16", 8, True, "compressed-tensors W8A16 (INT8, group 128)"),
    Target(name="fp8-channel", title="compressed-tensors FP8_DYNAMIC (FP8 per output channel)",
           outputs=(Output("weight", "F8_E4M3", lambda r, c: (r, c), "quantize:fp8-channel:weight", 1),
                    Output("weight_scale", None, lambda r, c: (r, 1), "quantize:fp8-channel:scale", 1)),
           compute=_fp8("channel"), refuses=lambda r, c: None,
           config=_ct_config({"weights": {**_FP8_WEIGHTS, "strategy": "channel"},
                              "input_activations": {"dynamic": True, "group_size": None, "num_bits": 8,
                                                    "strategy": "token", "symmetric": True, "type": "float"}},
                             "float-quantized"),
           library="compressed-tensors 0.20 `FloatQuantizationCompressor`"),
    Target(name="fp8-block", title="compressed-tensors FP8_BLOCK (FP8, 128x128 blocks)",
           outputs=(Output("weight", "F8_E4M3", lambda r, c: (r, c), "quantize:fp8-block:weight", 1, BLOCK),
                    Output("weight_scale", None, lambda r, c: (r // BLOCK, c // BLOCK), "quantize:fp8-block:scale",
                           BLOCK)),
           compute=_fp8("block"), refuses=_both(_divides("FP8_BLOCK", BLOCK), _divides("FP8_BLOCK", BLOCK, "rows")),
           config=_ct_config({"weights": {**_FP8_WEIGHTS, "block_structure": [BLOCK, BLOCK], "strategy": "block"},
                              "input_activations": {"dynamic": True, "group_size": BLOCK, "num_bits": 8,
                                                    "strategy": "group", "symmetric": True, "type": "float"}},
                             "float-quantized"),
           library="compressed-tensors 0.20 `FloatQuantizationCompressor`"),
    Target(name="nvfp4a16", title="compressed-tensors NVFP4A16 (FP4 E2M1, FP8 scale per 16, global scale)",
           outputs=(Output("weight_packed", "U8", lambda r, c: (r, c // 2), "quantize:nvfp4a16:packed", 1),
                    Output("weight_scale", "F8_E4M3", lambda r, c: (r, c // 16), "quantize:nvfp4a16:scale", 1),
                    Output("weight_global_scale", "F32", lambda r, c: (1,), "quantize:nvfp4a16:global_scale", 1,
                           stat=True)),
           compute=_fp4(False), refuses=_divides("NVFP4", 16), prepass=_amax,
           config=_ct_config({"weights": {**_FP4_WEIGHTS, "group_size": 16, "scale_dtype": "torch.float8_e4m3fn",
                                          "strategy": "tensor_group"}}, "nvfp4-pack-quantized"),
           library="compressed-tensors 0.20 `NVFP4PackedCompressor`", repacks_nvfp4_from="modelopt_nvfp4"),
    Target(name="mxfp4", title="compressed-tensors MXFP4A16 (FP4 E2M1, E8M0 scale per 32)",
           outputs=(Output("weight_packed", "U8", lambda r, c: (r, c // 2), "quantize:mxfp4:packed", 1),
                    Output("weight_scale", "U8", lambda r, c: (r, c // 32), "quantize:mxfp4:scale", 1)),
           compute=_fp4(True), refuses=_divides("MXFP4", 32),
           config=_ct_config({"weights": {**_FP4_WEIGHTS, "group_size": 32, "scale_dtype": "torch.uint8",
                                          "strategy": "group"}}, "mxfp4-pack-quantized"),
           library="compressed-tensors 0.20 `MXFP4PackedCompressor`"),
)


# -- DeepSeek's blocks and gpt-fast's layouts (the stage's first formats, unchanged) ----------------------
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [BLOCK, BLOCK]}
"""DeepSeek-V3's quantization_config: transformers' FineGrainedFP8 and our dequant read it."""


def _deepseek_config(config: dict, ignored: list[str]) -> dict:
    return {**config, "quantization_config": dict(FP8_QUANTIZATION_CONFIG)}


def _gpt_fast_config(fmt: str, group_size: int | None) -> Callable[[dict, list[str]], dict]:
    """gpt-fast's layouts have no transformers quantizer: described under `ckpttool_quantization`, which no
    loader mistakes for a method it knows."""
    def write(config: dict, ignored: list[str]) -> dict:
        config = dict(config)
        config.pop("quantization_config", None)
        config[CKPTTOOL_QUANTIZATION] = {"format": fmt, "scheme": "gpt-fast weight-only",
                                         **({"group_size": group_size} if group_size else {})}
        return config
    return write


FP8_BLOCK_DEEPSEEK = Target(
    name="fp8-block-deepseek", aliases=("fp8_block",), title="DeepSeek FP8 128x128 blocks",
    outputs=(Output("weight", "F8_E4M3", lambda r, c: (r, c), "quantize_fp8_block", 1, BLOCK),
             Output("weight_scale_inv", "F32", lambda r, c: scale_shape((r, c)), "quantize_fp8_block_scale", BLOCK)),
    compute=lambda w, leaf=None: dict(zip(("weight", "weight_scale_inv"), quantize_fp8_block(w))),
    refuses=lambda r, c: None,
    config=_deepseek_config, mp=True, library="DeepSeek-V3's reference `act_quant` block scaling",
    repacks_to_fp8_blocks=True)


def _repack_target(b0: int, b1: int) -> Target:
    def refuses(rows: int, cols: int) -> str:
        return f"fp8-{b0}x{b1} repacks FP8 blocks and MXFP4 experts exactly; it does not quantize float weights"

    def compute(w, leaf=None):
        raise ValueError(refuses(0, 0))

    return Target(name=f"fp8-{b0}x{b1}", title=f"FP8 {b0}x{b1} blocks, repacked exactly", outputs=(),
                  compute=compute, refuses=refuses, config=_deepseek_config,
                  mp=mp_companion((b0, b1), "scale") is not None,
                  mp_refusal=f"the mp layout cuts FP8 weights of 128x128 blocks per rank (DeepSeek's), not {b0}x{b1}",
                  repacks_to_fp8_blocks=True,
                  repack_block=(b0, b1), repack_only=True,
                  library="transformers' FP8 blocks (`weight_block_size`), DeepSeek-V4 and V4.1")


def _modelopt_config(config: dict, ignored: list[str]) -> dict:
    """ModelOpt's W4A16_NVFP4 as its export's convert_hf_quant_config_format puts it in config.json (no
    hf_quant_config.json: ckpttool writes no file of its own name there; readers take either)."""
    config = dict(config)
    config["quantization_config"] = {
        "config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
                                      "targets": ["Linear"]}},
        "ignore": ignored, "quant_algo": "W4A16_NVFP4", "quant_method": "modelopt"}
    return config


def _modelopt_refuses(rows: int, cols: int) -> str:
    return "modelopt-nvfp4 repacks compressed-tensors NVFP4 exactly; it does not quantize float weights"


MODELOPT_NVFP4_TARGET = Target(
    name="modelopt-nvfp4", title="NVIDIA ModelOpt W4A16_NVFP4, repacked exactly", outputs=(),
    compute=lambda w, leaf=None: (_ for _ in ()).throw(ValueError(_modelopt_refuses(0, 0))),
    refuses=_modelopt_refuses, config=_modelopt_config, mp_refusal="NVFP4's groups are not cut per rank",
    repack_only=True, repacks_nvfp4_from="ct_nvfp4", library="nvidia-modelopt 0.47's NVFP4 export")
REPACK_TARGETS = (_repack_target(128, 128), _repack_target(32, 32), _repack_target(1, 128), MODELOPT_NVFP4_TARGET)
INT8 = Target(
    name="int8", title="gpt-fast int8 per channel",
    outputs=(Output("weight", "I8", lambda r, c: (r, c), "quantize_int8", 1),
             Output("scales", None, lambda r, c: (r,), "quantize_int8_scales", 1)),
    compute=lambda w, leaf=None: dict(zip(("weight", "scales"), quantize_int8_per_channel(w))),
    refuses=lambda r, c: None,
    config=_gpt_fast_config("int8", None), mp_refusal="gpt-fast's layouts are HF layout only",
    library="gpt-fast `WeightOnlyInt8Linear`")


def _int4(group: int) -> Target:
    def compute(w: torch.Tensor, leaf: str | None = None) -> dict:
        q, scales_and_zeros = quantize_int4_grouped(w, group)
        return {"weight": pack_int4(q), "scales_and_zeros": scales_and_zeros}

    return Target(
        name=f"int4_g{group}", title=f"gpt-fast int4 (group {group})",
        outputs=(Output("weight", "U8", lambda r, c: (r, c // 2), f"quantize_int4_g{group}", 1),
                 Output("scales_and_zeros", "BF16", lambda r, c: (c // group, r, 2),
                        f"quantize_int4_g{group}_scales_and_zeros")),
        compute=compute, refuses=_both(_divides("int4", group), _divides("int4", 2)),
        config=_gpt_fast_config("int4", group), mp_refusal="gpt-fast's layouts are HF layout only",
        library="gpt-fast `get_group_qparams` + `group_quantize_tensor_from_qparams`")


TARGETS: tuple[Target, ...] = (*CT_TARGETS, FP8_BLOCK_DEEPSEEK, *REPACK_TARGETS, INT8,
                                *(_int4(g) for g in INT4_GROUP_SIZES))
FORMATS = tuple(dict.fromkeys((*(t.name for t in CT_TARGETS), FP8_BLOCK_DEEPSEEK.name, "fp8_block",
                               *(t.name for t in REPACK_TARGETS), "int8", "int4")))
"""the names `--to` and a recipe's quantize.format take (int4's group from group_size)"""
_BY_NAME = {t.name: t for t in TARGETS} | {a: t for t in TARGETS for a in t.aliases}


def target(name: str, group_size: int = 128) -> Target | None:
    """The row a format name means (int4 by its group size), or None."""
    return _BY_NAME.get(f"int4_g{group_size}" if name == "int4" else name)


QUANTIZE_TRANSFORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    name: fn for t in TARGETS for name, fn in t.transforms.items()}
"""Transforms of a whole source tensor (no scale input; outputs not row-aligned with the source:
quantized values and their block/channel/group scales): read once, applied once (in torch, imported
only then), pieces narrowed."""


def ignored_modules(names: list[str]) -> list[str]:
    """compressed-tensors' `ignore`: the Linear modules left unquantized, in the model's order (a decoder's layers
    by number, then the head), from the 2-D `.weight`s the stage did not quantize, embeddings excepted."""
    modules = [n[: -len(".weight")] for n in names if n.split(".")[-2] not in EMBEDDING_LEAVES]

    def order(module: str):
        parts = module.split(".")
        numbered = any(p.isdigit() for p in parts)
        return (not numbered, [(int(p), "") if p.isdigit() else (-1, p) for p in parts])
    return sorted(modules, key=order)


