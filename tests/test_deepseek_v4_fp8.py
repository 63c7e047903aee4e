"""DeepSeek-V4 in its published on-disk form: every linear projection F8_E4M3 with an F8_E8M0 `.scale` per
128x128 block (V4.1: 32x32), the routed experts MXFP4 (`I8`, two e2m1 codes a byte, low nibble first, one
E8M0 `.scale` per 32 values along K), under `quant_method: fp8`, `scale_fmt: ue8m0`, `expert_dtype: fp4`.
The FP8 weights are quantized by transformers' own Fp8Quantize (ue8m0), the experts written in the published
form (tests/fp8_builders.py). `dequant` equals transformers' Fp8Dequantize of every weight bit for bit and
transformers loads its output as plain BF16; `convert --mp N` from it verifies against transformers'
DeepseekV4ForCausalLM of those BF16 weights."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_dir, run_cli
from deepseek_v4_models import PROMPT, build
from fp8_builders import fp8_dequantize, fp8_quantize, mxfp4_quantize
from quant_builders import load_all, write_like

from ckpttool.describe import describe
from ckpttool.families.deepseek_v4.spec import KEY_MAPS
from ckpttool.verify.run import run_verify

transformers = pytest.importorskip("transformers")

WIDE = dict(hidden_size=128, head_dim=128, q_lora_rank=128, o_lora_rank=128, moe_intermediate_size=128,
            index_head_dim=128)
"""every linear dimension a multiple of 128, so that transformers' quantizer tiles each weight whole"""


def _is_expert(name: str) -> bool:
    return ".ffn.experts." in name


def published_form(src, dst, block: int) -> dict[str, str]:
    """src (BF16, DeepSeek's names) with every linear weight FP8 + `.scale` in `block` blocks and the routed
    experts MXFP4, as the hub publishes V4 (block 128) and V4.1 (block 32). Returns weight -> its scale."""
    tensors, file_of = load_all(src)
    scales = {}
    for name in [n for n in tensors if KEY_MAPS["deepseek"].is_linear(n)]:
        w, scale = tensors[name], name[: -len("weight")] + "scale"
        if _is_expert(name):
            tensors[name], tensors[scale] = mxfp4_quantize(w)
        else:
            tensors[name], tensors[scale] = fp8_quantize(w, (block, block), "ue8m0")
            assert tensors[name].dtype == torch.float8_e4m3fn, name  # tiled whole
        file_of[scale] = file_of[name]
        scales[name] = scale
    write_like(src, dst, tensors, file_of)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "scale_fmt": "ue8m0", "weight_block_size": [block, block], "expert_dtype": "fp4"}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return scales


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("v4-fp8")
    bf16 = build(root / "bf16", spelling="deepseek", mtp=True, **WIDE)
    out = {"bf16": bf16}
    for block in (128, 32):
        out[block] = (root / f"fp8-{block}", published_form(bf16, root / f"fp8-{block}", block))
    return out


@pytest.mark.parametrize("block", [128, 32])
def test_inspect_names_both_formats(v4, block):
    src, scales = v4[block]
    q = describe(src)["quantization"]
    experts = sum(_is_expert(n) for n in scales)
    assert q["unsupported"] is None and experts and len(scales) > experts
    assert q["formats"] == {f"FP8 {block}x{block} blocks (E8M0 scales)": len(scales) - experts,
                            "MXFP4 experts (DeepSeek-V4)": experts}


@pytest.mark.parametrize("block", [128, 32])
def test_dequant_equals_transformers_and_loads_as_bf16(v4, block, tmp_path):
    src, scales = v4[block]
    run_cli("dequant", src, tmp_path / "hf", "--quiet")
    stored, _ = load_all(src)
    ours, _ = load_all(tmp_path / "hf")
    assert sorted(ours) == sorted(n for n in stored if n not in scales.values())  # names and MTP kept
    for name, t in ours.items():
        want = fp8_dequantize(stored[name], stored[scales[name]]) if name in scales else stored[name]
        assert t.dtype == want.dtype and torch.equal(t.view(torch.uint8), want.view(torch.uint8)), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.parametrize("block, mp", [(128, 2), (32, 4)])
def test_convert_from_the_published_form_verifies_against_transformers(v4, block, mp, tmp_path):
    src, _ = v4[block]
    run_cli("dequant", src, tmp_path / "reference", "--quiet")
    run_cli("convert", src, tmp_path / "mp", "--mp", mp, "--quiet")
    report = run_verify(tmp_path / "mp", reference=tmp_path / "reference", prompt_ids=PROMPT, max_new_tokens=6)
    text = report.render(tmp_path / "mp")
    assert report.ok and "DeepseekV4ForCausalLM" in text and "greedy ids agree" in text, text
    assert report.max_abs_logit_diff < 1e-3
    # the same shards as from the BF16 form of the same weights, byte for byte
    run_cli("convert", tmp_path / "reference", tmp_path / "from-bf16", "--mp", mp, "--quiet")
    ours, ref = load_dir(tmp_path / "mp"), load_dir(tmp_path / "from-bf16")
    assert ours.keys() == ref.keys()
    for f in ours:
        assert (tmp_path / "mp" / f).read_bytes() == (tmp_path / "from-bf16" / f).read_bytes(), f
