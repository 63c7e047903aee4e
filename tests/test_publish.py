"""publish/destination.py and publish/publish.py on their own, without the CLI: where a run may write (never into
SRC, by inode; never over the user's files), the lock that keeps one run per DST, the free-space check, whether an
earlier run already published this plan, what --overwrite may delete (only files it can prove it wrote) and what
`inspect --check` reports. Real directories, links, locks and manifests in tmp_path. (The whole of publish through
a run, crashes and files appearing during it: tests/test_crash_safety.py, tests/test_dst_changed_during_run.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckpttool.errors import InputError, OutputError
from ckpttool.io.hashing import ALGORITHM, file_digest
from ckpttool.io.layout import MANIFEST, PARTIAL_DIR
from ckpttool.publish.destination import (
    DestinationLock,
    allocated,
    already_complete,
    check_destination,
    check_free_space,
    check_outside,
    existing_ancestor,
    snapshot,
)
from ckpttool.publish.publish import check_manifest, remove_stale


def manifest(dst: Path, names: list[str], plan_hash: str = "p" * 64, **extra: dict) -> dict:
    files = {n: {"size": (dst / n).stat().st_size, ALGORITHM: file_digest(dst / n)} for n in names}
    files.update(extra)
    body = {"tool": "ckpttool test", "plan_hash": plan_hash, "format": "hf", "files": files}
    (dst / MANIFEST).write_text(json.dumps(body))
    return body


@pytest.fixture
def src(tmp_path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"weights")
    return src


@pytest.mark.parametrize("where", ["inside", "same", "symlink", "parent"])
def test_output_overlapping_the_input_is_refused(src, tmp_path, where):
    """Compared by device and inode: a symlinked path to SRC is SRC."""
    (tmp_path / "link").symlink_to(src)
    dst = {"inside": src / "out", "same": src, "symlink": tmp_path / "link" / "out", "parent": tmp_path}[where]
    with pytest.raises(OutputError, match="overlaps input"):
        check_destination(src, dst, overwrite=True, resume=False)


def test_a_non_empty_output_needs_overwrite_or_resume(src, tmp_path):
    dst = tmp_path / "dst"
    check_destination(src, dst, overwrite=False, resume=False)  # not there yet: fine
    dst.mkdir()
    check_destination(src, dst, overwrite=False, resume=False)  # empty: fine
    (dst / "notes.txt").write_text("mine")
    with pytest.raises(OutputError) as err:
        check_destination(src, dst, overwrite=False, resume=False)
    assert "not empty (1 entries, e.g. 'notes.txt')" in str(err.value) and "--overwrite" in err.value.fix
    check_destination(src, dst, overwrite=True, resume=False)
    with pytest.raises(OutputError, match="not empty"):  # nothing of ours here: --resume is refused like any run
        check_destination(src, dst, overwrite=False, resume=True)
    manifest(dst, ["notes.txt"])
    check_destination(src, dst, overwrite=False, resume=True)  # a published output: --resume may look at it


def test_resume_continues_only_what_was_started(src, tmp_path):
    dst = tmp_path / "dst"
    (dst / PARTIAL_DIR).mkdir(parents=True)
    with pytest.raises(OutputError) as err:
        check_destination(src, dst, overwrite=False, resume=False)
    assert "interrupted run" in str(err.value) and "--resume" in err.value.fix
    check_destination(src, dst, overwrite=False, resume=True)


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_a_staging_path_ckpttool_never_makes_is_refused(src, tmp_path, kind):
    dst = tmp_path / "dst"
    dst.mkdir()
    if kind == "symlink":
        (dst / PARTIAL_DIR).symlink_to(tmp_path)
    else:
        (dst / PARTIAL_DIR).write_text("")
    with pytest.raises(OutputError, match="staging path is a symlink or not a directory"):
        check_destination(src, dst, overwrite=True, resume=True)


def test_an_output_path_that_is_a_file_is_refused(src, tmp_path):
    (tmp_path / "dst").write_text("")
    with pytest.raises(OutputError, match="not a directory"):
        check_destination(src, tmp_path / "dst", overwrite=True, resume=False)


def test_an_input_reached_through_dst_is_refused(src, tmp_path):
    """A shard of SRC that is a symlink into DST would be destroyed by writing DST."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "real.safetensors").write_bytes(b"x")
    (src / "linked.safetensors").symlink_to(dst / "real.safetensors")
    with pytest.raises(OutputError, match="lives inside the output directory"):
        check_outside(dst, [src / "model.safetensors", src / "linked.safetensors"])
    check_outside(dst, [src / "model.safetensors"])
    check_outside(tmp_path / "not-yet", [src / "linked.safetensors"])


def test_one_run_per_output_directory(tmp_path):
    """The lock is on the directory's inode: a second lock by another path fails at once, naming what to do;
    released, it can be taken again. A run refused before writing leaves no directory it made behind."""
    dst = tmp_path / "dst"
    first = DestinationLock(dst)
    (tmp_path / "alias").symlink_to(dst)
    with pytest.raises(OutputError) as err:
        DestinationLock(tmp_path / "alias", then="run it again")
    assert "another ckpttool run is using this output directory" in str(err.value)
    assert err.value.fix.endswith("run it again")
    first.release(failed=True)  # it made dst: gone again
    assert not dst.exists()
    dst.mkdir()
    (dst / "keep").write_text("")
    second = DestinationLock(dst)
    second.release(failed=True)  # it did not make dst: stays
    assert (dst / "keep").exists()
    second.release()  # twice is harmless


