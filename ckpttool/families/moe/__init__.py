"""Mixture-of-experts decoders with Llama-style attention: Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, GLM-4.5,
MiniMax-M2 and ERNIE-4.5-MoE. Its FAMILY row; the family's files are laid out as families/base.py describes."""

from __future__ import annotations

from ckpttool.families.base import Family
from ckpttool.families.lazy import verifier_in
from ckpttool.families.moe import spec


FAMILY = Family(
    name="moe",
    model_types=spec.MODEL_TYPES,
    key_map=spec.KEY_MAPS["qwen3_moe"],
    key_maps=spec.KEY_MAPS,
    parse_config=spec.MoeConfig.from_dict,
    expected_shapes=lambda cfg, with_mtp: spec.hf_tensor_shapes(cfg, with_mtp=with_mtp),
    is_mtp_tensor=spec.is_mtp_tensor,
    num_experts=lambda cfg: cfg.num_experts,
    vocab_size=lambda cfg: cfg.vocab_size,
    check_mp=spec.check_mp,
    verifier=verifier_in(__name__),
    mtp_config_key="num_nextn_predict_layers",
    explicit_config=spec.explicit_config,
    quantize=True,
    # a registered buffer in GLM's and MiniMax-M2's routers (ERNIE's moe_statics.e_score_correction_bias is a
    # parameter, and counts)
    buffers=("gate.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias"),
)
