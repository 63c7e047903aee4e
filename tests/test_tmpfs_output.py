"""Output on tmpfs: each fresh output file's pages are allocated on a thread while the run starts
(execute/staging.py, osutil.allocate). The bytes, the resume after a kill and the space taken are the
same as anywhere else. Skipped where /dev/shm is not tmpfs."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from ckpttool.execute.osutil import allocate, in_memory_fs
from conftest import run_cli, run_cli_process

CONVERT = ("--mp", "2", "--dtype", "bf16", "--quiet", "--workers", "2")


@pytest.fixture
def shm_dir():
    base = Path("/dev/shm")
    if not (base.is_dir() and os.access(base, os.W_OK) and in_memory_fs(base)):
        pytest.skip("no writable tmpfs at /dev/shm")
    path = Path(tempfile.mkdtemp(dir=base, prefix="ckpttool-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tree(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_allocate_takes_the_pages_and_keeps_the_bytes(shm_dir):
    path = shm_dir / "f"
    with open(path, "wb") as f:
        f.write(b"head")
        f.truncate(64 << 20)
    fd = os.open(path, os.O_RDWR)
    try:
        assert os.fstat(fd).st_blocks * 512 < 1 << 20  # sparse before
        assert allocate(fd, 64 << 20)
        assert os.fstat(fd).st_blocks * 512 >= 64 << 20
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert data[:4] == b"head" and len(data) == 64 << 20 and not any(data[4:])


def test_tmpfs_output_is_the_disk_outputs_bytes(tiny_v3, tmp_path, shm_dir):
    run_cli("convert", tiny_v3, tmp_path / "disk", *CONVERT)
    run_cli("convert", tiny_v3, shm_dir / "out", *CONVERT)
    assert _tree(shm_dir / "out") == _tree(tmp_path / "disk")
    assert run_cli("inspect", shm_dir / "out", "--check").returncode == 0


def test_killed_on_tmpfs_then_resumed_is_byte_identical(tiny_v3, tmp_path, shm_dir):
    run_cli("convert", tiny_v3, tmp_path / "disk", *CONVERT)
    dst = shm_dir / "out"
    proc = run_cli_process("convert", tiny_v3, dst, *CONVERT, env={"CKPTTOOL_FAULT": "pwrite:40"})
    assert proc.returncode == -signal.SIGKILL
    run_cli("convert", tiny_v3, dst, *CONVERT, "--resume")
    assert _tree(dst) == _tree(tmp_path / "disk")


def test_each_fresh_file_is_allocated_once_and_only_on_tmpfs(tiny_v3, tmp_path, shm_dir, monkeypatch):
    from ckpttool.execute import staging

    sizes = []
    real = staging.allocate
    monkeypatch.setattr(staging, "allocate", lambda fd, size: sizes.append(size) or real(fd, size))
    run_cli("convert", tiny_v3, tmp_path / "disk", *CONVERT)
    if not in_memory_fs(tmp_path):
        assert sizes == []  # on a disk nothing is allocated ahead
    sizes.clear()
    run_cli("convert", tiny_v3, shm_dir / "out", *CONVERT)
    files = sorted((shm_dir / "out").glob("*.safetensors"))
    assert sorted(sizes) == sorted(f.stat().st_size for f in files)
