"""compressed-tensors 0.20's own output for a preset, no calibration data: the quantize stage's oracle.

The library's path without llm-compressor: `apply_quantization_config` of the preset (targets Linear, ignore the
head) on transformers' model of the BF16 checkpoint, each quantized Linear's scale and zero point from a memoryless
min-max observer (amin / amax per group, block, row or tensor, in the weight's dtype, as llm-compressor's `minmax`
observer computes them for weights; NVFP4's global scale from the whole tensor, `generate_gparam`) through the
library's `calculate_qparams`, then `ModelCompressor.from_pretrained_model(model).compress_model(model)`,
`save_pretrained` and `update_config`: what llm-compressor's `oneshot` + `save_pretrained` writes for a
QuantizationModifier scheme with these statistics.
"""

from __future__ import annotations

from pathlib import Path

import torch

PRESETS = {"w4a16": "W4A16", "w4a16-asym": "W4A16_ASYM", "w8a16": "W8A16", "fp8-channel": "FP8_DYNAMIC",
           "fp8-block": "FP8_BLOCK", "nvfp4a16": "NVFP4A16", "mxfp4": "MXFP4A16"}
"""ckpttool's --to name -> the compressed-tensors preset it writes"""


def _min_max(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy in ("group", "tensor_group"):
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if args.strategy == "block":
        b0, b1 = args.block_structure
        blocks = w.unflatten(0, (-1, b0)).unflatten(-1, (-1, b1))
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    return w.amin().reshape(1), w.amax().reshape(1)


def compress_model(src: Path, dst: Path, fmt: str, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """dst: the library's compressed checkpoint of src under the preset `fmt` stands for."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme(PRESETS[fmt], ["Linear"])
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    args = scheme.weights
    with torch.no_grad():
        for _, module in model.named_modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            w = module.weight
            global_scale = None
            if args.strategy == "tensor_group":
                global_scale = generate_gparam(w.amin(), w.amax())
                module.weight_global_scale.data = global_scale
            scale, zero = calculate_qparams(*_min_max(w, args), args, global_scale=global_scale)
            module.weight_scale.data = scale.to(module.weight_scale.dtype) if args.scale_dtype is None else scale
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    return dst
