"""SRC is never written: overlap of SRC and DST is decided by device and inode, so a bind mount, a
symlinked path or an input file that is a symlink into DST is refused before anything is written."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest

from conftest import run_cli

CONVERT = ("--mp", "2", "--dtype", "bf16", "--quiet", "--workers", "2")


def _digest(root) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


@pytest.fixture
def bind(src, tmp_path):
    view = tmp_path / "view"
    view.mkdir()
    proc = subprocess.run(["mount", "--bind", str(src), str(view)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {proc.stderr.decode(errors='replace').strip()}")
    try:
        yield view
    finally:
        subprocess.run(["umount", str(view)], check=False)


def _refused(*args) -> str:
    proc = run_cli(*args, check=False)
    assert proc.returncode == 1, proc.stderr
    assert "error:" in proc.stderr and "fix:" in proc.stderr
    return proc.stderr


def test_dst_inside_a_bind_mount_of_src_is_refused(src, bind):
    before = _digest(src)
    assert "overlaps input" in _refused("convert", src, bind / "out", *CONVERT)
    assert "overlaps input" in _refused("convert", src, bind, *CONVERT, "--overwrite")
    assert "overlaps input" in _refused("dequant", bind, src, "--quiet", "--overwrite")
    assert _digest(src) == before and not (src / "out").exists()


def test_dst_reached_through_a_symlink_into_src_is_refused(src, tmp_path):
    (tmp_path / "link").symlink_to(src)
    before = _digest(src)
    assert "overlaps input" in _refused("convert", src, tmp_path / "link" / "out", *CONVERT)
    assert "overlaps input" in _refused("convert", tmp_path / "link", src, *CONVERT, "--overwrite")
    assert _digest(src) == before


def test_input_files_that_are_symlinks_into_dst_are_refused(src, tmp_path):
    dst = tmp_path / "dst"
    run_cli("dequant", src, dst, "--quiet")
    # SRC's shards and tokenizer now point at DST's files of the same names
    linked = tmp_path / "linked"
    linked.mkdir()
    for p in src.iterdir():
        target = dst / p.name if (dst / p.name).exists() and p.suffix in (".safetensors", ".json") else p
        (linked / p.name).symlink_to(target)
    before = _digest(dst)
    err = _refused("dequant", linked, dst, "--quiet", "--overwrite")
    assert "lives inside the output directory" in err
    assert _digest(dst) == before
    # only the tokenizer pointing into DST: still refused, the shards could be anywhere
    only_tok = tmp_path / "only-tok"
    shutil.copytree(src, only_tok)
    (only_tok / "tokenizer.json").unlink()
    (only_tok / "tokenizer.json").symlink_to(dst / "tokenizer.json")
    assert "lives inside the output directory" in _refused("dequant", only_tok, dst, "--quiet", "--overwrite")
    assert _digest(dst) == before


def test_merge_into_its_own_input_is_refused(src, tmp_path):
    shards = tmp_path / "shards"
    run_cli("convert", src, shards, *CONVERT)
    (tmp_path / "alias").symlink_to(shards)
    before = _digest(shards)
    assert "overlaps input" in _refused("merge", shards, tmp_path / "alias", "--quiet", "--overwrite")
    assert "overlaps input" in _refused("merge", tmp_path / "alias", shards / "sub", "--quiet")
    assert _digest(shards) == before


def test_a_refused_run_leaves_src_untouched_even_its_directory(src, tmp_path):
    before = (os.stat(src).st_mtime_ns, sorted(os.listdir(src)), _digest(src))
    for dst in (src, src / "sub", src / "sub" / "deeper", src.parent):
        _refused("convert", src, dst, *CONVERT)
    assert (os.stat(src).st_mtime_ns, sorted(os.listdir(src)), _digest(src)) == before
