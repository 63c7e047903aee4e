"""DeepSeek-V4: its tensors in both spellings, and the mp layout of DeepSeek's own V4 inference code.

The mp layout is DeepSeek's `inference/convert.py` for V4 (published with the V4-Flash weights): a
tensor keeps its hub name (the `model.` prefix, if any, dropped) and is cut by its leaf's row of one
small table, everything else being whole on every rank:
- `embed`, `head`: vocabulary rows (dim 0);
- `attn.wq_b`, `attn.attn_sink`: whole query heads (dim 0); `attn.wo_a`: whole output groups (dim 0:
  the grouped projection is block-diagonal, each group reading only its own heads, so a rank's heads
  are exactly its groups' heads); `attn.wo_b`: its input columns, the same groups (dim 1, all-reduced);
- `attn.indexer.wq_b`, `attn.indexer.weights_proj`: whole indexer heads (dim 0, scores all-reduced);
- routed experts `ffn.experts.E.*`: whole, expert E on rank E // (n_routed_experts / mp);
- replicated: `wq_a`, `wkv` (one KV head, shared by every query head), the norms, the compressors
  (`attn.compressor.*`, `attn.indexer.compressor.*`), the router (`ffn.gate.weight`, `bias`, `tid2eid`),
  the shared expert (DeepSeek's V4 model runs it whole on every rank), the hyper-connections
  (`hc_attn_*`, `hc_ffn_*`, `hc_head_*`) and the MTP projections.
Kept in FP8 (128x128 blocks; convert.py's `--expert-dtype fp8`), a weight's `.scale` is cut with it, and `wo_a` is
BF16 (convert.py dequantizes it; its model runs the grouped projection as a BF16 einsum): the MP_BF16 column.
DeepSeek's convert.py keeps the MTP layers (`mtp.N.*`, without embedding or head, which V4 does not
store); it asserts only that sizes divide. `check_mp` refuses every mp that would cut a head, an output
group (DeepSeek's model computes `o_groups // world_size` local groups: mp 16 over V4-Flash's 8 groups
would leave none), an indexer head, an expert range or the vocabulary.

Two spellings of the same tensors exist (config.spelling, read from config.json):
- `deepseek`: the hub's files, `layers.N.attn.wq_a.weight`, `embed.weight`, `hc_head_fn`, `mtp.0.e_proj.weight`;
  the mp names are these names;
- `transformers`: what transformers 5.24's save_pretrained writes after its conversion mapping is reversed:
  the same names under `model.` (`model.layers.N.attn.wq_a.weight`, per-expert `ffn.experts.E.w1`), but
  `model.embed_tokens.weight`, `model.norm.weight`, `model.hc_head.hc_fn`, `attn.norm.weight` for the
  attention's `kv_norm`, and no MTP layers (transformers does not build them). transformers loads both.
A quantized weight's scale is `X.scale` in both spellings (`KeyMap(..., hf_scale_leaf="scale")`).
"""

from __future__ import annotations

from ckpttool.errors import PlanError
from ckpttool.families.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from ckpttool.families.keymap import EXPERT, LINEAR, MP_BF16, KeyMap

