"""gpt-oss (openai/gpt-oss-20b, -120b): GQA with sinks, sliding windows, MXFP4 stacked experts. Its FAMILY row; the
family's files are laid out as families/base.py describes."""

from __future__ import annotations

from ckpttool.families.base import Family
from ckpttool.families.lazy import verifier_in
from ckpttool.families.gpt_oss import spec


FAMILY = Family(
    name="gpt-oss",
    model_types=("gpt_oss",),
    key_map=spec.KEY_MAP,
    parse_config=spec.GptOssConfig.from_dict,
    expected_shapes=lambda cfg, with_mtp: spec.hf_tensor_shapes(cfg),
    is_mtp_tensor=lambda cfg, name: False,
    num_experts=lambda cfg: cfg.num_local_experts,
    vocab_size=lambda cfg: cfg.vocab_size,
    check_mp=spec.check_mp,
    verifier=verifier_in(__name__),
)
