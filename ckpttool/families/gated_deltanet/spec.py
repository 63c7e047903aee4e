"""Gated DeltaNet hybrids: Qwen3-Next (qwen3_next) and Qwen3.5/3.6 MoE's text model (qwen3_5_moe_text).
Config, tensor shapes and the HF <-> mp key tables.

Each layer is either linear attention (Gated DeltaNet: projections, a short depthwise conv over the q, k and v
channels, a per-head decay and gate, a gated RMSNorm) or gated full attention (q_proj holds each head's
queries, then its output gate), followed by routed experts with a gated shared expert (or a dense MLP).

The mp layout cuts both on whole heads. A rank holds whole key-head groups of the linear attention (each key
head with the value heads that read it, `linear_num_key_heads` / mp of them): every projection row, conv
channel, decay and gate of those heads, so its conv and recurrent state never leave the rank; out_proj is cut
on the same heads' columns and summed. The conv (and Qwen3.5's in_proj_qkv) holds every q channel, then every
k, then every v: in the mp layout each of the three is a tensor of its own (`conv_q`, `conv_k`, `conv_v`;
`in_proj_q`, ...), cut on the same heads (keymap.Segment). Full attention is cut as the dense family's (query
heads, KV heads split or replicated), experts by contiguous range, norms replicated. Names: `tok_embeddings`,
`layers.{layer}.attention_norm`, `.attention.wq` / `.linear_attn.*`, `.ffn_norm`, `.feed_forward.*`, `norm`,
`output`; MTP layers keep their `mtp.` names.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpttool.errors import InputError, PlanError
from ckpttool.families.base import (KV_HEADS, O_HEADS, Q_HEADS, HeadSplit, check_gqa_heads, config_fields,
                                    rope_theta_of, state_fields)
from ckpttool.families.shapes import mlp_shapes
from ckpttool.families.gated_deltanet.types import MODEL_TYPES, TYPES, HybridType
from ckpttool.families.keymap import EXPERT, LINEAR, KeyMap, Segment

LAYER_TYPES = ("linear_attention", "full_attention")
LINEAR_HEADS = HeadSplit(dim=0, count="linear_num_key_heads")
"""rows of whole key-head groups (each key head's own rows, then its value heads')"""
LINEAR_OUT = HeadSplit(dim=1, count="linear_num_key_heads")
QKV_SIZES = ("linear_key_dim", "linear_key_dim", "linear_value_dim")
MLP = (("gate_proj", "w1", 0), ("up_proj", "w3", 0), ("down_proj", "w2", 1))


def _segments(hf: str, natives: tuple[str, str, str], *rest) -> list[tuple]:
    return [(hf, native, Segment(0, QKV_SIZES, i, LINEAR_HEADS), *rest) for i, native in enumerate(natives)]


def _layer_rows(hf: str, nat: str, t: HybridType, *, linear: bool) -> list[tuple]:
    """One decoder layer's rows under the prefixes `hf` / `nat` (MTP layers have no linear attention)."""
    rows = [(hf + "input_layernorm.weight", nat + "attention_norm.weight", None),
            (hf + "post_attention_layernorm.weight", nat + "ffn_norm.weight", None),
            (hf + "self_attn.o_proj.weight", nat + "attention.wo.weight", O_HEADS, LINEAR),
            (hf + "self_attn.o_proj.bias", nat + "attention.wo.bias", None),  # added once, after the sum
            (hf + "self_attn.q_norm.weight", nat + "attention.q_norm.weight", None),
            (hf + "self_attn.k_norm.weight", nat + "attention.k_norm.weight", None),
            (hf + "mlp.gate.weight", nat + "feed_forward.gate.weight", None),
            (hf + "mlp.shared_expert_gate.weight", nat + "feed_forward.shared_expert_gate.weight", None)]
    for a, b, split in (("q_proj", "wq", Q_HEADS), ("k_proj", "wk", KV_HEADS), ("v_proj", "wv", KV_HEADS)):
        rows += [(f"{hf}self_attn.{a}.weight", f"{nat}attention.{b}.weight", split, LINEAR),
                 (f"{hf}self_attn.{a}.bias", f"{nat}attention.{b}.bias", split)]
    for a, b, split in MLP:
        rows += [(f"{hf}mlp.{a}.weight", f"{nat}feed_forward.{b}.weight", split, LINEAR),
                 (f"{hf}mlp.shared_expert.{a}.weight", f"{nat}feed_forward.shared_experts.{b}.weight", split, LINEAR),
                 (f"{hf}mlp.experts.{{expert}}.{a}.weight", f"{nat}feed_forward.experts.{{expert}}.{b}.weight",
                  EXPERT, LINEAR)]
    if not linear:
        return rows
    la, ln = hf + "linear_attn.", nat + "linear_attn."
    rows += _segments(la + "conv1d.weight", (ln + "conv_q.weight", ln + "conv_k.weight", ln + "conv_v.weight"))
    rows += [(la + "dt_bias", ln + "dt_bias", LINEAR_HEADS), (la + "A_log", ln + "A_log", LINEAR_HEADS),
             (la + "norm.weight", ln + "norm.weight", None),
             (la + "out_proj.weight", ln + "out_proj.weight", LINEAR_OUT, LINEAR)]
    if t.fused_projections:
        return rows + [(la + "in_proj_qkvz.weight", ln + "in_proj_qkvz.weight", LINEAR_HEADS, LINEAR),
                       (la + "in_proj_ba.weight", ln + "in_proj_ba.weight", LINEAR_HEADS)]
    return rows + _segments(la + "in_proj_qkv.weight", (ln + "in_proj_q.weight", ln + "in_proj_k.weight",
                                                          ln + "in_proj_v.weight"), LINEAR) + [
        (la + "in_proj_z.weight", ln + "in_proj_z.weight", LINEAR_HEADS, LINEAR),
        (la + "in_proj_b.weight", ln + "in_proj_b.weight", LINEAR_HEADS),
        (la + "in_proj_a.weight", ln + "in_proj_a.weight", LINEAR_HEADS)]


