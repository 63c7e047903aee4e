"""Kimi-Linear (kimi_linear): inspect, plan, shard --mp 1/2/4, merge back byte for byte, and verify giving
transformers' own greedy tokens at mp 1 and 2, in transformers' save_pretrained spelling and in the published
one (dense layers under `mlp.`, layer types in `linear_attn_config`); config fields read as transformers'
KimiLinearConfig reads them (its aliases included); what transformers' model does not build refused.

The input is a tiny checkpoint transformers 5 builds and saves itself, every norm and bias perturbed (the
router's correction bias included); the oracle is transformers' generate() on it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import load_dir, run_cli
from family_checks import assert_same_tensors, verify_equals_transformers
from dense_models import NEW_TOKENS, PROMPT, build_hf, greedy_oracle

from ckpttool.errors import InputError, PlanError
from ckpttool.families.kimi_linear import spec

transformers = pytest.importorskip("transformers")

# KDA layers 1 and 3, MLA layers 2 and 4 (1-based, as published), a dense first layer, grouped sigmoid routing
# with a scaling factor; 4 heads of each attention kind, 8 experts.
TINY = dict(cls="KimiLinearForCausalLM", config="KimiLinearConfig", vocab_size=256, hidden_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.0, max_position_embeddings=64, tie_word_embeddings=False,
            linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4, "full_attn_layers": [2, 4],
                                "kda_layers": [1, 3]})
DENSE = ("gate_proj", "up_proj", "down_proj")


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _published(hf, dst):
    """The same weights in the published spelling: the dense layer's MLP under `mlp.`, and a config.json as
    Moonshot's config class writes it (no layer_types or mlp_layer_types: linear_attn_config and
    first_k_dense_replace say them)."""
    shutil.copytree(hf, dst)
    config = {k: v for k, v in _config(dst).items() if k not in ("layer_types", "mlp_layer_types")}
    (dst / "config.json").write_text(json.dumps(config))
    tensors = {n.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): t
               for n, t in load_file(str(hf / "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def kimi_hf(tmp_path_factory) -> dict:
    """spelling -> (HF dir, transformers' greedy ids, their logits)."""
    root = tmp_path_factory.mktemp("kimi_linear")
    hf = build_hf("kimi_linear", root / "transformers", spec=TINY)
    published = _published(hf, root / "hub")
    return {"transformers": (hf, *greedy_oracle(hf)), "hub": (published, *greedy_oracle(published))}


def _equal_files(a, b) -> None:
    original, merged = load_file(str(a)), load_file(str(b))
    assert_same_tensors(original, merged)


def test_config_defaults_are_the_transformers_class_defaults():
    defaults = transformers.KimiLinearConfig()
    for field, value in spec.DEFAULTS.items():
        assert getattr(defaults, field) == value, field
    cfg = spec.KimiLinearConfig.from_dict({"model_type": "kimi_linear"})
    assert (list(cfg.layer_types), list(cfg.mlp_layer_types)) == (defaults.layer_types, defaults.mlp_layer_types)


@pytest.mark.parametrize("given", [
    {},  # the class's defaults
    {"num_experts_per_tok": 3, "n_group": 4, "norm_topk_prob": False, "n_shared_experts": 2, "num_local_experts": 12},
    {"num_experts_per_tok": 3, "num_experts_per_token": 5, "n_group": 4, "num_expert_group": 2},  # the stored name wins
    {"linear_head_dim": 16, "linear_attn_config": {"head_dim": 32, "num_heads": 8}, "first_k_dense_replace": 3},
    {"layer_types": ["linear_attention"] * 26 + ["full_attention"], "linear_attn_config": {"full_attn_layers": [1],
                                                                                          "kda_layers": [2]}},
])
def test_fields_are_read_as_kimi_linear_config_reads_them(given):
    theirs = transformers.KimiLinearConfig.from_dict(dict(given))
    ours = spec.KimiLinearConfig.from_dict({"model_type": "kimi_linear", **given})
    for field in ("num_experts", "num_experts_per_tok", "n_group", "norm_topk_prob", "n_shared_experts", "topk_group",
                  "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim", "intermediate_size",
                  "num_key_value_heads"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (list(ours.layer_types), list(ours.mlp_layer_types)) == (theirs.layer_types, theirs.mlp_layer_types)


@pytest.mark.parametrize("spelling", ["transformers", "hub"])
def test_expected_shapes_are_what_the_checkpoint_holds(kimi_hf, spelling):
    hf = kimi_hf[spelling][0]
    cfg = spec.KimiLinearConfig.from_dict(_config(hf))
    assert cfg.spelling == spelling
    assert spec.hf_tensor_shapes(cfg) == {k: tuple(v.shape) for k, v in load_file(str(hf / "model.safetensors")).items()}


@pytest.mark.parametrize("mp", [1, 2])
@pytest.mark.parametrize("spelling", ["transformers", "hub"])
def test_shard_then_verify_gives_transformers_greedy_tokens(kimi_hf, tmp_path, spelling, mp):
    hf, ids, logits = kimi_hf[spelling]
    out = tmp_path / "mp"
    run_cli("shard", hf, out, "--mp", mp, "--quiet")
    report = verify_equals_transformers(out, hf, ids, logits, tmp_path, PROMPT, NEW_TOKENS)
    assert "KimiLinearForCausalLM" in report.render(out)


@pytest.mark.parametrize("spelling", ["transformers", "hub"])
def test_shard_mp4_then_merge_is_byte_identical_in_its_own_spelling(kimi_hf, tmp_path, spelling):
    hf = kimi_hf[spelling][0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 4, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    _equal_files(hf / "model.safetensors", tmp_path / "hf" / "model.safetensors")


def test_both_attentions_are_cut_on_whole_heads(kimi_hf, tmp_path):
    hf = kimi_hf["hub"][0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 2, "--quiet")
    src, shards = load_file(str(hf / "model.safetensors")), load_dir(tmp_path / "mp")
    for r in range(2):
        s = shards[f"model{r}-mp2.safetensors"]
        kda, mla = "model.layers.0.self_attn.", "model.layers.1.self_attn."
        assert torch.equal(s["layers.0.attn.k_conv1d.weight"], src[kda + "k_conv1d.weight"][r * 16:(r + 1) * 16])
        assert torch.equal(s["layers.0.attn.A_log"], src[kda + "A_log"][:, :, r * 2:(r + 1) * 2])
        assert torch.equal(s["layers.0.attn.f_a_proj.weight"], src[kda + "f_a_proj.weight"])  # low rank: replicated
        assert torch.equal(s["layers.0.feed_forward.w2.weight"], src["model.layers.0.mlp.down_proj.weight"][:, r * 48:(r + 1) * 48])
        assert torch.equal(s["layers.1.attn.kv_b_proj.weight"], src[mla + "kv_b_proj.weight"][r * 64:(r + 1) * 64])
        assert torch.equal(s["layers.1.attn.kv_a_proj_with_mqa.weight"], src[mla + "kv_a_proj_with_mqa.weight"])
        assert torch.equal(s["layers.1.feed_forward.gate.bias"], src["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"])
        assert sorted(n.split(".")[4] for n in s if n.startswith("layers.1.feed_forward.experts.") and n.endswith("w1.weight")) \
            == [str(e) for e in range(r * 4, (r + 1) * 4)]


def test_plan_and_inspect_read_it(kimi_hf):
    hf = kimi_hf["hub"][0]
    assert json.loads(run_cli("inspect", hf, "--json").stdout)["model_type"] == "kimi_linear"
    plan = json.loads(run_cli("plan", hf, "--mp", 4, "--json").stdout)
    assert [f["name"] for f in plan["files"]] == [f"model{r}-mp4.safetensors" for r in range(4)]


def test_mp_that_cuts_a_head_is_refused(kimi_hf, tmp_path):
    proc = run_cli("shard", kimi_hf["hub"][0], tmp_path / "out", "--mp", 8, "--quiet", check=False)
    assert proc.returncode != 0 and "num_attention_heads (4) is not divisible by mp=8" in proc.stderr
    assert not (tmp_path / "out" / "model0-mp8.safetensors").exists()
    cfg = spec.KimiLinearConfig.from_dict({**_config(kimi_hf["hub"][0]),
                                           "linear_attn_config": {**TINY["linear_attn_config"], "num_heads": 2}})
    with pytest.raises(PlanError, match=r"linear_num_heads \(2\) is not divisible by mp=4"):
        spec.check_mp(cfg, 4)


@pytest.mark.parametrize("extra, message", [
    ({"mla_use_output_gate": True}, "mla_use_output_gate"),  # Kimi-K3's text model
    ({"linear_attn_config": {**TINY["linear_attn_config"], "use_full_rank_gate": True}}, "use_full_rank_gate"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"q_lora_rank": 8}, "q_lora_rank"),
    ({"hidden_act": "situ"}, "hidden_act"),
    ({"linear_attn_config": {**TINY["linear_attn_config"], "kda_layers": [1]}}, "layer_types"),
])
def test_what_transformers_does_not_build_is_refused_by_name(kimi_hf, extra, message):
    with pytest.raises(InputError, match=message):
        spec.KimiLinearConfig.from_dict({**_config(kimi_hf["hub"][0]), **extra})
