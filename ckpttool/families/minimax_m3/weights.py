"""verify's MiniMax-M3 loaders: an mp shard (mp names as they are), a whole HF checkpoint at mp=1 through the
key table, and the comparison of every loaded weight with its slice of a reference HF checkpoint; `prepare`
and `skip` are what a multimodal wrapper passes (its text tower renamed, its vision tower skipped)."""

from __future__ import annotations

from pathlib import Path

from ckpttool.families.base import Verifier, rank_slice, unstack_experts
from ckpttool.families.minimax_m3.model import MiniMaxM3Args, MiniMaxM3Transformer
from ckpttool.families.minimax_m3.spec import KEY_MAP, hf_tensor_shapes
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.model.loading import check_tensors, load_mp_shard, reference_differences
from ckpttool.model.parallel import ParallelContext


def _source(model: MiniMaxM3Transformer, ctx: ParallelContext):
    cfg = model.args.cfg
    shapes = hf_tensor_shapes(cfg)
    return lambda native, _=None: rank_slice(KEY_MAP, native, shapes, cfg, ctx.rank, ctx.world_size)


def _prepared(model: MiniMaxM3Transformer, prepare):
    def run(ckpt: Checkpoint) -> None:
        if prepare is not None:
            prepare(ckpt)
        unstack_experts(ckpt, KEY_MAP, model.args.cfg.num_experts)
    return run


def load_shard(model: MiniMaxM3Transformer, path: Path, skip=None) -> int:
    return load_mp_shard(model, path, skip=skip)


def load_hf(model: MiniMaxM3Transformer, directory: Path, n_layers: int = 0, prepare=None) -> None:
    """A whole HF checkpoint into an mp=1 model, strictly."""
    source = _source(model, ParallelContext())
    with Checkpoint(directory) as ckpt:
        _prepared(model, prepare)(ckpt)
        params = dict(model.named_parameters())
        names = {source(n)[0]: n for n in params}
        check_tensors(params, {names.get(hf, hf): (hf, src.info) for hf, src in ckpt.tensors.items()}, directory)
        for hf, name in names.items():
            params[name].data.copy_(ckpt.read(hf))


def weight_differences(model: MiniMaxM3Transformer, ctx: ParallelContext, reference: Path, n_layers: int,
                       shard: Path, prepare=None) -> list[str]:
    return reference_differences(model, reference, shard, _source(model, ctx), prepare=_prepared(model, prepare))


VERIFIER = Verifier(
    load_args=MiniMaxM3Args.from_hf_config,
    build=lambda args, ctx, dtype, attn: MiniMaxM3Transformer(args, ctx, dtype=dtype),
    load_shard=load_shard,
    load_hf=load_hf,
    weight_differences=weight_differences,
)
