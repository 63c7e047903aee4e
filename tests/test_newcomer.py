"""What a new user meets first: a plain clone's tests, the CLI's help and flags, the torch-free core."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_reference_script_tests_skip_with_how_to_get_them_when_seeds_are_absent(tmp_path):
    """A plain clone has no ../shared: the tests that need DeepSeek's scripts skip and say why."""
    env = {**os.environ, "CKPTTOOL_SEEDS": str(tmp_path / "no-seeds")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/test_convert.py::test_shard_keeps_fp8_with_split_scales_like_reference"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "1 skipped" in proc.stdout and "CKPTTOOL_SEEDS" in proc.stdout and "inference/" in proc.stdout, \
        proc.stdout[-2000:]


def test_numpy_fp8_quantize_is_torch_bit_for_bit():
    """The demo builder's numpy FP8 (no torch in the core install) against kernels.fp8's torch one,
    on random weights over many magnitudes, exact ties between FP8 values, subnormals and zeros."""
    import numpy as np
    import torch

    from ckpttool.families.demo_files import fp8_e4m3, quantize_fp8_block as quantize_np
    from ckpttool.kernels.fp8 import quantize_fp8_block

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes)].unique()
    ties = (finite[:-1] + finite[1:]) / 2  # halfway between neighbours: round half to even
    x = torch.cat([finite, ties, -ties, torch.linspace(-448, 448, 100_001)])
    assert np.array_equal(fp8_e4m3(x.numpy()), x.to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    g = torch.Generator().manual_seed(0)
    for rows, cols, scale in [(300, 200, 1e-3), (128, 128, 10.0), (5, 700, 1e-6), (256, 384, 1.0)]:
        w = torch.randn(rows, cols, generator=g) * scale
        w[:3, :130] = 0  # an all-zero block gets scale 1.0
        q, s = quantize_fp8_block(w)
        qn, sn = quantize_np(w.numpy())
        assert np.array_equal(qn.data, q.view(torch.uint8).numpy()) and np.array_equal(sn.data, s.numpy())


NO_TORCH = ("import importlib.abc, sys\n"
            "class NoTorch(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'transformers', 'triton'):\n"
            "            raise ModuleNotFoundError('no ' + name + ' in the core install', name=name)\n"
            "sys.meta_path.insert(0, NoTorch())\n"
            "from ckpttool.cli import main\n")


def _without_torch(*commands: list) -> subprocess.CompletedProcess:
    """Each command through main() in one interpreter where torch cannot be imported; exit: the
    return codes as a string ("0 0 1")."""
    code = NO_TORCH + f"codes = [main([str(a) for a in c]) for c in {[list(map(str, c)) for c in commands]!r}]\n"
    code += "print('codes:', *codes)\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_core_commands_run_without_torch(tmp_path):
    """The core install has no torch: demo (numpy FP8), inspect, plan, dequant, shard and merge run."""
    hf, mp = tmp_path / "tiny-v3-hf", tmp_path / "tiny-v3-mp2-bf16"
    proc = _without_torch(["demo", tmp_path, "-q"], ["inspect", mp, "--check"], ["plan", hf, "--mp", "2"],
                          ["dequant", hf, tmp_path / "bf16", "-q"], ["shard", hf, tmp_path / "fp8", "--mp", "2", "-q"],
                          ["merge", tmp_path / "fp8", tmp_path / "merged", "-q"], ["inspect", tmp_path / "merged"])
    assert "codes: 0 0 0 0 0 0 0" in proc.stdout, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert "converted to" in proc.stdout and "intact" in proc.stdout


def test_what_needs_torch_says_which_extra_brings_it(tiny_llama, tmp_path):
    hf, mp = tmp_path / "tiny-v3-hf", tmp_path / "tiny-v3-mp2-bf16"
    recipe = tmp_path / "q.yaml"
    recipe.write_text("name: q\nstages:\n  - quantize: {format: fp8_block}\n")
    proc = _without_torch(["demo", tmp_path, "-q"], ["verify", mp], ["convert", hf, tmp_path / "v", "--mp", "2", "--verify"],
                          ["run", recipe, "-i", tiny_llama, "-o", tmp_path / "q"])
    assert "codes: 0 1 1 1" in proc.stdout, proc.stdout[-1000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for extra in ("ckpttool[verify]", "ckpttool[quantize]"):
        assert extra in proc.stderr, proc.stderr


def test_dequant_keeps_mtp_by_default_and_mp_outputs_drop_it(tiny_v3, tmp_path):
    import json

    from conftest import run_cli

    def mtp_in(out):
        names = json.loads(run_cli("inspect", out, "--json", "--tensors").stdout)["all"]
        config = json.loads((out / "config.json").read_text())
        return config["num_nextn_predict_layers"], any("layers.3." in n.split(":")[-1] for n in names)

    run_cli("dequant", tiny_v3, tmp_path / "hf", "--quiet")
    assert mtp_in(tmp_path / "hf") == (1, True)
    run_cli("dequant", tiny_v3, tmp_path / "hf-drop", "--drop-mtp", "--quiet")
    assert mtp_in(tmp_path / "hf-drop") == (0, False)
    run_cli("convert", tiny_v3, tmp_path / "mp", "--mp", 2, "--quiet")
    assert mtp_in(tmp_path / "mp") == (0, False)
    run_cli("convert", tiny_v3, tmp_path / "mp-keep", "--mp", 2, "--keep-mtp", "--quiet")
    assert mtp_in(tmp_path / "mp-keep") == (1, True)


def test_plan_previews_what_convert_writes(tiny_v3, tmp_path):
    """`plan` takes convert's flags with convert's defaults: the same plan as `convert --dry-run`."""
    import json

    from conftest import run_cli

    for flags in ([], ["--mp", "2"], ["--mp", "2", "--dtype", "fp8"], ["--keep-mtp"], ["--mp", "4", "--drop-mtp"]):
        planned = json.loads(run_cli("plan", tiny_v3, *flags, "--json").stdout)
        dry = json.loads(run_cli("convert", tiny_v3, tmp_path / "o", *flags, "--dry-run", "--json").stdout)
        assert planned["plan_hash"] == dry["plan_hash"], flags
        assert planned["files"] == dry["files"], flags


def test_bundled_recipe_by_name_runs_and_a_missing_one_lists_them(tiny_v3, tmp_path, monkeypatch):
    from conftest import run_cli

    monkeypatch.chdir(tmp_path)  # no recipes/ here: the package's own copy is found by name
    run_cli("run", "deepseek-v3-mp8-bf16", "-i", tiny_v3, "-o", tmp_path / "o", "--set", "shard.mp=2", "--quiet")
    assert sorted(p.name for p in (tmp_path / "o").glob("*.safetensors")) == ["model0-mp2.safetensors",
                                                                              "model1-mp2.safetensors"]
    proc = run_cli("run", "deepseek-v3-mp8-bf61", "-i", tiny_v3, "-o", tmp_path / "o2", check=False)
    assert proc.returncode != 0 and "no bundled recipe" in proc.stderr and "deepseek-v3-mp8-bf16" in proc.stderr


def test_built_wheel_ships_the_bundled_recipes(tmp_path):
    import zipfile

    import importlib.util

    # build with the installed setuptools where there is one (fast, offline); a fresh venv of Python
    # 3.12+ has none, and pip fetches it into an isolated build environment
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("ckpttool-*.whl"))).namelist()
    shipped = {n.split("/")[-1] for n in names if n.startswith("ckpttool/recipes/")}
    assert shipped == {p.name for p in (REPO / "ckpttool" / "recipes").glob("*.yaml")} and shipped


