"""quantize refuses a weight holding NaN or Inf, in every format that quantizes float weights: no scale is written
from it (a min-max scale of NaN or Inf poisons its whole group, block or row, and engines load it silently). The
run names the tensor, the first bad row and column, exits non-zero, and publishes nothing under DST."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from dense_models import BLOCK_LLAMA, build_hf
from quant_builders import load_all, write_like

from ckpttool.errors import InputError
from ckpttool.formats.outputs import CT_TARGETS, FP8_BLOCK_DEEPSEEK
from ckpttool.plan.build import Spec
from ckpttool.runner import ExecOptions, convert

FLOAT_FORMATS = (*(t.name for t in CT_TARGETS), FP8_BLOCK_DEEPSEEK.name, "int8", "int4")
WEIGHT = "model.layers.0.mlp.up_proj.weight"  # [512, 256]
ROW, COL = 200, 37


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_hf("llama", tmp_path_factory.mktemp("nonfinite") / "llama", seed=4, spec=BLOCK_LLAMA)


def _poisoned(src, dst, value: float):
    tensors, file_of = load_all(src)
    w = tensors[WEIGHT].clone()
    assert w.shape == (512, 256) and w.dtype == torch.bfloat16
    w[ROW, COL] = value
    tensors[WEIGHT] = w
    write_like(src, dst, tensors, file_of)
    return dst


@pytest.fixture(scope="module")
def poisoned(llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("poisoned")
    return {kind: _poisoned(llama, root / kind, value)
            for kind, value in (("nan", float("nan")), ("inf", float("inf")), ("-inf", -float("inf")))}


def _published(dst) -> list:
    return [p for p in dst.rglob("*") if p.suffix == ".safetensors" and ".ckpttool-partial" not in p.parts] \
        if dst.exists() else []


@pytest.mark.parametrize("fmt", FLOAT_FORMATS)
def test_nan_weight_is_refused_by_tensor_in_every_format(poisoned, llama, fmt, tmp_path):
    run_cli("quantize", llama, tmp_path / "clean", "--to", fmt, "--quiet")  # the same weights, finite: it runs
    proc = run_cli("quantize", poisoned["nan"], tmp_path / "out", "--to", fmt, check=False)
    assert proc.returncode != 0, proc.stdout
    assert "NaN or Inf" in proc.stderr and WEIGHT in proc.stderr, proc.stderr
    assert f"row {ROW}, column {COL}" in proc.stderr, proc.stderr
    assert not _published(tmp_path / "out")


@pytest.mark.parametrize("kind", ["inf", "-inf"])
@pytest.mark.parametrize("fmt", ["w4a16", "nvfp4a16", "fp8-block-deepseek", "int4"])
def test_inf_weight_is_refused_by_tensor(poisoned, fmt, kind, tmp_path):
    proc = run_cli("quantize", poisoned[kind], tmp_path / "out", "--to", fmt, check=False)
    assert proc.returncode != 0 and "NaN or Inf" in proc.stderr and WEIGHT in proc.stderr, proc.stderr
    assert not _published(tmp_path / "out")


@pytest.mark.parametrize("fmt", ["w8a16", "fp8-block"])
def test_the_row_is_the_tensors_in_runs_of_a_few_rows(poisoned, fmt, tmp_path):
    """Streamed in runs of 2 KiB, the NaN lies in a later run: the row named is still the tensor's."""
    with pytest.raises(InputError) as err:
        convert(poisoned["nan"], tmp_path / "out", Spec(quantize=fmt),
                ExecOptions(quiet=True, workers=1, chunk_bytes=2048))
    assert f"row {ROW}, column {COL}" in str(err.value) and WEIGHT in str(err.value), str(err.value)
    assert not _published(tmp_path / "out")
