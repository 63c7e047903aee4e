"""The reference two-pass pipeline, runnable on CPU: FP8 -> BF16 per file with the published
formula (fp8_cast_bf16.py needs CUDA + Triton, so its CPU stand-in is written here from the formula,
independently of ckpttool's kernel), then the unmodified reference convert.py in a subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from conftest import require_seeds


def formula_dequant(w: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    rows, cols = w.shape
    s_full = s.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (w.to(torch.float32) * s_full).to(torch.bfloat16)


def reference_dequant(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    scales = {}
    for name, fname in weight_map.items():
        if name.endswith("_scale_inv"):
            scales[name] = load_file(str(src / fname))[name]
    for f in sorted(src.glob("*.safetensors")):
        out = {}
        for name, t in load_file(str(f)).items():
            if name.endswith("_scale_inv"):
                continue
            out[name] = formula_dequant(t, scales[name + "_scale_inv"]) if t.element_size() == 1 else t
        save_file(out, str(dst / f.name))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def reference_convert(src: Path, dst: Path, mp: int) -> Path:
    seeds = require_seeds()
    n_experts = json.loads((src / "config.json").read_text())["n_routed_experts"]
    subprocess.run([sys.executable, str(seeds / "convert.py"), "--hf-ckpt-path", str(src), "--save-path", str(dst),
                    "--n-experts", str(n_experts), "--model-parallel", str(mp)], check=True, capture_output=True)
    return dst
