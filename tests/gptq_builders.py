"""Tiny GPTQ and AWQ checkpoints, made by the libraries' own packing code, and the libraries' dequantization as
the oracle.

AWQ: autoawq (installed by the `test` extra) packs every layer with its own `WQLinear_GEMM.from_linear` /
`WQLinear_GEMV.from_linear` from min-max scales and zero points (what its quantizer's pseudo_quantize_tensor
computes); the oracle is its `dequantize_gemm`. GEMV has no dequantization in autoawq (only a CUDA kernel), so
its oracle is dequantize_gemm on the GEMM packing of the same linear, scales and zero points.

GPTQ: gptqmodel, which defines the format today (transformers 5.24 loads GPTQ through it), needs torch >= 2.14
and a dozen packages beside it, so it cannot join the `test` extra. Its reference packing (`pack_original`, bits 2,
4 and 8) and its torch dequantization (`PackableQuantLinear.dequantize_weight` after `convert_gptq_v1_to_v2_format`)
are copied below as the spec, from gptqmodel 7.7.0; test_gptq_copies_equal_gptqmodel checks the copies against
gptqmodel itself wherever it imports (see the test for how).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import torch

from quant_builders import load_all, write_like

LINEAR = re.compile(r"model\.layers\.\d+\..*_proj\.weight")
V1_OFFSET = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


# -- GPTQ: gptqmodel 7.7.0, copied ------------------------------------------------------------------------
def gptq_params(w: torch.Tensor, bits: int, group: int, sym: bool, desc_act: bool, seed: int):
    """gptqmodel's Quantizer.find_params (min-max, no MSE search) per group of input columns, the groups taken in
    act-order under desc_act (a random permutation standing in for the Hessian's order): (scales [N, G] fp32
    on fp16 values, zeros [N, G], g_idx [K]) as GPTQ.quantize hands them to pack."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    g = k if group == -1 else group
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if desc_act else torch.arange(k)
    g_idx = (torch.argsort(perm) // g).to(torch.int32)  # gptqmodel: [i // group_size for i in range(K)][invperm]
    groups = math.ceil(k / g)
    scales, zeros = torch.zeros(n, groups), torch.zeros(n, groups)
    x = w.float()
    for j in range(groups):
        cols = x[:, g_idx == j]
        xmin = torch.minimum(cols.amin(1), torch.zeros(n))
        xmax = torch.maximum(cols.amax(1), torch.zeros(n))
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        both_zero = (xmax == 0) if sym else (xmin == 0) & (xmax == 0)
        xmin, xmax = torch.where(both_zero, xmin - 1, xmin), torch.where(both_zero, xmax + 1, xmax)
        scale = (xmax - xmin) / maxq
        zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
        scales[:, j], zeros[:, j] = scale.half().float(), zero
    return scales, zeros, g_idx


def gptq_pack(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int):
    """gptqmodel's PackableQuantLinear.pack_original for a Linear weight [N, K] (bits 2, 4, 8; int32 words):
    (qweight, qzeros, scales, g_idx) in the v2 (gptq_v2) form it holds in memory."""
    maxq, per = (1 << bits) - 1, 32 // bits
    scales, zeros = scales.T.contiguous(), zeros.T.contiguous()
    scale_zeros = zeros * scales
    stored_scales = scales.to(dtype=torch.float16)
    int_weight = torch.round((w.float() + scale_zeros[g_idx].T) / scales[g_idx].T)
    int_weight.clamp_(0, maxq)
    int_weight = int_weight.to(torch.int32).T.contiguous().numpy().astype(np.uint32)
    qweight = np.zeros((math.ceil(int_weight.shape[0] * bits / 32), int_weight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(min(per, int_weight.shape[0] - row * per)):
            qweight[row] |= int_weight[row * per + j] << (bits * j)
    zeros = zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], math.ceil(zeros.shape[1] * bits / 32)), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(min(per, zeros.shape[1] - col * per)):
            qzeros[:, col] |= zeros[:, col * per + j] << (bits * j)
    return (torch.from_numpy(qweight.astype(np.int32)), torch.from_numpy(qzeros.astype(np.int32)), stored_scales,
            g_idx.to(torch.int32))


def to_v1(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """gptqmodel's convert_gptq_v2_to_v1_format_module: what `checkpoint_format: gptq` stores (an int32
    subtraction, borrows and all)."""
    return qzeros - V1_OFFSET[bits]


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits: int, v1: bool) -> torch.Tensor:
    """gptqmodel's convert_gptq_v1_to_v2_format_module (for v1) and PackableQuantLinear.dequantize_weight
    (bits 2, 4, 8): the fp16 weight [K, N]."""
    if v1:
        qzeros = qzeros + V1_OFFSET[bits]
    per, maxq = 32 // bits, (1 << bits) - 1
    dequant_dtype = torch.int16 if bits == 8 else torch.int8
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, per), wf.unsqueeze(0)).to(dequant_dtype)
    zeros = torch.bitwise_and(zeros, maxq).reshape(qzeros.shape[0], -1)[:, : scales.shape[1]]
    weight = torch.bitwise_and(torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, per, -1),
                                                         wf.unsqueeze(-1)).to(dequant_dtype), maxq)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    return scales[g_idx.long()] * (weight - zeros[g_idx.long()])


