"""plan/dequant.py on its own, without the CLI: each quantized weight resolved against the rules config.json
declares (formats.declared_rules), its side tensors checked, and the dequantized tensor it becomes described; a
tensor that fits no rule, two rules, or a malformed side is refused by name before a byte of weights is read.
Real safetensors files (the demo's FP8 DeepSeek-V3, and small ones written here with torch's float8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpttool.errors import InputError, PlanError
from ckpttool.families.deepseek.spec import is_fp8_in_published_checkpoint
from ckpttool.formats import FP8_QUANTIZATION_CONFIG, SCALE_SUFFIX, declared_rules
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.plan import dequant
from ckpttool.plan.types import TensorPlan

W = "model.layers.0.mlp.down_proj.weight"


def plans(ckpt: Checkpoint) -> list[TensorPlan]:
    return [TensorPlan(n, s.info.dtype, tuple(s.info.shape), source=n, file=s.file) for n, s in sorted(ckpt.tensors.items())]


def rules_of(config: dict):
    return declared_rules(config.get("quantization_config"), None, "config.json")


def written(tmp_path: Path, tensors: dict[str, torch.Tensor], quant: dict | None = None) -> Path:
    """One safetensors file and a config.json declaring `quant` (FP8 128x128 blocks by default)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant or dict(FP8_QUANTIZATION_CONFIG)}))
    return tmp_path


def fp8(rows: int, cols: int) -> torch.Tensor:
    return torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)


def test_demo_fp8_checkpoint_resolves_every_weight_to_its_scale(tiny_v3):
    """Every weight DeepSeek publishes as FP8 is matched with its `weight_scale_inv`, and nothing else."""
    with Checkpoint(tiny_v3) as ckpt:
        tensors, rules = plans(ckpt), rules_of(ckpt.config)
        assert dequant.check_scales(tensors, ckpt, rules) == {}  # no row here plans from tensor data
    found = dequant.matches(tensors, rules)
    weights = {t.name for t in tensors if t.dtype == "F8_E4M3"}
    assert set(found) == weights and all(is_fp8_in_published_checkpoint(n) for n in weights)
    for name, m in found.items():
        assert m.sides == (name + SCALE_SUFFIX,) and m.base == name
    assert dequant.scale_names(tensors, rules) == {n + SCALE_SUFFIX for n in weights}


@pytest.mark.parametrize("out_dtype", ["BF16", "F16"])
def test_dequantized_tensors_replace_weight_and_scale(tiny_v3, out_dtype):
    """Each FP8 weight becomes one `out_dtype` tensor of its shape, made by the row's transform from the weight
    and its scale; the scales disappear; every other tensor passes as it was."""
    with Checkpoint(tiny_v3) as ckpt:
        tensors, rules = plans(ckpt), rules_of(ckpt.config)
    out, n = dequant.dequant(tensors, rules, out_dtype)
    before = {t.name: t for t in tensors}
    fp8_names = {t.name for t in tensors if t.dtype == "F8_E4M3"}
    assert n == len(fp8_names) and len(out) == len(tensors) - n
    for t in out:
        assert not t.name.endswith(SCALE_SUFFIX)
        if t.name in fp8_names:
            assert t.dtype == out_dtype and t.shape == before[t.name].shape and t.source == t.name
            assert t.transform and t.sides == (t.name + SCALE_SUFFIX,)
        else:
            assert t == before[t.name]


def test_nothing_to_dequantize_passes_every_tensor(tmp_path):
    root = written(tmp_path, {W: torch.ones(4, 4, dtype=torch.bfloat16)}, quant={})
    with Checkpoint(root) as ckpt:
        tensors = plans(ckpt)
        out, n = dequant.dequant(tensors, rules_of(ckpt.config))
    assert n == 0 and out == tensors


@pytest.mark.parametrize("scale,why", [
    (torch.ones(2, 3), "scale shape [2, 3] does not match weight shape [256, 256]: expected [2, 2]"),
    (torch.ones(2, 2, dtype=torch.bfloat16), "scale dtype is BF16, expected F32"),
])
def test_a_malformed_scale_is_refused_naming_it(tmp_path, scale, why):
    root = written(tmp_path, {W: fp8(256, 256), W + SCALE_SUFFIX: scale})
    with Checkpoint(root) as ckpt, pytest.raises(InputError) as err:
        dequant.check_scales(plans(ckpt), ckpt, rules_of(ckpt.config))
    assert why in str(err.value) and err.value.tensor == W + SCALE_SUFFIX
    assert Path(err.value.file) == root / "model.safetensors"


def test_an_fp8_weight_without_its_scale_is_refused(tmp_path):
    """No silent fallback: DeepSeek's reference warns and copies the FP8 bytes through as if they were BF16."""
    root = written(tmp_path, {W: fp8(256, 256), "model.norm.weight": torch.ones(256, dtype=torch.bfloat16)})
    with Checkpoint(root) as ckpt, pytest.raises(InputError) as err:
        dequant.check_scales(plans(ckpt), ckpt, rules_of(ckpt.config))
    assert "has no" in str(err.value) and err.value.tensor == W and "re-download" in err.value.fix


def test_a_weight_the_config_leaves_out_is_refused(tmp_path):
    """A module the config excludes (modules_to_not_convert) that is stored quantized anyway: the config does not
    describe this checkpoint, and the error says which module."""
    quant = {**FP8_QUANTIZATION_CONFIG, "modules_to_not_convert": ["down_proj"]}
    root = written(tmp_path, {W: fp8(256, 256), W + SCALE_SUFFIX: torch.ones(2, 2)}, quant=quant)
    with Checkpoint(root) as ckpt, pytest.raises(InputError) as err:
        dequant.check_scales(plans(ckpt), ckpt, rules_of(ckpt.config))
    assert "does not cover module 'model.layers.0.mlp.down_proj'" in str(err.value) and err.value.tensor == W


def test_only_formats_shard_can_lay_out_may_be_kept(tmp_path, tiny_v3):
    """FP8 128x128 blocks can be kept (cut on blocks); fbgemm's per-row FP8 can only be dequantized."""
    with Checkpoint(tiny_v3) as ckpt:
        dequant.refuse_kept(plans(ckpt), rules_of(ckpt.config), "config.json")
    quant = {"quant_method": "fbgemm_fp8"}
    root = written(tmp_path, {W: fp8(256, 256), "model.layers.0.mlp.down_proj.weight_scale": torch.ones(256, 1)},
                   quant=quant)
    with Checkpoint(root) as ckpt:
        tensors, rules = plans(ckpt), rules_of(ckpt.config)
        dequant.check_scales(tensors, ckpt, rules)
    with pytest.raises(PlanError) as err:
        dequant.refuse_kept(tensors, rules, root / "config.json")
    assert "can only be dequantized" in str(err.value) and "--dtype bf16" in err.value.fix
    out, n = dequant.dequant(tensors, rules)
    assert n == 1 and [(t.name, t.dtype, t.shape) for t in out] == [(W, "BF16", (256, 256))]
