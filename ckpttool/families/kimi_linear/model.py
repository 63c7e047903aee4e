"""Kimi-Linear for verify, numerics as transformers' torch code computes them: KDA layers (the gated delta rule
with a decay per key channel, model/delta.py), MLA layers without rotary (transformers' KimiLinearAttention:
the latent's rope part is shared by every head and never rotated), DeepSeek-V3 routing over routed and shared
experts (model/moe.py), Llama RMSNorms.

Parameter names are the mp names of families/kimi_linear/spec.py. Shapes: B batch, S new tokens, T cached
positions, H local heads, D a KDA head's dim, C the latent (kv_lora_rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ckpttool.errors import InputError
from ckpttool.families.base import ConfigArgs, eos_ids
from ckpttool.families.kimi_linear.spec import KimiLinearConfig
from ckpttool.model.decoder import DenseLinear, FeedForward
from ckpttool.model.delta import ShortConv, delta_rule, l2norm
from ckpttool.model.lm import VocabParallelLM, causal_mask
from ckpttool.model.moe import MoE, Routing
from ckpttool.model.norms import GatedRMSNorm, RMSNorm
from ckpttool.model.parallel import ParallelContext

LATENT_NORM_EPS = 1e-6
"""transformers builds MLA's kv_a_layernorm with KimiLinearRMSNorm's own default eps, not rms_norm_eps"""


@dataclass(kw_only=True, slots=True, frozen=True)
class KimiLinearArgs(ConfigArgs):
    cfg: KimiLinearConfig
    routing: Routing
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, raw: dict, source: object = "config.json") -> "KimiLinearArgs":
        cfg = KimiLinearConfig.from_dict(raw, source)
        if raw.get("quantization_config") is not None:
            raise InputError("ckpttool's kimi_linear model reads BF16/F16/F32 weights, and config.json declares a "
                             "quantization_config", file=source,
                             fix="convert with --dtype bf16 (dequantize) and verify that output")
        routing = Routing(experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
                          correction_bias=True, groups=cfg.n_group, topk_groups=cfg.topk_group,
                          normalize=cfg.norm_topk_prob, scale=cfg.routed_scaling_factor)
        return cls(cfg=cfg, routing=routing, eos_token_ids=eos_ids(raw))


class LatentAttention(nn.Module):
    """MLA with the latent cached: q_proj and kv_b_proj on this rank's heads, the latent replicated."""

    def __init__(self, c: KimiLinearConfig, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        h = c.hidden_size
        self.n_heads = ctx.split(c.num_attention_heads, "num_attention_heads")
        self.nope, self.rope, self.v_dim, self.rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        self.scale = c.head_dim ** -0.5
        self.q_proj = DenseLinear(h, self.n_heads * c.head_dim, dtype, False)
        self.kv_a_proj_with_mqa = DenseLinear(h, self.rank + self.rope, dtype, False)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = DenseLinear(self.rank, self.n_heads * (self.nope + self.v_dim), dtype, False)
        self.o_proj = DenseLinear(self.n_heads * self.v_dim, h, dtype, False, row_ctx=ctx)

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.register_buffer("latent_cache", torch.zeros(batch, max_seq_len, self.rank + self.rope, dtype=dtype,
                                                         device=device), persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int, mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        end = start_pos + seqlen
        q = self.q_proj(x).view(bsz, seqlen, self.n_heads, self.nope + self.rope)  # [B, S, H, nope + rope]
        latent, k_shared = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        self.latent_cache[:bsz, start_pos:end] = torch.cat([self.kv_a_layernorm(latent), k_shared], dim=-1)
        latent, k_shared = self.latent_cache[:bsz, :end].split([self.rank, self.rope], dim=-1)  # [B, T, C], [B, T, rope]
        k_nope, v = self.kv_b_proj(latent).view(bsz, end, self.n_heads, -1).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_shared[:, :, None, :].expand(-1, -1, self.n_heads, -1)], dim=-1)  # [B, T, H, nope + rope]
        scores = torch.einsum("bshd,bthd->bhst", q, k) * self.scale + mask  # [B, H, S, T]
        probs = scores.float().softmax(dim=-1).to(q.dtype)
        out = torch.einsum("bhst,bthd->bshd", probs, v)
        return self.o_proj(out.reshape(bsz, seqlen, -1))


