"""Qwen3-MoE in its published block-FP8 form (F8_E4M3 weights with a 128x128 float32
`weight_scale_inv` per linear weight, routed experts included; router, norms, embeddings and head in
BF16): dequant bit-equal to the block formula, shard keeping FP8 where cuts fall on blocks and a clear
refusal where they do not (fixed by --dtype bf16), verify against transformers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import load_dir, run_cli
from dense_models import NEW_TOKENS, PROMPT, build_hf, greedy_oracle
from reference_pipeline import formula_dequant

from ckpttool.families.moe import spec
from ckpttool.verify.run import run_verify

pytest.importorskip("transformers")

# head_dim 128 and widths of 128/256 so that mp=2 cuts fall on FP8 blocks; at mp=4 the dense MLP's
# 256 columns become 64 per rank, which an FP8 block cannot straddle (Qwen3's FP8 at TP 8 in small).
QWEN3_FP8 = dict(cls="Qwen3MoeForCausalLM", config="Qwen3MoeConfig", vocab_size=256, hidden_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                 intermediate_size=256, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                 norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=64, tie_word_embeddings=False)
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def quantize_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 128x128 block: scale = amax / 448, codes = w / scale in e4m3 (how such checkpoints are made)."""
    rows, cols = w.shape
    w = w.float()
    scale = torch.ones(-(-rows // block), -(-cols // block))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            amax = tile.abs().max()
            scale[i, j] = amax / 448.0 if amax > 0 else 1.0
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


@pytest.fixture(scope="module")
def qwen3_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3fp8")
    bf16 = build_hf("qwen3_moe", root / "bf16", spec=QWEN3_FP8)
    keys = spec.KEY_MAPS["qwen3_moe"]
    out = {}
    for name, t in load_file(str(bf16 / "model.safetensors")).items():
        if keys.is_linear(name):
            out[name], out[name + "_scale_inv"] = quantize_block(t)
        else:
            out[name] = t
    fp8 = root / "fp8"
    fp8.mkdir()
    save_file(out, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((bf16 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}))
    return fp8


def test_linear_weights_of_experts_and_attention_are_fp8_and_the_router_is_not(qwen3_fp8):
    tensors = load_file(str(qwen3_fp8 / "model.safetensors"))
    assert tensors["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 1)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


def test_dequant_is_the_block_formula_bit_for_bit_and_drops_the_quantization_config(qwen3_fp8, tmp_path):
    run_cli("dequant", qwen3_fp8, tmp_path / "bf16", "--quiet")
    src = load_file(str(qwen3_fp8 / "model.safetensors"))
    ours = load_dir(tmp_path / "bf16")["model.safetensors"]
    assert set(ours) == {n for n in src if not n.endswith("_scale_inv")}
    for name, t in ours.items():
        want = formula_dequant(src[name], src[name + "_scale_inv"]) if src[name].element_size() == 1 else src[name]
        assert t.dtype == torch.bfloat16 and torch.equal(t, want), name
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())


def test_fp8_kept_shards_verify_against_transformers(qwen3_fp8, tmp_path):
    run_cli("shard", qwen3_fp8, tmp_path / "mp", "--mp", 2, "--quiet")
    shard = load_dir(tmp_path / "mp")["model1-mp2.safetensors"]
    assert shard["layers.1.feed_forward.experts.3.w2.weight"].dtype == torch.float8_e4m3fn
    assert shard["layers.1.feed_forward.experts.3.w2.scale"].shape == (2, 1)
    report = run_verify(tmp_path / "mp", prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, device="cpu",
                        reference=qwen3_fp8)
    assert report.ok, report.render(tmp_path / "mp")


def test_fp8_cut_off_block_boundaries_is_refused_and_bf16_output_works(qwen3_fp8, tmp_path):
    proc = run_cli("shard", qwen3_fp8, tmp_path / "fp8", "--mp", 4, "--quiet", check=False)
    assert proc.returncode != 0
    assert "FP8 block boundaries" in proc.stderr and "--dtype bf16" in proc.stderr
    assert not (tmp_path / "fp8" / "model0-mp4.safetensors").exists()

    run_cli("convert", qwen3_fp8, tmp_path / "bf16", "--mp", 4, "--quiet")
    run_cli("dequant", qwen3_fp8, tmp_path / "hf", "--quiet")
    ids, _ = greedy_oracle(tmp_path / "hf")
    report = run_verify(tmp_path / "bf16", prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS, device="cpu",
                        reference=qwen3_fp8)
    assert report.ok, report.render(tmp_path / "bf16")
    assert report.generated_ids == ids


def test_stacked_fp8_experts_with_stacked_scales_dequant_and_shard_like_per_expert(qwen3_fp8, tmp_path):
    """FP8 experts stacked as transformers 5 holds them, with `gate_up_proj_scale_inv` [E, 2I/128, H/128]
    stacked alike: dequant gives the per-expert weights of the block formula, and FP8-kept shards equal
    those of the per-expert checkpoint."""
    import shutil

    from dense_models import stack_experts

    src = load_file(str(qwen3_fp8 / "model.safetensors"))
    tensors = stack_experts(stack_experts(src, 4), 4, suffix="weight_scale_inv", stacked_suffix="_scale_inv")
    assert tensors["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape == (4, 2, 2)
    stacked = tmp_path / "stacked"
    shutil.copytree(qwen3_fp8, stacked)
    save_file(tensors, str(stacked / "model.safetensors"), metadata={"format": "pt"})

    run_cli("dequant", stacked, tmp_path / "bf16", "--quiet")
    ours = load_dir(tmp_path / "bf16")["model.safetensors"]
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    assert torch.equal(ours[name], formula_dequant(src[name], src[name + "_scale_inv"]))
    assert set(ours) == {n for n in src if not n.endswith("_scale_inv")}

    run_cli("shard", stacked, tmp_path / "a", "--mp", 2, "--quiet")
    run_cli("shard", qwen3_fp8, tmp_path / "b", "--mp", 2, "--quiet")
    a, b = load_dir(tmp_path / "a"), load_dir(tmp_path / "b")
    for f in b:
        assert a[f].keys() == b[f].keys() and all(torch.equal(_bits(a[f][n]), _bits(b[f][n])) for n in b[f]), f


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
