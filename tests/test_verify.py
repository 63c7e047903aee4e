"""verify end to end on CPU: real tiny checkpoints, real mp shards, real gloo process groups.

The mp shards come from the reference convert.py (shared/seeds) until `ckpttool shard` lands; the
independent oracle is transformers' own DeepseekV3/V2ForCausalLM on the HF checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ckpttool.cli import app
from ckpttool.families.deepseek.demo import build_checkpoint
from ckpttool.errors import InputError
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.kernels.fp8 import dequant_fp8_block
from ckpttool.verify.run import run_verify
from conftest import require_seeds

REPO = Path(__file__).resolve().parent.parent
PROMPT = [0, 5, 9, 33, 7]
NEW_TOKENS = 5


def reference_convert(hf_dir: Path, dst: Path, mp: int) -> Path:
    """model{i}-mp{N}.safetensors by the reference convert.py, plus config.json beside them."""
    spec = importlib.util.spec_from_file_location("reference_convert", require_seeds() / "convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    try:
        module.main(str(hf_dir), str(dst), 8, mp)
    finally:
        torch.set_num_threads(threads)  # the reference sets 8 threads for the whole process
    shutil.copy(hf_dir / "config.json", dst / "config.json")
    return dst


def dequantized_copy(hf_dir: Path, dst: Path) -> Path:
    """A BF16 HF copy of an FP8 checkpoint (our dequant kernel), for transformers to load."""
    dst.mkdir()
    tensors = {}
    with Checkpoint(hf_dir) as ckpt:
        for name in ckpt.tensors:
            if name.endswith("_scale_inv"):
                continue
            t = ckpt.read(name)
            if name + "_scale_inv" in ckpt.tensors:
                t = dequant_fp8_block(t, ckpt.read(name + "_scale_inv"))
            tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def transformers_oracle(hf_dir: Path, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy ids and the logits that chose them, from transformers' own implementation in float32."""
    import transformers

    config = json.loads((hf_dir / "config.json").read_text())
    cls = {"deepseek_v3": transformers.DeepseekV3ForCausalLM, "deepseek_v2": transformers.DeepseekV2ForCausalLM}
    model = cls[config["model_type"]].from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None)
    ids = out.sequences[0, len(prompt):].tolist()
    return ids, torch.cat(out.logits).float()


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        # seed 1: greedy decoding of this prompt meets no near-tie in bfloat16, so the bfloat16 run stays
        # within the default tolerance (3 of seeds 0-5 of the numpy builder flip a token and then diverge)
        "v3": build_checkpoint(root / "v3", "tiny-v3", fp8=False, seed=1, overrides={"num_nextn_predict_layers": 0}),
        # same seed, so the same weights plus an MTP layer the model must skip
        "v3-mtp": build_checkpoint(root / "v3-mtp", "tiny-v3", fp8=False, seed=1),
        "v3-fp8": build_checkpoint(root / "v3-fp8", "tiny-v3", overrides={"num_nextn_predict_layers": 0}),
        "v2-lite": build_checkpoint(root / "v2-lite", "tiny-v2-lite"),
    }


@pytest.fixture(scope="module")
def shards(hf, tmp_path_factory):
    made: dict[tuple[str, int], Path] = {}

    def get(preset: str, mp: int) -> Path:
        if (preset, mp) not in made:
            made[preset, mp] = reference_convert(hf[preset], tmp_path_factory.mktemp(f"{preset}-mp{mp}"), mp)
        return made[preset, mp]

    return get


@pytest.mark.parametrize("preset", ["v3", "v2-lite"])
@pytest.mark.parametrize("mp", [1, 2, 4])
def test_mp_shards_match_reference_and_transformers(preset, mp, hf, shards, tmp_path):
    logits_path = tmp_path / "logits.safetensors"
    report = run_verify(shards(preset, mp), reference=hf[preset], prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS,
                        logits_path=logits_path)
    assert report.ok, report.render(preset)
    assert set(report.checks) == {"load", "weights", "finite", "generate", "reference"}
    assert report.mp == mp and len(report.generated_ids) == NEW_TOKENS
    assert report.max_abs_logit_diff is not None and report.max_abs_logit_diff < 1e-4

    oracle_ids, oracle_logits = transformers_oracle(hf[preset], PROMPT, NEW_TOKENS)
    assert report.generated_ids == oracle_ids
    ours = load_file(logits_path)["logits"]
    assert ours.shape == oracle_logits.shape
    assert (ours - oracle_logits).abs().max() < 1e-3


def test_fp8_shards_match_reference_and_transformers(hf, shards, tmp_path):
    fp8_shards = shards("v3-fp8", 2)
    assert any(k.endswith(".scale") for k in load_file(fp8_shards / "model0-mp2.safetensors"))
    logits_path = tmp_path / "logits.safetensors"
    report = run_verify(fp8_shards, reference=hf["v3-fp8"], prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS,
                        logits_path=logits_path)
    assert report.ok, report.render("fp8")
    oracle_ids, oracle_logits = transformers_oracle(dequantized_copy(hf["v3-fp8"], tmp_path / "bf16"),
                                                    PROMPT, NEW_TOKENS)
    assert report.generated_ids == oracle_ids
    assert (load_file(logits_path)["logits"] - oracle_logits).abs().max() < 1e-3


