"""Llama-4's text model (`llama4_text`, Llama4ForCausalLM): config, tensor shapes and the HF <-> mp key table.

A family of its own, not a row of families/moe: its experts are stored stacked and transposed against
nn.Linear (`feed_forward.experts.gate_up_proj` [E, H, 2I], each row of H holding the expert's gate columns
then its up columns, and `down_proj` [E, I, H]), so one expert's gate weight is no byte range of the file;
the mp layout keeps them stacked and gives rank r the contiguous experts r*E/mp.. of dim 0 (a byte range,
cut and merged back without a copy or a transpose, as gpt-oss's). Its router scales each token before
the expert rather than the expert's output, and its attention differs per layer in four ways no MoE type
has: RoPE or none (`no_rope_layers`), an L2 q/k norm on the RoPE layers, a temperature on the others,
and chunked attention (`layer_types`, `attention_chunk_size`).

mp names (the dense layout's, plus): `feed_forward.gate.weight` (router, replicated),
`feed_forward.experts.w13` / `w2` (stacked, dim 0 by expert range), `feed_forward.shared_experts.w1/w3/w2`
(tensor parallel). Dense layers keep `feed_forward.w1/w3/w2`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpttool.errors import InputError, PlanError
from ckpttool.families.base import (KV_HEADS, O_HEADS, Q_HEADS, check_gqa_heads, config_fields, rope_theta_of,
                                    state_fields)
from ckpttool.families.shapes import attention_shapes, decoder_shapes, mlp_shapes
from ckpttool.families.keymap import LINEAR, KeyMap

MODEL_TYPES = ("llama4_text",)
DEFAULT_THETA = 500000.0
DEFAULTS = dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                rms_norm_eps=1e-5, tie_word_embeddings=False, num_experts_per_tok=1, num_local_experts=16,
                moe_layers=None, interleave_moe_layer_step=1, use_qk_norm=True, no_rope_layers=None,
                no_rope_layer_interval=4, attention_chunk_size=8192, layer_types=None, attn_temperature_tuning=True,
                floor_scale=8192, attn_scale=0.1, attention_bias=False)
"""Llama4TextConfig's class defaults, for fields a config.json leaves out (held to the class by tests)"""
EXPLICIT_FIELDS = ("num_experts_per_tok", "num_local_experts", "interleave_moe_layer_step", "use_qk_norm",
                   "no_rope_layer_interval", "attention_chunk_size", "attn_temperature_tuning", "floor_scale",
                   "attn_scale", "intermediate_size_mlp")
"""what an HF output's config.json states where the input left it to the class"""

_HF, _NAT = "model.layers.{layer}.", "layers.{layer}."
_MLP = (("gate_proj", "w1", 0), ("up_proj", "w3", 0), ("down_proj", "w2", 1))
KEY_TABLE: list[tuple] = [
    ("model.embed_tokens.weight", "tok_embeddings.weight", 0),
    ("model.norm.weight", "norm.weight", None),
    ("lm_head.weight", "output.weight", 0),
    (_HF + "input_layernorm.weight", _NAT + "attention_norm.weight", None),
    (_HF + "post_attention_layernorm.weight", _NAT + "ffn_norm.weight", None),
    *[(f"{_HF}self_attn.{a}_proj.{leaf}", f"{_NAT}attention.w{a}.{leaf}", split, *((LINEAR,) if leaf == "weight" else ()))
      for a, split in (("q", Q_HEADS), ("k", KV_HEADS), ("v", KV_HEADS)) for leaf in ("weight", "bias")],
    (_HF + "self_attn.o_proj.weight", _NAT + "attention.wo.weight", O_HEADS, LINEAR),
    (_HF + "self_attn.o_proj.bias", _NAT + "attention.wo.bias", None),  # added once, after the all-reduce
    *[(f"{_HF}feed_forward.{a}.weight", f"{_NAT}feed_forward.{b}.weight", split, LINEAR) for a, b, split in _MLP],
    (_HF + "feed_forward.router.weight", _NAT + "feed_forward.gate.weight", None),
    (_HF + "feed_forward.experts.gate_up_proj", _NAT + "feed_forward.experts.w13", 0),  # experts r*E/mp.. on rank r
    (_HF + "feed_forward.experts.down_proj", _NAT + "feed_forward.experts.w2", 0),
    *[(f"{_HF}feed_forward.shared_expert.{a}.weight", f"{_NAT}feed_forward.shared_experts.{b}.weight", split, LINEAR)
      for a, b, split in _MLP],
]
KEY_MAP = KeyMap(KEY_TABLE)


