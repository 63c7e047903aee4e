"""Issue 16: malformed compressed-tensors / ModelOpt checkpoints and formats ckpttool does not know are
refused with the file, the tensor and the fix, before anything is written (DST never appears); an
unknown quantization_config is never passed through."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from quant_builders import EXPERTS, LINEAR, load_all, quantize_checkpoint, write_like

pytest.importorskip("compressed_tensors")

EXPERT = "model.layers.1.mlp.experts.3.down_proj."
LAYER = "model.layers.1.mlp.down_proj."


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    from dense_models import build_hf

    from ckpttool.families.deepseek.demo import build_checkpoint

    root = tmp_path_factory.mktemp("refused")
    qwen3 = build_hf("qwen3", root / "qwen3")
    v3 = build_checkpoint(root / "v3", "tiny-v3", fp8=False, overrides={"num_nextn_predict_layers": 0})
    out = {}
    for kind in ("ct_int4", "ct_fp8_channel", "ct_nvfp4", "modelopt_nvfp4"):
        if kind.startswith("modelopt"):
            pytest.importorskip("modelopt")
        src, pattern = (v3, EXPERTS) if kind == "ct_int4" else (qwen3, LINEAR)
        quantize_checkpoint(src, root / kind, kind, pattern)
        out[kind] = root / kind
    return out


def edit_tensors(src: Path, dst: Path, change) -> Path:
    tensors, file_of = load_all(src)
    change(tensors, file_of)
    write_like(src, dst, tensors, file_of)
    return dst


def edit_config(src: Path, dst: Path, change, name: str = "config.json") -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / name).read_text())
    change(config)
    (dst / name).write_text(json.dumps(config))
    return dst


def drop(name):
    return lambda t, f: (t.pop(name), f.pop(name))


def put(name, value):
    def change(t, f):
        f.setdefault(name, next(iter(f.values())))
        t[name] = value
    return change


def both(*changes):
    return lambda t, f: [c(t, f) for c in changes]


class ConfigChange:
    """A change of config.json rather than of the tensors."""

    def __init__(self, change):
        self.change = change


def group_size(n):
    return ConfigChange(lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=n))


# (kind, how the tensors or the config change, the message, the tensor it must name)
MALFORMED = {
    "int4 scale missing": ("ct_int4", drop(EXPERT + "weight_scale"), "has no '" + EXPERT + "weight_scale'",
                           EXPERT + "weight_packed"),
    "int4 weight_shape missing": ("ct_int4", drop(EXPERT + "weight_shape"), "has no '" + EXPERT + "weight_shape'",
                                  EXPERT + "weight_packed"),
    "int4 wrong group size": ("ct_int4", group_size(64), "one scale per 64 values", EXPERT.replace("3", "0") +
                              "weight_scale"),
    "int4 weight_shape disagrees": ("ct_int4", put(EXPERT + "weight_shape", torch.tensor([256, 264])),
                                    "says the weight is [256, 264]", EXPERT + "weight_shape"),
    "int4 packed dims not divisible": ("ct_int4", put(EXPERT + "weight_shape", torch.tensor([256, 252])),
                                       "whole int32 words", EXPERT + "weight_shape"),
    "int4 packed columns not whole groups": (
        "ct_int4", both(put(EXPERT + "weight_packed", torch.zeros(256, 30, dtype=torch.int32)),
                        put(EXPERT + "weight_shape", torch.tensor([256, 240]))),
        "not a multiple of the group size 32", EXPERT + "weight_scale"),
    "fp8 scale missing": ("ct_fp8_channel", drop(LAYER + "weight_scale"), "has no '" + LAYER + "weight_scale'",
                          LAYER + "weight"),
    "fp8 scale per tensor under a per-channel config": (
        "ct_fp8_channel", put(LAYER + "weight_scale", torch.ones(1, dtype=torch.bfloat16)), "strategy channel",
        LAYER + "weight_scale"),
    "nvfp4 global scale missing": ("ct_nvfp4", drop(LAYER + "weight_global_scale"),
                                   "has no '" + LAYER + "weight_global_scale'", LAYER + "weight_packed"),
    "nvfp4 scale missing": ("ct_nvfp4", drop(LAYER + "weight_scale"), "has no '" + LAYER + "weight_scale'",
                            LAYER + "weight_packed"),
    "nvfp4 packed dims not divisible": (
        "ct_nvfp4", both(put(LAYER + "weight_packed", torch.zeros(64, 60, dtype=torch.uint8)),
                         put(LAYER + "weight_scale", torch.ones(64, 7).to(torch.float8_e4m3fn))),
        "120 values a row, not a multiple of 16", LAYER + "weight_scale"),
    "nvfp4 scales for groups of 32": (
        "ct_nvfp4", put(LAYER + "weight_scale", torch.ones(64, 4).to(torch.float8_e4m3fn)), "one scale per 16 values",
        LAYER + "weight_scale"),
    "modelopt scale_2 missing": ("modelopt_nvfp4", drop(LAYER + "weight_scale_2"),
                                 "has no '" + LAYER + "weight_scale_2'", LAYER + "weight"),
    "modelopt scale missing": ("modelopt_nvfp4", drop(LAYER + "weight_scale"), "has no '" + LAYER + "weight_scale'",
                               LAYER + "weight"),
    "modelopt scale_2 not one value": ("modelopt_nvfp4", put(LAYER + "weight_scale_2", torch.ones(2)),
                                       "expected one F32 value", LAYER + "weight_scale_2"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_is_refused_naming_file_tensor_and_fix(case, made, tmp_path):
    kind, change, message, tensor = MALFORMED[case]
    src = (edit_config(made[kind], tmp_path / "src", change.change) if isinstance(change, ConfigChange)
           else edit_tensors(made[kind], tmp_path / "src", change))
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0, proc.stdout
    assert message in proc.stderr and f"tensor {tensor!r}" in proc.stderr and "file " + str(src) in proc.stderr
    assert "fix:" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def _scheme(**weights):
    return lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(**weights)


UNKNOWN = {
    "another quant_method": ("ct_fp8_channel", lambda c: c["quantization_config"].update(quant_method="qwerty"),
                             "quant_method 'qwerty' is not a format ckpttool reads"),  # (EETQ & co: by name)
    "another compressed-tensors format": ("ct_int4", lambda c: c["quantization_config"].update(format="marlin-24"),
                                          "format 'marlin-24'"),
    "3-bit packing": ("ct_int4", _scheme(num_bits=3), "3-bit int"),
    "dynamic weights": ("ct_int4", _scheme(dynamic=True), "dynamic weights"),
    "mxfp6": ("ct_nvfp4", lambda c: (c["quantization_config"].update(format="mxfp6-pack-quantized"),
                                     _scheme(num_bits=6, strategy="group", group_size=32)(c)),
              "format 'mxfp6-pack-quantized'"),
    "int blocks": ("ct_int4", _scheme(strategy="block", block_structure=[32, 32], group_size=None), "strategy block"),
    "not yet compressed": ("ct_int4", lambda c: c["quantization_config"].update(quantization_status="frozen"),
                           "quantization_status 'frozen'"),
    "modelopt int8 weights": ("modelopt_nvfp4", lambda c: c["quantization_config"].update(quant_algo="W8A16"),
                              "quant_algo 'W8A16'"),
}


@pytest.mark.parametrize("case", sorted(UNKNOWN))
@pytest.mark.parametrize("command", [("dequant",), ("shard", "--mp", "2")])
def test_unknown_formats_are_refused_by_name(case, command, made, tmp_path):
    kind, change, message = UNKNOWN[case]
    src = edit_config(made[kind], tmp_path / "src", change)
    if kind.startswith("modelopt"):  # both ModelOpt files must say the same; here both say W8A16
        (src / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "W8A16"}}))
    proc = run_cli(command[0], src, tmp_path / "out", *command[1:], check=False)
    assert proc.returncode != 0 and message in proc.stderr and "fix:" in proc.stderr, proc.stderr
    assert "config.json" in proc.stderr and not (tmp_path / "out").exists()
    info = json.loads(run_cli("inspect", src, "--json").stdout)  # inspect still describes it, and says why
    assert message in info["quantization"]["unsupported"]


def test_modelopt_files_that_disagree_are_refused(made, tmp_path):
    src = edit_config(made["modelopt_nvfp4"], tmp_path / "src", lambda c: c["quantization"].update(quant_algo="FP8"),
                      name="hf_quant_config.json")
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and "config.json says quant_algo 'NVFP4' but hf_quant_config.json says 'FP8'" \
        in proc.stderr


def test_nan_scale_codes_are_refused_at_execution_and_nothing_is_published(made, tmp_path):
    def nan(t, f):
        t[LAYER + "weight_scale"] = t[LAYER + "weight_scale"].clone()
        t[LAYER + "weight_scale"].view(torch.uint8)[5, 2] = 0x7F

    src = edit_tensors(made["ct_nvfp4"], tmp_path / "src", nan)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and "row 5" in proc.stderr and f"tensor {LAYER + 'weight_packed'!r}" in proc.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("kind, leaf, value", [("ct_nvfp4", "weight_global_scale", torch.zeros(1)),
                                               ("modelopt_nvfp4", "weight_scale_2", torch.tensor(float("inf")))])
def test_a_global_scale_that_is_not_finite_and_positive_is_refused(kind, leaf, value, made, tmp_path):
    src = edit_tensors(made[kind], tmp_path / "src", put(LAYER + leaf, value))
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and "is not a finite positive number" in proc.stderr
    assert f"tensor {LAYER + leaf!r}" in proc.stderr and "fix:" in proc.stderr
    assert not (tmp_path / "out" / "model.safetensors").exists()
