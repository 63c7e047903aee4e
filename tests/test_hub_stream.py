"""Straight from the hub (issue 19): plan a repo id from range-requested headers, convert it while it
downloads with at most K input files on disk, resume after a kill, re-fetch what is corrupt, read
what the HF cache already holds in place. The real CLI and the real huggingface_hub client, in child
processes, against the project's hub server on 127.0.0.1 (tests/hub_server.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from ckpttool.execute.osutil import in_memory_fs
from ckpttool.families.deepseek.demo import build_checkpoint
from ckpttool.io.layout import PARTIAL_DIR, STREAM_FETCH, STREAM_INPUT

try:  # `hub`: test_download's per-test fixture (reset, no unknown endpoints), over this module's `server`
    from hub_server import HubServer, load_repo
    from test_download import REPO_ROOT, hub, hub_env  # noqa: F401
except ImportError:
    from tests.hub_server import HubServer, load_repo
    from tests.test_download import REPO_ROOT, hub, hub_env  # noqa: F401

N_FILES = 5
WEIGHTS = [f"model-0000{i}-of-0000{N_FILES}.safetensors" for i in range(1, N_FILES + 1)]
CONVERT = ("--mp", "2", "--device", "cpu", "--workers", "2")


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """Five weight files of about 2.3 MB (one layer each), so a bound of one or two files shows."""
    return build_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", overrides={"num_hidden_layers": 5,
                            "num_nextn_predict_layers": 0}, n_files=N_FILES)


@pytest.fixture(scope="module")
def scattered(tmp_path_factory) -> Path:
    """Every scale in the last file: that file is needed from the first task on."""
    return build_checkpoint(tmp_path_factory.mktemp("src") / "scattered", seed=3, overrides={
        "num_hidden_layers": 4, "num_nextn_predict_layers": 0}, n_files=4, scales_in_last_file=True)


@pytest.fixture(scope="module")
def server(source, scattered):
    repos = [load_repo(r, source) for r in ("org/five", "org/cached", "org/corrupt")]
    with HubServer(repos + [load_repo("org/scattered", scattered)]) as hub:
        yield hub


@pytest.fixture(scope="module")
def expected(source, tmp_path_factory) -> Path:
    """The same conversion from the local directory: what every streamed run must equal, byte for byte."""
    out = tmp_path_factory.mktemp("expected") / "out"
    done = subprocess.run([sys.executable, "-m", "ckpttool", "convert", str(source), str(out), *CONVERT, "-q"],
                          cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr
    return out


def cli(env: dict, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpttool", *map(str, args)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def allocated(d: Path) -> int:
    total = 0
    for top, _, files in os.walk(d):
        for n in files:
            try:
                total += os.lstat(os.path.join(top, n)).st_blocks * 512
            except FileNotFoundError:
                pass  # deleted between the listing and the stat
    return total


def weight_gets(hub, name: str, *, ranged: bool | None = False) -> list:
    """GETs of `name`; ranged False: whole-file fetches only (no Range), True: range requests only."""
    return [r for r in hub.gets(name) if ranged is None or (r.range is not None) == ranged]


def fetches(hub, name: str) -> list:
    """Transfers of `name` itself: whole, or continued from an offset (`bytes=N-`), not the plan's header ranges."""
    return [r for r in hub.gets(name) if r.range is None or r.range.endswith("-")]


# -- plan ---------------------------------------------------------------------------------------------------

