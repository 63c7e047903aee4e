"""The MLA transformer (DeepSeek V2/V3/V3.2, Kimi-K2, GLM-5, Mistral 4, Large 4: MLA + MoE) with tensor/expert
parallelism, for verify.

Parameter names are exactly those of the reference model.py, so `model{i}-mp{N}.safetensors` loads
into `Transformer(args, ParallelContext(i, N))` one to one. Shapes: B batch, S new tokens,
T cached positions, H local heads, E local experts.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ckpttool.errors import InputError
from ckpttool.families.deepseek.args import ModelArgs, yarn_mscale
from ckpttool.model.decoder import DenseLinear, FeedForward
from ckpttool.model.moe import MoE, Router, Routing
from ckpttool.model.norms import RMSNorm
from ckpttool.model.parallel import ColumnParallelLinear, Linear, ParallelContext, ParallelEmbedding

AttnImpl = Literal["absorb", "naive"]


# -- rotary embedding --------------------------------------------------------------------------------
def rope_frequencies(args: ModelArgs, max_seq_len: int, alpha: torch.Tensor | None = None) -> torch.Tensor:
    """complex64 [max_seq_len, rope_dim / 2]: e^(i * pos * inv_freq), times YaRN's attention factor; LeRoPE's
    learned `alpha` (Mistral Large 4) scales each frequency by exp(alpha) after YaRN, in float32."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    attention_factor = 1.0
    yarn = args.yarn
    if yarn is not None:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(yarn.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
        if yarn.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        # high-frequency dims keep their frequency (extrapolate), low-frequency dims are divided by factor
        inv_freq = inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)
        attention_factor = yarn.attention_factor
        if attention_factor is None:
            if yarn.mscale and yarn.mscale_all_dim:
                attention_factor = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
            else:
                attention_factor = yarn_mscale(yarn.factor)
    if alpha is not None:
        inv_freq = inv_freq * alpha.detach().float().cpu().exp()
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return torch.polar(torch.full_like(angles, attention_factor), angles)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x: [B, S, H, D], freqs: [S, D/2]. Pairs are (x0, x1), (x2, x3)... when interleaved, else
    (x_i, x_{i + D/2}). Output layout may differ from the input's, identically for q and k."""
    xf = x.float()
    half = x.shape[-1] // 2
    if interleave:
        xc = torch.view_as_complex(xf.reshape(*x.shape[:-1], half, 2).contiguous())
    else:
        xc = torch.complex(xf[..., :half].contiguous(), xf[..., half:].contiguous())
    y = xc * freqs.view(1, x.shape[1], 1, half)
    out = torch.view_as_real(y).flatten(-2) if interleave else torch.cat([y.real, y.imag], dim=-1)
    return out.to(x.dtype)


# -- attention ---------------------------------------------------------------------------------------
class Indexer(nn.Module):
    """DeepSeek-V3.2's sparse-attention indexer, replicated on every rank. verify loads and checks its
    weights but does not run it: it picks the index_topk best keys for each query, so for sequences no
    longer than index_topk (what verify generates; the model refuses longer ones) sparse attention
    attends to every key and equals the dense attention MLA computes."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype):
        super().__init__()
        if args.softmax_scaling:  # Mistral Large 4's: queries from the normalised hidden states, scaled per head
            self.q_norm = nn.LayerNorm(args.dim, eps=1e-6, dtype=dtype)
            self.q_norm.requires_grad_(False)
            self.softmax_scaling = SoftmaxScaling(args.index_n_heads, dtype)
        self.wq_b = Linear(args.q_lora_rank or args.dim, args.index_n_heads * args.index_head_dim, dtype, args.fp8)
        self.wk = Linear(args.dim, args.index_head_dim, dtype, args.fp8)
        self.k_norm = nn.LayerNorm(args.index_head_dim, eps=1e-6, dtype=dtype)
        self.k_norm.requires_grad_(False)
        self.weights_proj = Linear(args.dim, args.index_n_heads, dtype)


class SoftmaxScaling(nn.Module):
    """Mistral Large 4's learned query scaling, per head: q * (scale_h * log(pos + 1) + bias_h), computed in the
    query's dtype as transformers does."""

    def __init__(self, n_heads: int, dtype: torch.dtype):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(n_heads, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_heads, dtype=dtype), requires_grad=False)

    def forward(self, q: torch.Tensor, start_pos: int) -> torch.Tensor:
        """q: [B, S, H, D] at positions start_pos.."""
        pos = torch.arange(start_pos, start_pos + q.shape[1], device=q.device)
        log_pos, scale, bias = ((pos + 1).float().log().to(q.dtype), self.scale.to(q.dtype), self.bias.to(q.dtype))
        return q * (scale[None, :] * log_pos[:, None] + bias[None, :])[None, :, :, None]


