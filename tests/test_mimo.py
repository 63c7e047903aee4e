"""MiMo-V2-Flash (`mimo_v2_flash`): inspect, plan, shard --mp 1/2/4 (8 refused: 4 heads), merge back byte for
byte, verify giving transformers' own greedy tokens at mp 1 and 2, and transformers' own form (stacked experts,
`self_attn.sinks`) read as the published one.

The tiny model exercises every way MiMo differs, each of which breaks verify when the bundled model leaves it
out: sliding-window layers (a window of 3, shorter than the prompt) with twice the KV heads and a sink logit
per head beside a full-attention layer, value heads narrower than query/key heads and scaled, a rope theta per
layer kind on a third of each head, grouped sigmoid routing with a correction bias and a scaling factor, a
dense first layer, q/k/v biases. With one KV head per full layer (two per sliding one), mp 2 and 4 replicate
KV heads differently per layer kind. Every parameter is perturbed (tests/dense_models.build_hf).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import load_dir, run_cli
from family_checks import assert_same_tensors, verify_equals_transformers
from dense_models import NEW_TOKENS, PROMPT, build_hf, greedy_oracle

from ckpttool.families.mimo import spec

transformers = pytest.importorskip("transformers")

TINY = dict(cls="MiMoV2FlashForCausalLM", config="MiMoV2FlashConfig", vocab_size=256, hidden_size=64,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=24, v_head_dim=16,
            max_position_embeddings=64, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, sliding_window=3,
            attention_value_scale=0.6, attention_bias=True, tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])


@pytest.fixture(scope="module")
def mimo(tmp_path_factory) -> tuple:
    """(HF dir saved by transformers, its greedy ids, their logits)."""
    hf = build_hf("mimo_v2_flash", tmp_path_factory.mktemp("mimo") / "hf", spec=dict(TINY))
    return (hf, *greedy_oracle(hf))


def _config(hf) -> dict:
    return json.loads((hf / "config.json").read_text())


def test_config_defaults_are_the_transformers_class_defaults():
    import dataclasses

    declared = {f.name: f.default for f in dataclasses.fields(transformers.MiMoV2FlashConfig)}
    assert {k: declared[k] for k in spec.DEFAULTS} == spec.DEFAULTS
    assert transformers.MiMoV2FlashConfig(num_hidden_layers=12).rope_parameters == spec.DEFAULT_ROPE


def test_layer_rules_are_what_transformers_derives():
    """With no per-layer lists in config.json, the rules give transformers' lists."""
    theirs = transformers.MiMoV2FlashConfig(num_hidden_layers=13, sliding_window_size=7)
    ours = spec.MiMoConfig.from_dict({"model_type": "mimo_v2_flash", "num_hidden_layers": 13, "sliding_window_size": 7})
    assert ["sliding_attention" if ours.is_sliding(i) else "full_attention" for i in range(13)] == theirs.layer_types
    assert ["sparse" if ours.is_moe_layer(i) else "dense" for i in range(13)] == theirs.mlp_layer_types
    assert ours.sliding_window == theirs.sliding_window == 8


def test_expected_shapes_are_what_transformers_saved(mimo):
    saved = {k: tuple(v.shape) for k, v in load_file(str(mimo[0] / "model.safetensors")).items()}
    assert spec.hf_tensor_shapes(spec.MiMoConfig.from_dict(_config(mimo[0]))) == saved


@pytest.mark.parametrize("mp", [1, 2])
def test_shard_then_verify_gives_transformers_greedy_tokens(mimo, tmp_path, mp):
    hf, ids, logits = mimo
    run_cli("shard", hf, tmp_path / "mp", "--mp", mp, "--quiet")
    verify_equals_transformers(tmp_path / "mp", hf, ids, logits, tmp_path, PROMPT, NEW_TOKENS)


