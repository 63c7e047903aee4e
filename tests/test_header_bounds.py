"""A header of 10^6 tiny tensors took 29 s and 1.0 GB of RSS per file to parse (issue 39): the parse is now
bounded before it starts (io/safetensors.py counts the entries at memchr speed and refuses past
MAX_TENSORS_PER_FILE, or past MAX_HEADER_ITEMS JSON values of any kind), per checkpoint (MAX_TENSORS over
all files) and, from the hub, over all headers fetched (MAX_HEADERS_BYTES). Real files, the real parser."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ckpttool.errors import InputError
from ckpttool.io import shards
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.io.safetensors import MAX_TENSORS_PER_FILE, read_header

try:
    from conftest import run_cli_process
    from hub_server import HubServer, load_repo
    from test_download import REPO_ROOT, hub_env
except ImportError:
    from tests.conftest import run_cli_process
    from tests.hub_server import HubServer, load_repo
    from tests.test_download import REPO_ROOT, hub_env


def tiny_tensors(path: Path, n: int, *, metadata: dict | None = None, prefix: str = "t") -> Path:
    """A valid safetensors file of n one-byte tensors (what a hostile header would list)."""
    header = {"__metadata__": metadata} if metadata else {}
    header.update({f"{prefix}.{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(n)})
    raw = json.dumps(header, separators=(",", ":")).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(n))
    return path


def test_a_million_tiny_tensors_are_refused_unparsed(tmp_path):
    """The issue's file, through the CLI (`inspect`) as a user meets it: refused, not parsed."""
    path = tiny_tensors(tmp_path / "model.safetensors", 10 ** 6)
    proc = run_cli_process("inspect", path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "header lists 1000000 tensors" in proc.stderr and "it was not parsed" in proc.stderr, proc.stderr


def test_a_header_at_the_bound_still_reads(tmp_path):
    """The bound refuses only what no real file holds: a file at exactly the cap parses, whole."""
    path = tiny_tensors(tmp_path / "at.safetensors", MAX_TENSORS_PER_FILE)
    sf = read_header(path)
    assert len(sf.tensors) == MAX_TENSORS_PER_FILE
    with pytest.raises(InputError, match=f"header lists {MAX_TENSORS_PER_FILE + 1} tensors"):
        read_header(tiny_tensors(tmp_path / "over.safetensors", MAX_TENSORS_PER_FILE + 1))


def test_bulk_that_is_not_tensors_is_refused_unparsed(tmp_path):
    """Not in the issue: a few tensors under millions of metadata entries, or a shape millions of dimensions
    long (both fit in the 100 MB header cap, and both used to be parsed whole before being refused)."""
    meta = {f"k{i}": "v" for i in range(3 * 10 ** 6)}
    with pytest.raises(InputError, match="JSON values"):
        read_header(tiny_tensors(tmp_path / "meta.safetensors", 4, metadata=meta))
    raw = json.dumps({"w": {"dtype": "U8", "shape": [1] * 3_000_000, "data_offsets": [0, 1]}}).encode()
    (tmp_path / "shape.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0")
    with pytest.raises(InputError, match="JSON values"):
        read_header(tmp_path / "shape.safetensors")


def test_a_checkpoint_is_bounded_over_all_its_files(tmp_path, monkeypatch):
    """Files each under the per-file cap add up: the checkpoint stops at the file that crosses MAX_TENSORS
    (lowered here so that the test stays small)."""
    monkeypatch.setattr(shards, "MAX_TENSORS", 1000)  # its home since io/shards.py (ShardFiles counts them)
    for i in range(3):
        tiny_tensors(tmp_path / f"model-{i}.safetensors", 400, prefix=f"f{i}")
    with pytest.raises(InputError, match="over 1000 tensors") as caught:
        Checkpoint(tmp_path)
    assert caught.value.file.endswith("model-2.safetensors")


def test_a_repos_headers_are_bounded_before_they_are_fetched(tmp_path):
    """From the hub every header is fetched before any is parsed: their announced lengths are added up as they
    arrive and the plan stops at the file that crosses MAX_HEADERS_BYTES (lowered in the child)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        tiny_tensors(src / f"model-0000{i}.safetensors", 2000, prefix=f"f{i}")
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    script = ("import sys; import ckpttool.hub.remote as r; r.MAX_HEADERS_BYTES = 200_000; "
              "from ckpttool.cli import main; sys.exit(main(sys.argv[1:]))")
    with HubServer([load_repo("org/bulky", src)]) as hub:
        proc = subprocess.run([sys.executable, "-c", script, "plan", "org/bulky"], env=hub_env(hub.url, tmp_path / "h"),
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        fetched = [r for r in hub.requests("GET", "/resolve/") if r.path.endswith(".safetensors")]
    assert proc.returncode == 1 and "headers announce over 200000 bytes" in proc.stderr, proc.stderr
    assert sum(r.sent for r in fetched) < 4 * 2000 * 70, "every header was fetched whole anyway"
