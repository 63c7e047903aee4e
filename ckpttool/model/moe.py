"""Routed experts as the MoE families compute them: a router (softmax or sigmoid scores, an optional
correction bias and group limit for the choice, top-k, weights from the unbiased scores), whole experts
on the rank owning a contiguous range (expert parallel, partial sums all-reduced), and optional shared
experts (tensor parallel) with an optional sigmoid gate (Qwen2-MoE); experts and shared experts take the
clamped gpt-oss activation where `swiglu` says so (MiniMax-M3). Identity ("zero") experts (LongCat-Flash) follow
the routed ones in the router's width and in the ranges ranks own; each adds its tokens, weighted.

Parameter names: `gate.weight` (router), `gate.bias` (correction bias), `experts.{e}.w1/w2/w3` with the
global expert index, `shared_experts.w1/w2/w3`, `shared_expert_gate.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ckpttool.model.decoder import FeedForward
from ckpttool.model.parallel import Linear, ParallelContext


@dataclass(frozen=True, slots=True, kw_only=True)
class Routing:
    experts: int
    top_k: int
    scoring: str = "softmax"  # or "sigmoid"
    correction_bias: bool = False
    correction_bias_rows: bool = False  # stored [1, experts] (ERNIE's moe_statics)
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "top2_sum"  # or "max" (DeepSeek-V2's group_limited_greedy)
    normalize: bool = False
    scale: float = 1.0
    identity_experts: int = 0  # zero experts after the routed ones: no weights, output = input


class IdentityExpert(nn.Module):
    """A zero expert: the token itself (its routing weight is applied by MoE, as for any expert)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Router(nn.Module):
    """Scores in float32; the choice adds the correction bias and masks all but the best groups."""

    def __init__(self, r: Routing, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.r = r
        width = r.experts + r.identity_experts
        self.weight = nn.Parameter(torch.empty(width, hidden, dtype=dtype), requires_grad=False)
        if r.correction_bias:
            shape = (1, width) if r.correction_bias_rows else (width,)
            self.bias = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights [N, k] in x's dtype, expert indices [N, k])."""
        r = self.r
        logits = F.linear(x.float(), self.weight.float())  # [N, experts]
        scores = logits.softmax(dim=-1) if r.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.bias is None else scores + self.bias.view(-1)
        if r.groups > 1:
            grouped = choice.view(x.shape[0], r.groups, -1)  # [N, G, experts per group]
            if r.group_score == "top2_sum":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            kept = group_scores.topk(r.topk_groups, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(1)
        indices = choice.topk(r.top_k, dim=-1).indices  # [N, k]
        weights = scores.gather(1, indices)
        if r.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * r.scale).to(x.dtype), indices


class MoE(nn.Module):
    """Routed experts by contiguous ranges across ranks plus shared experts; routed sums all-reduced."""

    def __init__(self, r: Routing, hidden: int, expert_inter: int, ctx: ParallelContext, dtype: torch.dtype,
                 fp8: bool, *, shared_inter: int = 0, shared_gate: bool = False, shared_bias: bool = False,
                 swiglu: tuple[float, float] | None = None):
        super().__init__()
        self.ctx = ctx
        n_local = ctx.split(r.experts + r.identity_experts,
                            "routed + zero experts" if r.identity_experts else "the routed expert count")
        first = ctx.rank * n_local
        self.gate = Router(r, hidden, dtype)
        self.experts = nn.ModuleDict({str(e): FeedForward(hidden, expert_inter, dtype, fp8, ctx=None, swiglu=swiglu)
                                      if e < r.experts else IdentityExpert() for e in range(first, first + n_local)})
        self.shared_experts = (FeedForward(hidden, shared_inter, dtype, fp8, ctx=ctx, bias=shared_bias, swiglu=swiglu)
                               if shared_inter else None)
        self.shared_expert_gate = Linear(hidden, 1, dtype) if shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N, hidden]
        weights, indices = self.gate(flat)
        y = torch.zeros_like(flat)
        for name, expert in self.experts.items():
            token, slot = torch.where(indices == int(name))
            if token.numel():
                y.index_add_(0, token, expert(flat[token]) * weights[token, slot, None])
        y = self.ctx.all_reduce(y)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            y = y + shared
        return y.view_as(x)
