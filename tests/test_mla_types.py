"""The MLA family's newer model types, GLM-5 (glm_moe_dsa) and Mistral 4 (mistral4), each a row of
families/deepseek/types.py: inspect, plan, shard --mp 1/2/4, merge back byte for byte, and verify giving
transformers 5.24's own greedy tokens at mp 1 and 2, on tiny models transformers builds and saves in tmp_path
with every parameter perturbed (tests/mla_models.py). Refusals say why."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ckpttool.errors import InputError
from ckpttool.families.deepseek.args import ModelArgs
from ckpttool.families.base import unstack_experts
from ckpttool.families.deepseek.spec import KEY_MAP, DeepseekConfig, hf_tensor_shapes
from ckpttool.families.deepseek.types import TYPES
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.verify.run import run_verify
from conftest import load_dir, run_cli
from mla_models import NEW_TOKENS, PROMPT, TINY, build_hf, config_of, greedy_oracle

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def mla_hf(tmp_path_factory) -> dict:
    """model_type -> (HF dir, transformers' greedy ids), built once."""
    root = tmp_path_factory.mktemp("mla")
    return {t: (hf := build_hf(t, root / t), greedy_oracle(hf)) for t in TINY}


def _config_class(model_type: str):
    return transformers.CONFIG_MAPPING[model_type]


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "mistral4", "kimi_k2"])
def test_config_defaults_are_the_transformers_class_defaults(model_type):
    theirs = _config_class("deepseek_v3" if model_type == "kimi_k2" else model_type)()
    row = TYPES[model_type]
    compared = [k for k in row.defaults if hasattr(theirs, k)]
    assert len(compared) >= 20
    for key in compared:
        assert row.defaults[key] == getattr(theirs, key), key
    if row.default_rope is not None:  # Mistral 4's YaRN where config.json states no rope
        rope = dict(theirs.rope_parameters)
        assert {k: rope[k] for k in row.default_rope} == row.default_rope


def per_expert(hf) -> dict[str, torch.Tensor]:
    """Every tensor transformers saved, its stacked experts (Mistral 4's) read one by one as ckpttool reads them."""
    with Checkpoint(hf) as ckpt:
        cfg = DeepseekConfig.from_dict(ckpt.config)
        unstack_experts(ckpt, KEY_MAP, cfg.n_routed_experts)
        return {name: ckpt.read(name) for name in ckpt.tensors}


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_expected_shapes_are_what_transformers_saved(mla_hf, model_type):
    hf = mla_hf[model_type][0]
    saved = {k: tuple(v.shape) for k, v in per_expert(hf).items()}
    assert hf_tensor_shapes(DeepseekConfig.from_dict(config_of(hf))) == saved