# -- AWQ: autoawq 0.2.9 -------------------------------------------------------------------------------------
def awq_params(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """autoawq's AwqQuantizer.pseudo_quantize_tensor (zero_point, 4 bits) on an fp16 weight: (the weight
    rounded to its codes, as _apply_quant hands it to from_linear; scales and zeros [N, K / group])."""
    n, k = w.shape
    g = w.reshape(-1, k if group == -1 else group)
    max_val, min_val = g.amax(dim=1, keepdim=True), g.amin(dim=1, keepdim=True)
    scales = (max_val - min_val).clamp(min=1e-5) / 15
    zeros = (-torch.round(min_val / scales)).clamp_(0, 15)
    g = (torch.clamp(torch.round(g / scales) + zeros, 0, 15) - zeros) * scales
    return g.reshape(n, k), scales.view(n, -1), zeros.view(n, -1)


def awq_pack(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, version: str) -> dict:
    """autoawq's WQLinear_GEMM / WQLinear_GEMV.from_linear of nn.Linear(w), given scales and zeros as its
    _apply_quant passes them (GEMM: [G, N], GEMV: [N, G]): its qweight, qzeros and scales."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from awq.modules.linear.gemm import WQLinear_GEMM
        from awq.modules.linear.gemv import WQLinear_GEMV
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
    linear.weight.data = w
    cls = WQLinear_GEMV if version == "gemv" else WQLinear_GEMM
    q = cls.from_linear(linear, 4, w.shape[1] if group == -1 else group, scales=scales, zeros=zeros)
    return {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales}


def awq_dequantize(qweight, qzeros, scales, group: int) -> torch.Tensor:
    """autoawq's dequantize_gemm: the fp16 weight [K, N]."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from awq.utils.packing_utils import dequantize_gemm
    return dequantize_gemm(qweight, qzeros, scales, 4, qweight.shape[0] if group == -1 else group)


# -- checkpoints --------------------------------------------------------------------------------------------
def quantize(src: Path, dst: Path, kind: dict, pattern: re.Pattern = LINEAR, seed: int = 0) -> dict[str, torch.Tensor]:
    """src (BF16, as dense_models builds it) -> dst with every weight `pattern` matches quantized as `kind`
    says ({"method": "gptq", bits, group, sym, desc_act, format} or {"method": "awq", group, version}), the
    rest stored in F16 as GPTQ and AWQ models are. Returns the oracle: every quantized weight dequantized by
    the library (fp16 [N, K]) by its dequantized name."""
    tensors, file_of = load_all(src)
    out, out_file, oracle = {}, {}, {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if not pattern.fullmatch(name):
            out[name], out_file[name] = t.to(torch.float16) if t.is_floating_point() else t, file_of[name]
            continue
        base = name[: -len("weight")]
        w = t.float().half().float()  # the F16 model the libraries quantize
        if kind["method"] == "gptq":
            bits, group = kind["bits"], kind["group"]
            scales, zeros, g_idx = gptq_params(w, bits, group, kind["sym"], kind["desc_act"], seed + i)
            qweight, qzeros, stored, g_idx = gptq_pack(w, scales, zeros, g_idx, bits)
            oracle[name] = gptq_dequantize(qweight, qzeros, stored, g_idx, bits, v1=False).T
            if kind["format"] == "gptq":
                qzeros = to_v1(qzeros, bits)
                assert torch.equal(gptq_dequantize(qweight, qzeros, stored, g_idx, bits, v1=True).T, oracle[name])
            parts = {"qweight": qweight, "qzeros": qzeros, "scales": stored, "g_idx": g_idx}
        else:
            parts = awq_layers(w.half(), kind["group"], kind["version"])
            oracle[name] = parts.pop("oracle")
        for leaf, value in parts.items():
            out[base + leaf], out_file[base + leaf] = value.contiguous(), file_of[name]
    write_like(src, dst, out, out_file)
    config = json.loads((dst / "config.json").read_text())
    config["torch_dtype"] = "float16"
    config["quantization_config"] = quant_config(kind)
    (dst / "config.json").write_text(json.dumps(config))
    return oracle


def awq_layers(w: torch.Tensor, group: int, version: str) -> dict:
    """The tensors autoawq stores for one fp16 linear weight in `version`, and the oracle: dequantize_gemm of the
    GEMM packing of the same weight, scales and zeros ([N, K])."""
    wq, scales, zeros = awq_params(w, group)
    gemm = awq_pack(wq, scales.t().contiguous(), zeros.t().contiguous(), group, "gemm")
    oracle = awq_dequantize(gemm["qweight"], gemm["qzeros"], gemm["scales"], group).T
    parts = gemm if version == "gemm" else awq_pack(wq, scales, zeros, group, "gemv")
    return {**parts, "oracle": oracle}


def quant_config(kind: dict) -> dict:
    """config.json's quantization_config as the library writes it."""
    if kind["method"] == "gptq":  # gptqmodel's QuantizeConfig.to_dict (the fields a loader reads)
        return {"quant_method": "gptq", "bits": kind["bits"], "group_size": kind["group"], "desc_act": kind["desc_act"],
                "sym": kind["sym"], "lm_head": False, "damp_percent": 0.05, "true_sequential": True,
                "static_groups": False, "checkpoint_format": kind["format"], "pack_dtype": "int32",
                "meta": {"quantizer": ["gptqmodel:7.7.0"]}}
    return {"quant_method": "awq", "zero_point": True, "group_size": kind["group"], "bits": 4,  # autoawq's save
            "version": kind["version"], "modules_to_not_convert": None}
