"""merge(shard(x)) == x: byte for byte for transformers-saved dense checkpoints, tensor for tensor (and
dtype for dtype, FP8 scales included) for the DeepSeek layouts."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import load_dir, run_cli
from ckpttool.io.layout import MANIFEST
from dense_models import TINY, build_hf

pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def dense_sources(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("merge-src")
    return {family: build_hf(family, root / family, seed=3) for family in TINY}


def _flat(path) -> dict[str, torch.Tensor]:
    return {k: v for tensors in load_dir(path).values() for k, v in tensors.items()}


@pytest.mark.parametrize("mp", [1, 2, 4])
@pytest.mark.parametrize("family", sorted(TINY))
def test_dense_shard_then_merge_is_byte_identical(dense_sources, tmp_path, family, mp):
    src = dense_sources[family]
    run_cli("shard", src, tmp_path / "mp", "--mp", mp, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (src / name).read_bytes(), name
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()  # one file, as transformers writes it
    assert run_cli("inspect", tmp_path / "hf", "--check").returncode == 0


@pytest.mark.parametrize("fixture,mp,extra", [("tiny_v3", 2, ["--keep-mtp"]), ("tiny_v2_lite", 2, []),
                                              ("tiny_v2_lite", 4, [])])
def test_deepseek_shard_then_merge_gives_the_same_tensors(request, tmp_path, fixture, mp, extra):
    """FP8 V3 (scales kept and split, MTP kept) and BF16 V2-Lite (experts on their ranks). The merged
    files are cut at --max-shard-size, so there is an index whose total_size and weight_map are right."""
    src = request.getfixturevalue(fixture)
    run_cli("shard", src, tmp_path / "mp", "--mp", mp, "--quiet", *extra)
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--max-shard-size", "300KB", "--quiet")
    ours, ref = _flat(tmp_path / "hf"), _flat(src)
    assert sorted(ours) == sorted(ref)
    for name, r in ref.items():
        o = ours[name]
        assert o.dtype == r.dtype and o.shape == r.shape, name
        assert torch.equal(o.view(torch.uint8), r.view(torch.uint8)), name
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = load_dir(tmp_path / "hf")
    assert len(files) > 1
    assert index["weight_map"] == {k: f for f, tensors in files.items() for k in tensors}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_merged_fp8_dequantizes_like_the_original(tiny_v3_no_mtp, tmp_path):
    run_cli("shard", tiny_v3_no_mtp, tmp_path / "mp", "--mp", 2, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    run_cli("dequant", tmp_path / "hf", tmp_path / "a", "--quiet")
    run_cli("dequant", tiny_v3_no_mtp, tmp_path / "b", "--quiet")
    a, b = _flat(tmp_path / "a"), _flat(tmp_path / "b")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_merge_refuses_incomplete_or_foreign_shards(dense_sources, tmp_path):
    run_cli("shard", dense_sources["llama"], tmp_path / "mp", "--mp", 2, "--quiet")
    (tmp_path / "mp" / "model1-mp2.safetensors").unlink()
    proc = run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet", check=False)
    assert proc.returncode != 0 and "missing shard(s) model1-mp2.safetensors" in proc.stderr

    run_cli("shard", dense_sources["llama"], tmp_path / "mp2", "--mp", 2, "--quiet")
    config = json.loads((tmp_path / "mp2" / "config.json").read_text())
    config["num_key_value_heads"] = 4  # a config that is not the shards': merged shapes contradict it
    (tmp_path / "mp2" / "config.json").write_text(json.dumps(config))
    proc = run_cli("merge", tmp_path / "mp2", tmp_path / "hf2", "--quiet", check=False)
    assert proc.returncode != 0 and "config.json is" in proc.stderr and "the manifest beside it" in proc.stderr
    (tmp_path / "mp2" / MANIFEST).unlink()  # unchecked, the shapes still tell
    proc = run_cli("merge", tmp_path / "mp2", tmp_path / "hf2", "--quiet", check=False)
    assert proc.returncode != 0 and "contradicts config.json" in proc.stderr
    assert not (tmp_path / "hf2" / "model.safetensors").exists()


def test_gpt_oss_shard_then_merge_gives_the_same_tensors(tiny_gpt_oss, tmp_path):
    """MXFP4 kept by shard (stacked experts split by expert range) comes back tensor for tensor."""
    run_cli("shard", tiny_gpt_oss, tmp_path / "mp", "--mp", 2, "--quiet")
    run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet")
    ours, ref = _flat(tmp_path / "hf"), _flat(tiny_gpt_oss)
    assert sorted(ours) == sorted(ref)
    for name, r in ref.items():
        assert ours[name].dtype == r.dtype and torch.equal(ours[name].view(torch.uint8), r.view(torch.uint8)), name
