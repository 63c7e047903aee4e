"""HF outputs state the routing and rope fields transformers leaves to its class defaults (Family.explicit_config):
engines read config.json with defaults of their own (vLLM and llama.cpp route a DeepSeek-V3 that lacks
topk_method / scoring_func with softmax). Each stated value must be what transformers reads for the input.
The engines tier (tests/test_engines.py) proves the engines then agree with transformers."""

from __future__ import annotations

import json

import pytest

from conftest import load_dir, run_cli
from engine_cases import MOE, _MOE_BASE, strip_to_what_transformers_needs

from ckpttool.families.deepseek import spec as deepseek_spec
from ckpttool.families.moe import spec as moe_spec

transformers = pytest.importorskip("transformers")


def _transformers_reads(hf) -> object:
    return transformers.AutoConfig.from_pretrained(hf)


def test_dequant_of_a_bare_deepseek_v3_config_states_its_routing_and_rope(tmp_path):
    from ckpttool.families.deepseek.demo import build_checkpoint

    src = build_checkpoint(tmp_path / "v3", "tiny-v3")
    stripped = strip_to_what_transformers_needs(src)
    assert {"topk_method", "scoring_func", "norm_topk_prob", "routed_scaling_factor", "rope_theta"} <= set(stripped)
    run_cli("dequant", src, tmp_path / "bf16", "--quiet")
    out = json.loads((tmp_path / "bf16" / "config.json").read_text())
    ours = _transformers_reads(src)
    assert out["topk_method"] == "noaux_tc" and out["scoring_func"] == "sigmoid"  # what DeepseekV3 hard-codes
    for name in ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor", "n_routed_experts",
                 "num_experts_per_tok", "first_k_dense_replace", "n_shared_experts"):
        assert out[name] == getattr(ours, name), name
    assert out["rope_theta"] == ours.rope_parameters["rope_theta"] == 10000.0
    assert out["rope_scaling"]["type"] == "yarn"  # what config.json said is kept as it said it
    assert "quantization_config" not in out


