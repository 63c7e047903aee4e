"""DeepSeek-V4 transformer for verify: hyper-connected blocks (attention.py), hash-routed then top-k
experts with a shared expert, and the MTP layers left out (their tensors are skipped, as V3's are).

Parameter names are the mp names (DeepSeek's, spec.py), so `model{i}-mp{N}.safetensors` loads into
`Transformer(cfg, ParallelContext(i, N))` one to one. Numerics follow transformers 5.24's
DeepseekV4ForCausalLM, the oracle of the tests; the cuts follow DeepSeek's model: the router and the
shared expert are whole on every rank, each rank runs its range of experts and the routed sums are
all-reduced. What runs differently is said in attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ckpttool.families.deepseek_v4.attention import Attention, RMSNorm, param, rope_table, unweighted_rms
from ckpttool.families.deepseek_v4.config import DeepseekV4Config
from ckpttool.model.parallel import ColumnParallelLinear, Linear, ParallelContext, ParallelEmbedding


# -- hyper-connections -------------------------------------------------------------------------------
def hc_weights(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: DeepseekV4Config
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the hc_mult streams h [B, S, N, dim]: `pre` [B, S, N] (how they collapse into a block's
    input), `post` [B, S, N] (how its output expands) and `comb` [B, S, N, N] (how the streams mix),
    made doubly stochastic by Sinkhorn iterations. float32, as transformers computes them."""
    n = cfg.hc_mult
    mixes = F.linear(unweighted_rms(h.flatten(2).float(), cfg.rms_norm_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_s, post_s, comb_s = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + cfg.hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
    return pre, post, comb


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)


def expand(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Streams after a block: its output weighted into each stream, plus the streams mixed by comb."""
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)


# -- mixture of experts ------------------------------------------------------------------------------
class Gate(nn.Module):
    """Scores sqrt(softplus) (or sigmoid) of the logits. Top-k layers choose by scores + `bias`; hash
    layers take `tid2eid[token]`. Weights are the chosen scores, normalised, times routed_scaling_factor."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.scoring, self.scale = cfg.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor
        self.weight = param(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype)
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long),
                                        requires_grad=False)
        else:
            self.bias = param(cfg.n_routed_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # [N, experts]
        scores = F.softplus(logits).sqrt() if self.scoring == "sqrtsoftplus" else logits.sigmoid()
        if hasattr(self, "tid2eid"):
            indices = self.tid2eid[ids]
        else:
            indices = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale, indices


class Expert(nn.Module):
    """SwiGLU with swiglu_limit: the up branch clamped on both sides, the gate branch from above."""

    def __init__(self, dim: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.w1, self.w2, self.w3 = Linear(dim, inter, dtype), Linear(inter, dim, dtype), Linear(dim, inter, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, hashed: bool, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.ctx = ctx
        n_local = ctx.split(cfg.n_routed_experts, "n_routed_experts")
        d, inter, limit = cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit
        self.gate = Gate(cfg, hashed, dtype)
        self.experts = nn.ModuleDict({str(e): Expert(d, inter, limit, dtype)
                                      for e in range(ctx.rank * n_local, (ctx.rank + 1) * n_local)})
        self.shared_experts = Expert(d, inter, limit, dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat, ids.reshape(-1))
        y = torch.zeros_like(flat)
        for name, expert in self.experts.items():
            token, slot = torch.where(indices == int(name))
            if token.numel():
                y.index_add_(0, token, (expert(flat[token]) * weights[token, slot, None]).to(y.dtype))
        return (self.ctx.all_reduce(y) + self.shared_experts(flat)).view_as(x)


# -- the model ---------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, layer: int, cfg: DeepseekV4Config, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, cfg.layer_type(layer), ctx, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.ffn = MoE(cfg, cfg.is_hash(layer), ctx, dtype)
        mix, width = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.hidden_size
        for part in ("attn", "ffn"):  # the streams' mixing weights around each sub-block
            self.register_parameter(f"hc_{part}_fn", param(mix, width, dtype=dtype))
            self.register_parameter(f"hc_{part}_base", param(mix, dtype=dtype))
            self.register_parameter(f"hc_{part}_scale", param(3, dtype=dtype))

    def forward(self, h: torch.Tensor, ids: torch.Tensor, start_pos: int, ropes: dict) -> torch.Tensor:
        """h: [B, S, hc_mult, dim] streams."""
        pre, post, comb = hc_weights(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)
        h = expand(h, self.attn(self.attn_norm(collapse(h, pre)), start_pos, ropes), post, comb)
        pre, post, comb = hc_weights(h, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg)
        return expand(h, self.ffn(self.ffn_norm(collapse(h, pre)), ids), post, comb)


class Transformer(nn.Module):
    """Embedding copied into hc_mult streams, blocks, the streams collapsed by `hc_head_*`, final norm
    and a vocabulary-parallel head whose slices are all-gathered."""

    def __init__(self, cfg: DeepseekV4Config, ctx: ParallelContext, *, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.cfg, self.ctx, self.dtype = cfg, ctx, dtype
        d, n = cfg.hidden_size, cfg.hc_mult
        self.embed = ParallelEmbedding(ctx, cfg.vocab_size, d, dtype)
        self.layers = nn.ModuleList(Block(i, cfg, ctx, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.head = ColumnParallelLinear(ctx, d, cfg.vocab_size, dtype, what="vocab_size")
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = param(n, n * d, dtype=dtype), param(n, dtype=dtype), \
            param(1, dtype=dtype)
        self.max_seq_len = 0

    def setup_caches(self, batch: int, max_seq_len: int) -> None:
        """Allocate KV and compressor caches and rope tables; call after loading weights, before forward."""
        device = self.embed.weight.device
        self.max_seq_len = max_seq_len
        self.ropes = {name: tuple(t.to(device) for t in rope_table(rope, max_seq_len))
                      for name, rope in (("main", self.cfg.main_rope), ("compress", self.cfg.compress_rope))}
        for block in self.layers:
            block.attn.setup_cache(batch, max_seq_len, self.dtype, device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int = 0, *, all_positions: bool = False) -> torch.Tensor:
        """tokens: [B, S] at positions start_pos.. -> float32 logits [B, V] for the last position,
        or [B, S, V] for every position."""
        if start_pos + tokens.shape[1] > self.max_seq_len:
            raise ValueError(f"position {start_pos + tokens.shape[1]} exceeds the cache of {self.max_seq_len}; "
                             "call setup_caches")
        x = self.embed(tokens)
        ropes = {name: (cos.to(x.dtype), sin.to(x.dtype)) for name, (cos, sin) in self.ropes.items()}
        h = x.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1).contiguous()
        for block in self.layers:
            h = block(h, tokens, start_pos, ropes)
        flat = unweighted_rms(h.flatten(2).float(), self.cfg.rms_norm_eps)
        mixes = F.linear(flat, self.hc_head_fn.float())
        pre = torch.sigmoid(mixes * self.hc_head_scale.float() + self.hc_head_base.float()) + self.cfg.hc_eps
        h = self.norm(collapse(h, pre))
        if not all_positions:
            h = h[:, -1]
        return self.ctx.all_gather_last_dim(self.head(h)).float()
