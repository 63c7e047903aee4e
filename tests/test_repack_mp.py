"""Exact repacks sharded in the same pass (`quantize --to fp8-block-deepseek --mp N`): DeepSeek-V4 as published (FP8
128x128 blocks with E8M0 scales, MXFP4 routed experts) -> the mp files DeepSeek's own V4 inference code loads on
Hopper: every linear weight FP8 e4m3 beside its E8M0 `.scale`, the experts repacked into the same blocks, `wo_a` in
BF16 (DeepSeek's convert.py dequantizes it: its model runs the grouped projection in BF16). The shards are byte for
byte `shard --mp N` of the repacked HF checkpoint; `verify` loads them (FP8 weights, E8M0 scales) and generates
transformers' greedy ids of the source; `merge` gives back the repacked HF checkpoint's bytes but for wo_a, which
comes back as the BF16 it holds. FP8 blocks of another size are refused by name: the mp layout cuts 128x128."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_dir, run_cli
from deepseek_v4_models import PROMPT, build
from fp8_builders import fp8_dequantize
from quant_builders import load_all, write_like
from test_deepseek_v4_fp8 import WIDE, _is_expert, published_form

from ckpttool.verify.run import run_verify

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("v4-repack-mp")
    bf16 = build(root / "bf16", spelling="deepseek", mtp=True, **WIDE)
    src = root / "fp8-128"
    scales = published_form(bf16, src, 128)
    run_cli("quantize", src, root / "repacked", "--to", "fp8-block-deepseek", "--quiet")
    run_cli("dequant", src, root / "reference", "--quiet")
    return {"src": src, "scales": scales, "repacked": root / "repacked", "reference": root / "reference"}


def _all(path) -> dict[str, torch.Tensor]:
    return {k: v for f in load_dir(path).values() for k, v in f.items()}


def _same_files(a, b) -> None:
    names = sorted(p.name for p in a.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in b.glob("*.safetensors"))
    for f in names:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def _published_nothing(path) -> bool:
    return not path.exists() or not any(p.suffix == ".safetensors" for p in path.iterdir())


@pytest.mark.parametrize("mp", [2, 4])
def test_v4_repacked_and_sharded_in_one_pass_is_shard_of_the_repack_and_verifies(v4, mp, tmp_path):
    run_cli("quantize", v4["src"], tmp_path / "mp", "--to", "fp8-block-deepseek", "--mp", mp, "--quiet")
    run_cli("shard", v4["repacked"], tmp_path / "shard", "--mp", mp, "--quiet")
    _same_files(tmp_path / "mp", tmp_path / "shard")
    config = json.loads((tmp_path / "mp" / "config.json").read_text())["quantization_config"]
    assert config["expert_dtype"] == "fp8" and config["weight_block_size"] == [128, 128]
    assert config["scale_fmt"] == "ue8m0"
    # what DeepSeek's V4 model holds per rank: FP8 + E8M0 scales, wo_a BF16 with no scale, experts on their rank
    repacked = _all(v4["repacked"])
    experts = sorted({n.split(".ffn.experts.")[1].split(".")[0] for n in repacked if _is_expert(n)}, key=int)
    for rank, shard in enumerate(load_dir(tmp_path / "mp").values()):
        held = sorted({int(n.split(".ffn.experts.")[1].split(".")[0]) for n in shard if _is_expert(n)})
        assert held == list(range(rank * len(experts) // mp, (rank + 1) * len(experts) // mp))
        for name, t in shard.items():
            if name.endswith("wo_a.weight"):
                assert t.dtype == torch.bfloat16 and name.replace("weight", "scale") not in shard, name
                full = fp8_dequantize(repacked[name], repacked[name.replace("weight", "scale")])
                part = full.shape[0] // mp
                assert torch.equal(t.view(torch.int16), full[rank * part:(rank + 1) * part].view(torch.int16)), name
            elif name in v4["scales"]:
                assert t.dtype == torch.float8_e4m3fn and shard[v4["scales"][name]].dtype == torch.float8_e8m0fnu, name
    report = run_verify(tmp_path / "mp", reference=v4["reference"], prompt_ids=PROMPT, max_new_tokens=6)
    text = report.render(tmp_path / "mp")
    assert report.ok and "DeepseekV4ForCausalLM" in text and "greedy ids agree" in text, text
    assert "quantized compared dequantized" in text


def test_merge_gives_back_the_repacked_bytes_but_wo_a_in_bf16(v4, tmp_path):
    run_cli("quantize", v4["src"], tmp_path / "mp", "--to", "fp8-block-deepseek", "--mp", 2, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "merged", "--quiet")
    repacked, merged = _all(v4["repacked"]), _all(tmp_path / "merged")
    wo_a = {n for n in repacked if ".attn.wo_a." in n}
    assert wo_a and set(merged) == set(repacked) - {n for n in wo_a if n.endswith(".scale")}
    for name, t in merged.items():
        if name in wo_a:
            want = fp8_dequantize(repacked[name], repacked[name.replace("weight", "scale")])
            assert t.dtype == torch.bfloat16 and torch.equal(t.view(torch.int16), want.view(torch.int16)), name
        else:
            assert t.dtype == repacked[name].dtype, name
            assert t.contiguous().view(torch.uint8).equal(repacked[name].contiguous().view(torch.uint8)), name
    # and it dequantizes to the source's BF16, tensor for tensor
    run_cli("dequant", tmp_path / "merged", tmp_path / "a", "--quiet")
    a, b = _all(tmp_path / "a"), _all(v4["reference"])
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))
                                        if a[k].dtype == torch.bfloat16 else torch.equal(a[k], b[k]) for k in a)
    # transformers loads it, its FP8 quantization_config beside a BF16 wo_a (its o_a_proj is not an FP8 linear;
    # without a GPU it dequantizes the rest), and gives the source's logits
    import transformers

    logits = {}
    for name, path in (("merged", tmp_path / "merged"), ("source", v4["reference"])):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            logits[name] = model(torch.tensor([PROMPT])).logits
    assert torch.equal(logits["merged"], logits["source"])


def test_v4_regrouped_into_128_blocks_shards_in_one_pass(v4, tmp_path):
    """FP8 32x32 blocks (V4's regrouped by fp8-32x32) merged back into 128x128 with --mp: the shards of the HF
    output, byte for byte, and verify agrees with transformers."""
    run_cli("quantize", v4["repacked"], tmp_path / "32", "--to", "fp8-32x32", "--quiet")
    run_cli("quantize", tmp_path / "32", tmp_path / "mp", "--to", "fp8-128x128", "--mp", 2, "--quiet")
    run_cli("quantize", tmp_path / "32", tmp_path / "hf", "--to", "fp8-128x128", "--quiet")
    run_cli("shard", tmp_path / "hf", tmp_path / "shard", "--mp", 2, "--quiet")
    _same_files(tmp_path / "mp", tmp_path / "shard")
    report = run_verify(tmp_path / "mp", reference=v4["reference"], prompt_ids=PROMPT, max_new_tokens=4)
    assert report.ok and "greedy ids agree" in report.render(tmp_path / "mp")


@pytest.mark.parametrize("to", ["fp8-32x32", "fp8-1x128"])
def test_blocks_the_mp_layout_does_not_cut_are_refused_by_name(v4, to, tmp_path):
    proc = run_cli("quantize", v4["src"], tmp_path / "out", "--to", to, "--mp", 2, check=False)
    assert proc.returncode != 0 and f"{to} output is HF layout only" in proc.stderr and "128x128" in proc.stderr
    assert _published_nothing(tmp_path / "out")


def test_32x32_blocks_kept_by_fp8_block_deepseek_are_refused_by_tensor(tmp_path_factory, tmp_path):
    """V4.1's 32x32 blocks: fp8-block-deepseek repacks the experts into the checkpoint's own blocks, which the mp
    layout does not cut: refused, naming a weight, before anything is written."""
    root = tmp_path_factory.mktemp("v41")
    bf16 = build(root / "bf16", spelling="deepseek", **WIDE)
    published_form(bf16, root / "fp8-32", 32)
    proc = run_cli("quantize", root / "fp8-32", tmp_path / "out", "--to", "fp8-block-deepseek", "--mp", 2, check=False)
    assert proc.returncode != 0 and "FP8 32x32 blocks" in proc.stderr and "tensor '" in proc.stderr
    assert "fp8-128x128" in proc.stderr  # the fix names the target that merges them into 128x128 blocks
    assert _published_nothing(tmp_path / "out")


def test_an_inexact_block_is_refused_by_tensor_and_block_with_mp(v4, tmp_path):
    """The exactness check runs in the sharded pass too: one group 20 binades below its block's largest is named
    (tensor, block) and no shard is published."""
    tensors, file_of = load_all(v4["src"])
    name = next(n for n in v4["scales"] if _is_expert(n))
    scale = tensors[v4["scales"][name]].view(torch.uint8).clone()
    values = tensors[name].view(torch.uint8).clone()
    scale[3, 2] = int(scale[3].max()) - 20
    values[3, 32:48] = 0x22
    tensors[name], tensors[v4["scales"][name]] = values.view(torch.int8), scale.view(torch.float8_e8m0fnu)
    write_like(v4["src"], tmp_path / "bad", tensors, file_of)
    proc = run_cli("quantize", tmp_path / "bad", tmp_path / "out", "--to", "fp8-block-deepseek", "--mp", 2,
                   check=False)
    assert proc.returncode != 0 and "cannot repack exactly" in proc.stderr and "block [0, 0]" in proc.stderr
    assert name in proc.stderr and _published_nothing(tmp_path / "out")


def test_published_v4_with_mxfp4_experts_is_not_cut_without_a_repack(v4, tmp_path):
    proc = run_cli("shard", v4["src"], tmp_path / "out", "--mp", 2, check=False)
    assert proc.returncode != 0 and "MXFP4 experts (DeepSeek-V4)" in proc.stderr
    assert "--to fp8-128x128 --mp N" in proc.stderr and _published_nothing(tmp_path / "out")


def test_verify_refuses_shards_its_config_does_not_describe(v4, tmp_path):
    """verify reads what the shards hold from config.json: scales said to be float32 while the shards hold E8M0 are
    named by tensor; MXFP4 experts said to be there (expert_dtype fp4) are refused naming config.json."""
    import shutil

    from ckpttool.errors import CkptError

    run_cli("quantize", v4["src"], tmp_path / "mp", "--to", "fp8-block-deepseek", "--mp", 2, "--quiet")
    for change, expect in (({"scale_fmt": "float"}, ".scale' is F8_E8M0"), ({"expert_dtype": "fp4"}, "expert_dtype")):
        bad = tmp_path / f"bad-{next(iter(change))}"
        shutil.copytree(tmp_path / "mp", bad)
        config = json.loads((bad / "config.json").read_text())
        config["quantization_config"].update(change)
        (bad / "config.json").write_text(json.dumps(config))
        (bad / "ckpttool-manifest.json").unlink()
        try:
            report = run_verify(bad, reference=v4["reference"], prompt_ids=PROMPT, max_new_tokens=2)
        except CkptError as exc:
            text = str(exc)
        else:
            assert not report.ok
            text = report.render(bad)
        assert expect in text, text


def test_v3_float_blocks_split_then_merged_with_mp_are_the_shards_of_the_original(tiny_v3, tmp_path):
    """DeepSeek-V3's F32 128x128 scales split into 32x32 (HF only) and merged back into 128x128 with --mp: the shards
    `shard --mp 2` makes of the original, byte for byte, config included (the repack gives back its very bytes)."""
    run_cli("quantize", tiny_v3, tmp_path / "32", "--to", "fp8-32x32", "--quiet")
    run_cli("quantize", tmp_path / "32", tmp_path / "mp", "--to", "fp8-128x128", "--mp", 2, "--quiet")
    run_cli("shard", tiny_v3, tmp_path / "shard", "--mp", 2, "--quiet")
    _same_files(tmp_path / "mp", tmp_path / "shard")
    assert (tmp_path / "mp" / "config.json").read_text() == (tmp_path / "shard" / "config.json").read_text()
