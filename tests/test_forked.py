"""A CPU run split over forked processes (execute/forked.py, defaults.layout): the same bytes as one
process, every rank's error reported with its file, tensor and fix, a rank that dies fails the run and
--resume finishes it, and no rank outlives its parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ckpttool import defaults
from ckpttool.io.layout import PARTIAL_DIR
from conftest import run_cli_process, wait_until_stopped

CONVERT = ("--mp", "4", "--dtype", "bf16", "--device", "cpu", "--quiet", "--json")


def _tree(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _report(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("cores, files, asked, expected", [
    (2, 8, (None, None), (1, 2)),  # small machines stay one process, workers() as before
    (4, 8, (None, None), (1, 4)),
    (8, 8, (None, None), (2, 4)),
    (16, 8, (None, None), (4, 4)),  # one per 4 cores, a worker per core in all
    (16, 2, (None, None), (2, 7)),  # at most one process per output file; one of its 8 cores for the hashes
    (32, 4, (None, None), (4, 7)),  # a node of 32 cores taking 4 of mp8's files
    (64, 8, (None, None), (8, 7)),
    (64, 160, (None, None), (8, 7)),  # at most MAX_PROCESSES
    (16, 2, (16, None), (2, 8)),  # --workers is taken as given
    (16, 8, (12, None), (4, 3)),  # --workers is the total
    (16, 8, (None, 1), (1, 12)),  # --processes 1: the one-process defaults
    (2, 8, (None, 2), (2, 1)),
    (16, 1, (None, 4), (1, 12)),  # one output file: one process whatever is asked
])
def test_layout(monkeypatch, cores, files, asked, expected):
    monkeypatch.setattr(defaults, "cores", lambda: cores)
    assert defaults.layout(files, *asked) == expected
    assert defaults.layout(files, *asked, can_split=False)[0] == 1
    # onto a disk one process unless asked (four took 1.14-1.24x the time of one there)
    assert defaults.layout(files, *asked, to_memory=False)[0] == (expected[0] if asked[1] else 1)


@pytest.mark.parametrize("cores, share, expected", [
    (32, 4, (1, 7)),  # 4 torchrun ranks of a 32-core node, one file each: one core of 8 left to the rank's hashes
    (16, 4, (1, 4)),  # 4 cores each: a worker per core, as a forked process of 4
    (64, 4, (1, 12)),  # 16 cores each: workers()'s 12 already leave 4
    (8, 1, (1, 8)),  # one rank on its node: unchanged
])
def test_layout_of_a_rank_sharing_its_node(monkeypatch, cores, share, expected):
    """A torchrun rank of one output file (mp8 over 8 ranks) on its share of a node's cores."""
    monkeypatch.setattr(defaults, "cores", lambda: cores)
    assert defaults.layout(1, share=share) == expected


def test_processes_write_the_bytes_of_one_process(tiny_v3, tmp_path):
    one = _report(run_cli_process("convert", tiny_v3, tmp_path / "one", *CONVERT, "--processes", "1", "--workers", "2"))
    split = _report(run_cli_process("convert", tiny_v3, tmp_path / "three", *CONVERT, "--processes", "3",
                                    "--workers", "3"))
    assert (one["processes"], split["processes"]) == (1, 3)
    assert _tree(tmp_path / "three") == _tree(tmp_path / "one")
    assert not (tmp_path / "three" / PARTIAL_DIR).exists()
    # the ranks' timings reach the report: every chunk dequantized, in any process, is counted (a tensor
    # split along columns is dequantized whole by every rank that writes a part of it)
    chunks = lambda rep: sum(v for k, v in rep["timing"]["counts"].items() if k.startswith("chunks_by_cpu_loops"))
    assert chunks(split) >= chunks(one) > 0
    assert split["timing"]["thread_s"]["write"] > 0


def test_merge_split_over_processes_writes_the_same_bytes(tiny_v3, tmp_path):
    shards = tmp_path / "mp4"
    run_cli_process("convert", tiny_v3, shards, *CONVERT, "--processes", "1")
    one = _report(run_cli_process("merge", shards, tmp_path / "one", "--max-shard-size", "1MB", "--quiet", "--json",
                                  "--processes", "1"))
    split = run_cli_process("merge", shards, tmp_path / "two", "--max-shard-size", "1MB", "--processes", "2")
    assert one["processes"] == 1 and len(one["files"]) > 2
    assert split.returncode == 0 and "GB/s, 2 processes)" in split.stdout, split.stdout + split.stderr
    assert _tree(tmp_path / "two") == _tree(tmp_path / "one")


