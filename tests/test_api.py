"""The Python API (ckpttool/api.py, exported by the package): README's example runs as written, each function
writes the bytes its command writes, bad arguments raise a CkptError naming the fix, and importing the package
loads none of it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckpttool
from conftest import REPO, run_cli
from ckpttool.errors import CkptError, RecipeError


def readme_example() -> str:
    text = (REPO / "README.md").read_text()
    found = re.search(r"<!-- api-example -->\n```python\n(.*?)```\n<!-- /api-example -->", text, re.S)
    assert found, "README.md lost its <!-- api-example --> block"
    return found.group(1)


def outputs(path: Path) -> dict[str, bytes]:
    """What a run published, less the manifest (it names its own destination)."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "ckpttool-manifest.json"}


def test_the_readme_example_runs_and_writes_what_the_commands_write(tiny_v3, tmp_path, monkeypatch, capsys):
    shutil.copytree(tiny_v3, tmp_path / "my-model")
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_example(), "README.md api-example", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"2 files, \d+ bytes of disk", printed[0]), printed
    assert re.fullmatch(r"\d+ bytes in \d+\.\d s", printed[1]), printed
    assert "not divisible by mp=3" in printed[2] and printed[3].startswith("  fix: "), printed  # the error, its fix
    assert not (tmp_path / "my-model-mp3").exists()

    run_cli("convert", tmp_path / "my-model", tmp_path / "cli-mp2", "--mp", 2, "--quiet")
    run_cli("merge", tmp_path / "cli-mp2", tmp_path / "cli-hf", "--quiet")
    assert outputs(tmp_path / "my-model-mp2") == outputs(tmp_path / "cli-mp2")
    assert outputs(tmp_path / "my-model-hf") == outputs(tmp_path / "cli-hf")
    assert sorted(n for n in outputs(tmp_path / "my-model-mp2") if n.endswith(".safetensors")) == \
        ["model0-mp2.safetensors", "model1-mp2.safetensors"]


def test_each_function_writes_the_bytes_of_its_command(tiny_v3_no_mtp, tmp_path):
    report = ckpttool.dequant(tiny_v3_no_mtp, tmp_path / "api-bf16")
    run_cli("dequant", tiny_v3_no_mtp, tmp_path / "cli-bf16", "--quiet")
    assert outputs(tmp_path / "api-bf16") == outputs(tmp_path / "cli-bf16")
    assert report.result.bytes_written > 0 and report.ok

    ckpttool.shard(tiny_v3_no_mtp, tmp_path / "api-fp8", mp=2)
    run_cli("shard", tiny_v3_no_mtp, tmp_path / "cli-fp8", "--mp", 2, "--quiet")
    assert outputs(tmp_path / "api-fp8") == outputs(tmp_path / "cli-fp8")

    ckpttool.run_recipe("deepseek-v3-mp8-bf16", tiny_v3_no_mtp, tmp_path / "api-recipe", overrides=["shard.mp=2"])
    run_cli("run", "deepseek-v3-mp8-bf16", "-i", tiny_v3_no_mtp, "-o", tmp_path / "cli-recipe", "--set", "shard.mp=2",
            "--quiet")
    assert outputs(tmp_path / "api-recipe") == outputs(tmp_path / "cli-recipe")

    planned = ckpttool.plan_report(tiny_v3_no_mtp, mp=2)
    assert [f["name"] for f in planned["files"]] == ["model0-mp2.safetensors", "model1-mp2.safetensors"]
    assert planned["plan_hash"] == run_cli_json_plan_hash(tiny_v3_no_mtp)


def run_cli_json_plan_hash(src: Path) -> str:
    import json

    return json.loads(run_cli("plan", src, "--mp", 2, "--json").stdout)["plan_hash"]


def test_bad_arguments_raise_a_ckpt_error_with_its_fix(tiny_v3_no_mtp, tmp_path):
    with pytest.raises(RecipeError, match="verify") as raised:
        ckpttool.convert(tiny_v3_no_mtp, tmp_path / "out", verify=True)
    assert raised.value.fix == "pass mp=N"
    with pytest.raises(RecipeError) as raised:
        ckpttool.convert(tiny_v3_no_mtp, tmp_path / "out", dtype="int3")
    assert "dtype" in raised.value.fix
    with pytest.raises(CkptError):
        ckpttool.convert(tmp_path / "no-such-model", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        ckpttool.nothing  # noqa: B018


def test_every_exported_name_is_what_its_module_defines():
    """Not shadowed by a subpackage of the same name (once imported, ckpttool.plan is the package, not a function)."""
    import ckpttool.api
    import ckpttool.plan  # noqa: F401
    import ckpttool.runner

    modules = {"api": ckpttool.api, "runner": ckpttool.runner, "errors": sys.modules["ckpttool.errors"]}
    for name, module in ckpttool._API.items():
        assert getattr(ckpttool, name) is getattr(modules[module], name), name
    assert set(ckpttool.__all__) == set(ckpttool._API) | {"__version__"}
    assert not {name for name in ckpttool._API if (REPO / "ckpttool" / name).is_dir()
                or (REPO / "ckpttool" / f"{name}.py").is_file()}


def test_importing_the_package_loads_no_command():
    code = ("import sys, ckpttool; loaded = sorted(m for m in sys.modules if m.startswith('ckpttool'));"
            "assert loaded == ['ckpttool', 'ckpttool.version'], loaded; print(ckpttool.__version__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ckpttool.__version__
