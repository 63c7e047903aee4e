"""The engines tier (`pytest -m engines`, after scripts/install_engines.sh): vLLM's CPU build and llama.cpp
load ckpttool's HF outputs and generate exactly transformers' greedy ids, in float32, from the same files.

Every case (tests/engine_cases.py) is made with several seeds (CKPTTOOL_ENGINES_SEEDS, default 3): a claim
holds for every seed or it is not made. The jobs are prepared once; each engine then runs them in a
subprocess of the engines venv (tests/engines/*_generate.py), since starting an engine is the slow part, and
after a job fails the rest run in a fresh process, so that the order of the jobs decides no result. A case
an engine cannot run here is skipped only when the engine's own error is the known limitation (KNOWN_LIMITS);
ids that differ are accepted only where the cause is known and shown: the engine's ids then equal
transformers' on what the engine actually runs: a copy with the config it reads, or without the weights it
ignores (KNOWN_DIFFERENCES). The run writes its report to
build/engines-report.json (untracked); `python scripts/engines_table.py --from build/engines-report.json
--write` makes it the committed record (tests/engines/report.json) and renders the README's Engines tables.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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
REPORT = Path(os.environ.get("CKPTTOOL_ENGINES_REPORT", REPO / "build" / "engines-report.json"))
N_SEEDS = int(os.environ.get("CKPTTOOL_ENGINES_SEEDS", "3"))
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
FALLBACK = " (fallback dtype)"


def _yarn_truncated(copy: Path) -> None:
    """YaRN's correction range truncated (floor/ceil) in the copy's config, which llama.cpp always does."""
    config = json.loads((copy / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), dict) and config[key].get("rope_type", config[key].get("type")) == "yarn":
            config[key] = {**config[key], "truncate": True}
    (copy / "config.json").write_text(json.dumps(config))


def _no_correction_bias(copy: Path) -> None:
    """The copy's router correction biases zeroed, in place: what vLLM's CPU router selects experts by."""
    from safetensors.torch import load_file, save_file

    for path in sorted(copy.glob("*.safetensors")):
        tensors = load_file(str(path))
        zeroed = {n for n in tensors if n.endswith("e_score_correction_bias")}
        if zeroed:
            save_file({n: t.zero_() if n in zeroed else t for n, t in tensors.items()}, str(path),
                      metadata={"format": "pt"})


KNOWN_DIFFERENCES = {
    # (engine, model_type): (how to make, from the case's output, what the engine actually runs; what it gets wrong)
    ("llama.cpp", "gpt_oss"): (_yarn_truncated,
                               "llama.cpp's convert_hf_to_gguf.py drops gpt-oss's YaRN `truncate: false`, and "
                               "its rope always truncates the correction range: its ids are transformers' with "
                               "`truncate: true`"),
    ("vllm", "ernie4_5_moe"): (_no_correction_bias,
                               "vLLM 0.32's CPU router (cpu_router.py `_softmax_topk`) selects experts by the "
                               "logits alone, ignoring `moe_statics.e_score_correction_bias` that ERNIE-4.5 adds "
                               "to the softmax before its top-k: its ids are transformers' with that bias zeroed"),
}


def _engine_versions() -> dict[str, str]:
    code = ("import importlib.metadata as m; import json; "
            "print(json.dumps({'vllm': m.version('vllm-cpu'), 'llama.cpp': 'llama-cpp-python ' + m.version('llama-cpp-python')}))")
    return json.loads(subprocess.run([str(PYTHON), "-c", code], capture_output=True, text=True, check=True).stdout)


def _run_engine(script: str, jobs: list[dict], work: Path, env: dict, timeout: float) -> tuple[dict, float, int]:
    """Every job's result. The script stops at the first job that fails; the rest then run in a fresh
    process, and a job that failed with a `fallback_dtype` runs once more in that dtype (as NAME + FALLBACK),
    also in a fresh process. Returns (results, seconds, processes started)."""
    start, results, pending, processes = time.monotonic(), {}, list(jobs), 0
    log = work / f"{script}.log"
    while pending:
        processes += 1
        jobs_path, results_path = work / f"{script}.jobs.json", work / f"{script}.results.json"
        jobs_path.write_text(json.dumps(pending, indent=1))
        results_path.unlink(missing_ok=True)
        proc = subprocess.run([str(PYTHON), str(HERE / script), str(jobs_path), str(results_path)],
                              capture_output=True, text=True, timeout=timeout, env={**os.environ, **env}, cwd=work)
        with open(log, "a") as f:
            f.write(f"--- process {processes}: {[j['name'] for j in pending]}\n{proc.stdout}{proc.stderr}")
        got = json.loads(results_path.read_text()) if results_path.exists() else {}
        if not got:  # died before its first result: that is the first job's error
            got = {pending[0]["name"]: {"error": f"{script} exited {proc.returncode}: {proc.stderr[-3000:]}"}}
        results.update(got)
        retry = [{**j, "name": j["name"] + FALLBACK, "dtype": j["fallback_dtype"], "fallback_dtype": None}
                 for j in pending if j["name"] in got and "error" in got[j["name"]] and j.get("fallback_dtype")]
        pending = retry + [j for j in pending if j["name"] not in results]
    return results, time.monotonic() - start, processes


def _vllm_job(case) -> dict:
    return {"name": case.key, "model": str(case.out), "prompt": PROMPT, "new_tokens": NEW_TOKENS,
            "llm_kwargs": VLLM_OPTIONS.get(case.model_type, {}), "fallback_dtype": FALLBACK_DTYPE.get(case.model_type)}


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory) -> dict:
    if not PYTHON.exists():
        pytest.skip(f"the engines are not installed in {VENV}: run scripts/install_engines.sh")
    from dense_models import greedy_oracle
    from engine_cases import build_all

    root = tmp_path_factory.mktemp("engines")
    start = time.monotonic()
    cases = build_all(root, N_SEEDS)
    oracle = {c.key: _oracle_ids(c, greedy_oracle) for c in cases}
    alternative = {(e, c.key): _oracle_ids(c, greedy_oracle, KNOWN_DIFFERENCES[e, c.model_type][0])
                   for c in cases for e in ENGINES if (e, c.model_type) in KNOWN_DIFFERENCES}
    prepared = time.monotonic() - start
    llama_jobs = [{"name": c.key, "model": str(c.out), "gguf": str(root / f"{c.out.name}.f32.gguf"), "prompt": PROMPT,
                   "new_tokens": NEW_TOKENS} for c in cases]
    vllm, vllm_s, vllm_n = _run_engine("vllm_generate.py", [_vllm_job(c) for c in cases], root, VLLM_ENV, timeout=1800)
    llama, llama_s, llama_n = _run_engine("llama_cpp_generate.py", llama_jobs, root, {}, timeout=1800)
    runs = {"cases": cases, "oracle": oracle, "alternative": alternative, "root": root,
            "results": {"vllm": vllm, "llama.cpp": llama}, "outcomes": {},
            "seconds": {"prepare and oracle": round(prepared), "vllm": round(vllm_s), "llama.cpp": round(llama_s)},
            "processes": {"vllm": vllm_n, "llama.cpp": llama_n}}
    yield runs
    _write_report(runs)


def _oracle_ids(case, greedy_oracle, change=None) -> list[int]:
    """transformers' greedy ids on the case's weights; FP8 ones dequantized to float32 first (weight x its
    block's scale, as the engines do), into a copy without quantization_config. `change`: on a copy it
    changed in place (what an engine runs instead: the config it reads, or without the weights it ignores)."""
    if change is not None:
        changed = case.out.parent / f"{case.out.name}-{change.__name__.strip('_')}"
        shutil.copytree(case.out, changed)
        change(changed)
        return greedy_oracle(changed)[0]
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


STATUS_ORDER = ("failed", "differs", "skipped", "explained", "equal", "not run")


def _write_report(runs: dict) -> None:
    """One entry per case: its seeds, and per engine the worst status over them with each seed's outcome."""
    report = {"engines": _engine_versions(), "prompt": PROMPT, "new_tokens": NEW_TOKENS, "seeds_per_case": N_SEEDS,
              "seconds": runs["seconds"], "processes": runs["processes"], "cases": {}}
    for case in runs["cases"]:
        entry = report["cases"].setdefault(case.name, {
            "output": case.output, "config fields the input lacked": case.stripped, "seeds": [],
            **{e: {"status": "equal", "seeds": {}} for e in ENGINES}})
        entry["seeds"].append(case.seed)
        for e in ENGINES:
            outcome = runs["outcomes"].get((e, case.key), {"status": "not run"})
            entry[e]["seeds"][str(case.seed)] = outcome
            worst = min((entry[e]["status"], outcome["status"]), key=STATUS_ORDER.index)
            entry[e]["status"] = worst
            for key in ("workarounds", "detail"):
                if outcome.get(key):
                    entry[e][key] = outcome[key]
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=1) + "\n")


