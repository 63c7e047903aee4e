"""MiMo-V2-Flash (`mimo_v2_flash`, MiMoV2FlashForCausalLM): config, tensor shapes and the HF <-> mp key table.

A family of its own, not a row of families/moe: its routing is the MoE family's (DeepSeek-V3's sigmoid
router with a correction bias and expert groups, no shared expert), but each attention layer is one of two
kinds with its own shapes and numerics, which the MoE family's one decoder does not have: sliding-window
layers with twice the KV heads and a sink logit per head (`self_attn.attention_sink_bias`), full layers
without; value heads narrower than query/key heads (`v_head_dim`), values scaled by
`attention_value_scale`, and a rope (theta, partial share) per layer type.

mp names: the dense layout's, plus `attention.sinks` (cut with the query heads), the MoE family's router
(`feed_forward.gate.weight`, its `bias` the correction bias) and whole experts by rank
(`feed_forward.experts.{expert}.w1/w3/w2`). KV heads are cut, or replicated where fewer than ranks, per
layer kind: the k/v rows count their heads from the tensor (`HeadSplit.width`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpttool.errors import InputError, PlanError
from ckpttool.families.base import KV_HEADS, O_HEADS, Q_HEADS, HeadSplit, check_gqa_heads, config_fields, state_fields
from ckpttool.families.shapes import attention_shapes, decoder_shapes, mlp_shapes
from ckpttool.families.keymap import EXPERT, LINEAR, KeyMap

MODEL_TYPES = ("mimo_v2_flash",)
DEFAULTS = dict(vocab_size=152576, hidden_size=4096, intermediate_size=16384, moe_intermediate_size=2048,
                num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=4, hidden_act="silu",
                rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, num_experts_per_tok=8,
                n_routed_experts=256, routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True,
                head_dim=192, v_head_dim=128, sliding_window=129, layer_types=None, mlp_layer_types=None,
                attention_value_scale=0.707, rope_parameters=None)
"""MiMoV2FlashConfig's class defaults (held to the class by tests)"""
DEFAULT_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334}}
"""what __post_init__ sets when config.json has no rope_parameters"""
DEFAULT_PARTIAL_ROTARY = 0.334
LAYER_TYPES = ("full_attention", "sliding_attention")
EXPLICIT_FIELDS = ("num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                   "attention_value_scale", "sliding_window", "head_dim", "v_head_dim")

_HF, _NAT = "model.layers.{layer}.", "layers.{layer}."
K_HEADS = HeadSplit(dim=0, count="num_key_value_heads", replicate=True, width="head_dim")
V_HEADS = HeadSplit(dim=0, count="num_key_value_heads", replicate=True, width="v_head_dim")
"""KV heads counted from each tensor: a sliding layer's k/v hold twice as many as a full layer's"""
_MLP = (("gate_proj", "w1", 0), ("up_proj", "w3", 0), ("down_proj", "w2", 1))
KEY_TABLE: list[tuple] = [
    ("model.embed_tokens.weight", "tok_embeddings.weight", 0),
    ("model.norm.weight", "norm.weight", None),
    ("lm_head.weight", "output.weight", 0),
    (_HF + "input_layernorm.weight", _NAT + "attention_norm.weight", None),
    (_HF + "post_attention_layernorm.weight", _NAT + "ffn_norm.weight", None),
    *[(f"{_HF}self_attn.{a}_proj.{leaf}", f"{_NAT}attention.w{a}.{leaf}", split, *((LINEAR,) if leaf == "weight" else ()))
      for a, split in (("q", Q_HEADS), ("k", K_HEADS), ("v", V_HEADS)) for leaf in ("weight", "bias")],
    (_HF + "self_attn.o_proj.weight", _NAT + "attention.wo.weight", O_HEADS, LINEAR),
    (_HF + "self_attn.attention_sink_bias", _NAT + "attention.sinks", Q_HEADS),
    *[(f"{_HF}mlp.{a}.weight", f"{_NAT}feed_forward.{b}.weight", split, LINEAR) for a, b, split in _MLP],
    (_HF + "mlp.gate.weight", _NAT + "feed_forward.gate.weight", None),
    (_HF + "mlp.gate.e_score_correction_bias", _NAT + "feed_forward.gate.bias", None),
    *[(f"{_HF}mlp.experts.{{expert}}.{a}.weight", f"{_NAT}feed_forward.experts.{{expert}}.{b}.weight", EXPERT, LINEAR)
      for a, b, _ in _MLP],
]
KEY_MAP = KeyMap(KEY_TABLE, aliases=((_HF + "self_attn.sinks", _HF + "self_attn.attention_sink_bias"),))
"""transformers' own model calls the sinks `self_attn.sinks` (save_original_format=False)"""


@dataclass(frozen=True, slots=True)
class LayerRope:
    theta: float
    partial_rotary_factor: float


@dataclass(kw_only=True, slots=True, frozen=True)
class MiMoConfig:
    """The fields of a MiMoV2FlashConfig that decide tensor names, shapes and the model's numerics. Per-layer
    kinds are rules (or the lists config.json gives), never expanded while reading."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense layers
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # full-attention layers; sliding ones have twice as many
    head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    sliding_window: int
    layer_types: tuple[str, ...] | None  # None: full at layer 0 and every 6th, sliding elsewhere
    mlp_layer_types: tuple[str, ...] | None  # None: dense at layer 0, sparse elsewhere
    rope: dict[str, LayerRope]
    attention_value_scale: float
    attention_bias: bool
    tie_word_embeddings: bool
    rms_norm_eps: float

    def is_sliding(self, layer: int) -> bool:
        if self.layer_types is not None:
            return self.layer_types[layer] == "sliding_attention"
        return not (layer == 0 or (layer + 1) % 6 == 0)

    def kv_heads(self, layer: int) -> int:
        return self.num_key_value_heads * (2 if self.is_sliding(layer) else 1)

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse" if self.mlp_layer_types is not None else layer > 0

    @property
    def has_dense_layers(self) -> bool:
        n = self.num_hidden_layers
        return n > 0 and (self.mlp_layer_types is None or "dense" in self.mlp_layer_types[:n])

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "MiMoConfig":
        if raw.get("model_type") not in MODEL_TYPES:
            raise InputError(f"model_type {raw.get('model_type')!r} is not {', '.join(MODEL_TYPES)}", file=source)
        d = {**DEFAULTS, **raw}
        with config_fields(source):
            if d["hidden_act"] != "silu":
                raise InputError(f"hidden_act {d['hidden_act']!r} is not supported", file=source,
                                 fix="ckpttool's MiMo model uses SiLU-gated experts")
            experts = {k: int(raw[k]) for k in ("n_routed_experts", "num_local_experts") if raw.get(k) is not None}
            if len(set(experts.values())) > 1:
                raise InputError(f"config.json names the expert count twice, differently: {experts}", file=source)
            heads, hidden = int(d["num_attention_heads"]), int(d["hidden_size"])
            window = d["sliding_window"] if raw.get("sliding_window_size") is None else int(raw["sliding_window_size"]) + 1
            scale = d["attention_value_scale"]
            cfg = cls(
                model_type=raw["model_type"], vocab_size=int(d["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]), moe_intermediate_size=int(d["moe_intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]), num_attention_heads=heads,
                num_key_value_heads=int(d["num_key_value_heads"]), head_dim=int(d.get("head_dim") or hidden // heads),
                v_head_dim=int(d["v_head_dim"]),
                num_experts=next(iter(experts.values())) if experts else int(d["n_routed_experts"]),
                num_experts_per_tok=int(d["num_experts_per_tok"]), n_group=int(d["n_group"]),
                topk_group=int(d["topk_group"]), norm_topk_prob=bool(d["norm_topk_prob"]),
                routed_scaling_factor=1.0 if d["routed_scaling_factor"] is None else float(d["routed_scaling_factor"]),
                sliding_window=int(window),
                layer_types=None if d["layer_types"] is None else tuple(str(t) for t in d["layer_types"]),
                mlp_layer_types=None if d["mlp_layer_types"] is None else tuple(str(t) for t in d["mlp_layer_types"]),
                rope=_ropes(d["rope_parameters"] or DEFAULT_ROPE, source),
                attention_value_scale=1.0 if scale is None else float(scale),
                attention_bias=bool(d["attention_bias"]), tie_word_embeddings=bool(d["tie_word_embeddings"]),
                rms_norm_eps=float(d["rms_norm_eps"]))
        _check(cfg, source)
        return cfg


def _ropes(params: object, source: object) -> dict[str, LayerRope]:
    """rope_parameters per layer type, as MiMoV2FlashRotaryEmbedding reads them; only the default rope type."""
    if not isinstance(params, dict) or set(params) != set(LAYER_TYPES) or \
            not all(isinstance(p, dict) for p in params.values()):
        raise InputError("rope_parameters is not one dict per layer type (full_attention, sliding_attention)",
                         file=source, fix="use the config.json published with the checkpoint")
    out = {}
    for kind, p in params.items():
        if p.get("rope_type", "default") != "default":
            raise InputError(f"rope type {p.get('rope_type')!r} of {kind} layers is not supported", file=source,
                             fix="ckpttool's MiMo model implements the default rope")
        out[kind] = LayerRope(float(p["rope_theta"]), float(p.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)))
    return out


def _check(cfg: MiMoConfig, source: object) -> None:
    n, heads, kv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    if kv < 1 or heads % (2 * kv):
        raise InputError(f"num_attention_heads ({heads}) is not a multiple of twice num_key_value_heads ({kv}), the "
                         "KV heads of a sliding-window layer", file=source)
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise InputError(f"num_experts_per_tok ({cfg.num_experts_per_tok}) is not in 1..{cfg.num_experts}", file=source)
    if cfg.n_group < 1 or cfg.num_experts % cfg.n_group or not 0 < cfg.topk_group <= cfg.n_group:
        raise InputError(f"n_group {cfg.n_group} / topk_group {cfg.topk_group} do not divide {cfg.num_experts} experts",
                         file=source)
    for name, values, allowed in (("layer_types", cfg.layer_types, LAYER_TYPES),
                                  ("mlp_layer_types", cfg.mlp_layer_types, ("dense", "sparse"))):
        if values is not None and (len(values) < n or set(values) - set(allowed)):
            raise InputError(f"{name} must name each of the {n} layers one of {', '.join(allowed)}", file=source,
                             fix="use the config.json published with the checkpoint")
    if not all(0 < r.partial_rotary_factor <= 1 and r.theta > 0 for r in cfg.rope.values()) or cfg.sliding_window < 1:
        raise InputError("rope_theta, partial_rotary_factor or sliding_window out of range", file=source)


def hf_tensor_shapes(cfg: MiMoConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds."""
    h, d, v, e = cfg.hidden_size, cfg.head_dim, cfg.v_head_dim, cfg.num_experts
    shapes, prefixes = decoder_shapes(cfg.vocab_size, h, cfg.num_hidden_layers,
                                      tie_word_embeddings=cfg.tie_word_embeddings)
    for layer, p in enumerate(prefixes):
        heads, kv = cfg.num_attention_heads, cfg.kv_heads(layer)
        attention_shapes(shapes, p, h, heads * d, kv * d, qkv_bias=cfg.attention_bias, o_bias=False)
        shapes[p + "self_attn.v_proj.weight"] = (kv * v, h)
        if cfg.attention_bias:
            shapes[p + "self_attn.v_proj.bias"] = (kv * v,)
        shapes[p + "self_attn.o_proj.weight"] = (h, heads * v)
        if cfg.is_sliding(layer):
            shapes[p + "self_attn.attention_sink_bias"] = (heads,)
        if cfg.is_moe_layer(layer):
            shapes[p + "mlp.gate.weight"] = (e, h)
            shapes[p + "mlp.gate.e_score_correction_bias"] = (e,)
            for expert in range(e):
                mlp_shapes(shapes, f"{p}mlp.experts.{expert}.", h, cfg.moe_intermediate_size)
        else:
            mlp_shapes(shapes, p + "mlp.", h, cfg.intermediate_size)
    return shapes


def check_mp(cfg: MiMoConfig, mp: int) -> None:
    """Query heads split evenly, the KV heads of both layer kinds split or replicate evenly, and the experts,
    vocabulary and dense MLP width divide."""
    check_gqa_heads(cfg, mp)
    problem = KV_HEADS.ranges(2 * cfg.num_key_value_heads, 2 * cfg.num_key_value_heads, mp)
    if isinstance(problem, str):
        raise PlanError(f"a sliding-window layer's {problem}", file="config.json",
                        fix="choose an --mp that fits twice num_key_value_heads")
    sizes = [("n_routed_experts", cfg.num_experts), ("vocab_size", cfg.vocab_size)]
    if cfg.has_dense_layers:
        sizes.append(("intermediate_size", cfg.intermediate_size))
    for what, size in sizes:
        if size % mp:
            raise PlanError(f"{what} ({size}) is not divisible by mp={mp}", file="config.json",
                            fix=f"choose an --mp that divides {size}")


def explicit_config(raw: dict, source: object = "config.json") -> dict:
    """config.json with the routing and attention fields MiMoV2FlashConfig defaults stated, and the per-layer
    rope it sets when config.json has none."""
    cfg = MiMoConfig.from_dict(raw, source)
    fields = {k: getattr(cfg, k) for k in EXPLICIT_FIELDS}
    fields.update(n_routed_experts=cfg.num_experts, rope_parameters=DEFAULT_ROPE)
    return state_fields(raw, fields, theta=None)