def key_table(model_type: str) -> list[tuple]:
    """(hf template, native template, split[, LINEAR]) rows of one model type."""
    t = TYPES[model_type]
    return [("model.embed_tokens.weight", "tok_embeddings.weight", 0), ("model.norm.weight", "norm.weight", None),
            ("lm_head.weight", "output.weight", 0),
            *_layer_rows("model.layers.{layer}.", "layers.{layer}.", t, linear=True),
            *_layer_rows("mtp.layers.{layer}.", "mtp.layers.{layer}.", t, linear=False),
            *[(f"mtp.{n}.weight", f"mtp.{n}.weight", None) for n in ("fc", "norm", "pre_fc_norm_embedding",
                                                                      "pre_fc_norm_hidden")]]


KEY_MAPS = {t: KeyMap(key_table(t)) for t in MODEL_TYPES}


@dataclass(kw_only=True, slots=True, frozen=True)
class HybridConfig:
    """The fields of a config.json that decide tensor names, shapes and the model's numerics."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int  # dense MLP layers (0: the type has none)
    expert_intermediate_size: int
    shared_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    sparse_step: int
    dense_layers: frozenset[int]
    partial_rotary_factor: float
    mtp_num_hidden_layers: int  # MTP layers (the published configs' name for them)
    tie_word_embeddings: bool
    rms_norm_eps: float

    @property
    def type(self) -> HybridType:
        return TYPES[self.model_type]

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Routed experts (True) or a dense MLP, as transformers decides it per layer."""
        step = self.sparse_step
        return self.num_experts > 0 and layer not in self.dense_layers and step > 0 and (layer + 1) % step == 0

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "HybridConfig":
        model_type = raw.get("model_type")
        if model_type not in TYPES:
            raise InputError(f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}", file=source)
        t = TYPES[model_type]
        d = {**t.defaults, **raw}
        with config_fields(source):
            if d["hidden_act"] != "silu":
                raise InputError(f"hidden_act {d['hidden_act']!r} is not supported", file=source,
                                 fix="ckpttool's Gated DeltaNet model uses SiLU (conv, experts and gates)")
            layers = int(d["num_hidden_layers"])
            cfg = cls(
                model_type=model_type, vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
                num_hidden_layers=layers, layer_types=_layer_types(t, raw, layers, source),
                num_attention_heads=int(d["num_attention_heads"]), num_key_value_heads=int(d["num_key_value_heads"]),
                head_dim=int(d["head_dim"]), attention_bias=bool(d["attention_bias"]),
                linear_num_key_heads=int(d["linear_num_key_heads"]),
                linear_num_value_heads=int(d["linear_num_value_heads"]),
                linear_key_head_dim=int(d["linear_key_head_dim"]), linear_value_head_dim=int(d["linear_value_head_dim"]),
                linear_conv_kernel_dim=int(d["linear_conv_kernel_dim"]), intermediate_size=t.dense_width(d),
                expert_intermediate_size=int(d["moe_intermediate_size"]),
                shared_intermediate_size=int(d["shared_expert_intermediate_size"]), num_experts=int(d["num_experts"]),
                num_experts_per_tok=int(d["num_experts_per_tok"]), norm_topk_prob=t.norm_topk_prob(d),
                sparse_step=t.sparse_step(d), dense_layers=t.dense_layers(d),
                partial_rotary_factor=_partial_rotary(t, raw), mtp_num_hidden_layers=t.mtp_layers(d),
                tie_word_embeddings=bool(d["tie_word_embeddings"]), rms_norm_eps=float(d["rms_norm_eps"]))
        _check(cfg, source)
        return cfg


