"""DeepSeek-V4 attention for the bundled model: one shared KV head (K = V) with per-head sinks over a
sliding window, plus, per layer type, compressed KV entries (HCA: one per `rate` tokens; CSA: windows
overlapping by one, of which the indexer keeps `index_topk` per query), and the grouped low-rank output
projection. Numerics follow transformers 5.24's DeepseekV4Attention (the oracle of the tests); the
tensor cuts follow DeepSeek's model (spec.py). Shapes: B batch, S new tokens, T cached positions,
C compressed entries, H local heads, D head dim.

What this model runs differently from both, and where that stops mattering:
- the sliding window is a mask over a cache of every position, not a ring of `sliding_window` slots;
- each compressed entry is computed once, when its window is complete, from cached projections of
  every token, instead of from running buffers (transformers' cache, DeepSeek's kv_state): the same
  arithmetic on the same rows;
- the indexer's top-k is taken over the entries made so far (transformers' one-shot forward takes it
  over every entry of the sequence, the later ones masked), each query's scores summed over the ranks'
  heads (all-reduced) before the choice.
Where that stops holding: the indexer's scores are sums of relu(q . k), so two entries whose every
head is clipped to zero tie exactly, and then torch's topk picks by position in a tensor whose length
differs between the two forms (and between one-shot forwards of different lengths in transformers
itself: DeepSeek's model is no different). Such a tie at the top-k boundary changes which entries a
query reads; the tests' models have 8 indexer heads, where it did not happen, and with 4 it did.
Scores within float rounding of each other may likewise pick differently at different mp.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ckpttool.families.deepseek_v4.config import CSA, HCA, DeepseekV4Config, RopeSpec
from ckpttool.model.parallel import ColumnParallelLinear, Linear, ParallelContext, RowParallelLinear


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """V4's norm: normalise in float32, scale in float32, cast once (its norm weights are float32)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


# -- rotary embeddings -------------------------------------------------------------------------------
def rope_table(rope: RopeSpec, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin [max_seq_len, dim / 2] of one rope, YaRN-scaled as transformers computes it
    (its truncated correction range; cos/sin times the attention factor)."""
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq, attention = 1.0 / pos_freqs, 1.0
    if rope.yarn is not None:
        factor, original, beta_fast, beta_slow, attention = rope.yarn

        def correction_dim(rotations: float) -> float:
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(math.floor(correction_dim(beta_fast)), 0), min(math.ceil(correction_dim(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + inv_freq * extrapolation
    angles = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos() * attention, angles.sin() * attention


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing `2 * cos.shape[-1]` dims of x in adjacent pairs (DeepSeek's interleaved
    rope, transformers' formula). x: [B, S, (H,) D]; cos, sin: [S, dim / 2] in x's dtype."""
    if x.dim() == 4:
        cos, sin = cos[:, None], sin[:, None]
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    nope, rope = x[..., :-cos.shape[-1]], x[..., -cos.shape[-1]:]
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope.float() * cos + rotated.float() * sin).to(x.dtype)], dim=-1)


