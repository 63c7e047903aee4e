"""MiniMax-M3's text model (`minimax_m3_vl_text`, the text tower of `minimax_m3_vl`): config, tensor shapes and
the HF <-> mp key table.

A GQA decoder with Gemma's RMSNorm (1 + weight) everywhere, per-head q/k norms, dense or MoE feed-forward per
layer (`mlp_layer_types`), both with gpt-oss's clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`); MoE layers route
sigmoid scores with a correction bias, scale the routed sum by `routed_scaling_factor` and add a shared expert;
`minimax_m3_sparse` layers (`layer_types`) hold a lightning indexer that picks blocks of keys. Names are those
of the hub's checkpoint (what transformers' save_pretrained writes too): `block_sparse_moe.experts.E.w1/w2/w3`,
`block_sparse_moe.shared_experts.*`, `self_attn.index_q_proj`. The mp layout is the MoE family's (the dense
family's names plus `feed_forward.gate`, `feed_forward.experts.E.*`, `feed_forward.shared_experts.*`), the
indexer under `attention.indexer.*`, replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpttool.errors import InputError, PlanError
from ckpttool.families.base import KV_HEADS, O_HEADS, Q_HEADS, check_gqa_heads, config_fields, layer_index
from ckpttool.families.shapes import attention_shapes, decoder_shapes, mlp_shapes
from ckpttool.families.keymap import EXPERT, LINEAR, KeyMap

MODEL_TYPE = "minimax_m3_vl_text"
DEFAULT_ROPE_THETA = 5000000.0  # MiniMaxM3VLTextConfig's
CONFIG_DEFAULTS = dict(
    vocab_size=200064, hidden_size=6144, intermediate_size=3072, dense_intermediate_size=12288,
    shared_intermediate_size=3072, num_hidden_layers=60, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
    num_local_experts=128, num_experts_per_tok=4, routed_scaling_factor=2.0, swiglu_alpha=1.702, swiglu_limit=7.0,
    index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
    tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=524288)
"""What MiniMaxM3VLTextConfig holds for a field config.json leaves out (held to the class by tests)."""
SPARSE_ATTENTION = "minimax_m3_sparse"  # a `layer_types` entry: the layer holds a lightning indexer
_LEGACY_INDEXER = {"index_n_heads": "sparse_num_index_heads", "index_head_dim": "sparse_index_dim",
                   "index_block_size": "sparse_block_size", "index_topk_blocks": "sparse_topk_blocks",
                   "index_local_blocks": "sparse_local_block"}
"""the class reads these from `sparse_attention_config`, the published checkpoints' spelling"""

_HF, _NAT = "model.layers.{layer}.", "layers.{layer}."
_MLP = (("gate_proj", "w1", 0), ("up_proj", "w3", 0), ("down_proj", "w2", 1))
KEY_TABLE: list[tuple] = [
    ("model.embed_tokens.weight", "tok_embeddings.weight", 0),
    ("model.norm.weight", "norm.weight", None),
    ("lm_head.weight", "output.weight", 0),
    (_HF + "input_layernorm.weight", _NAT + "attention_norm.weight", None),
    (_HF + "post_attention_layernorm.weight", _NAT + "ffn_norm.weight", None),
    (_HF + "self_attn.q_proj.weight", _NAT + "attention.wq.weight", Q_HEADS, LINEAR),
    (_HF + "self_attn.k_proj.weight", _NAT + "attention.wk.weight", KV_HEADS, LINEAR),
    (_HF + "self_attn.v_proj.weight", _NAT + "attention.wv.weight", KV_HEADS, LINEAR),
    (_HF + "self_attn.o_proj.weight", _NAT + "attention.wo.weight", O_HEADS, LINEAR),
    (_HF + "self_attn.q_norm.weight", _NAT + "attention.q_norm.weight", None),  # per head: whole on every rank
    (_HF + "self_attn.k_norm.weight", _NAT + "attention.k_norm.weight", None),
    # the lightning indexer: replicated (its heads score blocks for every query head)
    (_HF + "self_attn.index_q_proj.weight", _NAT + "attention.indexer.wq.weight", None, LINEAR),
    (_HF + "self_attn.index_k_proj.weight", _NAT + "attention.indexer.wk.weight", None, LINEAR),
    (_HF + "self_attn.index_q_norm.weight", _NAT + "attention.indexer.q_norm.weight", None),
    (_HF + "self_attn.index_k_norm.weight", _NAT + "attention.indexer.k_norm.weight", None),
    (_HF + "block_sparse_moe.gate.weight", _NAT + "feed_forward.gate.weight", None),
    (_HF + "block_sparse_moe.e_score_correction_bias", _NAT + "feed_forward.gate.bias", None),
    *[(f"{_HF}mlp.{a}.weight", f"{_NAT}feed_forward.{b}.weight", split, LINEAR) for a, b, split in _MLP],
    *[(f"{_HF}block_sparse_moe.shared_experts.{a}.weight", f"{_NAT}feed_forward.shared_experts.{b}.weight", split,
       LINEAR) for a, b, split in _MLP],
    *[(f"{_HF}block_sparse_moe.experts.{{expert}}.{b}.weight", f"{_NAT}feed_forward.experts.{{expert}}.{b}.weight",
       EXPERT, LINEAR) for b in ("w1", "w3", "w2")],
]
KEY_MAP = KeyMap(KEY_TABLE)