def test_sdist_carries_its_tests_and_their_helpers_and_they_run(tmp_path):
    """An sdist is a source release: unpacked, its tests (conftest, hub server, model builders, engines harness
    included) collect and run against the code beside them, and it carries the LICENSE its metadata names."""
    import tarfile

    proc = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; "
                           f"print(build_meta.build_sdist({str(tmp_path)!r}))"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with tarfile.open(tmp_path / proc.stdout.split()[-1]) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    tree = next((tmp_path / "x").iterdir())
    for helper in ("conftest.py", "hub_server.py", "dense_models.py", "engine_cases.py", "quant_builders.py",
                   "reference_pipeline.py", "engines/vllm_generate.py", "engines/llama_cpp_generate.py"):
        assert (tree / "tests" / helper).is_file(), helper
    assert (tree / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]
    meta = (tree / "PKG-INFO").read_text()
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([sys.executable, "-c", "import ckpttool; print(ckpttool.__file__)"], cwd=tree, env=env,
                           capture_output=True, text=True)
    assert Path(where.stdout.strip()).is_relative_to(tree), where  # the unpacked code, not this checkout's
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only"],
                               cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert collected.returncode == 0 and " error" not in collected.stdout, collected.stdout[-3000:]
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_layers.py",
                          "tests/test_recipes.py", "tests/test_download.py::test_download_help_shows_an_example"],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0 and " passed" in ran.stdout and "failed" not in ran.stdout, ran.stdout[-3000:]


