"""Input names never collide with what ckpttool writes: an index that names a shard like one of our
outputs (the manifest, config.json, a tokenizer file that is also copied, the staging dir's plan or
journal) or a shard in a subfolder is refused with an error naming the file, before DST is touched."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ckpttool.io.layout import INDEX_NAME, MANIFEST
from conftest import run_cli, run_cli_process

FIRST = "model-00001-of-00003.safetensors"


def _rename_shard(src, new: str) -> None:
    index = json.loads((src / INDEX_NAME).read_text())
    index["weight_map"] = {k: (new if v == FIRST else v) for k, v in index["weight_map"].items()}
    (src / INDEX_NAME).write_text(json.dumps(index))
    target = src / new
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        target.unlink()
    os.rename(src / FIRST, target)


@pytest.mark.parametrize("name", ["tokenizer.json", MANIFEST, "config.json", "plan.json", "journal.jsonl",
                                  "model.safetensors.index.json", "sub/model-1.safetensors", ".hidden.safetensors"])
def test_shard_names_that_collide_with_our_outputs_are_refused(tiny_v3, tmp_path, name):
    src = tmp_path / "src"
    shutil.copytree(tiny_v3, src)
    _rename_shard(src, name)
    dst = tmp_path / "out"
    for command in (("dequant", src, dst, "--quiet"), ("dequant", src, dst, "--dry-run")):
        proc = run_cli(*command, check=False)
        assert proc.returncode == 1, (command, proc.stdout, proc.stderr)
        assert "error:" in proc.stderr and "fix:" in proc.stderr and "Traceback" not in proc.stderr
    assert not dst.exists()
    if name == "tokenizer.json":  # a shard is never copied out as if it were a side file either
        proc = run_cli("convert", src, dst, "--mp", "2", "--quiet", check=False)
        assert proc.returncode == 1 and "fix:" in proc.stderr and not dst.exists()


def test_a_subfolder_shard_prints_an_error_not_a_traceback(tiny_v3, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_v3, src)
    _rename_shard(src, "nested/dir/model.safetensors")
    proc = run_cli_process("dequant", src, tmp_path / "out", "--quiet")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "subfolder" in proc.stderr


def test_files_named_like_ours_in_src_are_not_copied_over_our_outputs(tiny_v3, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_v3, src)
    (src / MANIFEST).write_text('{"files": {"../escape": {"size": 1, "sha256": "0"}}}')
    (src / ".ckpttool-partial").mkdir()
    (src / ".ckpttool-partial" / "plan.json").write_text("{}")
    dst = tmp_path / "out"
    run_cli("convert", src, dst, "--mp", "2", "--quiet")
    manifest = json.loads((dst / MANIFEST).read_text())
    assert "../escape" not in manifest["files"] and not (dst / ".ckpttool-partial").exists()
    assert run_cli("inspect", dst, "--check", check=False).returncode == 0


@pytest.mark.parametrize("name", ["a\x1b[2Jb.safetensors", "x\u202egpj.safetensors", "bell\x07.safetensors"])
def test_names_with_terminal_escapes_are_refused_and_printed_escaped(tiny_v3, tmp_path, name):
    src = tmp_path / "src"
    shutil.copytree(tiny_v3, src)
    _rename_shard(src, name)
    proc = run_cli("dequant", src, tmp_path / "out", "--quiet", check=False)
    assert proc.returncode == 1 and "fix:" in proc.stderr, proc.stderr
    assert not any(c in proc.stderr for c in "\x1b\u202e\x07")
    assert "\\x1b" in proc.stderr or "\\u202e" in proc.stderr or "\\x07" in proc.stderr
