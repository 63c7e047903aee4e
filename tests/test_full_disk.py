"""Every full disk is an error with a way back (issue 39). On a real small tmpfs that another process fills
mid-run (a file written up to the last page, while the run is held at a failpoint): the run stops with an
`error:` naming the file it could not write and a `fix:` saying to free space and --resume, in one process
and in a forked rank alike, with no traceback; freeing what is left to write (not what the whole output
needs) is then enough for --resume, which finishes byte for byte as a clean run."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpttool.families.deepseek.demo import build_checkpoint
from ckpttool.io.layout import JOURNAL, MANIFEST, PARTIAL_DIR
from ckpttool.publish.destination import SPACE_MARGIN

try:
    from conftest import finish, run_cli_process, start_cli, wait_until_stopped
    from hub_server import HubServer, load_repo
    from test_download import REPO_ROOT, hub_env
    from tmpfs import small_tmpfs
except ImportError:
    from tests.conftest import finish, run_cli_process, start_cli, wait_until_stopped
    from tests.hub_server import HubServer, load_repo
    from tests.test_download import REPO_ROOT, hub_env
    from tests.tmpfs import small_tmpfs

CONVERT = ("--mp", "2", "--device", "cpu", "--workers", "2", "--quiet")
PAGE = 4096
ONE_COMMIT = {"CKPTTOOL_JOURNAL_SECONDS": "3600"}
"""journal commits an hour apart: the first is the run's last, into an empty journal, which needs a new page"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """About 14 MB of FP8 input, 28 MB of BF16 output: small beside the 64 MiB the free-space check adds."""
    return build_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", overrides={"num_hidden_layers": 6,
                            "num_nextn_predict_layers": 0}, n_files=3)


@pytest.fixture(scope="module")
def clean(source, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("clean") / "out"
    assert _run(source, out).returncode == 0
    return _digests(out)


@pytest.fixture
def disk(tmp_path):
    with small_tmpfs(tmp_path / "disk", "128m") as where:
        yield where


def _run(source: Path, dst: Path, *extra: str, env: dict | None = None, processes: int = 1, wait: bool = True):
    args = ("convert", source, dst, *CONVERT, "--processes", processes, *extra)
    return run_cli_process(*args, env=env) if wait else start_cli(*args, env=env)


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and p.name != MANIFEST}


def fill(mount: Path) -> Path:
    """Take every free byte of `mount`: a filler file allocated up to the last page."""
    filler = mount / "filler"
    with open(filler, "ab", buffering=0) as f:
        free = shutil.disk_usage(mount).free
        if free > PAGE:
            os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size, free - PAGE)
        try:
            while True:
                f.write(b"\0" * PAGE)
        except OSError:
            pass
    assert shutil.disk_usage(mount).free < 2 * PAGE
    return filler


