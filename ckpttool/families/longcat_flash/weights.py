"""verify's LongCat-Flash loaders: an mp shard (mp names as they are), a whole HF checkpoint at mp=1 through the
key table, and the comparison of every loaded weight with its slice of a reference HF checkpoint. Either
spelling (spec.py) is bound from the tensor names before loading, so the zero experts' unused weights that
transformers' save_pretrained writes are loaded strictly too. A kept MTP layer is not run (transformers has
none to compare with), but each of its tensors in a shard is compared with its slice of the reference."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ckpttool.families.base import Verifier, rank_slice, unstack_experts
from ckpttool.families.longcat_flash.model import LongcatFlashArgs, LongcatFlashTransformer
from ckpttool.families.longcat_flash.spec import (KEY_MAP, MTP_NATIVE, hf_tensor_shapes, is_mtp_tensor, spelled,
                                                  stacked_experts)
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.model.loading import (check_tensors, load_mp_shard, read_shard_header, reference_differences,
                                    stored_differences)
from ckpttool.model.parallel import ParallelContext


def _bind(model: LongcatFlashTransformer, names) -> None:
    cfg = spelled(model.args.cfg, names)
    if cfg.spelling != model.args.cfg.spelling:
        model.args = replace(model.args, cfg=cfg)
        model.hold_unused_zero_expert_weights()


def _source(model: LongcatFlashTransformer, ctx: ParallelContext):
    cfg = model.args.cfg
    shapes = hf_tensor_shapes(cfg)
    return lambda native, _=None: rank_slice(KEY_MAP, native, shapes, cfg, ctx.rank, ctx.world_size)


def _prepared(model: LongcatFlashTransformer, prepare):
    """An HF checkpoint as the key table names it: a wrapper's `prepare` first, then transformers' own stacked
    experts read one by one (spec.stacked_experts)."""
    def run(ckpt) -> None:
        if prepare is not None:
            prepare(ckpt)
        cfg = model.args.cfg
        unstack_experts(ckpt, KEY_MAP, cfg.num_experts, stacked_experts(cfg))

    return run


MTP_SKIPPED = "MTP (not run; each compared with its slice of the reference, when one is given)"
"""how verify's load check counts a kept MTP layer's tensors (verify/run.py renders the count under this name)"""


def _is_mtp(native: str) -> bool:
    return native.startswith(MTP_NATIVE)


def load_shard(model: LongcatFlashTransformer, path: Path) -> dict[str, int]:
    _bind(model, read_shard_header(Path(path)).tensors)
    return {MTP_SKIPPED: load_mp_shard(model, path, skip=_is_mtp)}


def load_hf(model: LongcatFlashTransformer, directory: Path, n_layers: int = 0, prepare=None) -> None:
    """A whole HF checkpoint into an mp=1 model, strictly."""
    with Checkpoint(directory) as ckpt:
        _prepared(model, prepare)(ckpt)
        _bind(model, ckpt.tensors)
        source = _source(model, ParallelContext())
        params, cfg = dict(model.named_parameters()), model.args.cfg
        names = {source(n)[0]: n for n in params}
        check_tensors(params, {names.get(hf, hf): (hf, src.info) for hf, src in ckpt.tensors.items()
                               if not is_mtp_tensor(cfg, hf)}, directory)
        for hf, name in names.items():
            params[name].data.copy_(ckpt.read(hf))


def weight_differences(model: LongcatFlashTransformer, ctx: ParallelContext, reference: Path, n_layers: int,
                       shard: Path, prepare=None) -> list[str]:
    """Every loaded weight, then every MTP tensor the shard holds, against its slice of the reference."""
    source, prepared = _source(model, ctx), _prepared(model, prepare)
    problems = reference_differences(model, reference, shard, source, prepare=prepared)
    return problems + stored_differences(shard, _is_mtp, reference, source, prepare=prepared)


VERIFIER = Verifier(
    load_args=LongcatFlashArgs.from_hf_config,
    build=lambda args, ctx, dtype, attn: LongcatFlashTransformer(args, ctx, dtype=dtype),
    load_shard=load_shard,
    load_hf=load_hf,
    weight_differences=weight_differences,
)
