"""NVIDIA ModelOpt's formats (`hf_quant_config.json`; newer exports also embed it in config.json as
`quantization_config` with `quant_method: modelopt`), one row each, and which rows its config declares.

  modelopt_nvfp4        W.weight (U8 [M, N/2]) + W.weight_scale (F8_E4M3 [M, N/16]) + W.weight_scale_2 (F32)
                        -> W.weight [M, N] (quant_algo NVFP4, W4A16_NVFP4)
  modelopt_fp8_tensor   W.weight (F8_E4M3 [M, N]) + W.weight_scale (F32 [] or [1])   (quant_algo FP8)
  modelopt_fp8_channel  W.weight (F8_E4M3 [M, N]) + W.weight_scale (F32 [M] or [M, 1])
                        (quant_algo FP8_PER_CHANNEL_PER_TOKEN)
  W.input_scale (static activations) and an FP8 KV cache's k_proj.k_scale / v_proj.v_scale (kv_cache_quant_algo FP8):
  dropped with the quantization (the output's KV cache is BF16). quant_algo MIXED_PRECISION: each listed layer's
  algorithm, one rule per algorithm over those layers.

weight_scale_2 is the reciprocal of compressed-tensors' global scale and multiplies where compressed-tensors
divides: the formula is in kernels/nvfp4_cpu.py. FP8 is ModelOpt's own dequantization (FP8QTensor.dequantize, and
from_quantized_weight of its export): `q.to(dtype) * scale.to(dtype)`: the scale rounded to the output dtype first,
then the product in that dtype; out = round_out(e4m3(q) * round_out(s)) (one rounding of an exact fp32 product).
"""

from __future__ import annotations

import re

import numpy as np

from ckpttool.errors import InputError
from ckpttool.formats.compressed import nvfp4_row
from ckpttool.formats.resolve import Rule
from ckpttool.formats.row import DROPPED, WHOLE, Chunk, Name, QuantFormat, Side
from ckpttool.kernels import grouped, scaled_cpu
from ckpttool.kernels.fp8_cpu import fp8_values, round_to_bf16, value_tables

METHOD = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"
"""ModelOpt's own description of the checkpoint: copied unchanged unless the weights are dequantized"""
KV_SCALES = ("k_scale", "v_scale")
"""an FP8 KV cache's scales, on k_proj and v_proj (export: `k_bmm_quantizer._amax` -> `k_proj.k_scale`)"""

MODELOPT_NVFP4 = nvfp4_row("modelopt", name="modelopt_nvfp4", title="NVIDIA ModelOpt NVFP4", values=Name("weight"),
                           global_leaf="weight_scale_2", dropped="input_scale", also_dropped=KV_SCALES)


def rounded_scale(scale: np.ndarray, out: str) -> np.ndarray:
    """F32 scales as `scale.to(dtype)` leaves them, back in fp32 (exact)."""
    s = np.ascontiguousarray(scale, dtype=np.float32)
    if out == "F16":
        with np.errstate(over="ignore"):
            return s.astype(np.float16).astype(np.float32)
    if out == "BF16":
        bits = np.empty(s.shape, dtype=np.uint16)
        round_to_bf16(s, bits, np.empty(s.shape, dtype=np.uint32))
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return s


def _fp8_cpu(c: Chunk, out: str, into) -> np.ndarray:
    """The rounded scales in the output's 16-bit dtype where it has one: the same values, and 16-bit scales find
    their distinct values in one linear pass (F32 ones sort), a table each, as compressed-tensors' rows do."""
    scale = rounded_scale(c.scale, out).reshape(-1, 1)
    if out == "BF16":
        return scaled_cpu.dequant_fp8_rows(c.values, (scale.view(np.uint32) >> 16).astype(np.uint16), c.dtype, out, out)
    if out == "F16":
        return scaled_cpu.dequant_fp8_rows(c.values, scale.astype(np.float16), c.dtype, out, out)
    return scaled_cpu.dequant_fp8_rows(c.values, scale, c.dtype, "F32", out)