_ATTN = [
    ("attn_norm.weight", None), ("ffn_norm.weight", None),
    *[(f"hc_{part}_{leaf}", None) for part in ("attn", "ffn") for leaf in ("fn", "base", "scale")],
    ("attn.wq_a.weight", None, LINEAR), ("attn.q_norm.weight", None), ("attn.wq_b.weight", 0, LINEAR),
    ("attn.wkv.weight", None, LINEAR), ("attn.kv_norm.weight", None), ("attn.wo_a.weight", 0, LINEAR, MP_BF16),
    ("attn.wo_b.weight", 1, LINEAR), ("attn.attn_sink", 0),
    *[(f"attn.{c}.{leaf}", None) for c in ("compressor", "indexer.compressor")
      for leaf in ("wkv.weight", "wgate.weight", "norm.weight", "ape")],
    ("attn.indexer.wq_b.weight", 0, LINEAR), ("attn.indexer.weights_proj.weight", 0),
    ("ffn.gate.weight", None), ("ffn.gate.bias", None), ("ffn.gate.tid2eid", None),
    *[(f"ffn.shared_experts.{w}.weight", None, LINEAR) for w in ("w1", "w2", "w3")],
    *[(f"ffn.experts.{{expert}}.{w}.weight", EXPERT, LINEAR) for w in ("w1", "w2", "w3")],
]
"""(name under `layers.N.` / `mtp.N.`, split[, LINEAR[, mp dtype]]) of a decoder layer; LINEAR marks what the
published checkpoints store in FP8 (or MXFP4, the experts), beside a `.scale`; wo_a is BF16 in the mp layout
(DeepSeek's convert.py dequantizes it: its model runs the grouped projection as a BF16 einsum)"""
_MTP = [("enorm.weight", None), ("hnorm.weight", None), ("norm.weight", None), ("e_proj.weight", None, LINEAR),
        ("h_proj.weight", None, LINEAR), ("hc_head_fn", None), ("hc_head_base", None), ("hc_head_scale", None)]
_GLOBAL = [("embed.weight", 0), ("head.weight", 0), ("norm.weight", None), ("hc_head_fn", None),
           ("hc_head_base", None), ("hc_head_scale", None)]

