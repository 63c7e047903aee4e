"""Gated DeltaNet hybrids: Qwen3-Next and Qwen3.5/3.6 MoE's text model, linear-attention layers beside gated
full attention, routed experts with a gated shared expert, MTP. Its FAMILY row; the family's files are laid
out as families/base.py describes. Qwen3.5 MoE's multimodal checkpoint (qwen3_5_moe) is a wrapper row of
families/multimodal.py over this family."""

from __future__ import annotations

from ckpttool.families.base import Family
from ckpttool.families.lazy import verifier_in
from ckpttool.families.gated_deltanet import spec


FAMILY = Family(
    name="gated_deltanet",
    model_types=spec.MODEL_TYPES,
    key_map=spec.KEY_MAPS["qwen3_next"],
    key_maps=spec.KEY_MAPS,
    parse_config=spec.HybridConfig.from_dict,
    expected_shapes=lambda cfg, with_mtp: spec.hf_tensor_shapes(cfg, with_mtp=with_mtp),
    is_mtp_tensor=spec.is_mtp_tensor,
    num_experts=lambda cfg: cfg.num_experts,
    vocab_size=lambda cfg: cfg.vocab_size,
    check_mp=spec.check_mp,
    verifier=verifier_in(__name__),
    mtp_config_key="mtp_num_hidden_layers",
    explicit_config=spec.explicit_config,
)
