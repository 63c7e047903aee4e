"""DeepSeek variants: an MTP layer kept with --keep-mtp passes verify (skipped and said so), and
DeepSeek-V3.1's `scale_fmt: ue8m0` FP8 configs (scales still float32, not powers of two) dequantize
to exactly the block formula, with the quantization section gone from the output config."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from ckpttool.families.deepseek.demo import build_checkpoint
from ckpttool.verify.run import run_verify
from conftest import load_dir, run_cli
from reference_pipeline import formula_dequant


def test_keep_mtp_output_passes_verify_and_says_the_mtp_layer_is_skipped(tiny_v3, tmp_path):
    run_cli("convert", tiny_v3, tmp_path / "mp", "--mp", 2, "--keep-mtp", "--quiet")
    with safe_open(str(tmp_path / "mp" / "model0-mp2.safetensors"), "pt") as f:
        assert any(k.startswith("layers.3.") for k in f.keys())  # the MTP layer is in the shards
    report = run_verify(tmp_path / "mp", reference=tiny_v3, prompt_ids=[0, 5, 9], max_new_tokens=3)
    assert report.ok, report.render("keep-mtp")
    assert "MTP tensor(s) on rank 0 skipped" in report.checks["load"].detail


def test_v31_ue8m0_scale_format_dequantizes_to_the_block_formula(tmp_path):
    src = build_checkpoint(tmp_path / "v31", "tiny-v3", seed=4, overrides={"num_nextn_predict_layers": 0})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "ue8m0"  # DeepSeek-V3.1's config; the scales stay float32
    (src / "config.json").write_text(json.dumps(config))
    tensors = {k: v for f in load_dir(src).values() for k, v in f.items()}
    scales = [v for k, v in tensors.items() if k.endswith("_scale_inv")]
    assert all(s.dtype == torch.float32 for s in scales)
    assert any((torch.log2(s) != torch.log2(s).round()).any() for s in scales)  # not all powers of two

    run_cli("dequant", src, tmp_path / "bf16", "--quiet")
    out = {k: v for f in load_dir(tmp_path / "bf16").values() for k, v in f.items()}
    for name, w in tensors.items():
        if w.dtype == torch.float8_e4m3fn:
            want = formula_dequant(w, tensors[name + "_scale_inv"])
            assert torch.equal(out[name].view(torch.int16), want.view(torch.int16)), name
    assert not any(k.endswith("_scale_inv") for k in out)
    written = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in written and written["torch_dtype"] == "bfloat16"

    run_cli("convert", src, tmp_path / "mp", "--mp", 2, "--quiet")
    report = run_verify(tmp_path / "mp", reference=src, prompt_ids=[0, 5, 9], max_new_tokens=3)
    assert report.ok, report.render("v3.1")
