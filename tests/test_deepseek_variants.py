"""DeepSeek variants: an MTP layer kept with --keep-mtp passes verify (skipped and said so), and
DeepSeek-V3.1's `scale_fmt: ue8m0` FP8 configs (scales still float32, not powers of two) dequantize
to exactly the block formula, with the quantization section gone from the output config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckpttool.errors import CkptError
from ckpttool.families.deepseek.demo import build_checkpoint
from ckpttool.verify.run import run_verify
from conftest import load_dir, run_cli
from mla_models import perturb
from reference_pipeline import formula_dequant


def test_keep_mtp_output_passes_verify_and_says_the_mtp_layer_is_skipped(tiny_v3, tmp_path):
    run_cli("convert", tiny_v3, tmp_path / "mp", "--mp", 2, "--keep-mtp", "--quiet")
    with safe_open(str(tmp_path / "mp" / "model0-mp2.safetensors"), "pt") as f:
        assert any(k.startswith("layers.3.") for k in f.keys())  # the MTP layer is in the shards
    report = run_verify(tmp_path / "mp", reference=tiny_v3, prompt_ids=[0, 5, 9], max_new_tokens=3)
    assert report.ok, report.render("keep-mtp")
    assert "MTP tensor(s) on rank 0 skipped" in report.checks["load"].detail


def test_demo_weights_depend_on_seed_and_name_only(tmp_path):
    """verify's MTP tests compare an MTP-less conversion against the same seed's checkpoint with an MTP
    layer: that holds only while adding a layer leaves every other tensor's values as they were."""
    without = load_dir(build_checkpoint(tmp_path / "a", "tiny-v3", seed=1, overrides={"num_nextn_predict_layers": 0}))
    with_mtp = load_dir(build_checkpoint(tmp_path / "b", "tiny-v3", seed=1))
    other_seed = load_dir(build_checkpoint(tmp_path / "c", "tiny-v3", seed=2, overrides={"num_nextn_predict_layers": 0}))
    flat = [{k: v for f in d.values() for k, v in f.items()} for d in (without, with_mtp, other_seed)]
    assert set(flat[1]) > set(flat[0])
    assert all(torch.equal(v, flat[1][k]) for k, v in flat[0].items())
    assert not torch.equal(flat[0]["model.layers.0.self_attn.q_a_proj.weight"].float(),
                           flat[2]["model.layers.0.self_attn.q_a_proj.weight"].float())


def test_v31_ue8m0_scale_format_dequantizes_to_the_block_formula(tmp_path):
    src = build_checkpoint(tmp_path / "v31", "tiny-v3", seed=4, overrides={"num_nextn_predict_layers": 0})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["scale_fmt"] = "ue8m0"  # DeepSeek-V3.1's config; the scales stay float32
    (src / "config.json").write_text(json.dumps(config))
    tensors = {k: v for f in load_dir(src).values() for k, v in f.items()}
    scales = [v for k, v in tensors.items() if k.endswith("_scale_inv")]
    assert all(s.dtype == torch.float32 for s in scales)
    assert any((torch.log2(s) != torch.log2(s).round()).any() for s in scales)  # not all powers of two

    run_cli("dequant", src, tmp_path / "bf16", "--quiet")
    out = {k: v for f in load_dir(tmp_path / "bf16").values() for k, v in f.items()}
    for name, w in tensors.items():
        if w.dtype == torch.float8_e4m3fn:
            want = formula_dequant(w, tensors[name + "_scale_inv"])
            assert torch.equal(out[name].view(torch.int16), want.view(torch.int16)), name
    assert not any(k.endswith("_scale_inv") for k in out)
    written = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert "quantization_config" not in written and written["torch_dtype"] == "bfloat16"

    run_cli("convert", src, tmp_path / "mp", "--mp", 2, "--quiet")
    report = run_verify(tmp_path / "mp", reference=src, prompt_ids=[0, 5, 9], max_new_tokens=3)
    assert report.ok, report.render("v3.1")


def _tiny_v32(dst: Path, *, index_topk: int = 64) -> Path:
    """A DeepseekV32ForCausalLM that transformers builds and saves: V3 plus the indexer, non-trivial norms,
    LayerNorm bias and router bias; index_topk above prompt + generation unless said otherwise."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV32Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=128, routed_scaling_factor=2.5,
        index_n_heads=2, index_head_dim=16, index_topk=index_topk,
        rope_parameters={"rope_theta": 40000.0, "rope_type": "default"}, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(5)
    model = transformers.DeepseekV32ForCausalLM(config)
    perturb(model)
    model.save_pretrained(dst)
    return dst


@pytest.mark.parametrize("mp", [1, 2])
def test_v32_indexer_is_replicated_and_verifies_against_transformers(tmp_path, mp):
    """The indexer's wq_b is whole on every rank while MLA's wq_b is cut; verify loads and checks every
    indexer tensor and, for a sequence shorter than index_topk, gives transformers' DeepseekV32 tokens."""
    src = _tiny_v32(tmp_path / "v32")
    run_cli("shard", src, tmp_path / "mp", "--mp", mp, "--quiet")
    ref = load_file(str(src / "model.safetensors"))
    for r in range(mp):
        shard = load_file(str(tmp_path / "mp" / f"model{r}-mp{mp}.safetensors"))
        assert torch.equal(shard["layers.1.attn.indexer.wq_b.weight"], ref["model.layers.1.self_attn.indexer.wq_b.weight"])
        assert torch.equal(shard["layers.1.attn.indexer.k_norm.bias"], ref["model.layers.1.self_attn.indexer.k_norm.bias"])
        assert shard["layers.1.attn.wq_b.weight"].shape[0] == ref["model.layers.1.self_attn.q_b_proj.weight"].shape[0] // mp
    report = run_verify(tmp_path / "mp", prompt_ids=[3, 17, 42, 99, 7, 150], max_new_tokens=6, device="cpu",
                        reference=src)
    assert report.ok, report.render(tmp_path / "mp")
    assert "DeepseekV32ForCausalLM" in report.render(tmp_path / "mp")
    run_cli("merge", tmp_path / "mp", tmp_path / "merged", "--quiet")
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert merged.keys() == ref.keys() and all(torch.equal(ref[n], merged[n]) for n in ref)


def test_v32_sequences_longer_than_index_topk_are_refused_by_verify(tmp_path):
    """Beyond index_topk the indexer would drop keys; verify's model, which runs dense attention, says so."""
    src = _tiny_v32(tmp_path / "v32", index_topk=8)
    run_cli("shard", src, tmp_path / "mp", "--mp", 1, "--quiet")
    with pytest.raises(CkptError, match="exceed DeepSeek-V3.2's index_topk"):
        run_verify(tmp_path / "mp", prompt_ids=[3, 17, 42, 99, 7, 150], max_new_tokens=6, device="cpu")


def test_a_config_counting_2_30_mtp_layers_is_refused_before_expanding_them(tiny_v3, tmp_path):
    """MTP layers count against the headers like the main layers (a fuzzed count once took 20 GB)."""
    import shutil

    src = tmp_path / "huge-mtp"
    shutil.copytree(tiny_v3, src)
    raw = json.loads((src / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1 << 30
    (src / "config.json").write_text(json.dumps(raw))
    proc = run_cli("plan", src, "--mp", 1, check=False)
    assert proc.returncode != 0
    assert f"num_nextn_predict_layers = {1 << 30} cannot describe" in proc.stderr
