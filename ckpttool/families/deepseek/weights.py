"""verify's MLA loaders: an mp shard (mp names as they are), or a whole HF checkpoint at mp=1
through KEY_MAP (MTP layers, which the bundled model does not have, are skipped), and the comparison
of every loaded weight with its slice of a reference HF checkpoint."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ckpttool.families.base import Verifier, layer_index, unstack_experts
from ckpttool.families.deepseek.args import ModelArgs
from ckpttool.families.deepseek.model import Transformer
from ckpttool.families.deepseek.spec import KEY_MAP
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.io.safetensors import TensorInfo
from ckpttool.model.loading import MAX_LISTED, check_tensors, load_mp_shard, reference_differences
from ckpttool.model.parallel import ParallelContext


def hf_name_and_split(native: str) -> tuple[str, object]:
    """The HF name of a model parameter (`layers.3.ffn.experts.7.w1.scale` ->
    `model.layers.3.mlp.experts.7.gate_proj.weight_scale_inv`) and how convert splits it: a dim or None."""
    mapped = KEY_MAP.to_hf(native)
    if mapped is None:
        raise KeyError(f"no HF name for model parameter {native!r}")  # a model/table mismatch: a bug here
    return mapped.name, mapped.split if isinstance(mapped.split, int) else None


def load_hf_checkpoint(model: nn.Module, directory: Path, n_layers: int, prepare=None) -> None:
    """Load a whole HF checkpoint into an mp=1 model; MTP layers (>= n_layers) are skipped. `prepare(ckpt)`
    runs first (a wrapper names its text tower as this family does)."""
    with Checkpoint(directory) as ckpt:
        if prepare is not None:
            prepare(ckpt)
        unstack_experts(ckpt, KEY_MAP, model.args.n_routed_experts)
        params = dict(model.named_parameters())
        wanted = {hf_name_and_split(name)[0]: name for name in params}
        available: dict[str, tuple[str, TensorInfo]] = {}
        for hf, src in ckpt.tensors.items():
            layer = layer_index(hf)
            if layer is not None and layer >= n_layers:
                continue  # multi-token-prediction layers are not part of the model
            available[wanted.get(hf, hf)] = (hf, src.info)
        check_tensors(params, available, directory)
        for hf, name in wanted.items():
            params[name].data.copy_(ckpt.read(hf))


def weight_differences(model: nn.Module, ctx: ParallelContext, reference: Path, n_layers: int,
                       shard: Path, limit: int = MAX_LISTED, prepare=None) -> list[str]:
    """Every loaded weight against its slice of the reference HF checkpoint (`prepare(ckpt)` first)."""

    def prepared(ckpt: Checkpoint) -> None:
        if prepare is not None:
            prepare(ckpt)
        unstack_experts(ckpt, KEY_MAP, model.args.n_routed_experts)

    def source(name: str, ckpt: Checkpoint) -> tuple[str, tuple[int, int, int] | None]:
        hf, split = hf_name_and_split(name)
        if split is None or ctx.world_size == 1 or hf not in ckpt.tensors:
            return hf, None  # expert tensors are whole per rank; a missing one is reported by the caller
        part = ckpt.source(hf).info.shape[split] // ctx.world_size
        return hf, (split, ctx.rank * part, part)

    return reference_differences(model, reference, shard, source, limit, prepare=prepared)


def load_shard(model: Transformer, path: Path, skip=None) -> int:
    """An mp shard, strictly; the MTP layers config.json declares (kept by `--keep-mtp`) are not part
    of the model verify runs and are skipped (and counted), as are the tensors `skip` names. A layer past
    those is still an error."""
    mtp = range(model.args.n_layers, model.args.n_layers + model.args.n_mtp_layers)

    def is_mtp(native: str) -> bool:
        parts = native.split(".")
        return len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) in mtp

    return load_mp_shard(model, path, skip=is_mtp if skip is None else lambda n: is_mtp(n) or skip(n))


VERIFIER = Verifier(
    load_args=ModelArgs.from_hf_config,
    build=lambda args, ctx, dtype, attn: Transformer(args, ctx, dtype=dtype, attn_impl=attn),
    load_shard=load_shard,
    load_hf=load_hf_checkpoint,
    weight_differences=weight_differences,
)
