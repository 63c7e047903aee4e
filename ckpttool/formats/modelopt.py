"""NVIDIA ModelOpt's NVFP4 (`hf_quant_config.json` quant_algo NVFP4; newer exports also embed it in
config.json as `quantization_config` with `quant_method: modelopt`).

  modelopt_nvfp4  W.weight (U8 [M, N/2]) + W.weight_scale (F8_E4M3 [M, N/16]) + W.weight_scale_2 (F32)
                  -> W.weight [M, N]; W.input_scale (F32) dropped

weight_scale_2 is the reciprocal of compressed-tensors' global scale and multiplies where
compressed-tensors divides: the formula is in kernels/nvfp4_cpu.py.
"""

from __future__ import annotations

import re

from ckpttool.errors import InputError
from ckpttool.formats.compressed import nvfp4_row
from ckpttool.formats.resolve import Rule
from ckpttool.formats.row import Name

METHOD = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"
"""ModelOpt's own description of the checkpoint: copied unchanged unless the weights are dequantized"""
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")  # the same weight tensors; W4A16 has no input_scale


MODELOPT_NVFP4 = nvfp4_row("modelopt", name="modelopt_nvfp4", title="NVIDIA ModelOpt NVFP4", values=Name("weight"),
                           global_leaf="weight_scale_2", dropped="input_scale")
ROWS = (MODELOPT_NVFP4,)


def _refuse(what: str, source) -> InputError:
    return InputError(f"ModelOpt {what} is not a format ckpttool reads", file=source,
                      fix=f"ckpttool dequantizes ModelOpt {' and '.join(NVFP4_ALGOS)} (group 16, no KV-cache "
                          "quantization); load this checkpoint with ModelOpt or TensorRT-LLM")


def declared(quant: dict | None, hf_quant: dict | None, config_path, hf_quant_path) -> tuple[Rule, ...]:
    """The rules ModelOpt's config (config.json's quantization_config and/or hf_quant_config.json) declares."""
    found = []
    if quant is not None:
        groups = quant.get("config_groups") or {}
        sizes = {(g.get("weights") or {}).get("group_size") for g in groups.values() if isinstance(g, dict)}
        found.append((config_path, quant.get("quant_algo"), quant.get("kv_cache_scheme"), sizes or {16}))
    if hf_quant is not None:
        q = hf_quant.get("quantization") if isinstance(hf_quant.get("quantization"), dict) else {}
        found.append((hf_quant_path, q.get("quant_algo"), q.get("kv_cache_quant_algo"), {q.get("group_size", 16)}))
    if len({algo for _, algo, _, _ in found}) > 1:
        raise InputError(f"config.json says quant_algo {found[0][1]!r} but {HF_QUANT_CONFIG} says {found[1][1]!r}",
                         file=config_path, fix=f"one of config.json and {HF_QUANT_CONFIG} is not this checkpoint's")
    for source, algo, kv, sizes in found:
        if algo not in NVFP4_ALGOS:
            raise _refuse(f"quant_algo {algo!r}", source)
        if kv:
            raise _refuse(f"KV-cache quantization {kv!r}", source)
        if sizes != {16}:
            raise _refuse(f"{algo} with group_size {sorted(sizes, key=str)}", source)
    ignore = _excluded(quant, hf_quant)
    origin = HF_QUANT_CONFIG if hf_quant is not None else "quantization_config"
    return tuple(Rule(row, origin, ignore=ignore) for row in ROWS)


def _excluded(quant: dict | None, hf_quant: dict | None) -> tuple[str, ...]:
    """ModelOpt's `exclude_modules` (hf_quant_config.json) / `ignore` (config.json), as module patterns: its
    `*` wildcards become regular expressions."""
    names = []
    for value in ((hf_quant or {}).get("quantization") or {}).get("exclude_modules"), (quant or {}).get("ignore"):
        if isinstance(value, list):
            names += [v for v in value if isinstance(v, str)]
    return tuple("re:" + ".*".join(map(re.escape, n.split("*"))) + "$" if "*" in n else n for n in names)