def test_reference_with_mtp_layer_is_accepted_and_bfloat16_within_default_tolerance(hf, shards):
    report = run_verify(shards("v3", 2), reference=hf["v3-mtp"], prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS,
                        dtype="bfloat16")
    assert report.ok, report.render("bf16")
    assert 0 < report.max_abs_logit_diff <= report.tolerance


def test_naive_attention_gives_the_same_tokens(hf, shards):
    absorbed = run_verify(shards("v2-lite", 2), prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    naive = run_verify(shards("v2-lite", 2), reference=hf["v2-lite"], prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS,
                       attn_impl="naive")
    assert absorbed.ok and naive.ok, naive.render("naive")
    assert "reference" not in absorbed.checks and absorbed.max_abs_logit_diff is None
    assert naive.generated_ids == absorbed.generated_ids


def test_our_own_convert_output_verifies(tmp_path):
    """`ckpttool convert --mp 2 --dtype bf16` of the published-style FP8 checkpoint (with its MTP
    layer) verifies against that FP8 checkpoint."""
    src = build_checkpoint(tmp_path / "hf", "tiny-v3")
    dst = tmp_path / "mp2"
    result = CliRunner().invoke(app, ["convert", str(src), str(dst), "--mp", "2", "--dtype", "bf16", "--quiet"])
    assert result.exit_code == 0, result.output
    report = run_verify(dst, reference=src, prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    assert report.ok, report.render(dst)


# -- corrupted shards --------------------------------------------------------------------------------
def _corrupt(src: Path, dst: Path, change) -> Path:
    shutil.copytree(src, dst)
    path = dst / "model1-mp2.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, str(path))
    return dst


def _zero(tensors):
    tensors["layers.1.attn.wq_b.weight"].zero_()


def _rename(tensors):
    tensors["layers.2.ffn.gate_renamed.weight"] = tensors.pop("layers.2.ffn.gate.weight")


def _reshape(tensors):
    tensors["layers.0.attn.kv_norm.weight"] = tensors["layers.0.attn.kv_norm.weight"][:100].clone()


def _extra(tensors):
    tensors["layers.3.attn_norm.weight"] = tensors["norm.weight"].clone()


@pytest.mark.parametrize(("change", "failed", "expected"), [
    (_zero, "weights", ["layers.1.attn.wq_b.weight", "model1-mp2.safetensors", "model.layers.1.self_attn.q_b_proj.weight"]),
    (_rename, "load", ["missing tensor 'layers.2.ffn.gate.weight'", "unexpected tensor 'layers.2.ffn.gate_renamed.weight'",
                       "model1-mp2.safetensors"]),
    (_reshape, "load", ["'layers.0.attn.kv_norm.weight' has shape [100], the model expects [128]", "model1-mp2"]),
    (_extra, "load", ["unexpected tensor 'layers.3.attn_norm.weight'", "model1-mp2.safetensors"]),
], ids=["zeroed", "renamed", "reshaped", "extra"])
def test_corrupted_shard_fails_naming_the_problem(change, failed, expected, hf, shards, tmp_path):
    bad = _corrupt(shards("v3", 2), tmp_path / "bad", change)
    result = CliRunner().invoke(app, ["verify", str(bad), "--reference", str(hf["v3"]), "--prompt-ids", "0,5,9",
                                      "--max-new-tokens", "2", "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is False and report["checks"][failed]["ok"] is False
    for text in expected:
        assert text in report["checks"][failed]["detail"]


def test_zeroed_tensor_without_reference_still_fails_on_logits(hf, shards, tmp_path):
    """Without --reference the weights check cannot run; zeroed attention still moves the logits."""
    bad = _corrupt(shards("v3", 2), tmp_path / "bad", _zero)
    report = run_verify(bad, prompt_ids=PROMPT, max_new_tokens=2)
    assert report.ok  # nothing to compare against: load, finite and generate all pass
    with_ref = run_verify(bad, reference=hf["v3"], prompt_ids=PROMPT, max_new_tokens=2)
    assert not with_ref.checks["reference"].ok and with_ref.max_abs_logit_diff > 1e-3


# -- CLI ---------------------------------------------------------------------------------------------
def test_cli_json_with_text_prompt(hf, shards):
    result = CliRunner().invoke(app, ["verify", str(shards("v2-lite", 2)), "--prompt", "hello world",
                                      "--reference", str(hf["v2-lite"]), "--max-new-tokens", "3", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] is True and len(report["generated_ids"]) == 3
    assert report["prompt_ids"][0] == 0  # BOS from tokenizer_config.json, then "hello world"
    assert all(c["ok"] for c in report["checks"].values())
    assert isinstance(report["max_abs_logit_diff"], float)


def test_cli_human_report(shards):
    result = CliRunner().invoke(app, ["verify", str(shards("v2-lite", 2)), "--prompt-ids", "0,5", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert "PASS  load" in result.stdout and "generated ids: [" in result.stdout and result.stdout.strip().endswith("OK")


def test_missing_shard_is_a_clear_error(shards, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(shards("v2-lite", 2), partial)
    (partial / "model1-mp2.safetensors").unlink()
    with pytest.raises(InputError, match="missing shard.*model1-mp2.safetensors"):
        run_verify(partial, prompt_ids=PROMPT)


def test_config_that_does_not_match_the_shards_is_a_clear_error(hf, shards, tmp_path):
    wrong = tmp_path / "wrong"
    shutil.copytree(shards("v2-lite", 2), wrong)
    shutil.copy(hf["v3"] / "config.json", wrong / "config.json")
    report = run_verify(wrong, prompt_ids=PROMPT)
    assert not report.ok and "missing tensor 'layers.0.attn.wq_a.weight'" in report.checks["load"].detail


def test_prompt_outside_vocabulary_is_a_clear_error(shards):
    with pytest.raises(InputError, match=r"prompt ids \[5000\] are outside the vocabulary"):
        run_verify(shards("v2-lite", 1), prompt_ids=[0, 5000])


def test_runs_under_torchrun(hf, shards):
    """Each torchrun process is one rank; only rank 0 prints the report."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cli = "import sys; from ckpttool.cli import main; sys.argv[0] = 'ckpttool'; main()"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
         sys.executable, "-c", cli, "verify", str(shards("v3", 2)), "--reference", str(hf["v3"]),
         "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "2", "--json"],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, result.stdout
    report = json.loads(lines[0])
    assert report["ok"] and report["mp"] == 2 and len(report["generated_ids"]) == 2


# -- GPU (run on the device machine: pytest -m gpu tests/test_verify.py) -----------------------------
def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA device(s)")


@pytest.mark.gpu
@pytest.mark.parametrize("mp", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_nccl_matches_cpu(mp, dtype, hf, shards):
    _need_gpus(mp)
    cpu = run_verify(shards("v3", mp), prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    gpu = run_verify(shards("v3", mp), reference=hf["v3"], prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS,
                     device="cuda", dtype=dtype)
    assert gpu.ok, gpu.render("gpu")
    if dtype == "float32":
        assert gpu.generated_ids == cpu.generated_ids


@pytest.mark.gpu
def test_gpu_fp8_shards_triton_dequant(hf, shards):
    _need_gpus(2)
    report = run_verify(shards("v3-fp8", 2), reference=hf["v3-fp8"], prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS,
                        device="cuda", dtype="bfloat16")
    assert report.ok, report.render("gpu fp8")
    assert report.checks["weights"].ok  # Triton dequant on GPU == torch dequant on CPU, bit for bit


def test_a_rank_that_died_before_its_log_is_named_not_a_missing_file(tmp_path):
    """A rank process that exits before its body opens rank{r}.log (killed at spawn, say) is reported as that
    rank's failure with its exit code, not as a FileNotFoundError about the log."""
    import multiprocessing
    import os

    from ckpttool.errors import CkptError
    from ckpttool.verify.run import _collect

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=os._exit, args=(code,)) for code in (0, 3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    (tmp_path / "rank0.log").write_text("rank 0 ran\n")
    with pytest.raises(CkptError, match=r"verify rank 1 exited with code 3:\n    \(no log\)"):
        _collect(tmp_path, procs)



def test_a_rank_that_failed_first_is_named_not_one_stopped_after_it(tmp_path):
    """When one rank fails, verify stops the others after a grace (SIGKILL): the report names the rank that
    failed and its log, not rank 0 killed with an empty log (what a CUDA verify of 2 ranks on one GPU showed)."""
    import multiprocessing
    import os
    import signal
    import time

    from ckpttool.errors import CkptError
    from ckpttool.verify.run import _collect

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=time.sleep, args=(60,)), ctx.Process(target=os._exit, args=(3,))]
    for p in procs:
        p.start()
    procs[1].join()
    procs[0].kill()
    procs[0].join()
    (tmp_path / "rank0.log").write_text("")
    (tmp_path / "rank1.log").write_text("RuntimeError: NCCL error: duplicate GPU\n")
    assert procs[0].exitcode == -signal.SIGKILL and procs[1].exitcode == 3
    with pytest.raises(CkptError, match=r"verify rank 1 exited with code 3:\n    RuntimeError: NCCL error"):
        _collect(tmp_path, procs)


def test_cuda_with_fewer_gpus_than_ranks_is_refused_before_any_rank_starts(shards):
    """NCCL takes one GPU per rank: --device cuda where the machine has fewer GPUs than ranks (none here) is an
    error naming both counts and --device cpu, not ranks dying inside NCCL."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        pytest.skip("this machine has the GPUs for 2 ranks")
    with pytest.raises(InputError, match=f"2 ranks here need 2 GPUs, this machine has {gpus}") as err:
        run_verify(shards("v3", 2), prompt_ids=PROMPT, max_new_tokens=1, device="cuda")
    assert "--device cpu" in err.value.fix
