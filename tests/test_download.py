"""The download stage against a real HTTP hub on 127.0.0.1, driven by the real huggingface_hub client.

huggingface_hub reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE once, at import, so every download runs in
a child process whose environment is set before that import: a long-lived worker that runs
download_checkpoint per request (fast), or the real CLI. The child's HTTP(S) proxy points at a dead
loopback port with NO_PROXY=127.0.0.1, so any request for a non-loopback host fails instead of leaving
the machine; Xet is disabled and the server never advertises it.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from ckpttool.families.deepseek.demo import build_checkpoint
from ckpttool.errors import InputError
from ckpttool.io.checkpoint import Checkpoint

try:
    from hub_server import HubServer, load_repo  # pytest's default rootdir-less import puts tests/ on sys.path
except ImportError:
    from tests.hub_server import HubServer, load_repo

REPO_ROOT = Path(__file__).resolve().parents[1]
DEAD_PROXY = "http://127.0.0.1:9"  # nothing listens on the discard port: a non-loopback request fails at once
TOKEN = "hf_test_token_123"
SHARD1, SHARD2, SHARD3 = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
BIG = "model.safetensors"
REPLY_TIMEOUT_S = 60

WORKER = r"""
import json, sys, traceback
from ckpttool.errors import CkptError
from ckpttool.hub import download_checkpoint
for line in sys.stdin:
    try:
        reply = {"ok": download_checkpoint(**json.loads(line)).to_json()}
    except CkptError as exc:
        reply = {"error": str(exc), "type": type(exc).__name__, "exit_code": exc.exit_code}
    except BaseException as exc:
        reply = {"error": traceback.format_exc(), "type": "crash"}
    print(json.dumps(reply), flush=True)
"""

# The real entry point once every command module has landed; until then the same contract around the
# download command alone (a hidden second command keeps typer from collapsing a one-command app).
CLI = r"""
import sys
try:
    from ckpttool.cli import main
except ModuleNotFoundError as exc:
    if not (exc.name or "").startswith("ckpttool.cli."):
        raise
    import ckpttool.cli.download
    from ckpttool.cli.app import app
    from ckpttool.errors import CkptError
    app.command("_only-download-landed", hidden=True)(lambda: None)
    def main():
        try:
            app()
        except CkptError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(exc.exit_code)
sys.argv[0] = "ckpttool"
main()
"""


# -- fixtures ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    tiny = build_checkpoint(tmp_path_factory.mktemp("tiny"))
    (tiny / "original").mkdir()
    (tiny / "original" / "README.txt").write_text("files of the original release, not needed here\n")
    big = tmp_path_factory.mktemp("big")
    # Over the client's 10 MiB read chunk, so a cut after the first chunk is resumed with a Range request.
    save_file({"w": torch.arange(12_000_000, dtype=torch.int32).to(torch.bfloat16)}, str(big / BIG))
    return {"org/tiny": tiny, "org/tiny-private": tiny, "org/tiny-offline": tiny, "org/big": big}


@pytest.fixture(scope="module")
def server(sources):
    repos = [load_repo("org/tiny", sources["org/tiny"]), load_repo("org/big", sources["org/big"]),
             load_repo("org/tiny-private", sources["org/tiny-private"], token=TOKEN),
             load_repo("org/tiny-offline", sources["org/tiny-offline"])]
    with HubServer(repos) as hub:
        yield hub


@pytest.fixture
def hub(server):
    server.reset()
    yield server
    assert server.unknown == [], "the client called an endpoint the test hub does not serve"
    server.reset()


def hub_env(url: str, home: Path, **extra: str) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "LANG": "C.UTF-8", "PYTHONPATH": str(REPO_ROOT),
           "HF_HOME": str(home / "hf"), "HF_HUB_CACHE": str(home / "hf" / "hub"), "HF_ENDPOINT": url,
           "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "HF_HUB_ETAG_TIMEOUT": "10", "HF_HUB_DOWNLOAD_TIMEOUT": "10",
           "HTTP_PROXY": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY, "ALL_PROXY": DEAD_PROXY,
           "NO_PROXY": "127.0.0.1,localhost"}
    env.update(extra)
    return env


class Worker:
    """A child process with a hub environment that runs download_checkpoint(**kwargs) per request."""

    def __init__(self, env: dict[str, str], log: Path):
        self._stderr = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER], env=env, cwd=REPO_ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.log = log

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._replies.put(json.loads(line))
        self._replies.put({"type": "crash", "error": "worker exited"})

    def __call__(self, repo_id: str, dst: Path | None = None, **kwargs) -> dict:
        kwargs.setdefault("quiet", True)
        self.proc.stdin.write(json.dumps({"repo_id": repo_id, "dst": str(dst) if dst else None, **kwargs}) + "\n")
        self.proc.stdin.flush()
        try:
            reply = self._replies.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            pytest.fail(f"no reply in {REPLY_TIMEOUT_S}s; worker stderr:\n{self.log.read_text()[-3000:]}")
        assert reply.get("type") != "crash", reply["error"]
        return reply

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """HOME and HF cache shared by the module's child processes. Only org/tiny-private and org/tiny-offline are
    downloaded into this cache: the hub client fills a DST from the cache without a request, which would hide
    the faults the other tests inject."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def worker(server, home):
    w = Worker(hub_env(server.url, home), home / "worker.log")
    yield w
    w.close()


