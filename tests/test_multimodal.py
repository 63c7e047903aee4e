"""Multimodal wrappers (families/multimodal.py), proven on Kimi-K2.5 (kimi_k25: a DeepSeek-V3 text tower beside
a MoonViT vision tower and a projector) that transformers 5.24 builds and saves in tmp_path, every parameter
perturbed: the text tower is converted, sharded and verified against transformers' own
Kimi_K25ForConditionalGeneration at mp 1 and 2; the vision tower and projector pass through unchanged, in HF
outputs where they were and in mp outputs whole on rank 0, so merge gives them back; each spelling of the
checkpoint's names (the hub's, transformers' own, transformers' save_pretrained's) is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttool.errors import InputError
from ckpttool.families.table import family_for
from ckpttool.verify.run import run_verify
from conftest import load_dir, run_cli
from mla_models import NEW_TOKENS, PROMPT, build_kimi_k25, config_of, greedy_oracle

transformers = pytest.importorskip("transformers")

PASSED = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.")


def _hub_spelling(saved: Path, dst: Path) -> Path:
    """transformers' save_pretrained output renamed to the hub's names: its text tower under
    `language_model.model.layers` (transformers writes `blocks`), every projector tensor under `mm_projector.`,
    and the text config's model_type kimi_k2."""
    dst.mkdir()
    tensors = load_file(str(saved / "model.safetensors"))
    renamed = {n.replace("language_model.model.blocks.", "language_model.model.layers.")
               .replace("model.mm_projector.", "mm_projector."): t for n, t in tensors.items()}
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(saved / "generation_config.json", dst)
    config = config_of(saved)
    config["text_config"]["model_type"] = "kimi_k2"  # as published (transformers saves what it maps it to)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> dict:
    """spelling -> HF dir of one tiny Kimi-K2.5 (the same weights), and "ids": transformers' greedy ids."""
    root = tmp_path_factory.mktemp("kimi")
    saved = build_kimi_k25(root / "saved")
    out = {"saved": saved, "hub": _hub_spelling(saved, root / "hub"),
           "transformers": build_kimi_k25(root / "transformers", save_original_format=False)}
    out["ids"] = greedy_oracle(out["hub"])
    assert greedy_oracle(out["transformers"]) == out["ids"]
    return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in load_dir(path).values() for k, v in f.items()}


