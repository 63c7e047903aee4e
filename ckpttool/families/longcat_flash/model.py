"""LongCat-Flash for verify, numerics as transformers 5.24's torch code computes them: per decoder layer two MLA
sublayers (query LoRA; the query and the normed latent scaled by sqrt(hidden / rank); interleaved rotary pairs),
two dense MLPs, and the shortcut MoE (model/moe.py: softmax over routed + zero experts, correction bias for the
choice, unnormalised weights times routed_scaling_factor; zero experts are IdentityExpert).

Parameter names are the mp names of families/longcat_flash/spec.py. Shapes: B batch, S new tokens, T cached
positions, H local heads, C the latent (kv_lora_rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ckpttool.errors import InputError
from ckpttool.families.base import ConfigArgs, eos_ids
from ckpttool.families.longcat_flash.spec import LongcatFlashConfig
from ckpttool.model.decoder import DenseLinear, FeedForward
from ckpttool.model.lm import VocabParallelLM, causal_mask
from ckpttool.model.moe import IdentityExpert, MoE, Routing
from ckpttool.model.norms import RMSNorm
from ckpttool.model.parallel import ParallelContext

LORA_NORM_EPS = 1e-6
"""transformers builds q_a_layernorm and kv_a_layernorm with LongcatFlashRMSNorm's own default eps"""


@dataclass(kw_only=True, slots=True, frozen=True)
class LongcatFlashArgs(ConfigArgs):
    cfg: LongcatFlashConfig
    routing: Routing
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "LongcatFlashArgs":
        cfg = LongcatFlashConfig.from_dict(raw, source)
        if raw.get("quantization_config") is not None:
            raise InputError("ckpttool's longcat_flash model reads BF16/F16/F32 weights, and config.json declares a "
                             "quantization_config", file=source,
                             fix="convert with --dtype bf16 (dequantize) and verify that output")
        routing = Routing(experts=cfg.n_routed_experts, identity_experts=cfg.zero_expert_num, top_k=cfg.moe_topk,
                          scoring="softmax", correction_bias=True, scale=cfg.routed_scaling_factor)
        return cls(cfg=cfg, routing=routing, eos_token_ids=eos_ids(raw))


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] with rotary pairs (x0, x1), (x2, x3)..., cos/sin [S, D/2] -> the rotated evens, then
    the rotated odds (transformers' apply_rotary_pos_emb_interleave; q and k alike, so scores are unchanged)."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LoraScaledMLA(nn.Module):
    """MLA with the (scaled, rotated) latent cached: q_b_proj and kv_b_proj on this rank's heads, the low-rank
    projections and their norms replicated, o_proj summed over ranks."""

    def __init__(self, c: LongcatFlashConfig, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        h = c.hidden_size
        self.n_heads = ctx.split(c.num_attention_heads, "num_attention_heads")
        self.nope, self.rope, self.v_dim, self.rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.scale = c.qk_head_dim ** -0.5
        self.q_lora_scale, self.kv_lora_scale = (h / c.q_lora_rank) ** 0.5, (h / c.kv_lora_rank) ** 0.5
        bias = c.attention_bias  # q_a_proj and kv_a_proj_with_mqa replicated, o_proj's added after the sum
        self.q_a_proj = DenseLinear(h, c.q_lora_rank, dtype, False, bias)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, LORA_NORM_EPS, dtype)
        self.q_b_proj = DenseLinear(c.q_lora_rank, self.n_heads * c.qk_head_dim, dtype, False)
        self.kv_a_proj_with_mqa = DenseLinear(h, self.rank + self.rope, dtype, False, bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LORA_NORM_EPS, dtype)
        self.kv_b_proj = DenseLinear(self.rank, self.n_heads * (self.nope + self.v_dim), dtype, False)
        self.o_proj = DenseLinear(self.n_heads * self.v_dim, h, dtype, False, bias, row_ctx=ctx)

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.register_buffer("latent_cache", torch.zeros(batch, max_seq_len, self.rank + self.rope, dtype=dtype,
                                                         device=device), persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        end = start_pos + seqlen
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(bsz, seqlen, self.n_heads, -1)
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)  # [B, S, H, nope], [B, S, H, rope]
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent) * self.kv_lora_scale  # [B, S, C]
        q_pass, q_rot = q_pass * self.q_lora_scale, q_rot * self.q_lora_scale
        q_rot = rotate_pairs(q_rot, *rope)
        k_rot = rotate_pairs(k_rot[:, :, None, :], *rope)[:, :, 0]  # [B, S, rope], shared by every head
        self.latent_cache[:bsz, start_pos:end] = torch.cat([latent, k_rot], dim=-1)
        latent, k_rot = self.latent_cache[:bsz, :end].split([self.rank, self.rope], dim=-1)  # [B, T, C], [B, T, rope]
        k_nope, v = self.kv_b_proj(latent).view(bsz, end, self.n_heads, -1).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot[:, :, None, :].expand(-1, -1, self.n_heads, -1)], dim=-1)  # [B, T, H, qk]
        scores = torch.einsum("bshd,bthd->bhst", torch.cat([q_pass, q_rot], dim=-1), k) * self.scale + mask
        probs = scores.float().softmax(dim=-1).to(q.dtype)  # [B, H, S, T]
        out = torch.einsum("bhst,bthd->bshd", probs, v)
        return self.o_proj(out.reshape(bsz, seqlen, -1))


