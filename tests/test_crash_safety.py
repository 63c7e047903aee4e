"""Killed at any point (SIGKILL), a conversion resumes to byte-identical output; ENOSPC and unsafe
destinations fail cleanly, with nothing half-written under a final name."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from ckpttool.execute.staging import JOURNAL
from ckpttool.io.layout import MANIFEST, PARTIAL_DIR
from conftest import run_cli, run_cli_process

CONVERT = ("--mp", "2", "--dtype", "bf16", "--quiet", "--workers", "2", "--processes", "1")  # faults count per process
# 21 points: inside files (n-th tensor write), journal commits, between published files, among the
# copied tokenizer/config files, and just before the manifest.
KILL_POINTS = ([f"pwrite:{n}" for n in (1, 2, 7, 19, 40, 66, 90, 100, 121, 134)]
               + [f"commit:{n}" for n in (1, 3, 6, 10, 20)]
               + [f"publish:{n}" for n in (1, 2, 3, 4, 5)]
               + ["manifest:1"])
# With a tiny journal batch, commits happen every few tensors, so a kill mid-run leaves real
# journalled work for --resume to skip.
FAULT_ENV = {"CKPTTOOL_JOURNAL_BYTES": "200000"}


def _tree(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def clean_output(tiny_v3, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    run_cli("convert", tiny_v3, out, *CONVERT)
    return _tree(out)


def test_enough_distinct_kill_points():
    assert len(set(KILL_POINTS)) >= 20


@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_then_resume_is_byte_identical(tiny_v3, tmp_path, clean_output, point):
    dst = tmp_path / "out"
    proc = run_cli_process("convert", tiny_v3, dst, *CONVERT, env={**FAULT_ENV, "CKPTTOOL_FAULT": point})
    assert proc.returncode == -signal.SIGKILL, f"fault {point} never fired: {proc.returncode} {proc.stderr}"
    assert not (dst / MANIFEST).exists()
    if not point.startswith(("publish", "manifest")):
        # before publish nothing exists under a final name
        assert sorted(p.name for p in dst.iterdir()) == [PARTIAL_DIR]
    # a kill can tear the journal's last line; resume must shrug that off
    with open(dst / PARTIAL_DIR / JOURNAL, "ab") as j:
        j.write(b'{"f": "model0-mp2.safet')
    refused = run_cli("convert", tiny_v3, dst, *CONVERT, check=False)
    assert refused.returncode == 1 and "--resume" in refused.stderr
    run_cli("convert", tiny_v3, dst, *CONVERT, "--resume")
    assert _tree(dst) == clean_output
    assert not (dst / PARTIAL_DIR).exists()


def test_resume_skips_journalled_work(tiny_v3, tmp_path):
    dst = tmp_path / "out"
    # Killed as the fourth commit begins, so three are on disk whatever the threads' timing (a kill at
    # the n-th write left anywhere from 8 to 76 tensors journalled).
    proc = run_cli_process("convert", tiny_v3, dst, *CONVERT, env={**FAULT_ENV, "CKPTTOOL_FAULT": "commit:4"})
    assert proc.returncode == -signal.SIGKILL
    journalled = (dst / PARTIAL_DIR / JOURNAL).read_text().count("\n")
    assert journalled >= 3, journalled
    rep = json.loads(run_cli("convert", tiny_v3, dst, *CONVERT, "--resume", "--json").stdout)
    assert rep["resumed_tensors"] == journalled


def test_enospc_fails_cleanly_then_resumes(tiny_v3, tmp_path, clean_output):
    dst = tmp_path / "out"
    proc = run_cli_process("convert", tiny_v3, dst, *CONVERT, env={**FAULT_ENV, "CKPTTOOL_FAULT": "pwrite:30:enospc"})
    assert proc.returncode == 1
    assert "no space left on device" in proc.stderr and "--resume" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in dst.iterdir()) == [PARTIAL_DIR]
    run_cli("convert", tiny_v3, dst, *CONVERT, "--resume")
    assert _tree(dst) == clean_output


def test_resume_with_other_arguments_is_refused(tiny_v3, tmp_path):
    dst = tmp_path / "out"
    proc = run_cli_process("convert", tiny_v3, dst, *CONVERT, env={"CKPTTOOL_FAULT": "pwrite:5"})
    assert proc.returncode == -signal.SIGKILL
    other = run_cli("convert", tiny_v3, dst, "--mp", "4", "--quiet", "--resume", check=False)
    assert other.returncode == 1 and "planned for different inputs or options" in other.stderr


def test_resume_of_finished_output_is_a_no_op(tiny_v3, tmp_path):
    run_cli("convert", tiny_v3, tmp_path / "out", *CONVERT)
    before = _tree(tmp_path / "out")
    rep = json.loads(run_cli("convert", tiny_v3, tmp_path / "out", *CONVERT, "--resume", "--json").stdout)
    assert rep["already_complete"] and _tree(tmp_path / "out") == before


def test_never_writes_into_source_or_non_empty_destination(tiny_v3, tmp_path):
    before = _tree(tiny_v3)
    for dst in (tiny_v3, tiny_v3 / "sub", tiny_v3.parent):
        proc = run_cli("convert", tiny_v3, dst, "--mp", "2", check=False)
        assert proc.returncode == 1 and "overlaps input" in proc.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    proc = run_cli("convert", tiny_v3, tmp_path / "mine", "--mp", "2", check=False)
    assert proc.returncode == 1 and "not empty" in proc.stderr and "--overwrite" in proc.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"
    assert _tree(tiny_v3) == before


def test_overwrite_replaces_previous_output_and_its_stale_shards(tiny_v3, tmp_path):
    dst = tmp_path / "out"
    run_cli("convert", tiny_v3, dst, "--mp", "4", "--quiet")
    (dst / "notes.txt").write_text("mine")
    run_cli("convert", tiny_v3, dst, "--mp", "2", "--quiet", "--overwrite")
    names = sorted(p.name for p in dst.glob("*.safetensors"))
    assert names == ["model0-mp2.safetensors", "model1-mp2.safetensors"]  # no stale model3-mp4
    assert (dst / "notes.txt").read_text() == "mine"  # not ours: left alone
    assert run_cli("inspect", dst, "--check").returncode == 0


def test_errors_have_no_traceback_unless_debug(tiny_v3, tmp_path):
    proc = run_cli_process("convert", tiny_v3, tmp_path / "o", "--mp", "3")
    assert proc.returncode == 1 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr
    assert "not divisible by mp=3" in proc.stderr or "cannot be split evenly over mp=3" in proc.stderr
    debug = run_cli_process("convert", tiny_v3, tmp_path / "o", "--mp", "3", env={"CKPTTOOL_DEBUG": "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 2 MiB filesystem (tmpfs), where mounting is allowed (root); skipped elsewhere."""
    mount = tmp_path / "small-fs"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_too_little_free_space_is_refused_before_anything_is_created(tiny_v3, small_filesystem):
    dst = small_filesystem / "out"
    proc = run_cli("convert", tiny_v3, dst, "--mp", 2, "--dtype", "bf16", check=False)
    assert proc.returncode != 0
    assert "free for the output, only" in proc.stderr and "fix:" in proc.stderr and str(small_filesystem) in proc.stderr
    assert list(small_filesystem.iterdir()) == []  # not even DST