def test_plan_from_a_repo_id_reads_headers_only_and_hashes_like_the_downloaded_copy(hub, source, tmp_path):
    home = tmp_path / "home"
    env = hub_env(hub.url, home)
    remote = cli(env, "plan", "org/five", "--mp", 2, "--json")
    assert remote.returncode == 0, remote.stderr
    rep = json.loads(remote.stdout)
    assert not (home / "hf").exists(), "planning wrote into the HF cache"
    sizes = {n: (source / n).stat().st_size for n in WEIGHTS}
    for name in WEIGHTS:
        assert weight_gets(hub, name) == [], f"plan fetched {name} whole"
    probe = max(sizes, key=sizes.get)
    sent_beyond_headers = sum(r.sent for n in WEIGHTS if n != probe for r in weight_gets(hub, n, ranged=True))
    assert sent_beyond_headers <= 100_000 * (N_FILES - 1), "more than the headers of non-probe files was sent"
    h = rep["hub"]
    assert h["bytes_to_fetch"] == sum(sizes.values()) and h["input_files"] == N_FILES
    assert h["disk_needed_streaming"] == rep["disk_needed"] + 2 * max(sizes.values())
    assert h["disk_needed_download_first"] >= rep["disk_needed"] + sum(sizes.values())
    assert h["download_rate"] and h["expected_download_seconds"] is not None

    downloaded = cli(env, "download", "org/five", tmp_path / "dl", "-q")
    assert downloaded.returncode == 0, downloaded.stderr
    local = json.loads(cli(env, "plan", tmp_path / "dl", "--mp", 2, "--json").stdout)
    assert local["plan_hash"] == rep["plan_hash"] and local["files"] == rep["files"]
    assert local["copies"] == rep["copies"] and local["disk_needed"] == rep["disk_needed"]
    human = cli(env, "plan", "org/five", "--mp", 2)
    assert "disk needed streaming (output + at most 2 input files)" in human.stdout, human.stdout


# -- convert while downloading ------------------------------------------------------------------------------

