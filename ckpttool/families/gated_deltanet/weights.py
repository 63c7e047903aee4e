"""verify's Gated DeltaNet loaders: an mp shard (mp names as they are; kept MTP layers skipped and counted), a
whole HF checkpoint at mp=1 through the model type's key table (a conv or in_proj_qkv read as the segments the
model holds), and the comparison of every loaded weight with its slice of a reference HF checkpoint; `prepare`
and `skip` are what a multimodal wrapper passes (its text tower renamed, its vision tower skipped)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ckpttool.families.base import Verifier, rank_slice, unstack_experts
from ckpttool.families.gated_deltanet.model import HybridArgs, HybridTransformer
from ckpttool.families.gated_deltanet.spec import KEY_MAPS, hf_tensor_shapes, is_mtp_tensor
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.io.safetensors import TensorInfo
from ckpttool.model.loading import check_tensors, load_mp_shard, reference_differences
from ckpttool.model.parallel import ParallelContext


def _source(model: HybridTransformer, ctx: ParallelContext):
    cfg = model.args.cfg
    keys, shapes = KEY_MAPS[cfg.model_type], hf_tensor_shapes(cfg, with_mtp=False)
    return lambda native, _=None: rank_slice(keys, native, shapes, cfg, ctx.rank, ctx.world_size)


def _prepared(model: HybridTransformer, prepare):
    def run(ckpt: Checkpoint) -> None:
        if prepare is not None:
            prepare(ckpt)
        unstack_experts(ckpt, KEY_MAPS[model.args.cfg.model_type], model.args.cfg.num_experts)
    return run


def load_shard(model: HybridTransformer, path: Path, skip=None) -> int:
    return load_mp_shard(model, path, skip=lambda native: native.startswith("mtp.") or bool(skip and skip(native)))


def load_hf(model: HybridTransformer, directory: Path, n_layers: int = 0, prepare=None) -> None:
    """A whole HF checkpoint into an mp=1 model, strictly; MTP layers skipped. A parameter held as a segment
    of an HF tensor is checked and loaded as its slice."""
    cfg = model.args.cfg
    source = _source(model, ParallelContext())
    with Checkpoint(directory) as ckpt:
        _prepared(model, prepare)(ckpt)
        params = dict(model.named_parameters())
        sources = {name: source(name) for name in params}
        found = {name: (hf, _narrowed(ckpt.tensors[hf].info, narrow)) for name, (hf, narrow) in sources.items()
                 if hf in ckpt.tensors}
        held = {hf for hf, _ in sources.values()}
        found.update({hf: (hf, src.info) for hf, src in ckpt.tensors.items()  # unexpected: named as they are
                      if hf not in held and not is_mtp_tensor(cfg, hf)})
        check_tensors(params, found, directory)
        for name, (hf, narrow) in sources.items():
            tensor = ckpt.read(hf)
            params[name].data.copy_(tensor if narrow is None else tensor.narrow(*narrow))


def _narrowed(info: TensorInfo, narrow: tuple[int, int, int] | None) -> TensorInfo:
    if narrow is None:
        return info
    dim, _, length = narrow
    return replace(info, shape=tuple(length if d == dim else n for d, n in enumerate(info.shape)))


def weight_differences(model: HybridTransformer, ctx: ParallelContext, reference: Path, n_layers: int,
                       shard: Path, prepare=None) -> list[str]:
    return reference_differences(model, reference, shard, _source(model, ctx), prepare=_prepared(model, prepare))


VERIFIER = Verifier(
    load_args=HybridArgs.from_hf_config,
    build=lambda args, ctx, dtype, attn: HybridTransformer(args, ctx, dtype=dtype),
    load_shard=load_shard,
    load_hf=load_hf,
    weight_differences=weight_differences,
)
