"""FP8 stacked experts, as ckpttool's exact repack of gpt-oss's MXFP4 experts writes them (formats/repack.py), read
back into gpt-oss's BF16 layout.

  fp8_experts:{b0}x{b1}:{float|ue8m0}   X (F8_E4M3 [E, R, K]) + X_scale_inv ([E, ceil(R/b0), ceil(K/b1)]: F32, or
                                        E8M0 under scale_fmt ue8m0) -> X [E, K, R]

Each expert is stored by output rows, [R, K], the orientation of gpt-oss's `*_blocks` and of the experts transformers'
FP8Experts allocates (`gate_up_proj` [E, 2I, H] with `gate_up_proj_scale_inv` [E, 2I/b0, H/b1]), with blocks of its
own. Read back, it is transposed into [E, K, R], the layout transformers' GptOssExperts holds and the `mxfp4` row
dequantizes to (formats/blocks.py), so a repacked checkpoint dequantizes to the very BF16 its MXFP4 source does.
Each expert's values: the FP8 block row's kernel (formats/fp8.py), fp32(code) * fp32(scale) rounded once.

No engine loads it as FP8 (transformers 5.24's FP8Experts refuses experts with biases, which gpt-oss's have; vLLM's
gpt-oss loader reads MXFP4 or BF16 experts): ckpttool's dequant and verify read it, and `quantize` writes it for a
Hopper runtime of the user's own.
"""

from __future__ import annotations

import functools

import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats.fp8 import E8M0, block_row
from ckpttool.formats.resolve import Rule
from ckpttool.formats.row import BY_ROWS, Chunk, Name, QuantFormat, Side, via_cpu
from ckpttool.kernels.fp8 import FP8_DTYPES

EXPERTS_SCALE = "_scale_inv"
"""`X` -> `X_scale_inv`: transformers' FP8Experts' name for a stacked projection's block scales"""


class _Stacked(Name):
    """The stacked projection itself, `X` (transformers' parameter names: `gate_up_proj`, `down_proj`), never a
    Linear's `X.weight`: FP8 blocks of 2-D weights are formats/fp8.py's rows, with `X.weight_scale_inv` beside."""

    def base_of(self, stored: str) -> str | None:
        return None if stored.endswith(".weight") else stored


def _check(block: tuple[int, int]):
    def check(w_shape, sides, names, file) -> None:
        want = (w_shape[0], -(-w_shape[1] // block[0]), -(-w_shape[2] // block[1])) if len(w_shape) == 3 else None
        if want is None or tuple(sides["scale"]) != want:
            raise InputError(f"stacked FP8 experts {list(w_shape)} with scale {list(sides['scale'])}: expected a 3-D "
                             f"weight [E, R, K] and scales [E, ceil(R/{block[0]}), ceil(K/{block[1]})]", file=file,
                             tensor=names["scale"], fix="re-download the checkpoint, or fix config.json's "
                                                        "weight_block_size")
    return check


@functools.lru_cache(maxsize=None)
def experts_row(b0: int, b1: int, scale_fmt: str) -> QuantFormat:
    per_expert = block_row(b0, b1, scale_fmt, "x")

    def cpu(c: Chunk, out: str, into) -> np.ndarray:
        codes, scale = np.asarray(c.values), np.asarray(c.scale)
        experts, rows, cols = codes.shape
        result = np.empty((experts, cols, rows), dtype=np.dtype(f"u{2 if out != 'F32' else 4}"))
        for e in range(experts):
            one = Chunk(codes[e], c.dtype, {"scale": scale[e]}, c.side_dtypes)
            result[e] = per_expert.cpu(one, out, None).T
        return result

    def example(dev) -> Chunk:
        import torch

        return Chunk(torch.zeros(1, b0, b1, dtype=torch.float8_e4m3fn, device=dev), "F8_E4M3",
                     {"scale": torch.ones(1, 1, 1, device=dev)}, {"scale": "F32"})

    return QuantFormat(
        name=f"fp8_experts:{b0}x{b1}:{scale_fmt}",
        title=f"FP8 {b0}x{b1} blocks, stacked experts" + (" (E8M0 scales)" if scale_fmt == "ue8m0" else ""),
        values=_Stacked("", leaf=False), value_dtypes=FP8_DTYPES,
        sides=(Side("scale", Name(EXPERTS_SCALE, leaf=False), ("F32", *E8M0) if scale_fmt == "ue8m0" else ("F32",),
                    BY_ROWS, encoding="e8m0", positive=True),),
        check=_check((b0, b1)), out_shape=lambda s: (s[0], s[2], s[1]), cpu=cpu, cuda=via_cpu(cpu), example=example,
        keepable=False)


def named(name: str) -> QuantFormat | None:
    """The row a plan's transform name stands for: `fp8_experts:{b0}x{b1}:{float|ue8m0}`."""
    kind, _, args = name.partition(":")
    size, _, fmt = args.partition(":")
    b0, _, b1 = size.partition("x")
    if kind != "fp8_experts" or fmt not in ("float", "ue8m0") or not (b0.isdigit() and b1.isdigit()) \
            or int(b0) < 1 or int(b1) < 1:
        return None
    return experts_row(int(b0), int(b1), fmt)


def declared(quant: dict, source) -> tuple[Rule, ...]:
    """The rule a transformers FP8 config of blocks declares for stacked experts, beside formats/fp8.py's (which
    has validated the config by then): blocks of weight_block_size, scale_fmt's scales."""
    block = quant.get("weight_block_size")
    if quant.get("quant_method") != "fp8" or not isinstance(block, list) or len(block) != 2:
        return ()
    ignore = tuple(v for v in quant.get("modules_to_not_convert") or [] if isinstance(v, str))
    return (Rule(experts_row(block[0], block[1], quant.get("scale_fmt", "float")), "quantization_config",
                 ignore=ignore),)
