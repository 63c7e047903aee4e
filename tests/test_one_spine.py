"""One spine for every command: merge runs on convert's executor (journal, --resume after a kill,
manifest, memory budget, torchrun); one family table answers every command; one set of defaults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from ckpttool import defaults
from ckpttool.errors import InputError, RecipeError
from ckpttool.execute.staging import JOURNAL
from ckpttool.families.table import MODEL_TYPES, family_for
from ckpttool.io.layout import MANIFEST, PARTIAL_DIR
from ckpttool.recipe import load_recipe, preset, validate_recipe
from ckpttool.runner import ExecOptions
from conftest import REPO, run_cli, run_cli_process

MERGE = ("--quiet", "--workers", "2", "--processes", "1")  # faults count per process


def _tree(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def v3_mp2(tiny_v3, tmp_path_factory):
    out = tmp_path_factory.mktemp("spine") / "mp2"
    run_cli("shard", tiny_v3, out, "--mp", 2, "--quiet")
    return out


@pytest.fixture(scope="module")
def merged(v3_mp2, tmp_path_factory):
    out = tmp_path_factory.mktemp("spine") / "merged"
    run_cli("merge", v3_mp2, out, "--max-shard-size", "1MB", *MERGE)
    return out


@pytest.mark.parametrize("point", ["pwrite:3", "pwrite:40", "commit:2", "publish:2", "manifest:1"])
def test_merge_killed_anywhere_resumes_to_identical_output(v3_mp2, merged, tmp_path, point):
    dst = tmp_path / "out"
    proc = run_cli_process("merge", v3_mp2, dst, "--max-shard-size", "1MB", *MERGE,
                           env={"CKPTTOOL_JOURNAL_BYTES": "100000", "CKPTTOOL_FAULT": point})
    assert proc.returncode == -signal.SIGKILL, f"fault {point} never fired: {proc.returncode} {proc.stderr}"
    assert not (dst / MANIFEST).exists()
    if point.startswith(("pwrite", "commit")):
        assert sorted(p.name for p in dst.iterdir()) == [PARTIAL_DIR]  # nothing under a final name
    refused = run_cli("merge", v3_mp2, dst, "--max-shard-size", "1MB", *MERGE, check=False)
    assert refused.returncode == 1 and "--resume" in refused.stderr
    run_cli("merge", v3_mp2, dst, "--max-shard-size", "1MB", *MERGE, "--resume")
    assert _tree(dst) == _tree(merged)


def test_merge_journals_streams_and_reports_like_convert(v3_mp2, merged, tmp_path):
    """A merge that finished is `inspect --check` intact; resuming it is a no-op; a second run with
    a tiny chunk size (so every tensor streams in many runs of rows) and a tiny budget gives the same
    bytes; --json reports its timing and --dry-run its plan."""
    assert json.loads(run_cli("inspect", merged, "--check", "--json").stdout)["ok"]
    again = json.loads(run_cli("merge", v3_mp2, merged, "--max-shard-size", "1MB", "--resume", "--json").stdout)
    assert again["already_complete"] and again["bytes_written"] == 0

    from ckpttool.plan.merge import MergeSpec
    from ckpttool.runner import convert

    result = convert(v3_mp2, tmp_path / "chunked", MergeSpec(max_shard_bytes=10**6),
                     ExecOptions(quiet=True, chunk_bytes=4096, max_memory=16 << 20, workers=2))
    assert _tree(tmp_path / "chunked") == _tree(merged)
    assert result.timings.to_json()["thread_s"]["write"] > 0

    report = json.loads(run_cli("merge", v3_mp2, tmp_path / "j", "--json", "--quiet").stdout)
    assert report["ok"] and report["recipe"] == "merge" and report["format"] == "hf"
    assert report["timing"]["thread_s"]["read"] > 0
    plan = json.loads(run_cli("merge", v3_mp2, tmp_path / "d", "--dry-run", "--json").stdout)
    assert plan["plan_hash"] == report["plan_hash"] and not (tmp_path / "d").exists()


def test_merge_under_torchrun_is_byte_identical(v3_mp2, merged, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "ckpttool", "merge", str(v3_mp2), str(tmp_path / "multi"), "--max-shard-size", "1MB", *MERGE],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _tree(tmp_path / "multi") == _tree(merged)
    assert not list((tmp_path / "multi").rglob(JOURNAL))


def test_one_family_table_answers_every_command(tiny_v3, v3_mp2, tmp_path):
    """An unknown model_type is the same clear error in plan, convert, merge and verify (verify used to
    build the DeepSeek model and fail on a missing field), listing what is supported."""
    for name in ("src", "mp"):
        (tmp_path / name).mkdir()
    for p in tiny_v3.iterdir():
        (tmp_path / "src" / p.name).symlink_to(p)
    for p in v3_mp2.iterdir():
        if p.name != "ckpttool-manifest.json":  # the edited config.json would be refused by it, before its model_type
            (tmp_path / "mp" / p.name).symlink_to(p)
    for d in ("src", "mp"):
        config = json.loads((tmp_path / d / "config.json").read_text())
        (tmp_path / d / "config.json").unlink()
        (tmp_path / d / "config.json").write_text(json.dumps({**config, "model_type": "foo9"}))
    for args in (("plan", tmp_path / "src"), ("convert", tmp_path / "src", tmp_path / "o1", "--mp", "2"),
                 ("merge", tmp_path / "mp", tmp_path / "o2"), ("verify", tmp_path / "mp", "--prompt-ids", "1,2")):
        proc = run_cli(*args, check=False)
        assert proc.returncode == 1, (args, proc.stderr)
        assert "unsupported model_type 'foo9'" in proc.stderr and ", ".join(MODEL_TYPES) in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_the_recipe_schema_reads_the_same_table(tmp_path):
    assert {"kimi_k2", "deepseek_v3", "llama", "gpt_oss"} <= set(MODEL_TYPES)
    for model_type in MODEL_TYPES:  # every model_type the planner reads is a valid `arch:`
        assert validate_recipe({"name": "x", "arch": model_type, "stages": [{"dequant": {}}]}).arch == model_type
        assert model_type in family_for({"model_type": model_type}).model_types
    with pytest.raises(RecipeError, match="kimi_k2"):  # the refusal lists the table's types
        validate_recipe({"name": "x", "arch": "kimi_k3", "stages": [{"dequant": {}}]})
    with pytest.raises(InputError, match="unsupported model_type"):
        family_for({"model_type": "kimi_k3"})


@pytest.mark.parametrize("stages, needle", [
    ([{"merge": {}}, {"shard": {"mp": 2}}], "takes no other stage"),
    ([{"dequant": {}}, {"merge": {}}], "takes no other stage"),
    ([{"merge": {"max_shard_size": "lots"}}], "stages.0.merge.max_shard_size"),
])
def test_merge_stage_is_validated(stages, needle):
    with pytest.raises(RecipeError, match=needle):
        validate_recipe({"name": "x", "stages": stages})


def test_one_source_of_defaults(tmp_path):
    """`run RECIPE` and the commands' presets resolve to the same execution settings."""
    recipe = load_recipe(REPO / "recipes" / "deepseek-v3-mp8-bf16.yaml")
    from_file = ExecOptions.from_recipe(recipe.execution)
    from_flags = ExecOptions.from_recipe(preset("convert", dequant=True, mp=8).execution)
    assert from_file.workers is from_flags.workers is ExecOptions().workers is None  # defaults.layout decides
    assert from_file.processes is from_flags.processes is ExecOptions().processes is None
    assert from_flags.max_memory == ExecOptions().max_memory == defaults.parse_size(defaults.MAX_MEMORY)
    assert from_file.device == from_flags.device == ExecOptions().device == defaults.DEVICE
    assert ExecOptions.from_recipe(preset("convert", workers=3).execution).workers == 3
    assert ExecOptions.from_recipe(preset("convert", processes=2).execution).processes == 2
    with pytest.raises(ValueError, match="as a size"):
        defaults.parse_size("1e400GiB")