def _layer_types(t: HybridType, raw: dict, layers: int, source: object) -> tuple[str, ...]:
    """config.json's layer_types, else every `full_attention_interval`-th layer full attention (the class's rule)."""
    given = raw.get("layer_types")
    if given is None:
        interval = int(raw.get("full_attention_interval", t.full_attention_interval))
        if interval <= 0:
            raise InputError(f"full_attention_interval {interval} is not positive", file=source)
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))
    if not isinstance(given, list) or len(given) != layers or any(k not in LAYER_TYPES for k in given):
        raise InputError(f"layer_types must list {layers} of {', '.join(LAYER_TYPES)}", file=source,
                         fix="use the config.json published with the checkpoint")
    return tuple(given)


def _partial_rotary(t: HybridType, raw: dict) -> float:
    """transformers' precedence: rope_parameters' (or rope_scaling's) partial_rotary_factor, then a top-level
    one, then the class default."""
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    top = raw.get("partial_rotary_factor", t.partial_rotary)
    return float(rope.get("partial_rotary_factor", top) if isinstance(rope, dict) else top)


def _check(cfg: HybridConfig, source: object) -> None:
    positive = {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                             "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                                             "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")}
    bad = [f"{k} = {v}" for k, v in positive.items() if v <= 0]
    if cfg.num_hidden_layers < 0 or cfg.mtp_num_hidden_layers < 0:
        bad.append(f"num_hidden_layers = {cfg.num_hidden_layers}, MTP layers = {cfg.mtp_num_hidden_layers}")
    if cfg.num_attention_heads % max(cfg.num_key_value_heads, 1):
        bad.append(f"num_attention_heads ({cfg.num_attention_heads}) is not a multiple of num_key_value_heads "
                   f"({cfg.num_key_value_heads})")
    if cfg.linear_num_value_heads % max(cfg.linear_num_key_heads, 1):
        bad.append(f"linear_num_value_heads ({cfg.linear_num_value_heads}) is not a multiple of linear_num_key_heads "
                   f"({cfg.linear_num_key_heads})")
    if cfg.num_experts < 0 or (cfg.num_experts and not 0 < cfg.num_experts_per_tok <= cfg.num_experts):
        bad.append(f"num_experts_per_tok = {cfg.num_experts_per_tok} of num_experts = {cfg.num_experts}")
    if cfg.intermediate_size <= 0 and any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        bad.append(f"a dense layer needs intermediate_size > 0 (num_experts = {cfg.num_experts})")
    if not 0 < cfg.partial_rotary_factor <= 1:
        bad.append(f"partial_rotary_factor = {cfg.partial_rotary_factor}")
    if bad:
        raise InputError(f"config.json describes no {cfg.model_type} model: {'; '.join(bad)}", file=source,
                         fix="use the config.json published with the checkpoint")


def explicit_config(raw: dict, source: object = "config.json") -> dict:
    """config.json with the fields its class defaults stated: layer types, routing, rope theta and rotary share."""
    cfg = HybridConfig.from_dict(raw, source)
    fields = {"layer_types": list(cfg.layer_types), "num_experts": cfg.num_experts,
              "num_experts_per_tok": cfg.num_experts_per_tok, "moe_intermediate_size": cfg.expert_intermediate_size,
              "shared_expert_intermediate_size": cfg.shared_intermediate_size,
              "partial_rotary_factor": cfg.partial_rotary_factor}
    if "decoder_sparse_step" in cfg.type.defaults:
        fields.update(norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.sparse_step,
                      mlp_only_layers=sorted(cfg.dense_layers))
    return state_fields(raw, fields, theta=rope_theta_of(raw, cfg.type.default_theta))


def _layer_shapes(shapes: dict, p: str, cfg: HybridConfig, layer: int, *, linear: bool) -> None:
    h, d = cfg.hidden_size, cfg.head_dim
    shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (h,)
    if linear:
        la, key, value = p + "linear_attn.", cfg.linear_key_dim, cfg.linear_value_dim
        nv = cfg.linear_num_value_heads
        shapes.update({la + "conv1d.weight": (2 * key + value, 1, cfg.linear_conv_kernel_dim), la + "dt_bias": (nv,),
                       la + "A_log": (nv,), la + "norm.weight": (cfg.linear_value_head_dim,),
                       la + "out_proj.weight": (h, value)})
        if cfg.type.fused_projections:
            shapes[la + "in_proj_qkvz.weight"] = (2 * key + 2 * value, h)
            shapes[la + "in_proj_ba.weight"] = (2 * nv, h)
        else:
            shapes.update({la + "in_proj_qkv.weight": (2 * key + value, h), la + "in_proj_z.weight": (value, h),
                           la + "in_proj_b.weight": (nv, h), la + "in_proj_a.weight": (nv, h)})
    else:
        q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        for proj, out in (("q_proj", 2 * q), ("k_proj", kv), ("v_proj", kv)):  # q_proj: each head's q, then its gate
            shapes[f"{p}self_attn.{proj}.weight"] = (out, h)
            if cfg.attention_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.attention_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        shapes[p + "self_attn.q_norm.weight"] = shapes[p + "self_attn.k_norm.weight"] = (d,)
    if not cfg.is_moe_layer(layer):
        mlp_shapes(shapes, p + "mlp.", h, cfg.intermediate_size)
        return
    shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
    shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
    mlp_shapes(shapes, p + "mlp.shared_expert.", h, cfg.shared_intermediate_size)
    for e in range(cfg.num_experts):
        mlp_shapes(shapes, f"{p}mlp.experts.{e}.", h, cfg.expert_intermediate_size)


def hf_tensor_shapes(cfg: HybridConfig, *, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds (no FP8 scales); MTP layers are full attention."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for layer, kind in enumerate(cfg.layer_types):
        _layer_shapes(shapes, f"model.layers.{layer}.", cfg, layer, linear=kind == "linear_attention")
    if with_mtp and cfg.mtp_num_hidden_layers:
        shapes.update({"mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,), "mtp.pre_fc_norm_embedding.weight": (h,),
                       "mtp.pre_fc_norm_hidden.weight": (h,)})
        for layer in range(cfg.mtp_num_hidden_layers):
            _layer_shapes(shapes, f"mtp.layers.{layer}.", cfg, layer, linear=False)
    return shapes


def is_mtp_tensor(cfg: HybridConfig, hf_name: str) -> bool:
    return hf_name.startswith("mtp.")


def check_mp(cfg: HybridConfig, mp: int) -> None:
    """Query heads split evenly, KV heads split or replicate, linear attention on whole key-head groups (the
    value heads and conv channels that read each key head stay with it), and experts, the vocabulary and the
    dense and shared MLP widths divide."""
    check_gqa_heads(cfg, mp)
    sizes = [("num_experts", cfg.num_experts), ("vocab_size", cfg.vocab_size)]
    if "linear_attention" in cfg.layer_types:
        sizes.insert(0, ("linear_num_key_heads", cfg.linear_num_key_heads))
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        sizes.append(("intermediate_size", cfg.intermediate_size))
    if cfg.num_experts:
        sizes.append(("shared_expert_intermediate_size", cfg.shared_intermediate_size))
    for what, size in sizes:
        if size % mp:
            heads = " (a rank holds whole key heads with their value heads)" if what.startswith("linear") else ""
            raise PlanError(f"{what} ({size}) is not divisible by mp={mp}{heads}", file="config.json",
                            fix=f"choose an --mp that divides {size}")