def test_shard_mp4_replicates_kv_heads_per_layer_kind_and_merges_back_byte_identical(mimo, tmp_path):
    hf = mimo[0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 4, "--quiet")
    src, shards = load_file(str(hf / "model.safetensors")), load_dir(tmp_path / "mp")
    for r in range(4):
        s = shards[f"model{r}-mp4.safetensors"]
        full_k, swa_v = src["model.layers.1.self_attn.k_proj.weight"], src["model.layers.0.self_attn.v_proj.weight"]
        assert torch.equal(s["layers.1.attention.wk.weight"], full_k)  # one KV head: on every rank
        assert torch.equal(s["layers.0.attention.wv.weight"], swa_v[(r // 2) * 16:(r // 2 + 1) * 16])  # two: halves
        assert torch.equal(s["layers.2.attention.sinks"], src["model.layers.2.self_attn.attention_sink_bias"][r:r + 1])
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    merged = load_dir(tmp_path / "hf")["model.safetensors"]
    assert_same_tensors(src, merged)


def test_transformers_own_form_reads_as_the_published_one(mimo, tmp_path):
    """save_original_format=False: experts stacked, the sinks at `self_attn.sinks`; same shard values."""
    hf = mimo[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "own", save_original_format=False)
    saved = load_file(str(tmp_path / "own" / "model.safetensors"))
    assert "model.layers.1.mlp.experts.gate_up_proj" in saved and "model.layers.0.self_attn.sinks" in saved
    run_cli("shard", tmp_path / "own", tmp_path / "a", "--mp", 2, "--quiet")
    run_cli("shard", hf, tmp_path / "b", "--mp", 2, "--quiet")
    a, b = load_dir(tmp_path / "a"), load_dir(tmp_path / "b")
    assert a.keys() == b.keys() and all(a[f].keys() == b[f].keys() for f in a)
    for f in a:  # equal values (transformers saves what it keeps in float32, the router, as F32)
        assert all(torch.equal(a[f][n].float(), b[f][n].float()) for n in a[f]), f


def test_plan_inspect_and_refusals_say_why(mimo, tmp_path):
    hf = mimo[0]
    described = json.loads(run_cli("inspect", hf, "--json").stdout)
    assert described["model_type"] == "mimo_v2_flash" and described["tensors"] == len(load_file(str(hf / "model.safetensors")))
    plan = json.loads(run_cli("plan", hf, "--mp", 2, "--json").stdout)
    assert [f["name"] for f in plan["files"]] == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    proc = run_cli("shard", hf, tmp_path / "out", "--mp", 8, "--quiet", check=False)
    assert proc.returncode != 0 and "4 heads (num_attention_heads) cannot be cut evenly over mp=8" in proc.stderr
    raw = _config(hf)
    with pytest.raises(Exception, match="rope type 'yarn' of full_attention layers is not supported"):
        spec.MiMoConfig.from_dict({**raw, "rope_parameters": {**raw["rope_parameters"], "full_attention": {
            "rope_type": "yarn", "rope_theta": 1.0, "factor": 2.0}}})
    with pytest.raises(Exception, match="layer_types must name each of the 3 layers"):
        spec.MiMoConfig.from_dict({**raw, "layer_types": ["full_attention"]})


def test_quantize_takes_the_linear_projections_of_its_table(mimo):
    from ckpttool.io.checkpoint import Checkpoint
    from ckpttool.plan.build import Spec

    with Checkpoint(mimo[0]) as ckpt:
        plan = Spec(quantize="fp8_block").plan(ckpt)
    quantized = {p.tensor.name for f in plan.files for p in f.tensors if p.tensor.transform == "quantize_fp8_block"}
    assert {f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(8)} <= quantized
    assert {"model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.gate_proj.weight"} <= quantized
    assert not {n for n in quantized if "sink" in n or "gate.weight" in n or "norm" in n or "embed" in n}


def test_index_total_parameters_is_what_transformers_counts(mimo, tmp_path):
    """The router's correction bias is a buffer in transformers' MiMo: merge's index leaves it out."""
    run_cli("shard", mimo[0], tmp_path / "mp", "--mp", 2, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--max-shard-size", "40KB", "--quiet")
    ours = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["metadata"]
    assert ours["total_parameters"] == transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").num_parameters()
