"""Shared fixtures: tiny real checkpoints (built once per session) and the reference seeds."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpttool.families.deepseek.demo import build_checkpoint

REPO = Path(__file__).resolve().parents[1]
# the reference scripts sit in ../shared beside the checkout (CI, developers); machines that only get
# the checkout (the GPU machine) point CKPTTOOL_SEEDS at a copy
SEEDS = Path(os.environ.get("CKPTTOOL_SEEDS", REPO.parent / "shared" / "seeds" / "deepseek_v3_inference"))
SEEDS_MISSING = (f"needs DeepSeek's reference scripts (convert.py, kernel.py), not found in {SEEDS}: copy the "
                 "`inference/` folder of github.com/deepseek-ai/DeepSeek-V3 (e.g. to .seeds/, git-ignored) and "
                 "set CKPTTOOL_SEEDS to it")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the marks
def pytest_collection_modifyitems(config, items) -> None:
    """Mark the tests tests/slow.py lists `slow`; and keep the gpu and engines tiers out of any run whose -m does not
    name them (a `-m "not slow"` replaces pyproject's `-m 'not gpu and not engines'` rather than adding to it)."""
    from slow import category

    for item in items:
        if category(item.nodeid) is not None:
            item.add_marker(pytest.mark.slow)
    expression = config.getoption("markexpr") or ""
    tiers = [tier for tier in ("gpu", "engines") if tier not in expression]
    kept = [item for item in items if not any(item.get_closest_marker(tier) for tier in tiers)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def require_seeds() -> Path:
    """SEEDS, or skip the calling test with a reason that says how to get them (a plain clone has no
    ../shared; CI and developers do, so there nothing is skipped)."""
    if not (SEEDS / "convert.py").is_file():
        pytest.skip(SEEDS_MISSING)
    return SEEDS


@pytest.fixture(params=["c", "numba", "numpy"])
def cpu_kernels(request, monkeypatch) -> str:
    """Each form of the CPU dequant's compiled loops in turn (kernels/fp8_gather.py): C (CKPTTOOL_NATIVE),
    numba with C off, numpy with both off. C is skipped where setup.py found no compiler at install, numba
    where it is not installed; CI has both."""
    from ckpttool.kernels import native

    monkeypatch.setenv("CKPTTOOL_NATIVE", "1" if request.param == "c" else "0")
    monkeypatch.setenv("CKPTTOOL_NUMBA", "1" if request.param == "numba" else "0")
    if request.param == "c" and native.library() is None:
        pytest.skip("the C kernels were not built: setup.py found no C compiler at install")
    if request.param == "numba":
        pytest.importorskip("numba")
    return request.param


@pytest.fixture(scope="session")
def tiny_v3(tmp_path_factory) -> Path:
    """FP8 DeepSeek-V3 layout with one MTP layer, scales beside their weights."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-v3", "tiny-v3")


@pytest.fixture(scope="session")
def tiny_v3_no_mtp(tmp_path_factory) -> Path:
    """Like tiny_v3 without MTP and with every scale in the last shard, away from its weight."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-v3-no-mtp", "tiny-v3", seed=1,
                            overrides={"num_nextn_predict_layers": 0}, scales_in_last_file=True)


@pytest.fixture(scope="session")
def tiny_v2_lite(tmp_path_factory) -> Path:
    """BF16 DeepSeek-V2-Lite layout (no q_lora, softmax gate, no correction bias)."""
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-v2-lite", "tiny-v2-lite", seed=2)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny LlamaForCausalLM saved by transformers (GQA: 4 heads, 2 KV heads); see dense_models.py."""
    from dense_models import build_hf

    return build_hf("llama", tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    """A tiny Qwen2ForCausalLM saved by transformers (q/k/v biases, one KV head, tied embeddings)."""
    from dense_models import build_hf

    return build_hf("qwen2", tmp_path_factory.mktemp("ckpt") / "tiny-qwen2")


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory) -> Path:
    """gpt-oss as published: MXFP4 expert blocks/scales (u8) beside BF16 attention, router and norms."""
    from ckpttool.families.gpt_oss.demo import build_gpt_oss_checkpoint

    return build_gpt_oss_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-gpt-oss", mxfp4=True, seed=7)


@pytest.fixture
def src(tiny_v3, tmp_path) -> Path:
    """A private copy of tiny_v3, for tests that change, bind-mount or symlink their input."""
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(tiny_v3, copy)
    return copy


def wait_until_stopped(proc, timeout: float = 120) -> bool:
    """Whether `proc` reached a stopped state (a CKPTTOOL_FAULT `stop` point) within `timeout` s."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "T":
                return True
        time.sleep(0.05)
    return False


def run_cli(*args: object, check: bool = True) -> subprocess.CompletedProcess:
    """The CLI in-process (fast): real argument parsing, real exit code, captured stdout/stderr."""
    from ckpttool.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    proc = subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
    if check and code != 0:
        raise AssertionError(f"ckpttool {' '.join(map(str, args))} exited {code}\n{proc.stderr}")
    return proc


def run_cli_process(*args: object, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The real console entry point in a subprocess: for exit codes and tracebacks as users see them."""
    return subprocess.run([sys.executable, "-m", "ckpttool", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cli(*args: object, env: dict | None = None) -> subprocess.Popen:
    """The console entry point in a subprocess left running: to hold it at a CKPTTOOL_FAULT stop point, signal it,
    watch it; `finish` collects it."""
    return subprocess.Popen([sys.executable, "-m", "ckpttool", *map(str, args)], env={**os.environ, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    """Wait for a `start_cli` process (let go with SIGCONT where it was held): its exit code and output."""
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_cuda_convert_equals_cpu(src: Path, tmp_path: Path) -> None:
    """dequant of `src` to HF and to mp 2 on CUDA (4 KB chunks through 3 workers, none left to the CPU while CUDA
    starts) writes the CPU's bytes, file for file."""
    from ckpttool.plan.build import Spec
    from ckpttool.runner import ExecOptions, convert

    for spec, name in ((Spec(dequant=True), "hf"), (Spec(dequant=True, mp=2), "mp2")):
        convert(src, tmp_path / f"cpu-{name}", spec, ExecOptions(quiet=True, device="cpu"))
        gpu = convert(src, tmp_path / f"gpu-{name}", spec, ExecOptions(quiet=True, device="cuda", chunk_bytes=4096,
                                                                        workers=3, wait_for_cuda=True))
        counts = gpu.timings.to_json()["counts"]
        assert counts.get("chunks_on_gpu", 0) > 0 and "chunks_on_cpu_while_cuda_started" not in counts, counts
        for f in (tmp_path / f"cpu-{name}").iterdir():
            assert f.read_bytes() == (tmp_path / f"gpu-{name}" / f.name).read_bytes(), (name, f.name)


def load_dir(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{file name: {tensor name: tensor}} for every safetensors file in a directory."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out[f.name] = {k: h.get_tensor(k) for k in h.keys()}
    return out


def assert_same_tensors(ours: dict, ref: dict) -> None:
    """Key for key, dtype for dtype, bit for bit."""
    assert sorted(ours) == sorted(ref), f"files differ: {sorted(ours)} vs {sorted(ref)}"
    for fname in ref:
        assert sorted(ours[fname]) == sorted(ref[fname]), f"keys differ in {fname}: " \
            f"{sorted(set(ours[fname]) ^ set(ref[fname]))[:5]}"
        for key, r in ref[fname].items():
            o = ours[fname][key]
            assert o.dtype == r.dtype and o.shape == r.shape, f"{fname}:{key} {o.dtype}{list(o.shape)} vs {r.dtype}{list(r.shape)}"
            assert torch.equal(o.contiguous().view(torch.uint8), r.contiguous().view(torch.uint8)), f"{fname}:{key} bits differ"
