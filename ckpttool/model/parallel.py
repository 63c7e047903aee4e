"""Tensor-parallel building blocks with an explicit context: no module globals.

The layouts match the reference convert.py: column-parallel weights are cut along dim 0 (output
features), row-parallel weights along dim 1 (input features), the embedding along the vocabulary.
FP8 weights carry a `scale` ([ceil(out/128), ceil(in/128)], fp32) and are dequantized per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ckpttool.errors import PlanError
from ckpttool.kernels.fp8 import BLOCK, dequant_fp8_block


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """Which model-parallel rank this process is, out of how many; collectives are no-ops at 1."""

    rank: int = 0
    world_size: int = 1

    def split(self, size: int, what: str) -> int:
        """The local part of a dimension that is cut evenly across ranks."""
        if size % self.world_size:
            raise PlanError(f"{what} ({size}) is not divisible by mp={self.world_size}",
                            fix="choose an --mp that divides it")
        return size // self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


class ParallelEmbedding(nn.Module):
    """The vocabulary is cut into contiguous ranges; each rank embeds its own ids, then all-reduce."""

    def __init__(self, ctx: ParallelContext, vocab_size: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.ctx = ctx
        part = ctx.split(vocab_size, "vocab_size")
        self.vocab_start = ctx.rank * part
        self.weight = nn.Parameter(torch.empty(part, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.ctx.all_reduce(y)


class Linear(nn.Module):
    """y = x W^T, W stored in `dtype` or as FP8 with a block `scale` (dequantized on each call)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, fp8: bool = False):
        super().__init__()
        self.compute_dtype = dtype
        weight_dtype = torch.float8_e4m3fn if fp8 else dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=weight_dtype), requires_grad=False)
        self.register_parameter("scale", None)
        if fp8:
            self.hold_fp8()

    def hold_fp8(self, scale_dtype: torch.dtype = torch.float32) -> None:
        """Hold the weight as FP8 e4m3 beside a scale per 128x128 block of `scale_dtype` (float32, or E8M0 bytes as
        DeepSeek-V4's files store them), as the mp files do: dequantized on each call."""
        rows, cols = self.weight.shape
        if self.weight.dtype != torch.float8_e4m3fn:
            self.weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(-(-rows // BLOCK), -(-cols // BLOCK), dtype=scale_dtype),
                                  requires_grad=False)

    def dense_weight(self) -> torch.Tensor:
        """The weight in the compute dtype: FP8 goes through the bf16 dequant every call, never cached."""
        if self.scale is None:
            return self.weight
        return dequant_fp8_block(self.weight, self.scale).to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight())


class ColumnParallelLinear(Linear):
    """Output features cut across ranks; each rank returns its slice (no communication)."""

    def __init__(self, ctx: ParallelContext, in_features: int, out_features: int, dtype: torch.dtype,
                 fp8: bool = False, what: str = "output features"):
        super().__init__(in_features, ctx.split(out_features, what), dtype, fp8)


class RowParallelLinear(Linear):
    """Input features cut across ranks; partial products are summed by all-reduce."""

    def __init__(self, ctx: ParallelContext, in_features: int, out_features: int, dtype: torch.dtype,
                 fp8: bool = False, what: str = "input features"):
        super().__init__(ctx.split(in_features, what), out_features, dtype, fp8)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(super().forward(x))
