"""`merge` holds the shards to the manifest beside them (issue 39): a rank file of another conversion of the
same architecture has the same names, shapes and size, and used to be merged without a word. Two tiny Llamas
that differ only in their weights (transformers-built, different seeds), each sharded by ckpttool."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckpttool.io.layout import MANIFEST, PARTIAL_DIR

try:
    from conftest import run_cli
    from dense_models import build_hf
except ImportError:
    from tests.conftest import run_cli
    from tests.dense_models import build_hf


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict[str, Path]:
    """{"a", "b"}: the same Llama config with other weights, each sharded --mp 2 (and "a4": a at --mp 4)."""
    root = tmp_path_factory.mktemp("two")
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        src = build_hf("llama", root / f"{name}-hf", seed=seed)
        run_cli("shard", src, root / name, "--mp", 2, "--quiet")
        out[name] = root / name
    run_cli("shard", root / "a-hf", root / "a4", "--mp", 4, "--quiet")
    out["a4"] = root / "a4"
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _refused(proc, *words: str) -> None:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "fix:" in proc.stderr, proc.stderr
    for w in words:
        assert w in proc.stderr, (w, proc.stderr)


def test_a_rank_file_of_another_conversion_is_refused(two, tmp_path):
    mixed = _copy(two["a"], tmp_path / "mixed")
    shutil.copyfile(two["b"] / "model1-mp2.safetensors", mixed / "model1-mp2.safetensors")
    assert (mixed / "model1-mp2.safetensors").stat().st_size == (two["a"] / "model1-mp2.safetensors").stat().st_size
    proc = run_cli("merge", mixed, tmp_path / "hf", "--quiet", check=False)
    _refused(proc, "model1-mp2.safetensors", "differs from", "manifest")
    assert not (tmp_path / "hf").exists(), "a refused merge left its output directory behind"


def test_a_changed_side_file_and_a_foreign_manifest_are_refused(two, tmp_path):
    """A copied side file edited since (refused before any shard is hashed), and shards beside a manifest
    that lists other ones (a's --mp 4 manifest beside its --mp 2 shards)."""
    edited = _copy(two["a"], tmp_path / "edited")
    side = next(p for p in edited.iterdir() if p.name.startswith("generation_config") or p.name.startswith("tokenizer"))
    side.write_bytes(side.read_bytes() + b" ")
    _refused(run_cli("merge", edited, tmp_path / "hf1", "--quiet", check=False), side.name)

    foreign = _copy(two["a"], tmp_path / "foreign")
    shutil.copyfile(two["a4"] / MANIFEST, foreign / MANIFEST)
    _refused(run_cli("merge", foreign, tmp_path / "hf2", "--quiet", check=False), "model0-mp2.safetensors",
             "not listed")


def test_a_rank_file_swapped_before_resume_is_refused(two, tmp_path):
    """Not in the issue: the check runs again when an interrupted merge is resumed."""
    shards = _copy(two["a"], tmp_path / "shards")
    dst = tmp_path / "hf"
    proc = subprocess.Popen([sys.executable, "-m", "ckpttool", "merge", str(shards), str(dst), "--quiet",
                             "--processes", "1", "--max-shard-size", "1MB"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "CKPTTOOL_FAULT": "pwrite:3:kill"})
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL and (dst / PARTIAL_DIR).is_dir()
    shutil.copyfile(two["b"] / "model0-mp2.safetensors", shards / "model0-mp2.safetensors")
    _refused(run_cli("merge", shards, dst, "--quiet", "--resume", "--max-shard-size", "1MB", check=False),
             "model0-mp2.safetensors", "differs from")
    # the right file put back: the manifest is satisfied, but a copy has a new ctime, so --resume says to start over
    shutil.copyfile(two["a"] / "model0-mp2.safetensors", shards / "model0-mp2.safetensors")
    _refused(run_cli("merge", shards, dst, "--quiet", "--resume", "--max-shard-size", "1MB", check=False),
             "model0-mp2.safetensors", "put back", "--overwrite")
    run_cli("merge", shards, dst, "--quiet", "--overwrite", "--max-shard-size", "1MB")
    run_cli("merge", two["a"], tmp_path / "clean", "--quiet", "--max-shard-size", "1MB")
    assert _bytes(dst) == _bytes(tmp_path / "clean")


def test_checked_and_unchecked_merges_say_which_and_agree(two, tmp_path):
    """The shards as written merge, and say they were checked; without a manifest (DeepSeek's convert.py
    writes none) they are read unchecked and the report says that instead."""
    checked = json.loads(run_cli("merge", two["a"], tmp_path / "checked", "--json").stdout)
    assert any("checked against" in n for n in checked["notes"]), checked["notes"]
    bare = _copy(two["a"], tmp_path / "bare")
    (bare / MANIFEST).unlink()
    unchecked = json.loads(run_cli("merge", bare, tmp_path / "unchecked", "--json").stdout)
    assert any("without checking" in n for n in unchecked["notes"]), unchecked["notes"]
    assert _bytes(tmp_path / "checked") == _bytes(tmp_path / "unchecked")


def _bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.safetensors"))}