class MLA(nn.Module):
    """Multi-head latent attention. `absorb` caches the normalised latent (kv_lora_rank per token) and
    folds wkv_b into q and the output; `naive` expands keys/values per head and caches those.
    Mistral Large 4: a NoPE layer rotates nothing (its whole qk head is "nope"), and a layer whose latent KV
    comes from an earlier layer (`kv_source`) holds no wkv_a / kv_norm and reads that layer's cache."""

    def __init__(self, args: ModelArgs, ctx: ParallelContext, dtype: torch.dtype, attn_impl: AttnImpl,
                 indexer: bool = False, layer: int = 0):
        super().__init__()
        self.args, self.attn_impl = args, attn_impl
        self.n_local_heads = ctx.split(args.n_heads, "num_attention_heads")
        self.rope_dim = args.qk_rope_head_dim if args.rotates(layer) else 0
        self.nope_dim = args.qk_head_dim - self.rope_dim
        self.shares_kv = args.kv_source(layer) != layer
        if self.shares_kv and attn_impl == "naive":
            raise InputError("verify's naive attention caches each layer's expanded keys and values, and this "
                             f"model's layer {layer} attends to layer {args.kv_source(layer)}'s latent instead",
                             fix="verify with --attn absorb")
        q_out, bias = args.n_heads * args.qk_head_dim, args.attention_bias
        if args.q_lora_rank == 0:
            self.wq = ColumnParallelLinear(ctx, args.dim, q_out, dtype, args.fp8)
        else:
            self.wq_a = DenseLinear(args.dim, args.q_lora_rank, dtype, args.fp8, bias)
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps, dtype)
            self.wq_b = ColumnParallelLinear(ctx, args.q_lora_rank, q_out, dtype, args.fp8)
        if not self.shares_kv:
            self.wkv_a = DenseLinear(args.dim, args.kv_lora_rank + self.rope_dim, dtype, args.fp8, bias)
            self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps, dtype)
        self.wkv_b = ColumnParallelLinear(ctx, args.kv_lora_rank, args.n_heads * (self.nope_dim + args.v_head_dim),
                                          dtype, args.fp8)
        self.wo = DenseLinear(ctx.split(args.n_heads * args.v_head_dim, "input features"), args.dim, dtype, args.fp8,
                              bias, row_ctx=ctx)
        self.softmax_scale = args.softmax_scale
        if args.softmax_scaling:
            self.softmax_scaling = SoftmaxScaling(self.n_local_heads, dtype)
        if indexer:
            self.indexer = Indexer(args, dtype)

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device,
                    source: "MLA | None" = None) -> None:
        """Allocate this layer's cache, or (a layer sharing latent KV) hold the source layer's own tensors."""
        a, h = self.args, self.n_local_heads
        if source is not None:
            shapes = {"kv_cache": source.kv_cache, "pe_cache": source.pe_cache}
        elif self.attn_impl == "naive":
            shapes = {"k_cache": (batch, max_seq_len, h, a.qk_head_dim), "v_cache": (batch, max_seq_len, h, a.v_head_dim)}
        else:
            shapes = {"kv_cache": (batch, max_seq_len, a.kv_lora_rank), "pe_cache": (batch, max_seq_len, self.rope_dim)}
        for name, shape in shapes.items():
            cache = shape if isinstance(shape, torch.Tensor) else torch.zeros(shape, dtype=dtype, device=device)
            self.register_buffer(name, cache, persistent=False)

    def forward(self, x: torch.Tensor, start_pos: int, freqs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        a = self.args
        bsz, seqlen, _ = x.shape
        end = start_pos + seqlen
        q = self.wq(x) if a.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bsz, seqlen, self.n_local_heads, a.qk_head_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        if self.rope_dim:
            q_pe = apply_rope(q_pe, freqs, a.rope_interleave)  # [B, S, H, rope]
        if a.softmax_scaling:
            q_nope, q_pe = self.softmax_scaling(q_nope, start_pos), self.softmax_scaling(q_pe, start_pos)
        if a.llama4_beta:  # Mistral 4: 1 + beta * log(1 + floor(pos / original)) on the whole rotated query
            pos = torch.arange(start_pos, end, device=x.device, dtype=torch.float32)
            scale = (1 + a.llama4_beta * torch.log(1 + torch.floor(pos / a.llama4_original))).to(q.dtype)
            q_nope, q_pe = q_nope * scale[:, None, None], q_pe * scale[:, None, None]
        if self.shares_kv:  # the source layer, earlier in this forward, has cached positions ..end already
            kv, k_pe = None, None
        else:
            kv, k_pe = self.wkv_a(x).split([a.kv_lora_rank, self.rope_dim], dim=-1)
            k_pe = k_pe.unsqueeze(2)  # [B, S, 1, rope], shared by heads
            if self.rope_dim:
                k_pe = apply_rope(k_pe, freqs, a.rope_interleave)
            kv = self.kv_norm(kv)  # [B, S, kv_lora_rank]

        if self.attn_impl == "naive":
            kv = self.wkv_b(kv).view(bsz, seqlen, self.n_local_heads, self.nope_dim + a.v_head_dim)
            k_nope, v = kv.split([self.nope_dim, a.v_head_dim], dim=-1)
            self.k_cache[:bsz, start_pos:end] = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_local_heads, -1)], -1)
            self.v_cache[:bsz, start_pos:end] = v
            q = torch.cat([q_nope, q_pe], dim=-1)
            scores = torch.einsum("bshd,bthd->bsht", q, self.k_cache[:bsz, :end])
        else:
            wkv_b = self.wkv_b.dense_weight().view(self.n_local_heads, -1, a.kv_lora_rank)  # [H, nope + v, c]
            q_latent = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, : self.nope_dim])
            if kv is not None:
                self.kv_cache[:bsz, start_pos:end] = kv
                self.pe_cache[:bsz, start_pos:end] = k_pe.squeeze(2)
            scores = (torch.einsum("bshc,btc->bsht", q_latent, self.kv_cache[:bsz, :end])
                      + torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end]))
        scores = scores * self.softmax_scale  # [B, S, H, T]
        if mask is not None:
            scores = scores + mask.unsqueeze(1)
        probs = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        if self.attn_impl == "naive":
            out = torch.einsum("bsht,bthd->bshd", probs, self.v_cache[:bsz, :end])
        else:
            out = torch.einsum("bsht,btc->bshc", probs, self.kv_cache[:bsz, :end])
            out = torch.einsum("bshc,hdc->bshd", out, wkv_b[:, -a.v_head_dim:])
        return self.wo(out.flatten(2))  # [B, S, dim], summed over ranks


