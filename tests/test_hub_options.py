"""The hub as `hf` users know it (issue 40): `--revision` and `repo@rev`, `--token` on every command that takes
a repo id; `download` of named files, `--include/--exclude`, `--local-dir` and `--cache-dir`; and, when the hub
cannot be reached, the HF cache's copy (as huggingface_hub falls back to it) instead of an error asking for
HF_HUB_OFFLINE=1. The real CLI and the real huggingface_hub client, in child processes, against the
project's hub server on 127.0.0.1 (tests/hub_server.py)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ckpttool.families.deepseek.demo import build_checkpoint

try:
    from conftest import free_port
    from hub_server import HubServer, load_repo
    from test_download import REPO_ROOT, TOKEN, hub, hub_env  # noqa: F401
except ImportError:
    from tests.conftest import free_port
    from tests.hub_server import HubServer, load_repo
    from tests.test_download import REPO_ROOT, TOKEN, hub, hub_env  # noqa: F401

CONVERT = ("--mp", "2", "--device", "cpu", "--workers", "2")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Two commits of one model: v1 and main hold different weights (seeds), the same names."""
    import shutil

    root = tmp_path_factory.mktemp("src")
    found = {"v1": build_checkpoint(root / "v1", "tiny-v3", seed=5), "main": build_checkpoint(root / "main", "tiny-v3")}
    found["files"] = Path(shutil.copytree(found["main"], root / "files"))
    (found["files"] / "original").mkdir()
    (found["files"] / "original" / "params.json").write_text('{"dim": 64}\n')
    return found


@pytest.fixture(scope="module")
def server(sources):
    repos = [load_repo("org/rev", sources["main"]), load_repo("org/rev", sources["v1"], revisions=("v1", "refs/pr/1")),
             load_repo("org/private", sources["main"], token=TOKEN), load_repo("org/files", sources["files"]),
             load_repo("org/cached", sources["v1"]), load_repo("org/never-cached", sources["v1"])]
    with HubServer(repos) as hub:
        yield hub


