"""verify's Llama-4 loaders: an mp shard (mp names as they are), a whole HF checkpoint at mp=1 through
KEY_MAP, and the comparison of every loaded weight with its slice of a reference HF checkpoint (the
stacked experts by expert range)."""

from __future__ import annotations

from pathlib import Path

from ckpttool.families.base import Verifier, rank_slice
from ckpttool.families.llama4.model import Llama4Args, Llama4Transformer
from ckpttool.families.llama4.spec import KEY_MAP, hf_tensor_shapes
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.model.loading import check_tensors, load_mp_shard, reference_differences
from ckpttool.model.parallel import ParallelContext


def _source(model: Llama4Transformer, ctx: ParallelContext):
    cfg = model.args.cfg
    shapes = hf_tensor_shapes(cfg)
    return lambda native, _=None: rank_slice(KEY_MAP, native, shapes, cfg, ctx.rank, ctx.world_size)


def load_hf(model: Llama4Transformer, directory: Path, n_layers: int = 0) -> None:
    """A whole HF checkpoint into an mp=1 model, strictly (every parameter, nothing extra)."""
    source = _source(model, ParallelContext())
    with Checkpoint(directory) as ckpt:
        params = dict(model.named_parameters())
        names = {source(n)[0]: n for n in params}
        check_tensors(params, {names.get(hf, hf): (hf, src.info) for hf, src in ckpt.tensors.items()}, directory)
        for hf, name in names.items():
            params[name].data.copy_(ckpt.read(hf))


def weight_differences(model: Llama4Transformer, ctx: ParallelContext, reference: Path, n_layers: int,
                       shard: Path) -> list[str]:
    return reference_differences(model, reference, shard, _source(model, ctx))


VERIFIER = Verifier(
    load_args=Llama4Args.from_hf_config,
    build=lambda args, ctx, dtype, attn: Llama4Transformer(args, ctx, dtype=dtype),
    load_shard=load_mp_shard,
    load_hf=load_hf,
    weight_differences=weight_differences,
)
