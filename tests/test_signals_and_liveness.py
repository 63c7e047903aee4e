"""Signals and silent ranks (issue 39): Ctrl-C or SIGTERM at any moment, even while the CLI is still being
imported, ends in one line that says what happened and how to go on (never a traceback, never silence),
and a forked rank that stops answering (SIGSTOP) fails the run naming it instead of holding rank 0 forever.
The real executable in child processes; ranks held at failpoints (faults.py) where a moment matters."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpttool.io.layout import MANIFEST, PARTIAL_DIR

try:
    from conftest import wait_until_stopped
except ImportError:
    from tests.conftest import wait_until_stopped

CONVERT = ("--mp", "2", "--device", "cpu", "--quiet")
TERMINAL = {"preexec_fn": lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)}
"""a terminal's foreground job takes SIGINT; a test runner's background children would ignore it"""


def _tree(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and p.name != MANIFEST}


@pytest.fixture(scope="module")
def clean(tiny_v3, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("clean") / "out"
    done = subprocess.run([sys.executable, "-m", "ckpttool", "convert", str(tiny_v3), str(out), *CONVERT],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return _tree(out)


def _start(args, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(args, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, **kw)


def _resume(tiny_v3, dst: Path, *extra: str) -> None:
    done = subprocess.run([sys.executable, "-m", "ckpttool", "convert", str(tiny_v3), str(dst), *CONVERT, *extra,
                           "--resume"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def _ranks_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _stopped_rank(pid: int, timeout: float = 120) -> int:
    """The child of `pid` held at its failpoint (state T): a forked rank, not a helper process of the start
    (ctypes' find_library runs ldconfig)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in _ranks_of(pid):
            try:
                with open(f"/proc/{child}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "T":
                        return child
            except (OSError, IndexError):
                continue
        time.sleep(0.02)
    raise AssertionError("no rank reached its stop point")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- while starting -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["module", "executable"])
def test_a_signal_while_the_cli_is_imported_is_one_line_not_a_traceback(tiny_v3, tmp_path, how):
    """`python -m ckpttool` and the installed `ckpttool` script, each signalled at ten moments of its first
    0.45 s (importing typer, click, numpy, the commands): Ctrl-C and SIGTERM alike."""
    exe = [sys.executable, "-m", "ckpttool"] if how == "module" else [str(Path(sys.executable).parent / "ckpttool")]
    if how == "executable" and not Path(exe[0]).exists():
        pytest.skip(f"no installed ckpttool script beside {sys.executable} (pip install -e . makes it)")
    outcomes = set()
    for i in range(10):
        signum = (signal.SIGINT, signal.SIGTERM)[i % 2]
        proc = _start([*exe, "convert", str(tiny_v3), str(tmp_path / f"o{i}"), *CONVERT], **TERMINAL)
        time.sleep(0.05 * i)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (i, err)
        if proc.returncode == 0:  # the run was over (output published) before the signal came
            assert (tmp_path / f"o{i}" / MANIFEST).exists(), (i, err)
            outcomes.add("finished")
            continue
        assert proc.returncode in (128 + signum, -signum), (i, proc.returncode, err)  # -signum: before Python's own handler
        if proc.returncode > 0:
            assert ("interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)") in err, (i, err)
            assert "nothing was written" in err or "--resume" in err, (i, err)
        outcomes.add("starting" if "while starting" in err else "running" if "--resume" in err else "none")
    assert "starting" in outcomes, f"no signal arrived while the CLI was being imported: {outcomes}"


# -- SIGTERM ------------------------------------------------------------------------------------------------

def test_sigterm_says_the_work_is_journalled_and_resume_finishes(tiny_v3, clean, tmp_path):
    dst = tmp_path / "out"
    proc = _start([sys.executable, "-m", "ckpttool", "convert", str(tiny_v3), str(dst), *CONVERT, "--processes", "1"],
                  env={"CKPTTOOL_FAULT": "pwrite:20:stop"})
    assert wait_until_stopped(proc), "the conversion never reached its stop point"
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "journalled" in err and "--resume" in err and "Traceback" not in err
    assert (dst / PARTIAL_DIR).is_dir()
    _resume(tiny_v3, dst, "--processes", "1")
    assert _tree(dst) == clean


def test_sigterm_to_one_rank_names_it_and_stops_the_others(tiny_v3, clean, tmp_path):
    """A job manager ending one process of a forked run (not in the issue): rank 0 reports which, with the way
    back, and no rank outlives the run."""
    dst = tmp_path / "out"
    proc = _start([sys.executable, "-m", "ckpttool", "convert", str(tiny_v3), str(dst), *CONVERT, "--processes", "2"],
                  env={"CKPTTOOL_FAULT": "pwrite:3:stop@1"})
    ranks = [_stopped_rank(proc.pid)]
    os.kill(ranks[0], signal.SIGTERM)
    os.kill(ranks[0], signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "rank 1 was terminated (SIGTERM)" in err and "--resume" in err and "Traceback" not in err, err
    assert not _alive(ranks[0])
    _resume(tiny_v3, dst, "--processes", "2")
    assert _tree(dst) == clean


# -- a rank that stops answering ------------------------------------------------------------------------------

LIVENESS = {"CKPTTOOL_RANK_TIMEOUT_S": "3"}


@pytest.mark.parametrize("how", ["sigstop", "failpoint"])
def test_a_stopped_rank_fails_the_run_naming_it(tiny_v3, clean, tmp_path, how):
    """Rank 1 stopped from outside (SIGSTOP, as the issue did) or by itself mid-write: rank 0 gives up on it
    after CKPTTOOL_RANK_TIMEOUT_S (3 s here), ends it, names it, and --resume finishes byte for byte."""
    dst = tmp_path / "out"
    proc = _start([sys.executable, "-m", "ckpttool", "convert", str(tiny_v3), str(dst), *CONVERT, "--processes", "2"],
                  env={**LIVENESS, "CKPTTOOL_FAULT": "pwrite:3:stop@1"})
    ranks = [_stopped_rank(proc.pid)]  # rank 1, held at its third write: its share is not done
    if how == "sigstop":  # let it go on, and stop it from outside at once, mid-share
        os.kill(ranks[0], signal.SIGCONT)
        os.kill(ranks[0], signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("rank 0 waited for the stopped rank past 90 s")
    assert proc.returncode == 1, err
    assert "rank 1" in err and "stopped (SIGSTOP)" in err and "--resume" in err and "Traceback" not in err, err
    assert not _alive(ranks[0]), "the stopped rank outlived the run"
    _resume(tiny_v3, dst, "--processes", "2")
    assert _tree(dst) == clean


def test_a_whole_run_suspended_and_continued_is_not_a_silent_rank(tiny_v3, clean, tmp_path):
    """Ctrl-Z on the terminal stops every process of the run; `fg` continues them. Longer than the liveness
    limit in between, that is the user's pause, not a rank's silence: the run finishes."""
    dst = tmp_path / "out"
    proc = _start([sys.executable, "-m", "ckpttool", "convert", str(tiny_v3), str(dst), *CONVERT, "--processes", "2"],
                  env={**LIVENESS, "CKPTTOOL_FAULT": "pwrite:3:stop@1"}, start_new_session=True)
    _stopped_rank(proc.pid)  # rank 1 is mid-share, held; stop the whole run within moments, as Ctrl-Z would
    os.killpg(proc.pid, signal.SIGSTOP)
    assert wait_until_stopped(proc)
    time.sleep(7)  # twice the limit
    os.killpg(proc.pid, signal.SIGCONT)  # `fg`: rank 1 goes on from its stop point too
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert _tree(dst) == clean
