"""The engines tier (`pytest -m engines`, after scripts/install_engines.sh): vLLM's CPU build and llama.cpp
load ckpttool's HF outputs and generate exactly transformers' greedy ids, in float32, from the same files.

Every case (tests/engine_cases.py) is prepared once; each engine then runs all of them in one subprocess
of the engines venv (tests/engines/*_generate.py), since starting an engine is the slow part. A case an
engine cannot run here is skipped only when the engine's own error is the known limitation (KNOWN_LIMITS),
and the skip says so. The run writes tests/engines/report.json, which scripts/engines_table.py renders
into the README's Engines table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO
from dense_models import NEW_TOKENS, PROMPT

pytestmark = pytest.mark.engines

VENV = Path(os.environ.get("CKPTTOOL_ENGINES_VENV", REPO / ".venv-engines"))
PYTHON = VENV / "bin" / "python"
HERE = REPO / "tests" / "engines"
REPORT = HERE / "report.json"
ENGINES = ("vllm", "llama.cpp")

VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: no second import of vLLM
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the default takes a share of the machine's memory
    # MLA's CPU path needs kv_lora_rank 512 (DeepSeek-V3's own); the tiny model's is 128
    "VLLM_MLA_DISABLE": "1",
}
VLLM_OPTIONS = {
    # vLLM's CPU rotary kernel gives wrong tokens, silently, on DeepSeek's strided q/k slices: the native op
    "deepseek_v3": {"compilation_config": {"custom_ops": ["-rotary_embedding"]}},
}
WORKAROUNDS = {
    ("llama.cpp", "*"): "KV cache in f32 (`type_k`/`type_v`; its f16 default flips near-ties); "
                        "a byte-level vocabulary for the token-less tiny models (llama_cpp_generate.py)",
    ("vllm", "deepseek_v3"): "`VLLM_MLA_DISABLE=1` (MLA on CPU needs kv_lora_rank 512); "
                             "`compilation_config={\"custom_ops\": [\"-rotary_embedding\"]}`",
}
KNOWN_LIMITS = {
    # (engine, model_type): (pattern the engine's error or traceback must match, why it cannot run here)
    ("vllm", "llama"): (r"float32 is not supported for quantization method fp8",
                        "vLLM's FP8 linear layers refuse float32 activations"),
    ("vllm", "minimax_m2"): (r'cpu_router\.py.*\n.*assert self\.scoring_func == "softmax"',
                             "vLLM 0.32's CPU MoE router scores sigmoid only with grouped top-k "
                             "(cpu_router.py asserts softmax), and MiniMax-M2 routes sigmoid without groups"),
}
FALLBACK_DTYPE = {"llama": "bfloat16"}  # the FP8 output: what vLLM does in the dtype its FP8 layers accept


def _engine_versions() -> dict[str, str]:
    code = ("import importlib.metadata as m; import json; "
            "print(json.dumps({'vllm': m.version('vllm-cpu'), 'llama.cpp': 'llama-cpp-python ' + m.version('llama-cpp-python')}))")
    return json.loads(subprocess.run([str(PYTHON), "-c", code], capture_output=True, text=True, check=True).stdout)


def _run_engine(script: str, jobs: list[dict], work: Path, env: dict, timeout: float) -> tuple[dict, float]:
    jobs_path, results_path = work / f"{script}.jobs.json", work / f"{script}.results.json"
    jobs_path.write_text(json.dumps(jobs, indent=1))
    start = time.monotonic()
    proc = subprocess.run([str(PYTHON), str(HERE / script), str(jobs_path), str(results_path)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env}, cwd=work)
    (work / f"{script}.log").write_text(proc.stdout + proc.stderr)
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for job in jobs:  # a crash of the whole process is every remaining job's error
        results.setdefault(job["name"], {"error": f"{script} exited {proc.returncode}: {proc.stderr[-3000:]}"})
    return results, time.monotonic() - start


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory) -> dict:
    if not PYTHON.exists():
        pytest.skip(f"the engines are not installed in {VENV}: run scripts/install_engines.sh")
    from dense_models import greedy_oracle
    from engine_cases import build_all

    root = tmp_path_factory.mktemp("engines")
    start = time.monotonic()
    cases = build_all(root)
    oracle = {c.name: _oracle_ids(c, greedy_oracle) for c in cases}
    prepared = time.monotonic() - start
    vllm_jobs = [{"name": c.name, "model": str(c.out), "prompt": PROMPT, "new_tokens": NEW_TOKENS,
                  "llm_kwargs": VLLM_OPTIONS.get(c.model_type, {}), "fallback_dtype": FALLBACK_DTYPE.get(c.model_type)}
                 for c in cases]
    llama_jobs = [{"name": c.name, "model": str(c.out), "gguf": str(root / f"{c.out.name}.f32.gguf"), "prompt": PROMPT,
                   "new_tokens": NEW_TOKENS} for c in cases]
    vllm, vllm_s = _run_engine("vllm_generate.py", vllm_jobs, root, VLLM_ENV, timeout=1800)
    llama, llama_s = _run_engine("llama_cpp_generate.py", llama_jobs, root, {}, timeout=1800)
    runs = {"cases": cases, "oracle": oracle, "results": {"vllm": vllm, "llama.cpp": llama}, "outcomes": {},
            "seconds": {"prepare and oracle": round(prepared), "vllm": round(vllm_s), "llama.cpp": round(llama_s)}}
    yield runs
    _write_report(runs)


def _oracle_ids(case, greedy_oracle) -> list[int]:
    """transformers' greedy ids on the case's weights; FP8 ones dequantized to float32 first (weight x its
    block's scale, as the engines do), into a copy without quantization_config."""
    if not case.fp8:
        return greedy_oracle(case.out)[0]
    import torch
    from safetensors.torch import load_file, save_file

    from ckpttool.kernels.fp8 import dequant_fp8_block

    f32 = case.out.parent / f"{case.out.name}-f32"
    f32.mkdir()
    tensors = {}
    for path in sorted(case.out.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    scales = [n for n in tensors if n.endswith(".weight_scale_inv")]
    for scale in scales:
        weight = scale.removesuffix("_scale_inv")
        tensors[weight] = dequant_fp8_block(tensors[weight], tensors.pop(scale), torch.float32)
    save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(f32 / "model.safetensors"))
    config = json.loads((case.out / "config.json").read_text())
    config.pop("quantization_config")
    (f32 / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    assert scales, f"{case.out} holds no FP8 weights"
    return greedy_oracle(f32)[0]


def _write_report(runs: dict) -> None:
    report = {"engines": _engine_versions(), "prompt": PROMPT, "new_tokens": NEW_TOKENS, "seconds": runs["seconds"],
              "cases": {}}
    for case in runs["cases"]:
        report["cases"][case.name] = {
            "output": case.output, "config fields the input lacked": case.stripped,
            **{e: runs["outcomes"].get((e, case.name), {"status": "not run"}) for e in ENGINES}}
    REPORT.write_text(json.dumps(report, indent=1) + "\n")


def _case_names() -> list[str]:
    from engine_cases import MOE

    return ["deepseek_v3 FP8 -> BF16", "gpt_oss MXFP4 -> BF16", "llama BF16 -> FP8", *MOE]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", _case_names())
def test_engine_generates_transformers_greedy_ids(engine_runs, engine, name):
    case = next(c for c in engine_runs["cases"] if c.name == name)
    want, got = engine_runs["oracle"][name], engine_runs["results"][engine][name]
    outcome = engine_runs["outcomes"].setdefault((engine, name), {})
    outcome["workarounds"] = WORKAROUNDS.get((engine, case.model_type), WORKAROUNDS.get((engine, "*"), ""))
    if "error" in got:
        limit = KNOWN_LIMITS.get((engine, case.model_type))
        if limit and re.search(limit[0], got["error"] + got.get("traceback", "")):
            why = limit[1]
            if "fallback_error" in got:  # its most telling clause: "... requires AMX tile support (...)"
                said = " ".join(got["fallback_error"].split())
                said = next((c.strip() for c in said.split("..") if "requires" in c), said[:200])
                why += f"; in {FALLBACK_DTYPE[case.model_type]}: {said}"
            elif "fallback_ids" in got:
                why += (f"; in {FALLBACK_DTYPE[case.model_type]} it runs (ids {got['fallback_ids']}, "
                        "not comparable with float32 ids)")
            outcome.update(status="skipped", detail=why)
            pytest.skip(f"{engine} cannot run {name} here: {why} ({got['error'][:300]})")
        outcome.update(status="failed", detail=got["error"][:500])
        pytest.fail(f"{engine} on {case.out}: {got['error']}\n{got.get('traceback', '')}")
    outcome.update(status="equal" if got["ids"] == want else "differs", ids=got["ids"], transformers=want)
    assert got["ids"] == want, f"{engine} generated {got['ids']}, transformers {want} on {case.out}"
