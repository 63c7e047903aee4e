"""Each model type of the MLA family as a row of data: its transformers class's defaults, how it routes,
which of its fields it reads, and its numerics switches. spec.py and args.py read every type through these
rows with one code path, so adding a type adds a row and edits no other.

The defaults are what each transformers config class holds for a field config.json leaves out (held to the
installed classes by tests/test_config_reading.py and tests/test_mla_types.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class MlaType:
    title: str
    """how messages name the type"""
    defaults: dict
    """the transformers config class's value of each field config.json may leave out"""
    # -- routing, as the type's transformers router computes it
    scoring: str
    """"softmax" or "sigmoid" scores"""
    correction_bias: bool
    """the router has an `e_score_correction_bias` added for the choice (DeepSeek-V3's noaux_tc)"""
    group_score: str = "top2_sum"
    """how the model ranks a group of experts: by the sum of its two best scores ("top2_sum") or its best ("max")"""
    topk_methods: dict[str, str] | None = None
    """config.json's `topk_method` -> the group ranking ("none": no groups), where the model reads it
    (DeepSeek-V2); None: the model hard-codes `group_score`"""
    renormalizes: bool = True
    """the model honours norm_topk_prob (DeepSeek-V2's never renormalises: a config asking is refused)"""
    hard_coded: dict = field(default_factory=dict)
    """routing fields the model hard-codes: a config.json stating another value is refused, and HF outputs
    state them (engines read other defaults)"""
    # -- which fields it reads
    moe_layer_freq: bool = False
    """reads `moe_layer_freq` (DeepSeek's published configs state it; ckpttool has always read it for them)"""
    mlp_layer_types: bool = False
    """reads `mlp_layer_types` ("dense" / "sparse" per layer) where given"""
    rope_interleave: bool | None = True
    """rotate adjacent pairs (True) or halves (False), hard-coded by the model; None: the config's
    `rope_interleave` field (its class default in `defaults`)"""
    rope_head_dim: str = "qk_rope_head_dim"
    """the head size a `partial_rotary_factor` applies to, as the class's rotary embedding reads it (Mistral 4:
    the whole query head, qk_nope_head_dim + qk_rope_head_dim); the rotated dims must be qk_rope_head_dim"""
    default_rope: dict | None = None
    """the class's rope parameters where config.json states none (Mistral 4's YaRN); None: default rope"""
    # -- attention switches
    indexer: bool = False
    """DeepSeek Sparse Attention's indexer (`self_attn.indexer.*`) in every layer that runs one"""
    shared_indexers: bool = False
    """reads GLM-5's per-layer indexer mode (`indexer_types`, `index_topk_pattern`, `index_topk_freq` /
    `index_skip_topk_offset`): a "shared" layer reuses the previous full layer's top-k and holds no indexer"""
    needs_q_lora: bool = False
    """the model always builds q_a_proj / q_b_proj (no plain q_proj): a config without q_lora_rank is refused"""
    llama4_scaling: bool = False
    """queries scaled by 1 + beta * log(1 + floor(pos / original_max_position_embeddings)), beta the rope
    parameters' `llama_4_scaling_beta` (Mistral 4)"""
    # -- Mistral Large 4's additions
    q_lora: bool = True
    """reads `q_lora_rank` (False: the class has no query LoRA; queries through a plain `q_proj`)"""
    nope_layers: bool = False
    """reads `no_rope_layers` (1: the layer rotates, 0: NoPE, its kv_a_proj holds no rotary part and its q/k nope
    width is qk_nope + qk_rope); left out, every `no_rope_layer_interval`-th (4) layer is NoPE"""
    kv_sharing: bool = False
    """reads `kv_source_layers`: a layer pointing at an earlier one holds no kv_a_proj_with_mqa / kv_a_layernorm
    and attends to that layer's latent KV"""
    softmax_scaling: bool = False
    """learned per-head query scaling q * (scale_h * log(pos + 1) + bias_h) (`self_attn.softmax_scaling.*`, and the
    indexer's own), and an indexer whose queries come from the hidden states (`q_input_norm`, not a query LoRA)"""
    lerope: bool = False
    """learned rotary frequencies: inv_freq * exp(alpha), `model.rotary_emb.alpha` (LeRoPE)"""
    logit_softcapping: bool = False
    """reads `final_logit_softcapping`: logits = tanh(logits / cap) * cap"""
    fp32_router: bool = False
    """the model keeps the router's weight in float32 whatever the dtype it runs in (_keep_in_fp32_modules_strict)"""
    wrapped_only: str | None = None
    """why the type alone is refused where it is read only as a multimodal wrapper's text tower"""


_MLA_DIMS = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False)
_V3 = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
           num_hidden_layers=61, num_attention_heads=128, n_routed_experts=256, n_shared_experts=1,
           num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4, norm_topk_prob=True,
           routed_scaling_factor=2.5, max_position_embeddings=4096, **_MLA_DIMS)
_NOAUX_TC = dict(scoring="sigmoid", correction_bias=True, hard_coded={"topk_method": "noaux_tc", "scoring_func": "sigmoid"})
"""DeepSeek-V3's router: sigmoid scores, a correction bias for the choice, groups ranked by their two best"""