def _case_keys() -> list[str]:
    from engine_cases import BUILDERS, seeds

    names = {"deepseek_v3": "deepseek_v3 FP8 -> BF16", "gpt_oss": "gpt_oss MXFP4 -> BF16", "llama": "llama BF16 -> FP8"}
    return [f"{names.get(t, t)} / seed {s}" for t in BUILDERS for s in seeds(t, N_SEEDS)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("key", _case_keys())
def test_engine_generates_transformers_greedy_ids(engine_runs, engine, key):
    case = next(c for c in engine_runs["cases"] if c.key == key)
    want, got = engine_runs["oracle"][key], engine_runs["results"][engine][key]
    outcome = engine_runs["outcomes"].setdefault((engine, key), {})
    outcome["workarounds"] = WORKAROUNDS.get((engine, case.model_type), WORKAROUNDS.get((engine, "*"), ""))
    if "error" in got:
        limit = KNOWN_LIMITS.get((engine, case.model_type))
        if limit and re.search(limit[0], got["error"] + got.get("traceback", "")):
            why = limit[1]
            fallback = engine_runs["results"][engine].get(key + FALLBACK)
            if fallback is not None and "error" in fallback:  # its most telling clause: "... requires AMX ..."
                said = " ".join(fallback["error"].split())
                said = next((c.strip() for c in said.split("..") if "requires" in c), said[:200])
                why += f"; in {FALLBACK_DTYPE[case.model_type]}: {said}"
            elif fallback is not None:
                why += (f"; in {FALLBACK_DTYPE[case.model_type]} it runs (ids {fallback['ids']}, "
                        "not comparable with float32 ids)")
            outcome.update(status="skipped", detail=why)
            pytest.skip(f"{engine} cannot run {key} here: {why} ({got['error'][:300]})")
        outcome.update(status="failed", detail=got["error"][:500])
        pytest.fail(f"{engine} on {case.out}: {got['error']}\n{got.get('traceback', '')}")
    outcome.update(ids=got["ids"], transformers=want)
    if got["ids"] == want:
        outcome["status"] = "equal"
        return
    known = KNOWN_DIFFERENCES.get((engine, case.model_type))
    if known is not None and got["ids"] == engine_runs["alternative"][engine, key]:
        outcome.update(status="explained", detail=known[1], explained_by=engine_runs["alternative"][engine, key])
        return  # the difference is the known one, and only it: proven on this seed
    outcome["status"] = "differs"
    assert got["ids"] == want, f"{engine} generated {got['ids']}, transformers {want} on {case.out}"


def test_a_failed_job_decides_nothing_about_the_next(engine_runs):
    """vLLM given [minimax_m2, mixtral]: MiniMax-M2 fails its known limit, and Mixtral after it still gives
    transformers' ids (it once failed there, on what the failed model left in the process)."""
    cases = engine_runs["cases"]
    minimax = next(c for c in cases if c.model_type == "minimax_m2")
    mixtral = next(c for c in cases if c.model_type == "mixtral")
    work = engine_runs["root"] / "order"
    work.mkdir()
    results, _, processes = _run_engine("vllm_generate.py", [_vllm_job(minimax), _vllm_job(mixtral)], work, VLLM_ENV,
                                        timeout=1800)
    assert "error" in results[minimax.key] and re.search(KNOWN_LIMITS["vllm", "minimax_m2"][0],
                                                         results[minimax.key]["traceback"])
    assert results[mixtral.key].get("ids") == engine_runs["oracle"][mixtral.key], results[mixtral.key]
    assert processes == 2