def test_snapshot_and_space(tmp_path):
    dst = tmp_path / "dst"
    assert snapshot(dst) == {}
    dst.mkdir()
    (dst / "a").write_bytes(b"x" * 5000)
    (dst / PARTIAL_DIR).mkdir()
    snap = snapshot(dst)
    st = os.lstat(dst / "a")
    assert snap == {"a": [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]}
    assert allocated(dst) >= 4096 and allocated(tmp_path / "none") == 0
    assert existing_ancestor(dst / "x" / "y") == dst
    check_free_space(dst / "x", 1)
    with pytest.raises(OutputError) as err:
        check_free_space(dst / "x", 1 << 62, what="the output")
    assert "needs 4294967296.00 GiB free for the output" in str(err.value) and Path(err.value.file) == dst


def test_already_complete_only_for_the_same_plan(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"out")
    assert not already_complete(dst, "p" * 64, resume=True)  # no manifest: the run starts
    manifest(dst, ["model.safetensors"])
    assert already_complete(dst, "p" * 64, resume=True)
    assert not already_complete(dst, "p" * 64, resume=False)
    with pytest.raises(OutputError, match="produced by a different plan"):
        already_complete(dst, "q" * 64, resume=True)
    (dst / PARTIAL_DIR).mkdir()
    assert not already_complete(dst, "q" * 64, resume=True)  # staged work to continue


def test_overwrite_removes_only_what_it_can_prove_it_wrote(tmp_path):
    """remove_stale deletes what the old manifest lists and this run does not produce, only where it is a plain
    name, a regular file with one link, with the size and hash recorded."""
    dst = tmp_path / "dst"
    dst.mkdir()
    for name in ("old.safetensors", "kept.safetensors", "changed.safetensors", "linked.safetensors",
                 "hardlinked.safetensors", "new.safetensors"):
        (dst / name).write_bytes(name.encode())
    listed = manifest(dst, ["old.safetensors", "kept.safetensors", "changed.safetensors", "linked.safetensors",
                            "hardlinked.safetensors"],
                      **{"../outside.txt": {"size": 1, ALGORITHM: "0" * 64},
                         "gone.safetensors": {"size": 1, ALGORITHM: "0" * 64}})["files"]
    (dst / "changed.safetensors").write_bytes(b"CHANGED.safetensors")  # same size, other bytes
    (tmp_path / "target").write_bytes(b"linked.safetensors")
    (dst / "linked.safetensors").unlink()
    (dst / "linked.safetensors").symlink_to(tmp_path / "target")
    os.link(dst / "hardlinked.safetensors", tmp_path / "second-link")
    (tmp_path / "outside.txt").write_text("x")
    removed = remove_stale(dst, listed, keep={"kept.safetensors", "new.safetensors"})
    assert removed == ["old.safetensors"]
    assert sorted(p.name for p in dst.iterdir()) == sorted(["kept.safetensors", "changed.safetensors",
                                                            "linked.safetensors", "hardlinked.safetensors",
                                                            "new.safetensors", MANIFEST])
    assert (tmp_path / "target").exists() and (tmp_path / "outside.txt").exists()


def test_check_reports_each_file(tmp_path):
    """`inspect --check`: every listed file re-hashed; missing, resized, changed and unsafe names each said."""
    dst = tmp_path / "dst"
    dst.mkdir()
    for name in ("a.safetensors", "b.safetensors", "c.safetensors", "d.safetensors"):
        (dst / name).write_bytes(name.encode() * 3)
    manifest(dst, ["a.safetensors", "b.safetensors", "c.safetensors", "d.safetensors"],
             **{"../x": {"size": 1, ALGORITHM: "0" * 64}})
    assert check_manifest(dst)["ok"] is False  # the unsafe name
    (dst / "b.safetensors").unlink()
    (dst / "c.safetensors").write_bytes(b"short")
    (dst / "d.safetensors").write_bytes(b"D" * len(b"d.safetensors" * 3))
    report = check_manifest(dst)
    assert report["plan_hash"] == "p" * 64 and report["ok"] is False
    assert report["files"] == {"a.safetensors": "ok", "b.safetensors": "missing",
                               "c.safetensors": f"size 5 != {len(b'c.safetensors' * 3)}",
                               "d.safetensors": f"{ALGORITHM} mismatch",
                               "../x": "not a plain file name (not something ckpttool writes)"}
    manifest(dst, ["a.safetensors"], **{"b.safetensors": {"size": 1}})  # an entry with neither hash proves nothing
    with pytest.raises(InputError, match="no `files` object of"):
        check_manifest(dst)
    (dst / MANIFEST).unlink()
    with pytest.raises(InputError, match="no ckpttool manifest here"):
        check_manifest(dst)
