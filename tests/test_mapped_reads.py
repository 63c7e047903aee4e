"""An input in RAM (tmpfs) is read through read-only mappings of its files (io/checkpoint.py
`mapped_range`), not copied out of the page cache: the same bytes as pread, a clear error for a file
shorter than its header, and each chunk's mapping gone with its last view, so RSS does not grow with the model."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from ckpttool.errors import InputError
from ckpttool.execute import tasks
from ckpttool.execute.osutil import in_memory_fs
from ckpttool.io.checkpoint import ShardFiles
from conftest import run_cli, run_cli_process

SHM = Path("/dev/shm")


def _tree(path: Path) -> dict:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_an_input_in_ram_is_converted_through_mappings_to_the_bytes_of_pread(tiny_v3, tmp_path, monkeypatch):
    if not in_memory_fs(SHM):
        pytest.skip("/dev/shm is not a tmpfs here: no input in RAM to map")
    ram = Path(tempfile.mkdtemp(dir=SHM, prefix="ckpttool-test-"))
    args = ("--mp", "2", "--dtype", "bf16", "--device", "cpu", "--processes", "1", "--quiet", "--json")
    try:
        shutil.copytree(tiny_v3, ram / "src")
        mapped = run_cli_process("convert", ram / "src", tmp_path / "mapped", *args)
        assert mapped.returncode == 0, mapped.stderr
        monkeypatch.setattr(tasks, "in_memory_fs", lambda path: False)  # the same input, read by pread
        pread = run_cli("convert", ram / "src", tmp_path / "pread", *args)
        counts = {name: json.loads(proc.stdout)["timing"]["counts"] for name, proc in (("mapped", mapped),
                                                                                       ("pread", pread))}
        assert counts["mapped"].get("chunks_read_mapped", 0) > 0
        assert "chunks_read_mapped" not in counts["pread"]
        assert _tree(tmp_path / "mapped") == _tree(tmp_path / "pread")
    finally:
        shutil.rmtree(ram)


def _one_tensor_file(path: Path, rows: int, cols: int) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.arange(rows * cols, dtype=np.uint8).reshape(rows, cols)}, str(path))


def test_a_mapped_read_past_the_end_of_a_truncated_file_names_the_file(tmp_path):
    _one_tensor_file(tmp_path / "a.safetensors", 64, 4096)
    files = ShardFiles(tmp_path, ["a.safetensors"])
    info = files.info("a.safetensors", "w")
    with open(tmp_path / "a.safetensors", "r+b") as f:  # the file shrinks after its header was read
        f.truncate(info.start + 10 * 4096)
    assert files.read_rows("a.safetensors", info, 0, 10, mapped=True).shape == (10, 4096)
    with pytest.raises(InputError, match="unexpected end of file") as exc:
        files.read_rows("a.safetensors", info, 0, 11, mapped=True)
    assert "a.safetensors" in str(exc.value.file)
    files.close()


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from Linux's /proc")
def test_mapped_rows_leave_the_process_rss_with_their_last_view(tmp_path):
    rows, cols = 256, 1 << 18  # 64 MiB
    _one_tensor_file(tmp_path / "a.safetensors", rows, cols)
    files = ShardFiles(tmp_path, ["a.safetensors"])
    info = files.info("a.safetensors", "w")
    before = _rss_kib()
    x = files.read_rows("a.safetensors", info, 0, rows, mapped=True)
    held = _rss_kib()  # populated as mapped, before any element is read
    assert int(x[rows - 1, cols - 1]) == (rows * cols - 1) % 256
    half = x[rows // 2:]
    del x
    still = _rss_kib()  # a view of it is alive: the mapping stays
    assert int(half[0, 0]) == (rows // 2 * cols) % 256
    del half
    after = _rss_kib()
    files.close()
    assert held - before > 48 << 10, (before, held)
    assert still - after > 48 << 10, (still, after)
    assert after - before < 8 << 10, (before, after)  # nothing around the range stays mapped either
