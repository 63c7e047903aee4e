"""Llama-4's text model (`llama4_text`): stacked, transposed experts kept stacked per rank, input-scaled
routing, per-layer RoPE / NoPE, L2 q/k norm, temperature and chunked attention (spec.py says why it is
not a row of families/moe). Its FAMILY row; the family's files are laid out as families/base.py describes."""

from __future__ import annotations

from ckpttool.families.base import Family
from ckpttool.families.lazy import verifier_in
from ckpttool.families.llama4 import spec


FAMILY = Family(
    name="llama4",
    model_types=spec.MODEL_TYPES,
    key_map=spec.KEY_MAP,
    parse_config=spec.Llama4Config.from_dict,
    expected_shapes=lambda cfg, with_mtp: spec.hf_tensor_shapes(cfg),
    is_mtp_tensor=lambda cfg, name: False,
    num_experts=lambda cfg: cfg.num_experts,
    vocab_size=lambda cfg: cfg.vocab_size,
    check_mp=spec.check_mp,
    verifier=verifier_in(__name__),
    explicit_config=spec.explicit_config,
)