def test_convert_streams_in_plan_order_with_at_most_k_input_files_on_disk(hub, source, expected, tmp_path):
    home, dst = tmp_path / "home", tmp_path / "out"
    peak, stop = [0], threading.Event()

    def watch() -> None:  # our own measurement, beside the tool's report
        while not stop.is_set():
            if dst.exists():
                peak[0] = max(peak[0], allocated(dst))
            stop.wait(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        done = cli(hub_env(hub.url, home), "convert", "org/five", dst, *CONVERT, "--max-input-files", 1, "--json")
    finally:
        stop.set()
        watcher.join()
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert digests(dst) == {**digests(expected)} | {"ckpttool-manifest.json": digests(dst)["ckpttool-manifest.json"]}
    assert digests(dst).keys() == digests(expected).keys()

    whole = [r.path.rsplit("/", 1)[1] for r in hub.requests("GET", "/resolve/") if r.range is None
             and r.path.endswith(".safetensors")]
    assert whole == WEIGHTS, "each input fetched once, in the order the plan reads them"
    d = report["download"]
    output = sum((dst / f).stat().st_size for f in report["files"])
    largest = max((source / n).stat().st_size for n in WEIGHTS)
    everything = output + sum((source / n).stat().st_size for n in WEIGHTS)
    bound = output + 1 * largest + (2 << 20)  # plan.json, journal, side files, block rounding
    assert d["max_input_files"] == 1 and d["files_fetched"] == N_FILES and d["bytes_fetched"] >= everything - output
    assert output < d["peak_disk_bytes"] <= bound < everything, (d, output, largest)
    assert 0 < peak[0] <= bound, "the disk held more than the output and one input file"
    assert d["download_gb_per_s"] and report["gb_per_s"]  # both rates, separately
    assert not (dst / PARTIAL_DIR).exists() and not (home / "hf").exists(), "something was left or written outside DST"


def test_a_file_is_freed_once_its_tensors_are_journalled_not_at_the_next_timed_commit(hub, expected, tmp_path):
    """With room for one file the fetcher waits for every file before the next: it asks for the commit that
    frees it. Timed commits an hour apart would hold each transfer an hour if it did not."""
    env = {**hub_env(hub.url, tmp_path / "home"), "CKPTTOOL_JOURNAL_SECONDS": "3600"}
    dst = tmp_path / "out"
    try:
        done = cli(env, "convert", "org/five", dst, *CONVERT, "--max-input-files", 1, "--json", timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a transfer waited for a timed journal commit to free room for it")
    assert done.returncode == 0, done.stderr
    assert digests(dst) == digests(expected) | {"ckpttool-manifest.json": digests(dst)["ckpttool-manifest.json"]}
    d = json.loads(done.stdout)["download"]
    times = [d["timeline"][n] for n in WEIGHTS]
    assert all(t.keys() >= {"fetch", "ready", "read", "freed"} for t in times), times
    assert all(after["room"] <= before["freed"] <= after["fetch"] for before, after in zip(times, times[1:])), times


def test_a_stream_into_tmpfs_reads_in_fetch_order(hub, expected):
    """On tmpfs the executor writes in output order (execute.tasks.run_order), but a streamed input
    arrives in read order: the stream's tasks must run in read order there too, or the fetcher waits for
    room the executor frees only after a file still to come (this hung on the device's /dev/shm)."""
    if not (os.path.isdir("/dev/shm") and in_memory_fs("/dev/shm")):
        pytest.skip("no tmpfs at /dev/shm on this machine")
    scratch = Path(tempfile.mkdtemp(prefix="ckpttool-test-", dir="/dev/shm"))
    try:
        dst = scratch / "out"
        try:
            done = cli(hub_env(hub.url, scratch / "home"), "convert", "org/five", dst, *CONVERT,
                       "--max-input-files", 1, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("a stream into tmpfs waited for room that was never freed")
        assert done.returncode == 0, done.stderr
        assert digests(dst) == digests(expected) | {"ckpttool-manifest.json": digests(dst)["ckpttool-manifest.json"]}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def test_the_bound_is_raised_to_what_the_plan_needs_at_once(hub, scattered, tmp_path):
    done = cli(hub_env(hub.url, tmp_path / "home"), "convert", "org/scattered", tmp_path / "out", *CONVERT,
               "--max-input-files", 1, "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)["download"]
    assert d["input_files_needed_at_once"] == 2 and d["max_input_files"] == 2  # the scales' file stays, one more


def test_progress_shows_download_and_conversion_rates_separately(hub, tmp_path):
    done = cli(hub_env(hub.url, tmp_path / "home"), "convert", "org/five", tmp_path / "out", *CONVERT)
    assert done.returncode == 0, done.stderr
    assert "downloading: " in done.stderr and "converting: " in done.stderr, done.stderr
    assert "streamed from org/five: fetched 5 files" in done.stdout and "peak disk" in done.stdout, done.stdout


# -- kills, resume and bad bytes ----------------------------------------------------------------------------

def _killed(env: dict, dst: Path, *, fault: str | None = None, hub=None, stall: str | None = None) -> None:
    """Run convert until a failpoint kills it, or until the hub holds `stall` mid-transfer and we kill it."""
    env = {**env, **({"CKPTTOOL_FAULT": fault} if fault else {})}
    proc = subprocess.Popen([sys.executable, "-m", "ckpttool", "convert", "org/five", str(dst), *CONVERT,
                             "--max-input-files", "1", "-q"], env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    if stall is not None:
        assert hub.stalled.wait(60), "the transfer never reached the stall"
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.returncode


def _resume(env: dict, dst: Path, hub, expected: Path) -> dict:
    hub.reset()
    done = cli(env, "convert", "org/five", dst, *CONVERT, "--max-input-files", 1, "--resume", "--json")
    assert done.returncode == 0, done.stderr
    assert set(digests(dst)) == set(digests(expected))
    assert all(digests(dst)[n] == h for n, h in digests(expected).items()), "resumed output differs"
    return json.loads(done.stdout)


@pytest.mark.parametrize("when", ["download", "convert", "publish"])
def test_kill_at_any_point_then_resume_is_byte_identical_and_refetches_only_what_is_needed(
        hub, source, expected, tmp_path, when):
    env, dst = hub_env(hub.url, tmp_path / "home"), tmp_path / "out"
    if when == "download":
        hub.stall(WEIGHTS[2], 1 << 20)  # files 1 and 2 are converted and deleted before file 3 may come
        _killed(env, dst, hub=hub, stall=WEIGHTS[2])
    else:
        _killed(env, dst, fault="commit:3" if when == "convert" else "publish:1")
    staged = dst / PARTIAL_DIR
    kept = {p.relative_to(staged / STREAM_INPUT).as_posix() for p in (staged / STREAM_INPUT).rglob("*")} \
        if (staged / STREAM_INPUT).exists() else set()
    journal = (staged / "journal.jsonl").read_text().splitlines()
    assert journal, "the kill came before anything was durable; the test would prove nothing"
    report = _resume(env, dst, hub, expected)
    fetched_again = [n for n in WEIGHTS if fetches(hub, n)]
    if when == "download":
        assert WEIGHTS[0] not in fetched_again and WEIGHTS[1] not in fetched_again, fetched_again
        assert WEIGHTS[2] in fetched_again
    if when == "publish":
        assert fetched_again == [], "a kill during publish needs no input again"
    assert not (set(fetched_again) & kept), "a verified file kept in DST was fetched again"
    assert report["download"]["files_fetched"] + report["download"]["files_reused"] <= N_FILES


def test_a_corrupt_transfer_is_refetched_and_never_converted(hub, source, expected, tmp_path):
    env = hub_env(hub.url, tmp_path / "home")
    size = (source / WEIGHTS[1]).stat().st_size
    # size and header still right, only sha256 sees it; the first of the two GETs is the plan's header range
    hub.corrupt(WEIGHTS[1], offset=size - 3, times=2)
    hub.cut(WEIGHTS[3], 1 << 20)  # a dropped connection: the client continues with a range request
    done = cli(env, "convert", "org/corrupt", tmp_path / "ok", *CONVERT, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["download"]["refetched"] == [WEIGHTS[1]]
    assert len(fetches(hub, WEIGHTS[1])) == 2
    assert all(digests(tmp_path / "ok")[n] == h for n, h in digests(expected).items())

    hub.reset()
    hub.corrupt(WEIGHTS[0], offset=(source / WEIGHTS[0]).stat().st_size - 3)  # every time
    bad = cli(env, "convert", "org/corrupt", tmp_path / "bad", *CONVERT, "--max-input-files", 1)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert WEIGHTS[0] in bad.stderr and "sha256" in bad.stderr and "fix:" in bad.stderr, bad.stderr
    staged = tmp_path / "bad" / PARTIAL_DIR
    assert (staged / "journal.jsonl").read_text() == "", "a tensor was converted from the corrupt file"
    assert not (staged / STREAM_INPUT / WEIGHTS[0]).exists() and not (staged / STREAM_FETCH / WEIGHTS[0]).exists()
    assert not list((tmp_path / "bad").glob("*.safetensors")) and len(fetches(hub, WEIGHTS[0])) == 2


# -- the HF cache -------------------------------------------------------------------------------------------

def test_a_cached_repo_is_read_in_place_online_and_offline(hub, expected, tmp_path):
    home = tmp_path / "home"
    env = hub_env(hub.url, home)
    assert cli(env, "download", "org/cached", "-q").returncode == 0
    blobs = home / "hf" / "hub" / "models--org--cached" / "blobs"
    before = {b.name: (b.stat().st_mtime_ns, b.stat().st_size) for b in blobs.iterdir()}
    hub.reset()
    done = cli(env, "convert", "org/cached", tmp_path / "online", *CONVERT, "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)["download"]
    assert sorted(d["files_in_place"]) == WEIGHTS and d["files_fetched"] == 0 and d["bytes_fetched"] == 0
    assert [r for r in hub.requests("GET", "/resolve/") if r.path.endswith(".safetensors") and r.range is None] == []
    output = sum(p.stat().st_size for p in (tmp_path / "online").glob("*.safetensors"))
    assert d["peak_disk_bytes"] < output + (1 << 20), "an input was copied into DST"

    hub.reset()
    offline = cli(hub_env(hub.url, home, HF_HUB_OFFLINE="1"), "convert", "org/cached", tmp_path / "offline",
                  *CONVERT, "-q")
    assert offline.returncode == 0, offline.stderr
    assert hub.log == [], "offline mode made a request"
    for out in ("online", "offline"):
        assert all(digests(tmp_path / out)[n] == h for n, h in digests(expected).items())
        assert not any(p.name.startswith("model-0") for p in (tmp_path / out).rglob("*"))
    assert {b.name: (b.stat().st_mtime_ns, b.stat().st_size) for b in blobs.iterdir()} == before, "cache changed"


def test_bundled_hub_recipe_streams(hub, tmp_path):
    done = cli(hub_env(hub.url, tmp_path / "home"), "run", "deepseek-v3-hub-mp8-bf16", "-i", "org/five", "-o",
               tmp_path / "out", "--set", "shard.mp=2", "--json")
    assert done.returncode == 0, done.stderr
    d = json.loads(done.stdout)["download"]
    assert d["files_fetched"] == N_FILES and d["max_input_files"] == 2
    assert not (tmp_path / "home" / "hf").exists()
