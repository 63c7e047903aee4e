"""hub/stream.py on its own, in this process, without the CLI: a StreamingCheckpoint fetches a hub repo's files in
the order the conversion reads them, with at most K on disk (K raised to what the plan needs at once), deletes
each once its tensors are journalled, fetches a corrupt file once more and then refuses it by name, and clears
what an interrupted run left that nothing reads. The real huggingface_hub client against tests/hub_server.py on
127.0.0.1; its endpoint and cache are set for the test on huggingface_hub's constants (what HF_ENDPOINT and
HF_HUB_CACHE set at its import), which it reads per call.
(The same through the CLI in child processes, kills and --resume included: tests/test_hub_stream.py.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from huggingface_hub import constants as hf_constants

from ckpttool.errors import InputError
from ckpttool.execute.staging import Staging
from ckpttool.families.deepseek.demo import build_checkpoint
from ckpttool.hub.remote import RemoteCheckpoint, open_repo
from ckpttool.hub.schedule import schedule
from ckpttool.hub.stream import StreamingCheckpoint
from ckpttool.io.layout import MANIFEST, PARTIAL_DIR, STREAM_FETCH, STREAM_INPUT
from ckpttool.plan.build import Spec
from ckpttool.runner import ExecOptions, convert

try:
    from hub_server import HubServer, load_repo
except ImportError:
    from tests.hub_server import HubServer, load_repo

SPEC = Spec(mp=2, dequant=True)


def options(k: int) -> ExecOptions:
    return ExecOptions(quiet=True, device="cpu", workers=2, processes=1, max_input_files=k)


@pytest.fixture(scope="module")
def five(tmp_path_factory) -> Path:
    """Five weight files of one layer each, every scale beside its weight."""
    return build_checkpoint(tmp_path_factory.mktemp("src") / "five", n_files=5,
                            overrides={"num_hidden_layers": 5, "num_nextn_predict_layers": 0})


@pytest.fixture(scope="module")
def scattered(tmp_path_factory) -> Path:
    """Every scale in the last of four files: that file is needed from the first task to the last."""
    return build_checkpoint(tmp_path_factory.mktemp("src") / "scattered", seed=3, n_files=4, scales_in_last_file=True,
                            overrides={"num_hidden_layers": 4, "num_nextn_predict_layers": 0})


@pytest.fixture(scope="module")
def server(five, scattered):
    with HubServer([load_repo("org/five", five), load_repo("org/corrupt", five),
                    load_repo("org/scattered", scattered)]) as hub:
        yield hub


@pytest.fixture
def hub(server, tmp_path, monkeypatch):
    # what HF_ENDPOINT sets at huggingface_hub's import (the URL template is derived from it there)
    monkeypatch.setattr(hf_constants, "ENDPOINT", server.url)
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))  # empty: nothing read in place
    server.reset()
    return server


@pytest.fixture(scope="module")
def expected(five, tmp_path_factory) -> dict[str, str]:
    """What every streamed conversion of `five` must write: the same conversion of the local directory."""
    out = tmp_path_factory.mktemp("expected") / "out"
    convert(five, out, SPEC, options(2))
    return digests(out)


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def weight_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.safetensors"))


def test_files_arrive_in_read_order_one_at_a_time(hub, five, expected, tmp_path):
    """K = 1: each file is fetched only after the one before it was freed (its tensors journalled), in the order
    the executor first reads them, and the output is the local conversion's, byte for byte."""
    repo = open_repo("org/five")
    with RemoteCheckpoint(repo, tmp_path / "label") as remote:
        plan = SPEC.plan(remote)
        _, first, _ = schedule(plan, remote)
    result = convert(repo, tmp_path / "out", SPEC, options(1))
    d = result.download
    order = sorted(first, key=first.get)
    assert sorted(order) == weight_files(five) and d["files_fetched"] == 5 and d["refetched"] == []
    assert d["max_input_files"] == 1 and d["input_files_needed_at_once"] == 1
    assert sorted(d["timeline"], key=lambda f: d["timeline"][f]["fetch"]) == order
    for before, after in zip(order, order[1:]):
        assert d["timeline"][after]["fetch"] >= d["timeline"][before]["freed"], d["timeline"]
    assert all(d["timeline"][f]["read"] <= d["timeline"][f]["freed"] for f in order)
    assert digests(tmp_path / "out") == expected and not (tmp_path / "out" / PARTIAL_DIR).exists()
    assert d["bytes_fetched"] == sum((five / f).stat().st_size for f in order + plan.copies)  # side files too


