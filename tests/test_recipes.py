"""Every recipe in recipes/ validates and runs on a tiny model; bad recipes fail naming key and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from ckpttool.errors import RecipeError
from ckpttool.recipe import load_recipe
from conftest import REPO, load_dir, run_cli

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))

# the tiny models have 4 attention heads, so mp 8 would cut heads in half (refused: see
# test_convert.py); the recipes still run end to end with the rank count overridden via --set.
LOCAL_RUNS = {
    "deepseek-v3-bf16.yaml": ("tiny_v3", [], "hf"),
    "deepseek-v3-mp8-bf16.yaml": ("tiny_v3", ["shard.mp=4"], "mp4"),
    "deepseek-v3-mp8-fp8.yaml": ("tiny_v3", ["shard.mp=2"], "mp2"),
    "deepseek-v2-lite-mp.yaml": ("tiny_v2_lite", ["shard.mp=4"], "mp4"),
    "llama-mp.yaml": ("tiny_llama", ["shard.mp=2"], "mp2"),
    "qwen-mp.yaml": ("tiny_qwen2", [], "mp4"),
    "gpt-oss-bf16.yaml": ("tiny_gpt_oss", [], "hf"),
    "gpt-oss-mp.yaml": ("tiny_gpt_oss", [], "mp2"),
    "dense-fp8.yaml": ("tiny_llama", [], "hf"),
}


def test_every_recipe_validates_and_is_exercised():
    assert RECIPES, "no recipes found"
    for path in RECIPES:
        recipe = load_recipe(path)
        assert recipe.name == path.stem, f"{path.name}: name should match the file name"
    hub_recipes = {p.name for p in RECIPES if load_recipe(p).stage("download") is not None}
    assert {p.name for p in RECIPES} - hub_recipes <= set(LOCAL_RUNS), "a local recipe has no test run"


@pytest.mark.parametrize("name", sorted(LOCAL_RUNS))
def test_recipe_runs_on_tiny_model(name, request, tmp_path):
    fixture, sets, expect = LOCAL_RUNS[name]
    src = request.getfixturevalue(fixture)
    args = ["run", REPO / "recipes" / name, "-i", src, "-o", tmp_path / "out", "--quiet"]
    for s in sets:
        args += ["--set", s]
    run_cli(*args)
    files = sorted(load_dir(tmp_path / "out"))
    if expect == "hf":
        assert (tmp_path / "out" / "model.safetensors.index.json").exists()
        assert set(files) <= {p.name for p in src.glob("*.safetensors")}  # HF layout keeps the file names
    else:
        n = int(expect[2:])
        assert files == sorted(f"model{i}-mp{n}.safetensors" for i in range(n))
    recipe = load_recipe(REPO / "recipes" / name)
    was_quantized = "quantization_config" in json.loads((src / "config.json").read_text())
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    # the output config says it is quantized exactly when its weights are
    expected = recipe.stage("quantize") is not None or (was_quantized and recipe.stage("dequant") is None)
    assert ("quantization_config" in config) == expected
    if recipe.stage("quantize") is not None:
        out = {k: v for f in load_dir(tmp_path / "out").values() for k, v in f.items()}
        assert any(t.dtype == torch.float8_e4m3fn for t in out.values())
        assert all(k[: -len("_scale_inv")] in out for k in out if k.endswith("_scale_inv"))


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_unknown_key_is_named_with_its_line(tmp_path):
    p = _write(tmp_path, "name: x\nstages:\n  - shard:\n      mp: 2\n      mpp: 3\n")
    with pytest.raises(RecipeError) as exc:
        load_recipe(p)
    assert "stages.0.shard.mpp" in str(exc.value) and f"{p}:5" in str(exc.value) and "unknown key" in str(exc.value)


def test_a_typo_in_set_is_blamed_on_the_set_not_on_the_recipe_file(tmp_path):
    """`--set shard.mpp=2` on a bundled recipe: the typo is the --set's, and the fix names the key meant."""
    from ckpttool.recipe import BUNDLED

    with pytest.raises(RecipeError) as exc:
        load_recipe("deepseek-v2-lite-mp", ["shard.mpp=2"])
    text = str(exc.value)
    assert text.startswith("--set shard.mpp=2: stages.0.shard.mpp: unknown key (did you mean 'mp'?); allowed: mp"), text
    assert str(BUNDLED) not in text and ".yaml" not in text
    with pytest.raises(RecipeError, match=r"--set execution\.wokers=3: .*did you mean 'workers'\?.*allowed: max_memory, "
                                          r"workers, processes, device"):
        load_recipe("deepseek-v2-lite-mp", ["execution.wokers=3"])