def test_a_value_config_json_states_is_kept():
    raw = {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "norm_topk_prob": False,
           "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}}
    out = deepseek_spec.explicit_config(raw)
    assert out["norm_topk_prob"] is False and out["n_group"] == 2 and out["rope_theta"] == 50000.0
    assert out["topk_method"] == "noaux_tc" and out["routed_scaling_factor"] == 2.5
    assert {k: out[k] for k in raw} == raw


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_moe_outputs_state_what_transformers_reads(tmp_path, model_type):
    spec = {**_MOE_BASE, **MOE[model_type]}
    config = getattr(transformers, spec.pop("config"))(**{k: v for k, v in spec.items() if k != "cls"})
    config.save_pretrained(tmp_path)
    stripped = strip_to_what_transformers_needs(tmp_path)
    ours = _transformers_reads(tmp_path)
    out = moe_spec.explicit_config(json.loads((tmp_path / "config.json").read_text()))
    for name, value in out.items():
        if name in stripped and hasattr(ours, name):
            assert value == getattr(ours, name), name
    assert out["rope_theta"] == ours.rope_parameters["rope_theta"]
    assert out[moe_spec.TYPES[model_type].top_k[0]] == ours.num_experts_per_tok  # ERNIE's own name: moe_k
    for name, value in moe_spec.TYPES[model_type].hard_coded_routing.items():
        assert out[name] == value, name
    if model_type in ("qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe"):
        assert out["norm_topk_prob"] == ours.norm_topk_prob
    if model_type == "glm4_moe":
        assert (out["n_group"], out["topk_group"], out["routed_scaling_factor"]) == (2, 1, 2.5)
        assert out["partial_rotary_factor"] == ours.rope_parameters["partial_rotary_factor"] == 0.5
    if model_type == "minimax_m2":
        assert out["rotary_dim"] == 16 == ours.rope_parameters["partial_rotary_factor"] * ours.head_dim


def test_shard_and_merge_carry_the_explicit_config(tmp_path):
    from dense_models import build_hf

    src = build_hf("glm4_moe", tmp_path / "glm", spec={**_MOE_BASE, **MOE["glm4_moe"]})
    assert "topk_method" not in json.loads((src / "config.json").read_text())
    run_cli("shard", src, tmp_path / "mp", "--mp", 2, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    for out in (tmp_path / "mp", tmp_path / "hf"):
        config = json.loads((out / "config.json").read_text())
        assert (config["topk_method"], config["scoring_func"], config["rope_theta"]) == ("noaux_tc", "sigmoid", 10000.0)


def test_readme_engines_table_is_the_last_engines_run():
    """docs/engines.md's Engines tables say what tests/engines/report.json (written by `pytest -m engines`) proved."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("engines_table", REPO / "scripts" / "engines_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    report = json.loads(table.REPORT.read_text())
    assert table.readme_block(table.README.read_text()) == table.render(report)
    statuses = {c[e]["status"] for c in report["cases"].values() for e in table.ENGINES}
    assert statuses <= {"equal", "explained", "skipped"}, statuses  # a committed report of a failing run is not a proof
    assert report.get("seeds_per_case", 1) >= 3  # each claim held for several seeds, not one


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_an_unquantized_checkpoint_keeps_its_dtype_and_config_json_says_so(tmp_path, dtype):
    """`convert` (a dequant stage by default) of an F32 or F16 checkpoint with nothing to dequantize copies
    its tensors unchanged: config.json must name their dtype, or transformers loads them as bfloat16."""
    import torch

    from dense_models import build_hf

    bf16 = build_hf("llama", tmp_path / "bf16")
    src = tmp_path / dtype
    model = transformers.AutoModelForCausalLM.from_pretrained(bf16, dtype=getattr(torch, dtype))
    model.save_pretrained(src)
    for args, out in ((["convert"], "hf"), (["convert", "--mp", 2], "mp"), (["dequant"], "dq")):
        run_cli(args[0], src, tmp_path / out, *args[1:], "--quiet")
        config = json.loads((tmp_path / out / "config.json").read_text())
        assert config["torch_dtype"] == config.get("dtype", dtype) == dtype, (args, config)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {getattr(torch, dtype)}


def test_dequantized_fp8_states_the_dtype_it_was_dequantized_to(tiny_v3, tmp_path):
    run_cli("dequant", tiny_v3, tmp_path / "bf16", "--quiet")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    recipe = tmp_path / "f32.yaml"
    recipe.write_text("name: f32\nstages:\n  - dequant: {dtype: fp32}\n")
    run_cli("run", recipe, "-i", tiny_v3, "-o", tmp_path / "f32", "--quiet")
    config = json.loads((tmp_path / "f32" / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and "quantization_config" not in config


def _index_written_by_transformers(model, where) -> dict:
    model.save_pretrained(where, max_shard_size="20KB")  # sharded, so it writes an index
    return json.loads((where / "model.safetensors.index.json").read_text())["metadata"]


@pytest.mark.parametrize("model_type", ["llama", "glm4_moe", "minimax_m2", "mixtral", "ernie4_5_moe"])
def test_index_total_parameters_is_what_transformers_writes(tmp_path, model_type):
    """transformers 5 writes `total_parameters` (model.num_parameters(): buffers such as GLM's and MiniMax-M2's
    router correction bias left out, ERNIE's, a parameter, counted) beside `total_size`; merge's index says the
    same of the same model."""
    from dense_models import build_hf

    spec = None if model_type == "llama" else {**_MOE_BASE, **MOE[model_type]}
    src = build_hf(model_type, tmp_path / "src", spec=spec)
    run_cli("shard", src, tmp_path / "mp", "--mp", 2, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--max-shard-size", "40KB", "--quiet")
    ours = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["metadata"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    theirs = _index_written_by_transformers(model, tmp_path / "saved")
    assert ours["total_parameters"] == theirs["total_parameters"] == model.num_parameters(), (ours, theirs)
    elements = sum(t.numel() for f in load_dir(tmp_path / "hf").values() for t in f.values())
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert ours["total_parameters"] == elements - buffers and (buffers > 0) == (model_type in ("glm4_moe", "minimax_m2"))


def test_dequant_index_counts_parameters_as_transformers_does(tmp_path):
    """DeepSeek-V3 FP8 -> BF16 (its router bias a buffer in transformers; MTP dropped, as transformers has none)."""
    from ckpttool.families.deepseek.demo import build_checkpoint

    src = build_checkpoint(tmp_path / "v3", "tiny-v3")
    run_cli("dequant", src, tmp_path / "bf16", "--drop-mtp", "--quiet")
    ours = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())["metadata"]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert ours["total_parameters"] == _index_written_by_transformers(model, tmp_path / "saved")["total_parameters"]
    assert ours["total_parameters"] == model.num_parameters()


def test_the_engines_tier_writes_no_tracked_file():
    """`pytest -m engines` writes its report where git ignores it; the committed record changes only by
    `scripts/engines_table.py --from REPORT --write`."""
    import shutil
    import subprocess

    import test_engines
    from conftest import REPO

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout (an sdist): nothing is tracked here")
    rel = test_engines.REPORT.relative_to(REPO)
    assert subprocess.run(["git", "check-ignore", "-q", str(rel)], cwd=REPO).returncode == 0, rel
    assert subprocess.run(["git", "ls-files", "--error-unmatch", str(rel)], cwd=REPO,
                          capture_output=True).returncode != 0, rel
