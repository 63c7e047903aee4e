"""The quantize stage's exact repacks, at plan time: quantized weights whose format repacks exactly into the
target (formats/repack.py) become the target's codes and scales, made from their stored values and sides;
nothing is dequantized and nothing is rounded (a value the target cannot hold fails the run, naming the tensor
and the block). The config then says what the tensors now are, and the rules it declares are what the rest of
the plan (and every later reader) resolves the output with.

DeepSeek-V4 as published (`quant_method: fp8`, `scale_fmt: ue8m0`, `expert_dtype: fp4`): the MXFP4 routed experts
become FP8 e4m3 with E8M0 scales in the checkpoint's own `weight_block_size` blocks (128x128; V4.1: 32x32), the
layout its other projections already have, and `expert_dtype` becomes `fp8`: Hopper's kernels for every weight.
FP8 blocks of one size become another's (`--to fp8-32x32`, `fp8-128x128`: DeepSeek-V4 <-> V4.1's blocks), and
`weight_block_size` says so. NVFP4 goes between ModelOpt and compressed-tensors (`--to nvfp4a16`, `modelopt-nvfp4`).
"""

from __future__ import annotations

from ckpttool.errors import PlanError
from ckpttool.formats import HF_QUANT_CONFIG, declared_rules, with_leaf
from ckpttool.formats.outputs import Target, ignored_modules
from ckpttool.formats.repack import (
    NVFP4_ROWS,
    block_of,
    codes_row,
    nvfp4_codes_row,
    nvfp4_global_row,
    nvfp4_other,
    repackable,
    scale_row,
    source_of,
)
from ckpttool.formats.resolve import members_of
from ckpttool.plan.dequant import Rules, matches
from ckpttool.plan.types import TensorPlan


def repack(tensors: list[TensorPlan], rules: Rules, target: Target, config: dict, source, mp: int | None = None
           ) -> tuple[list[TensorPlan], Rules, dict | None, int, tuple[str, ...]]:
    """(tensors, the rules of the output's config, that config's quantization_config or None where nothing was
    repacked, how many weights were repacked, the input's top-level files the output must not copy). `mp`: the
    ranks the output is cut for (a source whose repack the mp layout cannot cut is refused by name)."""
    every = matches(tensors, rules)
    nvfp4 = {v: m for v, m in every.items() if target.repacks_nvfp4_from and m.row.name == target.repacks_nvfp4_from}
    if nvfp4:
        return _nvfp4(tensors, nvfp4, target, config, source)
    found = {v: m for v, m in every.items() if repackable(m.row)}
    quant = config.get("quantization_config") or {}
    if found and not target.repacks_to_fp8_blocks:
        first = next(iter(found.values()))
        raise PlanError(f"{first.row.title} weights do not repack exactly into {target.name}", tensor=first.values,
                        fix="repack them with --to fp8-block-deepseek, fp8-32x32 or fp8-128x128, or dequantize the "
                            "checkpoint first")
    if not target.repacks_to_fp8_blocks:
        if target.repack_only:
            raise PlanError(f"nothing to repack into {target.name}: no {target.repacks_nvfp4_from} weights",
                            file=source, fix="it repacks the other library's NVFP4; quantize BF16 with --to nvfp4a16")
        return tensors, rules, None, 0, ()
    block = tuple(target.repack_block or quant.get("weight_block_size") or (128, 128))
    found = {v: m for v, m in found.items() if block_of(m.row) != block}
    if not found:
        if target.repack_only:
            raise PlanError(f"nothing to repack into {target.name}: no MXFP4 experts or FP8 blocks of another size",
                            file=source, fix="quantize a BF16 checkpoint with --to fp8-block-deepseek instead")
        return tensors, rules, None, 0, ()
    if mp is not None and (m := next((m for m in found.values() if source_of(m.row).mp_refusal), None)):
        raise PlanError(f"{m.row.title} weights repacked into FP8 are not cut per rank: "
                        f"{source_of(m.row).mp_refusal}", file=source, tensor=m.values,
                        fix=f"repack without --mp (HF layout), or shard the {m.row.title} checkpoint as it is "
                            "(`ckpttool shard SRC DST --mp N`)")
    own = {source_of(m.row).config for m in found.values()}
    if own != {None}:  # a source whose config is not transformers' FP8 (gpt-oss's mxfp4): the row writes the output's
        if len(own) > 1:
            raise PlanError("the checkpoint mixes repack sources of different configs", file=source,
                            fix="dequantize the checkpoint instead (ckpttool dequant)")
        quant = next(iter(own))(quant, block)
    experts = any(block_of(m.row) is None for m in found.values())
    if own == {None} and (quant.get("quant_method") != "fp8" or (experts and (quant.get("expert_dtype") != "fp4"
                                                                             or quant.get("scale_fmt") != "ue8m0"))):
        raise PlanError("ckpttool repacks the FP8 blocks and MXFP4 experts of a transformers FP8 config "
                        "(quant_method fp8; MXFP4 experts under scale_fmt ue8m0, expert_dtype fp4); this one says "
                        f"{quant!r}", file=source, fix="dequantize the checkpoint instead (ckpttool dequant)")
    dtypes = {t.name: t.dtype for t in tensors}
    beside = members_of(found) - set(found)
    out = []
    for t in tensors:
        if t.name in beside:
            continue
        m = found.get(t.name)
        if m is None:
            out.append(t)
            continue
        kind = source_of(m.row)
        shape = kind.codes_shape(m.row, t.shape)
        codes, scale = kind.names(m)
        out.append(t.with_(name=codes, dtype="F8_E4M3", shape=shape, transform=codes_row(*block, m.row.name).name,
                           sides=m.sides))
        out.append(t.with_(name=scale, dtype=kind.scale_dtype(dtypes[m.members["scale"]]),
                           shape=kind.scale_shape(shape, block), transform=scale_row(*block, m.row.name, t.name).name,
                           sides=m.sides))
    quant = {**quant, "weight_block_size": list(block),
             **({"expert_dtype": "fp8"} if experts and own == {None} else {})}
    return out, declared_rules(quant, None, source), quant, len(found), ()


def _nvfp4(tensors: list[TensorPlan], found: dict, target: Target, config: dict, source):
    """NVFP4 weights of one library as the other's: the codes (ModelOpt's +0.0 code re-spelled), the F8_E4M3 scales
    byte for byte, the per-tensor scale that gives every block scale's very fp32 value; activation scales dropped
    (the output is weight-only: W4A16)."""
    beside = members_of(found) - set(found)
    kept = {m.members["scale"] for m in found.values()}
    out = []
    for t in tensors:
        if t.name in beside and t.name not in kept:
            continue
        m = found.get(t.name)
        if m is None:
            out.append(t)
            continue
        _, _, values_leaf, global_leaf, shape = NVFP4_ROWS[nvfp4_other(m.row)]
        scale = m.members["scale"]
        out.append(t.with_(name=with_leaf(m.base, values_leaf), transform=nvfp4_codes_row(m.row.name).name,
                           sides=m.sides))
        out.append(t.with_(name=with_leaf(m.base, global_leaf), dtype="F32", shape=shape, source=scale,
                           transform=nvfp4_global_row(m.row.name, t.name).name, sides=(m.members["global"],)))
    floats = [t.name for t in out if t.transform is None and t.name.endswith(".weight") and len(t.shape) == 2
              and t.dtype in ("BF16", "F16", "F32")]
    quant = target.config(config, ignored_modules(floats))["quantization_config"]
    return out, declared_rules(quant, None, source), quant, len(found), (HF_QUANT_CONFIG,)