def test_a_tensor_is_journalled_only_once_every_run_of_its_rows_is_written(tiny_v3, tmp_path, monkeypatch):
    """Several workers stream one tensor's runs of rows at once (Task.row_runs). When one run fails
    (ENOSPC) after others of the same tensor were written, the journal may hold none of that tensor's
    pieces, or --resume would skip rows never written; the resumed output equals a clean run's."""
    from ckpttool import faults
    from ckpttool.errors import OutputError
    from ckpttool.execute import executor
    from ckpttool.plan.build import Spec
    from ckpttool.runner import ExecOptions, convert

    def run(dst, **kw):
        return convert(tiny_v3, dst, Spec(dequant=True, mp=2), ExecOptions(quiet=True, chunk_bytes=1024, workers=3, **kw))

    run(tmp_path / "clean")
    monkeypatch.setattr(executor, "COMMIT_EVERY_BYTES", 1)  # journal every finished tensor at once
    monkeypatch.setattr(faults, "_counts", {})
    monkeypatch.setattr(faults, "_target", ("pwrite", 1100, "enospc"))
    with pytest.raises(OutputError, match="no space left"):
        run(tmp_path / "out")
    monkeypatch.setattr(faults, "_target", None)
    journalled = (tmp_path / "out" / PARTIAL_DIR / JOURNAL).read_text().count("\n")
    assert journalled > 5
    assert run(tmp_path / "out", resume=True).resumed_from == journalled
    assert _tree(tmp_path / "out") == _tree(tmp_path / "clean")
