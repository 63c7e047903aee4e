"""Nothing outside DST is written or deleted: names from an old manifest, a planted symlink or hard
link in DST or its staging directory, and hostile names from a hub listing or our own download record
never lead a write or an unlink anywhere else (one name validator, io/layout.name_problem)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from ckpttool.errors import InputError
from ckpttool.io.layout import MANIFEST, PARTIAL_DIR, check_name, check_output_names, name_problem
from conftest import run_cli

CONVERT = ("--mp", "2", "--dtype", "bf16", "--quiet", "--workers", "2", "--processes", "1")  # faults count per process


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _plant_manifest(dst, names: dict[str, bytes]) -> None:
    """An earlier 'manifest' listing `names` with the size and sha256 of the given bytes: exactly
    what a file we wrote would have, so only the name checks stand between it and an unlink."""
    manifest = json.loads((dst / MANIFEST).read_text())
    for name, data in names.items():
        manifest["files"][name] = {"size": len(data), "sha256": _sha(data)}
    (dst / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def converted(tiny_v3, tmp_path):
    dst = tmp_path / "out"
    run_cli("convert", tiny_v3, dst, *CONVERT)
    return dst


def test_overwrite_never_deletes_what_a_manifest_names_outside_dst(tiny_v3, tmp_path, converted):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"the user's file beside DST\n")
    inside_src = tiny_v3 / "tokenizer.json"
    src_bytes = inside_src.read_bytes()
    sub = converted / "sub"
    sub.mkdir()
    (sub / "x.bin").write_bytes(b"nested")
    _plant_manifest(converted, {"../victim.txt": victim.read_bytes(), str(victim): victim.read_bytes(),
                                os.path.relpath(inside_src, converted): src_bytes,
                                "sub/x.bin": b"nested", "..": b"", ".": b""})
    run_cli("convert", tiny_v3, converted, *CONVERT, "--overwrite")
    assert victim.read_bytes() == b"the user's file beside DST\n"
    assert inside_src.read_bytes() == src_bytes
    assert (sub / "x.bin").read_bytes() == b"nested"


def test_overwrite_deletes_only_files_it_can_prove_it_wrote(tiny_v3, tmp_path, converted):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"outside")
    (converted / "link.bin").symlink_to(outside)  # a symlink listed with its target's size and hash
    (converted / "hard.bin").write_bytes(b"hard")
    os.link(converted / "hard.bin", tmp_path / "hard-elsewhere.bin")  # a second name: not ours alone
    (converted / "edited.bin").write_bytes(b"the user changed this")
    (converted / "ours.bin").write_bytes(b"an old output of ours")
    _plant_manifest(converted, {"link.bin": b"outside", "hard.bin": b"hard", "edited.bin": b"what we wrote",
                                "ours.bin": b"an old output of ours"})
    run_cli("convert", tiny_v3, converted, *CONVERT, "--overwrite")
    assert outside.read_bytes() == b"outside" and (converted / "link.bin").is_symlink()
    assert (tmp_path / "hard-elsewhere.bin").read_bytes() == b"hard" and (converted / "hard.bin").exists()
    assert (converted / "edited.bin").read_bytes() == b"the user changed this"
    assert not (converted / "ours.bin").exists()  # the one file that is provably an earlier output


def test_merge_overwrite_and_a_damaged_manifest_delete_nothing_outside(tiny_v3, tmp_path, converted):
    merged = tmp_path / "merged"
    run_cli("merge", converted, merged, "--quiet")
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me")
    _plant_manifest(merged, {"../victim.txt": b"keep me"})
    run_cli("merge", converted, merged, "--quiet", "--overwrite")
    assert victim.read_bytes() == b"keep me"
    (merged / "stray.bin").write_bytes(b"x")
    (merged / MANIFEST).write_text("{not json")  # proves nothing: nothing is deleted on its word
    run_cli("merge", converted, merged, "--quiet", "--overwrite")
    assert (merged / "stray.bin").read_bytes() == b"x" and victim.read_bytes() == b"keep me"


def test_writes_replace_planted_symlinks_instead_of_following_them(tiny_v3, tmp_path, converted):
    victim = tmp_path / "victim.json"
    victim.write_text("outside DST")
    for name in ("config.json", MANIFEST, "tokenizer.json", "model0-mp2.safetensors"):
        (converted / name).unlink()
        (converted / name).symlink_to(victim)
    # the temp names are random now, but plant the old fixed ones too
    (converted / ".config.json.ckpttool-tmp").symlink_to(victim)
    run_cli("convert", tiny_v3, converted, *CONVERT, "--overwrite")
    assert victim.read_text() == "outside DST"
    for name in ("config.json", MANIFEST, "tokenizer.json", "model0-mp2.safetensors"):
        assert not (converted / name).is_symlink()


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "staging-symlink"])
def test_resume_refuses_planted_links_in_the_staging_dir(tiny_v3, tmp_path, kind):
    from conftest import run_cli_process

    dst = tmp_path / "out"
    proc = run_cli_process("convert", tiny_v3, dst, *CONVERT, env={"CKPTTOOL_FAULT": "pwrite:2"})
    assert proc.returncode != 0
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"v" * 100)
    shard = dst / PARTIAL_DIR / "model1-mp2.safetensors"
    if kind == "symlink":
        shard.unlink(missing_ok=True)
        shard.symlink_to(victim)
    elif kind == "hardlink":
        shard.unlink(missing_ok=True)
        os.link(victim, shard)
    else:
        elsewhere = tmp_path / "elsewhere"
        os.rename(dst / PARTIAL_DIR, elsewhere)
        (dst / PARTIAL_DIR).symlink_to(elsewhere)
    refused = run_cli("convert", tiny_v3, dst, *CONVERT, "--resume", check=False)
    assert refused.returncode == 1, refused.stderr
    assert "ckpttool never creates" in refused.stderr and "fix:" in refused.stderr
    assert victim.read_bytes() == b"v" * 100


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../b", "./a", "a//b", "", "..", "a\\b", "a\x1b[2Jb",
                                  "a\u202eb", "a\x00b", 7, None])
def test_one_validator_refuses_every_hostile_name(name):
    assert name_problem(name, subdirs=True) is not None
    with pytest.raises(InputError):
        check_name(name, source="test")


def test_output_names_cannot_collide_with_ours_or_leave_the_directory():
    ok = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    check_output_names(ok, ["tokenizer.json", "config.json"], source="t")
    for files, copies in [(["tokenizer.json"], ["tokenizer.json"]), (["plan.json"], []),
                          ([MANIFEST], []), (["sub/a.safetensors"], []), (ok + ok[:1], []),
                          (ok, [MANIFEST]), (ok, [ok[0]]), ([".x.safetensors"], [])]:
        with pytest.raises(InputError):
            check_output_names(files, copies, source="t")