def _fp8_cuda(c: Chunk, out_dtype):
    import torch

    from ckpttool.dtypes import dtype_code

    codes = c.values.view(torch.uint8)
    values, index = scaled_cpu.distinct(rounded_scale(c.scale.cpu().numpy(), dtype_code(out_dtype)).reshape(-1))
    table = value_tables(fp8_values(c.dtype), values, dtype_code(out_dtype)).reshape(-1)
    tables = torch.from_numpy(table.view(table.dtype.str.replace("u", "i"))).to(codes.device)
    which = torch.from_numpy(index).to(codes.device).reshape(-1, 1).expand(codes.shape[0], 1)
    return grouped.gather_torch(codes, which, tables, max(codes.shape[1], 1)).view(out_dtype), None


def _fp8_row(per: str) -> QuantFormat:
    def check(w_shape, sides, names, file) -> None:
        s_shape = tuple(sides["scale"])
        ok = s_shape in ((), (1,)) if per == "tensor" else s_shape in ((w_shape[0],), (w_shape[0], 1))
        if len(w_shape) != 2 or not ok:
            want = "[] or [1]" if per == "tensor" else f"[{w_shape[0]}] or [{w_shape[0]}, 1]"
            raise InputError(f"scale shape {list(s_shape)} for weight {list(w_shape)}: expected {want} (one scale per "
                             f"{per})", file=file, tensor=names["scale"],
                             fix=f"re-download the checkpoint, or fix {HF_QUANT_CONFIG}'s quant_algo")

    def example(dev) -> Chunk:
        import torch

        return Chunk(torch.zeros(1, 2, dtype=torch.float8_e4m3fn, device=dev), "F8_E4M3",
                     {"scale": torch.ones(1, dtype=torch.float32, device=dev)}, {"scale": "F32"})

    rows = (lambda r0, r1: (r0, r1)) if per == "channel" else (lambda r0, r1: (0, 1))
    return QuantFormat(
        name=f"modelopt_fp8_{per}", title=f"NVIDIA ModelOpt FP8 (per {per})", values=Name("weight"),
        value_dtypes=("F8_E4M3",),
        sides=(Side("scale", Name("weight_scale"), ("F32",), WHOLE, rows=rows),
               *(Side(leaf, Name(leaf), read=DROPPED) for leaf in ("input_scale", *KV_SCALES))),
        check=check, out_shape=lambda s: s, cpu=_fp8_cpu, cuda=_fp8_cuda, example=example, keepable=False)


MODELOPT_FP8_TENSOR = _fp8_row("tensor")
MODELOPT_FP8_CHANNEL = _fp8_row("channel")
ROWS = (MODELOPT_NVFP4, MODELOPT_FP8_TENSOR, MODELOPT_FP8_CHANNEL)
ALGOS = {"NVFP4": MODELOPT_NVFP4, "W4A16_NVFP4": MODELOPT_NVFP4, "FP8": MODELOPT_FP8_TENSOR,
         "FP8_PER_CHANNEL_PER_TOKEN": MODELOPT_FP8_CHANNEL}
"""quant_algo -> its row (NVFP4 and W4A16_NVFP4 store the same weight tensors; W4A16 has no input_scale)"""
GROUP_SIZES = {"NVFP4": 16, "W4A16_NVFP4": 16}
_KV_FP8 = ("FP8", {"dynamic": False, "num_bits": 8, "type": "float"})
"""an FP8 KV cache as hf_quant_config.json (kv_cache_quant_algo) and config.json (kv_cache_scheme) say it"""


def _refuse(what: str, source) -> InputError:
    return InputError(f"ModelOpt {what} is not a format ckpttool reads", file=source,
                      fix=f"ckpttool dequantizes ModelOpt {', '.join(ALGOS)} and MIXED_PRECISION of them (NVFP4 in "
                          "groups of 16; an FP8 KV cache's scales are dropped); load this checkpoint with ModelOpt or "
                          "TensorRT-LLM")


