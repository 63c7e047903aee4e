"""Checks that need the plan (scales, config vs tensors) fail before any output exists, naming the
file, the tensor and the fix; non-finite scales fail during execution with nothing published."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttool.families.deepseek.demo import build_checkpoint
from conftest import run_cli

W = "model.layers.1.mlp.experts.3.up_proj.weight"
FILE = "model-00002-of-00003.safetensors"  # holds layer 1


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("p") / "ckpt", "tiny-v3", overrides={"num_nextn_predict_layers": 0})


def _edit(pristine, tmp_path, change):
    """Copy the checkpoint, let `change(tensors, config)` edit one shard's tensors and the config,
    and rewrite the index so only the edit differs."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    shard = ckpt / FILE
    tensors = load_file(str(shard))
    config = json.loads((ckpt / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (ckpt / "config.json").write_text(json.dumps(config))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != FILE}
    index["weight_map"].update({k: FILE for k in tensors})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    return ckpt


def _drop(name):
    return lambda t, c: t.pop(name)


def _set(name, value):
    def change(t, c):
        t[name] = value(t[name])
    return change


def _cfg(key, value):
    def change(t, c):
        c[key] = value
    return change


CASES = {
    "weight without its scale": (_drop(W + "_scale_inv"), "has no '" + W + "_scale_inv'", W),
    "scale without its weight": (_drop(W), "scale has no quantized weight", W + "_scale_inv"),
    "scale shape not ceil(M/128) x ceil(N/128)": (_set(W + "_scale_inv", lambda s: torch.ones(3, 2)),
                                                  "does not match weight shape", W + "_scale_inv"),
    "scale dtype not F32": (_set(W + "_scale_inv", lambda s: s.to(torch.bfloat16)), "expected F32", W + "_scale_inv"),
    "scale for a BF16 weight": (_set(W, lambda w: w.to(torch.float32).to(torch.bfloat16)),
                                "scale has no quantized weight", W + "_scale_inv"),
    "config hidden_size contradicts tensors": (_cfg("hidden_size", 512), "contradicts config.json", None),
    "config n_routed_experts too small": (_cfg("n_routed_experts", 4), "not part of the model", None),
    "config n_routed_experts too large": (_cfg("n_routed_experts", 16), "contradicts config.json", None),
    "config q_lora_rank removed": (_cfg("q_lora_rank", None), "not part of the model", None),
    "config more layers than tensors": (_cfg("num_hidden_layers", 5), "absent from the checkpoint", None),
    "unknown model_type": (_cfg("model_type", "llama9"), "unsupported model_type", None),
    "tensor unknown to the architecture": (lambda t, c: t.update({"model.extra.weight": torch.zeros(4)}),
                                           "not part of the model", "model.extra.weight"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_time_errors_name_file_tensor_and_fix(pristine, tmp_path, case):
    change, needle, tensor = CASES[case]
    ckpt = _edit(pristine, tmp_path, change)
    for args in (("dequant",), ("convert", "--mp", "2"), ("shard", "--mp", "2")):
        proc = run_cli(args[0], ckpt, tmp_path / f"out-{args[0]}", *args[1:], check=False)
        assert proc.returncode == 1, proc.stdout
        assert needle in proc.stderr, proc.stderr
        assert "fix:" in proc.stderr
        if tensor:
            assert repr(tensor) in proc.stderr
        assert not (tmp_path / f"out-{args[0]}").exists(), "nothing may be written when planning fails"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_non_finite_or_non_positive_scale_fails_and_publishes_nothing(pristine, tmp_path, bad):
    def change(t, c):
        t[W + "_scale_inv"][0, 0] = bad
    ckpt = _edit(pristine, tmp_path, change)
    proc = run_cli("convert", ckpt, tmp_path / "out", "--mp", "2", check=False)
    assert proc.returncode == 1
    assert "non-finite or non-positive" in proc.stderr and repr(W + "_scale_inv") in proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".ckpttool-partial"]


def test_missing_config_is_named(pristine, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(pristine, ckpt)
    (ckpt / "config.json").unlink()
    proc = run_cli("dequant", ckpt, tmp_path / "out", check=False)
    assert proc.returncode == 1 and "config.json is missing" in proc.stderr and "fix:" in proc.stderr


@pytest.mark.parametrize("mp", [1, 2])
def test_our_own_mp_output_given_as_an_input_is_read_as_the_checkpoint_it_was_cut_from(pristine, tmp_path, mp):
    """mp shards repeat tensor names across ranks (and mp 1 holds native names): the mp layout's row reads them back
    (layouts/mp.py), so every command takes them where it takes an HF checkpoint, with nothing merged first."""
    run_cli("convert", pristine, tmp_path / "mp", "--mp", mp, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "merged", "--quiet")
    for cmd, *rest in (["convert", "--mp", "2"], ["dequant"], ["shard", "--mp", "2"]):
        run_cli(cmd, tmp_path / "mp", tmp_path / f"o-{cmd}", *rest, "--quiet")
        run_cli(cmd, tmp_path / "merged", tmp_path / f"ref-{cmd}", *rest, "--quiet")
        ours, ref = sorted((tmp_path / f"o-{cmd}").glob("*.safetensors")), sorted((tmp_path / f"ref-{cmd}").glob("*.safetensors"))
        if cmd == "dequant":  # HF from mp names its files as merge does: the same names, the same bytes
            assert [p.name for p in ours] == [p.name for p in ref]
        assert [p.read_bytes() for p in ours] == [p.read_bytes() for p in ref], cmd
    proc = run_cli("plan", tmp_path / "mp", "--json")
    assert f"read {mp} mp ranks as one checkpoint" in json.loads(proc.stdout)["notes"]