def test_convert_verify_compares_with_the_input_where_it_fits(tiny_v3, tmp_path, monkeypatch):
    """`convert --verify` checks the output against the checkpoint it was converted from (transformers'
    model of it), and where loading that whole would not be safe here it says so instead."""
    from ckpttool import runner

    report = json.loads(run_cli("convert", tiny_v3, tmp_path / "a", "--mp", 2, "--verify", "--json").stdout)
    reference = report["verify"]["checks"]["reference"]
    assert report["ok"] and reference["ok"] and "against transformers" in reference["detail"], reference
    assert "verify_reference_skipped" not in report

    monkeypatch.setattr(runner, "REFERENCE_RAM_FRACTION", 1e-9)  # as if the input were far too large here
    report = json.loads(run_cli("convert", tiny_v3, tmp_path / "b", "--mp", 2, "--verify", "--json").stdout)
    assert report["ok"] and "reference" not in report["verify"]["checks"]
    assert "would load it whole in float32" in report["verify_reference_skipped"]


def test_verbose_shows_the_traceback_and_where_the_time_went(tiny_v3, tmp_path):
    """`ckpttool -v`: more words, only for that run (in-process callers after it see the plain form)."""
    loud = run_cli("-v", "convert", tiny_v3, tmp_path / "a", "--mp", 2)
    assert "  time: plan" in loud.stdout and "thread-seconds:" in loud.stdout
    quiet = run_cli("convert", tiny_v3, tmp_path / "b", "--mp", 2)
    assert "time: plan" not in quiet.stdout
    with pytest.raises(InputError):  # re-raised, so the traceback shows
        run_cli("-v", "convert", tmp_path / "missing", tmp_path / "c")
    plain = run_cli("convert", tmp_path / "missing", tmp_path / "c", check=False)
    assert plain.returncode == 1 and "Traceback" not in plain.stderr and "error: input directory does not exist" in plain.stderr