class DeltaAttention(nn.Module):
    """KDA over this rank's heads: q/k/v with their short convs, a per-channel forget gate (low rank, then
    softplus), beta, the delta rule with its state, a sigmoid-gated norm, and o_proj summed over ranks."""

    def __init__(self, c: KimiLinearConfig, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        h, d = c.hidden_size, c.linear_head_dim
        n = self.n_heads = ctx.split(c.linear_num_heads, "linear_num_heads")
        self.head_dim = d
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(self, name, DenseLinear(h, n * d, dtype, False))
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(self, name, ShortConv(n * d, c.linear_conv_kernel_dim, dtype))
        self.f_a_proj, self.f_b_proj = DenseLinear(h, d, dtype, False), DenseLinear(d, n * d, dtype, False)
        self.g_a_proj, self.g_b_proj = DenseLinear(h, d, dtype, False), DenseLinear(d, n * d, dtype, False)
        self.b_proj = DenseLinear(h, n, dtype, False)
        self.dt_bias = nn.Parameter(torch.empty(n * d, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(1, 1, n, 1, dtype=dtype), requires_grad=False)
        self.o_norm = GatedRMSNorm(d, c.rms_norm_eps, dtype, gate="sigmoid", float_weight=True)
        self.o_proj = DenseLinear(n * d, h, dtype, False, row_ctx=ctx)

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        for conv in (self.q_conv1d, self.k_conv1d, self.v_conv1d):
            conv.setup_cache(batch, device)
        self.register_buffer("state", torch.zeros(batch, self.n_heads, self.head_dim, self.head_dim,
                                                  dtype=torch.float32, device=device), persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int, mask: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        heads = (bsz, seqlen, self.n_heads, self.head_dim)
        q = self.q_conv1d(self.q_proj(x)).view(heads)
        k = self.k_conv1d(self.k_proj(x)).view(heads)
        v = self.v_conv1d(self.v_proj(x)).view(heads)
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(heads)
        g = -self.A_log.float().exp() * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))  # softplus as theirs
        beta = torch.sigmoid(self.b_proj(x))
        q, k = (l2norm(t.float(), divide=True) for t in (q, k))
        out = delta_rule(q * self.head_dim ** -0.5, k, v.float(), g, beta.float(), self.state).to(x.dtype)
        out = self.o_norm(out, self.g_b_proj(self.g_a_proj(x)).view(heads))
        return self.o_proj(out.reshape(bsz, seqlen, -1))


class KimiLayer(nn.Module):
    def __init__(self, args: KimiLinearArgs, layer: int, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        c = args.cfg
        self.attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        kind = DeltaAttention if c.layer_types[layer] == "linear_attention" else LatentAttention
        self.attn = kind(c, ctx, dtype)
        if c.is_moe_layer(layer):
            self.feed_forward = MoE(args.routing, c.hidden_size, c.moe_intermediate_size, ctx, dtype, False,
                                    shared_inter=c.moe_intermediate_size * c.n_shared_experts)
        else:
            self.feed_forward = FeedForward(c.hidden_size, c.intermediate_size, dtype, False, ctx=ctx)

    def forward(self, x: torch.Tensor, start_pos: int, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attention_norm(x), start_pos, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class KimiLinearTransformer(VocabParallelLM):
    """The layers between model/lm.py's embedding and head."""

    def __init__(self, args: KimiLinearArgs, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16):
        c = args.cfg
        super().__init__(ctx, c.vocab_size, c.hidden_size, RMSNorm(c.hidden_size, c.rms_norm_eps, dtype), dtype,
                         tie_word_embeddings=c.tie_word_embeddings)
        self.args = args
        self.layers = nn.ModuleList(KimiLayer(args, i, ctx, dtype) for i in range(c.num_hidden_layers))

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        """Latent caches and zeroed conv and recurrent states: a new sequence starts here."""
        self.max_seq_len = max_seq_len
        for layer in self.layers:
            layer.attn.setup_cache(batch, max_seq_len, self.dtype, self.tok_embeddings.weight.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, *, all_positions: bool = False) -> torch.Tensor:
        """tokens: [B, S] at positions start_pos.. -> float32 logits [B, V] (last position) or [B, S, V]."""
        end = self.positions(tokens, start_pos)
        h = self.tok_embeddings(tokens)
        mask = causal_mask(start_pos, end, h)
        for layer in self.layers:
            h = layer(h, start_pos, mask)
        return self.logits(h, all_positions)
