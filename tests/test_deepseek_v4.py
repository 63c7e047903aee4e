"""DeepSeek-V4 on checkpoints transformers 5.24 builds and saves itself, in both tensor spellings (its own
save_pretrained's, and DeepSeek's hub names): config.json read as DeepseekV4Config reads it, every tensor
the config implies, DeepSeek's own V4 mp layout, `shard` / `convert` then `verify` against transformers'
DeepseekV4ForCausalLM at mp 1, 2 and 4 (every layer type and both MLP types, prompts past the sliding
window, the CSA indexer's top-k and the HCA windows), `merge` back byte for byte, `dequant`, `inspect`,
and the refusals. Header-only plans at V4-Flash's published dims are in test_deepseek_v4_plan.py."""

from __future__ import annotations

import json

import pytest
import torch

from ckpttool.errors import InputError, PlanError
from ckpttool.families.deepseek_v4.config import CONFIG_DEFAULTS, DeepseekV4Config
from ckpttool.families.deepseek_v4.spec import KEY_MAPS, hf_tensor_shapes, native_shapes
from ckpttool.verify.run import run_verify
from conftest import load_dir, run_cli
from deepseek_v4_models import PROMPT, build

transformers = pytest.importorskip("transformers")
SPELLINGS = ("transformers", "deepseek")


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> dict:
    """The same perturbed model in both spellings; DeepSeek's with an MTP layer, as published."""
    root = tmp_path_factory.mktemp("v4")
    return {s: build(root / s, spelling=s, mtp=s == "deepseek") for s in SPELLINGS}


def _flat(directory) -> dict[str, torch.Tensor]:
    return {k: v for f in load_dir(directory).values() for k, v in f.items()}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


# -- config.json -------------------------------------------------------------------------------------
def test_config_defaults_are_the_transformers_class_defaults():
    theirs = transformers.DeepseekV4Config()
    assert len(CONFIG_DEFAULTS) == 33
    for key, value in CONFIG_DEFAULTS.items():
        assert getattr(theirs, key) == value, key


CONFIGS = {
    "V4-Flash as published (compress_ratios, num_hash_layers, qk_rope_head_dim, yarn rope_scaling)": dict(
        num_hidden_layers=6, compress_ratios=[0, 0, 4, 128, 4, 0, 0], num_hash_layers=3, qk_rope_head_dim=64,
        rope_theta=10000, compress_rope_theta=160000, max_position_embeddings=1048576,
        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                      "type": "yarn"}),
    "nothing said: the class defaults": dict(num_hidden_layers=5),
    "legacy compress rates and two hash layers": dict(num_hidden_layers=4, compress_rate_csa=2, compress_rate_hca=8,
                                                      num_hash_layers=2, compress_ratios=[4, 128, 0, 4]),
    "explicit types win over compress_ratios": dict(
        num_hidden_layers=3, compress_ratios=[0, 0, 0], mlp_layer_types=["moe", "hash_moe", "moe"],
        layer_types=["heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention"]),
    "nested rope_parameters as transformers saves them": dict(
        num_hidden_layers=2, rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
            "compress": {"rope_type": "yarn", "rope_theta": 90000.0, "partial_rotary_factor": 0.25, "factor": 8.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2}}),
    "yarn with mscale and no attention factor": dict(
        num_hidden_layers=2, partial_rotary_factor=0.5, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 1.0,
            "mscale_all_dim": 0.5}),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_config_is_read_as_transformers_reads_it(case):
    """Layer types, MLP types, compress rates and both ropes (their cos / sin tables from transformers'
    own rotary embedding) agree with DeepseekV4Config / DeepseekV4RotaryEmbedding."""
    from ckpttool.families.deepseek_v4.attention import rope_table

    raw = {"model_type": "deepseek_v4", "head_dim": 128, **CONFIGS[case]}
    ours = DeepseekV4Config.from_dict(raw)
    theirs = transformers.DeepseekV4Config(**{k: v for k, v in json.loads(json.dumps(raw)).items() if k != "model_type"})
    assert list(ours.layer_types) == theirs.layer_types
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert ours.compress_rates == theirs.compress_rates
    rotary = transformers.models.deepseek_v4.modeling_deepseek_v4.DeepseekV4RotaryEmbedding(theirs)
    positions = torch.arange(300)[None]
    for kind, rope in (("main", ours.main_rope), ("compress", ours.compress_rope)):
        assert rope.theta == theirs.rope_parameters[kind]["rope_theta"]
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions, layer_type=kind)
        want_cos, want_sin = rope_table(rope, 300)
        assert torch.equal(cos[0], want_cos) and torch.equal(sin[0], want_sin), kind


