"""Mistral Large 4 (mistral_large4): its text tower is a row of the MLA family (families/deepseek/types.py) inside a
multimodal wrapper (families/multimodal.py), read in Mistral's own names and in transformers' own. On tiny models
transformers 5.24 builds and saves in tmp_path (tests/large4_models.py: NoPE and RoPE layers, layers storing and
reusing latent KV, shared-indexer layers, a learned LeRoPE alpha, per-head softmax scaling, every parameter
perturbed): inspect, plan, shard --mp 1/2/4 (8 refused: it would cut a head), merge back byte for byte, verify
giving transformers' own greedy tokens (MistralLarge4ForConditionalGeneration) at mp 1 and 2; refusals say why."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttool.errors import InputError
from ckpttool.families.base import unstack_experts
from ckpttool.families.deepseek.spec import DeepseekConfig, hf_tensor_shapes
from ckpttool.families.deepseek.types import TYPES
from ckpttool.families.table import family_for
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.model.parallel import ParallelContext
from ckpttool.verify.defaults import DEFAULT_TOLERANCE
from ckpttool.verify.run import run_verify
from conftest import load_dir, run_cli
from large4_models import PASSED, TEXT, build_large4
from mla_models import NEW_TOKENS, PROMPT, greedy_oracle

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def large4(tmp_path_factory) -> dict:
    """spelling -> HF dir of the same tiny model, and "ids": transformers' greedy ids (equal in both spellings)."""
    out: dict = build_large4(tmp_path_factory.mktemp("large4"))
    out["ids"] = greedy_oracle(out["mistral"])
    assert greedy_oracle(out["transformers"]) == out["ids"]
    return out


def _tensors(path) -> dict[str, torch.Tensor]:
    return {k: v for f in load_dir(path).values() for k, v in f.items()}


def test_config_defaults_are_the_transformers_class_defaults():
    theirs = transformers.MistralLarge4TextConfig()
    row = TYPES["mistral_large4_text"]
    compared = [k for k in row.defaults if hasattr(theirs, k)]
    assert len(compared) >= 25
    for key in compared:
        assert row.defaults[key] == getattr(theirs, key), key
    assert dict(theirs.rope_parameters) == row.default_rope


def test_layers_read_as_the_class_derives_them():
    """no_rope_layers (listed, or every 4th layer NoPE), kv_source_layers, indexer_types, mlp_layer_types."""
    for extra in ({}, {"no_rope_layers": None, "kv_source_layers": None, "indexer_types": None,
                       "index_topk_freq": 2, "mlp_layer_types": None, "num_hidden_layers": 8}):
        text = {k: v for k, v in {**TEXT, **extra}.items() if v is not None}
        theirs = transformers.MistralLarge4TextConfig(**text)
        ours = DeepseekConfig.from_dict({"model_type": "mistral_large4_text", **text})
        n = theirs.num_hidden_layers
        assert [ours.rotates(i) for i in range(n)] == [bool(r) for r in theirs.no_rope_layers]
        assert [ours.kv_source(i) for i in range(n)] == theirs.kv_source_layers
        assert [ours.has_indexer(i) for i in range(n)] == [t == "full" for t in theirs.indexer_types]
        assert [ours.is_moe_layer(i) for i in range(n)] == [t == "sparse" for t in theirs.mlp_layer_types]
        assert ours.q_lora_rank is None


@pytest.mark.parametrize("spelling", ["mistral", "transformers"])
def test_expected_shapes_are_what_transformers_saved(large4, spelling):
    family = family_for(json.loads((large4[spelling] / "config.json").read_text()))
    with Checkpoint(large4[spelling]) as ckpt:
        cfg = family.spelled(family.parse_config(ckpt.config, "config.json"), ckpt.tensors)
        assert cfg.spelled.title.startswith("Mistral's" if spelling == "mistral" else "transformers'")
        unstack_experts(ckpt, cfg.keys, 4)
        saved = {k: tuple(v.info.shape) for k, v in ckpt.tensors.items() if not k.startswith(PASSED)}
    assert family.expected_shapes(cfg, True) == saved
    assert len(hf_tensor_shapes(cfg.text)) == len(saved)


