"""Issue 7, gpt-oss through the CLI on real files: `dequant` is bit-equal to transformers' own MXFP4
dequantization and the export runs in transformers; `convert --mp 2` verifies against the MXFP4
original; `shard --mp 2` keeps MXFP4 and cuts experts into contiguous ranges; bad mp is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttool.families.gpt_oss.spec import GptOssConfig, expert_range
from ckpttool.verify.run import run_verify
from conftest import load_dir, run_cli

PROMPT = [0, 5, 9, 11, 3, 20, 7, 8, 30, 4]  # longer than the tiny sliding window (4)
NEW_TOKENS = 6
INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT_OF[t.element_size()])


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for tensors in load_dir(path).values() for k, v in tensors.items()}


def load_transformers(path: Path, dtype: torch.dtype):
    """transformers' GptOssForCausalLM; an MXFP4 checkpoint is dequantized by transformers itself (CPU)."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    mxfp4 = "quantization_config" in json.loads((path / "config.json").read_text())
    kwargs = {"quantization_config": Mxfp4Config(dequantize=True)} if mxfp4 else {}
    return GptOssForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()


def transformers_greedy(model) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        logits = model(ids).logits
    return out[0, len(PROMPT):].tolist(), logits


@pytest.fixture(scope="module")
def bf16_export(tiny_gpt_oss, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpt-oss-out") / "bf16"
    run_cli("dequant", tiny_gpt_oss, out, "--quiet")
    return out


@pytest.fixture(scope="module")
def mxfp4_greedy(tiny_gpt_oss) -> tuple[list[int], torch.Tensor]:
    """transformers' float32 greedy tokens and prompt logits for the published MXFP4 checkpoint."""
    return transformers_greedy(load_transformers(tiny_gpt_oss, torch.float32))


@pytest.fixture(scope="module")
def bf16_mp2(tiny_gpt_oss, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpt-oss-out") / "mp2"
    run_cli("convert", tiny_gpt_oss, out, "--mp", 2, "--dtype", "bf16", "--quiet")
    return out


@pytest.fixture(scope="module")
def mxfp4_mp2(tiny_gpt_oss, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpt-oss-out") / "mxfp4-mp2"
    run_cli("shard", tiny_gpt_oss, out, "--mp", 2, "--quiet")
    return out


# -- (a), (b): the BF16 HF export ---------------------------------------------------------------------
def test_dequant_equals_transformers_mxfp4_dequantization_bit_for_bit(tiny_gpt_oss, bf16_export):
    ours = hf_tensors(bf16_export)
    theirs = load_transformers(tiny_gpt_oss, torch.bfloat16).state_dict()
    # transformers' parameter names are the HF file names; nothing else (e.g. rope buffers) is persistent
    assert sorted(ours) == sorted(theirs)
    experts = [n for n in ours if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(experts) == 2 * 3, "every layer's two MXFP4 expert weights became BF16"
    for name, value in theirs.items():
        mine = ours[name]
        assert mine.dtype == value.dtype == torch.bfloat16 and mine.shape == value.shape, name
        assert torch.equal(bits(mine), bits(value)), f"{name} differs from transformers' dequantization"

    index = json.loads((bf16_export / "model.safetensors.index.json").read_text())
    assert not [n for n in index["weight_map"] if n.endswith(("_blocks", "_scales"))]
    assert set(index["weight_map"]) == set(ours)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())
    config = json.loads((bf16_export / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    source_config = json.loads((tiny_gpt_oss / "config.json").read_text())
    assert {k: v for k, v in config.items() if k not in ("torch_dtype", "quantization_config")} == \
        {k: v for k, v in source_config.items() if k not in ("torch_dtype", "quantization_config")}
    for name in ("tokenizer.json", "generation_config.json"):
        assert (bf16_export / name).read_bytes() == (tiny_gpt_oss / name).read_bytes()


def test_bf16_export_generates_like_the_mxfp4_original_in_transformers(bf16_export, mxfp4_greedy):
    tokens, logits = transformers_greedy(load_transformers(bf16_export, torch.float32))
    want_tokens, want_logits = mxfp4_greedy
    assert torch.equal(logits, want_logits)  # same weights, bit for bit, so the same float32 run
    assert tokens == want_tokens and len(tokens) >= 2


# -- (c): BF16 mp shards verify against the MXFP4 original ---------------------------------------------
def test_convert_mp2_verifies_against_mxfp4_reference(bf16_mp2, tiny_gpt_oss, mxfp4_greedy):
    proc = run_cli("verify", bf16_mp2, "--reference", tiny_gpt_oss, "--prompt-ids", ",".join(map(str, PROMPT)),
                   "--max-new-tokens", NEW_TOKENS, "--json", check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], proc.stdout + proc.stderr
    assert set(report["checks"]) == {"load", "weights", "finite", "generate", "reference"}
    assert report["mp"] == 2 and report["max_abs_logit_diff"] < 1e-3
    assert report["generated_ids"] == mxfp4_greedy[0], "greedy ids differ from transformers' float32 run"


def test_verify_catches_swapped_experts(bf16_mp2, tiny_gpt_oss, tmp_path):
    """Rank 1 holding its two experts in the wrong order loads (shapes agree) but is named by the
    weights check and moves the logits."""
    broken = tmp_path / "mp2"
    shutil.copytree(bf16_mp2, broken)
    path = broken / "model1-mp2.safetensors"
    tensors = load_file(path)
    for name in ("layers.1.ffn.experts.w13", "layers.1.ffn.experts.b13"):
        tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(path))
    report = run_verify(broken, reference=tiny_gpt_oss, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    assert not report.ok and report.checks["load"].ok
    assert not report.checks["weights"].ok and "'layers.1.ffn.experts.w13' in model1-mp2" in \
        report.checks["weights"].detail
    assert "layers.1.ffn.experts.b13" in report.checks["weights"].detail
    assert not report.checks["reference"].ok


# -- (d): MXFP4 kept, experts by contiguous range ------------------------------------------------------
def test_shard_mp2_keeps_mxfp4_and_splits_experts_by_range(tiny_gpt_oss, mxfp4_mp2):
    src = hf_tensors(tiny_gpt_oss)
    cfg = GptOssConfig.load(tiny_gpt_oss / "config.json")
    shards = load_dir(mxfp4_mp2)
    assert sorted(shards) == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    assert json.loads((mxfp4_mp2 / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    hf_of = {"w13_blocks": "gate_up_proj_blocks", "w13_scales": "gate_up_proj_scales", "b13": "gate_up_proj_bias",
             "w2_blocks": "down_proj_blocks", "w2_scales": "down_proj_scales", "b2": "down_proj_bias"}
    for rank in range(2):
        tensors = shards[f"model{rank}-mp2.safetensors"]
        experts = expert_range(cfg, rank, 2)
        assert list(experts) == [2 * rank, 2 * rank + 1]
        assert not [n for n in tensors if n.endswith((".w13", ".w2"))], "MXFP4 was dequantized"
        for layer in range(cfg.num_hidden_layers):
            for native, hf in hf_of.items():
                mine = tensors[f"layers.{layer}.ffn.experts.{native}"]
                theirs = src[f"model.layers.{layer}.mlp.experts.{hf}"][experts.start:experts.stop]
                assert mine.dtype == theirs.dtype and torch.equal(bits(mine), bits(theirs)), (rank, layer, native)
        # the router sees every expert: replicated, not cut with them
        assert torch.equal(tensors["layers.0.ffn.gate.weight"], src["model.layers.0.mlp.router.weight"])


def test_mxfp4_shards_verify_against_bf16_export(mxfp4_mp2, bf16_export, mxfp4_greedy):
    """verify dequantizes MXFP4 shards on load (the same function as `dequant`), so they run as the BF16 ones."""
    report = run_verify(mxfp4_mp2, reference=bf16_export, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    assert report.ok, report.render(mxfp4_mp2)
    assert report.generated_ids == mxfp4_greedy[0]


@pytest.mark.parametrize("change, expected", [
    (lambda t: t.pop("layers.2.ffn.experts.w2_scales"), "'layers.2.ffn.experts.w2_blocks' has no scales"),
    (lambda t: t.pop("layers.0.attn.sinks"), "missing tensor 'layers.0.attn.sinks'"),
    (lambda t: t.update({"layers.1.ffn.experts.w13": torch.zeros(2, 64, 192, dtype=torch.bfloat16)}),
     "unexpected tensor 'layers.1.ffn.experts.w13'"),
])
def test_broken_mxfp4_shard_fails_load_naming_the_tensor(mxfp4_mp2, tmp_path, change, expected):
    broken = tmp_path / "mp2"
    shutil.copytree(mxfp4_mp2, broken)
    tensors = load_file(broken / "model1-mp2.safetensors")
    change(tensors)
    save_file(tensors, str(broken / "model1-mp2.safetensors"))
    report = run_verify(broken, prompt_ids=PROMPT, max_new_tokens=2)
    assert not report.ok and not report.checks["load"].ok
    assert expected in report.checks["load"].detail and "model1-mp2.safetensors" in report.checks["load"].detail


# -- (e): gpt-oss-specific refusals ---------------------------------------------------------------------
@pytest.mark.parametrize("command, mp, field", [
    ("convert", 3, "num_attention_heads (4) is not divisible by mp=3"),
    ("shard", 3, "num_attention_heads (4) is not divisible by mp=3"),
    # 4 query heads divide, 2 KV heads do not: gpt-oss cuts KV heads, it never replicates them
    ("convert", 4, "num_key_value_heads (2) is not divisible by mp=4"),
])
def test_mp_that_cuts_a_head_is_refused_naming_the_field(tiny_gpt_oss, tmp_path, command, mp, field):
    extra = ["--dtype", "bf16"] if command == "convert" else []
    proc = run_cli(command, tiny_gpt_oss, tmp_path / "out", "--mp", mp, *extra, check=False)
    assert proc.returncode != 0
    assert field in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.gpu
def test_cuda_dequant_through_streams_equals_cpu_bytes(tiny_gpt_oss, tmp_path):
    """MXFP4 experts through the per-worker streams and pinned buffers, every chunk on the GPU."""
    from ckpttool.plan.build import Spec
    from ckpttool.runner import ExecOptions, convert

    spec = Spec(dequant=True)
    convert(tiny_gpt_oss, tmp_path / "cpu", spec, ExecOptions(quiet=True, device="cpu"))
    gpu = convert(tiny_gpt_oss, tmp_path / "gpu", spec, ExecOptions(quiet=True, device="cuda", chunk_bytes=4096,
                                                                   workers=3, wait_for_cuda=True))
    assert gpu.timings.to_json()["counts"]["chunks_on_gpu"] > 10
    for f in (tmp_path / "cpu").iterdir():
        assert f.read_bytes() == (tmp_path / "gpu" / f.name).read_bytes(), f.name
