"""Hub file names are untrusted: a name from the hub's listing or from ckpttool's own download
record is validated (relative, plain parts, outside .cache, printable) before any file is opened,
written or deleted, and the refusal prints the name escaped."""

from __future__ import annotations

import json

import pytest

from ckpttool.families.deepseek.demo import build_checkpoint

try:
    from hub_server import HubServer, RepoEntry, git_blob_sha1, load_repo
    from test_download import hub_env, run_cli
except ImportError:
    from tests.hub_server import HubServer, RepoEntry, git_blob_sha1, load_repo
    from tests.test_download import hub_env, run_cli

HOSTILE = {"org/dotdot": "../victim.txt", "org/escape": "tok\x1b[31menizer.json", "org/marker": ".cache/ckpttool/x",
           "org/deep": "a/../../victim.txt", "org/abs": "/tmp/ckpttool-hub-abs-victim.txt"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tiny = build_checkpoint(tmp_path_factory.mktemp("tiny"))
    repos = [load_repo("org/clean", tiny)]
    for repo_id, name in HOSTILE.items():
        repo = load_repo(repo_id, tiny)
        data = b"planted by the repo\n"
        repo.files[name] = RepoEntry(name, data, git_blob_sha1(data), None)
        repos.append(repo)
    with HubServer(repos) as hub:
        yield hub


@pytest.mark.parametrize("repo_id", sorted(HOSTILE))
def test_a_hostile_listing_is_refused_before_anything_is_fetched(server, tmp_path, repo_id):
    victim = tmp_path / "victim.txt"
    victim.write_text("beside DST")
    server.reset()
    done = run_cli(hub_env(server.url, tmp_path / "home"), "download", repo_id, str(tmp_path / "dst"))
    assert done.returncode == 1, done.stderr
    assert "error:" in done.stderr and "fix:" in done.stderr and "Traceback" not in done.stderr
    assert "\x1b" not in done.stderr  # the name is printed escaped
    assert victim.read_text() == "beside DST"
    assert server.requests("GET", "/resolve/") == []  # refused before a single file was fetched
    assert not (tmp_path / "dst").exists() or not any((tmp_path / "dst").rglob("*.safetensors"))


def test_a_tampered_download_record_cannot_point_a_delete_outside(server, tmp_path):
    home = tmp_path / "home"
    dst = tmp_path / "dst"
    ok = run_cli(hub_env(server.url, home), "download", "org/clean", str(dst))
    assert ok.returncode == 0, ok.stderr
    victim = tmp_path / "victim.txt"
    victim.write_text("beside DST")
    marker = dst / ".cache" / "ckpttool" / "download.json"
    record = json.loads(marker.read_text())
    record["files"]["../victim.txt"] = {"size": 1, "sha256": None, "blob_id": None}  # wrong size: 'discard' it
    marker.write_text(json.dumps(record))
    offline = run_cli(hub_env(server.url, home, HF_HUB_OFFLINE="1"), "download", "org/clean", str(dst))
    assert offline.returncode == 1 and "Traceback" not in offline.stderr, offline.stderr
    assert victim.read_text() == "beside DST"
    marker.write_text('["not", "a record"]')  # damaged: treated as absent, never a traceback
    again = run_cli(hub_env(server.url, home, HF_HUB_OFFLINE="1"), "download", "org/clean", str(dst))
    assert "Traceback" not in again.stderr
    assert victim.read_text() == "beside DST"


def test_a_bad_file_that_is_a_symlink_out_of_dst_loses_only_the_link(server, tmp_path):
    home = tmp_path / "home"
    dst = tmp_path / "dst"
    assert run_cli(hub_env(server.url, home), "download", "org/clean", str(dst)).returncode == 0
    victim = tmp_path / "victim.json"
    victim.write_text("outside DST, and not the size the hub lists")
    (dst / "tokenizer.json").unlink()
    (dst / "tokenizer.json").symlink_to(victim)  # fails the size check: discarded, offline no re-fetch
    offline = run_cli(hub_env(server.url, home, HF_HUB_OFFLINE="1"), "download", "org/clean", str(dst))
    assert offline.returncode == 1 and "Traceback" not in offline.stderr, offline.stderr
    assert victim.read_text() == "outside DST, and not the size the hub lists"