def test_both_spellings_shard_to_the_same_text_tower_and_rank0_carries_the_rest(large4, tmp_path):
    shards = {}
    for spelling in ("mistral", "transformers"):
        hf = large4[spelling]
        run_cli("shard", hf, tmp_path / spelling, "--mp", 2, "--quiet")
        shards[spelling] = load_dir(tmp_path / spelling)
        passed = {n: t for n, t in load_file(str(hf / "model.safetensors")).items() if n.startswith(PASSED)}
        rank0, rank1 = shards[spelling]["model0-mp2.safetensors"], shards[spelling]["model1-mp2.safetensors"]
        assert len(passed) >= 15 and not any(n.startswith(PASSED) for n in rank1)
        assert {n for n in rank0 if n.startswith(PASSED)} == set(passed)
        assert all(torch.equal(rank0[n], t) for n, t in passed.items())
    for rank in ("model0-mp2.safetensors", "model1-mp2.safetensors"):
        mistral, theirs = ({n: t for n, t in shards[s][rank].items() if not n.startswith(PASSED)} for s in shards)
        assert mistral.keys() == theirs.keys() and all(torch.equal(t, theirs[n]) for n, t in mistral.items())
    rank0, rank1 = shards["mistral"]["model0-mp2.safetensors"], shards["mistral"]["model1-mp2.safetensors"]
    ref = load_file(str(large4["mistral"] / "model.safetensors"))
    # the reuse layers (3, 4) hold no latent projection; the NoPE layer's is kv_lora_rank wide
    assert "layers.3.attn.wkv_a.weight" not in rank0 and "layers.4.attn.kv_norm.weight" not in rank1
    assert rank0["layers.2.attn.wkv_a.weight"].shape == (16, 64)
    # per-head query scaling is cut with the heads; LeRoPE's alpha and the indexers are whole on each rank
    scale = ref["layers.1.attention.ssmax_scaling.s"]
    assert torch.equal(rank0["layers.1.attn.softmax_scaling.scale"], scale[:2])
    assert torch.equal(rank1["layers.1.attn.softmax_scaling.scale"], scale[2:])
    for shard in (rank0, rank1):
        assert torch.equal(shard["rope_alpha"], ref["lerope.alpha"]) and shard["rope_alpha"].dtype == torch.float32
        assert torch.equal(shard["layers.3.attn.indexer.q_norm.bias"], ref["layers.3.attention.indexer.q_input_norm.bias"])
        assert not any(n.startswith("layers.5.attn.indexer.") for n in shard)