def run_cli(env: dict[str, str], *args: str, timeout: float = REPLY_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout)


def same_bytes(a: Path, b: Path) -> bool:
    return hashlib.sha256(a.read_bytes()).digest() == hashlib.sha256(b.read_bytes()).digest()


def checkpoint_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and ".cache" not in p.parts}


# -- clean download ---------------------------------------------------------------------------------------

def test_cli_download_fetches_verifies_and_hands_over_a_loadable_checkpoint(hub, home, sources, tmp_path):
    dst = tmp_path / "dsv3"
    done = run_cli(hub_env(hub.url, home), "download", "org/tiny", str(dst), "--exclude", "original/*",
                   "--verify-sha256", "--max-workers", "4", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)

    src = sources["org/tiny"]
    expected = checkpoint_files(src) - {"original/README.txt"}
    assert checkpoint_files(dst) == expected
    assert all(same_bytes(dst / name, src / name) for name in expected)
    assert {f["name"] for f in report["files"]} == expected
    assert all(f["hash_checked"] == ("sha256" if f["name"].endswith(".safetensors") else "git-sha1")
               for f in report["files"])
    assert sum(f["header_checked"] for f in report["files"]) == 3
    assert report["hashed_bytes"] == report["total_bytes"] > 0 and report["hash_gbps"] > 0
    assert Path(report["path"]) == dst.resolve() and report["refetched"] == []
    Checkpoint(dst)  # the whole directory, index included, passes the strict reader

    # Every call went to HF_ENDPOINT: the model info with siblings, the tree, resolve per file.
    assert hub.requests("GET", "/api/models/org/tiny")
    assert not hub.requests(contains="original/")
    assert {r.path.rsplit("/", 1)[1] for r in hub.requests("GET", "/resolve/")} == expected


def test_rerun_into_the_same_directory_fetches_nothing_again(hub, worker, tmp_path):
    first = worker("org/tiny", tmp_path / "d", ignore_patterns=["original/*"])
    assert "ok" in first, first
    hub.reset()
    again = worker("org/tiny", tmp_path / "d", ignore_patterns=["original/*"])
    assert "ok" in again, again
    assert hub.requests("GET", "/resolve/") == [], "a verified file was downloaded a second time"
    assert again["ok"]["commit"] == first["ok"]["commit"]


