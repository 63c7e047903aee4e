"""--resume continues only the run it was bound to: the journal is tied to the plan and to each input
file's size, mtime, ctime and sampled content, so changed SRC bytes are refused instead of mixing old
and new tensors; and --resume where nothing was started simply starts (CI passes it on every run)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ckpttool.io.layout import PARTIAL_DIR
from ckpttool.io.safetensors import read_header
from conftest import run_cli, run_cli_process

CONVERT = ("--mp", "2", "--dtype", "bf16", "--quiet", "--workers", "2", "--processes", "1")  # faults count per process
SHARD = "model-00003-of-00003.safetensors"


def _tree(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture
def interrupted(src, tmp_path):
    dst = tmp_path / "out"
    proc = run_cli_process("convert", src, dst, *CONVERT, env={"CKPTTOOL_FAULT": "pwrite:3"})
    assert proc.returncode != 0 and (dst / PARTIAL_DIR).is_dir()
    return dst


def _refused_as_changed(src, dst) -> None:
    proc = run_cli("convert", src, dst, *CONVERT, "--resume", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "changed since the interrupted run" in proc.stderr and "--overwrite" in proc.stderr


def _rewrite_tensor_bytes(path) -> None:
    """Change one tensor's data in place (header untouched), then put the mtime back."""
    st = os.stat(path)
    info = max(read_header(path).tensors.values(), key=lambda t: t.nbytes)
    with open(path, "r+b") as f:
        f.seek(info.start + info.nbytes // 2 + 1)
        f.write(b"\x00" * 3)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_resume_refuses_changed_bytes_even_with_the_mtime_put_back(src, interrupted):
    _rewrite_tensor_bytes(src / SHARD)
    _refused_as_changed(src, interrupted)


def test_resume_refuses_a_touched_or_replaced_input(src, interrupted, tmp_path):
    os.utime(src / SHARD)  # same bytes, new mtime: a rewrite cannot be told from this cheaply
    _refused_as_changed(src, interrupted)
    other = tmp_path / "other"
    shutil.copytree(src, other)
    subprocess.run(["cp", "-p", str(other / SHARD), str(src / SHARD)], check=True)  # same bytes and mtime, new ctime
    _refused_as_changed(src, interrupted)
    run_cli("convert", src, interrupted, *CONVERT, "--overwrite")  # the fix the error names works


def test_resume_of_an_unchanged_src_through_a_renamed_directory_continues(src, interrupted, tmp_path):
    moved = tmp_path / "moved-src"
    os.rename(src, moved)  # a moved checkpoint is the same plan, and its files are the same files
    run_cli("convert", moved, interrupted, *CONVERT, "--resume")
    clean = tmp_path / "clean"
    run_cli("convert", moved, clean, *CONVERT)
    assert _tree(interrupted) == _tree(clean)


@pytest.mark.parametrize("state", ["absent", "empty", "empty-staging", "staging-without-plan-but-a-shard"])
def test_resume_where_nothing_was_started_simply_starts(src, tmp_path, state):
    dst = tmp_path / "out"
    if state != "absent":
        dst.mkdir()
    if state.startswith(("empty-staging", "staging")):
        (dst / PARTIAL_DIR).mkdir()
    if state == "staging-without-plan-but-a-shard":
        (dst / PARTIAL_DIR / "model0-mp2.safetensors").write_bytes(b"torn")
    run_cli("convert", src, dst, *CONVERT, "--resume")
    clean = tmp_path / "clean"
    run_cli("convert", src, clean, *CONVERT)
    assert _tree(dst) == _tree(clean) and not (dst / PARTIAL_DIR).exists()


def test_resume_into_a_directory_of_the_users_files_is_still_refused(src, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "notes.txt").write_text("mine")
    proc = run_cli("convert", src, dst, *CONVERT, "--resume", check=False)
    assert proc.returncode == 1 and "not empty" in proc.stderr
    assert sorted(os.listdir(dst)) == ["notes.txt"]


def test_a_side_file_gone_from_src_does_not_block_resume(src, tmp_path):
    dst = tmp_path / "out"
    proc = run_cli_process("convert", src, dst, *CONVERT, env={"CKPTTOOL_FAULT": "publish:2"})
    assert proc.returncode != 0
    (src / "generation_config.json").unlink()
    run_cli("convert", src, dst, *CONVERT, "--resume")
    clean = tmp_path / "clean"
    run_cli("convert", src, clean, *CONVERT)
    assert _tree(dst) == _tree(clean)
