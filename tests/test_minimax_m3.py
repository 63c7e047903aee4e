"""MiniMax-M3 (`minimax_m3_vl`: its text model families/minimax_m3 inside the multimodal wrapper): inspect, plan,
shard --mp 1/2/4, merge back byte for byte (the vision tower too), and verify giving transformers 5.24's own
greedy tokens at mp 1 and 2, on a tiny MiniMaxM3SparseForConditionalGeneration transformers builds and saves in
tmp_path with every parameter perturbed (tests/mla_models.py: Gemma norms, a dense layer among MoE ones, the
lightning indexer, partial rotary, swiglu_limit reached). Refusals say why."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ckpttool.errors import CkptError, InputError
from ckpttool.families.minimax_m3.spec import CONFIG_DEFAULTS, MiniMaxM3Config, hf_tensor_shapes
from ckpttool.families.table import family_for
from ckpttool.verify.run import run_verify
from conftest import load_dir, run_cli
from mla_models import MINIMAX_TEXT, NEW_TOKENS, PROMPT, build_minimax_m3, config_of, greedy_oracle

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def m3(tmp_path_factory) -> tuple:
    """(HF dir, transformers' greedy ids)."""
    hf = build_minimax_m3(tmp_path_factory.mktemp("m3") / "hf")
    return hf, greedy_oracle(hf)


def test_config_defaults_are_the_transformers_class_defaults():
    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig

    theirs = MiniMaxM3VLTextConfig()
    assert all(CONFIG_DEFAULTS[k] == getattr(theirs, k) for k in CONFIG_DEFAULTS), \
        {k: (v, getattr(theirs, k)) for k, v in CONFIG_DEFAULTS.items() if v != getattr(theirs, k)}
    assert theirs.rope_parameters == {"rope_theta": 5000000.0, "rope_type": "default"}


def test_expected_shapes_are_what_transformers_saved(m3):
    hf = m3[0]
    saved = {k[len("language_model."):]: tuple(v.shape) for k, v in load_file(str(hf / "model.safetensors")).items()
             if k.startswith("language_model.")}
    assert hf_tensor_shapes(MiniMaxM3Config.from_dict(config_of(hf)["text_config"])) == saved


@pytest.mark.parametrize("mp", [1, 2])
def test_shard_then_verify_gives_transformers_greedy_tokens_minimax_m3(m3, tmp_path, mp):
    hf, want = m3
    run_cli("shard", hf, tmp_path / "mp", "--mp", mp, "--quiet")
    report = run_verify(tmp_path / "mp", reference=hf, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    assert report.ok, report.render("minimax_m3_vl")
    assert report.generated_ids == want
    assert "MiniMaxM3SparseForConditionalGeneration" in report.checks["reference"].detail
    assert "vision tower and projector tensor(s) on rank 0 skipped" in report.checks["load"].detail


def test_shard_mp4_then_merge_is_byte_identical(m3, tmp_path):
    """KV heads replicated over two ranks each, the indexer whole on every rank, the vision tower on rank 0."""
    hf = m3[0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 4, "--quiet")
    shards, source = load_dir(tmp_path / "mp"), load_file(str(hf / "model.safetensors"))
    for r in range(4):
        s = shards[f"model{r}-mp4.safetensors"]
        assert torch.equal(s["layers.1.attention.indexer.wq.weight"],
                           source["language_model.model.layers.1.self_attn.index_q_proj.weight"])
        assert torch.equal(s["layers.1.attention.wk.weight"],
                           source["language_model.model.layers.1.self_attn.k_proj.weight"][r // 2 * 16:(r // 2 + 1) * 16])
        assert torch.equal(s[f"layers.2.feed_forward.experts.{r}.w1.weight"],
                           source[f"language_model.model.layers.2.block_sparse_moe.experts.{r}.w1.weight"])
        assert any(n.startswith("vision_tower.") for n in s) == (r == 0)
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    assert (hf / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()


def test_verify_refuses_what_the_indexer_would_not_keep_whole(m3, tmp_path):
    """Blocks of 4 keys, 4 of them kept: past 16 positions the sparse attention drops keys the dense one sees."""
    run_cli("shard", m3[0], tmp_path / "mp", "--mp", 1, "--quiet")
    with pytest.raises(CkptError, match=r"exceed what MiniMax-M3's indexer keeps whole \(index_topk_blocks x "
                                        r"index_block_size = 16\)"):
        run_verify(tmp_path / "mp", prompt_ids=PROMPT, max_new_tokens=11)


def test_plan_inspect_and_refusals_say_why(m3, tmp_path):
    hf = m3[0]
    assert json.loads(run_cli("inspect", hf, "--json").stdout)["model_type"] == "minimax_m3_vl"
    plan = json.loads(run_cli("plan", hf, "--mp", 2, "--json").stdout)
    assert any("passed through unchanged, whole on rank 0" in note for note in plan["notes"])
    proc = run_cli("shard", hf, tmp_path / "out", "--mp", 8, "--quiet", check=False)
    assert proc.returncode != 0 and "4 heads (num_attention_heads) cannot be cut evenly over mp=8" in proc.stderr
    ours = build_minimax_m3(tmp_path / "transformers", save_original_format=False)  # fused gate_up_proj
    proc = run_cli("plan", ours, "--mp", 2, check=False)
    assert proc.returncode != 0 and "fuse each MLP's gate_up_proj" in proc.stderr
    with pytest.raises(InputError, match=r"read inside its multimodal checkpoint \(minimax_m3_vl\)"):
        family_for(config_of(hf)["text_config"])  # the text model on its own


def test_config_is_read_as_minimaxm3vltextconfig_reads_it():
    """The published spelling of the indexer fields (sparse_attention_config), moe_layer_freq for the MLP types,
    the rotated share from the rope parameters (transformers 5.24 does not read rotary_dim), and the head tied
    when either config says so."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLConfig, MiniMaxM3VLTextConfig

    published = {**{k: v for k, v in MINIMAX_TEXT.items() if k not in ("mlp_layer_types", "layer_types")},
                 "model_type": "minimax_m3_vl_text", "rotary_dim": 4, "moe_layer_freq": [0, 1, 1],
                 "sparse_attention_config": {"sparse_num_index_heads": 3, "sparse_block_size": 8,
                                             "sparse_attention_freq": [0, 0, 1]}}
    ours = MiniMaxM3Config.from_dict(published)
    theirs = MiniMaxM3VLTextConfig(**{k: v for k, v in published.items() if k != "model_type"})
    assert ours.mlp_layer_types == tuple(theirs.mlp_layer_types)
    assert ours.sparse_attention == tuple(t == "minimax_m3_sparse" for t in theirs.layer_types)
    assert (ours.index_n_heads, ours.index_block_size) == (theirs.index_n_heads, theirs.index_block_size) == (3, 8)
    assert ours.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"] == 0.5
    wrapper = {"model_type": "minimax_m3_vl", "text_config": {**published, "tie_word_embeddings": True}}
    assert family_for(wrapper).parse_config(wrapper, "config.json").tie_word_embeddings
    assert MiniMaxM3VLConfig(text_config={**MINIMAX_TEXT, "tie_word_embeddings": True}).tie_word_embeddings
    with pytest.raises(InputError, match="mlp_layer_types"):
        MiniMaxM3Config.from_dict({**published, "mlp_layer_types": ["dense", "moe", "sparse"]})