@pytest.mark.parametrize("mp", [1, 2])
@pytest.mark.parametrize("model_type", sorted(TINY))
def test_shard_then_verify_gives_transformers_greedy_tokens(mla_hf, tmp_path, model_type, mp):
    hf, want = mla_hf[model_type]
    run_cli("shard", hf, tmp_path / "mp", "--mp", mp, "--quiet")
    report = run_verify(tmp_path / "mp", reference=hf, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    assert report.ok, report.render(model_type)
    assert report.generated_ids == want
    oracle = "GlmMoeDsaForCausalLM" if model_type == "glm_moe_dsa" else "Mistral4ForCausalLM"
    assert oracle in report.checks["reference"].detail  # transformers answered, not the bundled model


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_shard_mp4_then_merge_is_byte_identical_per_tensor(mla_hf, tmp_path, model_type):
    hf = mla_hf[model_type][0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 4, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    original, merged = per_expert(hf), load_dir(tmp_path / "hf")["model.safetensors"]  # merge writes experts one by one
    assert original.keys() == merged.keys()
    for name, tensor in original.items():
        assert tensor.dtype == merged[name].dtype and torch.equal(tensor, merged[name]), name


def test_glm5_shared_layers_hold_no_indexer_and_the_others_a_replicated_one(mla_hf, tmp_path):
    """index_topk_freq 2: layer 2 reuses layer 1's top-k and has no indexer; every other layer's indexer is
    whole on each rank while MLA's q_b is cut, and the biases of attention_bias are where transformers puts them."""
    hf = mla_hf["glm_moe_dsa"][0]
    assert config_of(hf)["indexer_types"] == ["full", "full", "shared", "full"]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 2, "--quiet")
    ref = load_file(str(hf / "model.safetensors"))
    for r in range(2):
        shard = load_file(str(tmp_path / "mp" / f"model{r}-mp2.safetensors"))
        assert not any(k.startswith("layers.2.attn.indexer.") for k in shard)
        for layer in (0, 1, 3):
            assert torch.equal(shard[f"layers.{layer}.attn.indexer.wq_b.weight"],
                               ref[f"model.layers.{layer}.self_attn.indexer.wq_b.weight"])
        assert shard["layers.1.attn.wq_b.weight"].shape[0] == ref["model.layers.1.self_attn.q_b_proj.weight"].shape[0] // 2
        assert torch.equal(shard["layers.1.attn.wo.bias"], ref["model.layers.1.self_attn.o_proj.bias"])
        assert torch.equal(shard["layers.1.attn.wkv_a.bias"], ref["model.layers.1.self_attn.kv_a_proj_with_mqa.bias"])


def test_mistral4_query_scaling_is_what_verify_checks(mla_hf, tmp_path):
    """Llama-4's query scaling from position 4 on (original_max_position_embeddings 4): shards whose config says
    beta 0 generate without it, and transformers, reading the reference's 0.1, disagrees."""
    hf = mla_hf["mistral4"][0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 2, "--quiet")
    config = json.loads((tmp_path / "mp" / "config.json").read_text())
    config["rope_parameters"]["llama_4_scaling_beta"] = 0.0
    (tmp_path / "mp" / "config.json").write_text(json.dumps(config))
    report = run_verify(tmp_path / "mp", reference=hf, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    assert not report.ok and not report.checks["reference"].ok
    assert report.max_abs_logit_diff > 1e-2


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_plan_and_inspect_read_them_and_mp8_is_refused_by_name(mla_hf, tmp_path, model_type):
    hf = mla_hf[model_type][0]
    described = json.loads(run_cli("inspect", hf, "--json").stdout)
    assert described["model_type"] == model_type
    plan = json.loads(run_cli("plan", hf, "--mp", 2, "--json").stdout)
    assert [f["name"] for f in plan["files"]] == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    proc = run_cli("shard", hf, tmp_path / "out", "--mp", 8, "--quiet", check=False)
    assert proc.returncode != 0 and "num_attention_heads (4) is not divisible by mp=8" in proc.stderr
    assert not (tmp_path / "out" / "model0-mp8.safetensors").exists()


def test_rows_read_what_their_classes_read():
    """The fields a type reads, as its transformers class does: GLM-5's indexer schedule (indexer_types, a
    pattern, or freq / offset), Mistral 4's YaRN default where config.json states no rope."""
    glm = {"model_type": "glm_moe_dsa", **TINY["glm_moe_dsa"], "num_hidden_layers": 6}
    for extra in ({"index_topk_freq": 3, "index_skip_topk_offset": 1}, {"index_topk_pattern": "FSFFSS"},
                  {"indexer_types": ["full", "shared", "shared", "full", "full", "shared"]}):
        raw = {k: v for k, v in {**glm, **extra}.items() if k not in ("cls", "config", "index_topk_freq")} | extra
        theirs = transformers.GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
        ours = DeepseekConfig.from_dict(raw)
        assert [ours.has_indexer(i) for i in range(6)] == [t == "full" for t in theirs.indexer_types], extra
    mistral = {"model_type": "mistral4", **{k: v for k, v in TINY["mistral4"].items()
                                             if k not in ("cls", "config", "rope_parameters")}}
    args = ModelArgs.from_hf_config(mistral)
    theirs = _config_class("mistral4")(**{k: v for k, v in mistral.items() if k != "model_type"})
    assert args.yarn.factor == theirs.rope_parameters["factor"] and args.llama4_beta == 0.1
    assert args.rope_interleave is True and args.score_func == "softmax" and not args.correction_bias


@pytest.mark.parametrize("change, message", [
    ({"model_type": "glm_moe_dsa", "q_lora_rank": None}, "glm_moe_dsa without q_lora_rank is not supported"),
    ({"model_type": "glm_moe_dsa", "indexer_types": ["shared", "full", "full", "full"]},
     "starts with a 'shared' layer"),
    ({"model_type": "glm_moe_dsa", "mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types"),
    ({"model_type": "glm_moe_dsa", "topk_method": "greedy"}, "unsupported routing for GLM-5: topk_method='greedy'"),
    ({"model_type": "mistral4", "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5,
                                                    "original_max_position_embeddings": 4, "llama_4_scaling_beta": 0.1}},
     "partial_rotary_factor 0.5 rotates 12 dims"),
    ({"model_type": "mistral4", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "scales queries by the rope parameters' llama_4_scaling_beta"),
])
def test_what_the_model_does_not_implement_is_refused_by_name(change, message):
    base = {k: v for k, v in TINY[change["model_type"]].items() if k not in ("cls", "config")}
    with pytest.raises(InputError, match=message):
        ModelArgs.from_hf_config({**base, **change})