DEEPSEEK_ROWS: list[tuple] = [
    *[(name, name, *rest) for name, *rest in _GLOBAL],
    *[(f"layers.{{layer}}.{name}", f"layers.{{layer}}.{name}", *rest) for name, *rest in _ATTN],
    *[(f"mtp.{{layer}}.{name}", f"mtp.{{layer}}.{name}", *rest) for name, *rest in _ATTN + _MTP],
]
_TRANSFORMERS_GLOBAL = {"embed.weight": "model.embed_tokens.weight", "head.weight": "head.weight",
                        "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
                        "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
_TRANSFORMERS_LEAF = {"attn.kv_norm.weight": "attn.norm.weight"}  # its reversed `.norm.` -> `.kv_norm.` renaming
TRANSFORMERS_ROWS: list[tuple] = [
    *[(_TRANSFORMERS_GLOBAL[name], name, *rest) for name, *rest in _GLOBAL],
    *[(f"model.layers.{{layer}}.{_TRANSFORMERS_LEAF.get(name, name)}", f"layers.{{layer}}.{name}", *rest)
      for name, *rest in _ATTN],
]
KEY_MAPS = {"deepseek": KeyMap(DEEPSEEK_ROWS, hf_scale_leaf="scale"),
            "transformers": KeyMap(TRANSFORMERS_ROWS, hf_scale_leaf="scale")}


def key_map(cfg: DeepseekV4Config) -> KeyMap:
    """The key table of the config's spelling."""
    return KEY_MAPS[cfg.spelling]


def native_shapes(cfg: DeepseekV4Config, *, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model (mp names, unquantized shapes), MTP layers included when asked."""
    d, hc = cfg.hidden_size, cfg.hc_mult
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, d), "head.weight": (cfg.vocab_size, d),
                                          "norm.weight": (d,), **_hc_head(hc, d, "")}
    for layer in range(cfg.num_hidden_layers):
        shapes.update(_layer(cfg, layer, f"layers.{layer}."))
    for i in range(cfg.num_nextn_predict_layers if with_mtp else 0):
        p = f"mtp.{i}."
        shapes.update(_layer(cfg, cfg.num_hidden_layers + i, p))
        shapes.update({p + "enorm.weight": (d,), p + "hnorm.weight": (d,), p + "norm.weight": (d,),
                       p + "e_proj.weight": (d, d), p + "h_proj.weight": (d, d), **_hc_head(hc, d, p)})
    return shapes


def _hc_head(hc: int, d: int, p: str) -> dict:
    return {p + "hc_head_fn": (hc, hc * d), p + "hc_head_base": (hc,), p + "hc_head_scale": (1,)}


def _layer(cfg: DeepseekV4Config, layer: int, p: str) -> dict[str, tuple[int, ...]]:
    d, heads, hd, q = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    mix = (2 + cfg.hc_mult) * cfg.hc_mult
    out: dict[str, tuple[int, ...]] = {p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,)}
    for part in ("attn", "ffn"):
        out.update({f"{p}hc_{part}_fn": (mix, cfg.hc_mult * d), f"{p}hc_{part}_base": (mix,), f"{p}hc_{part}_scale": (3,)})
    a = p + "attn."
    out.update({a + "wq_a.weight": (q, d), a + "q_norm.weight": (q,), a + "wq_b.weight": (heads * hd, q),
                a + "wkv.weight": (hd, d), a + "kv_norm.weight": (hd,),
                a + "wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups),
                a + "wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank), a + "attn_sink": (heads,)})
    kind = cfg.layer_type(layer)
    if kind != SLIDING:
        rate, width = cfg.compress_rates[kind], 2 if kind == CSA else 1  # CSA's windows overlap: two series
        out.update(_compressor(a + "compressor.", d, hd, rate, width))
    if kind == CSA:
        ihd = cfg.index_head_dim
        out.update({a + "indexer.wq_b.weight": (cfg.index_n_heads * ihd, q),
                    a + "indexer.weights_proj.weight": (cfg.index_n_heads, d),
                    **_compressor(a + "indexer.compressor.", d, ihd, cfg.compress_rates[CSA], 2)})
    f, e, inter = p + "ffn.", cfg.n_routed_experts, cfg.moe_intermediate_size
    out[f + "gate.weight"] = (e, d)
    if cfg.is_hash(layer):
        out[f + "gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
    else:
        out[f + "gate.bias"] = (e,)
    for prefix in [f + "shared_experts."] + [f"{f}experts.{x}." for x in range(e)]:
        out.update({prefix + "w1.weight": (inter, d), prefix + "w2.weight": (d, inter), prefix + "w3.weight": (inter, d)})
    return out


def _compressor(p: str, d: int, head_dim: int, rate: int, width: int) -> dict[str, tuple[int, ...]]:
    return {p + "wkv.weight": (width * head_dim, d), p + "wgate.weight": (width * head_dim, d),
            p + "ape": (rate, width * head_dim), p + "norm.weight": (head_dim,)}


def hf_tensor_shapes(cfg: DeepseekV4Config, *, with_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config holds, in its spelling. transformers saves no MTP layers."""
    keys = key_map(cfg)
    mtp = with_mtp and cfg.spelling == "deepseek"
    return {keys.to_hf(name).name: shape for name, shape in native_shapes(cfg, with_mtp=mtp).items()}


def is_mtp_tensor(cfg: DeepseekV4Config, hf_name: str) -> bool:
    return hf_name.startswith("mtp.")


def check_mp(cfg: DeepseekV4Config, mp: int) -> None:
    """Every cut on whole units: query heads, output groups, indexer heads, expert ranges, vocabulary
    rows. DeepSeek's convert.py asserts only that sizes divide, which can cut a group in half."""
    units = [("num_attention_heads", cfg.num_attention_heads, "wq_b and attn_sink are cut on whole heads"),
             ("o_groups", cfg.o_groups, "wo_a / wo_b are cut on whole output groups (DeepSeek's model runs "
                                        "o_groups // mp groups per rank)"),
             ("n_routed_experts", cfg.n_routed_experts, "each rank holds a contiguous range of whole experts"),
             ("vocab_size", cfg.vocab_size, "embed and head are cut on vocabulary rows")]
    if CSA in cfg.layer_types + cfg.mtp_layer_types:
        units.append(("index_n_heads", cfg.index_n_heads, "the indexer's wq_b and weights_proj are cut on whole heads"))
    for what, size, why in units:
        if size % mp:
            raise PlanError(f"{what} ({size}) is not divisible by mp={mp}: {why}", file="config.json",
                            fix=f"choose an --mp that divides {size}")
