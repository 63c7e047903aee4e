"""MoE families with Llama-style attention (qwen2_moe, qwen3_moe, mixtral, olmoe, glm4_moe, minimax_m2, ernie4_5_moe):
inspect, plan, shard --mp N, merge back byte-identical, and verify giving transformers' own greedy tokens.

Inputs are tiny checkpoints saved by transformers 5 itself, with non-trivial norms, biases and router
correction biases; the oracle is transformers' generate() on them.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import load_dir, run_cli
from family_checks import assert_same_tensors, verify_equals_transformers
from dense_models import NEW_TOKENS, PROMPT, build_hf, greedy_oracle

from ckpttool.families.moe import spec
from ckpttool.verify.run import run_verify

transformers = pytest.importorskip("transformers")

_BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64,
             tie_word_embeddings=False)
# Each tiny model differs where its family differs: GQA against MHA, dense layers among MoE ones, shared
# experts and their gate, sigmoid routing with a correction bias and expert groups, partial rotary,
# q/k norms per head and across all heads, qkv biases, clip_qkv, a non-default rope_theta; ERNIE's MoE layers
# between a start and an end index, interleaved rope, biases on every projection and on the tied head, and its
# router bias stored [1, experts].
TINY = {
    "qwen3_moe": dict(cls="Qwen3MoeForCausalLM", config="Qwen3MoeConfig", num_key_value_heads=2, head_dim=32,
                      intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[1], rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1234567.0}),
    "qwen2_moe": dict(cls="Qwen2MoeForCausalLM", config="Qwen2MoeConfig", num_key_value_heads=2,
                      intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(cls="MixtralForCausalLM", config="MixtralConfig", num_key_value_heads=2, intermediate_size=32,
                    num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(cls="OlmoeForCausalLM", config="OlmoeConfig", num_key_value_heads=4, intermediate_size=32,
                  num_experts=4, num_experts_per_tok=2, clip_qkv=3.0),
    "glm4_moe": dict(cls="Glm4MoeForCausalLM", config="Glm4MoeConfig", num_key_value_heads=2, head_dim=16,
                     intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                     n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, use_qk_norm=True,
                     attention_bias=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0),
    "minimax_m2": dict(cls="MiniMaxM2ForCausalLM", config="MiniMaxM2Config", num_key_value_heads=2, head_dim=16,
                       intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, rotary_dim=8),
    "ernie4_5_moe": dict(cls="Ernie4_5_MoeForCausalLM", config="Ernie4_5_MoeConfig", num_key_value_heads=2,
                         intermediate_size=96, moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
                         moe_num_shared_experts=1, moe_layer_end_index=1, use_bias=True, tie_word_embeddings=True),
}


@pytest.fixture(scope="session")
def moe_hf(tmp_path_factory) -> dict:
    """model_type -> (HF dir, transformers' greedy ids, their logits), built once."""
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for model_type, extra in TINY.items():
        hf = build_hf(model_type, root / model_type, spec={**_BASE, **extra})
        out[model_type] = (hf, *greedy_oracle(hf))
    return out


def test_every_moe_type_has_a_tiny_model():
    assert sorted(TINY) == sorted(spec.MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_config_defaults_are_the_transformers_class_defaults(model_type):
    """What a config.json that leaves a field out means: what an instance of the class holds, or the class's
    declared default where the reader derives the rest as __post_init__ does (ERNIE's moe_layer_end_index = -1,
    the last layer)."""
    import dataclasses

    cls = transformers.CONFIG_MAPPING[model_type]
    declared = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    defaults = cls()
    row = spec.TYPES[model_type]
    for field, value in row.defaults.items():
        assert value in (getattr(defaults, field), declared.get(field, dataclasses.MISSING)), field
    assert row.default_theta == defaults.rope_parameters["rope_theta"]
    assert (row.partial_rotary or 1.0) == defaults.rope_parameters.get("partial_rotary_factor", 1.0)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_expected_shapes_are_what_transformers_saved(moe_hf, model_type):
    hf = moe_hf[model_type][0]
    saved = {k: tuple(v.shape) for k, v in load_file(str(hf / "model.safetensors")).items()}
    cfg = spec.MoeConfig.from_dict(json.loads((hf / "config.json").read_text()))
    assert spec.hf_tensor_shapes(cfg) == saved


@pytest.mark.parametrize("mp", [1, 2])
@pytest.mark.parametrize("model_type", sorted(TINY))
def test_shard_then_verify_gives_transformers_greedy_tokens(moe_hf, tmp_path, model_type, mp):
    hf, ids, logits = moe_hf[model_type]
    out = tmp_path / "mp"
    run_cli("shard", hf, out, "--mp", mp, "--quiet")
    verify_equals_transformers(out, hf, ids, logits, tmp_path, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_shard_mp4_then_merge_is_byte_identical_per_tensor(moe_hf, tmp_path, model_type):
    hf = moe_hf[model_type][0]
    mp = 2 if model_type == "minimax_m2" else 4  # MiniMax-M2's k norm spans its 2 KV heads: mp must divide them
    run_cli("shard", hf, tmp_path / "mp", "--mp", mp, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    original, merged = load_file(str(hf / "model.safetensors")), load_dir(tmp_path / "hf")["model.safetensors"]
    assert_same_tensors(original, merged)


def test_routed_experts_go_whole_to_their_rank_and_full_qk_norm_is_cut_on_heads(moe_hf, tmp_path):
    hf = moe_hf["olmoe"][0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 4, "--quiet")
    src, shards = load_file(str(hf / "model.safetensors")), load_dir(tmp_path / "mp")
    d = 64 // 4
    for r in range(4):
        s = shards[f"model{r}-mp4.safetensors"]
        assert torch.equal(s[f"layers.0.feed_forward.experts.{r}.w1.weight"],
                           src[f"model.layers.0.mlp.experts.{r}.gate_proj.weight"])
        assert not any(f"experts.{e}." in n for n in s for e in range(4) if e != r)
        assert torch.equal(s["layers.2.attention.q_norm.weight"], src["model.layers.2.self_attn.q_norm.weight"][r * d:(r + 1) * d])
        assert torch.equal(s["layers.2.attention.k_norm.weight"], src["model.layers.2.self_attn.k_norm.weight"][r * d:(r + 1) * d])


def test_mixtral_names_map_to_the_common_layout(moe_hf, tmp_path):
    hf = moe_hf["minimax_m2"][0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 2, "--quiet")
    src, s = load_file(str(hf / "model.safetensors")), load_dir(tmp_path / "mp")["model1-mp2.safetensors"]
    assert torch.equal(s["layers.1.feed_forward.experts.3.w3.weight"], src["model.layers.1.block_sparse_moe.experts.3.w3.weight"])
    assert torch.equal(s["layers.1.feed_forward.gate.bias"], src["model.layers.1.block_sparse_moe.e_score_correction_bias"])
    assert torch.equal(s["layers.1.feed_forward.gate.weight"], src["model.layers.1.block_sparse_moe.gate.weight"])


def test_full_qk_norm_with_replicated_kv_heads_is_refused(moe_hf, tmp_path):
    """MiniMax-M2's k norm spans both KV heads: at mp=4 each rank would hold one replicated head."""
    proc = run_cli("shard", moe_hf["minimax_m2"][0], tmp_path / "out", "--mp", 4, "--quiet", check=False)
    assert proc.returncode != 0
    assert "k norm spans all 2 KV heads" in proc.stderr
    assert not (tmp_path / "out" / "model0-mp4.safetensors").exists()


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_plan_and_inspect_read_moe_checkpoints(moe_hf, model_type):
    hf = moe_hf[model_type][0]
    described = json.loads(run_cli("inspect", hf, "--json").stdout)
    assert described["model_type"] == model_type
    assert described["tensors"] == len(load_file(str(hf / "model.safetensors")))
    plan = json.loads(run_cli("plan", hf, "--mp", 2, "--json").stdout)
    assert [f["name"] for f in plan["files"]] == ["model0-mp2.safetensors", "model1-mp2.safetensors"]


def test_conflicting_expert_counts_are_refused(moe_hf, tmp_path):
    raw = json.loads((moe_hf["qwen3_moe"][0] / "config.json").read_text())
    raw["num_experts"] = raw["num_local_experts"] + 1
    with pytest.raises(Exception, match="expert count twice"):
        spec.MoeConfig.from_dict(raw)


def _with_mtp_layer(hf, dst):
    """The checkpoint as published, with one MTP layer (transformers neither builds nor saves it): GLM-4.5's
    is a full MoE layer after the main ones plus DeepSeek-style enorm/hnorm/eh_proj/embed_tokens/shared_head;
    ERNIE-4.5's a dense `model.mtp_block.0` plus `mtp_emb_norm`, `mtp_hidden_norm` and `mtp_linear_proj`."""
    import shutil

    shutil.copytree(hf, dst)
    config = json.loads((dst / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(dst / "model.safetensors"))
    cfg = spec.MoeConfig.from_dict(config)
    torch.manual_seed(3)
    for name, shape in spec.hf_tensor_shapes(cfg).items():
        if spec.is_mtp_tensor(cfg, name):
            tensors[name] = torch.randn(shape).to(torch.bfloat16)
    from safetensors.torch import save_file

    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("model_type, mtp_names", [
    ("glm4_moe", ("layers.3.eh_proj.weight", "layers.3.feed_forward.experts.7.w2.weight")),
    ("ernie4_5_moe", ("mtp.0.eh_proj.weight", "mtp.0.enorm.weight", "mtp.0.feed_forward.w2.bias",
                      "mtp.0.attention.wq.weight"))])
def test_mtp_layer_is_dropped_by_default_and_kept_shards_verify(moe_hf, tmp_path, model_type, mtp_names):
    hf, ids, _ = moe_hf[model_type]
    src = _with_mtp_layer(hf, tmp_path / "with_mtp")
    run_cli("shard", src, tmp_path / "dropped", "--mp", 2, "--quiet")
    assert json.loads((tmp_path / "dropped" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    dropped = load_dir(tmp_path / "dropped")
    assert not any(n.startswith(("layers.3.", "mtp.")) for f in dropped.values() for n in f)

    run_cli("shard", src, tmp_path / "kept", "--mp", 2, "--keep-mtp", "--quiet")
    kept = load_dir(tmp_path / "kept")["model1-mp2.safetensors"]
    assert all(n in kept for n in mtp_names), sorted(n for n in kept if n.startswith(("layers.3.", "mtp.")))
    report = run_verify(tmp_path / "kept", prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, device="cpu", reference=src)
    assert report.ok, report.render(tmp_path / "kept")
    assert report.generated_ids == ids
    assert "MTP tensor(s) on rank 0 skipped" in report.render(tmp_path / "kept")

    run_cli("merge", tmp_path / "kept", tmp_path / "merged", "--quiet")
    original, merged = load_file(str(src / "model.safetensors")), load_dir(tmp_path / "merged")["model.safetensors"]
    assert original.keys() == merged.keys() and all(torch.equal(original[n], merged[n]) for n in original)


def _transformers_own_form(hf, dst):
    """The checkpoint as transformers 5 saves it with save_original_format=False: its own module names
    (Mixtral's and MiniMax-M2's router at `mlp.gate`, their correction bias at `mlp.e_score_correction_bias`,
    ERNIE's under `mlp.gate.moe_statics`) and stacked experts (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
    [E, H, I])."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    model.save_pretrained(dst, save_original_format=False)
    return dst


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "minimax_m2", "ernie4_5_moe"])
def test_transformers_own_form_reads_as_the_published_one_and_verifies(moe_hf, tmp_path, model_type):
    """Stacked experts and transformers' own names read as the published checkpoint's: the shards hold the
    published checkpoint's values, and verify (against transformers on the stacked checkpoint) passes."""
    hf, ids, _ = moe_hf[model_type]
    stacked = _transformers_own_form(hf, tmp_path / "stacked")
    saved = load_file(str(stacked / "model.safetensors"))
    row, cfg = spec.TYPES[model_type], spec.MoeConfig.from_dict(json.loads((hf / "config.json").read_text()))
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    assert f"model.layers.{layer}.mlp.experts.gate_up_proj" in saved
    assert all(f"model.layers.{layer}.{own}" in saved for own, _ in row.transformers_names)

    plan = json.loads(run_cli("plan", stacked, "--mp", 2, "--json").stdout)
    assert any("stacked expert tensors" in n for n in plan["notes"])
    run_cli("shard", stacked, tmp_path / "from_stacked", "--mp", 2, "--quiet")
    run_cli("shard", hf, tmp_path / "from_experts", "--mp", 2, "--quiet")
    a, b = load_dir(tmp_path / "from_stacked"), load_dir(tmp_path / "from_experts")
    assert a.keys() == b.keys()
    for f in a:
        assert a[f].keys() == b[f].keys(), f
        for n in a[f]:  # equal values (transformers saves what it keeps in float32, ERNIE's router, as F32)
            assert torch.equal(a[f][n].float(), b[f][n].float()), n
    report = run_verify(tmp_path / "from_stacked", prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, device="cpu",
                        reference=stacked)
    assert report.ok, report.render(tmp_path / "from_stacked")
    assert report.generated_ids == ids


def test_two_spellings_of_one_tensor_are_refused(moe_hf, tmp_path):
    """A checkpoint holding Mixtral's router both as transformers names it and as published is ambiguous."""
    import shutil

    from safetensors.torch import save_file

    hf = moe_hf["mixtral"][0]
    shutil.copytree(hf, tmp_path / "bad")
    tensors = load_file(str(hf / "model.safetensors"))
    tensors["model.layers.0.mlp.gate.weight"] = tensors["model.layers.0.block_sparse_moe.gate.weight"].clone()
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    proc = run_cli("plan", tmp_path / "bad", "--mp", 2, check=False)
    assert proc.returncode != 0
    assert "holds both 'model.layers.0.block_sparse_moe.gate.weight' and 'model.layers.0.mlp.gate.weight'" in proc.stderr


def test_stacked_experts_of_the_wrong_count_are_refused(moe_hf, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from dense_models import stack_experts

    hf = moe_hf["qwen3_moe"][0]
    shutil.copytree(hf, tmp_path / "bad")
    tensors = stack_experts(load_file(str(hf / "model.safetensors")), 8)
    tensors["model.layers.0.mlp.experts.down_proj"] = tensors["model.layers.0.mlp.experts.down_proj"][:7].clone()
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"), metadata={"format": "pt"})
    proc = run_cli("shard", tmp_path / "bad", tmp_path / "out", "--mp", 2, "--quiet", check=False)
    assert proc.returncode != 0
    assert "stacked expert tensor of shape [7, 64, 32] is not [8 experts" in proc.stderr
    assert "model.layers.0.mlp.experts.down_proj" in proc.stderr


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_a_config_counting_a_trillion_layers_is_refused_without_expanding_it(moe_hf, tmp_path, model_type):
    """Layer rules are kept as rules: reading such a config costs nothing, and the plan refuses it
    against the headers (a per-layer tuple built while reading once took 20 GB in the fuzz test)."""
    import shutil

    src = tmp_path / "huge"
    shutil.copytree(moe_hf[model_type][0], src)
    raw = json.loads((src / "config.json").read_text())
    raw["num_hidden_layers"] = 10 ** 12
    cfg = spec.MoeConfig.from_dict(raw)
    assert cfg.is_moe_layer(10 ** 12 - 1) in (True, False)
    (src / "config.json").write_text(json.dumps(raw))
    proc = run_cli("plan", src, "--mp", 2, check=False)
    assert proc.returncode != 0 and "num_hidden_layers = 1000000000000 cannot describe" in proc.stderr


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_quantize_takes_every_linear_projection_of_the_types_own_table(moe_hf, model_type):
    """Each type's own key table decides (Mixtral's experts are `block_sparse_moe.experts.E.w1`): every expert,
    dense MLP, shared expert and attention projection is quantized; routers, norms, embeddings and the head not."""
    from ckpttool.io.checkpoint import Checkpoint
    from ckpttool.plan.build import Spec

    hf = moe_hf[model_type][0]
    with Checkpoint(hf) as ckpt:
        plan = Spec(quantize="fp8_block").plan(ckpt)
        cfg = spec.MoeConfig.from_dict(ckpt.config)
    quantized = {p.tensor.name for f in plan.files for p in f.tensors if p.tensor.transform == "quantize_fp8_block"}
    row = spec.TYPES[model_type]
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    experts = {f"model.layers.{i}.{row.block}.experts.{e}.{leaf}.weight" for i in moe_layers
               for e in range(cfg.num_experts) for leaf in row.expert_leaves}
    attention = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(cfg.num_hidden_layers) for p in "qkvo"}
    assert experts <= quantized and attention <= quantized, sorted(experts - quantized)[:3]
    assert not {n for n in quantized if "norm" in n or "gate.weight" in n or "embed" in n or "lm_head" in n}
