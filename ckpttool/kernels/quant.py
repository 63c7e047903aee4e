"""Weight-only quantization kernels (torch, CPU or CUDA), and their inverses.

- FP8 e4m3 128x128 blocks: `kernels.fp8.quantize_fp8_block` (scale = amax / 448 per block, q = w / scale),
  the inverse of the dequant every other command uses.
- int8 per output channel, gpt-fast's `dynamically_quantize_per_channel` (symmetric, -128..127):
  scale = max(|min|, |max|) / 127.5 per row (at least float32 eps), q = clamp(round(w / scale)); the
  scales are stored in the weight's dtype, as gpt-fast stores them.
- int4 grouped, gpt-fast's `get_group_qparams` + `group_quantize_tensor_from_qparams` (asymmetric,
  computed in bfloat16 as gpt-fast does): per group of `group_size` input columns,
  scale = (max - min).clamp(1e-6) / 15, zero = min + 8 * scale, q = clamp(round((w - (zero - 8 * scale)) / scale), 0, 15),
  dequant = (q - 8) * scale + zero. q is packed two per byte, see `pack_int4`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckpttool.errors import InputError

if TYPE_CHECKING:
    import torch

# torch is imported inside each function: planning (stages/quantize.py) reads INT4_GROUP_SIZES
# without paying for torch's import.
INT4_GROUP_SIZES = (32, 64, 128, 256)


class NonFinite(InputError):
    """A float weight holding NaN or Inf, which no format's scale can represent (a min-max scale of Inf or NaN
    would poison its whole group, block or row). `row`, `col`: the first such value in the rows the kernel saw;
    the executor adds the file and tensor and turns `row` into the tensor's row, as for NaNCodes."""

    def __init__(self, row: int | None = None, col: int | None = None, **context):
        self.row, self.col = row, col
        where = "" if row is None else f" (first at row {row}, column {col})"
        super().__init__(f"cannot quantize a weight holding NaN or Inf{where}",
                         fix="the source checkpoint is corrupt or was saved from a diverged run; re-download it, "
                             "or repair the weight before quantizing (ckpttool never writes a scale from it)",
                         **context)

    def moved(self, rows: int, **context) -> "NonFinite":
        """The same, `rows` rows further down the tensor (the run began there), naming file and tensor."""
        return NonFinite(None if self.row is None else self.row + rows, self.col, **context)


def check_finite(w: torch.Tensor) -> None:
    """Refuse (NonFinite) a weight holding NaN or +-Inf: two reductions where it is finite, a search only where
    it is not."""
    import torch

    if not w.numel() or not w.is_floating_point():
        return
    lo, hi = torch.aminmax(w.reshape(-1))
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return
    bad = (~torch.isfinite(w.reshape(w.shape[0], -1) if w.dim() else w.reshape(1, 1))).nonzero()[0]
    raise NonFinite(int(bad[0]), int(bad[1]))


def quantize_int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] -> (int8 [M, N], scales [M] in weight.dtype)."""
    import torch

    if weight.dim() != 2:
        raise ValueError(f"int8 per-channel quantization needs a 2-D weight, got {list(weight.shape)}")
    x = weight.float()
    min_val, max_val = torch.aminmax(x, dim=1)
    amax = torch.max(-torch.min(min_val, torch.zeros_like(min_val)), torch.max(max_val, torch.zeros_like(max_val)))
    scales = torch.clamp(amax / 127.5, min=torch.finfo(torch.float32).eps)
    q = torch.clamp(torch.round(x / scales.unsqueeze(-1)), -128, 127).to(torch.int8)
    return q, scales.to(weight.dtype)


def dequant_int8_per_channel(q: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    import torch

    return (q.float() * scales.float().unsqueeze(-1)).to(out_dtype or torch.bfloat16)


def _check_int4(weight: torch.Tensor, group_size: int) -> None:
    if weight.dim() != 2:
        raise ValueError(f"int4 grouped quantization needs a 2-D weight, got {list(weight.shape)}")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if weight.shape[1] % group_size:
        raise ValueError(f"input features ({weight.shape[1]}) are not a multiple of group_size {group_size}")


def quantize_int4_grouped(weight: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] -> (q: int32 [M, N] in 0..15, scales_and_zeros: bfloat16 [N / group_size, M, 2])."""
    import torch

    _check_int4(weight, group_size)
    w = weight.to(torch.bfloat16)
    rows = w.reshape(-1, group_size)
    max_val, min_val = rows.amax(dim=1, keepdim=True), rows.amin(dim=1, keepdim=True)
    scales = (max_val - min_val).clamp(min=1e-6) / 15
    zeros = min_val + scales * 8
    q = rows.sub(zeros - scales * 8).div(scales).round().clamp_(0, 15).to(torch.int32).reshape_as(w)
    m, n_groups = w.shape[0], w.shape[1] // group_size
    scales_and_zeros = torch.cat([scales.reshape(m, n_groups, 1), zeros.reshape(m, n_groups, 1)], 2)
    return q, scales_and_zeros.transpose(0, 1).contiguous()


def dequant_int4_grouped(q: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int = 128,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inverse of quantize_int4_grouped (q unpacked, int32 [M, N])."""
    import torch

    scales = scales_and_zeros[..., 0].transpose(0, 1).reshape(-1, 1)  # [M * G, 1]
    zeros = scales_and_zeros[..., 1].transpose(0, 1).reshape(-1, 1)
    w = q.reshape(-1, group_size).to(torch.bfloat16).sub(8).mul(scales).add(zeros)
    return w.reshape(q.shape).to(out_dtype or torch.bfloat16)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int 0..15 [M, N] -> uint8 [M, N / 2]: column 2j in the low nibble, column 2j + 1 in the high one."""
    import torch

    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [M, N / 2] -> int32 [M, N]."""
    import torch

    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)
