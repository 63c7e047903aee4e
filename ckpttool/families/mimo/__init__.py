"""MiMo-V2-Flash (`mimo_v2_flash`): sliding-window layers with twice the KV heads and attention sinks beside
full ones, narrower value heads, a rope per layer kind, DeepSeek-V3 routing without a shared expert (spec.py
says why it is not a row of families/moe). Its FAMILY row; the family's files are laid out as families/base.py
describes."""

from __future__ import annotations

from ckpttool.families.base import Family
from ckpttool.families.lazy import verifier_in
from ckpttool.families.mimo import spec


FAMILY = Family(
    name="mimo",
    model_types=spec.MODEL_TYPES,
    key_map=spec.KEY_MAP,
    parse_config=spec.MiMoConfig.from_dict,
    expected_shapes=lambda cfg, with_mtp: spec.hf_tensor_shapes(cfg),
    is_mtp_tensor=lambda cfg, name: False,
    num_experts=lambda cfg: cfg.num_experts,
    vocab_size=lambda cfg: cfg.vocab_size,
    check_mp=spec.check_mp,
    verifier=verifier_in(__name__),
    explicit_config=spec.explicit_config,
    quantize=True,
    buffers=("e_score_correction_bias",),  # a registered buffer in its DeepSeek-V3 router
)
