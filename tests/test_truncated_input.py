"""An input in RAM truncated (or opened for writing) by another process while the run maps it (issue 39):
never SIGBUS (exit 135, no `error:` line, once in about 40 tries before), but an error naming the file, or,
where the run no longer needed it, a clean finish; and after the file is put back, --resume says how to go
on. The input sits on a real tmpfs (reads there are mappings, io/mapped.py); the run is held at a failpoint
while another process truncates the file, which waits for the run's read lease to be let go."""

from __future__ import annotations

import hashlib
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ckpttool.errors import InputError
from ckpttool.io.checkpoint import ShardFiles
from ckpttool.io.layout import MANIFEST

try:
    from conftest import finish, run_cli_process, start_cli, wait_until_stopped
    from tmpfs import small_tmpfs
except ImportError:
    from tests.conftest import finish, run_cli_process, start_cli, wait_until_stopped
    from tests.tmpfs import small_tmpfs

CONVERT = ("--mp", "2", "--device", "cpu", "--quiet", "--json")
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


def _tree(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and p.name != MANIFEST}


@pytest.fixture
def ram(tiny_v3, tmp_path):
    """tiny_v3 copied onto a tmpfs of its own (the input is then read through mappings)."""
    with small_tmpfs(tmp_path / "ram", "64m") as where:
        shutil.copytree(tiny_v3, where / "src")
        yield where / "src"