@dataclass(kw_only=True, slots=True, frozen=True)
class Llama4Config:
    """The fields of a Llama4TextConfig that decide tensor names, shapes and the model's numerics. Per-layer
    choices are kept as rules (or the lists config.json gives), never expanded per layer while reading."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each routed expert and the shared expert
    intermediate_size_mlp: int  # dense layers
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_layers: frozenset[int] | None  # None: every interleave_moe_layer_step-th layer
    interleave_moe_layer_step: int
    no_rope_layers: tuple[int, ...] | None  # 1: the layer uses RoPE; None: all but every no_rope_layer_interval-th
    no_rope_layer_interval: int
    layer_types: tuple[str, ...] | None  # None: chunked where RoPE is used and attention_chunk_size is set
    attention_chunk_size: int | None
    use_qk_norm: bool
    attn_temperature_tuning: bool
    floor_scale: int
    attn_scale: float
    attention_bias: bool
    tie_word_embeddings: bool
    rms_norm_eps: float

    def is_moe_layer(self, layer: int) -> bool:
        if self.moe_layers is not None:
            return layer in self.moe_layers
        return (layer + 1) % self.interleave_moe_layer_step == 0  # range(step - 1, n, step)

    def uses_rope(self, layer: int) -> bool:
        if self.no_rope_layers is not None:
            return bool(self.no_rope_layers[layer])
        return (layer + 1) % self.no_rope_layer_interval != 0

    def chunk(self, layer: int) -> int | None:
        """The attention chunk of a chunked-attention layer, None for full attention."""
        if self.layer_types is not None:
            kind = self.layer_types[layer]
        else:
            kind = "chunked_attention" if self.uses_rope(layer) and self.attention_chunk_size is not None else "full"
        return self.attention_chunk_size if kind == "chunked_attention" else None

    @property
    def has_dense_layers(self) -> bool:
        n = self.num_hidden_layers
        if self.moe_layers is not None:
            return len({i for i in self.moe_layers if 0 <= i < n}) < n
        return n > 0 and self.interleave_moe_layer_step != 1

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "Llama4Config":
        if raw.get("model_type") not in MODEL_TYPES:
            raise InputError(f"model_type {raw.get('model_type')!r} is not {', '.join(MODEL_TYPES)}", file=source)
        d = {**DEFAULTS, **raw}
        with config_fields(source):
            if d["hidden_act"] != "silu":
                raise InputError(f"hidden_act {d['hidden_act']!r} is not supported", file=source,
                                 fix="ckpttool's Llama-4 model uses SiLU-gated experts")
            heads, hidden, layers = int(d["num_attention_heads"]), int(d["hidden_size"]), int(d["num_hidden_layers"])
            chunk = d["attention_chunk_size"]
            cfg = cls(
                model_type=raw["model_type"], vocab_size=int(d["vocab_size"]), hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]), intermediate_size_mlp=int(d["intermediate_size_mlp"]),
                num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads), num_experts=int(d["num_local_experts"]),
                num_experts_per_tok=int(d["num_experts_per_tok"]),
                moe_layers=None if d["moe_layers"] is None else frozenset(int(i) for i in d["moe_layers"]),
                interleave_moe_layer_step=int(d["interleave_moe_layer_step"]),
                # transformers takes an empty no_rope_layers as absent (Llama-4-Scout's config.json says [])
                no_rope_layers=tuple(int(i) for i in d["no_rope_layers"]) if d["no_rope_layers"] else None,
                no_rope_layer_interval=int(d["no_rope_layer_interval"]),
                layer_types=None if d["layer_types"] is None else tuple(str(t) for t in d["layer_types"]),
                attention_chunk_size=None if chunk is None else int(chunk), use_qk_norm=bool(d["use_qk_norm"]),
                attn_temperature_tuning=bool(d["attn_temperature_tuning"]), floor_scale=int(d["floor_scale"]),
                attn_scale=float(d["attn_scale"]), attention_bias=bool(d["attention_bias"]),
                tie_word_embeddings=bool(d["tie_word_embeddings"]), rms_norm_eps=float(d["rms_norm_eps"]))
        _check(cfg, source)
        return cfg


def _check(cfg: Llama4Config, source: object) -> None:
    n = cfg.num_hidden_layers
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise InputError(f"num_attention_heads ({cfg.num_attention_heads}) is not a multiple of num_key_value_heads "
                         f"({cfg.num_key_value_heads})", file=source)
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise InputError(f"num_experts_per_tok ({cfg.num_experts_per_tok}) is not in 1..{cfg.num_experts}", file=source)
    if cfg.interleave_moe_layer_step < 1 or cfg.no_rope_layer_interval < 1 or cfg.floor_scale < 1:
        raise InputError("interleave_moe_layer_step, no_rope_layer_interval and floor_scale must be >= 1", file=source)
    for name, values in (("no_rope_layers", cfg.no_rope_layers), ("layer_types", cfg.layer_types)):
        if values is not None and len(values) < n:
            raise InputError(f"{name} lists {len(values)} layers, fewer than num_hidden_layers ({n})", file=source,
                             fix="use the config.json published with the checkpoint")
    kinds = set(cfg.layer_types or ()) - {"full_attention", "chunked_attention"}
    if kinds or (cfg.layer_types and "chunked_attention" in cfg.layer_types and cfg.attention_chunk_size is None):
        raise InputError(f"layer_types {sorted(kinds) or ['chunked_attention']} not understood (chunked attention "
                         "needs attention_chunk_size)", file=source, fix="use the config.json published with the checkpoint")
    if cfg.attention_chunk_size is not None and cfg.attention_chunk_size < 1:
        raise InputError(f"attention_chunk_size {cfg.attention_chunk_size} is not positive", file=source)


def hf_tensor_shapes(cfg: Llama4Config) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds."""
    h, d, e, inter = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.intermediate_size
    shapes, prefixes = decoder_shapes(cfg.vocab_size, h, cfg.num_hidden_layers,
                                      tie_word_embeddings=cfg.tie_word_embeddings)
    for layer, p in enumerate(prefixes):
        attention_shapes(shapes, p, h, cfg.num_attention_heads * d, cfg.num_key_value_heads * d,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)
        if cfg.is_moe_layer(layer):
            f = p + "feed_forward."
            shapes.update({f + "router.weight": (e, h), f + "experts.gate_up_proj": (e, h, 2 * inter),
                           f + "experts.down_proj": (e, inter, h)})
            mlp_shapes(shapes, f + "shared_expert.", h, inter)
        else:
            mlp_shapes(shapes, p + "feed_forward.", h, cfg.intermediate_size_mlp)
    return shapes


def check_mp(cfg: Llama4Config, mp: int) -> None:
    """Query heads split evenly, KV heads split or replicate, and the experts, the vocabulary and the shared
    and dense MLP widths divide."""
    check_gqa_heads(cfg, mp)
    sizes = [("num_local_experts", cfg.num_experts), ("vocab_size", cfg.vocab_size),
             ("intermediate_size (the shared expert)", cfg.intermediate_size)]
    if cfg.has_dense_layers:
        sizes.append(("intermediate_size_mlp", cfg.intermediate_size_mlp))
    for what, size in sizes:
        if size % mp:
            raise PlanError(f"{what} ({size}) is not divisible by mp={mp}", file="config.json",
                            fix=f"choose an --mp that divides {size}")


def explicit_config(raw: dict, source: object = "config.json") -> dict:
    """config.json with the routing, attention and rope fields Llama4TextConfig defaults stated."""
    Llama4Config.from_dict(raw, source)
    return state_fields(raw, {k: DEFAULTS[k] for k in EXPLICIT_FIELDS}, theta=rope_theta_of(raw, DEFAULT_THETA))
