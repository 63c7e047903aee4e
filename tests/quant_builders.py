"""Tiny checkpoints in the formats of compressed-tensors and NVIDIA ModelOpt, made by those libraries,
and each library's own decompression as the oracle.

compressed-tensors: scales from its `calculate_qparams` (cast to the model dtype, as llm-compressor's
scale parameters are), tensors from its format compressor's `compress`, config.json's
quantization_config written by its `ModelCompressor.update_config`; the oracle is the same compressor's
`decompress`. ModelOpt quantizes on CPU with `NVFP4QTensor` (what its HF export calls per linear
layer); its `export_hf_checkpoint` needs a calibrated model, so the tensor names, the `.squeeze()` of
weight_scale_2 and hf_quant_config.json follow export/unified_export_hf.py and quant_utils.py, with
config.json's quantization_config from its own `convert_hf_quant_config_format`. Its oracle is
`NVFP4QTensor.dequantize`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

KINDS = ("ct_int4", "ct_fp8_channel", "ct_fp8_tensor", "ct_nvfp4", "modelopt_nvfp4")
CT_FORMAT = {"ct_int4": "pack-quantized", "ct_fp8_channel": "float-quantized", "ct_fp8_tensor": "float-quantized",
             "ct_nvfp4": "nvfp4-pack-quantized"}
EXPERTS = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")  # Kimi-K2-Thinking: routed experts only
LINEAR = re.compile(r"model\.layers\.\d+\..*_proj\.weight")  # llm-compressor's ["Linear"], ignore lm_head


def _args(kind: str, group: int = 32):
    from compressed_tensors.quantization import QuantizationArgs

    return {"ct_int4": lambda: QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                                group_size=group),
            "ct_fp8_channel": lambda: QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"),
            "ct_fp8_tensor": lambda: QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor"),
            "ct_nvfp4": lambda: QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group",
                                                 group_size=16)}[kind]()


def ct_scheme(kind: str, group: int = 32):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    inputs = None
    if kind == "ct_fp8_tensor":  # llm-compressor's FP8 (static): an input_scale per layer
        inputs = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False)
    if kind == "ct_nvfp4":  # NVFP4 W4A4: an input_global_scale per layer
        inputs = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
                                  dynamic=False)
    return QuantizationScheme(targets=["Linear"], weights=_args(kind, group), input_activations=inputs)


def _min_max(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The observer's statistics (llm-compressor's minmax observer) for these args."""
    w = w.float()
    if args.strategy in ("group", "tensor_group"):
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    return w.amin().reshape(1), w.amax().reshape(1)


