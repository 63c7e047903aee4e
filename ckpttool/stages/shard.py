"""Rename to the reference mp layout and split for tensor + expert parallelism, from one key table."""

from __future__ import annotations

from ckpttool.arch.base import Arch, HeadSplit
from ckpttool.arch.deepseek import EXPERT, FP8_BLOCK
from ckpttool.errors import PlanError
from ckpttool.plan import TensorPlan
from ckpttool.stages.dequant import SCALE_SUFFIX


def mp_file(rank: int, mp: int) -> str:
    return f"model{rank}-mp{mp}.safetensors"


def shard(tensors: list[TensorPlan], arch: Arch, cfg, mp: int, files_of: dict[str, str]) -> list[TensorPlan]:
    """Each input tensor becomes one tensor per rank (split or replicated), or, for a routed expert,
    one tensor on the rank owning its contiguous expert range. `files_of` maps input tensor -> input
    file, for error messages."""
    arch.check_mp(cfg, mp)
    per_rank = max(arch.num_experts(cfg) // mp, 1)
    shapes = {t.name: t.shape for t in tensors}
    out: list[TensorPlan] = []
    for t in tensors:
        is_scale = t.name.endswith(SCALE_SUFFIX)
        hf_weight = t.name[: -len(SCALE_SUFFIX)] if is_scale else t.name
        mapped = arch.key_map.to_native(hf_weight)
        if mapped is None:
            raise PlanError("tensor has no row in the key table", file=files_of.get(t.source), tensor=t.name,
                            fix=f"this {arch.name} checkpoint has a tensor ckpttool does not know; report it")
        name = mapped.name[: -len("weight")] + "scale" if is_scale else mapped.name
        if mapped.split == EXPERT:
            rank = mapped.values["expert"] // per_rank
            out.append(t.with_(name=name, file=mp_file(rank, mp)))
        elif mapped.split is None or mp == 1:
            out += [t.with_(name=name, file=mp_file(r, mp)) for r in range(mp)]
        elif isinstance(mapped.split, HeadSplit):
            weight_shape = shapes.get(hf_weight, t.shape)
            ranges = head_ranges(mapped.split, weight_shape, cfg, mp, tensor=t.name, file=files_of.get(t.source))
            out += _split_heads(t, name, mapped.split, ranges, weight_shape, is_scale, files_of.get(t.source))
        else:
            out += _split(t, name, mapped.split, mp, is_scale, files_of.get(t.source))
    return out


def _split(t: TensorPlan, name: str, dim: int, mp: int, is_scale: bool, file) -> list[TensorPlan]:
    size = t.shape[dim]
    fp8_kept = is_scale or (t.dtype.startswith("F8") and t.transform is None)
    if fp8_kept and (size % mp or (not is_scale and (size // mp) % FP8_BLOCK)):
        raise PlanError(f"an mp={mp} split of {size} along dim {dim} does not fall on {FP8_BLOCK}x{FP8_BLOCK} "
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


def head_ranges(split: HeadSplit, weight_shape: tuple[int, ...], cfg, mp: int, *, tensor: str | None = None,
                file=None) -> list[tuple[int, int]]:
    """(start, length) along split.dim of each rank's share of a weight (or bias) cut on whole heads."""
    ranges = split.ranges(weight_shape[split.dim], getattr(cfg, split.count), mp)
    if isinstance(ranges, str):
        raise PlanError(ranges, file=file, tensor=tensor, fix=f"choose an --mp that fits {split.count}")
    return ranges


def _split_heads(t: TensorPlan, name: str, split: HeadSplit, ranges: list[tuple[int, int]],
                 weight_shape: tuple[int, ...], is_scale: bool, file) -> list[TensorPlan]:
    """One narrowed copy per rank; ranks may share a range (replicated KV heads). An FP8 weight kept
    as FP8 (and its scale) must be cut on 128-row/column block boundaries."""
    dim = split.dim
    if is_scale or (t.dtype.startswith("F8") and t.transform is None):
        size = weight_shape[dim]
        if any(start % FP8_BLOCK or (length % FP8_BLOCK and start + length != size) for start, length in ranges):
            raise PlanError(f"an mp={len(ranges)} cut of {size} along dim {dim} on whole heads does not fall on "
                            f"{FP8_BLOCK}x{FP8_BLOCK} FP8 block boundaries, so a block's scale would straddle ranks",
                            file=file, tensor=t.name,
                            fix="add --dtype bf16 to dequantize before sharding, or choose a smaller --mp")
        if is_scale:
            ranges = [(start // FP8_BLOCK, -(-length // FP8_BLOCK)) for start, length in ranges]
    out = []
    for r, (start, length) in enumerate(ranges):
        shape = list(t.shape)
        shape[dim] = length
        out.append(t.with_(name=name, shape=tuple(shape), narrow=(dim, start, length), file=mp_file(r, len(ranges))))
    return out