def test_a_wheel_without_the_c_loops_is_pure_correct_and_says_so(tiny_v3_no_mtp, tmp_path):
    """CKPTTOOL_BUILD_NATIVE=0 builds the wheel that installs anywhere (py3-none-any, no compiled file): its
    conversions are byte-identical, and a run on numpy's loops says so."""
    import zipfile

    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp_path),
                           str(REPO)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CKPTTOOL_BUILD_NATIVE": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = next(tmp_path.glob("ckpttool-*.whl"))
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.endswith((".so", ".pyd", ".dylib"))] and any(n.endswith("licenses/LICENSE") for n in names)
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "CKPTTOOL_NUMBA": "0"}
    env.pop("CKPTTOOL_NATIVE", None)
    code = ("import ckpttool, sys; assert ckpttool.__file__.startswith(sys.argv[1]), ckpttool.__file__; "
            "from ckpttool.cli import main; sys.exit(main(sys.argv[2:]))")
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site"), "convert", str(tiny_v3_no_mtp),
                          str(tmp_path / "pure"), "--mp", "2", "--device", "cpu", "--json"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert any("numpy's loops" in w for w in json.loads(run.stdout)["warnings"])
    from conftest import run_cli

    run_cli("convert", tiny_v3_no_mtp, tmp_path / "here", "--mp", 2, "--device", "cpu", "--quiet")
    for name in ("model0-mp2.safetensors", "model1-mp2.safetensors"):
        assert (tmp_path / "pure" / name).read_bytes() == (tmp_path / "here" / name).read_bytes()


def test_run_input_that_is_a_missing_local_path_is_not_taken_for_a_hub_id(tiny_v3, tmp_path, monkeypatch):
    from conftest import run_cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "some").mkdir()  # `some/` exists here, so `some/typo` is a mistyped local path
    recipe = REPO / "recipes" / "deepseek-v3-mp8-bf16.yaml"
    for missing in ("some/typo", "./typo", str(tmp_path / "a" / "b"), "typo"):
        proc = run_cli("run", recipe, "-i", missing, "-o", tmp_path / "o", check=False)
        assert proc.returncode != 0, missing
        assert "input directory does not exist" in proc.stderr and "hub" not in proc.stderr.split("fix:")[0], \
            (missing, proc.stderr)