@pytest.fixture(scope="module")
def clean(tiny_v3, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("clean") / "out"
    assert _run(tiny_v3, out).returncode == 0
    return _tree(out)


def _run(src: Path, dst: Path, *extra: str, env: dict | None = None, wait: bool = True):
    args = ("convert", src, dst, *CONVERT, *extra)
    return run_cli_process(*args, env=env) if wait else start_cli(*args, env=env)


def _meanwhile(src: Path, dst: Path, at: int, change, processes: int = 1) -> subprocess.CompletedProcess:
    """Hold the run at its `at`-th write, start `change` in another process (it may wait for the run's lease),
    let the run go on; the change must have happened once the run ends."""
    proc = _run(src, dst, "--processes", str(processes), env={"CKPTTOOL_FAULT": f"pwrite:{at}:stop@0"}, wait=False)
    assert wait_until_stopped(proc), "the run never reached its stop point"
    changer = subprocess.Popen([sys.executable, "-c", change])
    time.sleep(0.3)  # the change has begun: it waits on the lease, or is done
    proc.send_signal(signal.SIGCONT)
    done = finish(proc)
    assert changer.wait(timeout=120) == 0, "the other process could not change the file"
    return done


def _named_or_clean(done: subprocess.CompletedProcess, name: str, dst: Path, clean: dict) -> str:
    assert done.returncode in (0, 1), (done.returncode, done.stderr)  # 135 / -7: SIGBUS
    assert "Traceback" not in done.stderr and "Bus error" not in done.stderr, done.stderr
    if done.returncode == 0:  # every read of that file came before the change
        assert _tree(dst) == clean
        return "finished"
    assert name in done.stderr and "fix:" in done.stderr, done.stderr
    assert "being written or truncated by another process" in done.stderr or "unexpected end of file" in done.stderr
    return "named"


def test_an_input_truncated_mid_run_is_named_never_sigbus(ram, clean, tmp_path):
    """Each shard truncated at several moments of the run, in one process and split over two."""
    seen = set()
    for i, (at, name) in enumerate([(a, n) for a in (2, 12, 24) for n in SHARDS]):
        path = ram / name
        size = path.stat().st_size
        saved = path.read_bytes()
        done = _meanwhile(ram, tmp_path / f"o{i}", at, f"import os; os.truncate({str(path)!r}, {size // 2})",
                          processes=1 + i % 2)
        seen.add(_named_or_clean(done, name, tmp_path / f"o{i}", clean))
        path.write_bytes(saved)
    assert "named" in seen, "no truncation met a read: the test proved nothing"


def test_an_input_opened_for_writing_mid_run_is_named(ram, clean, tmp_path):
    """Not in the issue: another process opens an input to write into it (here: one byte in its data)."""
    path = ram / SHARDS[0]
    change = f"f = open({str(path)!r}, 'r+b'); f.seek({path.stat().st_size - 1}); f.write(b'\\x7f'); f.close()"
    done = _meanwhile(ram, tmp_path / "out", 2, change)
    assert _named_or_clean(done, SHARDS[0], tmp_path / "out", clean) == "named"


def test_a_restored_input_is_refused_by_resume_with_the_way_on(ram, clean, tmp_path):
    """After the truncation the user puts the file back: --resume cannot prove it is the same, says so and
    says --overwrite; --overwrite then writes the clean bytes."""
    path, dst = ram / SHARDS[1], tmp_path / "out"
    saved = path.read_bytes()
    done = _meanwhile(ram, dst, 2, f"import os; os.truncate({str(path)!r}, 100)")
    assert done.returncode == 1, done.stderr
    path.write_bytes(saved)
    again = _run(ram, dst, "--resume")
    assert again.returncode == 1 and "put back" in again.stderr and "--overwrite" in again.stderr, again.stderr
    assert _run(ram, dst, "--overwrite").returncode == 0
    assert _tree(dst) == clean


def test_a_truncation_waits_for_the_views_in_flight(tmp_path):
    """Underneath: while a mapped view of a file is alive, another process's truncate waits; once the view is
    gone it proceeds, and the next read of the file names it instead of mapping it."""
    from safetensors.numpy import save_file

    save_file({"w": np.arange(64 * 4096, dtype=np.uint8).reshape(64, 4096)}, str(tmp_path / "a.safetensors"))
    files = ShardFiles(tmp_path, ["a.safetensors"])
    info = files.info("a.safetensors", "w")
    view = files.mapped_range("a.safetensors", info.start, info.nbytes)
    truncator = subprocess.Popen([sys.executable, "-c", f"import os; os.truncate({str(tmp_path / 'a.safetensors')!r}, 8)"])
    time.sleep(1.0)
    assert truncator.poll() is None, "the truncation did not wait for the lease: a mapped read could SIGBUS"
    assert int(view[-1]) == (64 * 4096 - 1) % 256  # the view still reads its bytes
    gone = threading.Event()
    threading.Thread(target=lambda: (truncator.wait(), gone.set()), daemon=True).start()
    del view
    # the lease goes with the last view (or at the latest with the next read), then the truncation proceeds
    with pytest.raises(InputError, match="being written or truncated"):
        for _ in range(200):
            files.mapped_range("a.safetensors", info.start, 4096)
            time.sleep(0.05)
    assert gone.wait(30) and (tmp_path / "a.safetensors").stat().st_size == 8
    files.close()


def test_a_file_that_cannot_be_leased_is_read_not_mapped(tmp_path):
    """A file open for writing elsewhere gets no read lease (EAGAIN): its bytes come from pread, so nothing of
    it is mapped that a truncation could turn into SIGBUS."""
    import mmap

    from safetensors.numpy import save_file

    save_file({"w": np.arange(16 * 4096, dtype=np.uint8).reshape(16, 4096)}, str(tmp_path / "a.safetensors"))
    writer = open(tmp_path / "a.safetensors", "r+b")  # held open for writing while the file is opened and read
    try:
        files = ShardFiles(tmp_path, ["a.safetensors"])
        info = files.info("a.safetensors", "w")
        got = files.mapped_range("a.safetensors", info.start, info.nbytes)
        base = got
        while getattr(base, "base", None) is not None:
            base = base.base
        assert not isinstance(base, (mmap.mmap, memoryview)), "a file without a lease was mapped"
        assert bytes(got) == bytes(np.arange(16 * 4096, dtype=np.uint8))
        files.close()
    finally:
        writer.close()
    files = ShardFiles(tmp_path, ["a.safetensors"])  # the same file, leasable now: mapped
    info = files.info("a.safetensors", "w")
    view = files.mapped_range("a.safetensors", info.start, info.nbytes)
    assert isinstance(view.base, memoryview) and bytes(view) == bytes(np.arange(16 * 4096, dtype=np.uint8))
    del view
    files.close()
