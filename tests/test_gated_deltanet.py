"""Gated DeltaNet hybrids (qwen3_next, qwen3_5_moe_text): inspect, plan, shard --mp 1/2/4, merge back byte for
byte, and verify giving transformers' own greedy tokens at mp 1 and 2; their MTP layers dropped, kept and
merged; the conv (and Qwen3.5's in_proj_qkv) cut on whole key heads as three segments; refusals.

Inputs are tiny checkpoints transformers 5 builds and saves itself, every norm and bias perturbed (the rest is
transformers' random init: A_log, conv, projections); the oracle is transformers' generate() on them.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import load_dir, run_cli
from family_checks import assert_same_tensors, verify_equals_transformers
from dense_models import NEW_TOKENS, PROMPT, build_hf, greedy_oracle, stack_experts

from ckpttool.errors import InputError, PlanError
from ckpttool.families.gated_deltanet import spec
from ckpttool.verify.run import run_verify

transformers = pytest.importorskip("transformers")

_BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=64, linear_num_key_heads=4, linear_num_value_heads=8,
             linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
# Where the types differ: fused per-group projections (qwen3_next) against in_proj_qkv/z/b/a; a dense layer
# among MoE ones, attention biases, a non-default rope_theta and layer types from full_attention_interval
# (qwen3_next); tied embeddings and layer types as a list (qwen3_5_moe_text). Both: KV heads fewer than 4
# (replicated at mp 4), two value heads per key head, a quarter of each head rotated.
TINY = {
    "qwen3_next": dict(cls="Qwen3NextForCausalLM", config="Qwen3NextConfig", intermediate_size=96, mlp_only_layers=[1],
                       full_attention_interval=2, attention_bias=True, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 123456.0, "partial_rotary_factor": 0.25}),
    "qwen3_5_moe_text": dict(cls="Qwen3_5MoeForCausalLM", config="Qwen3_5MoeTextConfig", tie_word_embeddings=True,
                             layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"]),
}


@pytest.fixture(scope="module")
def hybrid_hf(tmp_path_factory) -> dict:
    """model_type -> (HF dir, transformers' greedy ids, their logits), built once."""
    root = tmp_path_factory.mktemp("gated_deltanet")
    out = {}
    for model_type, extra in TINY.items():
        hf = build_hf(model_type, root / model_type, spec={**_BASE, **extra})
        out[model_type] = (hf, *greedy_oracle(hf))
    return out


def _config(hf) -> dict:
    return json.loads((hf / "config.json").read_text())


def _equal_files(a, b) -> None:
    original, merged = load_file(str(a)), load_file(str(b))
    assert_same_tensors(original, merged)


def test_every_type_has_a_tiny_model():
    assert sorted(TINY) == sorted(spec.MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_config_defaults_are_the_transformers_class_defaults(model_type):
    defaults = transformers.CONFIG_MAPPING[model_type]()
    row = spec.TYPES[model_type]
    for field, value in row.defaults.items():
        assert getattr(defaults, field) == value, field
    assert row.default_theta == defaults.rope_parameters["rope_theta"]
    assert row.partial_rotary == defaults.rope_parameters["partial_rotary_factor"]
    cfg = spec.HybridConfig.from_dict({"model_type": model_type})  # every field left to the class
    assert list(cfg.layer_types) == defaults.layer_types
    assert all(cfg.is_moe_layer(i) == (defaults.num_experts > 0) for i in range(cfg.num_hidden_layers))


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_expected_shapes_are_what_transformers_saved(hybrid_hf, model_type):
    hf = hybrid_hf[model_type][0]
    saved = {k: tuple(v.shape) for k, v in load_file(str(hf / "model.safetensors")).items()}
    assert spec.hf_tensor_shapes(spec.HybridConfig.from_dict(_config(hf)), with_mtp=False) == saved


@pytest.mark.parametrize("mp", [1, 2])
@pytest.mark.parametrize("model_type", sorted(TINY))
def test_shard_then_verify_gives_transformers_greedy_tokens(hybrid_hf, tmp_path, model_type, mp):
    hf, ids, logits = hybrid_hf[model_type]
    out = tmp_path / "mp"
    run_cli("shard", hf, out, "--mp", mp, "--quiet")
    report = run_verify(out, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, device="cpu", reference=hf,
                        logits_path=tmp_path / "logits.safetensors")
    assert report.ok, report.render(out)
    assert report.generated_ids == ids
    assert "transformers" in report.render(out)  # the oracle that answered is transformers' own model
    ours = load_file(str(tmp_path / "logits.safetensors"))["logits"]
    # transformers' chunked (prompt) and recurrent (decode) forms of the delta rule differ by ~3e-4 themselves
    assert (ours - logits).abs().max() < 1e-3


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_shard_mp4_then_merge_is_byte_identical_per_tensor(hybrid_hf, tmp_path, model_type):
    hf = hybrid_hf[model_type][0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 4, "--quiet")
    written = _config(tmp_path / "mp")  # what the class defaults, stated for engines with defaults of their own
    theta = (TINY[model_type].get("rope_parameters") or {}).get("rope_theta", 10000.0)
    assert (written["layer_types"], written["partial_rotary_factor"], written["rope_theta"]) == (
        _config(hf)["layer_types"], 0.25, theta)
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    _equal_files(hf / "model.safetensors", tmp_path / "hf" / "model.safetensors")


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_linear_attention_is_cut_on_whole_key_heads(hybrid_hf, tmp_path, model_type):
    """Each rank's conv (and Qwen3.5's in_proj_qkv) is its key heads' q channels, k channels and value heads'
    channels, three tensors cut from the one HF tensor; the fused projections whole key-head groups."""
    hf = hybrid_hf[model_type][0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 2, "--quiet")
    src, shards = load_file(str(hf / "model.safetensors")), load_dir(tmp_path / "mp")
    key, value = 4 * 8, 8 * 8  # linear_num_key_heads x key dim, linear_num_value_heads x value dim
    segments = {"q": (0, key), "k": (key, key), "v": (2 * key, value)}
    hf_names = {"conv": "model.layers.0.linear_attn.conv1d.weight", "in_proj": "model.layers.0.linear_attn.in_proj_qkv.weight"}
    for r in range(2):
        s = shards[f"model{r}-mp2.safetensors"]
        for part, (start, size) in segments.items():
            for kind, hf_name in hf_names.items():
                if hf_name not in src:
                    continue
                mine = s[f"layers.0.linear_attn.{kind}_{part}.weight"]
                assert torch.equal(mine, src[hf_name][start + r * size // 2:start + (r + 1) * size // 2]), (kind, part)
        assert torch.equal(s["layers.0.linear_attn.A_log"], src["model.layers.0.linear_attn.A_log"][r * 4:(r + 1) * 4])
        assert torch.equal(s["layers.0.linear_attn.out_proj.weight"],
                           src["model.layers.0.linear_attn.out_proj.weight"][:, r * 32:(r + 1) * 32])
        if model_type == "qwen3_next":  # per key head: [q 8, k 8, v 2x8, z 2x8] rows
            assert torch.equal(s["layers.0.linear_attn.in_proj_qkvz.weight"],
                               src["model.layers.0.linear_attn.in_proj_qkvz.weight"][r * 96:(r + 1) * 96])
        assert not any("conv1d" in n or "in_proj_qkv." in n for n in s)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_plan_and_inspect_read_hybrid_checkpoints(hybrid_hf, model_type):
    hf = hybrid_hf[model_type][0]
    described = json.loads(run_cli("inspect", hf, "--json").stdout)
    assert described["model_type"] == model_type
    assert described["tensors"] == len(load_file(str(hf / "model.safetensors")))
    plan = json.loads(run_cli("plan", hf, "--mp", 4, "--json").stdout)
    assert [f["name"] for f in plan["files"]] == [f"model{r}-mp4.safetensors" for r in range(4)]


def test_mp_that_cuts_a_head_group_is_refused(hybrid_hf, tmp_path):
    """mp=8 would cut the 4 query heads; 2 linear key heads at mp=4 would part a key head from its value heads."""
    proc = run_cli("shard", hybrid_hf["qwen3_next"][0], tmp_path / "out", "--mp", 8, "--quiet", check=False)
    assert proc.returncode != 0 and "num_attention_heads" in proc.stderr
    assert not (tmp_path / "out" / "model0-mp8.safetensors").exists()
    cfg = spec.HybridConfig.from_dict({**_config(hybrid_hf["qwen3_next"][0]), "linear_num_key_heads": 2})
    spec.check_mp(cfg, 2)
    with pytest.raises(PlanError, match=r"linear_num_key_heads \(2\) is not divisible by mp=4"):
        spec.check_mp(cfg, 4)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_published_dims_plan_up_to_16_ranks(model_type):
    """The class defaults are the published models' dims (Qwen3-Next-80B-A3B, Qwen3.5-35B-A3B): 16 query and
    16 linear key heads, 2 KV heads (replicated past mp 2), 512 or 256 experts."""
    cfg = spec.HybridConfig.from_dict({"model_type": model_type})
    for mp in (1, 2, 4, 8, 16):
        spec.check_mp(cfg, mp)
    with pytest.raises(PlanError, match="num_attention_heads"):
        spec.check_mp(cfg, 32)


def test_stacked_experts_shard_as_the_per_expert_checkpoint(hybrid_hf, tmp_path):
    """transformers 5's in-memory form (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) is read
    as per-expert weights: the same shards, byte for byte."""
    hf = hybrid_hf["qwen3_5_moe_text"][0]
    stacked = tmp_path / "stacked"
    shutil.copytree(hf, stacked)
    save_file(stack_experts(load_file(str(hf / "model.safetensors")), 4), str(stacked / "model.safetensors"),
              metadata={"format": "pt"})
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(str(stacked / "model.safetensors"))
    run_cli("shard", hf, tmp_path / "a", "--mp", 2, "--quiet")
    run_cli("shard", stacked, tmp_path / "b", "--mp", 2, "--quiet")
    for r in range(2):
        _equal_files(tmp_path / "a" / f"model{r}-mp2.safetensors", tmp_path / "b" / f"model{r}-mp2.safetensors")


@pytest.mark.parametrize("field, value, message", [
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("layer_types", ["linear_attention", "sliding_attention", "full_attention", "linear_attention"], "layer_types"),
    ("linear_num_value_heads", 6, "not a multiple of linear_num_key_heads"),
])
def test_configs_it_cannot_run_are_refused_by_name(hybrid_hf, field, value, message):
    with pytest.raises(InputError, match=message):
        spec.HybridConfig.from_dict({**_config(hybrid_hf["qwen3_next"][0]), field: value})


def _with_mtp_layer(hf, dst):
    """A checkpoint as Qwen publishes it: one MTP layer (`mtp.fc`, its norms, a full-attention MoE layer under
    `mtp.layers.0`), which transformers neither builds nor saves, ignoring it on load."""
    shutil.copytree(hf, dst)
    config = _config(dst)
    config["mtp_num_hidden_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(dst / "model.safetensors"))
    cfg = spec.HybridConfig.from_dict(config)
    torch.manual_seed(5)
    for name, shape in spec.hf_tensor_shapes(cfg).items():
        if spec.is_mtp_tensor(cfg, name):
            tensors[name] = torch.randn(shape).to(torch.bfloat16)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_mtp_layer_is_dropped_by_default_kept_on_request_verified_and_merged(hybrid_hf, tmp_path):
    hf, ids, _ = hybrid_hf["qwen3_next"]
    src = _with_mtp_layer(hf, tmp_path / "with_mtp")
    assert any(n.startswith("mtp.layers.0.mlp.experts.3.") for n in load_file(str(src / "model.safetensors")))
    run_cli("shard", src, tmp_path / "dropped", "--mp", 2, "--quiet")
    assert _config(tmp_path / "dropped")["mtp_num_hidden_layers"] == 0
    assert not any(n.startswith("mtp.") for n in load_dir(tmp_path / "dropped")["model0-mp2.safetensors"])

    run_cli("shard", src, tmp_path / "kept", "--mp", 2, "--keep-mtp", "--quiet")
    kept = load_dir(tmp_path / "kept")
    assert "mtp.fc.weight" in kept["model0-mp2.safetensors"]
    assert "mtp.layers.0.feed_forward.experts.3.w2.weight" in kept["model1-mp2.safetensors"]
    report = run_verify(tmp_path / "kept", prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, device="cpu", reference=src)
    assert report.ok, report.render(tmp_path / "kept")
    assert report.generated_ids == ids
    assert "MTP tensor(s) on rank 0 skipped" in report.render(tmp_path / "kept")

    run_cli("merge", tmp_path / "kept", tmp_path / "merged", "--quiet")
    _equal_files(src / "model.safetensors", tmp_path / "merged" / "model.safetensors")

    run_cli("dequant", src, tmp_path / "hf", "--quiet")  # HF layout: nothing to dequantize, MTP kept, names kept
    _equal_files(src / "model.safetensors", tmp_path / "hf" / "model.safetensors")
    assert _config(tmp_path / "hf")["mtp_num_hidden_layers"] == 1


_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
               spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)


@pytest.fixture(scope="module")
def wrapper_hf(tmp_path_factory):
    """Qwen3.5 MoE's multimodal checkpoint as transformers saves it (text tower under model.language_model,
    vision tower model.visual, lm_head), plus an MTP layer at the top (`mtp.*`) as the hub's carry it; with
    transformers' greedy ids (it ignores the MTP layer)."""
    text = {**_BASE, **{k: v for k, v in TINY["qwen3_5_moe_text"].items() if k not in ("cls", "config")},
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                "mrope_section": [1, 1, 0], "mrope_interleaved": True}}
    spec_ = dict(cls="Qwen3_5MoeForConditionalGeneration", config="Qwen3_5MoeConfig", text_config=text,
                 vision_config=_VISION, image_token_id=250, video_token_id=251, vision_start_token_id=252,
                 vision_end_token_id=253)
    hf = build_hf("qwen3_5_moe", tmp_path_factory.mktemp("qwen3_5_moe") / "hf", spec=spec_)
    config = _config(hf)
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (hf / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(hf / "model.safetensors"))
    cfg = spec.HybridConfig.from_dict(config["text_config"])
    torch.manual_seed(7)
    tensors.update({name: torch.randn(shape).to(torch.bfloat16) for name, shape in spec.hf_tensor_shapes(cfg).items()
                    if spec.is_mtp_tensor(cfg, name)})
    save_file(tensors, str(hf / "model.safetensors"), metadata={"format": "pt"})
    return (hf, *greedy_oracle(hf))


def test_multimodal_wrapper_text_tower_verifies_and_the_rest_passes_through(wrapper_hf, tmp_path):
    hf, ids, logits = wrapper_hf
    run_cli("shard", hf, tmp_path / "mp", "--mp", 2, "--quiet")
    shards = load_dir(tmp_path / "mp")
    assert any(n.startswith("model.visual.") for n in shards["model0-mp2.safetensors"])
    assert not any(n.startswith(("model.visual.", "mtp.")) for n in shards["model1-mp2.safetensors"])
    assert _config(tmp_path / "mp")["text_config"]["mtp_num_hidden_layers"] == 0  # MTP dropped from mp outputs
    report = verify_equals_transformers(tmp_path / "mp", hf, ids, logits, tmp_path, PROMPT, NEW_TOKENS)
    rendered = report.render(tmp_path / "mp")  # AutoModelForCausalLM of qwen3_5_moe: its text model, visual ignored
    assert "Qwen3_5MoeForCausalLM" in rendered and "vision tower" in rendered


def test_multimodal_wrapper_merges_back_byte_for_byte_mtp_and_vision_tower_included(wrapper_hf, tmp_path):
    hf = wrapper_hf[0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 4, "--keep-mtp", "--quiet")
    assert "mtp.layers.0.attention.wq.weight" in load_dir(tmp_path / "mp")["model3-mp4.safetensors"]
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    _equal_files(hf / "model.safetensors", tmp_path / "hf" / "model.safetensors")
    run_cli("dequant", hf, tmp_path / "out", "--quiet")  # HF layout: every name kept, the vision tower unchanged
    _equal_files(hf / "model.safetensors", tmp_path / "out" / "model.safetensors")