def test_k_is_raised_to_what_the_plan_needs_at_once(hub, scattered, tmp_path):
    """With every scale in the last file, K = 1 would deadlock: the stream takes K = 2, fetches the last file
    with the first one and keeps it to the end; the disk the free-space check reserves says so too."""
    repo = open_repo("org/scattered")
    last = weight_files(scattered)[-1]
    with RemoteCheckpoint(repo, tmp_path / "label") as remote:
        plan = SPEC.plan(remote)
    with StreamingCheckpoint(repo, tmp_path / "staging", max_files=1) as streaming:
        sizes = sorted((repo.files[f].size for f in weight_files(scattered)), reverse=True)
        assert streaming.disk_reserve(plan) == sum(sizes[:2])
    result = convert(repo, tmp_path / "out", SPEC, options(1))
    d = result.download
    assert d["input_files_needed_at_once"] == 2 and d["max_input_files"] == 2
    assert sorted(d["timeline"], key=lambda f: d["timeline"][f]["fetch"]).index(last) <= 1  # with the first task's
    assert d["timeline"][last]["freed"] == max(t["freed"] for t in d["timeline"].values())


def test_a_corrupt_file_is_fetched_once_more(hub, five, expected, tmp_path):
    victim = weight_files(five)[2]
    # past the header: only the sha256 sees it; the first of the two GETs is the plan's header range
    hub.corrupt(victim, (five / victim).stat().st_size // 2, times=2)
    result = convert(open_repo("org/corrupt"), tmp_path / "out", SPEC, options(2))
    assert result.download["refetched"] == [victim] and digests(tmp_path / "out") == expected


def test_a_file_corrupt_every_time_is_refused_and_nothing_published(hub, five, tmp_path):
    """Never converted from: deleted, fetched once more, then an error naming the file's URL and the fix."""
    victim = weight_files(five)[2]
    hub.corrupt(victim, (five / victim).stat().st_size // 2, times=None)
    with pytest.raises(InputError) as err:
        convert(open_repo("org/corrupt"), tmp_path / "out", SPEC, options(2))
    assert "failed verification after 1 re-fetch" in str(err.value) and str(err.value.file).endswith(victim)
    assert "--resume" in err.value.fix
    out = tmp_path / "out"
    assert not (out / MANIFEST).exists() and not list(out.glob("model*-mp2.safetensors"))
    assert not (out / PARTIAL_DIR / STREAM_INPUT / victim).exists()
    assert not (out / PARTIAL_DIR / STREAM_FETCH / victim).exists()


def test_what_an_interrupted_run_left_that_nothing_reads_is_cleared(hub, five, tmp_path):
    """plan_fetches keeps the files still to be read (a verified one is not fetched again) and deletes the rest."""
    repo = open_repo("org/five")
    names = weight_files(five)
    with RemoteCheckpoint(repo, tmp_path / "label") as remote:
        plan = SPEC.plan(remote)
    dst = tmp_path / "out"
    staging = Staging(dst, plan, resume=False)
    try:
        inputs, fetch = dst / PARTIAL_DIR / STREAM_INPUT, dst / PARTIAL_DIR / STREAM_FETCH
        for folder, name in ((inputs, "stale.safetensors"), (fetch, "half.safetensors"), (inputs, names[0]),
                             (fetch, names[1])):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(b"left by an interrupted run")
        with StreamingCheckpoint(repo, dst / PARTIAL_DIR, max_files=2) as streaming:
            to_fetch = streaming.plan_fetches(staging)
            assert to_fetch == sum((five / n).stat().st_size for n in names)
            assert sorted(p.name for p in inputs.iterdir()) == [names[0]]
            assert sorted(p.name for p in fetch.iterdir()) == [names[1]]
            assert staging.on_commit == streaming.durable
    finally:
        staging.close()
