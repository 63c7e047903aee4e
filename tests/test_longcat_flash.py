"""LongCat-Flash (longcat_flash): inspect, plan, shard --mp 1/2/4, merge back byte for byte, and verify giving
transformers' own greedy tokens at mp 1 and 2, in transformers' save_pretrained spelling (unused gate and up
projections for every zero expert), in transformers' own stacked form and in the published one (zero experts hold
no weights); with attention biases; with the published MTP layer (kept in HF outputs, cut like a layer with
--keep-mtp, compared with the reference by verify); config fields read as transformers' LongcatFlashConfig reads
them; what ckpttool's model does not build refused by name.

The input is a tiny checkpoint transformers 5 builds and saves itself, every norm and the router's correction
bias perturbed; the oracle is transformers' generate() on it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import load_dir, run_cli
from dense_models import NEW_TOKENS, PROMPT, build_hf, greedy_oracle

from ckpttool.errors import InputError, PlanError
from ckpttool.families.longcat_flash import spec
from ckpttool.verify.run import run_verify

transformers = pytest.importorskip("transformers")

# 2 decoder layers (4 MLA sublayers), 4 heads, 8 routed + 4 zero experts, top 3, a routed scaling factor.
TINY = dict(cls="LongcatFlashForCausalLM", config="LongcatFlashConfig", vocab_size=256, hidden_size=64, num_layers=2,
            num_attention_heads=4, ffn_hidden_size=96, expert_ffn_hidden_size=32, n_routed_experts=8,
            zero_expert_num=4, moe_topk=3, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            head_dim=8, v_head_dim=16, routed_scaling_factor=2.0, max_position_embeddings=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
ZERO = (8, 9, 10, 11)


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _published(hf, dst):
    """The same weights as the published checkpoints hold them: no tensor for any zero expert."""
    dst.mkdir()
    shutil.copy(hf / "config.json", dst / "config.json")
    tensors = {n: t for n, t in load_file(str(hf / "model.safetensors")).items()
               if not any(f".mlp.experts.{e}." in n for e in ZERO)}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def longcat_hf(tmp_path_factory) -> dict:
    """spelling -> (HF dir, transformers' greedy ids, their logits). transformers 5.24 cannot load the published
    spelling (its stacked gate_up_proj wants a block for every zero expert: a size mismatch), so both
    spellings' oracle is transformers' model of the same weights saved by itself."""
    root = tmp_path_factory.mktemp("longcat_flash")
    hf = build_hf("longcat_flash", root / "transformers", spec=TINY)
    published = _published(hf, root / "hub")
    oracle = greedy_oracle(hf)
    stacked = root / "stacked"  # transformers' own form: experts stacked, zero-expert slots in gate_up_proj
    transformers.AutoModelForCausalLM.from_pretrained(hf).save_pretrained(stacked, save_original_format=False)
    return {"transformers": (hf, *oracle), "hub": (published, *oracle), "stacked": (stacked, *oracle)}


def _equal_files(a, b) -> None:
    original, merged = load_file(str(a)), load_file(str(b))
    assert original.keys() == merged.keys()
    for name, tensor in original.items():
        assert tensor.dtype == merged[name].dtype and torch.equal(tensor, merged[name]), name


def test_config_defaults_are_the_transformers_class_defaults():
    defaults = transformers.LongcatFlashConfig()
    for field, value in spec.DEFAULTS.items():
        if field not in ("num_key_value_heads", "qk_head_dim"):  # None in the class, filled in __post_init__
            assert getattr(defaults, field) == value, field
    assert transformers.LongcatFlashConfig.attribute_map == {alias: k for k, alias in spec.ALIASES.items()}
    cfg = spec.LongcatFlashConfig.from_dict({"model_type": "longcat_flash"})
    assert (cfg.num_hidden_layers, cfg.qk_head_dim, cfg.rope_theta) == (
        defaults.num_layers, defaults.qk_head_dim, defaults.rope_parameters["rope_theta"])


@pytest.mark.parametrize("given", [
    {},
    {"num_local_experts": 16, "num_experts_per_tok": 4, "intermediate_size": 128, "moe_intermediate_size": 24},
    {"n_routed_experts": 16, "num_local_experts": 32, "zero_expert_num": 0},  # the attribute_map's name wins
    {"moe_topk": 3, "num_experts_per_tok": 5},
    {"num_hidden_layers": 7, "num_layers": 5},  # the class's setter wins: seven sublayers are three decoder layers
])
def test_fields_are_read_as_longcat_flash_config_reads_them(given):
    theirs = transformers.LongcatFlashConfig.from_dict(dict(given))
    ours = spec.LongcatFlashConfig.from_dict({"model_type": "longcat_flash", **given})
    for field in ("n_routed_experts", "moe_topk", "ffn_hidden_size", "expert_ffn_hidden_size", "q_lora_rank",
                  "routed_scaling_factor"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.zero_expert_num == theirs.zero_expert_num
    assert ours.num_hidden_layers == theirs.num_layers


@pytest.mark.parametrize("spelling", ["transformers", "hub"])
def test_expected_shapes_are_what_the_checkpoint_holds(longcat_hf, spelling):
    hf = longcat_hf[spelling][0]
    tensors = load_file(str(hf / "model.safetensors"))
    cfg = spec.spelled(spec.LongcatFlashConfig.from_dict(_config(hf)), tensors)
    assert cfg.spelling == spelling
    assert spec.hf_tensor_shapes(cfg, with_mtp=False) == {k: tuple(v.shape) for k, v in tensors.items()}


@pytest.mark.parametrize("mp", [1, 2])
@pytest.mark.parametrize("spelling", ["transformers", "hub"])
def test_shard_then_verify_gives_transformers_greedy_tokens(longcat_hf, tmp_path, spelling, mp):
    hf, ids, logits = longcat_hf[spelling]
    out = tmp_path / "mp"
    run_cli("shard", hf, out, "--mp", mp, "--quiet")
    reference = longcat_hf["transformers"][0]  # the one transformers loads (fixture); the weights are the same
    report = run_verify(out, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, device="cpu", reference=reference,
                        logits_path=tmp_path / "logits.safetensors")
    assert report.ok, report.render(out)
    assert report.generated_ids == ids
    assert "LongcatFlashForCausalLM" in report.render(out)
    ours = load_file(str(tmp_path / "logits.safetensors"))["logits"]
    assert (ours - logits).abs().max() < 1e-3


def test_a_published_reference_falls_back_to_the_bundled_model_and_says_why(longcat_hf, tmp_path):
    hf, ids, _ = longcat_hf["hub"]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 2, "--quiet")
    report = run_verify(tmp_path / "mp", prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, device="cpu", reference=hf)
    rendered = report.render(tmp_path / "mp")
    assert report.ok and report.generated_ids == ids, rendered
    assert "the bundled model at mp=1 (transformers could not load the reference" in rendered


@pytest.mark.parametrize("spelling", ["transformers", "hub"])
def test_shard_mp4_then_merge_is_byte_identical_in_its_own_spelling(longcat_hf, tmp_path, spelling):
    hf = longcat_hf[spelling][0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 4, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    _equal_files(hf / "model.safetensors", tmp_path / "hf" / "model.safetensors")


def test_heads_are_cut_whole_and_zero_experts_ranked_after_routed_ones(longcat_hf, tmp_path):
    hf = longcat_hf["transformers"][0]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 2, "--quiet")
    src, shards = load_file(str(hf / "model.safetensors")), load_dir(tmp_path / "mp")
    for r in range(2):
        s = shards[f"model{r}-mp2.safetensors"]
        a = "model.layers.1.self_attn.1."
        assert torch.equal(s["layers.1.attn.1.q_b_proj.weight"], src[a + "q_b_proj.weight"][r * 48:(r + 1) * 48])
        assert torch.equal(s["layers.1.attn.1.kv_b_proj.weight"], src[a + "kv_b_proj.weight"][r * 64:(r + 1) * 64])
        assert torch.equal(s["layers.1.attn.1.o_proj.weight"], src[a + "o_proj.weight"][:, r * 32:(r + 1) * 32])
        assert torch.equal(s["layers.1.attn.1.q_a_proj.weight"], src[a + "q_a_proj.weight"])  # low rank: replicated
        assert torch.equal(s["layers.0.moe.gate.weight"], src["model.layers.0.mlp.router.classifier.weight"])
        # 12 experts, 6 a rank: rank 0 holds routed 0-5, rank 1 routed 6-7 and zero experts 8-11 (gate, up only)
        held = sorted(int(n.split(".")[4]) for n in s if n.startswith("layers.0.moe.experts.") and ".w1." in n)
        assert held == list(range(r * 6, (r + 1) * 6))
        assert sorted(int(n.split(".")[4]) for n in s if n.startswith("layers.0.moe.experts.") and ".w2." in n) \
            == [e for e in held if e < 8]


def test_plan_and_inspect_read_it(longcat_hf):
    hf = longcat_hf["hub"][0]
    assert json.loads(run_cli("inspect", hf, "--json").stdout)["model_type"] == "longcat_flash"
    plan = json.loads(run_cli("plan", hf, "--mp", 4, "--json").stdout)
    assert [f["name"] for f in plan["files"]] == [f"model{r}-mp4.safetensors" for r in range(4)]


def test_mp_that_cuts_a_head_or_an_expert_range_is_refused(longcat_hf, tmp_path):
    proc = run_cli("shard", longcat_hf["hub"][0], tmp_path / "out", "--mp", 8, "--quiet", check=False)
    assert proc.returncode != 0 and "num_attention_heads (4) is not divisible by mp=8" in proc.stderr
    assert not (tmp_path / "out" / "model0-mp8.safetensors").exists()
    cfg = spec.LongcatFlashConfig.from_dict({**_config(longcat_hf["hub"][0]), "zero_expert_num": 2})
    with pytest.raises(PlanError, match=r"n_routed_experts \+ zero_expert_num .*\(10\) is not divisible by mp=4"):
        spec.check_mp(cfg, 4)


@pytest.mark.parametrize("extra, message", [
    ({"router_bias": True}, "router_bias"),
    ({"attention_bias": "yes"}, "attention_bias"),
    ({"mla_scale_q_lora": False}, "mla_scale_q_lora"),
    ({"zero_expert_type": "zero"}, "zero_expert_type"),
    ({"head_dim": 16}, "head_dim"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope type"),
])
def test_what_ckpttools_model_does_not_build_is_refused_by_name(longcat_hf, extra, message):
    with pytest.raises(InputError, match=message):
        spec.LongcatFlashConfig.from_dict({**_config(longcat_hf["hub"][0]), **extra})


def test_transformers_own_stacked_form_reads_as_its_per_expert_spelling(longcat_hf, tmp_path):
    """save_original_format=False: `gate_up_proj` [8 routed + 4 zero, 2I, H] beside `down_proj` [8, H, I]. It
    plans, shards at mp 1, 2 and 4 to the very tensors the per-expert spelling gives, and merges back to that
    spelling byte for byte."""
    stacked, per_expert = longcat_hf["stacked"][0], longcat_hf["transformers"][0]
    saved = load_file(str(stacked / "model.safetensors"))
    assert saved["model.layers.1.mlp.experts.gate_up_proj"].shape == (12, 64, 64)
    assert saved["model.layers.1.mlp.experts.down_proj"].shape == (8, 64, 32)
    assert json.loads(run_cli("inspect", stacked, "--json").stdout)["model_type"] == "longcat_flash"
    for mp in (1, 2, 4):
        run_cli("shard", stacked, tmp_path / f"a{mp}", "--mp", mp, "--quiet")
        run_cli("shard", per_expert, tmp_path / f"b{mp}", "--mp", mp, "--quiet")
        a, b = load_dir(tmp_path / f"a{mp}"), load_dir(tmp_path / f"b{mp}")
        assert a.keys() == b.keys() and all(a[f].keys() == b[f].keys() for f in a), mp
        for f in a:
            for n, t in a[f].items():
                assert t.dtype == b[f][n].dtype and torch.equal(t, b[f][n]), (mp, f, n)
    run_cli("merge", tmp_path / "a4", tmp_path / "hf", "--quiet")
    _equal_files(per_expert / "model.safetensors", tmp_path / "hf" / "model.safetensors")


@pytest.mark.parametrize("mp", [1, 2])
def test_the_stacked_form_verifies_against_itself(longcat_hf, tmp_path, mp):
    """transformers loads its own form: the oracle, and the reference each loaded weight is compared with."""
    stacked, ids, logits = longcat_hf["stacked"]
    run_cli("shard", stacked, tmp_path / "mp", "--mp", mp, "--quiet")
    report = run_verify(tmp_path / "mp", prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, device="cpu",
                        reference=stacked)
    rendered = report.render(tmp_path / "mp")
    assert report.ok and report.generated_ids == ids, rendered
    assert "LongcatFlashForCausalLM" in rendered and report.checks["weights"].ok, rendered


@pytest.fixture(scope="module")
def biased_hf(tmp_path_factory) -> tuple:
    """attention_bias: true (biases on q_a_proj, kv_a_proj_with_mqa and o_proj, each perturbed): (HF dir,
    transformers' greedy ids, their logits)."""
    hf = build_hf("longcat_flash", tmp_path_factory.mktemp("longcat_biased") / "hf",
                  spec={**TINY, "attention_bias": True})
    return (hf, *greedy_oracle(hf))


def test_attention_biases_are_cut_as_their_weights(biased_hf, tmp_path):
    """The low-rank down-projections' biases replicated with their weights, o_proj's whole on every rank (the
    model adds it once, after the all-reduce), and mp 4 merges back byte for byte."""
    hf = biased_hf[0]
    src = load_file(str(hf / "model.safetensors"))
    a = "model.layers.1.self_attn.0."
    assert {a + "q_a_proj.bias", a + "kv_a_proj_with_mqa.bias", a + "o_proj.bias"} <= src.keys()
    assert not any(n.endswith(".bias") and (".q_b_proj." in n or ".kv_b_proj." in n) for n in src)
    cfg = spec.LongcatFlashConfig.from_dict(_config(hf))
    assert cfg.attention_bias
    assert spec.hf_tensor_shapes(spec.spelled(cfg, src), False) == {k: tuple(v.shape) for k, v in src.items()}
    assert json.loads(run_cli("inspect", hf, "--json").stdout)["model_type"] == "longcat_flash"
    run_cli("shard", hf, tmp_path / "mp", "--mp", 4, "--quiet")
    shards = load_dir(tmp_path / "mp")
    for r in range(4):
        s = shards[f"model{r}-mp4.safetensors"]
        for leaf in ("q_a_proj.bias", "kv_a_proj_with_mqa.bias", "o_proj.bias"):
            assert torch.equal(s[f"layers.1.attn.0.{leaf}"], src[a + leaf]), (r, leaf)
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    _equal_files(hf / "model.safetensors", tmp_path / "hf" / "model.safetensors")


@pytest.mark.parametrize("mp", [1, 2])
def test_attention_biases_verify_as_transformers(biased_hf, tmp_path, mp):
    hf, ids, logits = biased_hf
    run_cli("shard", hf, tmp_path / "mp", "--mp", mp, "--quiet")
    report = run_verify(tmp_path / "mp", prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, device="cpu", reference=hf,
                        logits_path=tmp_path / "logits.safetensors")
    rendered = report.render(tmp_path / "mp")
    assert report.ok and report.generated_ids == ids, rendered
    assert "LongcatFlashForCausalLM" in rendered
    assert (load_file(str(tmp_path / "logits.safetensors"))["logits"] - logits).abs().max() < 1e-3


def _mtp_layer() -> dict[str, torch.Tensor]:
    """The published checkpoints' MTP layer for TINY, under the names vLLM's and SGLang's LongCat MTP models load
    (one MLA attention, a dense MLP of ffn_hidden_size), every value random."""
    h, v, f, p = 64, 256, 96, "model.mtp.layers.0."
    shapes = {"model.mtp.embed_tokens.weight": (v, h), "model.mtp.norm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
              p + "enorm.m.weight": (h,), p + "hnorm.m.weight": (h,), p + "input_layernorm.weight": (h,),
              p + "post_attention_layernorm.weight": (h,), p + "self_attn.q_a_proj.weight": (24, h),
              p + "self_attn.q_a_layernorm.weight": (24,), p + "self_attn.q_b_proj.weight": (4 * 24, 24),
              p + "self_attn.kv_a_proj_with_mqa.weight": (16 + 8, h), p + "self_attn.kv_a_layernorm.weight": (16,),
              p + "self_attn.kv_b_proj.weight": (4 * 32, 16), p + "self_attn.o_proj.weight": (h, 4 * 16),
              p + "transformer_layer.mlp.gate_proj.weight": (f, h), p + "transformer_layer.mlp.up_proj.weight": (f, h),
              p + "transformer_layer.mlp.down_proj.weight": (h, f)}
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(shape, generator=g).bfloat16() for n, shape in shapes.items()}


@pytest.fixture(scope="module")
def mtp_hf(longcat_hf, tmp_path_factory) -> dict:
    """spelling -> HF dir of the same weights with the MTP layer beside them (transformers' spelling is also the
    reference: transformers loads it, ignoring `model.mtp.*`)."""
    root, mtp = tmp_path_factory.mktemp("longcat_mtp"), _mtp_layer()
    out = {}
    for spelling in ("transformers", "hub"):
        src = longcat_hf[spelling][0]
        (root / spelling).mkdir()
        shutil.copy(src / "config.json", root / spelling / "config.json")
        save_file({**load_file(str(src / "model.safetensors")), **mtp}, str(root / spelling / "model.safetensors"),
                  metadata={"format": "pt"})
        out[spelling] = root / spelling
    return out


def test_the_mtp_layer_is_read_with_its_published_names_and_dropped_from_mp_by_default(mtp_hf, tmp_path):
    hf = mtp_hf["hub"]
    tensors = load_file(str(hf / "model.safetensors"))
    cfg = spec.spelled(spec.LongcatFlashConfig.from_dict(_config(hf)), tensors)
    assert spec.hf_tensor_shapes(cfg) == {k: tuple(v.shape) for k, v in tensors.items()}
    assert json.loads(run_cli("inspect", hf, "--json").stdout)["model_type"] == "longcat_flash"
    plan = json.loads(run_cli("plan", hf, "--mp", 2, "--json").stdout)
    assert "dropped 17 MTP tensors (keep them with --keep-mtp)" in plan["notes"]
    run_cli("shard", hf, tmp_path / "mp", "--mp", 2, "--quiet")
    assert not any(n.startswith("mtp.") for s in load_dir(tmp_path / "mp").values() for n in s)


def test_a_kept_mtp_layer_is_cut_like_a_layer_and_merges_back_byte_for_byte(mtp_hf, tmp_path):
    hf = mtp_hf["hub"]
    src, p = load_file(str(hf / "model.safetensors")), "model.mtp.layers.0."
    for mp in (1, 2, 4):
        run_cli("shard", hf, tmp_path / f"mp{mp}", "--mp", mp, "--keep-mtp", "--quiet")
        run_cli("merge", tmp_path / f"mp{mp}", tmp_path / f"hf{mp}", "--quiet")
        _equal_files(hf / "model.safetensors", tmp_path / f"hf{mp}" / "model.safetensors")
    shards = load_dir(tmp_path / "mp4")
    for r in range(4):
        s = shards[f"model{r}-mp4.safetensors"]
        assert torch.equal(s["mtp.embed_tokens.weight"], src["model.mtp.embed_tokens.weight"][r * 64:(r + 1) * 64])
        assert torch.equal(s["mtp.layers.0.attn.q_b_proj.weight"], src[p + "self_attn.q_b_proj.weight"][r * 24:(r + 1) * 24])
        assert torch.equal(s["mtp.layers.0.attn.o_proj.weight"], src[p + "self_attn.o_proj.weight"][:, r * 16:(r + 1) * 16])
        assert torch.equal(s["mtp.layers.0.mlp.w2.weight"],
                           src[p + "transformer_layer.mlp.down_proj.weight"][:, r * 24:(r + 1) * 24])
        for mine, theirs in (("eh_proj", "eh_proj"), ("enorm", "enorm.m"), ("attn.q_a_proj", "self_attn.q_a_proj")):
            assert torch.equal(s[f"mtp.layers.0.{mine}.weight"], src[f"{p}{theirs}.weight"]), mine


@pytest.mark.parametrize("spelling, mp", [("transformers", 1), ("transformers", 2), ("hub", 2)])
def test_a_kept_mtp_layer_verifies_and_is_compared_with_the_reference(longcat_hf, mtp_hf, tmp_path, spelling, mp):
    """verify runs the main model (transformers has no MTP to compare with) and compares every MTP tensor of each
    rank with its slice of the reference: one changed value fails it. A published reference (which transformers
    cannot load) is answered by the bundled model, loaded from it with the MTP layer left out."""
    hf, ids = mtp_hf[spelling], longcat_hf[spelling][1]
    run_cli("shard", hf, tmp_path / "mp", "--mp", mp, "--keep-mtp", "--quiet")
    report = run_verify(tmp_path / "mp", prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, device="cpu", reference=hf)
    rendered = report.render(tmp_path / "mp")
    assert report.ok and report.generated_ids == ids, rendered
    assert ("LongcatFlashForCausalLM" if spelling == "transformers" else "the bundled model at mp=1") in rendered
    assert "17 MTP (not run; each compared with its slice of the reference" in report.checks["load"].detail
    if (spelling, mp) != ("transformers", 2):  # one changed value, once: the check is the same at every mp
        return
    last = tmp_path / "mp" / f"model{mp - 1}-mp{mp}.safetensors"
    tensors = load_file(str(last))
    tensors["mtp.layers.0.mlp.w2.weight"][0, 0] += 1
    save_file(tensors, str(last), metadata={"format": "pt"})
    report = run_verify(tmp_path / "mp", prompt_ids=PROMPT, max_new_tokens=1, device="cpu", reference=hf)
    assert not report.ok and "'mtp.layers.0.mlp.w2.weight' in " + last.name + " differs from its slice of reference " \
        "'model.mtp.layers.0.transformer_layer.mlp.down_proj.weight'" in report.checks["weights"].detail
