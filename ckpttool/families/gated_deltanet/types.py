"""Each model type of the Gated DeltaNet family as a row of data: how its linear-attention layers name their
projections, which config fields it reads and their transformers class defaults, and which of its layers
are MoE. spec.py reads every type through these rows with one code path.

The defaults are what each transformers config class holds for a field config.json leaves out (held to the
installed classes by tests/test_gated_deltanet.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def _fixed(value):
    return lambda d: value


@dataclass(frozen=True, slots=True)
class HybridType:
    fused_projections: bool
    """Qwen3-Next's `in_proj_qkvz` and `in_proj_ba`, their rows grouped per key head ([q, k, v, z] of each
    group, then [b, a]); else Qwen3.5's `in_proj_qkv` (every q row, then every k, then every v), `in_proj_z`,
    `in_proj_b` and `in_proj_a`"""
    defaults: dict = field(default_factory=dict)
    sparse_step: Callable[[dict], int] = _fixed(1)
    """Qwen's decoder_sparse_step: layer i is MoE when (i + 1) % step == 0 (0: none is)"""
    dense_layers: Callable[[dict], frozenset] = _fixed(frozenset())
    """Qwen's mlp_only_layers"""
    dense_width: Callable[[dict], int] = _fixed(0)
    """the dense MLP's width (intermediate_size; 0 where the type has no dense layers)"""
    norm_topk_prob: Callable[[dict], bool] = _fixed(True)
    mtp_layers: Callable[[dict], int] = _fixed(0)
    """MTP layers after the decoder (`mtp.layers.N`, with `mtp.fc` and its norms): the published configs'
    count, else one (what vLLM's MTP model assumes); a checkpoint without any is read as one they were dropped from"""
    default_theta: float = 10000.0
    partial_rotary: float = 0.25
    """the class's partial_rotary_factor when neither rope_parameters nor config.json states one"""
    full_attention_interval: int = 4
    """layer_types when config.json has none: every `full_attention_interval`-th layer is full attention"""


def _mtp_count(d: dict) -> int:
    for name in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if d.get(name) is not None:
            return int(d[name])
    return 1


_QWEN_NEXT_DEFAULTS = dict(
    vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
    hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, head_dim=256,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512)

TYPES: dict[str, HybridType] = {
    "qwen3_next": HybridType(
        fused_projections=True,
        sparse_step=lambda d: int(d["decoder_sparse_step"]),
        dense_layers=lambda d: frozenset(int(i) for i in d["mlp_only_layers"] or []),
        dense_width=lambda d: int(d["intermediate_size"]), norm_topk_prob=lambda d: bool(d["norm_topk_prob"]),
        mtp_layers=_mtp_count,
        defaults=dict(_QWEN_NEXT_DEFAULTS, intermediate_size=5632, num_experts=512, num_experts_per_tok=10,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen3_5_moe_text": HybridType(
        fused_projections=False, mtp_layers=_mtp_count,
        defaults=dict(_QWEN_NEXT_DEFAULTS, vocab_size=248320, num_hidden_layers=40, num_experts=256,
                      num_experts_per_tok=8)),
}
MODEL_TYPES = tuple(sorted(TYPES))