@pytest.mark.parametrize("mp", [1, 2])
def test_text_tower_verifies_against_transformers_kimi_k25(kimi, tmp_path, mp):
    run_cli("shard", kimi["hub"], tmp_path / "mp", "--mp", mp, "--quiet")
    report = run_verify(tmp_path / "mp", reference=kimi["hub"], prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    assert report.ok, report.render("kimi_k25")
    assert report.generated_ids == kimi["ids"]
    assert "Kimi_K25ForConditionalGeneration" in report.checks["reference"].detail
    assert "vision tower and projector tensor(s) on rank 0 skipped" in report.checks["load"].detail
    assert "equals its slice of the reference" in report.checks["weights"].detail


def test_every_spelling_shards_to_the_same_text_tower_and_rank0_carries_the_rest(kimi, tmp_path):
    shards = {}
    for spelling in ("hub", "saved", "transformers"):
        run_cli("shard", kimi[spelling], tmp_path / spelling, "--mp", 2, "--quiet")
        shards[spelling] = load_dir(tmp_path / spelling)
        source = load_file(str(kimi[spelling] / "model.safetensors"))
        passed = {n: t for n, t in source.items() if n.startswith(PASSED)}
        rank0, rank1 = shards[spelling]["model0-mp2.safetensors"], shards[spelling]["model1-mp2.safetensors"]
        assert len(passed) > 20 and not any(n.startswith(PASSED) for n in rank1)
        assert {n for n in rank0 if n.startswith(PASSED)} == set(passed)
        assert all(torch.equal(rank0[n], t) for n, t in passed.items())
    for rank in ("model0-mp2.safetensors", "model1-mp2.safetensors"):
        text = [{n: t for n, t in shards[s][rank].items() if not n.startswith(PASSED)} for s in shards]
        assert text[0].keys() == text[1].keys() == text[2].keys() and "layers.1.ffn.experts.0.w1.weight" in \
            shards["hub"]["model0-mp2.safetensors"]
        assert all(torch.equal(t, other[n]) for other in text[1:] for n, t in text[0].items())


def test_merge_gives_each_spelling_back(kimi, tmp_path):
    """The hub's and save_pretrained's names come back byte for byte (the vision tower too); transformers' own
    spelling comes back with its stacked experts one by one, as for every family."""
    for spelling in ("hub", "saved"):
        run_cli("shard", kimi[spelling], tmp_path / spelling, "--mp", 2, "--quiet")
        run_cli("merge", tmp_path / spelling, tmp_path / f"{spelling}-hf", "--quiet")
        original, merged = load_file(str(kimi[spelling] / "model.safetensors")), _tensors(tmp_path / f"{spelling}-hf")
        assert original.keys() == merged.keys()
        assert all(t.dtype == merged[n].dtype and torch.equal(t, merged[n]) for n, t in original.items())
    assert (kimi["saved"] / "model.safetensors").read_bytes() == (tmp_path / "saved-hf" / "model.safetensors").read_bytes()
    run_cli("shard", kimi["transformers"], tmp_path / "tf", "--mp", 4, "--quiet")
    run_cli("merge", tmp_path / "tf", tmp_path / "tf-hf", "--quiet")
    original, merged = load_file(str(kimi["transformers"] / "model.safetensors")), _tensors(tmp_path / "tf-hf")
    gate_up = original.pop("model.language_model.layers.1.mlp.experts.gate_up_proj")
    down = original.pop("model.language_model.layers.1.mlp.experts.down_proj")
    for e in range(4):
        p = f"model.language_model.layers.1.mlp.experts.{e}."
        original.update({p + "gate_proj.weight": gate_up[e, :32], p + "up_proj.weight": gate_up[e, 32:],
                         p + "down_proj.weight": down[e]})
    assert original.keys() == merged.keys() and all(torch.equal(t, merged[n]) for n, t in original.items())


def test_hf_output_keeps_every_name_and_the_config_states_the_text_towers_routing(kimi, tmp_path):
    run_cli("convert", kimi["hub"], tmp_path / "hf", "--dtype", "bf16", "--quiet")
    original, out = load_file(str(kimi["hub"] / "model.safetensors")), _tensors(tmp_path / "hf")
    assert original.keys() == out.keys()
    assert all(torch.equal(t, out[n]) for n, t in original.items() if n.startswith(PASSED))
    config, given = config_of(tmp_path / "hf"), config_of(kimi["hub"])
    text = config["text_config"]
    assert (text["topk_method"], text["scoring_func"], text["rope_theta"]) == ("noaux_tc", "sigmoid", 50000.0)
    assert {k: text[k] for k in given["text_config"]} == given["text_config"]  # only fields added, none changed
    outer = ("text_config", "dtype", "torch_dtype")  # the dtype fields: what dequant writes
    assert {k: v for k, v in config.items() if k not in outer} == {k: v for k, v in given.items() if k not in outer}
    bare = {**given, "text_config": {k: v for k, v in given["text_config"].items()
                                     if k not in ("model_type", "tie_word_embeddings")}}
    stated = family_for(bare).explicit_config(bare, "config.json")["text_config"]
    assert "model_type" not in stated and "tie_word_embeddings" not in stated  # what reading it added stays out


def test_verify_compares_rank0s_vision_tower_with_the_reference(kimi, tmp_path):
    run_cli("shard", kimi["hub"], tmp_path / "mp", "--mp", 2, "--quiet")
    shard = tmp_path / "mp" / "model0-mp2.safetensors"
    tensors = load_file(str(shard))
    tensors["vision_tower.encoder.final_layernorm.weight"] += 1.0
    save_file(tensors, str(shard), metadata={"format": "pt"})
    report = run_verify(tmp_path / "mp", reference=kimi["hub"], prompt_ids=PROMPT, max_new_tokens=2)
    assert not report.ok and not report.checks["weights"].ok
    assert "'vision_tower.encoder.final_layernorm.weight' in model0-mp2.safetensors differs" in \
        report.checks["weights"].detail


def test_the_wrapper_config_is_read_as_kimi_k25config_reads_it(kimi):
    raw = config_of(kimi["hub"])
    family = family_for(raw)
    assert family.name == "kimi_k25"
    cfg = family.parse_config(raw, "config.json")
    assert cfg.text.model_type == "kimi_k2" and not cfg.tie_word_embeddings
    assert family.parse_config(config_of(kimi["saved"]), "config.json").text.model_type == "deepseek_v3"
    untied = {k: v for k, v in raw.items() if k != "tie_word_embeddings"}  # the class ties by default
    assert family.parse_config(untied, "config.json").tie_word_embeddings
    assert transformers.Kimi_K25Config().tie_word_embeddings is True
    nameless = {**raw, "text_config": {k: v for k, v in raw["text_config"].items() if k != "model_type"}}
    assert family.parse_config(nameless, "config.json").text.model_type == "deepseek_v3"  # as the class defaults
    with pytest.raises(InputError, match="text_config.model_type 'qwen3' is not one of deepseek_v3, kimi_k2"):
        family.parse_config({**raw, "text_config": {**raw["text_config"], "model_type": "qwen3"}}, "config.json")
    with pytest.raises(InputError, match="has no 'text_config' object"):
        family.parse_config({"model_type": "kimi_k25"}, "config.json")


def test_plan_says_what_passes_through_and_refuses_mp8(kimi, tmp_path):
    plan = json.loads(run_cli("plan", kimi["hub"], "--mp", 4, "--json").stdout)
    assert any("passed through unchanged, whole on rank 0" in note for note in plan["notes"])
    described = json.loads(run_cli("inspect", kimi["hub"], "--json").stdout)
    assert described["model_type"] == "kimi_k25"
    proc = run_cli("shard", kimi["hub"], tmp_path / "out", "--mp", 8, "--quiet", check=False)
    assert proc.returncode != 0 and "num_attention_heads (4) is not divisible by mp=8" in proc.stderr


@pytest.fixture(scope="module")
def kimi_int4(kimi, tmp_path_factory) -> dict[str, Path]:
    """Kimi-K2.5 as published: BF16, its routed experts INT4 compressed-tensors pack-quantized in groups of 32
    (quantized by compressed-tensors itself, tests/quant_builders.py), beside the same checkpoint with those
    experts as the library decompresses them."""
    from quant_builders import EXPERTS, load_all, oracle_weights, quantize_checkpoint, write_like

    root = tmp_path_factory.mktemp("kimi-int4")
    bf16 = root / "bf16"
    bf16.mkdir()
    tensors = {n: t if n.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
               for n, t in load_file(str(kimi["hub"] / "model.safetensors")).items()}
    save_file(tensors, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    (bf16 / "config.json").write_text(json.dumps({**config_of(kimi["hub"]), "dtype": "bfloat16"}))
    quantized = quantize_checkpoint(bf16, root / "int4", "ct_int4", EXPERTS)
    assert len(quantized) == 12  # 4 experts x gate, up, down
    tensors, file_of = load_all(bf16)
    tensors.update(oracle_weights(root / "int4", "ct_int4", quantized))
    write_like(bf16, root / "decompressed", tensors, file_of)
    return {"int4": root / "int4", "decompressed": root / "decompressed", "experts": quantized}


def test_published_int4_form_converts_to_what_the_librarys_decompression_gives_and_verifies(kimi_int4, tmp_path):
    for form in ("int4", "decompressed"):
        run_cli("convert", kimi_int4[form], tmp_path / form, "--mp", 2, "--quiet")
    ours, theirs = load_dir(tmp_path / "int4"), load_dir(tmp_path / "decompressed")
    assert ours.keys() == theirs.keys()
    for rank, tensors in ours.items():
        assert tensors.keys() == theirs[rank].keys()
        assert all(t.dtype == theirs[rank][n].dtype and torch.equal(t, theirs[rank][n]) for n, t in tensors.items())
    assert any(n.startswith("vision_tower.") for n in ours["model0-mp2.safetensors"])
    report = run_verify(tmp_path / "int4", reference=kimi_int4["decompressed"], prompt_ids=PROMPT,
                        max_new_tokens=NEW_TOKENS)
    assert report.ok, report.render("kimi_k25 int4")
    assert "Kimi_K25ForConditionalGeneration" in report.checks["reference"].detail
    run_cli("dequant", kimi_int4["int4"], tmp_path / "hf", "--quiet")
    out, want = _tensors(tmp_path / "hf"), load_file(str(kimi_int4["decompressed"] / "model.safetensors"))
    assert out.keys() == want.keys() and all(torch.equal(t, want[n]) for n, t in out.items())
    assert "quantization_config" not in config_of(tmp_path / "hf")


def test_merged_index_counts_parameters_as_transformers_does_vision_tower_included(kimi, tmp_path):
    """total_parameters of a merged wrapper: every tensor, the vision tower's too, but the router's buffer."""
    from ckpttool.verify.oracle import _auto_class

    run_cli("shard", kimi["hub"], tmp_path / "mp", "--mp", 2, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--max-shard-size", "40KB", "--quiet")
    ours = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["metadata"]["total_parameters"]
    config = transformers.AutoConfig.from_pretrained(kimi["hub"])
    assert ours == _auto_class(transformers, type(config)).from_pretrained(kimi["hub"]).num_parameters()
