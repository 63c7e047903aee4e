"""Each model type of the MoE family as a row of data: how it names its tensors, which config fields it
reads (and under which aliases), its transformers class's defaults, and its numerics switches. spec.py reads
every type through these rows with one code path, so adding a type adds a row and edits no other.

The defaults are what each transformers config class holds for a field config.json leaves out (held to the
installed classes by tests/test_moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

QWEN_LEAVES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_LEAVES = ("w1", "w3", "w2")


def _fixed(value):
    return lambda d: value


def _field(name: str, cast=int):
    return lambda d: cast(d[name])


@dataclass(frozen=True, slots=True)
class MoeType:
    # -- names
    block: str
    """the MoE module under each layer: "mlp" or "block_sparse_moe" """
    expert_leaves: tuple[str, str, str]
    """HF names of an expert's gate, up and down projections"""
    correction_bias: str | None = None
    """the router's e_score_correction_bias, relative to the block"""
    shared: str | None = None
    """the shared expert's module name under `mlp`, if any"""
    shared_gate: bool = False
    """Qwen2-MoE's sigmoid gate on the shared expert"""
    mtp: bool = False
    """MTP layers after the decoder, named as DeepSeek's (their count: `mtp_layers`)"""
    # -- config fields, read as the transformers class reads them
    defaults: dict = field(default_factory=dict)
    expert_count: tuple[str, ...] = ("num_experts",)
    """fields naming the routed expert count, as the class aliases them (the first is stated when absent)"""
    expert_width: str = "intermediate_size"
    """the field holding one routed expert's width"""
    default_theta: float = 10000.0
    sparse_step: Callable[[dict], int] = _fixed(1)
    """Qwen's decoder_sparse_step: layer i is MoE when (i + 1) % step == 0 (0: none is)"""
    dense_layers: Callable[[dict], frozenset] = _fixed(frozenset())
    """Qwen's mlp_only_layers"""
    first_moe_layer: Callable[[dict], int] = _fixed(0)
    """GLM's first_k_dense_replace"""
    shared_width: Callable[[dict], int] = _fixed(0)
    """the shared expert's width (0: none)"""
    mtp_layers: Callable[[dict], int] = _fixed(0)
    qkv_bias: Callable[[dict], bool] = lambda d: bool(d.get("attention_bias", False))
    o_bias: Callable[[dict], bool] = _fixed(False)
    clip_qkv: Callable[[dict], float | None] = _fixed(None)
    # -- numerics
    qk_norm: str = "none"
    """"none", "head" or "full" (model/decoder.QK_NORMS)"""
    qk_norm_switch: str | None = None
    """a boolean field that turns the q/k norm on (GLM's use_qk_norm); off, there is none"""
    scoring: str = "softmax"
    norm_topk_prob: Callable[[dict], bool] = lambda d: bool(d["norm_topk_prob"])
    groups: Callable[[dict], tuple[int, int]] = _fixed((1, 1))
    """(n_group, topk_group) of grouped top-k routing"""
    routed_scaling_factor: Callable[[dict], float] = _fixed(1.0)
    partial_rotary: float | None = None
    """the class's partial_rotary_factor where it rotates part of each head; None: the whole head, and a
    config asking for less is refused"""
    rotary_dim: bool = False
    """the class derives the rotated share from `rotary_dim` / head_dim (MiniMax-M2)"""
    hard_coded_routing: dict = field(default_factory=dict)
    """routing transformers' model of the type hard-codes (its config class has no field for it), as the
    published configs state it: engines read these fields, with other defaults"""
    needs_shared: bool = False
    """transformers always builds the shared expert: a config without one is refused"""


_QWEN_SPARSE = dict(sparse_step=_field("decoder_sparse_step"),
                    dense_layers=lambda d: frozenset(int(i) for i in d["mlp_only_layers"] or []))

TYPES: dict[str, MoeType] = {
    "qwen2_moe": MoeType(
        "mlp", QWEN_LEAVES, shared="shared_expert", shared_gate=True, expert_width="moe_intermediate_size",
        **_QWEN_SPARSE, shared_width=_field("shared_expert_intermediate_size"), qkv_bias=lambda d: bool(d["qkv_bias"]),
        defaults=dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                      num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, num_experts=60,
                      num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                      shared_expert_intermediate_size=5632, qkv_bias=True, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, hidden_act="silu")),
    "qwen3_moe": MoeType(
        "mlp", QWEN_LEAVES, expert_count=("num_local_experts", "num_experts"), expert_width="moe_intermediate_size",
        **_QWEN_SPARSE, o_bias=lambda d: bool(d.get("attention_bias", False)), qk_norm="head",
        defaults=dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                      num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=4, num_local_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
                      attention_bias=False, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu")),
    "mixtral": MoeType(
        "block_sparse_moe", MIXTRAL_LEAVES, expert_count=("num_local_experts", "num_experts"),
        default_theta=1000000.0, norm_topk_prob=_fixed(True),
        defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu")),
    "olmoe": MoeType(
        "mlp", QWEN_LEAVES, expert_count=("num_experts", "num_local_experts"), qk_norm="full",
        o_bias=lambda d: bool(d.get("attention_bias", False)),
        clip_qkv=lambda d: float(d["clip_qkv"]) if d.get("clip_qkv") is not None else None,
        defaults=dict(vocab_size=50304, hidden_size=2048, intermediate_size=2048, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                      norm_topk_prob=False, attention_bias=False, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      clip_qkv=None, hidden_act="silu")),
    "glm4_moe": MoeType(
        "mlp", QWEN_LEAVES, correction_bias="gate.e_score_correction_bias", shared="shared_experts", mtp=True,
        expert_count=("n_routed_experts", "num_local_experts"), expert_width="moe_intermediate_size",
        first_moe_layer=_field("first_k_dense_replace"),
        shared_width=lambda d: int(d["n_shared_experts"]) * int(d["moe_intermediate_size"]),
        mtp_layers=lambda d: int(d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 1))),
        qk_norm="head", qk_norm_switch="use_qk_norm", scoring="sigmoid",
        groups=lambda d: (int(d["n_group"]), int(d["topk_group"])),
        routed_scaling_factor=_field("routed_scaling_factor", float), partial_rotary=0.5,
        hard_coded_routing={"scoring_func": "sigmoid", "topk_method": "noaux_tc"}, needs_shared=True,
        defaults=dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                      num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, n_routed_experts=128,
                      num_experts_per_tok=8, n_shared_experts=1, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                      first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=False, attention_bias=False,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, num_nextn_predict_layers=1, hidden_act="silu")),
    "minimax_m2": MoeType(
        "block_sparse_moe", MIXTRAL_LEAVES, correction_bias="e_score_correction_bias",
        expert_count=("num_local_experts", "num_experts"), default_theta=5000000.0, qk_norm="full",
        scoring="sigmoid", norm_topk_prob=_fixed(True), rotary_dim=True,
        hard_coded_routing={"scoring_func": "sigmoid", "use_routing_bias": True},
        defaults=dict(vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
                      num_attention_heads=48, num_key_value_heads=8, head_dim=128, num_local_experts=256,
                      num_experts_per_tok=8, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu")),
}
MODEL_TYPES = tuple(sorted(TYPES))

ROUTING_FIELDS = ("num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "n_shared_experts",
                  "routed_scaling_factor", "n_group", "topk_group", "first_k_dense_replace", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "use_qk_norm")
"""the routing fields a rewritten config states where the class defaults them"""