@dataclass(kw_only=True, slots=True, frozen=True)
class MiniMaxM3Config:
    """The fields of a MiniMax-M3 text config.json that decide tensor names, shapes and the model's numerics."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # one routed expert's
    dense_intermediate_size: int
    shared_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_alpha: float
    swiglu_limit: float
    mlp_layer_types: tuple[str, ...]  # "dense" / "sparse" per layer
    sparse_attention: tuple[bool, ...]  # per layer: holds a lightning indexer
    index_n_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    partial_rotary_factor: float
    tie_word_embeddings: bool
    rms_norm_eps: float

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "MiniMaxM3Config":
        """As MiniMaxM3VLTextConfig reads it: `sparse_attention_config`'s legacy names for the indexer,
        `moe_layer_freq` (a list) for `mlp_layer_types`, its `sparse_attention_freq` for `layer_types`, every
        layer MoE and full attention otherwise; `hidden_act` is ignored (the class forces silu and computes its
        clamped SwiGLU from swiglu_alpha / swiglu_limit); the rotated share is the rope parameters'
        partial_rotary_factor (or a top-level one), not `rotary_dim`, which transformers 5.24 does not read."""
        if raw.get("model_type") != MODEL_TYPE:
            raise InputError(f"model_type {raw.get('model_type')!r} is not {MODEL_TYPE}", file=source)
        d = {**CONFIG_DEFAULTS, **raw}
        sparse = raw.get("sparse_attention_config") or {}
        with config_fields(source):
            for flat, legacy in _LEGACY_INDEXER.items():
                if legacy in sparse:
                    d[flat] = sparse[legacy]
            layers = int(d["num_hidden_layers"])
            mlp_types = d.get("mlp_layer_types")
            if mlp_types is None and d.get("moe_layer_freq") is not None:
                mlp_types = ["sparse" if f else "dense" for f in d["moe_layer_freq"]]
            layer_types = d.get("layer_types")
            if layer_types is None and "sparse_attention_freq" in sparse:
                layer_types = [SPARSE_ATTENTION if f else "full_attention" for f in sparse["sparse_attention_freq"]]
            heads = int(d["num_attention_heads"])
            cfg = cls(
                model_type=MODEL_TYPE, vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]), dense_intermediate_size=int(d["dense_intermediate_size"]),
                shared_intermediate_size=int(d["shared_intermediate_size"]), num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d["head_dim"]), num_experts=int(d.get("num_experts", d["num_local_experts"])),
                num_experts_per_tok=int(d["num_experts_per_tok"]),
                routed_scaling_factor=float(d["routed_scaling_factor"]), swiglu_alpha=float(d["swiglu_alpha"]),
                swiglu_limit=float(d["swiglu_limit"]),
                mlp_layer_types=_per_layer(mlp_types, layers, ("dense", "sparse"), "sparse", "mlp_layer_types", source),
                sparse_attention=tuple(t == SPARSE_ATTENTION for t in _per_layer(
                    layer_types, layers, ("full_attention", SPARSE_ATTENTION), "full_attention", "layer_types", source)),
                index_n_heads=int(d["index_n_heads"]), index_head_dim=int(d["index_head_dim"]),
                index_block_size=int(d["index_block_size"]), index_topk_blocks=int(d["index_topk_blocks"]),
                partial_rotary_factor=_partial_rotary(raw),
                tie_word_embeddings=bool(d["tie_word_embeddings"]), rms_norm_eps=float(d["rms_norm_eps"]))
        _check(cfg, source)
        return cfg


def _per_layer(types, layers: int, values: tuple[str, ...], default: str, key: str, source) -> tuple[str, ...]:
    if types is None:
        if layers > 1 << 20:  # a rule would do, but the class writes a list: a config this deep is not a model
            raise InputError(f"num_hidden_layers = {layers} is not a model's depth", file=source)
        return (default,) * layers
    if not isinstance(types, list) or len(types) != layers or set(types) - set(values):
        raise InputError(f"{key} {types!r} is not one of {' / '.join(map(repr, values))} per layer", file=source,
                         fix="use the config.json published with the checkpoint")
    return tuple(types)


def _partial_rotary(raw: dict) -> float:
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) if isinstance(rope, dict)
                 else raw.get("partial_rotary_factor", 1.0))


def _check(cfg: MiniMaxM3Config, source: object) -> None:
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise InputError(f"num_attention_heads ({cfg.num_attention_heads}) is not a multiple of num_key_value_heads "
                         f"({cfg.num_key_value_heads})", file=source)
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise InputError(f"num_experts_per_tok ({cfg.num_experts_per_tok}) is not in 1..{cfg.num_experts}", file=source)
    if not 0 < cfg.partial_rotary_factor <= 1 or int(cfg.head_dim * cfg.partial_rotary_factor) % 2:
        raise InputError(f"partial_rotary_factor {cfg.partial_rotary_factor} does not rotate an even number of the "
                         f"{cfg.head_dim} dims of a head", file=source)


def hf_tensor_shapes(cfg: MiniMaxM3Config, *, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds (weights only, no FP8 scales; no MTP layers: the
    published checkpoint's `mtp.*`, which transformers does not build either, is not read)."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes, prefixes = decoder_shapes(cfg.vocab_size, h, cfg.num_hidden_layers,
                                      tie_word_embeddings=cfg.tie_word_embeddings)
    for layer, p in enumerate(prefixes):
        attention_shapes(shapes, p, h, cfg.num_attention_heads * d, cfg.num_key_value_heads * d, qkv_bias=False,
                         o_bias=False)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        if cfg.sparse_attention[layer]:
            i = cfg.index_head_dim
            shapes[p + "self_attn.index_q_proj.weight"] = (cfg.index_n_heads * i, h)
            shapes[p + "self_attn.index_k_proj.weight"] = (i, h)
            shapes[p + "self_attn.index_q_norm.weight"] = (i,)
            shapes[p + "self_attn.index_k_norm.weight"] = (i,)
        if cfg.is_moe_layer(layer):
            b = p + "block_sparse_moe."
            shapes[b + "gate.weight"] = (cfg.num_experts, h)
            shapes[b + "e_score_correction_bias"] = (cfg.num_experts,)
            for e in range(cfg.num_experts):
                mlp_shapes(shapes, f"{b}experts.{e}.", h, cfg.intermediate_size, ("w1", "w3", "w2"))
            mlp_shapes(shapes, b + "shared_experts.", h, cfg.shared_intermediate_size)
        else:
            mlp_shapes(shapes, p + "mlp.", h, cfg.dense_intermediate_size)
    return shapes


def is_mtp_tensor(cfg: MiniMaxM3Config, hf_name: str) -> bool:
    layer = layer_index(hf_name)
    return layer is not None and layer >= cfg.num_hidden_layers


def check_mp(cfg: MiniMaxM3Config, mp: int) -> None:
    """Query heads split evenly, KV heads split or replicate, and experts, the vocabulary and the dense and
    shared MLP widths divide."""
    check_gqa_heads(cfg, mp)
    sizes = [("num_local_experts", cfg.num_experts), ("vocab_size", cfg.vocab_size),
             ("shared_intermediate_size", cfg.shared_intermediate_size)]
    if "dense" in cfg.mlp_layer_types:
        sizes.append(("dense_intermediate_size", cfg.dense_intermediate_size))
    for what, size in sizes:
        if size % mp:
            raise PlanError(f"{what} ({size}) is not divisible by mp={mp}", file="config.json",
                            fix=f"choose an --mp that divides {size}")
