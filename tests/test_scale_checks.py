"""Every format's scales are checked the same way (formats.row.bad_row, before any kernel): a NaN or infinite
scale is refused naming the scale, its row and the weight, whatever the format, and nothing is published.
Issue 39 found a compressed-tensors per-channel FP8 weight with an Inf scale written as Inf into the BF16
output (its BF16 scales were tested as if their uint16 bits were numbers), and an INT4 Inf scale called "FP8
weight holds NaN codes"; a packed weight of the wrong dtype was called a scale without its weight."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from quant_builders import EXPERTS, LINEAR, load_all, quantize_checkpoint, write_like

pytest.importorskip("compressed_tensors")

EXPERT = "model.layers.1.mlp.experts.3.down_proj."
LAYER = "model.layers.1.mlp.down_proj."


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from dense_models import build_hf

    from ckpttool.families.deepseek.demo import build_checkpoint
    from ckpttool.families.gpt_oss.demo import build_gpt_oss_checkpoint as build_gpt_oss

    root = tmp_path_factory.mktemp("scales")
    qwen3 = build_hf("qwen3", root / "qwen3")
    v3 = build_checkpoint(root / "v3", "tiny-v3", fp8=False, overrides={"num_nextn_predict_layers": 0})
    quantize_checkpoint(qwen3, root / "ct_fp8_channel", "ct_fp8_channel", LINEAR)
    quantize_checkpoint(v3, root / "ct_int4", "ct_int4", EXPERTS)
    return {"ct_fp8_channel": root / "ct_fp8_channel", "ct_int4": root / "ct_int4",
            "gpt_oss": build_gpt_oss(root / "gpt_oss", mxfp4=True)}


def edited(src, dst, change):
    tensors, file_of = load_all(src)
    change(tensors)
    write_like(src, dst, tensors, file_of)
    return dst


def set_value(name, index, value):
    def change(tensors):
        t = tensors[name].clone()
        t[index] = value
        tensors[name] = t
    return change


BAD = {  # case: (checkpoint, change, scale named, weight named, row)
    "fp8 per channel, +inf": ("ct_fp8_channel", set_value(LAYER + "weight_scale", (5, 0), float("inf")),
                              LAYER + "weight_scale", LAYER + "weight", 5),
    "fp8 per channel, -inf": ("ct_fp8_channel", set_value(LAYER + "weight_scale", (0, 0), float("-inf")),
                              LAYER + "weight_scale", LAYER + "weight", 0),
    "int4, +inf": ("ct_int4", set_value(EXPERT + "weight_scale", (7, 1), float("inf")), EXPERT + "weight_scale",
                   EXPERT + "weight_packed", 7),
    "int4, NaN": ("ct_int4", set_value(EXPERT + "weight_scale", (2, 0), float("nan")), EXPERT + "weight_scale",
                  EXPERT + "weight_packed", 2),
    "mxfp4 gpt-oss, E8M0 0xFF": ("gpt_oss", set_value("model.layers.0.mlp.experts.down_proj_scales", (1, 3, 0), 255),
                                 "model.layers.0.mlp.experts.down_proj_scales",
                                 "model.layers.0.mlp.experts.down_proj_blocks", 1),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_non_finite_scale_is_refused_naming_scale_row_and_weight(case, made, tmp_path):
    kind, change, scale, weight, row = BAD[case]
    src = edited(made[kind], tmp_path / "src", change)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0, proc.stdout
    assert "NaN or infinite values" in proc.stderr and repr(scale) in proc.stderr and f"row {row})" in proc.stderr
    assert f"tensor {weight!r}" in proc.stderr and "NaN codes" not in proc.stderr and "fix:" in proc.stderr
    assert not list((tmp_path / "out").glob("*.safetensors"))


def test_a_packed_weight_of_the_wrong_dtype_is_named_not_its_scale(made, tmp_path):
    def as_bytes(tensors):
        tensors[EXPERT + "weight_packed"] = tensors[EXPERT + "weight_packed"].view(torch.uint8).contiguous()

    src = edited(made["ct_int4"], tmp_path / "src", as_bytes)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and f"{EXPERT + 'weight_packed'!r} is U8" in proc.stderr, proc.stderr
    assert "I32" in proc.stderr and "has no quantized weight" not in proc.stderr
    assert not (tmp_path / "out").exists()