class LongcatLayer(nn.Module):
    """Two attention + MLP sublayers; the MoE reads the first sublayer's post-attention norm and its output
    joins the second sublayer's residual sum."""

    def __init__(self, args: LongcatFlashArgs, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        c = args.cfg
        h = c.hidden_size
        self.attention_norm = nn.ModuleList(RMSNorm(h, c.rms_norm_eps, dtype) for _ in range(2))
        self.ffn_norm = nn.ModuleList(RMSNorm(h, c.rms_norm_eps, dtype) for _ in range(2))
        self.attn = nn.ModuleList(LoraScaledMLA(c, ctx, dtype) for _ in range(2))
        self.mlps = nn.ModuleList(FeedForward(h, c.ffn_hidden_size, dtype, False, ctx=ctx) for _ in range(2))
        self.moe = MoE(args.routing, h, c.expert_ffn_hidden_size, ctx, dtype, False)

    def forward(self, x: torch.Tensor, start_pos: int, rope, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn[0](self.attention_norm[0](x), start_pos, rope, mask)
        h = self.ffn_norm[0](x)
        shortcut = self.moe(h)
        x = x + self.mlps[0](h)
        x = x + self.attn[1](self.attention_norm[1](x), start_pos, rope, mask)
        return x + self.mlps[1](self.ffn_norm[1](x)) + shortcut


class LongcatFlashTransformer(VocabParallelLM):
    """The layers between model/lm.py's embedding and head."""

    def __init__(self, args: LongcatFlashArgs, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16):
        c = args.cfg
        super().__init__(ctx, c.vocab_size, c.hidden_size, RMSNorm(c.hidden_size, c.rms_norm_eps, dtype), dtype,
                         tie_word_embeddings=c.tie_word_embeddings)
        self.args = args
        self.layers = nn.ModuleList(LongcatLayer(args, ctx, dtype) for _ in range(c.num_hidden_layers))
        d = c.qk_rope_head_dim
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def hold_unused_zero_expert_weights(self) -> None:
        """transformers' spelling (spec.py): this rank's zero experts hold the gate and up projections its
        save_pretrained writes for them; loaded and checked like any weight, never computed with."""
        c = self.args.cfg
        for layer in self.layers:
            for expert in layer.moe.experts.values():
                if isinstance(expert, IdentityExpert):
                    expert.w1 = DenseLinear(c.hidden_size, c.expert_ffn_hidden_size, self.dtype, False)
                    expert.w3 = DenseLinear(c.hidden_size, c.expert_ffn_hidden_size, self.dtype, False)

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        self.max_seq_len = max_seq_len
        for layer in self.layers:
            for attn in layer.attn:
                attn.setup_cache(batch, max_seq_len, self.dtype, self.tok_embeddings.weight.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, *, all_positions: bool = False) -> torch.Tensor:
        """tokens: [B, S] at positions start_pos.. -> float32 logits [B, V] (last position) or [B, S, V]."""
        end = self.positions(tokens, start_pos)
        h = self.tok_embeddings(tokens)
        angles = torch.arange(start_pos, end, dtype=torch.float32, device=h.device)[:, None] * self.inv_freq.to(h.device)
        rope = (angles.cos().to(h.dtype), angles.sin().to(h.dtype))  # [S, rope / 2]
        mask = causal_mask(start_pos, end, h)
        for layer in self.layers:
            h = layer(h, start_pos, rope, mask)
        return self.logits(h, all_positions)