def test_patterns_fetch_exactly_the_files_the_recipe_needs(hub, worker, tmp_path):
    reply = worker("org/tiny", tmp_path / "d", allow_patterns=["*.json", "model-*.safetensors"],
                   ignore_patterns=[SHARD3, "original/*"])
    assert "ok" in reply, reply
    got = {f["name"] for f in reply["ok"]["files"]}
    assert SHARD3 not in got and SHARD1 in got and "tokenizer.json" in got and "config.json" in got
    assert not (tmp_path / "d" / SHARD3).exists()
    assert hub.gets(SHARD3) == [] and not hub.requests(contains="/original/")


def test_run_with_a_repo_id_downloads_what_the_recipe_asks_then_converts(hub, tmp_path):
    out = tmp_path / "mp2"
    done = run_cli(hub_env(hub.url, tmp_path / "home"), "run", str(REPO_ROOT / "recipes" / "deepseek-v3-hub-mp8-bf16.yaml"),
                   "--input", "org/tiny", "--output", str(out), "--set", "shard.mp=2", "--quiet", timeout=300)
    assert done.returncode == 0, done.stderr
    assert (out / "model0-mp2.safetensors").is_file() and (out / "model1-mp2.safetensors").is_file()
    fetched = {r.path.rsplit("/", 1)[1] for r in hub.requests("GET", "/resolve/")}
    assert SHARD1 in fetched and "config.json" in fetched
    assert not hub.requests(contains="/original/")  # the recipe's ignore_patterns reached the hub client


# -- interrupted transfers --------------------------------------------------------------------------------

def test_cut_transfer_is_resumed_with_a_range_request(hub, worker, sources, tmp_path):
    size = (sources["org/big"] / BIG).stat().st_size
    hub.cut(BIG, 12_000_000)
    reply = worker("org/big", tmp_path / "d", verify_sha256=True)
    assert "ok" in reply, reply
    gets = hub.gets(BIG)
    assert len(gets) == 2 and gets[0].range is None and gets[0].sent == 12_000_000
    resumed_at = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= 12_000_000 and gets[1].status == 206
    assert gets[1].sent == size - resumed_at
    assert same_bytes(tmp_path / "d" / BIG, sources["org/big"] / BIG)
    assert reply["ok"]["files"][0]["hash_checked"] == "sha256"


def test_cut_transfer_restarts_cleanly_when_the_server_ignores_range(hub, worker, sources, tmp_path):
    hub.cut(BIG, 12_000_000)
    hub.ignore_range()
    reply = worker("org/big", tmp_path / "d", verify_sha256=True)
    assert "ok" in reply, reply
    gets = hub.gets(BIG)
    assert len(gets) == 2 and gets[1].range is not None and gets[1].status == 200  # asked to resume, got it all
    assert same_bytes(tmp_path / "d" / BIG, sources["org/big"] / BIG)


