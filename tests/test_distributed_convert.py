"""`torchrun -m ckpttool convert` splits the output files across ranks (gloo for barriers only):
the published result is byte-identical to a single-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import run_cli


def _tree(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.mark.parametrize("nproc, args", [(2, ("--mp", "4")), (3, ("--mp", "4")), (2, ())])
def test_torchrun_output_is_byte_identical(tiny_v3, tmp_path, nproc, args):
    run_cli("convert", tiny_v3, tmp_path / "single", *args, "--quiet")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "-m", "ckpttool", "convert", str(tiny_v3), str(tmp_path / "multi"), *args, "--quiet", "--workers", "1"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _tree(tmp_path / "multi") == _tree(tmp_path / "single")
    journals = sorted(p.name for p in (tmp_path / "multi").rglob("journal*"))
    assert journals == []  # staging removed after publish


@pytest.mark.parametrize("nproc, processes", [(2, 2), (3, 2)])
def test_torchrun_ranks_split_their_share_over_forked_processes(tiny_v3, tmp_path, nproc, processes):
    """Each rank forks as one machine does (issue 43): a rank of one Python process keeps few cores busy. Every
    process, of every rank, writes whole files with a journal of its own: the same bytes."""
    run_cli("convert", tiny_v3, tmp_path / "single", "--mp", "4", "--quiet")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "-m", "ckpttool", "convert", str(tiny_v3), str(tmp_path / "multi"), "--mp", "4", "--json", "--workers", "2",
         "--processes", str(processes)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # rank 0's
    assert report["processes"] == processes, report
    assert _tree(tmp_path / "multi") == _tree(tmp_path / "single")
    # rank 0's report holds every rank's timeline (issue 43: where a multi-node run's time goes, from one report)
    timeline = report["timing"]["ranks"]
    assert [r["rank"] for r in timeline] == list(range(nproc)), timeline
    for r in timeline:
        assert 0 <= r["process"] <= r["convert"] <= r["barrier"], r  # seconds after the earliest process start
        assert r["phases_s"]["execute"] > 0 and "hash_wait" in r["phases_s"], r
    assert min(r["process"] for r in timeline) == 0


def test_torchrun_setup_error_reaches_every_rank(tiny_v3, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("mine")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "ckpttool", "convert", str(tiny_v3), str(tmp_path / "busy"), "--mp", "2", "--quiet"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert proc.stderr.count("output directory is not empty") >= 2  # both ranks report rank 0's finding
    assert (tmp_path / "busy" / "x").read_text() == "mine"


def test_torchrun_resume_of_published_output_is_a_no_op_on_every_rank(tiny_v3, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "ckpttool", "convert", str(tiny_v3), str(tmp_path / "out"), "--mp", "2"]
    assert subprocess.run([*cmd, "--quiet"], capture_output=True, text=True, timeout=600).returncode == 0
    before = _tree(tmp_path / "out")
    proc = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "already complete" in proc.stdout  # rank 0's decision, shared with rank 1
    assert _tree(tmp_path / "out") == before
