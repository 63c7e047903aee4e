"""MiniMax-M3's text model for verify: the shared GQA decoder (model/decoder.py) with Gemma's norms, whose
feed-forward is a clamped-SwiGLU MLP on dense layers and routed experts plus a shared expert (model/moe.py) on
MoE layers; `minimax_m3_sparse` layers carry the lightning indexer's weights (loaded and checked, not run).

The indexer keeps, for each query, the index_topk_blocks best blocks of index_block_size keys: while a sequence
is no longer than index_topk_blocks * index_block_size every block holding a past key is kept, so the sparse
attention is the dense one, which is what this model runs; verify refuses longer sequences (setup_caches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ckpttool.errors import InputError
from ckpttool.families.base import ConfigArgs, eos_ids, read_rope
from ckpttool.families.minimax_m3.spec import DEFAULT_ROPE_THETA, MiniMaxM3Config
from ckpttool.formats import declares_fp8_block
from ckpttool.model.decoder import ROPE_TYPES, Decoder, DecoderShape, FeedForward, rope_inv_freq
from ckpttool.model.moe import MoE, Routing
from ckpttool.model.norms import GemmaRMSNorm
from ckpttool.model.parallel import Linear, ParallelContext


@dataclass(kw_only=True, slots=True, frozen=True)
class MiniMaxM3Args(ConfigArgs):
    cfg: MiniMaxM3Config
    shape: DecoderShape
    routing: Routing
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "MiniMaxM3Args":
        cfg = MiniMaxM3Config.from_dict(raw, source)
        rope = read_rope(raw, source, default_theta=DEFAULT_ROPE_THETA, types=ROPE_TYPES)
        inv_freq, scaling = rope_inv_freq(rope, cfg.head_dim, cfg.partial_rotary_factor)
        shape = DecoderShape(
            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, qkv_bias=False,
            o_bias=False, qk_norm="head", norm_eps=cfg.rms_norm_eps, inv_freq=tuple(inv_freq.tolist()),
            attention_scaling=scaling, sliding_windows=(None,) * cfg.num_hidden_layers,
            tie_word_embeddings=cfg.tie_word_embeddings, fp8=declares_fp8_block(raw.get("quantization_config"), source),
            gemma_norms=True)
        # the routed sum is scaled after the experts in transformers; scaling each weight is the same sum
        routing = Routing(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
                          correction_bias=True, normalize=True, scale=cfg.routed_scaling_factor)
        return cls(cfg=cfg, shape=shape, routing=routing, eos_token_ids=eos_ids(raw))


class Indexer(nn.Module):
    """The lightning indexer's weights (replicated): its queries and one key per token, each with a Gemma norm."""

    def __init__(self, cfg: MiniMaxM3Config, dtype: torch.dtype, fp8: bool):
        super().__init__()
        self.wq = Linear(cfg.hidden_size, cfg.index_n_heads * cfg.index_head_dim, dtype, fp8)
        self.wk = Linear(cfg.hidden_size, cfg.index_head_dim, dtype, fp8)
        self.q_norm = GemmaRMSNorm(cfg.index_head_dim, cfg.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(cfg.index_head_dim, cfg.rms_norm_eps, dtype)


class MiniMaxM3Transformer(Decoder):
    def __init__(self, args: MiniMaxM3Args, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16):
        c, fp8 = args.cfg, args.shape.fp8
        swiglu = (c.swiglu_alpha, c.swiglu_limit)

        def feed_forward(layer: int):
            if not c.is_moe_layer(layer):
                return FeedForward(c.hidden_size, c.dense_intermediate_size, dtype, fp8, ctx=ctx, swiglu=swiglu)
            return MoE(args.routing, c.hidden_size, c.intermediate_size, ctx, dtype, fp8,
                       shared_inter=c.shared_intermediate_size, swiglu=swiglu)

        super().__init__(args.shape, ctx, dtype, feed_forward)
        for block, sparse in zip(self.layers, c.sparse_attention):
            if sparse:
                block.attention.indexer = Indexer(c, dtype, fp8)
        self.args = args

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        c = self.args.cfg
        keep = c.index_topk_blocks * c.index_block_size
        if any(c.sparse_attention) and max_seq_len > keep:
            raise InputError(f"{max_seq_len} positions exceed what MiniMax-M3's indexer keeps whole "
                             f"(index_topk_blocks x index_block_size = {keep}): verify's model runs dense attention, "
                             "equal to the block-sparse one only up to there",
                             fix=f"verify with a prompt plus --max-new-tokens of at most {keep} tokens")
        super().setup_caches(batch, max_seq_len)