def leave_free(filler: Path, nbytes: int) -> None:
    """Shrink the filler so that `nbytes` (rounded up to a page) are free on its filesystem."""
    missing = nbytes - shutil.disk_usage(filler.parent).free
    if missing > 0:
        os.truncate(filler, max(0, filler.stat().st_size - (missing + PAGE - 1) // PAGE * PAGE))


def _held(proc: subprocess.Popen, pid: int, mount: Path) -> subprocess.CompletedProcess:
    """`pid` (the run or one of its ranks) is held at a failpoint: fill the disk, let it go on, collect."""
    assert wait_until_stopped(type("P", (), {"pid": pid})), "the run never reached its failpoint"
    filler = fill(mount)
    os.kill(pid, signal.SIGCONT)
    return finish(proc), filler


def _child_of(pid: int, timeout: float = 120) -> int:
    """The child of `pid` held at its failpoint (state T): the forked rank, not a helper process of the start
    (ctypes' find_library runs ldconfig)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if int(fields[1]) == pid and fields[0] == "T":
                        return int(entry)
                except (OSError, ValueError, IndexError):
                    continue
        time.sleep(0.05)
    raise AssertionError("no forked rank reached its stop point")


def _stopped_with_a_way_back(done: subprocess.CompletedProcess, *names: str) -> None:
    assert done.returncode == 1, done.stderr
    err = done.stderr
    assert "Traceback" not in err and "unexpected" not in err, err
    assert "no space left on device" in err.lower() and "--resume" in err and "free" in err, err
    assert any(n in err for n in names), (names, err)


def test_a_full_disk_while_journalling_names_the_journal_and_resume_finishes(source, clean, disk):
    dst = disk / "out"
    proc = _run(source, dst, env={"CKPTTOOL_FAULT": "commit:1:stop", **ONE_COMMIT}, wait=False)
    done, filler = _held(proc, proc.pid, disk)
    _stopped_with_a_way_back(done, JOURNAL)
    filler.unlink()
    again = _run(source, dst, "--resume")
    assert again.returncode == 0, again.stderr
    assert _digests(dst) == clean


def test_a_full_disk_in_a_forked_rank_is_the_same_error_not_a_traceback(source, clean, disk):
    """Both ranks are held at their first journal commit; only rank 1 meets the full disk, and rank 0 goes on
    once there is room again, so the error reported is rank 1's, through the pipe."""
    dst = disk / "out"
    proc = _run(source, dst, env={"CKPTTOOL_FAULT": "commit:1:stop", **ONE_COMMIT}, processes=2, wait=False)
    rank1 = _child_of(proc.pid)
    assert wait_until_stopped(proc), "rank 0 never reached its first commit"
    filler = fill(disk)
    os.kill(rank1, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while _state(rank1) not in ("Z", None) and time.monotonic() < deadline:  # it ends; rank 0 reaps it later
        time.sleep(0.05)
    filler.unlink()
    os.kill(proc.pid, signal.SIGCONT)
    _stopped_with_a_way_back(finish(proc), "journal.1.jsonl")
    again = _run(source, dst, "--resume", processes=2)
    assert again.returncode == 0, again.stderr
    assert _digests(dst) == clean


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_freeing_what_is_left_to_write_is_enough_to_resume(source, clean, disk):
    """The run is held once most tensors are written but none journalled (commits an hour apart), the disk
    fills, the run fails. Bytes already written sit in the sparse output files, so --resume needs room
    for the rest only: freeing that (plus the check's 64 MiB margin) must do."""
    dst = disk / "out"
    proc = _run(source, dst, env={"CKPTTOOL_FAULT": "pwrite:190:stop", **ONE_COMMIT}, wait=False)
    done, filler = _held(proc, proc.pid, disk)
    _stopped_with_a_way_back(done, "mp2.safetensors", JOURNAL)
    staged = dst / PARTIAL_DIR
    outputs = [staged / f"model{r}-mp2.safetensors" for r in range(2)]
    size = sum(p.stat().st_size for p in outputs)
    written = sum(p.stat().st_blocks * 512 for p in outputs)
    assert written > (4 << 20), "too little was written before the disk filled for this test to tell"
    leave_free(filler, size - written + SPACE_MARGIN + (256 << 10))
    assert shutil.disk_usage(disk).free < size + SPACE_MARGIN, "freed as much as a fresh run needs"
    again = _run(source, dst, "--resume")
    assert again.returncode == 0, again.stderr
    assert _digests(dst) == clean


def test_a_full_disk_while_publishing_resumes_to_the_same_output(source, clean, disk):
    """An attack the issue did not list: the disk fills after every tensor is written, while the manifest is
    being written. Nothing is under a final name half-written, and --resume finishes the publish."""
    dst = disk / "out"
    proc = _run(source, dst, env={"CKPTTOOL_FAULT": "manifest:1:stop"}, wait=False)
    done, filler = _held(proc, proc.pid, disk)
    _stopped_with_a_way_back(done, MANIFEST)
    assert not (dst / MANIFEST).exists() and not list(dst.glob(f".{MANIFEST}.*"))
    filler.unlink()
    again = _run(source, dst, "--resume")
    assert again.returncode == 0, again.stderr
    assert _digests(dst) == clean and (dst / MANIFEST).exists()


def test_a_full_disk_while_an_input_streams_in_resumes_from_the_hub(source, clean, disk, tmp_path):
    """Converting straight from the hub: the disk fills while the second input file arrives. The error names
    what could not be written (the fetched file, or the output if the conversion got there first) and
    --resume, which then fetches what is missing and finishes byte for byte."""
    with HubServer([load_repo("org/full", source)]) as hub:
        env = hub_env(hub.url, tmp_path / "home", CKPTTOOL_FAULT="fetch:2:stop", **ONE_COMMIT)
        cmd = [sys.executable, "-m", "ckpttool", "convert", "org/full", str(disk / "out"), *CONVERT, "--max-input-files",
               "1"]
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        done, filler = _held(proc, proc.pid, disk)
        _stopped_with_a_way_back(done, "fetch/model-", "mp2.safetensors", JOURNAL)
        filler.unlink()
        env.pop("CKPTTOOL_FAULT")
        again = subprocess.run(cmd + ["--resume"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert _digests(disk / "out") == clean
