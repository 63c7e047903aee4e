"""Llama-4's text model (`llama4_text`): inspect, plan, shard --mp 1/2/4 (8 refused: 4 heads), merge back byte
for byte, and verify giving transformers' own greedy tokens at mp 1 and 2.

The tiny model exercises every way Llama-4 differs, each of which breaks verify when the bundled model leaves
it out: stacked experts stored [E, H, 2I] (kept stacked, cut by expert range), dense layers between MoE ones
(`interleave_moe_layer_step`), NoPE layers every second layer, the L2 q/k norm of the RoPE layers, the
attention temperature of the others (a small `floor_scale` so the prompt reaches it), chunked attention
(chunks of 4 positions, shorter than prompt + generation), llama3 RoPE on interleaved pairs, and routing that
scales each token before its expert. Every parameter is perturbed (tests/dense_models.build_hf).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import load_dir, run_cli
from family_checks import assert_same_tensors, verify_equals_transformers
from dense_models import NEW_TOKENS, PROMPT, build_hf, greedy_oracle

from ckpttool.errors import PlanError
from ckpttool.families.llama4 import spec

transformers = pytest.importorskip("transformers")

TINY = dict(cls="Llama4ForCausalLM", config="Llama4TextConfig", vocab_size=256, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, intermediate_size=32,
            intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=2,
            no_rope_layer_interval=2, attention_chunk_size=4, floor_scale=3, attn_scale=0.5,
            tie_word_embeddings=False, rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> tuple:
    """(HF dir saved by transformers, its greedy ids, their logits)."""
    hf = build_hf("llama4_text", tmp_path_factory.mktemp("llama4") / "hf", spec=dict(TINY))
    return (hf, *greedy_oracle(hf))


def _config(hf) -> dict:
    return json.loads((hf / "config.json").read_text())


def test_config_defaults_are_the_transformers_class_defaults():
    import dataclasses

    declared = {f.name: f.default for f in dataclasses.fields(transformers.Llama4TextConfig)}
    assert {k: declared[k] for k in spec.DEFAULTS} == spec.DEFAULTS
    assert spec.DEFAULT_THETA == transformers.Llama4TextConfig.default_theta


def test_layer_rules_are_what_transformers_derives(llama4):
    ours = spec.Llama4Config.from_dict(_config(llama4[0]))
    theirs = transformers.AutoConfig.from_pretrained(llama4[0])
    n = ours.num_hidden_layers
    assert [i for i in range(n) if ours.is_moe_layer(i)] == theirs.moe_layers == [1, 3]
    assert [int(ours.uses_rope(i)) for i in range(n)] == theirs.no_rope_layers == [1, 0, 1, 0]
    assert ["chunked_attention" if ours.chunk(i) else "full_attention" for i in range(n)] == theirs.layer_types


def test_expected_shapes_are_what_transformers_saved(llama4):
    saved = {k: tuple(v.shape) for k, v in load_file(str(llama4[0] / "model.safetensors")).items()}
    assert spec.hf_tensor_shapes(spec.Llama4Config.from_dict(_config(llama4[0]))) == saved


@pytest.mark.parametrize("mp", [1, 2])
def test_shard_then_verify_gives_transformers_greedy_tokens(llama4, tmp_path, mp):
    hf, ids, logits = llama4
    run_cli("shard", hf, tmp_path / "mp", "--mp", mp, "--quiet")
    verify_equals_transformers(tmp_path / "mp", hf, ids, logits, tmp_path, PROMPT, NEW_TOKENS)


def test_shard_mp4_keeps_experts_stacked_by_range_and_merges_back_byte_identical(llama4, tmp_path):
    hf = llama4[0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 4, "--quiet")
    src, shards = load_file(str(hf / "model.safetensors")), load_dir(tmp_path / "mp")
    for r in range(4):
        s = shards[f"model{r}-mp4.safetensors"]
        assert torch.equal(s["layers.1.feed_forward.experts.w13"], src["model.layers.1.feed_forward.experts.gate_up_proj"][r:r + 1])
        assert torch.equal(s["layers.3.feed_forward.experts.w2"], src["model.layers.3.feed_forward.experts.down_proj"][r:r + 1])
        assert torch.equal(s["layers.1.feed_forward.shared_experts.w2.weight"],
                           src["model.layers.1.feed_forward.shared_expert.down_proj.weight"][:, r * 8:(r + 1) * 8])
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    merged = load_dir(tmp_path / "hf")["model.safetensors"]
    assert_same_tensors(src, merged)


def test_plan_and_inspect_read_it_and_refusals_say_why(llama4, tmp_path):
    hf = llama4[0]
    described = json.loads(run_cli("inspect", hf, "--json").stdout)
    assert described["model_type"] == "llama4_text" and described["tensors"] == 45
    plan = json.loads(run_cli("plan", hf, "--mp", 2, "--json").stdout)
    assert [f["name"] for f in plan["files"]] == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    proc = run_cli("shard", hf, tmp_path / "out", "--mp", 8, "--quiet", check=False)
    assert proc.returncode != 0 and "4 heads (num_attention_heads) cannot be cut evenly over mp=8" in proc.stderr
    assert not (tmp_path / "out" / "model0-mp8.safetensors").exists()
    six_experts = spec.Llama4Config.from_dict({**_config(hf), "num_local_experts": 6})
    with pytest.raises(PlanError, match=r"num_local_experts \(6\) is not divisible by mp=4"):
        spec.check_mp(six_experts, 4)


def test_hf_output_states_the_class_defaults_transformers_reads(llama4, tmp_path):
    """An HF output (merge) states the routing and attention fields the input left to the class."""
    hf = llama4[0]
    raw = _config(hf)
    out = spec.explicit_config({k: v for k, v in raw.items() if k not in ("use_qk_norm", "attn_temperature_tuning")})
    theirs = transformers.AutoConfig.from_pretrained(hf)
    for name in spec.EXPLICIT_FIELDS:
        assert out[name] == getattr(theirs, name), name
    assert out["rope_theta"] == 500000.0


def test_the_quantize_stage_refuses_it_by_name(llama4):
    from ckpttool.io.checkpoint import Checkpoint
    from ckpttool.plan.build import Spec

    with Checkpoint(llama4[0]) as ckpt, pytest.raises(PlanError, match="does not support llama4 checkpoints"):
        Spec(quantize="fp8_block").plan(ckpt)


def test_a_config_counting_a_trillion_layers_is_refused_without_expanding_it(llama4, tmp_path):
    import shutil

    shutil.copytree(llama4[0], tmp_path / "huge")
    raw = {**_config(llama4[0]), "num_hidden_layers": 10 ** 12}
    with pytest.raises(Exception, match=r"no_rope_layers lists 4 layers, fewer than num_hidden_layers"):
        spec.Llama4Config.from_dict(raw)  # the per-layer lists transformers saves no longer fit
    raw = {k: v for k, v in raw.items() if k not in ("no_rope_layers", "layer_types", "moe_layers")}
    assert spec.Llama4Config.from_dict(raw).is_moe_layer(10 ** 12 - 1)  # rules, not lists
    (tmp_path / "huge" / "config.json").write_text(json.dumps(raw))
    proc = run_cli("plan", tmp_path / "huge", "--mp", 2, check=False)
    assert proc.returncode != 0 and "num_hidden_layers = 1000000000000 cannot describe" in proc.stderr


def test_index_total_parameters_is_what_transformers_counts(llama4, tmp_path):
    run_cli("shard", llama4[0], tmp_path / "mp", "--mp", 2, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--max-shard-size", "40KB", "--quiet")
    ours = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["metadata"]
    assert ours["total_parameters"] == transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").num_parameters()
