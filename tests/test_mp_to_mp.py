"""mp N to mp M in one pass (`convert MP_DIR DST --mp M`): byte for byte what merge then shard writes, for every
way the key table cuts a tensor (dims 0 and 1, whole heads with KV heads replicated over ranks, routed experts on
their ranks, FP8 weights kept with their scales), into more ranks and into fewer; and what it refuses."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from ckpttool.io.layout import MANIFEST

pytest.importorskip("transformers")


def _files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file() and p.name != MANIFEST}


def _merge_then_shard(src, tmp_path, mp: int, *flags) -> dict[str, bytes]:
    run_cli("merge", src, tmp_path / "merged", "--quiet")
    run_cli("convert", tmp_path / "merged", tmp_path / "ref", "--mp", mp, *flags, "--quiet")
    return _files(tmp_path / "ref")


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> dict:
    from dense_models import build_hf

    root = tmp_path_factory.mktemp("mp2mp")
    return {family: build_hf(family, root / family, seed=5) for family in ("llama", "qwen2")}


@pytest.mark.parametrize("n,m", [(4, 2), (2, 4), (1, 4), (4, 1), (2, 2)])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_dense_mp_n_to_mp_m_is_merge_then_shard(dense, tmp_path, family, n, m):
    """llama: 2 KV heads (cut at mp 2, replicated at mp 4); qwen2: one KV head on every rank, q/k/v biases, tied
    embeddings; o_proj and down_proj cut along dim 1, whose re-cut assembles rows from several ranks' columns."""
    run_cli("convert", dense[family], tmp_path / "n", "--mp", n, "--quiet")
    run_cli("convert", tmp_path / "n", tmp_path / "m", "--mp", m, "--quiet")
    ours = _files(tmp_path / "m")
    assert ours == _merge_then_shard(tmp_path / "n", tmp_path, m)
    assert sorted(name for name in ours if name.endswith(".safetensors")) == [f"model{r}-mp{m}.safetensors"
                                                                              for r in range(m)]
    assert run_cli("inspect", tmp_path / "m", "--check").returncode == 0


@pytest.mark.parametrize("n,m", [(4, 2), (2, 4)])
def test_moe_experts_move_between_ranks(tiny_v2_lite, tmp_path, n, m):
    """DeepSeek-V2-Lite BF16: routed experts whole on the rank owning their range, which changes with mp."""
    run_cli("shard", tiny_v2_lite, tmp_path / "n", "--mp", n, "--quiet")
    run_cli("shard", tmp_path / "n", tmp_path / "m", "--mp", m, "--quiet")
    assert _files(tmp_path / "m") == _merge_then_shard(tmp_path / "n", tmp_path, m, "--dtype", "fp8")


def test_fp8_kept_with_its_scales(tiny_v3, tmp_path):
    """FP8 weights and their 128x128 block scales re-cut as they are (`--dtype fp8`); dequantizing a weight stored in
    pieces is refused before anything is written, naming it and the way on."""
    run_cli("shard", tiny_v3, tmp_path / "n", "--mp", 2, "--quiet")
    run_cli("shard", tmp_path / "n", tmp_path / "m", "--mp", 1, "--quiet")
    assert _files(tmp_path / "m") == _merge_then_shard(tmp_path / "n", tmp_path, 1, "--dtype", "fp8")
    proc = run_cli("convert", tmp_path / "n", tmp_path / "bf16", "--mp", 1, check=False)
    assert proc.returncode == 1 and "stored cut in 2 pieces" in proc.stderr and "--dtype fp8" in proc.stderr
    assert not (tmp_path / "bf16").exists()


def test_mp_to_hf_names_its_files_as_merge_and_keeps_the_tensors(dense, tmp_path):
    run_cli("convert", dense["llama"], tmp_path / "n", "--mp", 2, "--quiet")
    run_cli("convert", tmp_path / "n", tmp_path / "hf", "--quiet")
    run_cli("merge", tmp_path / "n", tmp_path / "merged", "--quiet")
    ours = _files(tmp_path / "hf")
    assert ours["model.safetensors"] == _files(tmp_path / "merged")["model.safetensors"]
    index = json.loads(ours["model.safetensors.index.json"])
    assert set(index["weight_map"].values()) == {"model.safetensors"}


def test_a_shard_of_another_conversion_is_refused(dense, tmp_path):
    """Read as merge reads them: each rank file is held to the manifest beside it."""
    run_cli("convert", dense["llama"], tmp_path / "a", "--mp", 2, "--quiet")
    run_cli("convert", dense["qwen2"], tmp_path / "b", "--mp", 2, "--quiet")
    (tmp_path / "a" / "model1-mp2.safetensors").write_bytes((tmp_path / "b" / "model1-mp2.safetensors").read_bytes())
    proc = run_cli("convert", tmp_path / "a", tmp_path / "out", "--mp", 1, check=False)
    assert proc.returncode == 1 and "model1-mp2.safetensors" in proc.stderr and "manifest" in proc.stderr
    assert not (tmp_path / "out" / "model0-mp1.safetensors").exists()


@pytest.mark.parametrize("point", ["pwrite:3", "commit:2", "publish:2"])
def test_killed_then_resumed_is_byte_identical(dense, tmp_path, point):
    """The same journal, staging and --resume as every conversion: a run killed mid-write (a gather's pieces, a
    commit, publishing) and resumed writes what an uninterrupted one does."""
    import signal

    from conftest import run_cli_process

    run_cli("convert", dense["llama"], tmp_path / "n", "--mp", 4, "--quiet")
    flags = ("--mp", "2", "--quiet", "--workers", "2", "--processes", "1")
    run_cli("convert", tmp_path / "n", tmp_path / "clean", *flags)
    proc = run_cli_process("convert", tmp_path / "n", tmp_path / "m", *flags,
                           env={"CKPTTOOL_FAULT": point, "CKPTTOOL_JOURNAL_BYTES": "20000"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    run_cli("convert", tmp_path / "n", tmp_path / "m", *flags, "--resume")
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == \
        {p.name: p.read_bytes() for p in (tmp_path / "clean").iterdir()}


@pytest.mark.parametrize("n,m", [(4, 2), (1, 2)])
def test_segmented_tensors_recut(tmp_path, n, m):
    """Qwen3-Next: fused per-group projections held as several mp tensors (`Segment`), each cut on whole key heads,
    and 2 KV heads replicated at mp 4: re-cut from their segments' ranks as merge then shard writes them."""
    from dense_models import build_hf
    from test_gated_deltanet import _BASE, TINY

    hf = build_hf("qwen3_next", tmp_path / "hf", spec={**_BASE, **TINY["qwen3_next"]})
    run_cli("shard", hf, tmp_path / "n", "--mp", n, "--quiet")
    run_cli("shard", tmp_path / "n", tmp_path / "m", "--mp", m, "--quiet")
    assert _files(tmp_path / "m") == _merge_then_shard(tmp_path / "n", tmp_path, m, "--dtype", "fp8")