REFUSED = {
    "norm_topk_prob": ({"norm_topk_prob": False}, "always normalises"),
    "scoring_func": ({"scoring_func": "softmax"}, "sqrtsoftplus or sigmoid"),
    "num_key_value_heads": ({"num_key_value_heads": 2}, "one shared KV head"),
    "n_shared_experts": ({"n_shared_experts": 2}, "one shared expert"),
    "swiglu_limit": ({"swiglu_limit": 0.0}, "only above 0"),
    "mlp_bias": ({"mlp_bias": True}, "no biases"),
    "tie_word_embeddings": ({"tie_word_embeddings": True}, "its own tensor"),
    "o_groups": ({"o_groups": 3}, "whole heads"),
    "index_head_dim": ({"index_head_dim": 32, "compress_ratios": [4, 0]}, "rotates its last 64 dims"),
    "compress ratio": ({"compress_ratios": [0, 2]}, "not one of the compress ratios"),
    "layer_types length": ({"layer_types": ["sliding_attention"]}, "must be 2 entries"),
    "rope type": ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "unsupported rope"),
    "DSpark (V4-Flash-0731)": ({"dspark_block_size": 5}, "DSpark draft stages"),
    "Engram (V4.1)": ({"engram_layer_ids": [1]}, "Engram"),
    "shared KV (V4.1)": ({"kv_source_layer_ids": [1]}, "KV shared across layers"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_neither_model_implements_is_refused(case):
    change, says = REFUSED[case]
    with pytest.raises(InputError, match=says):
        DeepseekV4Config.from_dict({"model_type": "deepseek_v4", "num_hidden_layers": 2, **change})


# -- tensors and names -------------------------------------------------------------------------------
def test_expected_tensors_are_what_transformers_saved_and_loads_in_either_spelling(v4):
    """The transformers spelling is exactly what save_pretrained wrote; DeepSeek's spelling (the same
    tensors under the hub's names, plus MTP) loads into transformers with nothing missing or left over,
    which is what its conversion mapping does to the hub's files."""
    for spelling, src in v4.items():
        cfg = DeepseekV4Config.from_dict(json.loads((src / "config.json").read_text()))
        assert cfg.spelling == spelling
        tensors = _flat(src)
        assert {k: tuple(v.shape) for k, v in tensors.items()} == hf_tensor_shapes(cfg)
        _, info = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours, hub = _flat(v4["transformers"]), _flat(v4["deepseek"])
    assert all(torch.equal(v.long() if k.endswith("tid2eid") else v, ours[KEY_MAPS["transformers"].to_hf(k).name])
               for k, v in hub.items() if not k.startswith("mtp."))


def test_both_key_tables_invert_and_name_the_scale_x_scale():
    cfg = DeepseekV4Config.from_dict({"model_type": "deepseek_v4", "num_hidden_layers": 4,
                                      "compress_ratios": [0, 4, 128, 0, 0]})
    for spelling, keys in KEY_MAPS.items():
        for native in native_shapes(cfg, with_mtp=spelling == "deepseek"):
            hf = keys.to_hf(native).name
            assert keys.to_native(hf).name == native
        scale = keys.to_native(keys.to_hf("layers.1.attn.wq_b.weight").name.replace(".weight", ".scale"))
        assert scale.name == "layers.1.attn.wq_b.scale" and scale.split == 0 and scale.companion is not None
    assert KEY_MAPS["deepseek"].to_hf("layers.3.attn.kv_norm.weight").name == "layers.3.attn.kv_norm.weight"
    assert KEY_MAPS["transformers"].to_hf("layers.3.attn.kv_norm.weight").name == "model.layers.3.attn.norm.weight"


# -- the mp layout -----------------------------------------------------------------------------------
def test_shard_mp4_is_deepseeks_layout_and_keeps_mtp(v4, tmp_path):
    """DeepSeek's V4 convert.py: query heads, output groups and indexer heads cut on dim 0 (wo_b on dim 1),
    experts by range, everything else whole on every rank, the MTP layer kept unless --drop-mtp."""
    src = v4["deepseek"]
    run_cli("shard", src, tmp_path / "mp4", "--mp", 4, "--quiet")
    hub = _flat(src)
    shards = [load_dir(tmp_path / "mp4")[f"model{r}-mp4.safetensors"] for r in range(4)]
    cuts = {"attn.wq_b.weight": 0, "attn.attn_sink": 0, "attn.wo_a.weight": 0, "attn.wo_b.weight": 1,
            "attn.indexer.wq_b.weight": 0, "attn.indexer.weights_proj.weight": 0, "embed.weight": 0, "head.weight": 0}
    for name, t in hub.items():
        dim = next((d for leaf, d in cuts.items() if name.endswith(leaf)), None)
        if ".experts." in name and ".shared_experts." not in name:
            expert = int(name.split(".")[-3])
            holders = [r for r in range(4) if name in shards[r]]
            assert holders == [expert // 2] and _same_bytes(shards[holders[0]][name], t), name
        elif dim is None:
            assert all(_same_bytes(shards[r][name], t) for r in range(4)), name
        else:
            assert all(_same_bytes(shards[r][name], t.chunk(4, dim)[r]) for r in range(4)), name
    assert sum(len(s) for s in shards) > 0 and any(n.startswith("mtp.0.") for n in shards[0])
    config = json.loads((tmp_path / "mp4" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    run_cli("shard", src, tmp_path / "nomtp", "--mp", 4, "--drop-mtp", "--quiet")
    assert not any(n.startswith("mtp.") for n in load_dir(tmp_path / "nomtp")["model0-mp4.safetensors"])
    assert json.loads((tmp_path / "nomtp" / "config.json").read_text())["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize("mp, says", [(8, "num_attention_heads"), (3, "num_attention_heads")])
def test_an_mp_that_cuts_a_head_or_group_is_refused(v4, tmp_path, mp, says):
    proc = run_cli("shard", v4["transformers"], tmp_path / "out", "--mp", mp, check=False)
    assert proc.returncode == 1 and says in proc.stderr and not (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("mp", [1, 2, 4])
def test_shard_then_verify_gives_transformers_greedy_tokens(v4, tmp_path, spelling, mp):
    src = v4[spelling]
    run_cli("shard", src, tmp_path / "mp", "--mp", mp, "--quiet")
    report = run_verify(tmp_path / "mp", reference=src, prompt_ids=PROMPT, max_new_tokens=6)
    text = report.render(tmp_path / "mp")
    assert report.ok, text
    assert report.max_abs_logit_diff < 1e-3 and "DeepseekV4ForCausalLM" in text and "greedy ids agree" in text
    assert ("MTP tensor(s) on rank 0 skipped" in text) == (spelling == "deepseek")


def test_bfloat16_forward_matches_transformers(v4):
    """In bfloat16 the one-shot logits are transformers' (equal on the machine the tests were written on;
    the bound leaves room for other kernels): this tiny model moves 0.46 from float32 in bfloat16, in
    transformers and here alike, so verify's incremental bfloat16 decode is compared in float32 above."""
    from ckpttool.families.deepseek_v4.weights import VERIFIER
    from ckpttool.model.generate import teacher_forced_logits
    from ckpttool.model.parallel import ParallelContext
    from ckpttool.verify.oracle import transformers_logits

    src, ids = v4["deepseek"], [25, 110, 91, 24, 36]
    args = VERIFIER.load_args(json.loads((src / "config.json").read_text()), src / "config.json")
    model = VERIFIER.build(args, ParallelContext(), torch.bfloat16, "")
    VERIFIER.load_hf(model, src, args.n_layers)
    ours = teacher_forced_logits(model, PROMPT, ids)
    theirs, oracle = transformers_logits(src, PROMPT, ids, torch.bfloat16, torch.device("cpu"))
    assert "DeepseekV4ForCausalLM" in oracle and (ours - theirs).abs().max() < 0.02


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_shard_then_merge_is_byte_identical(v4, tmp_path, spelling):
    src = v4[spelling]
    run_cli("shard", src, tmp_path / "mp", "--mp", 4, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "merged", "--quiet")
    ref, merged = _flat(src), _flat(tmp_path / "merged")
    assert merged.keys() == ref.keys() and all(_same_bytes(merged[n], ref[n]) for n in ref)


def test_convert_mp2_from_the_cli_verifies(v4, tmp_path):
    run_cli("convert", v4["deepseek"], tmp_path / "mp2", "--mp", 2, "--quiet")
    proc = run_cli("verify", tmp_path / "mp2", "--reference", v4["deepseek"], "--prompt-ids",
                   ",".join(map(str, PROMPT)), "--max-new-tokens", 4, "--json", check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"] and report["max_abs_logit_diff"] < 1e-3, report


# -- HF outputs and inspect --------------------------------------------------------------------------
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_dequant_keeps_names_and_mtp_and_transformers_loads_it(v4, tmp_path, spelling):
    src = v4[spelling]
    run_cli("dequant", src, tmp_path / "hf", "--quiet")
    ref, out = _flat(src), _flat(tmp_path / "hf")
    assert out.keys() == ref.keys() and all(_same_bytes(out[n], ref[n]) for n in ref)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_inspect_reads_both_spellings(v4):
    for spelling, src in v4.items():
        report = json.loads(run_cli("inspect", src, "--json").stdout)
        assert report["model_type"] == "deepseek_v4" and report["tensors"] == len(_flat(src)), report
        assert report["dtypes"]["I32" if spelling == "deepseek" else "I64"]["tensors"] == 2  # tid2eid, hash layers


def test_a_config_json_of_the_other_spelling_is_refused(v4, tmp_path):
    """DeepSeek's config.json beside transformers' tensors describes other names: refused, naming a tensor
    (config.json decides the spelling, so shard and merge agree on it)."""
    import shutil

    mixed = tmp_path / "mixed"
    shutil.copytree(v4["transformers"], mixed)
    shutil.copy(v4["deepseek"] / "config.json", mixed / "config.json")
    proc = run_cli("plan", mixed, "--mp", 2, check=False)
    assert proc.returncode == 1 and "not part of the model config.json describes" in proc.stderr


def test_check_mp_names_the_unit_it_would_cut():
    from ckpttool.families.deepseek_v4.spec import check_mp

    cfg = DeepseekV4Config.from_dict({"model_type": "deepseek_v4", "num_hidden_layers": 2})  # V4-Flash's widths
    check_mp(cfg, 8)
    with pytest.raises(PlanError, match="o_groups \\(8\\) is not divisible by mp=16"):
        check_mp(cfg, 16)
