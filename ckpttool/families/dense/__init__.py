"""Dense decoders: Llama, Mistral, Qwen2, Qwen3 (GQA attention, SwiGLU MLP). Its FAMILY row; the
family's files are laid out as families/base.py describes."""

from __future__ import annotations

from ckpttool.families.base import Family
from ckpttool.families.lazy import verifier_in
from ckpttool.families.dense import spec


FAMILY = Family(
    name="dense",
    model_types=spec.MODEL_TYPES,
    key_map=spec.KEY_MAP,
    parse_config=spec.DenseConfig.from_dict,
    expected_shapes=lambda cfg, with_mtp: spec.hf_tensor_shapes(cfg),
    is_mtp_tensor=lambda cfg, name: False,
    num_experts=lambda cfg: 0,
    vocab_size=lambda cfg: cfg.vocab_size,
    check_mp=spec.check_mp,
    verifier=verifier_in(__name__),
    quantize=True,
)