def _algos(source, algo, group_size, layers) -> dict[str, list[str]]:
    """quant_algo -> the layers it covers ([]: every layer), refusing what ckpttool does not read."""
    if algo != "MIXED_PRECISION":
        layers = {None: {"quant_algo": algo, "group_size": group_size}}
    elif not isinstance(layers, dict) or not layers:
        raise _refuse("quant_algo MIXED_PRECISION without quantized_layers", source)
    out: dict[str, list[str]] = {}
    for layer, cfg in layers.items():
        cfg = cfg if isinstance(cfg, dict) else {}
        a = cfg.get("quant_algo")
        size = cfg.get("group_size") if cfg.get("group_size") is not None else GROUP_SIZES.get(a)
        if a not in ALGOS:
            raise _refuse(f"quant_algo {a!r}" + (f" (layer {layer})" if layer else ""), source)
        if size != GROUP_SIZES.get(a, size):
            raise _refuse(f"{a} with group_size {size!r}", source)
        out.setdefault(a, []).extend([layer] if layer else [])
    return out


def declared(quant: dict | None, hf_quant: dict | None, config_path, hf_quant_path) -> tuple[Rule, ...]:
    """The rules ModelOpt's config (config.json's quantization_config and/or hf_quant_config.json) declares."""
    found = []  # (source, quant_algo, kv cache, group size, quantized_layers)
    if quant is not None:
        groups = [g for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict)]
        sizes = {(g.get("weights") or {}).get("group_size") for g in groups} - {None}
        found.append((config_path, quant.get("quant_algo"), quant.get("kv_cache_scheme"),
                      sizes.pop() if len(sizes) == 1 else sorted(sizes, key=str) or None, quant.get("quantized_layers")))
    if hf_quant is not None:
        q = hf_quant.get("quantization") if isinstance(hf_quant.get("quantization"), dict) else {}
        found.append((hf_quant_path, q.get("quant_algo"), q.get("kv_cache_quant_algo"), q.get("group_size"),
                      q.get("quantized_layers")))
    if len({str(algo) for _, algo, _, _, _ in found}) > 1:
        raise InputError(f"config.json says quant_algo {found[0][1]!r} but {HF_QUANT_CONFIG} says {found[1][1]!r}",
                         file=config_path, fix=f"one of config.json and {HF_QUANT_CONFIG} is not this checkpoint's")
    for source, algo, kv, size, layers in found:
        if kv and kv not in _KV_FP8:
            raise _refuse(f"KV-cache quantization {kv!r}", source)
        if algo == "MIXED_PRECISION" and source is config_path and hf_quant is not None:
            continue  # its config_groups summarize hf_quant_config.json's quantized_layers, read below
        algos = _algos(source, algo, size if algo != "MIXED_PRECISION" else None, layers)
    ignore = _excluded(quant, hf_quant)
    origin = HF_QUANT_CONFIG if hf_quant is not None else "quantization_config"
    return tuple(Rule(ALGOS[a], f"{origin} quant_algo {a}" if layers else origin, targets=tuple(layers), ignore=ignore)
                 for a, layers in algos.items())


def _excluded(quant: dict | None, hf_quant: dict | None) -> tuple[str, ...]:
    """ModelOpt's `exclude_modules` (hf_quant_config.json) / `ignore` (config.json), as module patterns: its
    `*` wildcards become regular expressions."""
    names = []
    for value in ((hf_quant or {}).get("quantization") or {}).get("exclude_modules"), (quant or {}).get("ignore"):
        if isinstance(value, list):
            names += [v for v in value if isinstance(v, str)]
    return tuple("re:" + ".*".join(map(re.escape, n.split("*"))) + "$" if "*" in n else n for n in names)
