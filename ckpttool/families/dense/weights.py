"""verify's dense loaders: an mp shard (mp names as they are), a whole HF checkpoint at mp=1 through
KEY_MAP, and the comparison of every loaded weight with its slice of a reference HF checkpoint."""

from __future__ import annotations

from pathlib import Path

from ckpttool.families.base import Verifier, rank_slice
from ckpttool.families.dense.model import DenseArgs, DenseTransformer
from ckpttool.families.dense.spec import KEY_MAP, DenseConfig, hf_tensor_shapes
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.model.loading import check_tensors, load_mp_shard, reference_differences
from ckpttool.model.parallel import ParallelContext


def hf_source(native: str, ctx: ParallelContext, cfg: DenseConfig) -> tuple[str, tuple[int, int, int] | None]:
    """The HF tensor a model parameter comes from, and the (dim, start, length) this rank holds of it."""
    return rank_slice(KEY_MAP, native, hf_tensor_shapes(cfg), cfg, ctx.rank, ctx.world_size)


def load_hf_dense(model: DenseTransformer, directory: Path, n_layers: int = 0) -> None:
    """Load a whole HF checkpoint into an mp=1 model, strictly (every parameter, nothing extra)."""
    with Checkpoint(directory) as ckpt:
        params = dict(model.named_parameters())
        names = {hf_source(n, ParallelContext(), model.args.cfg)[0]: n for n in params}
        check_tensors(params, {names.get(hf, hf): (hf, src.info) for hf, src in ckpt.tensors.items()}, directory)
        for hf, name in names.items():
            params[name].data.copy_(ckpt.read(hf))


def dense_weight_differences(model: DenseTransformer, ctx: ParallelContext, reference: Path, n_layers: int,
                             shard: Path) -> list[str]:
    """Every loaded weight against its slice of the reference HF checkpoint (FP8 compared dequantized)."""
    return reference_differences(model, reference, shard, lambda name, _: hf_source(name, ctx, model.args.cfg))


VERIFIER = Verifier(
    load_args=DenseArgs.from_hf_config,
    build=lambda args, ctx, dtype, attn: DenseTransformer(args, ctx, dtype=dtype),
    load_shard=load_mp_shard,
    load_hf=load_hf_dense,
    weight_differences=dense_weight_differences,
)
