"""A hostile hub cannot fill the disk or hold a run forever (issue 39): every transfer stops at the size the
hub's listing gives (hub/guard.py), whoever makes it (a streamed conversion, `download`, a plan's range
requests), and a transfer that makes no progress is given up, naming the file. The real CLI and the real
huggingface_hub client in child processes, against tests/hub_server.py answering as a hostile hub would;
the destination is a small real tmpfs, so a transfer that ran past its cap would end in ENOSPC, not pass."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpttool.families.deepseek.demo import build_checkpoint
from ckpttool.io.layout import MANIFEST, PARTIAL_DIR, STREAM_FETCH

try:
    from hub_server import HubServer, load_repo
    from test_download import REPO_ROOT, hub, hub_env  # noqa: F401 (hub: the per-test fixture over `server`)
    from tmpfs import small_tmpfs
except ImportError:
    from tests.hub_server import HubServer, load_repo
    from tests.test_download import REPO_ROOT, hub, hub_env  # noqa: F401
    from tests.tmpfs import small_tmpfs

N_FILES = 3
WEIGHTS = [f"model-0000{i}-of-0000{N_FILES}.safetensors" for i in range(1, N_FILES + 1)]
CONVERT = ("--mp", "2", "--device", "cpu", "--workers", "2", "--max-input-files", "1")
FAST_GIVE_UP = {"CKPTTOOL_HUB_STALL_S": "3", "HF_HUB_DOWNLOAD_TIMEOUT": "1"}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", overrides={"num_hidden_layers": N_FILES,
                            "num_nextn_predict_layers": 0}, n_files=N_FILES)


@pytest.fixture(scope="module")
def server(source):
    with HubServer([load_repo("org/hostile", source)]) as hub:
        yield hub


@pytest.fixture(scope="module")
def expected(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("expected") / "out"
    done = cli({**os.environ, "PYTHONPATH": str(REPO_ROOT)}, "convert", source, out, *CONVERT, "-q")
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def disk(tmp_path):
    """DST's filesystem: a 128 MiB tmpfs (the free-space check asks for the output, two inputs and 64 MiB)."""
    with small_tmpfs(tmp_path / "disk", "128m") as where:
        yield where


def cli(env: dict, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpttool", *map(str, args)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def allocated(d: Path) -> int:
    return sum(os.lstat(os.path.join(top, n)).st_blocks * 512 for top, _, files in os.walk(d) for n in files)


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())
            if p.is_file() and p.name != MANIFEST}


def refused(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "fix:" in done.stderr and "No space left" not in done.stderr, done.stderr
    for w in words:
        assert w in done.stderr, (w, done.stderr)


# -- caps ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["endless", "overlong"])
def test_a_streamed_file_stops_at_its_listed_size(hub, source, disk, tmp_path, how):
    """No Content-Length and a body without end; or a Content-Length 50 MB past the file (more than the disk)."""
    size = (source / WEIGHTS[1]).stat().st_size
    hub.hostile(WEIGHTS[1], how, 50 << 20)
    dst = disk / "out"
    done = cli(hub_env(hub.url, tmp_path / "home"), "convert", "org/hostile", dst, *CONVERT)
    refused(done, WEIGHTS[1], "listed" if how == "endless" else "announced a body of")
    part = dst / PARTIAL_DIR / STREAM_FETCH / WEIGHTS[1]
    written = part.stat().st_size if part.exists() else 0
    assert written <= size and (how == "endless" or written == 0), (written, size)
    assert allocated(dst) < 32 << 20, "DST holds more than the output and one input file"


def test_download_stops_every_file_at_its_listed_size(hub, source, disk, tmp_path):
    """huggingface_hub's own transfers (`ckpttool download`: snapshot_download) are held to the listing too."""
    env = hub_env(hub.url, tmp_path / "home")
    for how, name in (("endless", WEIGHTS[0]), ("overlong", "config.json")):
        hub.reset()
        hub.hostile(name, how, 50 << 20)
        dst = disk / f"dl-{how}"
        done = cli(env, "download", "org/hostile", dst, "-q")
        refused(done, name)
        assert allocated(dst) <= sum((source / n).stat().st_size for n in os.listdir(source)) + (1 << 20)
        for path in dst.rglob("*"):
            if path.is_file() and path.name.startswith(name.split(".")[0]):
                assert path.stat().st_size <= (source / name).stat().st_size, path


def test_plan_requests_are_held_to_the_listing_too(hub, source, tmp_path):
    """The plan's own requests: a config.json without end, a header range answered from elsewhere in the file,
    a gzip bomb (asked for identity, sent 1000:1 compressed zeros)."""
    env = hub_env(hub.url, tmp_path / "home")
    hub.hostile("config.json", "endless")
    refused(cli(env, "plan", "org/hostile", "--mp", 2), "config.json", "listed")
    hub.reset()
    for name in WEIGHTS:  # the plan times one range request past the header of the largest file
        hub.hostile(name, "wrong-range")
    refused(cli(env, "plan", "org/hostile", "--mp", 2), "from byte", "Content-Range")
    hub.reset()
    hub.hostile(WEIGHTS[2], "gzip", 200 << 20)
    refused(cli(env, "download", "org/hostile", tmp_path / "dl", "-q"), WEIGHTS[2], "gzip-encoded")
    assert allocated(tmp_path / "dl") <= sum((source / n).stat().st_size for n in os.listdir(source)) + (1 << 20)


# -- no progress --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["trickle", "stall"])
def test_a_transfer_without_progress_is_given_up_and_resume_finishes(hub, source, expected, disk, tmp_path, how):
    """A trickle (one byte every 2 s trips no read timeout) and a stall repeated on every retry: each ends in
    an error naming the file (here after CKPTTOOL_HUB_STALL_S=3), and --resume then finishes byte for byte."""
    env = {**hub_env(hub.url, tmp_path / "home"), **FAST_GIVE_UP}
    hub.hostile(WEIGHTS[2], how, 1 << 20)
    dst = disk / "out"
    try:
        done = cli(env, "convert", "org/hostile", dst, *CONVERT, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a {how} held the run past 90 s")
    refused(done, WEIGHTS[2], "made no progress", "--resume")
    assert (dst / PARTIAL_DIR / "journal.jsonl").read_text(), "nothing was journalled before the stalled file"
    hub.reset()
    again = cli(env, "convert", "org/hostile", dst, *CONVERT, "--resume", "--json")
    assert again.returncode == 0, again.stderr
    assert digests(dst) == digests(expected)


def test_the_stall_limit_spans_the_clients_own_retries(hub, source, tmp_path):
    """huggingface_hub retries a read timeout five times (about 67 s on a full stall): the file's clock runs
    across them, so `download` gives up once the limit has passed, however the time is split."""
    env = {**hub_env(hub.url, tmp_path / "home"), **FAST_GIVE_UP}
    hub.hostile(WEIGHTS[0], "stall", 1 << 16)
    done = cli(env, "download", "org/hostile", tmp_path / "dl", "-q", timeout=90)
    refused(done, WEIGHTS[0], "made no progress")
    gets = [r for r in hub.gets(WEIGHTS[0]) if r.range is None or r.range.endswith("-")]
    assert 2 <= len(gets) < 6, [(r.range, r.sent) for r in gets]  # retried, but not all five times
