"""Rename to the reference mp layout and split for tensor + expert parallelism, from one key table."""

from __future__ import annotations

from ckpttool.arch.base import Arch
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
    n_experts = arch.num_experts(cfg)
    if n_experts % mp:
        raise PlanError(f"{n_experts} routed experts cannot be split evenly over mp={mp}",
                        fix=f"choose --mp dividing {n_experts}")
    per_rank = n_experts // mp
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
        else:
            out += _split(t, name, mapped.split, mp, is_scale, files_of.get(t.source))
    return out


def _split(t: TensorPlan, name: str, dim: int, mp: int, is_scale: bool, file) -> list[TensorPlan]:
    size = t.shape[dim]
    fp8_kept = is_scale or (t.dtype.startswith("F8") and t.scale is None)
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
