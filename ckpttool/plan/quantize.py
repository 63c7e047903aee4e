"""The quantize stage: BF16/F16/F32 linear weights -> one of the output formats of formats/outputs.py's table.

Plan time: each weight the family calls quantizable (the key table's LINEAR column) becomes the tensors its
format's row lists (`Target.outputs`: the quantized values and their side tensors, each named by its leaf, with
its dtype and shape), all made from the same source by the row's transforms; every other tensor passes through.
The row says which weight shapes it refuses, the `quantization_config` it writes (compressed-tensors' `ignore`
lists the Linear modules left unquantized) and whether `shard` can cut its output per rank. docs/layouts.md "Output
formats" has the table.

Execution: `formats.QUANTIZE_TRANSFORMS[name](weight)` computes one output from the whole source tensor.
"""

from __future__ import annotations

from ckpttool.errors import PlanError
from ckpttool.families.base import Family
from ckpttool.formats import FP8_DTYPES, QUANTIZE_TRANSFORMS, with_leaf
from ckpttool.formats.outputs import FORMATS, Target, ignored_modules, target
from ckpttool.formats.outputs_stream import is_streamed
from ckpttool.plan.types import TensorPlan

_FLOAT_DTYPES = ("BF16", "F16", "F32")


def target_of(fmt: str, group_size: int = 128) -> Target:
    """The output format's row, or an error listing the names it may be."""
    row = target(fmt, group_size)
    if row is None:
        raise PlanError(f"unknown quantize format {fmt!r}" if fmt != "int4" else
                        f"int4 takes group_size 32, 64, 128 or 256, not {group_size}",
                        fix=f"use one of {', '.join(FORMATS)}")
    return row


def check_mp(fmt: str, group_size: int, mp: int | None) -> None:
    """Refuse, by name, a shard stage after a format whose output cannot be cut per rank."""
    row = target_of(fmt, group_size)
    if mp is not None and not row.mp:
        cut = ", ".join(t for t in FORMATS if (r := target(t)) is not None and r.mp)
        raise PlanError(f"{fmt} output is HF layout only: {row.mp_refusal}",
                        fix=f"drop the shard stage, or quantize to {cut}")


def quantize(tensors: list[TensorPlan], family: Family, cfg, fmt: str, group_size: int = 128,
             files_of: dict[str, str] | None = None, repacked: int = 0) -> list[TensorPlan]:
    """Each quantizable float weight -> its format's tensors. A checkpoint whose quantized weights the plan
    repacked instead (plan/repack.py) passes through: its config describes the repacked weights only."""
    row = target_of(fmt, group_size)
    if repacked:
        return tensors
    if not family.quantize:
        raise PlanError(f"the quantize stage does not support {family.name} checkpoints")
    files_of = files_of or {}
    out = []
    for t in tensors:
        if not family.quantizable(cfg, t.name):
            out.append(t)
            continue
        file = files_of.get(t.source)
        if t.dtype in FP8_DTYPES and t.transform is None:
            raise PlanError("weight is already FP8", file=file, tensor=t.name,
                            fix="add a dequant stage before quantize to requantize it")
        if t.dtype not in _FLOAT_DTYPES or t.transform is not None or len(t.shape) != 2:
            raise PlanError(f"cannot quantize a {t.dtype} {list(t.shape)} tensor" +
                            (" made by another transform" if t.transform else ""), file=file, tensor=t.name,
                            fix="quantize reads BF16/F16/F32 2-D weights; put dequant and quantize in one recipe "
                                "only through an intermediate BF16 checkpoint")
        rows, cols = t.shape
        if why := row.refuses(rows, cols):
            raise PlanError(f"{why}; the weight is [{rows}, {cols}]", file=file, tensor=t.name,
                            fix="choose another --to format (fp8-channel and fp8-block-deepseek take any shape)"
                                if fmt != "int4" else "choose a group_size dividing the input features")
        for o in row.outputs:
            out.append(t.with_(name=with_leaf(t.name, o.leaf), dtype=o.dtype or t.dtype, shape=o.shape(rows, cols),
                               transform=o.transform_for(rows, cols)))
    return out


def count_quantized(tensors: list[TensorPlan]) -> int:
    """How many weights the stage quantized (each is several output tensors)."""
    return len({t.source for t in tensors if t.transform in QUANTIZE_TRANSFORMS or is_streamed(t.transform)})


def unquantized_linears(before: list[TensorPlan], after: list[TensorPlan], family: Family | None = None,
                        cfg=None) -> list[str]:
    """The modules compressed-tensors' `ignore` lists: 2-D weights the stage passed through (heads, routers), and
    the model's Linear modules the checkpoint does not store: a head tied to the embeddings is still a module of
    transformers' model, which the library lists (the key table's rows that name one tensor, absent here)."""
    kept = {t.name for t in after if t.transform is None}
    names = [t.name for t in before if t.name in kept and t.name.endswith(".weight") and len(t.shape) == 2]
    if family is not None:
        present = {t.name for t in before}
        names += [r.hf for r in family.keys(cfg).rows if not r.fields and not r.linear and r.companion is None
                  and r.hf.endswith(".weight") and r.hf not in present]
    return ignored_modules(names)


def quantized_config(config: dict, fmt: str, group_size: int, ignored: list[str], repacked: dict | None = None
                     ) -> dict:
    """config.json as the format's row writes it (its `quantization_config`, or ckpttool's own key); where the
    plan repacked quantized weights, the quantization_config that says what they now are (plan/repack.py)."""
    if repacked is not None:
        return {**config, "quantization_config": repacked}
    return target_of(fmt, group_size).config(config, ignored)
