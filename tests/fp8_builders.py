"""Tiny checkpoints in the FP8 layouts transformers reads (`quant_method: fp8`), and transformers' own
dequantization as the oracle.

Block FP8 (any block size, float or E8M0 scales) is quantized by transformers' own `Fp8Quantize` (the op its
FineGrainedFP8 quantizer runs, here on the CPU: the quantizer itself refuses to start without a GPU), and
the oracle is its `Fp8Dequantize`. DeepSeek-V4's MXFP4 experts are written in the published on-disk form (I8,
two e2m1 codes a byte, low nibble first; one E8M0 scale per 32 values along K); AutoFP8's per-tensor and
fbgemm's per-row FP8 follow those libraries' formulas (amax / 448 per tensor or row): the oracle for all of
them is transformers' `Fp8Dequantize` too, which reads each by its scale's shape.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import torch

from quant_builders import load_all, write_like

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
EXPERTS = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
QWEN3_LINEAR = re.compile(r"model\.layers\.\d+\..*_proj\.weight")


def fp8_quantize(w: torch.Tensor, block: tuple[int, int] | None, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Fp8Quantize of one weight: (float8_e4m3fn weight, its weight_scale_inv)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=block, scale_fmt=scale_fmt)
    out = Fp8Quantize(SimpleNamespace(quantization_config=config))._quantize_one("x.weight", w)
    return out["x.weight"], out["x.weight_scale_inv"]


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """transformers' Fp8Dequantize of one weight (FP8 or int8-packed FP4), to bfloat16."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.bfloat16)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's on-disk MXFP4: int8 [N, K/2] (low nibble first) and float8_e8m0fnu scales [N, K/32], the
    scale the power of two that brings each group's amax within e2m1's 6, each value the nearest code."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // 32, 32)
    amax = g.abs().amax(-1).clamp(min=2.0 ** -120)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    x = g / torch.exp2(exp)[..., None]
    mag = (x.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = (mag | ((x < 0) & (mag > 0)).to(torch.int64) << 3).reshape(rows, cols).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def per_tensor(w: torch.Tensor, rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoFP8's per-tensor (or fbgemm's per-row) FP8: scale = amax / 448, weight = (w / scale) in e4m3."""
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True) if rows else w.abs().amax()
    scale = (amax / 448.0).clamp(min=1e-12)
    return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.float()


def quantize(src: Path, dst: Path, layout: str, pattern: re.Pattern) -> dict[str, str]:
    """Write src (BF16) with every tensor `pattern` matches quantized in `layout`; returns the stored
    values' names -> the dequantized name. Layouts: block{b0}x{b1}-{float|ue8m0}-{leaf}[-u8] (blocks, the
    scale as `X.<leaf>`, E8M0 as raw bytes with -u8), v4 (blocks 32x32 E8M0 `.scale`, experts MXFP4), autofp8,
    hf-tensor (transformers' per-tensor: weight_block_size null), fbgemm."""
    tensors, file_of = load_all(src)
    quant: dict = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    made = {}
    for name in [n for n in tensors if pattern.fullmatch(n)]:
        w = tensors.pop(name)
        base = name[: -len("weight")]
        if layout == "v4" and EXPERTS.fullmatch(name):
            q, s = mxfp4_quantize(w)
            stored = {name: q, base + "scale": s}
        elif layout.startswith(("block", "v4")):
            spec = "block32x32-ue8m0-scale" if layout == "v4" else layout
            b0, b1, fmt, leaf, *u8 = re.fullmatch(r"block(\d+)x(\d+)-(\w+?)-(\w+?)(-u8)?", spec).groups()
            q, s = fp8_quantize(w, (int(b0), int(b1)), fmt)
            if q.dtype != torch.float8_e4m3fn:  # transformers leaves a weight the blocks do not tile unquantized
                tensors[name] = w
                continue
            stored = {name: q, base + leaf: s.view(torch.uint8) if u8[0] else s}
        elif layout == "hf-tensor":
            q, s = fp8_quantize(w, None, "float")
            stored = {name: q, base + "weight_scale_inv": s.reshape(())}
        else:
            q, s = per_tensor(w, rows=layout == "fbgemm")
            stored = {name: q, base + "weight_scale": s, base + "input_scale": torch.tensor(0.02)}
            if layout == "fbgemm":
                stored.pop(base + "input_scale")
        for k, t in stored.items():
            tensors[k], file_of[k] = t.contiguous(), file_of.get(name, next(iter(file_of.values())))
        made[name] = name
    if layout.startswith(("block", "v4")):
        spec = "block32x32-ue8m0" if layout == "v4" else layout
        b0, b1, fmt = re.fullmatch(r"block(\d+)x(\d+)-(\w+?)-.*", spec + "-").groups()
        quant.update(weight_block_size=[int(b0), int(b1)], scale_fmt=fmt)
        if layout == "v4":
            quant["expert_dtype"] = "fp4"
    elif layout == "hf-tensor":
        quant["weight_block_size"] = None
    elif layout == "autofp8":
        quant.update(activation_scheme="static", ignored_layers=["lm_head"])
    elif layout == "fbgemm":
        quant = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
    write_like(src, dst, tensors, file_of)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))
    return made


def oracle(dst: Path, names: dict[str, str]) -> dict[str, torch.Tensor]:
    """transformers' dequantization of every quantized weight of `dst`, by its dequantized name."""
    tensors, _ = load_all(dst)
    out = {}
    for name in names:
        base = name[: -len("weight")]
        leaf = next(leaf for leaf in ("weight_scale_inv", "scale", "qscale_weight", "weight_scale") if base + leaf in tensors)
        out[name] = fp8_dequantize(tensors[name], tensors[base + leaf])
    return out