def cli(env: dict, *args, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpttool", *map(str, args)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def digests(d: Path, pattern: str = "*") -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob(pattern)) if p.is_file()}


def files_in(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file() and ".cache" not in p.parts}


@pytest.fixture(scope="module")
def local_outputs(sources, tmp_path_factory) -> dict[str, Path]:
    """Each commit converted from a local copy: what converting it from the hub must equal."""
    out = tmp_path_factory.mktemp("expected")
    for rev, src in sources.items():
        done = cli({"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)}, "convert", src, out / rev, *CONVERT, "-q")
        assert done.returncode == 0, done.stderr
    return {rev: out / rev for rev in sources}


# -- download: named files, patterns, --local-dir, --cache-dir ------------------------------------------------

def test_download_of_one_named_file_fetches_that_file_and_prints_its_path(hub, tmp_path, sources):
    env = hub_env(hub.url, tmp_path / "home")
    done = cli(env, "download", "org/files", "config.json", "-q")
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.name == "config.json" and path.read_bytes() == (sources["main"] / "config.json").read_bytes()
    assert path.parent.parent.name == "snapshots" and tmp_path / "home" / "hf" / "hub" in path.parents
    assert files_in(path.parent) == {"config.json"}
    assert [r.path.rsplit("/", 1)[1] for r in hub.requests("GET", "/resolve/")] == ["config.json"]
    assert not Path("config.json").exists() and not (REPO_ROOT / "config.json").exists()


def test_download_of_a_mistyped_file_names_the_nearest_and_fetches_nothing(hub, tmp_path):
    done = cli(hub_env(hub.url, tmp_path / "home"), "download", "org/files", "confg.json")
    assert done.returncode == 1 and "has no file 'confg.json'" in done.stderr, done.stderr
    assert "did you mean 'config.json'" in done.stderr and "--local-dir" in done.stderr
    assert hub.requests("GET", "/resolve/") == []
    assert not [p for p in (tmp_path / "home").rglob("*") if p.is_file() and "refs" not in p.parts]  # only the ref
    bare = cli(hub_env(hub.url, tmp_path / "home"), "download", "org/files", "dsv3")  # not a path: a file name
    assert bare.returncode == 1 and "has no file 'dsv3'" in bare.stderr and "--local-dir" in bare.stderr


def test_download_named_files_and_folders_and_patterns_into_a_local_dir(hub, tmp_path, sources):
    env = hub_env(hub.url, tmp_path / "home")
    done = cli(env, "download", "org/files", "config.json", "tokenizer.json", "--local-dir", tmp_path / "two", "--json")
    assert done.returncode == 0, done.stderr
    assert files_in(tmp_path / "two") == {"config.json", "tokenizer.json"}
    assert {f["name"] for f in json.loads(done.stdout)["files"]} == {"config.json", "tokenizer.json"}
    done = cli(env, "download", "org/files", "--local-dir", tmp_path / "json", "--include", "*.json",
               "--exclude", "tokenizer*")
    assert done.returncode == 0, done.stderr
    assert files_in(tmp_path / "json") == {n for n in files_in(sources["files"]) if n.endswith(".json") and
                                           not n.startswith("tokenizer")}
    folder = cli(env, "download", "org/files", "original/", "--local-dir", tmp_path / "folder")  # a folder, as hf
    assert folder.returncode == 0 and files_in(tmp_path / "folder") == {"original/params.json"}, folder.stderr
    legacy = cli(env, "download", "org/files", tmp_path / "all", "-q")  # `download REPO DST` of earlier versions
    assert legacy.returncode == 0 and Path(legacy.stdout.strip()) == (tmp_path / "all").resolve(), legacy.stderr
    assert files_in(tmp_path / "all") == files_in(sources["files"])


def test_download_into_a_cache_dir_and_not_with_a_local_dir_too(hub, tmp_path, sources):
    env = hub_env(hub.url, tmp_path / "home")
    done = cli(env, "download", "org/files", "--cache-dir", tmp_path / "cache", "--include", "*.safetensors", "-q")
    assert done.returncode == 0, done.stderr
    root = Path(done.stdout.strip())
    assert tmp_path / "cache" / "models--org--files" in root.parents
    assert digests(root, "*.safetensors") == digests(sources["main"], "*.safetensors")
    assert not (tmp_path / "home" / "hf" / "hub").exists()
    both = cli(env, "download", "org/files", "--cache-dir", tmp_path / "c", "--local-dir", tmp_path / "d")
    assert both.returncode == 1 and "--local-dir and --cache-dir" in both.stderr


# -- revisions and tokens -----------------------------------------------------------------------------------

def test_revision_and_repo_at_rev_pick_the_commit_everywhere(hub, tmp_path, sources, local_outputs):
    env = hub_env(hub.url, tmp_path / "home")
    for args in (["org/rev", "--revision", "v1"], ["org/rev@v1"], ["org/rev@refs/pr/1"]):
        done = cli(env, "download", *args, "--local-dir", tmp_path / args[-1].replace("/", "_"), "-q")
        assert done.returncode == 0, (args, done.stderr)
        assert digests(tmp_path / args[-1].replace("/", "_"), "*.safetensors") == digests(sources["v1"], "*.safetensors")
    for rev, args in (("v1", ["org/rev@v1"]), ("v1", ["org/rev", "--revision", "v1"]), ("main", ["org/rev"])):
        out = tmp_path / f"conv-{len(list(tmp_path.iterdir()))}"
        done = cli(env, "convert", *args, out, *CONVERT, "-q")
        assert done.returncode == 0, (args, done.stderr)
        assert digests(out, "*.safetensors") == digests(local_outputs[rev], "*.safetensors"), args
    planned = json.loads(cli(env, "plan", "org/rev@v1", *CONVERT[:2], "--json").stdout)
    local = json.loads(cli(env, "plan", sources["v1"], *CONVERT[:2], "--json").stdout)
    assert planned["plan_hash"] == local["plan_hash"]
    clash = cli(env, "convert", "org/rev@v1", tmp_path / "x", "--revision", "main")
    assert clash.returncode == 1 and "revision 'v1' and --revision 'main'" in clash.stderr
    missing = cli(env, "convert", "org/rev@v9", tmp_path / "y")
    assert missing.returncode == 1 and "revision not found" in missing.stderr


def test_token_reaches_the_hub_from_every_command_that_takes_a_repo_id(hub, tmp_path, local_outputs):
    env = hub_env(hub.url, tmp_path / "home")
    refused = cli(env, "plan", "org/private", "--mp", "2")
    assert refused.returncode == 1 and "--token" in refused.stderr
    hub.reset()
    for args in (["plan", "org/private", "--mp", "2"], ["convert", "org/private", tmp_path / "c", *CONVERT, "-q"],
                 ["download", "org/private", "config.json", "-q"]):
        done = cli(env, *args, "--token", TOKEN)
        assert done.returncode == 0, (args, done.stderr)
    assert hub.log and all(r.authorization == f"Bearer {TOKEN}" for r in hub.log)
    assert digests(tmp_path / "c", "*.safetensors") == digests(local_outputs["main"], "*.safetensors")
    recipe = cli(env, "run", "deepseek-v3-hub-mp8-bf16", "-i", "org/private", "-o", tmp_path / "r",
                 "--set", "shard.mp=2", "--token", TOKEN, "-q")
    assert recipe.returncode == 0, recipe.stderr


# -- the hub unreachable: the HF cache, as huggingface_hub does ---------------------------------------------

def _dead_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"  # a port nothing listens on: connection refused


class _Down(BaseHTTPRequestHandler):
    """A hub that is down: 503 to everything."""

    def _answer(self):
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def down_hub():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Down)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("how", ["refused", "503"])
def test_an_unreachable_hub_falls_back_to_the_cache_and_says_so(hub, tmp_path, local_outputs, down_hub, how):
    home = tmp_path / "home"
    assert cli(hub_env(hub.url, home), "download", "org/cached", "-q").returncode == 0
    gone = hub_env(_dead_endpoint() if how == "refused" else down_hub, home)
    done = cli(gone, "convert", "org/cached", tmp_path / "c", *CONVERT)
    assert done.returncode == 0, done.stderr
    assert "cannot be reached" in done.stderr and "HF cache" in done.stderr, done.stderr
    assert digests(tmp_path / "c", "*.safetensors") == digests(local_outputs["v1"], "*.safetensors")
    again = cli(gone, "download", "org/cached", "--json")
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    assert report["offline"] and "cannot be reached" in report["offline_reason"]
    assert sum(f["header_checked"] for f in report["files"]) == 3
    planned = cli(gone, "plan", "org/cached", "--mp", "2", "--json")
    assert planned.returncode == 0 and json.loads(planned.stdout)["tensors"] > 0, planned.stderr

    for args in (["convert", "org/never-cached", tmp_path / "n"], ["download", "org/never-cached"]):
        failed = cli(gone, *args)
        assert failed.returncode == 1 and "cannot be reached" in failed.stderr, failed.stderr
        assert "HF_HUB_OFFLINE" not in failed.stderr and "fix:" in failed.stderr and "Traceback" not in failed.stderr


def test_an_answer_that_refuses_is_not_a_reason_to_fall_back(hub, tmp_path):
    """401/404 are answers (as in huggingface_hub): a private repo without its token is not read from the cache."""
    home = tmp_path / "home"
    assert cli(hub_env(hub.url, home), "download", "org/private", "--token", TOKEN, "-q").returncode == 0
    refused = cli(hub_env(hub.url, home), "download", "org/private")
    assert refused.returncode == 1 and "--token" in refused.stderr and "cannot be reached" not in refused.stderr
