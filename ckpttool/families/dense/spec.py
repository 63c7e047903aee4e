"""Dense decoder families (llama, mistral, qwen2, qwen3): config, tensor shapes and the HF <-> mp key table.

The mp names follow the llama reference / gpt-fast layout (`tok_embeddings`, `layers.{layer}.attention.wq`,
`feed_forward.w1`, `output`). Column-parallel weights (q/k/v, gate/up, embedding rows, lm_head) are cut
along dim 0 on whole heads or rows, row-parallel ones (o, down) along dim 1; KV heads are replicated
when there are fewer of them than ranks (`HeadSplit(replicate=True)`). Rows keep HF's order, so RoPE
is HF's rotate-half form (no interleave permutation of wq/wk as in Meta's original weights).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpttool.families.base import KV_HEADS, O_HEADS, Q_HEADS, check_gqa_heads, config_fields
from ckpttool.families.shapes import attention_shapes, decoder_shapes
from ckpttool.families.keymap import LINEAR, KeyMap
from ckpttool.errors import InputError, PlanError


@dataclass(kw_only=True, slots=True, frozen=True)
class DenseType:
    """What transformers' model of one model_type builds from its config: each bias is fixed (a bool) or follows a
    config field (its name, absent = False); qk_norm is the per-head RMSNorm of q and k."""

    qkv_bias: bool | str
    o_bias: bool | str
    mlp_bias: bool | str
    qk_norm: bool


def _reads(column: bool | str, raw: dict) -> bool:
    """A DenseType column's value for one config.json."""
    return bool(raw.get(column, False)) if isinstance(column, str) else column


TYPES: dict[str, DenseType] = {
    "llama": DenseType(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias", qk_norm=False),
    "mistral": DenseType(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen2": DenseType(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False),
    "qwen3": DenseType(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False, qk_norm=True),
}
"""One row per model_type (tests/test_dense.py checks each against transformers' model): adding one edits no other."""
MODEL_TYPES = tuple(TYPES)

_ATTN = [
    ("q_proj.weight", "wq.weight", Q_HEADS, LINEAR),
    ("q_proj.bias", "wq.bias", Q_HEADS),
    ("k_proj.weight", "wk.weight", KV_HEADS, LINEAR),
    ("k_proj.bias", "wk.bias", KV_HEADS),
    ("v_proj.weight", "wv.weight", KV_HEADS, LINEAR),
    ("v_proj.bias", "wv.bias", KV_HEADS),
    ("o_proj.weight", "wo.weight", O_HEADS, LINEAR),
    ("o_proj.bias", "wo.bias", None),  # added once, after the all-reduce
    ("q_norm.weight", "q_norm.weight", None),  # qwen3: per head_dim, the same on every head
    ("k_norm.weight", "k_norm.weight", None),
]
_MLP = [
    ("gate_proj.weight", "w1.weight", 0, LINEAR),
    ("gate_proj.bias", "w1.bias", 0),
    ("up_proj.weight", "w3.weight", 0, LINEAR),
    ("up_proj.bias", "w3.bias", 0),
    ("down_proj.weight", "w2.weight", 1, LINEAR),
    ("down_proj.bias", "w2.bias", None),
]

KEY_TABLE: list[tuple] = [
    ("model.embed_tokens.weight", "tok_embeddings.weight", 0),
    ("model.norm.weight", "norm.weight", None),
    ("lm_head.weight", "output.weight", 0),  # absent when tie_word_embeddings: the model reuses tok_embeddings
    ("model.layers.{layer}.input_layernorm.weight", "layers.{layer}.attention_norm.weight", None),
    ("model.layers.{layer}.post_attention_layernorm.weight", "layers.{layer}.ffn_norm.weight", None),
    *[(f"model.layers.{{layer}}.self_attn.{a}", f"layers.{{layer}}.attention.{b}", *rest) for a, b, *rest in _ATTN],
    *[(f"model.layers.{{layer}}.mlp.{a}", f"layers.{{layer}}.feed_forward.{b}", *rest) for a, b, *rest in _MLP],
]
"""(hf template, native template, split[, LINEAR]): split is a dim cut evenly, a HeadSplit, or None
(replicated). Each `*.weight` row implies its FP8 scale row (`*.weight_scale_inv` -> `*.scale`)."""
KEY_MAP = KeyMap(KEY_TABLE)


@dataclass(kw_only=True, slots=True, frozen=True)
class DenseConfig:
    """The fields of an HF llama/mistral/qwen2/qwen3 config.json that decide tensor names and shapes."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, raw: dict, source: object = "config.json") -> "DenseConfig":
        with config_fields(source):
            model_type = raw["model_type"]
            if model_type not in MODEL_TYPES:
                raise InputError(f"model_type {model_type!r} is not a dense family ({', '.join(MODEL_TYPES)})",
                                 file=source)
            heads = int(raw["num_attention_heads"])
            row = TYPES[model_type]
            cfg = cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
                qkv_bias=_reads(row.qkv_bias, raw),
                o_bias=_reads(row.o_bias, raw),
                mlp_bias=_reads(row.mlp_bias, raw),
                qk_norm=row.qk_norm,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise InputError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                             f"({cfg.num_key_value_heads})", file=source)
        return cfg


def hf_tensor_shapes(cfg: DenseConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds (weights and biases, no FP8 scales)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, inter = cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.intermediate_size
    shapes, prefixes = decoder_shapes(cfg.vocab_size, h, cfg.num_hidden_layers,
                                      tie_word_embeddings=cfg.tie_word_embeddings)
    for p in prefixes:
        attention_shapes(shapes, p, h, q, kv, qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            shapes[f"{p}mlp.{proj}.weight"] = shape
            if cfg.mlp_bias:
                shapes[f"{p}mlp.{proj}.bias"] = (shape[0],)
    return shapes


def check_mp(cfg: DenseConfig, mp: int) -> None:
    """Query heads must split evenly, KV heads split or replicate evenly, and vocabulary and MLP width
    divide: row counts alone can divide and still cut a head in half."""
    check_gqa_heads(cfg, mp)
    for what, size in (("vocab_size", cfg.vocab_size), ("intermediate_size", cfg.intermediate_size)):
        if size % mp:
            raise PlanError(f"{what} ({size}) is not divisible by mp={mp}", file="config.json",
                            fix=f"choose an --mp that divides {size}")
