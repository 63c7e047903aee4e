"""verify's MiMo-V2-Flash loaders: an mp shard (mp names as they are), a whole HF checkpoint at mp=1 through
KEY_MAP (stacked experts and transformers' own names read as the table's), and the comparison of every
loaded weight with its slice of a reference HF checkpoint."""

from __future__ import annotations

from pathlib import Path

from ckpttool.families.base import Verifier, rank_slice, unstack_experts
from ckpttool.families.mimo.model import MiMoArgs, MiMoTransformer
from ckpttool.families.mimo.spec import KEY_MAP, hf_tensor_shapes
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.model.loading import check_tensors, load_mp_shard, reference_differences
from ckpttool.model.parallel import ParallelContext


def _source(model: MiMoTransformer, ctx: ParallelContext):
    cfg = model.args.cfg
    shapes = hf_tensor_shapes(cfg)
    return lambda native, _=None: rank_slice(KEY_MAP, native, shapes, cfg, ctx.rank, ctx.world_size)


def load_hf(model: MiMoTransformer, directory: Path, n_layers: int = 0) -> None:
    """A whole HF checkpoint into an mp=1 model, strictly (every parameter, nothing extra)."""
    source = _source(model, ParallelContext())
    with Checkpoint(directory) as ckpt:
        unstack_experts(ckpt, KEY_MAP, model.args.cfg.num_experts)
        params = dict(model.named_parameters())
        names = {source(n)[0]: n for n in params}
        check_tensors(params, {names.get(hf, hf): (hf, src.info) for hf, src in ckpt.tensors.items()}, directory)
        for hf, name in names.items():
            params[name].data.copy_(ckpt.read(hf))


def weight_differences(model: MiMoTransformer, ctx: ParallelContext, reference: Path, n_layers: int,
                       shard: Path) -> list[str]:
    return reference_differences(model, reference, shard, _source(model, ctx),
                                 prepare=lambda ckpt: unstack_experts(ckpt, KEY_MAP, model.args.cfg.num_experts))


VERIFIER = Verifier(
    load_args=MiMoArgs.from_hf_config,
    build=lambda args, ctx, dtype, attn: MiMoTransformer(args, ctx, dtype=dtype),
    load_shard=load_mp_shard,
    load_hf=load_hf,
    weight_differences=weight_differences,
)