def test_killed_download_leaves_no_partial_file_and_the_rerun_completes(hub, worker, home, sources, tmp_path):
    dst = tmp_path / "d"
    hub.stall(SHARD2, 1_000_000)
    proc = subprocess.Popen([sys.executable, "-c", CLI, "download", "org/tiny", str(dst), "--quiet",
                             "--max-workers", "1"], env=hub_env(hub.url, home), cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert hub.stalled.wait(REPLY_TIMEOUT_S), "the download never reached the stalled shard"
        proc.send_signal(signal.SIGKILL)  # a preempted node: no cleanup runs
    finally:
        proc.kill()
        proc.wait(timeout=10)
    hub.release()
    assert not (dst / SHARD2).exists(), "a partial file sits under its final name"
    finished = checkpoint_files(dst)
    assert finished and finished < checkpoint_files(sources["org/tiny"])

    hub.reset()
    reply = worker("org/tiny", dst, verify_sha256=True)
    assert "ok" in reply, reply
    assert checkpoint_files(dst) == checkpoint_files(sources["org/tiny"])
    assert all(same_bytes(dst / n, sources["org/tiny"] / n) for n in checkpoint_files(dst))
    assert [r.range for r in hub.gets(SHARD2)] == [None]  # fetched again from the start
    assert all(hub.gets(n) == [] for n in finished), "files finished before the kill were fetched again"


# -- corruption -------------------------------------------------------------------------------------------

def test_corrupt_bytes_are_caught_by_sha256_and_refetched(hub, worker, sources, tmp_path):
    size = (sources["org/tiny"] / SHARD1).stat().st_size
    hub.corrupt(SHARD1, offset=size - 3, times=1)  # tensor data: size and header still look right
    reply = worker("org/tiny", tmp_path / "d", verify_sha256=True)
    assert "ok" in reply, reply
    assert reply["ok"]["refetched"] == [SHARD1]
    assert len(hub.gets(SHARD1)) == 2
    assert same_bytes(tmp_path / "d" / SHARD1, sources["org/tiny"] / SHARD1)


def test_persistently_corrupt_file_is_reported_and_never_left_in_place(hub, worker, sources, tmp_path):
    size = (sources["org/tiny"] / SHARD1).stat().st_size
    hub.corrupt(SHARD1, offset=size - 3)
    reply = worker("org/tiny", tmp_path / "d", verify_sha256=True)
    assert reply["type"] == "InputError" and reply["exit_code"] != 0
    assert SHARD1 in reply["error"] and "sha256" in reply["error"] and "fix:" in reply["error"]
    assert not (tmp_path / "d" / SHARD1).exists()
    assert len(hub.gets(SHARD1)) == 2  # the first fetch and one re-fetch, no loop


def test_without_sha256_the_corruption_is_invisible_to_size_and_header_checks(hub, worker, sources, tmp_path):
    size = (sources["org/tiny"] / SHARD1).stat().st_size
    hub.corrupt(SHARD1, offset=size - 3, times=1)
    reply = worker("org/tiny", tmp_path / "d")
    assert "ok" in reply and reply["ok"]["refetched"] == []
    assert not same_bytes(tmp_path / "d" / SHARD1, sources["org/tiny"] / SHARD1)  # why --verify-sha256 exists


def test_corrupt_header_is_caught_by_the_strict_reader_without_hashing(hub, worker, tmp_path):
    hub.corrupt(SHARD2, offset=8)  # the first byte of the JSON header
    reply = worker("org/tiny", tmp_path / "d")
    assert reply["type"] == "InputError"
    assert SHARD2 in reply["error"] and "safetensors check failed" in reply["error"]
    assert not (tmp_path / "d" / SHARD2).exists()


def test_corrupt_files_in_the_hf_cache_are_replaced_or_removed_blob_and_all(hub, worker, home, sources):
    src = sources["org/tiny"]
    hub.corrupt(SHARD3, offset=(src / SHARD3).stat().st_size - 1, times=1)
    hub.corrupt(SHARD2, offset=(src / SHARD2).stat().st_size - 1)  # every time
    failed = worker("org/tiny-private", token=TOKEN, verify_sha256=True)
    assert failed["type"] == "InputError" and SHARD2 in failed["error"] and SHARD3 not in failed["error"]
    blobs = home / "hf" / "hub" / "models--org--tiny-private" / "blobs"
    lfs_blobs = [b for b in blobs.iterdir() if len(b.name) == 64]  # LFS blobs are named by their sha256
    assert lfs_blobs and all(hashlib.sha256(b.read_bytes()).hexdigest() == b.name for b in lfs_blobs), \
        "a corrupt blob was left in the cache, where the next run would link it back without downloading"

    hub.reset()
    reply = worker("org/tiny-private", token=TOKEN, verify_sha256=True)
    assert "ok" in reply, reply
    root = Path(reply["ok"]["path"])
    for name in (SHARD2, SHARD3):
        assert (root / name).is_symlink() and same_bytes(root / name, src / name)
    assert [r.range for r in hub.gets(SHARD2)] == [None] and hub.gets(SHARD3) == []


# -- offline ----------------------------------------------------------------------------------------------

def test_cache_is_reused_online_and_serves_offline_without_any_request(hub, worker, home, tmp_path):
    repo = "org/tiny-offline"  # a repo no other test puts in the shared HF cache
    online = worker(repo, ignore_patterns=["original/*"])
    assert "ok" in online, online
    hub.reset()
    in_dir = worker(repo, tmp_path / "d", ignore_patterns=["original/*"], verify_sha256=True)
    assert "ok" in in_dir, in_dir
    assert hub.requests("GET", "/resolve/") == [], "files already in the HF cache were downloaded again"

    hub.reset()
    offline = Worker(hub_env(hub.url, home, HF_HUB_OFFLINE="1"), tmp_path / "offline.log")
    try:
        cached = offline(repo, ignore_patterns=["original/*"], verify_sha256=True)
        again = offline(repo, tmp_path / "d", ignore_patterns=["original/*"], verify_sha256=True)
        missing = offline("org/never-downloaded")
    finally:
        offline.close()
    assert hub.log == [], "offline mode made a request"
    assert "ok" in cached, cached
    assert cached["ok"]["offline"] and cached["ok"]["path"] == online["ok"]["path"]
    assert {f["name"] for f in cached["ok"]["files"]} == {f["name"] for f in online["ok"]["files"]}
    assert sum(f["header_checked"] for f in cached["ok"]["files"]) == 3
    assert not any(f["hash_checked"] for f in cached["ok"]["files"])  # the HF cache keeps no hashes: said, not faked
    assert "ok" in again, again  # our record in DST still lets offline runs check sha256
    assert all(f["hash_checked"] for f in again["ok"]["files"])
    assert missing["type"] == "InputError" and "HF_HUB_OFFLINE" in missing["error"]


# -- errors -----------------------------------------------------------------------------------------------

def test_hub_errors_become_ckpt_errors_with_a_fix(hub, worker, tmp_path):
    cases = {
        "unknown repo": (dict(repo_id="org/nope"), "repository not found"),
        "bad revision": (dict(repo_id="org/tiny", revision="v9"), "revision not found"),
        "private, no token": (dict(repo_id="org/tiny-private"), "--token"),
        "patterns match nothing": (dict(repo_id="org/tiny", allow_patterns=["*.gguf"]), "no file of org/tiny"),
        "not a repo id": (dict(repo_id="../etc"), "namespace/name"),
    }
    for case, (kwargs, needle) in cases.items():
        reply = worker(dst=tmp_path / case.replace(" ", "-"), **kwargs)
        assert reply.get("type") == "InputError", (case, reply)
        assert needle in reply["error"] and "fix:" in reply["error"], (case, reply["error"])
    assert all(r.authorization is None for r in hub.log)


def test_token_is_sent_to_the_hub(hub, worker, tmp_path):
    reply = worker("org/tiny-private", tmp_path / "d", token=TOKEN, allow_patterns=["config.json"])
    assert "ok" in reply, reply
    assert hub.log and all(r.authorization == f"Bearer {TOKEN}" for r in hub.log)


def test_destination_must_be_empty_or_an_earlier_download_of_the_same_repo(hub, worker, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    reply = worker("org/tiny", foreign)
    assert reply["type"] == "OutputError" and "not empty" in reply["error"]
    assert hub.log == []

    assert "ok" in worker("org/tiny", tmp_path / "d", allow_patterns=["*.json"])
    reply = worker("org/big", tmp_path / "d")
    assert reply["type"] == "OutputError" and "org/tiny" in reply["error"]


def test_a_second_download_into_the_same_directory_fails_fast_and_the_first_completes(hub, home, sources,
                                                                                     tmp_path):
    """Two downloads into one DST would each verify (and delete) files the other is still writing."""
    dst = tmp_path / "d"
    hub.stall(SHARD2, 1_000_000)
    first = subprocess.Popen([sys.executable, "-c", CLI, "download", "org/tiny", str(dst), "--quiet",
                              "--max-workers", "1"], env=hub_env(hub.url, home), cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert hub.stalled.wait(REPLY_TIMEOUT_S), "the first download never reached the stalled shard"
        (tmp_path / "alias").symlink_to(dst)
        for path in (dst, tmp_path / "alias"):  # the lock is on the directory, whatever path names it
            requests = len(hub.log)
            second = run_cli(hub_env(hub.url, home), "download", "org/tiny", str(path), "--quiet")
            assert second.returncode == 1, second.stderr
            assert "another ckpttool run is using this output directory" in second.stderr
            assert "lock" in second.stderr and "fix:" in second.stderr and "Traceback" not in second.stderr
            assert len(hub.log) == requests, "the refused download talked to the hub"
        hub.release()
        out, err = first.communicate(timeout=REPLY_TIMEOUT_S)
    finally:
        hub.release()
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, err
    assert checkpoint_files(dst) == checkpoint_files(sources["org/tiny"])
    assert all(same_bytes(dst / n, sources["org/tiny"] / n) for n in checkpoint_files(dst))
    again = run_cli(hub_env(hub.url, home), "download", "org/tiny", str(dst), "--quiet")  # and it let go
    assert again.returncode == 0, again.stderr


def test_cli_error_exits_non_zero_without_traceback(tmp_path, monkeypatch, capsys):
    """Fails before any request, so it runs in-process through the real entry point."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    try:
        from ckpttool.cli import main
    except ModuleNotFoundError:
        pytest.skip("ckpttool.cli.main needs every command module; covered by the subprocess tests meanwhile")
    for argv, needle in ((["download", "../etc"], "namespace/name"), (["download", "org/x", str(foreign)], "not empty")):
        monkeypatch.setattr(sys, "argv", ["ckpttool", *argv])
        with pytest.raises(SystemExit) as exit_:
            main()
        err = capsys.readouterr().err
        assert exit_.value.code == 1 and needle in err and "fix:" in err and "Traceback" not in err


# -- in-process: input classification and help ------------------------------------------------------------

def test_inputs_tell_local_directories_from_repo_ids_and_revisions(tmp_path, monkeypatch):
    from ckpttool.errors import CkptError
    from ckpttool.hub.source import pick_revision, split_revision
    from ckpttool.recipe import preset
    from ckpttool.runner import resolve_input

    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "local").mkdir(parents=True)
    recipe = preset("convert", dequant=True)
    assert resolve_input(recipe, str(tmp_path), quiet=True) == tmp_path
    assert resolve_input(recipe, "org/local", quiet=True) == Path("org/local")  # an existing path wins over a repo id
    for bad in ("./missing/dir", "missing", "/abs/missing", "a/b/c", "org/local/x@v1"):
        with pytest.raises(CkptError, match="input directory does not exist"):
            resolve_input(recipe, bad, quiet=True)
    assert split_revision("deepseek-ai/DeepSeek-V3") == ("deepseek-ai/DeepSeek-V3", None)
    assert split_revision("org/m@refs/pr/3") == ("org/m", "refs/pr/3")
    assert pick_revision("org/m@v1", None, "main") == ("org/m", "v1")
    assert pick_revision("org/m", "v2", "main") == ("org/m", "v2") and pick_revision("org/m", None, "r") == ("org/m", "r")
    for text, flag in (("org/m@", None), ("org/m@v1", "v2")):
        with pytest.raises(InputError, match="revision"):
            pick_revision(text, flag)


def test_download_help_shows_an_example():
    import ckpttool.cli  # noqa: F401 - registers every command
    from ckpttool.cli.app import app

    out = CliRunner().invoke(app, ["download", "--help"], env={"COLUMNS": "200"}).output
    assert "Example: ckpttool download" in out
    for flag in ("--revision", "--include", "--exclude", "--max-workers", "--verify-sha256", "--token", "--quiet",
                 "--json"):
        assert flag in out
