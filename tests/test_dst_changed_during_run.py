"""A file someone else creates in DST while a run converts is never replaced at publish (issue 39): the
check for the user's files ran only at the start. The run is held at a failpoint mid-write, a file is put
in DST under a name publish will use (an output shard, config.json, the manifest; a symlink; with
--overwrite, an earlier output swapped for another file), the run goes on: publish refuses, naming the
file, leaves it as it was, and once it is moved away --resume publishes the same bytes as a clean run."""

from __future__ import annotations

import hashlib
import signal
import subprocess
from pathlib import Path

import pytest

from ckpttool.io.layout import MANIFEST, PARTIAL_DIR

try:
    from conftest import finish, run_cli_process, start_cli, wait_until_stopped
except ImportError:
    from tests.conftest import finish, run_cli_process, start_cli, wait_until_stopped

CONVERT = ("--mp", "2", "--device", "cpu", "--quiet", "--processes", "1")
MINE = b"the user's own bytes\n"


def _tree(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and not p.is_symlink() and p.name != MANIFEST}


@pytest.fixture(scope="module")
def clean(tiny_v3, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("clean") / "out"
    assert _convert(tiny_v3, out).returncode == 0
    return _tree(out)


def _convert(src: Path, dst: Path, *extra: str, env: dict | None = None, wait: bool = True):
    args = ("convert", src, dst, *CONVERT, *extra)
    return run_cli_process(*args, env=env) if wait else start_cli(*args, env=env)


def _meanwhile(src: Path, dst: Path, plant, *extra: str) -> subprocess.CompletedProcess:
    """Run a conversion held at its 5th write, call plant() while it is held, let it finish."""
    proc = _convert(src, dst, *extra, env={"CKPTTOOL_FAULT": "pwrite:5:stop"}, wait=False)
    assert wait_until_stopped(proc), "the conversion never reached its stop point"
    plant()
    proc.send_signal(signal.SIGCONT)
    return finish(proc)


def _refused(done: subprocess.CompletedProcess, name: str) -> None:
    assert done.returncode == 1, done.stderr
    assert f"{name} appeared in the output directory during the run" in done.stderr, done.stderr
    assert "--resume" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("name", ["model1-mp2.safetensors", "config.json", MANIFEST])
def test_a_file_created_during_the_run_is_not_replaced(tiny_v3, clean, tmp_path, name):
    """Under an output shard's name, a side file's, the manifest's."""
    dst = tmp_path / "out"
    done = _meanwhile(tiny_v3, dst, lambda: (dst / name).write_bytes(MINE))
    _refused(done, name)
    assert (dst / name).read_bytes() == MINE, "the user's file was changed"
    assert not (dst / MANIFEST).exists() or name == MANIFEST, "an output with someone else's file was published"
    (dst / name).rename(tmp_path / "moved-away")
    again = _convert(tiny_v3, dst, "--resume")
    assert again.returncode == 0, again.stderr
    assert _tree(dst) == clean and (tmp_path / "moved-away").read_bytes() == MINE


def test_a_symlink_planted_during_the_run_is_not_replaced_nor_followed(tiny_v3, clean, tmp_path):
    dst, target = tmp_path / "out", tmp_path / "elsewhere"
    target.write_bytes(MINE)
    done = _meanwhile(tiny_v3, dst, lambda: (dst / "model0-mp2.safetensors").symlink_to(target))
    _refused(done, "model0-mp2.safetensors")
    assert (dst / "model0-mp2.safetensors").is_symlink() and target.read_bytes() == MINE


def test_overwrite_replaces_what_was_there_but_not_what_was_swapped_in(tiny_v3, clean, tmp_path):
    """--overwrite may replace the earlier output it found at the start; a file put in its place during the
    run (another inode) is someone else's. Not in the issue: its check covered only new names."""
    dst = tmp_path / "out"
    assert _convert(tiny_v3, dst, "--mp", "4").returncode == 0  # an earlier output (mp4: other shard names)
    (dst / "notes.txt").write_bytes(MINE)

    def swap() -> None:
        (dst / "config.json").unlink()
        (dst / "config.json").write_bytes(MINE)

    done = _meanwhile(tiny_v3, dst, swap, "--overwrite")
    _refused(done, "config.json")
    assert (dst / "config.json").read_bytes() == MINE
    (dst / "config.json").unlink()
    again = _convert(tiny_v3, dst, "--overwrite", "--resume")
    assert again.returncode == 0, again.stderr
    assert {n: h for n, h in _tree(dst).items() if n != "notes.txt"} == clean
    assert (dst / "notes.txt").read_bytes() == MINE and not (dst / PARTIAL_DIR).exists()


def test_the_rename_into_dst_never_replaces_what_appears_meanwhile(tmp_path):
    """What publish renames with where nothing was there: a name taken in between fails, both files intact."""
    from ckpttool.execute.osutil import rename_noreplace

    (tmp_path / "staged").write_bytes(b"ours")
    (tmp_path / "taken").write_bytes(MINE)
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "staged", tmp_path / "taken")
    assert (tmp_path / "taken").read_bytes() == MINE and (tmp_path / "staged").read_bytes() == b"ours"
    rename_noreplace(tmp_path / "staged", tmp_path / "free")
    assert (tmp_path / "free").read_bytes() == b"ours" and not (tmp_path / "staged").exists()
