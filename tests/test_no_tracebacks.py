"""Every error path of every command prints `error:` and `fix:` lines and exits 1 (2 for usage and
recipe errors), never a traceback: each command is run with a set of bad arguments and bad inputs,
in-process through main() (which must not fall back to its 'unexpected' catch-all for any of them)
and, for a sample, as the real executable."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import os
import time

import pytest

from ckpttool.io.layout import MANIFEST, PARTIAL_DIR
from conftest import run_cli, run_cli_process, wait_until_stopped

COMMANDS = ("download", "dequant", "shard", "convert", "run", "plan", "inspect", "verify", "merge", "demo")


@pytest.fixture(scope="module")
def bad(tiny_v3, tmp_path_factory):
    """A directory of hostile and careless inputs, built once."""
    root = tmp_path_factory.mktemp("bad")
    (root / "file").write_text("not a directory\n")
    (root / "empty").mkdir()

    def variant(name, edit):
        d = root / name
        shutil.copytree(tiny_v3, d)
        edit(d)
        return d

    def set_config(**fields):
        def edit(d):
            cfg = json.loads((d / "config.json").read_text())
            cfg.update(fields)
            (d / "config.json").write_text(json.dumps(cfg))
        return edit

    variant("list-model-type", set_config(model_type=["deepseek_v3"]))
    variant("list-hidden", set_config(hidden_size=[7168]))
    variant("huge-experts", set_config(n_routed_experts=100_000_000))
    variant("huge-layers", set_config(num_hidden_layers=100_000_000))
    variant("float-layers", set_config(num_hidden_layers=2.5))
    variant("config-not-json", lambda d: (d / "config.json").write_bytes(b"{\xff\xfe"))
    variant("config-deep", lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000))
    variant("index-not-json", lambda d: (d / "model.safetensors.index.json").write_text("{"))
    variant("truncated-shard", lambda d: os.truncate(d / "model-00002-of-00003.safetensors", 100))
    (root / "not-utf8.yaml").write_bytes(b"name: \xff\xfe\n")
    (root / "deep.yaml").write_text("x: " + "[" * 5000 + "]" * 5000 + "\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    mp = root / "mp2"
    run_cli("convert", tiny_v3, mp, "--mp", "2", "--quiet")
    bad_tok = root / "mp2-bad-tokenizer"
    shutil.copytree(mp, bad_tok)
    (bad_tok / "tokenizer_config.json").write_text('["not", "an object"]')
    bad_manifest = root / "mp2-bad-manifest"
    shutil.copytree(mp, bad_manifest)
    (bad_manifest / MANIFEST).write_text("{not json")
    list_manifest = root / "mp2-list-manifest"
    shutil.copytree(mp, list_manifest)
    (list_manifest / MANIFEST).write_text('{"files": ["a", "b"]}')
    return root


def _cases(bad, src):
    b = bad
    recipe = "recipes/deepseek-v3-bf16.yaml"
    return {
        "download": [["not a repo"], ["a/b/c"], ["org/x", "--max-workers", "0"], ["org/x", str(b / "file")]],
        "dequant": [[b / "nope", b / "o"], [b / "file", b / "o"], [b / "empty", b / "o"], [src, b / "file"],
                    [b / "list-model-type", b / "o"], [b / "list-hidden", b / "o"], [b / "config-not-json", b / "o"],
                    [b / "config-deep", b / "o"], [b / "index-not-json", b / "o"], [b / "truncated-shard", b / "o"],
                    [src, src], [src, src / "sub"]],
        "shard": [[src, b / "o", "--mp", "0"], [src, b / "o", "--mp", "3"], [src, b / "o", "--dtype", "int3"],
                  [b / "huge-experts", b / "o", "--mp", "2"], [b / "float-layers", b / "o", "--mp", "2"]],
        "convert": [[src, b / "o", "--max-memory", "1e400GiB"], [src, b / "o", "--max-memory", "foo"],
                    [src, b / "o", "--max-memory", "-1GiB"], [src, b / "o", "--max-memory", "9" * 400],
                    [src, b / "o", "--workers", "0"], [src, b / "o", "--device", "tpu"],
                    [b / "huge-layers", b / "o"], [b / "huge-experts", b / "o"],
                    [src, b / "mp2-bad-manifest", "--mp", "2", "--resume"], [src, b / "o", "--bogus"]],
        "run": [[b / "nope.yaml", "-i", src, "-o", b / "o"], [b / "not-utf8.yaml", "-i", src, "-o", b / "o"],
                [b / "deep.yaml", "-i", src, "-o", b / "o"], [b / "list.yaml", "-i", src, "-o", b / "o"],
                [recipe, "-i", src, "-o", b / "o", "--set", "foo"], [recipe, "-i", src, "-o", b / "o", "--set", "a=["],
                [recipe, "-i", src, "-o", b / "o", "--set", "execution.max_memory=1e400GiB"],
                [recipe, "-i", src, "-o", b / "o", "--set", "stages.0=x"], [recipe, "-i", b / "nope", "-o", b / "o"]],
        "plan": [[b / "nope"], [b / "huge-experts"], [src, "--mp", "5"], [b / "config-deep"]],
        "inspect": [[b / "nope"], [b / "file"], [b / "truncated-shard" / "model-00002-of-00003.safetensors"],
                    [b / "mp2-bad-manifest", "--check"], [b / "mp2-list-manifest", "--check"], [src, "--check"]],
        "verify": [[b / "nope"], [b / "empty"], [b / "mp2-bad-tokenizer", "--prompt", "hi"],
                   [b / "mp2", "--prompt-ids", "a,b"], [b / "mp2", "--mp", "3"]],
        "merge": [[src, b / "o"], [b / "mp2", b / "o", "--max-shard-size", "foo"],
                  [b / "mp2", b / "o", "--max-shard-size", "1e400GB"], [b / "mp2", b / "o", "--max-shard-size", "-1"],
                  [b / "nope", b / "o"]],
        "demo": [[b / "file"], [b / "o", "--preset", "nope"], [b / "o", "--mp", "0"]],
    }


def test_every_command_has_bad_cases(bad, tiny_v3):
    cases = _cases(bad, tiny_v3)
    assert set(cases) == set(COMMANDS) and all(len(v) >= 3 for v in cases.values())


@pytest.mark.parametrize("command", COMMANDS)
def test_bad_arguments_give_error_and_fix_never_a_traceback(bad, tiny_v3, command):
    for args in _cases(bad, tiny_v3)[command]:
        proc = run_cli(command, *args, check=False)
        shown = f"ckpttool {command} {' '.join(map(str, args))[:200]}\n{proc.stderr[-2000:]}"
        assert proc.returncode in (1, 2), shown
        assert proc.stderr.startswith("error: ") and "\n  fix: " in proc.stderr, shown
        assert "Traceback" not in proc.stderr and "error: unexpected" not in proc.stderr, shown
    assert not (bad / "o").exists() or not any((bad / "o").iterdir())
    assert not (tiny_v3 / "sub").exists()


def test_the_real_executable_prints_no_traceback_and_json_errors_parse(bad, tiny_v3):
    proc = run_cli_process("convert", bad / "huge-experts", bad / "o", "--json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "fix:" in proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False and "experts" in report["error"] and report["fix"] and report["exit_code"] == 1
    proc = run_cli_process("run", bad / "deep.yaml", "-i", tiny_v3, "-o", bad / "o")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    debug = run_cli_process("demo", bad / "file", env={"CKPTTOOL_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback" in debug.stderr  # the debug switch still shows it


def test_huge_config_counts_fail_fast(bad):
    started = time.monotonic()
    for name in ("huge-experts", "huge-layers"):
        proc = run_cli("plan", bad / name, check=False)
        assert proc.returncode == 1 and "cannot describe a checkpoint of" in proc.stderr
    assert time.monotonic() - started < 20


def test_ctrl_c_says_the_work_is_journalled_and_how_to_resume(tiny_v3, tmp_path):
    dst = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "ckpttool", "convert", str(tiny_v3), str(dst), "--mp", "2",
                             "--quiet", "--workers", "2", "--processes", "1"],
                            env={**os.environ, "CKPTTOOL_FAULT": "pwrite:20:stop"}, stderr=subprocess.PIPE, text=True,
                            # a shell's background job ignores SIGINT, and so would its children: a terminal's does not
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert wait_until_stopped(proc), "the conversion never reached its stop point"
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "--resume" in err and "journalled" in err
    assert (dst / PARTIAL_DIR).is_dir()
    run_cli("convert", tiny_v3, dst, "--mp", "2", "--quiet", "--resume")
    assert (dst / MANIFEST).exists() and not (dst / PARTIAL_DIR).exists()


def test_a_read_only_destination_is_an_error_with_a_fix(tiny_v3, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {proc.stderr.decode(errors='replace').strip()}")
    try:
        for dst in (ro / "out", ro / "a" / "b"):
            proc = run_cli_process("convert", tiny_v3, dst, "--mp", "2", "--quiet")
            assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
            assert "Read-only file system" in proc.stderr and "fix:" in proc.stderr
        proc = run_cli_process("merge", tiny_v3, ro / "m", "--quiet")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr and "fix:" in proc.stderr
    finally:
        subprocess.run(["umount", str(ro)], check=False)
