"""The MoE decoders of families/moe for verify: the shared GQA decoder (model/decoder.py) whose
feed-forward is routed experts (model/moe.py) on MoE layers and a SwiGLU MLP on dense ones.

Parameter names are the mp names of families/moe/spec.py, so `model{i}-mp{N}.safetensors` loads into
`MoeTransformer(args, ParallelContext(i, N))` one to one. MTP layers (GLM-4.5) are not part of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ckpttool.families.base import ConfigArgs, eos_ids, read_rope
from ckpttool.families.moe.spec import MoeConfig
from ckpttool.formats import declares_fp8_block
from ckpttool.model.decoder import ROPE_TYPES, Decoder, DecoderShape, FeedForward, rope_inv_freq, sliding_windows
from ckpttool.model.moe import MoE, Routing
from ckpttool.model.parallel import ParallelContext


@dataclass(kw_only=True, slots=True, frozen=True)
class MoeArgs(ConfigArgs):
    cfg: MoeConfig
    shape: DecoderShape
    routing: Routing
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "MoeArgs":
        cfg = MoeConfig.from_dict(raw, source)
        rope = read_rope(raw, source, default_theta=cfg.type.default_theta, types=ROPE_TYPES)
        inv_freq, scaling = rope_inv_freq(rope, cfg.head_dim, cfg.partial_rotary_factor)
        shape = DecoderShape(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias, qk_norm=cfg.qk_norm, norm_eps=cfg.rms_norm_eps,
            inv_freq=tuple(inv_freq.tolist()), attention_scaling=scaling,
            sliding_windows=sliding_windows(raw, cfg.num_hidden_layers), tie_word_embeddings=cfg.tie_word_embeddings,
            fp8=declares_fp8_block(raw.get("quantization_config"), source), clip_qkv=cfg.clip_qkv)
        routing = Routing(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, scoring=cfg.scoring,
                          correction_bias=cfg.type.correction_bias is not None, groups=cfg.n_group,
                          topk_groups=cfg.topk_group, normalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
        return cls(cfg=cfg, shape=shape, routing=routing, eos_token_ids=eos_ids(raw))


class MoeTransformer(Decoder):
    def __init__(self, args: MoeArgs, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16):
        c, fp8 = args.cfg, args.shape.fp8

        def feed_forward(layer: int):
            if not c.is_moe_layer(layer):
                return FeedForward(c.hidden_size, c.intermediate_size, dtype, fp8, ctx=ctx)
            return MoE(args.routing, c.hidden_size, c.expert_intermediate_size, ctx, dtype, fp8,
                       shared_inter=c.shared_intermediate_size, shared_gate=c.type.shared_gate)

        super().__init__(args.shape, ctx, dtype, feed_forward)
        self.args = args