# -- feed-forward ------------------------------------------------------------------------------------
def routing(args: ModelArgs) -> Routing:
    """The router of ModelArgs: V2's softmax greedy or group-limited (max) top-k, V3's noaux_tc (sigmoid,
    correction bias, top-2-sum groups)."""
    return Routing(experts=args.n_routed_experts, top_k=args.n_activated_experts, scoring=args.score_func,
                   correction_bias=args.correction_bias, groups=args.n_expert_groups,
                   topk_groups=args.n_limited_groups, group_score="max" if args.group_score == "max" else "top2_sum",
                   normalize=args.norm_topk_prob, scale=args.route_scale)


# -- the model ---------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, layer: int, args: ModelArgs, ctx: ParallelContext, dtype: torch.dtype, attn_impl: AttnImpl):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.attn = MLA(args, ctx, dtype, attn_impl, indexer=bool(args.indexer_layers and args.indexer_layers[layer]),
                        layer=layer)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, dtype)
        self.ffn = (MoE(routing(args), args.dim, args.moe_inter_dim, ctx, dtype, args.fp8,
                        shared_inter=args.n_shared_experts * args.moe_inter_dim) if args.moe_layers[layer]
                    else FeedForward(args.dim, args.inter_dim, dtype, args.fp8, ctx=ctx))
        if args.fp32_router and args.moe_layers[layer]:  # transformers keeps it in float32 (Mistral Large 4)
            self.ffn.gate = Router(routing(args), args.dim, torch.float32)

    def forward(self, x: torch.Tensor, start_pos: int, freqs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), start_pos, freqs, mask)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """Embedding, blocks, final norm and a vocabulary-parallel head whose slices are all-gathered."""

    def __init__(self, args: ModelArgs, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16,
                 attn_impl: AttnImpl = "absorb"):
        super().__init__()
        self.args, self.ctx, self.dtype = args, ctx, dtype
        self.embed = ParallelEmbedding(ctx, args.vocab_size, args.dim, dtype)
        self.layers = nn.ModuleList(Block(i, args, ctx, dtype, attn_impl) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, dtype)
        if args.lerope:  # learned rotary frequencies, float32 as transformers keeps them
            self.rope_alpha = nn.Parameter(torch.empty(args.qk_rope_head_dim // 2, dtype=torch.float32),
                                           requires_grad=False)
        if not args.tie_word_embeddings:  # tied: each rank's embedding rows are its vocabulary slice of the head
            self.head = ColumnParallelLinear(ctx, args.dim, args.vocab_size, dtype, what="vocab_size")
        self.max_seq_len = 0

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        """Allocate KV caches and rope frequencies; call after loading weights, before forward."""
        device = self.embed.weight.device
        if self.args.index_topk and max_seq_len > self.args.index_topk:
            raise InputError(f"{max_seq_len} positions exceed DeepSeek-V3.2's index_topk ({self.args.index_topk}): "
                             "verify's model runs dense attention, equal to the sparse one only up to index_topk",
                             fix=f"verify with a prompt plus --max-new-tokens of at most {self.args.index_topk} tokens")
        self.max_seq_len = max_seq_len
        alpha = self.rope_alpha if self.args.lerope else None
        self.register_buffer("freqs", rope_frequencies(self.args, max_seq_len, alpha).to(device), persistent=False)
        for i, block in enumerate(self.layers):
            source = self.args.kv_source(i)
            block.attn.setup_cache(batch, max_seq_len, self.dtype, device,
                                   source=self.layers[source].attn if source != i else None)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, *, all_positions: bool = False) -> torch.Tensor:
        """tokens: [B, S] at positions start_pos.. -> float32 logits [B, V] for the last position,
        or [B, S, V] for every position."""
        seqlen = tokens.shape[1]
        end = start_pos + seqlen
        if end > self.max_seq_len:
            raise ValueError(f"position {end} exceeds the cache of {self.max_seq_len}; call setup_caches")
        h = self.embed(tokens)
        freqs = self.freqs[start_pos:end]
        mask = None
        if seqlen > 1:  # new token i (absolute start_pos + i) sees cached positions t <= start_pos + i
            mask = torch.full((seqlen, end), float("-inf"), device=tokens.device).triu_(start_pos + 1)
        for block in self.layers:
            h = block(h, start_pos, freqs, mask)
        h = self.norm(h)
        if not all_positions:
            h = h[:, -1]
        logits = F.linear(h, self.embed.weight) if self.args.tie_word_embeddings else self.head(h)
        logits = self.ctx.all_gather_last_dim(logits)
        if cap := self.args.logit_softcapping:  # Mistral Large 4: in the model's dtype, as transformers does
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
