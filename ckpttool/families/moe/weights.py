"""verify's MoE loaders: an mp shard (mp names as they are; kept MTP layers skipped and counted), a
whole HF checkpoint at mp=1 through the model type's key table, and the comparison of every loaded
weight with its slice of a reference HF checkpoint."""

from __future__ import annotations

from pathlib import Path

from ckpttool.families.base import Verifier, rank_slice, unstack_experts
from ckpttool.families.moe.model import MoeArgs, MoeTransformer
from ckpttool.families.moe.spec import KEY_MAPS, hf_tensor_shapes, is_mtp_tensor
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.model.loading import check_tensors, load_mp_shard, reference_differences
from ckpttool.model.parallel import ParallelContext


def _source(model: MoeTransformer, ctx: ParallelContext):
    cfg = model.args.cfg
    keys, shapes = KEY_MAPS[cfg.model_type], hf_tensor_shapes(cfg, with_mtp=False)
    return lambda native, _=None: rank_slice(keys, native, shapes, cfg, ctx.rank, ctx.world_size)


def load_shard(model: MoeTransformer, path: Path) -> int:
    cfg = model.args.cfg
    keys = KEY_MAPS[cfg.model_type]

    def is_mtp(native: str) -> bool:
        mapped = keys.to_hf(native)
        return mapped is not None and is_mtp_tensor(cfg, mapped.name)

    return load_mp_shard(model, path, skip=is_mtp)


def load_hf(model: MoeTransformer, directory: Path, n_layers: int = 0) -> None:
    """A whole HF checkpoint into an mp=1 model, strictly; MTP layers skipped."""
    source = _source(model, ParallelContext())
    with Checkpoint(directory) as ckpt:
        unstack_experts(ckpt, KEY_MAPS[model.args.cfg.model_type], model.args.cfg.num_experts)
        params = dict(model.named_parameters())
        names = {source(n)[0]: n for n in params}
        cfg = model.args.cfg
        found = {names.get(hf, hf): (hf, src.info) for hf, src in ckpt.tensors.items() if not is_mtp_tensor(cfg, hf)}
        check_tensors(params, found, directory)
        for hf, name in names.items():
            params[name].data.copy_(ckpt.read(hf))


def weight_differences(model: MoeTransformer, ctx: ParallelContext, reference: Path, n_layers: int,
                       shard: Path) -> list[str]:
    cfg = model.args.cfg
    return reference_differences(model, reference, shard, _source(model, ctx),
                                 prepare=lambda ckpt: unstack_experts(ckpt, KEY_MAPS[cfg.model_type], cfg.num_experts))


VERIFIER = Verifier(
    load_args=MoeArgs.from_hf_config,
    build=lambda args, ctx, dtype, attn: MoeTransformer(args, ctx, dtype=dtype),
    load_shard=load_shard,
    load_hf=load_hf,
    weight_differences=weight_differences,
)
