"""Rename to the mp layout and split for tensor + expert parallelism, from the family's key table."""

from __future__ import annotations

from ckpttool.errors import PlanError
from ckpttool.families.base import Family, HeadSplit
from ckpttool.families.keymap import EXPERT, RANK0, Segment
from ckpttool.formats import FP8_SCALE
from ckpttool.io.layout import mp_file
from ckpttool.plan.types import TensorPlan

BLOCK = FP8_SCALE.block


def _fp8_kept(t: TensorPlan, is_scale: bool) -> bool:
    """A block-scaled FP8 weight (or its scale) written as it is: its cuts must fall on block boundaries."""
    return is_scale or (t.dtype.startswith("F8") and t.transform is None)


def shard(tensors: list[TensorPlan], family: Family, cfg, mp: int, files_of: dict[str, str]) -> list[TensorPlan]:
    """Each input tensor becomes one tensor per rank (split or replicated), or, for a routed expert,
    one tensor on the rank owning its contiguous expert range (for a part the table passes through, on rank
    0); one held as segments (`Segment`) becomes one tensor per segment and rank. `files_of` maps input
    tensor -> input file, for error messages."""
    family.check_mp(cfg, mp)
    per_rank = max(family.num_experts(cfg) // mp, 1)
    shapes = {t.name: t.shape for t in tensors}
    out: list[TensorPlan] = []
    for t, mapped in ((t, m) for t in tensors for m in _natives(family, cfg, t, files_of)):
        is_scale = mapped.companion is not None
        if isinstance(mapped.split, Segment):
            weight_shape = shapes.get(mapped.hf_weight, t.shape) if is_scale else t.shape
            ranges = mapped.split.rank_ranges(weight_shape, cfg, mp, tensor=t.name, file=files_of.get(t.source))
            out += _split_heads(t, mapped.name, mapped.split, ranges, weight_shape, is_scale, files_of.get(t.source))
        elif mapped.split == EXPERT:
            rank = mapped.values["expert"] // per_rank
            out.append(t.with_(name=mapped.name, file=mp_file(rank, mp)))
        elif mapped.split == RANK0:  # a part passed through (a wrapper's vision tower): whole, on rank 0
            out.append(t.with_(name=mapped.name, file=mp_file(0, mp)))
        elif mapped.split is None or mp == 1:
            out += [t.with_(name=mapped.name, file=mp_file(r, mp)) for r in range(mp)]
        elif isinstance(mapped.split, HeadSplit):
            weight_shape = shapes.get(mapped.hf_weight, t.shape) if is_scale else t.shape
            ranges = mapped.split.rank_ranges(weight_shape, cfg, mp, tensor=t.name, file=files_of.get(t.source))
            out += _split_heads(t, mapped.name, mapped.split, ranges, weight_shape, is_scale, files_of.get(t.source))
        else:
            out += _split(t, mapped.name, mapped.split, mp, is_scale, files_of.get(t.source))
    return out


def _natives(family: Family, cfg, t: TensorPlan, files_of: dict[str, str]) -> list:
    mapped = family.keys(cfg).to_natives(t.name)
    if not mapped:
        raise PlanError("tensor has no row in the key table", file=files_of.get(t.source), tensor=t.name,
                        fix=f"this {family.name} checkpoint has a tensor ckpttool does not know; report it")
    return mapped


def _split(t: TensorPlan, name: str, dim: int, mp: int, is_scale: bool, file) -> list[TensorPlan]:
    size = t.shape[dim]
    if _fp8_kept(t, is_scale) and (size % mp or (not is_scale and (size // mp) % BLOCK)):
        raise PlanError(f"an mp={mp} split of {size} along dim {dim} does not fall on {BLOCK}x{BLOCK} "
                        "FP8 block boundaries, so a block's scale would straddle ranks", file=file, tensor=t.name,
                        fix="add --dtype bf16 to dequantize before sharding, or choose a smaller --mp")
    if size % mp:
        what = "vocab_size" if name in ("embed.weight", "head.weight") else f"dim {dim}"
        raise PlanError(f"{what} of size {size} is not divisible by mp={mp}", file=file, tensor=t.name,
                        fix=f"choose an --mp that divides {size}")
    part = size // mp
    shape = list(t.shape)
    shape[dim] = part
    return [t.with_(name=name, shape=tuple(shape), narrow=(dim, r * part, part), file=mp_file(r, mp))
            for r in range(mp)]


def _split_heads(t: TensorPlan, name: str, split: HeadSplit, ranges: list[tuple[int, int]],
                 weight_shape: tuple[int, ...], is_scale: bool, file) -> list[TensorPlan]:
    """One narrowed copy per rank; ranks may share a range (replicated KV heads). An FP8 weight kept
    as FP8 (and its scale) must be cut on 128-row/column block boundaries."""
    dim = split.dim
    if _fp8_kept(t, is_scale):
        size = weight_shape[dim]
        if any(start % BLOCK or (length % BLOCK and start + length != size) for start, length in ranges):
            raise PlanError(f"an mp={len(ranges)} cut of {size} along dim {dim} on whole heads does not fall on "
                            f"{BLOCK}x{BLOCK} FP8 block boundaries, so a block's scale would straddle ranks",
                            file=file, tensor=t.name,
                            fix="add --dtype bf16 to dequantize before sharding, or choose a smaller --mp")
        if is_scale:
            ranges = [FP8_SCALE.scale_range(start, length) for start, length in ranges]
    out = []
    for r, (start, length) in enumerate(ranges):
        shape = list(t.shape)
        shape[dim] = length
        out.append(t.with_(name=name, shape=tuple(shape), narrow=(dim, start, length), file=mp_file(r, len(ranges))))
    return out