def test_progress_is_plain_periodic_lines_when_stderr_is_not_a_terminal(tiny_v3, tmp_path):
    import io

    from ckpttool.progress import Progress
    from conftest import run_cli

    stream = io.StringIO()
    with Progress(3_000_000, "converting", stream=stream, interval=0) as progress:
        for _ in range(3):
            progress.advance(1_000_000)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("converting: 1.0 MB / 3.0 MB (33%), ") and "/s, ETA 0:00:" in lines[0], lines
    assert lines[-1].startswith("converting: 3.0 MB / 3.0 MB (100%)") and ", in 0:00:" in lines[-1], lines
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()  # no bar redraws, no colours
    err = run_cli("convert", tiny_v3, tmp_path / "o", "--mp", 2).stderr  # captured: not a terminal
    assert "(100%)" in err and "\x1b" not in err, err


def test_typo_inside_a_stage_is_the_unknown_key_and_flag_errors_name_the_flag(tiny_v3, tmp_path):
    from conftest import run_cli

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\nstages:\n  - shard:\n      mpp: 8\n")
    err = run_cli("run", recipe, "-i", tiny_v3, "-o", tmp_path / "o", check=False).stderr
    assert "r.yaml:4: stages.0.shard.mpp: unknown key" in err and "Field required" not in err, err
    for args, flag in ((["convert", "--max-memory", "1KB"], "--max-memory"), (["convert", "--device", "gpu"], "--device"),
                       (["shard", "--mp", "5000"], "--mp"), (["convert", "--workers", "999"], "--workers")):
        cmd, *rest = args
        err = run_cli(cmd, tiny_v3, tmp_path / "o", *rest, check=False).stderr
        assert f"ckpttool {cmd}: {flag}: " in err and "stages." not in err and "execution." not in err, (args, err)


def test_sharding_or_dequantizing_our_int4_output_is_a_clear_refusal(tiny_llama, tmp_path):
    from conftest import run_cli

    recipe = tmp_path / "q.yaml"
    recipe.write_text("name: q\nstages:\n  - quantize: {format: int4, group_size: 32}\n")
    run_cli("run", recipe, "-i", tiny_llama, "-o", tmp_path / "int4", "--quiet")
    for args in (["shard", "--mp", "2"], ["dequant"], ["convert", "--mp", "2"]):
        cmd, *rest = args
        proc = run_cli(cmd, tmp_path / "int4", tmp_path / "o", *rest, check=False)
        assert proc.returncode != 0 and "ckpttool's int4 output" in proc.stderr, (args, proc.stderr)
        assert "does not belong" not in proc.stderr and "quantized from" in proc.stderr


def test_every_command_help_renders_with_an_example_and_a_one_line_summary():
    from ckpttool.cli.app import COMMANDS
    from conftest import run_cli

    top = run_cli("--help").stdout
    for name, command in COMMANDS:
        assert f" {name} " in top, name
        summary = (command.__doc__ or "").split("\n\n")[0]
        assert summary.strip() and "\n" not in summary.strip(), f"{name}: the summary `--help` lists must be one line"
        for flag in ("--help", "-h"):
            proc = run_cli(name, flag)
            assert proc.returncode == 0 and f"Usage: ckpttool {name}" in proc.stdout, (name, flag, proc.stderr)
            assert f"Example: ckpttool {name} " in proc.stdout, (name, proc.stdout)
    assert "Example: ckpttool " in top and run_cli("-h").stdout == top


def test_version_flag():
    import ckpttool
    from conftest import run_cli

    for flag in ("--version", "-V"):
        assert run_cli(flag).stdout.strip() == f"ckpttool {ckpttool.__version__}"


def test_demo_refuses_a_used_directory_without_suggesting_a_flag_it_lacks(tmp_path):
    from conftest import run_cli

    run_cli("demo", tmp_path, "--quiet")
    proc = run_cli("demo", tmp_path, check=False)
    assert proc.returncode != 0 and "--overwrite" not in proc.stderr and "ckpttool demo ./" in proc.stderr
    assert "--overwrite" not in run_cli("demo", "--help").stdout


