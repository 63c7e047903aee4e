"""compressed-tensors checkpoints beyond issue 16's: zero points, INT8 (packed and int-quantized), act-order,
FP8 groups and blocks, MXFP4, scales in an F16 or F32 model's dtype, and several config groups in one checkpoint.
Written as tests/quant_builders.py writes issue 16's: scales from the library's `calculate_qparams` (cast to the
model's dtype, as llm-compressor's scale parameters are), tensors from its compressor's `compress`, config.json
from its `ModelCompressor.update_config`; the oracle is the same compressor's `decompress`.

Act-order `group` (a `weight_g_idx` per input column) was removed from compressed-tensors in 0.20 (its
QuantizationArgs refuses it); up to 0.12 it quantized and dequantized each column with its group's scale by
sorting the columns by g_idx into contiguous groups and putting them back. So here the columns sorted by g_idx are
quantized by 0.20's own `quantize` in contiguous groups, put back and packed by its `pack_to_int32`; the oracle is
0.20's `decompress` of the sorted columns, put back the same way; config.json says `actorder: group`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from quant_builders import load_all, write_like

SPECS = {  # kind: (format, weights, static input activations or None)
    "int4_asym_g32": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
                      None),
    "int4_asym_channel": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="channel"), None),
    "int4_g32_actorder_weight": ("pack-quantized", dict(num_bits=4, type="int", strategy="group", group_size=32,
                                                         actorder="weight"), None),
    "int8_g32": ("pack-quantized", dict(num_bits=8, type="int", strategy="group", group_size=32), None),
    "int8_asym_g32": ("pack-quantized", dict(num_bits=8, type="int", symmetric=False, strategy="group", group_size=32),
                      None),
    "w8a8_channel": ("int-quantized", dict(num_bits=8, type="int", strategy="channel"),
                     dict(num_bits=8, type="int", strategy="tensor")),
    "w8a8_asym_channel": ("int-quantized", dict(num_bits=8, type="int", symmetric=False, strategy="channel"),
                          dict(num_bits=8, type="int", symmetric=False, strategy="tensor")),
    "w8a8_tensor": ("int-quantized", dict(num_bits=8, type="int", strategy="tensor"), None),
    "fp8_block": ("float-quantized", dict(num_bits=8, type="float", strategy="block", block_structure=[32, 48]), None),
    "fp8_group": ("float-quantized", dict(num_bits=8, type="float", strategy="group", group_size=32), None),
    "fp8_channel": ("float-quantized", dict(num_bits=8, type="float", strategy="channel"), None),
    "mxfp4": ("mxfp4-pack-quantized", dict(num_bits=4, type="float", strategy="group", group_size=32,
                                           scale_dtype=torch.uint8), None),
    "int4_asym_g32_actorder_group": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                                            group_size=32), None),
    "int8_g32_actorder_group": ("pack-quantized", dict(num_bits=8, type="int", strategy="group", group_size=32), None),
}
ACTORDER_GROUP = {k for k in SPECS if k.endswith("actorder_group")}


def scheme(kind: str, targets=("Linear",)):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    fmt, weights, inputs = SPECS[kind]
    return QuantizationScheme(targets=list(targets), weights=QuantizationArgs(**weights), format=fmt,
                              input_activations=None if inputs is None else QuantizationArgs(**inputs, dynamic=False))


def _min_max(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """The minmax observer's statistics for these args (a last partial block padded as the library pads)."""
    w = w.float()
    if args.strategy == "group":
        g = w.unflatten(-1, (-1, args.group_size))
        return g.amin(-1), g.amax(-1)
    if args.strategy == "block":
        b0, b1 = args.block_structure
        rows, cols = -(-w.shape[0] // b0) * b0, -(-w.shape[1] // b1) * b1
        padded = torch.nn.functional.pad(w, (0, cols - w.shape[1], 0, rows - w.shape[0]), value=float(w[0, 0]))
        blocks = padded.reshape(rows // b0, b0, cols // b1, b1)
        return blocks.amin((1, 3)), blocks.amax((1, 3))
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    return w.amin().reshape(1), w.amax().reshape(1)


def _qparams(w: torch.Tensor, args, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from compressed_tensors.quantization.utils import calculate_qparams

    scale, zero = calculate_qparams(*_min_max(w, args), args)
    return {"weight_scale": scale.to(dtype) if args.scale_dtype is None else scale, "weight_zero_point": zero}


def act_order(columns: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """GPTQ's g_idx with act-order: column j's rank in a random activation order, divided by the group size."""
    rank = torch.empty(columns, dtype=torch.int32)
    rank[torch.randperm(columns, generator=gen)] = torch.arange(columns, dtype=torch.int32)
    return rank // group


def compress(w: torch.Tensor, kind: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One Linear's tensors as compressed-tensors stores them (local names)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    s = scheme(kind)
    args = s.weights
    if kind in ACTORDER_GROUP:  # sorted by g_idx, quantized in contiguous groups, put back, packed
        g_idx = act_order(w.shape[1], args.group_size, gen)
        order = torch.argsort(g_idx, stable=True)
        state = _qparams(w[:, order], args, w.dtype)
        q = quantize(w[:, order], state["weight_scale"], state["weight_zero_point"], args, dtype=torch.int8)
        out = {"weight_packed": pack_to_int32(q[:, torch.argsort(order)].contiguous(), args.num_bits),
               "weight_scale": state["weight_scale"], "weight_shape": torch.tensor(w.shape), "weight_g_idx": g_idx}
        if not args.symmetric:
            out["weight_zero_point"] = pack_to_int32(state["weight_zero_point"], args.num_bits, packed_dim=0)
        return out
    state = {"weight": w, **_qparams(w, args, w.dtype)}
    if s.input_activations is not None:  # a static input scale (and zero point) per layer
        x = torch.randn(8, w.shape[1], generator=gen)
        scale, zero = calculate_qparams(x.amin().reshape(1), x.amax().reshape(1), s.input_activations)
        state.update(input_scale=scale.to(w.dtype), input_zero_point=zero)
    out = BaseCompressor.get_value_from_registry(s.format).compress(state, s)
    if args.symmetric:
        out.pop("weight_zero_point", None)
    if s.input_activations is not None and s.input_activations.symmetric:
        out.pop("input_zero_point", None)
    return out


def decompress(tensors: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    """The library's own decompression of one Linear's stored tensors (act-order: of the sorted columns)."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    s = scheme(kind)
    state = dict(tensors)
    g_idx = state.pop("weight_g_idx", None)
    if g_idx is None:
        return BaseCompressor.get_value_from_registry(s.format).decompress(state, s)["weight"]
    order = torch.argsort(g_idx, stable=True)
    bits, shape = s.weights.num_bits, torch.Size(state["weight_shape"].tolist())
    q = unpack_from_int32(state["weight_packed"], bits, shape)
    state["weight_packed"] = pack_to_int32(q[:, order].contiguous(), bits)
    return BaseCompressor.get_value_from_registry(s.format).decompress(state, s)["weight"][:, torch.argsort(order)]


def retyped(src: Path, dst: Path, dtype: torch.dtype) -> Path:
    """src with every float tensor cast to dtype, and config.json saying so (an F16 or F32 model)."""
    tensors, file_of = load_all(src)
    write_like(src, dst, {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}, file_of)
    config = json.loads((dst / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def quantize_checkpoint(src: Path, dst: Path, groups: dict[str, re.Pattern], seed: int = 0,
                        ignore: tuple[str, ...] = ("lm_head",)) -> dict[str, tuple[str, tuple]]:
    """src -> dst with the weights each pattern matches in that kind (one config group per kind, its targets the
    modules it quantized); returns {weight name: (kind, shape)} of the quantized ones."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    gen = torch.Generator().manual_seed(seed)
    tensors, file_of = load_all(src)
    out, out_file, made = {}, {}, {}
    for name, t in tensors.items():
        kind = next((k for k, pattern in groups.items() if pattern.fullmatch(name)), None)
        if kind is None:
            out[name], out_file[name] = t, file_of[name]
            continue
        for leaf, v in compress(t, kind, gen).items():
            full = name[: -len("weight")] + leaf
            out[full], out_file[full] = v.contiguous(), file_of[name]
        made[name] = (kind, tuple(t.shape))
    write_like(src, dst, out, out_file)
    config_groups = {}
    for i, kind in enumerate(groups):
        modules = sorted(re.escape(n[: -len(".weight")]) for n, (k, _) in made.items() if k == kind)
        config_groups[f"group_{i}"] = scheme(kind, targets=["re:(" + "|".join(modules) + ")$"])
    formats = {s.format for s in config_groups.values()}
    qconfig = QuantizationConfig(config_groups=config_groups, quantization_status="compressed", ignore=list(ignore),
                                 format=formats.pop() if len(formats) == 1 else "mixed-precision")
    ModelCompressor(quantization_config=qconfig).update_config(str(dst))
    config = json.loads((dst / "config.json").read_text())
    for i, kind in enumerate(groups):  # 0.20 no longer writes it; 0.12 wrote `actorder: group` with the g_idx
        if kind in ACTORDER_GROUP:
            config["quantization_config"]["config_groups"][f"group_{i}"]["weights"]["actorder"] = "group"
    (dst / "config.json").write_text(json.dumps(config))
    return made


def oracle_weights(dst: Path, made: dict[str, tuple[str, tuple]]) -> dict[str, torch.Tensor]:
    """Each quantized weight as the library decompresses it from the files in dst."""
    tensors, _ = load_all(dst)
    out = {}
    for name, (kind, _) in made.items():
        prefix = name[: -len("weight")]
        local = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        local = {k: v for k, v in local.items() if not k.startswith("input_")}
        out[name] = decompress(local, kind)
    return out