# -- compressed KV -----------------------------------------------------------------------------------
class Compressor(nn.Module):
    """One compressed entry per `rate` tokens: the softmax-gated (`wgate` + `ape`) sum of their `wkv`
    rows, normed, rotated at the window's first position. Overlapping (CSA): entry w gates the first
    half of window w-1's rows together with the second half of window w's (2 * rate slots)."""

    def __init__(self, dim: int, head_dim: int, rate: int, overlap: bool, eps: float, dtype: torch.dtype):
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.rate, self.overlap = head_dim, rate, overlap
        self.wkv = Linear(dim, width, dtype)
        self.wgate = Linear(dim, width, dtype)
        self.ape = param(rate, width, dtype=dtype)
        self.norm = RMSNorm(head_dim, eps, dtype)

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        width = self.wkv.weight.shape[0]
        for name, shape in (("kv_rows", (batch, max_seq_len, width)), ("gate_rows", (batch, max_seq_len, width)),
                            ("entries", (batch, max_seq_len // self.rate, self.head_dim))):
            self.register_buffer(name, torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.n_entries = 0

    def forward(self, x: torch.Tensor, start_pos: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Cache this call's rows, make every entry whose window is now complete; all entries [B, C, D].
        cos/sin: the compress rope's table (in x's dtype), indexed by absolute position."""
        bsz, seqlen, _ = x.shape
        end, rate, d = start_pos + seqlen, self.rate, self.head_dim
        self.kv_rows[:bsz, start_pos:end] = self.wkv(x)
        self.gate_rows[:bsz, start_pos:end] = self.wgate(x)
        done, ready = self.n_entries, end // rate
        if ready > done:
            first = max(done - 1, 0) if self.overlap else done  # overlapping: the previous window too
            kv = self.kv_rows[:bsz, first * rate:ready * rate].view(bsz, ready - first, rate, -1)
            gate = self.gate_rows[:bsz, first * rate:ready * rate].view(bsz, ready - first, rate, -1) + self.ape
            if self.overlap:
                if done == 0:  # window 0 has no predecessor: empty slots (zero, gated -inf)
                    kv = torch.cat([torch.zeros_like(kv[:, :1]), kv], dim=1)
                    gate = torch.cat([torch.full_like(gate[:, :1], float("-inf")), gate], dim=1)
                # [B, W, 2 * rate, D]: window w-1's first half, then window w's second half
                kv = torch.cat([kv[:, :-1, :, :d], kv[:, 1:, :, d:]], dim=2)
                gate = torch.cat([gate[:, :-1, :, :d], gate[:, 1:, :, d:]], dim=2)
            pooled = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
            positions = torch.arange(done, ready, device=x.device) * rate
            self.entries[:bsz, done:ready] = apply_rope(pooled, cos[positions], sin[positions])
            self.n_entries = ready
        return self.entries[:bsz, :ready]


def visible_entries(start_pos: int, seqlen: int, n_entries: int, rate: int, device: torch.device) -> torch.Tensor:
    """[S, C] bool: query at position p sees entry c once its window is complete, c < (p + 1) // rate."""
    p = torch.arange(start_pos, start_pos + seqlen, device=device)[:, None]
    return torch.arange(n_entries, device=device)[None, :] < (p + 1) // rate


class Indexer(nn.Module):
    """CSA's lightning indexer: its own overlapping compressor at index_head_dim, queries from the
    q-LoRA latent, scores sum_h w_h * relu(q_h . k) over this rank's heads (all-reduced), and each query
    keeps its index_topk best visible entries."""

    def __init__(self, cfg: DeepseekV4Config, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.ctx, self.topk, self.n_heads = ctx, cfg.index_topk, cfg.index_n_heads
        self.head_dim, self.rate = cfg.index_head_dim, cfg.compress_rates[CSA]
        self.n_local_heads = ctx.split(cfg.index_n_heads, "index_n_heads")
        self.wq_b = ColumnParallelLinear(ctx, cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, dtype,
                                         what="index_n_heads")
        self.weights_proj = ColumnParallelLinear(ctx, cfg.hidden_size, cfg.index_n_heads, dtype, what="index_n_heads")
        self.compressor = Compressor(cfg.hidden_size, cfg.index_head_dim, self.rate, True, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, start_pos: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """[B, S, C] bool: the entries each query attends to."""
        bsz, seqlen, _ = x.shape
        keys = self.compressor(x, start_pos, cos, sin)  # [B, C, D]
        positions = slice(start_pos, start_pos + seqlen)
        q = apply_rope(self.wq_b(qr).view(bsz, seqlen, self.n_local_heads, self.head_dim), cos[positions], sin[positions])
        scores = torch.einsum("bshd,bcd->bshc", q.float(), keys.float()).relu() * self.head_dim ** -0.5
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5  # [B, S, H]
        scores = self.ctx.all_reduce((scores * weights.unsqueeze(-1)).sum(dim=2))  # [B, S, C]
        visible = visible_entries(start_pos, seqlen, keys.shape[1], self.rate, x.device)
        chosen = scores.masked_fill(~visible, float("-inf")).topk(min(self.topk, keys.shape[1]), dim=-1).indices
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
        return keep & visible


# -- attention ---------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Query heads (wq_b, attn_sink) and output groups (wo_a) cut across ranks; wo_b reduces their
    partial sums. The KV head, the compressors and the indexer's compressor are whole on every rank."""

    def __init__(self, cfg: DeepseekV4Config, kind: str, ctx: ParallelContext, dtype: torch.dtype):
        super().__init__()
        d, hd, eps = cfg.hidden_size, cfg.head_dim, cfg.rms_norm_eps
        self.kind, self.head_dim, self.eps, self.window = kind, hd, eps, cfg.sliding_window
        self.n_local_heads = ctx.split(cfg.num_attention_heads, "num_attention_heads")
        self.n_local_groups = ctx.split(cfg.o_groups, "o_groups")
        self.o_lora_rank = cfg.o_lora_rank
        self.wq_a = Linear(d, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps, dtype)
        self.wq_b = ColumnParallelLinear(ctx, cfg.q_lora_rank, cfg.num_attention_heads * hd, dtype,
                                         what="num_attention_heads")
        self.wkv = Linear(d, hd, dtype)
        self.kv_norm = RMSNorm(hd, eps, dtype)
        self.wo_a = ColumnParallelLinear(ctx, cfg.num_attention_heads * hd // cfg.o_groups,
                                         cfg.o_groups * cfg.o_lora_rank, dtype, what="o_groups")
        self.wo_b = RowParallelLinear(ctx, cfg.o_groups * cfg.o_lora_rank, d, dtype, what="o_groups")
        self.attn_sink = param(self.n_local_heads, dtype=dtype)
        if kind in (CSA, HCA):
            self.compressor = Compressor(d, hd, cfg.compress_rates[kind], kind == CSA, eps, dtype)
        if kind == CSA:
            self.indexer = Indexer(cfg, ctx, dtype)

    def setup_cache(self, batch: int, max_seq_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.register_buffer("kv_cache", torch.zeros(batch, max_seq_len, self.head_dim, dtype=dtype, device=device),
                             persistent=False)
        for part in (getattr(self, "compressor", None), getattr(getattr(self, "indexer", None), "compressor", None)):
            if part is not None:
                part.setup_cache(batch, max_seq_len, dtype, device)

    def forward(self, x: torch.Tensor, start_pos: int, ropes: dict[str, tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        end = start_pos + seqlen
        cos, sin = ropes["main" if self.kind not in (CSA, HCA) else "compress"]
        here = slice(start_pos, end)
        qr = self.q_norm(self.wq_a(x))
        q = unweighted_rms(self.wq_b(qr).view(bsz, seqlen, self.n_local_heads, self.head_dim), self.eps)
        q = apply_rope(q, cos[here], sin[here])  # [B, S, H, D]
        self.kv_cache[:bsz, start_pos:end] = apply_rope(self.kv_norm(self.wkv(x)), cos[here], sin[here])
        keys = self.kv_cache[:bsz, :end]  # [B, T, D]; K = V
        p = torch.arange(start_pos, end, device=x.device)[:, None]
        t = torch.arange(end, device=x.device)[None, :]
        visible = ((t <= p) & (t > p - self.window)).expand(bsz, -1, -1)  # [B, S, T]
        if self.kind in (CSA, HCA):
            entries = self.compressor(x, start_pos, cos, sin)  # [B, C, D]
            seen = visible_entries(start_pos, seqlen, entries.shape[1], self.compressor.rate, x.device)
            seen = self.indexer(x, qr, start_pos, cos, sin) & seen if self.kind == CSA else seen.expand(bsz, -1, -1)
            keys, visible = torch.cat([keys, entries], dim=1), torch.cat([visible, seen], dim=-1)
        scores = torch.einsum("bshd,btd->bhst", q, keys) * self.head_dim ** -0.5  # [B, H, S, T + C]
        scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
        sinks = self.attn_sink.to(scores.dtype).view(1, -1, 1, 1).expand(bsz, -1, seqlen, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]  # the sink column dropped
        out = torch.einsum("bhst,btd->bshd", probs.to(keys.dtype), keys)
        out = apply_rope(out, cos[here], -sin[here])  # undo the rotation V took on as K
        grouped = out.reshape(bsz, seqlen, self.n_local_groups, -1)
        wo_a = self.wo_a.dense_weight().view(self.n_local_groups, self.o_lora_rank, -1)
        return self.wo_b(torch.einsum("bsgi,gri->bsgr", grouped, wo_a).flatten(2))  # summed over ranks