def test_ctrl_c_stops_every_rank_and_says_how_to_resume(tiny_v3, tmp_path):
    """Rank 0 held mid-write, then interrupted: it stops its ranks, exits 130 and names --resume."""
    dst = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ckpttool", "convert", str(tiny_v3), str(dst), *CONVERT,
                             "--processes", "2", "--workers", "2"],
                            env={**os.environ, "CKPTTOOL_FAULT": "pwrite:2:stop@0"}, stderr=subprocess.PIPE, text=True,
                            stdout=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert wait_until_stopped(proc), "rank 0 never reached its stop point"
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "--resume" in err and "Traceback" not in err
    assert not _processes_naming(str(dst)), "a forked rank outlived the run"
    run_cli_process("convert", tiny_v3, dst, *CONVERT, "--processes", "2", "--workers", "2", "--resume")
    assert (dst / "model0-mp4.safetensors").exists() and not (dst / PARTIAL_DIR).exists()


def _corrupt_last_expert(src) -> str:
    """A NaN code in the last routed expert's weight: with --mp 2 it lands in model1-mp2, rank 1's file."""
    from ckpttool.io.checkpoint import Checkpoint

    ckpt = Checkpoint(src)
    experts = [n for n in ckpt.tensors if ".experts." in n and n.endswith("down_proj.weight")
               and ckpt.source(n).info.dtype == "F8_E4M3"]
    name = max(experts, key=lambda n: int(n.split(".experts.")[1].split(".")[0]))
    info = ckpt.source(name).info
    with open(src / ckpt.source(name).file, "r+b") as f:
        f.seek(info.start + info.shape[1] * 3 + 1)  # row 3
        f.write(b"\x7f")
    return name


def test_an_error_in_a_forked_rank_names_file_tensor_and_fix(src, tmp_path):
    name = _corrupt_last_expert(src)
    dst = tmp_path / "out"
    proc = run_cli_process("convert", src, dst, "--mp", "2", "--device", "cpu", "--quiet", "--processes", "2",
                           "--workers", "2")
    assert proc.returncode == 1, proc.stderr
    assert "NaN codes (first in row 3)" in proc.stderr and name in proc.stderr and "re-download" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in dst.iterdir()) == [PARTIAL_DIR]  # nothing under a final name


