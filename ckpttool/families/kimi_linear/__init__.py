"""Kimi-Linear: KDA linear-attention layers beside MLA without rotary, DeepSeek-V3 routing. Its FAMILY row; the
family's files are laid out as families/base.py describes."""

from __future__ import annotations

from ckpttool.families.base import Family
from ckpttool.families.lazy import verifier_in
from ckpttool.families.kimi_linear import spec


FAMILY = Family(
    name="kimi_linear",
    model_types=spec.MODEL_TYPES,
    key_map=spec.KEY_MAPS["hub"],
    key_map_of=lambda cfg: spec.KEY_MAPS[cfg.spelling],
    parse_config=spec.KimiLinearConfig.from_dict,
    expected_shapes=spec.hf_tensor_shapes,
    is_mtp_tensor=lambda cfg, name: False,
    num_experts=lambda cfg: cfg.num_experts,
    vocab_size=lambda cfg: cfg.vocab_size,
    check_mp=spec.check_mp,
    verifier=verifier_in(__name__),
    buffers=("e_score_correction_bias",),  # a registered buffer in transformers' router
)