def test_numpy_safetensors_writer_is_safetensors_byte_for_byte(tmp_path):
    """The demo's torch-free writer lays files out exactly as safetensors.torch.save_file does."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from ckpttool.families.demo_files import Array, bf16, quantize_fp8_block, save_arrays

    g = np.random.default_rng(3)
    w = g.standard_normal((200, 130), dtype=np.float32)
    q, s = quantize_fp8_block(w)
    ours = {"b.weight": q, "b.weight_scale_inv": s, "a.norm": bf16(w[0]), "c.bias": Array("F32", w[1, :7].copy())}
    save_arrays(ours, tmp_path / "ours.safetensors", {"format": "pt"})
    carrier = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32}
    theirs = {n: torch.from_numpy(a.data.copy()).view(carrier[a.dtype]) for n, a in ours.items()}
    save_file(theirs, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()


def test_convert_verify_prints_what_it_checked(tiny_v3, tmp_path):
    from conftest import run_cli

    out = run_cli("convert", tiny_v3, tmp_path / "o", "--mp", 2, "--verify").stdout
    for check in ("load", "finite", "generate"):
        assert f"PASS  {check}" in out, out
    assert out.rstrip().endswith("OK"), out


def test_convert_verify_without_a_tokenizer_says_so_before_converting_and_takes_prompt_ids(tiny_llama, tmp_path):
    """A checkpoint without tokenizer.json: refused before anything is written, with a fix convert takes."""
    from conftest import run_cli

    assert not (tiny_llama / "tokenizer.json").exists()
    proc = run_cli("convert", tiny_llama, tmp_path / "o", "--mp", 2, "--verify", check=False)
    assert proc.returncode == 2 and "no tokenizer.json" in proc.stderr and "--prompt-ids 0,5,9" in proc.stderr, \
        proc.stderr
    assert not (tmp_path / "o").exists()
    assert "--prompt-ids" in run_cli("convert", "--help").stdout
    out = run_cli("convert", tiny_llama, tmp_path / "o", "--mp", 2, "--verify", "--prompt-ids", "3,17,42").stdout
    assert "PASS  generate" in out and out.rstrip().endswith("OK"), out
    proc = run_cli("convert", tiny_llama, tmp_path / "o2", "--mp", 2, "--prompt-ids", "3", check=False)
    assert proc.returncode == 2 and "add --verify" in proc.stderr


def test_bare_ckpttool_prints_the_help_and_no_empty_error():
    from conftest import run_cli_process

    proc = run_cli_process()
    assert proc.returncode == 0 and "Usage: ckpttool" in proc.stdout and "Commands" in proc.stdout, proc
    assert "error" not in proc.stderr and proc.stderr.strip() == "", proc.stderr


def test_every_command_takes_quiet_and_every_reporting_one_json(tiny_v3, tmp_path):
    """README: every command accepts --quiet / -q (no progress output; errors still printed)."""
    from ckpttool.cli.app import COMMANDS
    from conftest import run_cli

    for name, _ in COMMANDS:
        help_text = run_cli(name, "--help").stdout
        assert "--quiet" in help_text and "-q" in help_text, name
        if name != "demo":
            assert "--json" in help_text, name
    run_cli("convert", tiny_v3, tmp_path / "o", "--mp", 2, "-q")
    assert run_cli("plan", tiny_v3, "--mp", 2, "-q").stdout.startswith("plan ")  # the plan is the report
    checked = run_cli("inspect", tmp_path / "o", "--check", "-q").stdout
    assert checked.startswith("intact: ") and " ok " not in checked, checked  # only failures and the verdict
    (tmp_path / "o" / "model1-mp2.safetensors").write_bytes(b"x")
    damaged = run_cli("inspect", tmp_path / "o", "--check", "-q", check=False)
    assert damaged.returncode == 1 and damaged.stdout.splitlines()[0].startswith("  BAD model1-mp2"), damaged.stdout
    assert "model0-mp2" not in damaged.stdout