@pytest.mark.parametrize("mp", [1, 4])
def test_merge_gives_each_spelling_back(large4, tmp_path, mp):
    """Mistral's names come back byte for byte, file and all; transformers' own come back tensor for tensor with
    their stacked experts one by one, under the names transformers stacks on load (Mistral's `experts.E.w1`)."""
    run_cli("shard", large4["mistral"], tmp_path / "mp", "--mp", mp, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    assert (large4["mistral"] / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    run_cli("shard", large4["transformers"], tmp_path / "tf", "--mp", mp, "--quiet")
    run_cli("merge", tmp_path / "tf", tmp_path / "tf-hf", "--quiet")
    original, merged = load_file(str(large4["transformers"] / "model.safetensors")), _tensors(tmp_path / "tf-hf")
    for layer in range(1, 6):
        p = f"model.language_model.layers.{layer}.mlp.experts."
        gate_up, down = original.pop(p + "gate_up_proj"), original.pop(p + "down_proj")
        for e in range(4):
            q = f"model.language_model.layers.{layer}.experts.{e}."
            original.update({q + "w1.weight": gate_up[e, :32], q + "w3.weight": gate_up[e, 32:], q + "w2.weight": down[e]})
    assert original.keys() == merged.keys()
    assert all(t.dtype == merged[n].dtype and torch.equal(t, merged[n]) for n, t in original.items())


def test_plan_and_inspect_read_it_and_mp8_is_refused_by_name(large4, tmp_path):
    described = json.loads(run_cli("inspect", large4["mistral"], "--json").stdout)
    assert described["model_type"] == "mistral_large4"
    plan = json.loads(run_cli("plan", large4["mistral"], "--mp", 4, "--json").stdout)
    assert [f["name"] for f in plan["files"]] == [f"model{r}-mp4.safetensors" for r in range(4)]
    proc = run_cli("shard", large4["mistral"], tmp_path / "out", "--mp", 8, "--quiet", check=False)
    assert proc.returncode != 0 and "num_attention_heads (4) is not divisible by mp=8" in proc.stderr
    assert not (tmp_path / "out" / "model0-mp8.safetensors").exists()


def test_the_text_model_alone_is_refused_saying_why():
    with pytest.raises(InputError, match="read inside its multimodal checkpoint.*no causal LM"):
        family_for({"model_type": "mistral_large4_text"})


@pytest.mark.parametrize("change, message", [
    ({"kv_source_layers": [0, 1, 2, 2, 2, 5]}, r"names layer 2 for layer 3.*layer that rotates \(none\)"),
    ({"no_rope_layers": [1, 1, 1, 1, 0, 1]}, r"names layer 1 for layer 3.*layer that rotates \(2\)"),
    ({"kv_source_layers": [0, 0, 1, 1, 2, 5]}, "is not, for each of the 6 layers, the layer itself"),
    ({"no_rope_layers": [1, 1, 2, 1, 0, 1]}, "no_rope_layers"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
])
def test_configs_transformers_would_read_otherwise_are_refused(change, message):
    with pytest.raises(InputError, match=message):
        DeepseekConfig.from_dict({"model_type": "mistral_large4_text", **TEXT, **change})


@pytest.mark.parametrize("mp", [1, 2])
@pytest.mark.parametrize("spelling", ["mistral", "transformers"])
def test_shard_then_verify_gives_transformers_greedy_tokens(large4, tmp_path, spelling, mp):
    hf = large4[spelling]
    run_cli("shard", hf, tmp_path / "mp", "--mp", mp, "--quiet")
    report = run_verify(tmp_path / "mp", reference=hf, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    assert report.ok, report.render("mistral_large4")
    assert report.generated_ids == large4["ids"]
    assert "MistralLarge4ForConditionalGeneration" in report.checks["reference"].detail  # transformers answered
    assert report.max_abs_logit_diff < 1e-4
    assert "vision tower and projector tensor(s) on rank 0 skipped" in report.checks["load"].detail


def test_bfloat16_verify_agrees_with_transformers_in_bfloat16(large4, tmp_path):
    """In bfloat16 the tiny model's free-running ids are not fp32's (near-ties), but verify's check is against
    transformers run in bfloat16 too: teacher-forced logits within the bf16 tolerance and the same greedy ids."""
    run_cli("shard", large4["mistral"], tmp_path / "mp", "--mp", 2, "--quiet")
    report = run_verify(tmp_path / "mp", reference=large4["mistral"], prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS,
                        dtype="bfloat16")
    assert report.ok, report.render("mistral_large4 bf16")
    assert report.checks["reference"].detail.endswith("greedy ids agree")
    assert report.max_abs_logit_diff <= DEFAULT_TOLERANCE["bfloat16"]


def _bundled_logits(hf, change=None) -> torch.Tensor:
    """The bundled model at mp 1 on PROMPT, every position, after `change(model)`."""
    family = family_for(json.loads((hf / "config.json").read_text()))
    verifier = family.verifier()
    args = verifier.load_args(json.loads((hf / "config.json").read_text()), hf / "config.json")
    model = verifier.build(args, ParallelContext(), torch.float32, "absorb")
    verifier.load_hf(model, hf, args.n_layers)
    if change is not None:
        change(model)
    model.setup_caches(1, len(PROMPT))
    return model(torch.tensor([PROMPT]), all_positions=True)[0]


def _no_softcapping(model) -> None:
    model.args = replace(model.args, logit_softcapping=0.0)


@pytest.mark.parametrize("change", [
    lambda m: m.rope_alpha.data.zero_(),  # LeRoPE's learned frequencies
    lambda m: m.layers[3].attn.softmax_scaling.scale.data.zero_(),  # per-head query scaling (a reusing layer)
    lambda m: m.layers[4].attn.softmax_scaling.bias.data.fill_(1.0),  # ... and a NoPE layer's
    lambda m: m.layers[1].attn.wkv_a.weight.data.mul_(1.5),  # the latent layer 3 reuses (and layer 1's own)
    _no_softcapping,
], ids=["lerope_alpha", "softmax_scaling_reuse_layer", "softmax_scaling_nope_layer", "stored_latent", "softcapping"])
def test_what_large4_adds_moves_the_logits_the_comparison_checks(large4, change):
    """The bundled model's logits equal transformers' at every prompt position, and each of Large 4's additions
    moves them by more than twice verify's tolerance: a model without one of them would fail verify."""
    with torch.no_grad():
        theirs = transformers.AutoModelForImageTextToText.from_pretrained(large4["mistral"], dtype=torch.float32)
        expected = theirs(torch.tensor([PROMPT])).logits[0].float()
    ours = _bundled_logits(large4["mistral"])
    assert (ours - expected).abs().max() < 1e-4
    assert (_bundled_logits(large4["mistral"], change) - expected).abs().max() > 2 * DEFAULT_TOLERANCE["float32"]


def test_naive_attention_is_refused_where_layers_share_latent_kv(large4, tmp_path):
    run_cli("shard", large4["mistral"], tmp_path / "mp", "--mp", 1, "--quiet")
    proc = run_cli("verify", tmp_path / "mp", "--prompt-ids", "3,17,42", "--attn", "naive", check=False)
    assert proc.returncode != 0 and "layer 3 attends to layer 1's latent" in proc.stderr and "--attn absorb" in proc.stderr


def test_the_published_draft_head_passes_through_on_rank0(large4, tmp_path):
    """The hub checkpoint's `mtp_dspark.*` (a draft head transformers 5.24 ignores on load) is carried whole on
    rank 0 and merged back byte for byte, beside the vision tower."""
    src = tmp_path / "src"
    src.mkdir()
    tensors = load_file(str(large4["mistral"] / "model.safetensors"))
    tensors["mtp_dspark.layers.0.attention.wq.weight"] = torch.arange(96 * 64, dtype=torch.float32).view(96, 64)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    (src / "config.json").write_bytes((large4["mistral"] / "config.json").read_bytes())
    run_cli("shard", src, tmp_path / "mp", "--mp", 2, "--quiet")
    rank0 = load_file(str(tmp_path / "mp" / "model0-mp2.safetensors"))
    assert torch.equal(rank0["mtp_dspark.layers.0.attention.wq.weight"], tensors["mtp_dspark.layers.0.attention.wq.weight"])
    assert not any(n.startswith("mtp_dspark.") for n in load_file(str(tmp_path / "mp" / "model1-mp2.safetensors")))
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    merged = _tensors(tmp_path / "hf")
    assert merged.keys() == tensors.keys() and all(torch.equal(t, merged[n]) for n, t in tensors.items())


@pytest.mark.parametrize("spelling", ["mistral", "transformers"])
def test_hf_outputs_load_in_transformers_as_the_model_they_came_from(large4, tmp_path, spelling):
    """convert's HF output (and merge's, which writes the same names) loads into transformers' model with nothing
    missing or left over, giving the original's logits: experts written one by one take the names transformers
    stacks on load, in either spelling."""
    run_cli("convert", large4[spelling], tmp_path / "hf", "--quiet")
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        original = transformers.AutoModelForImageTextToText.from_pretrained(large4["mistral"], dtype=torch.float32)
        converted, info = transformers.AutoModelForImageTextToText.from_pretrained(
            tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert torch.equal(converted(tokens).logits, original(tokens).logits)
