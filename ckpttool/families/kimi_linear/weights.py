"""verify's Kimi-Linear loaders: an mp shard (mp names as they are), a whole HF checkpoint at mp=1 through the
spelling's key table, and the comparison of every loaded weight with its slice of a reference HF checkpoint;
`prepare` and `skip` are what a multimodal wrapper would pass."""

from __future__ import annotations

from pathlib import Path

from ckpttool.families.base import Verifier, rank_slice
from ckpttool.families.kimi_linear.model import KimiLinearArgs, KimiLinearTransformer
from ckpttool.families.kimi_linear.spec import KEY_MAPS, hf_tensor_shapes
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.model.loading import check_tensors, load_mp_shard, reference_differences
from ckpttool.model.parallel import ParallelContext


def _source(model: KimiLinearTransformer, ctx: ParallelContext):
    cfg = model.args.cfg
    keys, shapes = KEY_MAPS[cfg.spelling], hf_tensor_shapes(cfg)
    return lambda native, _=None: rank_slice(keys, native, shapes, cfg, ctx.rank, ctx.world_size)


def load_hf(model: KimiLinearTransformer, directory: Path, n_layers: int = 0, prepare=None) -> None:
    """A whole HF checkpoint into an mp=1 model, strictly."""
    source = _source(model, ParallelContext())
    with Checkpoint(directory) as ckpt:
        if prepare is not None:
            prepare(ckpt)
        params = dict(model.named_parameters())
        names = {source(n)[0]: n for n in params}
        check_tensors(params, {names.get(hf, hf): (hf, src.info) for hf, src in ckpt.tensors.items()}, directory)
        for hf, name in names.items():
            params[name].data.copy_(ckpt.read(hf))


VERIFIER = Verifier(
    load_args=KimiLinearArgs.from_hf_config,
    build=lambda args, ctx, dtype, attn: KimiLinearTransformer(args, ctx, dtype=dtype),
    load_shard=lambda model, path, skip=None: load_mp_shard(model, path, skip=skip),
    load_hf=load_hf,
    weight_differences=lambda model, ctx, reference, n_layers, shard, prepare=None: reference_differences(
        model, reference, shard, _source(model, ctx), prepare=prepare),
)