def ct_compress(w: torch.Tensor, kind: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One Linear's tensors as compressed-tensors stores them (local names: weight_packed, ...)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = ct_scheme(kind)
    mn, mx = _min_max(w, scheme.weights)
    state: dict[str, torch.Tensor] = {"weight": w}
    global_scale = None
    if kind == "ct_nvfp4":
        global_scale = generate_gparam(w.float().amin(), w.float().amax()).reshape(1)
        state["weight_global_scale"] = global_scale
        x = torch.randn(8, w.shape[1], generator=gen)
        state["input_global_scale"] = generate_gparam(x.amin(), x.amax()).reshape(1)
    scale, zero_point = calculate_qparams(mn, mx, scheme.weights, global_scale=global_scale)
    state["weight_scale"] = scale if kind == "ct_nvfp4" else scale.to(w.dtype)
    state["weight_zero_point"] = zero_point
    if kind == "ct_fp8_tensor":
        x = torch.randn(8, w.shape[1], generator=gen)
        state["input_scale"] = calculate_qparams(x.amin().reshape(1), x.amax().reshape(1),
                                                 scheme.input_activations)[0].to(w.dtype)
    out = BaseCompressor.load_from_registry(CT_FORMAT[kind]).compress(state, scheme)
    out.pop("weight_zero_point", None)
    return out


def ct_decompress(tensors: dict[str, torch.Tensor], kind: str, group: int = 32) -> torch.Tensor:
    """The library's own decompression of one Linear's stored tensors."""
    from compressed_tensors.compressors.base import BaseCompressor

    return BaseCompressor.load_from_registry(CT_FORMAT[kind]).decompress(dict(tensors), ct_scheme(kind, group))["weight"]


def modelopt_compress(w: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """What modelopt's _export_quantized_weight registers for an NVFP4 Linear (dynamic weight quantizer)."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    scale_2 = NVFP4QTensor.get_weights_scaling_factor_2(w).squeeze()
    scale = NVFP4QTensor.get_weights_scaling_factor(w, 16, weights_scaling_factor_2=scale_2)[0]
    packed = NVFP4QTensor.quantize(w, 16, scale, scale_2)[0]._quantized_data
    x = torch.randn(8, w.shape[1], generator=gen)
    return {"weight": packed, "weight_scale": scale, "weight_scale_2": scale_2,
            "input_scale": (x.abs().amax().float() / (6.0 * 448.0)).squeeze()}


def modelopt_decompress(tensors: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    q = NVFP4QTensor(torch.Size(shape), torch.bfloat16, tensors["weight"])
    return q.dequantize(dtype=torch.bfloat16, scale=tensors["weight_scale"], double_scale=tensors["weight_scale_2"],
                        block_sizes={-1: 16})


def load_all(src: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of an HF checkpoint, and the file each came from."""
    tensors, file_of = {}, {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                tensors[k], file_of[k] = h.get_tensor(k), f.name
    return tensors, file_of


def write_like(src: Path, dst: Path, tensors: dict[str, torch.Tensor], file_of: dict[str, str]) -> None:
    """dst: src's side files, the tensors in src's file split, and an index."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    files: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        files.setdefault(file_of[name], {})[name] = t.contiguous()
    for fname, part in files.items():
        save_file(part, str(dst / fname), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {n: file_of[n] for n in sorted(tensors)}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))


def copy_changed(src: Path, dst: Path, change=None, config_change=None) -> Path:
    """dst: src written again (`write_like`) after `change(tensors)` (a tensor it adds goes into src's first file)
    and `config_change(quantization_config)` on its config.json: a damaged or misdeclared copy."""
    tensors, file_of = load_all(src)
    if change:
        change(tensors)
        for name in tensors:
            file_of.setdefault(name, next(iter(file_of.values())))
    write_like(src, dst, tensors, file_of)
    if config_change:
        config = json.loads((dst / "config.json").read_text())
        config_change(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def quantize_checkpoint(src: Path, dst: Path, kind: str, pattern: re.Pattern, seed: int = 0) -> dict[str, tuple]:
    """src (BF16) -> dst in `kind`; returns {weight name: its original shape} for the quantized ones."""
    gen = torch.Generator().manual_seed(seed)
    tensors, file_of = load_all(src)
    out, out_file, quantized = {}, {}, {}
    for name, t in tensors.items():
        if not pattern.fullmatch(name):
            out[name], out_file[name] = t, file_of[name]
            continue
        local = ct_compress(t, kind, gen) if kind.startswith("ct_") else modelopt_compress(t, gen)
        for leaf, v in local.items():
            full = name[: -len("weight")] + leaf
            out[full], out_file[full] = v, file_of[name]
        quantized[name] = tuple(t.shape)
    write_like(src, dst, out, out_file)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config))
    if kind.startswith("ct_"):
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import QuantizationConfig

        ignore = ["lm_head"] + ([r"re:.*self_attn.*", r"re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"]
                                if pattern is EXPERTS else [])
        qconfig = QuantizationConfig(config_groups={"group_0": ct_scheme(kind)}, format=CT_FORMAT[kind],
                                     quantization_status="compressed", ignore=ignore)
        ModelCompressor(quantization_config=qconfig).update_config(str(dst))
    else:
        import modelopt
        from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

        hf_quant = {"producer": {"name": "modelopt", "version": modelopt.__version__},
                    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                     "exclude_modules": ["lm_head"]}}
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4))
        config["quantization_config"] = convert_hf_quant_config_format(hf_quant)
        (dst / "config.json").write_text(json.dumps(config, indent=4))
    return quantized


def oracle_weights(dst: Path, kind: str, quantized: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Each quantized weight as its library decompresses it from the files in dst."""
    tensors, _ = load_all(dst)
    out = {}
    for name, shape in quantized.items():
        prefix = name[: -len("weight")]
        local = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        out[name] = ct_decompress(local, kind) if kind.startswith("ct_") else modelopt_decompress(local, shape)
    return out