@pytest.mark.parametrize("text, line, meant", [
    ("name: x\nstages:\n  - shrad: {mp: 2}\n", 3, "shard"),
    ("name: x\nstages:\n  - dequant: {}\nexecution: {wokers: 3}\n", 4, "workers"),
    ("name: x\nstages:\n  - dequant: {dtpye: bf16}\n", 3, "dtype"),
    ("name: x\nmpt: keep\nstages:\n  - dequant: {}\n", 2, "mtp"),
])
def test_unknown_keys_get_the_nearest_allowed_key_and_the_list(tmp_path, text, line, meant):
    p = _write(tmp_path, text)
    with pytest.raises(RecipeError) as exc:
        load_recipe(p)
    assert f"{p}:{line}: " in str(exc.value) and f"did you mean {meant!r}?" in str(exc.value), str(exc.value)
    assert "; allowed: " in str(exc.value) and meant in str(exc.value).split("; allowed: ")[1]


def test_unknown_names_get_the_nearest_one(tmp_path):
    with pytest.raises(RecipeError, match="did you mean 'deepseek-v3-mp8-bf16'"):
        load_recipe("deepseek-v3-mp8-bf61")
    with pytest.raises(RecipeError, match="unknown arch 'qwen3_mo' \\(did you mean 'qwen3_moe'\\?\\); use auto or one of"):
        load_recipe(_write(tmp_path, "name: x\narch: qwen3_mo\nstages:\n  - dequant: {}\n"))


@pytest.mark.parametrize("text, needle", [
    ("name: x\nstages:\n  - shard: {mp: 0}\n", "stages.0.shard.mp"),
    ("name: x\nstages:\n  - shard: {mp: 2}\n  - download: {}\n", "download stage must come first"),
    ("name: x\nstages:\n  - dequant: {}\n  - dequant: {}\n", "appears 2 times"),
    ("name: x\nstages:\n  - squash: {}\n", "stages.0.squash"),
    ("name: x\nstages: []\n", "stages"),
    ("name: x\narch: llama9\nstages:\n  - dequant: {}\n", "arch"),
    ("name: x\nstages:\n  - dequant: {dtype: int3}\n", "stages.0.dequant.dtype"),
    ("name: x\nstages:\n  - dequant: {}\nexecution: {max_memory: 1KiB}\n", "max_memory"),
    ("name: x\nstages:\n  - dequant: {}\n  - verify: {}\n", "add a shard stage"),
    ("[1, 2]\n", "YAML mapping"),
    ("name: x\nstages:\n  - {dequant: {}, shard: {mp: 2}}\n", "exactly one key"),
])
def test_invalid_recipes_are_rejected(tmp_path, text, needle):
    with pytest.raises(RecipeError) as exc:
        load_recipe(_write(tmp_path, text))
    assert needle in str(exc.value)


def test_set_overrides_stage_and_execution_keys(tmp_path):
    p = _write(tmp_path, yaml.safe_dump({"name": "x", "stages": [{"dequant": {}}, {"shard": {"mp": 8}}]}))
    r = load_recipe(p, ["shard.mp=2", "execution.workers=3", "mtp=keep"])
    assert r.stage("shard").mp == 2 and r.execution.workers == 3 and r.spec().keep_mtp
    with pytest.raises(RecipeError, match="not key=value"):
        load_recipe(p, ["shard.mp"])
    with pytest.raises(RecipeError, match="stages.1.shard.mp"):
        load_recipe(p, ["shard.mp=banana"])


def test_recipe_arch_must_match_checkpoint(tiny_v2_lite, tmp_path):
    proc = run_cli("run", REPO / "recipes" / "deepseek-v3-mp8-bf16.yaml", "-i", tiny_v2_lite, "-o", tmp_path / "o",
                   check=False)
    assert proc.returncode == 1 and "recipe is for deepseek_v3" in proc.stderr
    assert not (tmp_path / "o").exists()
