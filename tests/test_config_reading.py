"""config.json is read exactly as transformers reads it (defaults, rope precedence, routing), and
`verify --reference` answers with transformers' own implementation, which is what catches a misread:
a tiny DeepSeek-V3 built and saved by transformers itself, rope_theta only inside rope_parameters (as
transformers 5 saves it), non-zero router bias and non-trivial norms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpttool.errors import InputError
from ckpttool.families.base import read_rope
from ckpttool.families.deepseek.args import ModelArgs
from ckpttool.families.deepseek.spec import CONFIG_DEFAULTS
from ckpttool.verify.run import run_verify
from conftest import run_cli

transformers = pytest.importorskip("transformers")

PROMPT = [3, 17, 42, 7]
NEW = 5


@pytest.mark.parametrize("model_type, cls", [("deepseek_v2", "DeepseekV2Config"), ("deepseek_v3", "DeepseekV3Config"),
                                             ("deepseek_v32", "DeepseekV32Config")])
def test_deepseek_defaults_are_transformers_defaults(model_type, cls):
    theirs = getattr(transformers, cls)()
    compared = [k for k in CONFIG_DEFAULTS[model_type] if hasattr(theirs, k)]
    assert len(compared) >= 20
    for key in compared:
        assert CONFIG_DEFAULTS[model_type][key] == getattr(theirs, key), key


ROPES = {
    "transformers 5: theta only inside rope_parameters": {"rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"}},
    "published: top-level theta + yarn rope_scaling": {
        "rope_theta": 20000.0, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
    "dict theta wins over the top-level one": {"rope_theta": 11.0, "rope_parameters": {"rope_theta": 777.0}},
    "rope_scaling replaces rope_parameters": {"rope_parameters": {"rope_theta": 5.0}, "rope_scaling": {"rope_type": "default"},
                                               "rope_theta": 123.0},
    "yarn without original length takes max_position_embeddings": {
        "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}},
    "nothing: the class default": {},
}


@pytest.mark.parametrize("case", sorted(ROPES))
def test_rope_is_read_as_transformers_reads_it(case):
    raw = {"model_type": "deepseek_v3", "max_position_embeddings": 64, **ROPES[case]}
    theirs = transformers.DeepseekV3Config(**{k: v for k, v in json.loads(json.dumps(raw)).items() if k != "model_type"})
    ours = read_rope(raw, "config.json", default_theta=10000.0, types=("default", "yarn"))
    assert ours.theta == theirs.rope_parameters["rope_theta"]
    assert ours.type == theirs.rope_parameters["rope_type"]
    if ours.type == "yarn":
        assert ours.params["original_max_position_embeddings"] == theirs.rope_parameters["original_max_position_embeddings"]


def test_unknown_rope_and_routing_are_refused_not_defaulted():
    with pytest.raises(InputError, match="unsupported rope type 'dynamic'"):
        read_rope({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "c.json", default_theta=1.0, types=("default",))
    base = {"model_type": "deepseek_v3", **{k: v for k, v in CONFIG_DEFAULTS["deepseek_v3"].items()}}
    with pytest.raises(InputError, match="unsupported routing for the DeepSeek-V3 architecture"):
        ModelArgs.from_hf_config({**base, "topk_method": "greedy"})
    with pytest.raises(InputError, match="unsupported routing for DeepSeek-V2"):
        ModelArgs.from_hf_config({**base, "model_type": "deepseek_v2", "n_group": 1, "norm_topk_prob": True,
                                  "topk_method": "greedy", "scoring_func": "softmax"})


def _tiny_v3(dst: Path, *, model_type: str = "deepseek_v3", seed: int = 0) -> Path:
    """A DeepseekV3ForCausalLM that transformers builds and saves, with weights that exercise the router."""
    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=128, routed_scaling_factor=2.5,
        rope_parameters={"rope_theta": 50000.0, "rope_type": "default"}, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.08) + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.5)  # a zero bias proves nothing about the router
    model.save_pretrained(dst)
    raw = json.loads((dst / "config.json").read_text())
    assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == 50000.0  # as transformers 5 saves it
    if model_type != "deepseek_v3":
        raw["model_type"] = model_type
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _transformers_greedy(src: Path) -> list[int]:
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def hf_v3(tmp_path_factory) -> Path:
    return _tiny_v3(tmp_path_factory.mktemp("tf") / "v3")


@pytest.mark.parametrize("mp", [1, 2])
def test_transformers_saved_v3_verifies_against_transformers(hf_v3, tmp_path, mp):
    assert ModelArgs.from_hf_config(json.loads((hf_v3 / "config.json").read_text())).rope_theta == 50000.0
    run_cli("convert", hf_v3, tmp_path / "mp", "--mp", mp, "--quiet")
    report = run_verify(tmp_path / "mp", reference=hf_v3, prompt_ids=PROMPT, max_new_tokens=NEW)
    assert report.ok, report.render("v3")
    assert "against transformers" in report.checks["reference"].detail and "DeepseekV3ForCausalLM" in \
        report.checks["reference"].detail
    assert report.generated_ids == _transformers_greedy(hf_v3)


def test_a_misread_rope_theta_fails_verify(hf_v3, tmp_path):
    """The shards' config says theta 10000 (what the old reading assumed): transformers, reading the
    reference's 50000, disagrees, and verify says so."""
    run_cli("convert", hf_v3, tmp_path / "mp", "--mp", 2, "--quiet")
    config = json.loads((tmp_path / "mp" / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 10000.0
    (tmp_path / "mp" / "config.json").write_text(json.dumps(config))
    report = run_verify(tmp_path / "mp", reference=hf_v3, prompt_ids=PROMPT, max_new_tokens=NEW)
    assert not report.ok and not report.checks["reference"].ok
    assert report.max_abs_logit_diff > 1e-3


def test_kimi_k2_is_the_v3_architecture_verified(tmp_path):
    """model_type kimi_k2 with no topk_method (Kimi ships remote code): planned and verified with V3's
    rules, against transformers' DeepseekV3 as the oracle."""
    src = _tiny_v3(tmp_path / "kimi", model_type="kimi_k2", seed=1)
    assert "topk_method" not in json.loads((src / "config.json").read_text())
    run_cli("convert", src, tmp_path / "mp", "--mp", 2, "--quiet")
    report = run_verify(tmp_path / "mp", reference=src, prompt_ids=PROMPT, max_new_tokens=NEW)
    assert report.ok, report.render("kimi")
    assert "DeepseekV3ForCausalLM" in report.checks["reference"].detail


def test_without_transformers_the_bundled_model_answers_and_says_so(hf_v3, tmp_path):
    run_cli("convert", hf_v3, tmp_path / "mp", "--mp", 2, "--quiet")
    blocked = tmp_path / "no-transformers"  # every process of this run, the ranks too, finds no transformers
    blocked.mkdir()
    (blocked / "transformers.py").write_text("raise ImportError('transformers is not installed here')\n")
    path = os.pathsep.join([str(blocked), str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "ckpttool", "verify", tmp_path / "mp", "--reference", hf_v3,
                           "--prompt-ids", "3,17,42,7", "--json"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-2000:]
    detail = json.loads(proc.stdout)["checks"]["reference"]["detail"]
    assert "the bundled model at mp=1 (transformers is not installed)" in detail