def _processes_naming(text: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


@pytest.mark.parametrize("killed, resume_with", [("0", "2"), ("1", "2"), ("1", "1")])
def test_a_rank_killed_fails_the_run_and_resume_finishes_it(tiny_v3, tmp_path, killed, resume_with):
    """Rank 0 killed, the whole run dies at once, its forked ranks with it; a forked rank killed, rank 0
    reports it and fails. Either way no rank lives on, and --resume, in one process or several, writes the
    bytes of an uninterrupted run."""
    clean = tmp_path / "clean"
    run_cli_process("convert", tiny_v3, clean, *CONVERT, "--processes", "1", "--workers", "2")
    dst = tmp_path / "out"
    proc = run_cli_process("convert", tiny_v3, dst, *CONVERT, "--processes", "2", "--workers", "2",
                           env={"CKPTTOOL_FAULT": f"pwrite:3@{killed}", "CKPTTOOL_JOURNAL_BYTES": "100000"})
    if killed == "0":
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    else:
        assert proc.returncode == 1, proc.stderr
        assert "rank 1 was killed by signal 9" in proc.stderr and "--resume" in proc.stderr
    assert sorted(p.name for p in dst.iterdir()) == [PARTIAL_DIR]
    deadline = time.monotonic() + 10
    while _processes_naming(str(dst)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_naming(str(dst)), "a forked rank outlived the run"
    rep = _report(run_cli_process("convert", tiny_v3, dst, *CONVERT, "--processes", resume_with, "--workers", "2",
                                  "--resume"))
    assert rep["processes"] == int(resume_with)
    assert _tree(dst) == _tree(clean)


RANKS_WAITED = """
        seen = []
        ranks = ForkedRanks(3, share, Path("/tmp/where"))
        ranks.forward(seen.append)
        try:
            out = {"reports": ranks.wait(), "progress": sorted(seen)}
        except Exception as exc:
            out = {"error": type(exc).__name__, "text": str(exc), "notes": getattr(exc, "__notes__", []),
                   "fields": [getattr(exc, k, None) for k in ("file", "tensor", "fix")]}
        print(json.dumps(out))
"""


def _forked(body: str, then: str = RANKS_WAITED) -> dict:
    """Run `body` (which sets `share`), then `then` (by default ForkedRanks(3, share) waited for) in a fresh
    interpreter (pytest's own may have threads, and ForkedRanks refuses to fork beside them); returns the
    JSON it printed."""
    code = textwrap.dedent("""
        import json, os, signal, sys, time
        from pathlib import Path
        from ckpttool.errors import CkptError, OutputError
        from ckpttool.execute.forked import ForkedRanks
    """) + textwrap.dedent(body) + textwrap.dedent(then)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_ranks_report_progress_and_timings():
    out = _forked("""
        def share(rank, progress):
            for n in range(rank):
                progress(10 * rank + n)
            return {"thread_s": {"write": float(rank)}, "pid_differs": os.getpid() != int(os.environ.get("P", 0))}
    """)
    assert out["reports"] == [{"thread_s": {"write": 1.0}, "pid_differs": True},
                              {"thread_s": {"write": 2.0}, "pid_differs": True}]
    assert out["progress"] == [10, 20, 21]


@pytest.mark.parametrize("how, error, words", [
    ("raise OutputError('no space left on device', file='/x/y', tensor='t', fix='free some')", "OutputError",
     ["no space left on device", "/x/y"]),
    ("raise ValueError('a bug')", "RuntimeError", ["rank 2 failed", "ValueError: a bug"]),
    ("os._exit(3)", "OutputError", ["rank 2 exited with status 3", "--resume"]),
    ("os.kill(os.getpid(), signal.SIGKILL)", "OutputError", ["rank 2 was killed by signal 9", "/tmp/where"]),
])
def test_a_failing_rank_is_reported(how, error, words):
    out = _forked(f"""
        def share(rank, progress):
            if rank == 2:
                {how}
            return {{}}
    """)
    assert out["error"] == error, out
    assert all(w in out["text"] for w in words), out
    if error == "RuntimeError":  # a bug's traceback travels beside the message, for CKPTTOOL_DEBUG=1, not in it
        assert "Traceback" not in out["text"] and "Traceback" in out["notes"][0] and "a bug" in out["notes"][0]
    if "free some" in how:
        assert out["fields"] == ["/x/y", "t", "free some"]


def test_no_fork_beside_other_threads(tiny_v3, tmp_path):
    """A library caller's thread (or torch's) keeps the run in one process: a lock it held at fork time
    would be held forever in the child."""
    from ckpttool.execute.forked import ForkedRanks
    from ckpttool.plan.build import Spec
    from ckpttool.execute.forked import layout

    spec = Spec(dequant=True, mp=4)
    with spec.open(tiny_v3) as inputs:
        plan = spec.plan(inputs)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        with pytest.raises(RuntimeError, match="threads running"):
            ForkedRanks(2, lambda rank, progress: {}, tmp_path)
        assert layout(plan, "cpu", None, 2, one_process=False, to_memory=True) == ("cpu", 1, defaults.workers())
    finally:
        stop.set()
        t.join()
    if threading.active_count() == 1:  # pytest's process may hold threads of its own
        assert layout(plan, "cpu", None, 2, one_process=False, to_memory=True)[1] == 2
    assert layout(plan, "cpu", None, 2, one_process=True, to_memory=True)[1] == 1  # from the hub, or under torchrun
    assert layout(plan, "cuda", None, 2, one_process=False, to_memory=True)[1] == 1


def test_a_failing_rank_stops_rank_0_at_once():
    """Rank 0 does not finish its own share before it reports a rank's failure: `abort` carries the error as
    the rank ends, and execute raises it at once."""
    out = _forked("""
        from ckpttool.errors import InputError

        def share(rank, progress):
            if rank == 1:
                raise InputError("FP8 weight holds NaN codes", file="/in/x.safetensors", tensor="w", fix="re-download")
            time.sleep(60)
            return {}
    """, then="""
        started = time.monotonic()
        waiting = ForkedRanks(3, share, Path("/tmp/where"))
        waiting.forward(None)
        try:
            waiting.abort.exception(timeout=30)  # what execute waits on beside its tasks
        finally:
            waiting.kill()
        print(json.dumps({"seconds": time.monotonic() - started, "error": type(waiting.abort.exception()).__name__,
                          "text": str(waiting.abort.exception())}))
    """)
    assert out["error"] == "InputError" and "NaN codes" in out["text"] and "x.safetensors" in out["text"], out
    assert out["seconds"] < 20, out


def test_plan_previews_the_processes(tiny_v3, tmp_path):
    rep = _report(run_cli_process("plan", tiny_v3, tmp_path / "out", "--mp", "4", "--processes", "2", "--workers", "6",
                                  "--json"))
    assert (rep["processes"], rep["workers"]) == (2, 6)
    text = run_cli_process("plan", tiny_v3, tmp_path / "out", "--mp", "4", "--processes", "2", "--workers", "6").stdout
    assert "6 workers in 2 processes" in text


def test_a_fork_refused_by_a_limit_is_an_error_with_a_fix():
    """The second fork fails as under a container's pids.max (EAGAIN): an error naming the fix, and the first
    child stopped and reaped."""
    out = _forked("""
        import errno

        def share(rank, progress):
            time.sleep(60)
            return {}

        real_fork, forks = os.fork, []

        def fork():
            if forks:
                raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
            forks.append(real_fork())
            return forks[-1]

        os.fork = fork
    """, then="""
        started = time.monotonic()
        try:
            ForkedRanks(3, share, Path("/tmp/where"))
            out = {"error": None}
        except OutputError as exc:
            out = {"error": str(exc)}
        try:
            os.waitpid(-1, os.WNOHANG)
            out["children_left"] = True
        except ChildProcessError:
            out["children_left"] = False
        out["seconds"] = time.monotonic() - started
        print(json.dumps(out))
    """)
    assert "could not start conversion process rank 2 of 3" in out["error"] and "--processes 1" in out["error"], out
    assert not out["children_left"] and out["seconds"] < 30, out