TYPES: dict[str, MlaType] = {
    "deepseek_v2": MlaType(
        "DeepSeek-V2",
        dict(_MLA_DIMS, vocab_size=102400, hidden_size=4096, intermediate_size=11008, moe_intermediate_size=1407,
             num_hidden_layers=32, num_attention_heads=32, n_routed_experts=64, n_shared_experts=2,
             num_experts_per_tok=None, first_k_dense_replace=0, num_nextn_predict_layers=0, topk_method="greedy",
             n_group=None, topk_group=None, norm_topk_prob=False, routed_scaling_factor=1.0,
             max_position_embeddings=2048, moe_layer_freq=1),
        scoring="softmax", correction_bias=False, topk_methods={"greedy": "none", "group_limited_greedy": "max"},
        renormalizes=False, hard_coded={"scoring_func": "softmax"}, moe_layer_freq=True),
    "deepseek_v3": MlaType(
        "the DeepSeek-V3 architecture",
        dict(_V3, num_nextn_predict_layers=1, rope_interleave=True, moe_layer_freq=1),
        **_NOAUX_TC, moe_layer_freq=True, rope_interleave=None),
    "deepseek_v32": MlaType(
        "DeepSeek-V3.2",
        dict(_V3, num_nextn_predict_layers=0, max_position_embeddings=163840, index_topk=2048, index_head_dim=128,
             index_n_heads=64, moe_layer_freq=1),
        **_NOAUX_TC, moe_layer_freq=True, mlp_layer_types=True, indexer=True, needs_q_lora=True),
    "glm_moe_dsa": MlaType(  # V3.2's attention and router, indexers shared across layers
        "GLM-5",
        dict(_MLA_DIMS, vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
             num_hidden_layers=78, num_attention_heads=64, n_routed_experts=256, n_shared_experts=1,
             num_experts_per_tok=8, first_k_dense_replace=3, n_group=1, topk_group=1, norm_topk_prob=True,
             routed_scaling_factor=2.5, max_position_embeddings=202752, num_nextn_predict_layers=0, q_lora_rank=2048,
             qk_nope_head_dim=192, v_head_dim=256, rms_norm_eps=1e-5, index_topk=2048, index_head_dim=128,
             index_n_heads=32),
        **_NOAUX_TC, mlp_layer_types=True, indexer=True, shared_indexers=True, needs_q_lora=True),
    "mistral4": MlaType(  # MLA with V3's layout, a softmax router without bias, Llama-4's query scaling
        "Mistral 4",
        dict(_MLA_DIMS, vocab_size=131072, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=2048,
             num_hidden_layers=36, num_attention_heads=32, n_routed_experts=128, n_shared_experts=1,
             num_experts_per_tok=4, first_k_dense_replace=0, n_group=1, topk_group=1, norm_topk_prob=True,
             routed_scaling_factor=1.0, max_position_embeddings=1048576, num_nextn_predict_layers=0,
             q_lora_rank=1024, kv_lora_rank=256, qk_nope_head_dim=64, rope_interleave=True),
        scoring="softmax", correction_bias=False, rope_interleave=None, rope_head_dim="qk_head_dim",
        llama4_scaling=True,
        default_rope={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0,
                      "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
                      "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}),
    "mistral_large4_text": MlaType(  # GLM-5's DSA without a query LoRA, NoPE layers, latent KV shared across layers
        "Mistral Large 4's text model",
        dict(vocab_size=204800, hidden_size=6144, intermediate_size=24576, moe_intermediate_size=6144,
             num_hidden_layers=72, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=128,
             n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=1, topk_group=1,
             norm_topk_prob=True, routed_scaling_factor=1.0, max_position_embeddings=1048576,
             num_nextn_predict_layers=0, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128,
             rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, index_topk=2048, index_head_dim=128,
             index_n_heads=32, final_logit_softcapping=30.0),
        scoring="softmax", correction_bias=False, hard_coded={"norm_topk_prob": True}, mlp_layer_types=True,
        indexer=True, shared_indexers=True, q_lora=False, nope_layers=True, kv_sharing=True, softmax_scaling=True,
        lerope=True, logit_softcapping=True, fp32_router=True,
        default_rope={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2048.0,
                      "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0,
                      "attention_factor": 1.0},
        wrapped_only="Mistral Large 4's text model is read inside its multimodal checkpoint (model_type "
                     "mistral_large4): transformers 5.24 has no causal LM of the text model alone "
                     "(MistralLarge4TextModel holds no head), so nothing could verify it"),
}
TYPES["kimi_k2"] = TYPES["deepseek_v3"]  # Kimi-K2 is the DeepSeek-V3 architecture under its own model_type
MODEL_TYPES = tuple(sorted(t for t, row in TYPES.items() if row.wrapped_only is None))
"""the model_types the family reads alone (a `wrapped_only` type is read as a wrapper's text tower)"""

ROUTING_FIELDS = ("topk_method", "scoring_func", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                  "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
                  "moe_layer_freq")
"""What the HF outputs state explicitly (Family.explicit_config): transformers 5 saves a V3 config without
topk_method / scoring_func (its model hard-codes noaux_tc over sigmoid), and vLLM and llama.cpp then route
with softmax, or fail on the correction bias."""
