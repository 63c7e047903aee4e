"""bitsandbytes checkpoints that are damaged, mis-declared or in a layout ckpttool does not read are refused naming
the file, the tensor and the fix, with nothing written under DST (at plan time DST never appears; at execution no
output file is published). The quant state is untrusted data the plan depends on: bounded, strict JSON, its
numbers checked against the tensors beside it and the shape against config.json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bnb_builders import saved
from conftest import run_cli
from dense_models import build_hf
from quant_builders import copy_changed

pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")

Q = "model.layers.0.self_attn.q_proj.weight"
STATE = {"nf4-dq": Q + ".quant_state.bitsandbytes__nf4", "fp4": Q + ".quant_state.bitsandbytes__fp4"}


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bnb-refused")
    qwen3 = build_hf("qwen3", root / "qwen3")
    return {kind: saved(qwen3, root / kind, kind) for kind in ("nf4-dq", "fp4", "int8")}


def state_of(tensors, kind: str) -> dict:
    return json.loads(bytes(tensors[STATE[kind]].numpy()).decode())


def set_state(kind: str, change):
    def edit(tensors):
        state = state_of(tensors, kind)
        change(state)
        tensors[STATE[kind]] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    return edit


def set_tensor(name: str, make):
    def edit(tensors):
        tensors[name] = make(tensors[name].clone())
    return edit


def at(index, value):
    def put(t):
        t.view(-1)[index] = value
        return t
    return put


# (layout, tensors change, config change, message, tensor or file named)
AT_PLAN = {
    "state is not JSON": ("nf4-dq", set_tensor(STATE["nf4-dq"], lambda t: torch.tensor(list(b"{quant"), dtype=torch.uint8)),
                          None, "is not valid JSON", STATE["nf4-dq"]),
    "state is too large": ("fp4", set_tensor(STATE["fp4"], lambda t: torch.full((70_000,), 32, dtype=torch.uint8)),
                           None, "a bitsandbytes FP4 state is at most 65536", STATE["fp4"]),
    "state has an unknown key": ("nf4-dq", set_state("nf4-dq", lambda s: s.update(scale_fmt="x")), None,
                                 "unexpected 'scale_fmt'", STATE["nf4-dq"]),
    "state holds terminal escapes": ("fp4", set_state("fp4", lambda s: s.update(quant_type="\x1b[2J" * 40)), None,
                                     "quant_type '\\x1b[2J", STATE["fp4"]),
    "state lacks the nested keys": ("nf4-dq", set_state("nf4-dq", lambda s: s.pop("nested_offset")), None,
                                    "missing nested_offset", STATE["nf4-dq"]),
    "state says double quant without nested tensors": (
        "fp4", set_state("fp4", lambda s: s.update(nested_blocksize=256, nested_dtype="float32", nested_offset=0.5)),
        None, "there is no nested_absmax beside it", STATE["fp4"]),
    "state names another quant type": ("nf4-dq", set_state("nf4-dq", lambda s: s.update(quant_type="fp4")), None,
                                       "expected 'nf4'", STATE["nf4-dq"]),
    "state blocksize bitsandbytes lacks": ("fp4", set_state("fp4", lambda s: s.update(blocksize=48)), None,
                                           "blocksize 48", STATE["fp4"]),
    "state shape that the packed weight cannot hold": ("fp4", set_state("fp4", lambda s: s.update(shape=[128, 66])),
                                                       None, "quant state says [128, 66]", STATE["fp4"]),
    "state shape transposed": ("nf4-dq", set_state("nf4-dq", lambda s: s.update(shape=[64, 128])), None,
                               "shape [64, 128] contradicts config.json, which implies [128, 64]", Q),
    "state with an odd number of columns": ("fp4", set_state("fp4", lambda s: s.update(shape=[256, 31])), None,
                                            "odd number of columns", STATE["fp4"]),
    "nested offset beyond float32": ("nf4-dq", set_state("nf4-dq", lambda s: s.update(nested_offset=1e39)), None,
                                     "a finite float32 number", STATE["nf4-dq"]),
    "quant map is not the quant type's": ("nf4-dq", set_tensor(Q + ".quant_map", at(3, 0.25)), None,
                                          "quant map is not bitsandbytes' nf4 table", Q + ".quant_map"),
    "absmax missing": ("fp4", lambda t: t.pop(Q + ".absmax"), None, f"has no {Q + '.absmax'!r}", Q),
    "absmax of the wrong length": ("fp4", set_tensor(Q + ".absmax", lambda t: t[:-1]), None,
                                   "its absmax [127], expected [4096, 1] and [128]", STATE["fp4"]),
    "SCB of the wrong shape": ("int8", set_tensor("model.layers.0.self_attn.q_proj.SCB", lambda t: t[:-1]), None,
                               "SCB shape [127] for int8 weight [128, 64]", "model.layers.0.self_attn.q_proj.SCB"),
    "both 4-bit and 8-bit": ("fp4", None, lambda q: q.update(load_in_8bit=True), "load_in_8bit True", "config.json"),
    "bfloat16 storage": ("fp4", None, lambda q: q.update(bnb_4bit_quant_storage="bfloat16"),
                         "bnb_4bit_quant_storage 'bfloat16'", "config.json"),
    "a quantized module the config skips": ("nf4-dq", None, lambda q: q.update(llm_int8_skip_modules=["q_proj"]),
                                            "does not cover module 'model.layers.0.self_attn.q_proj'", Q),
}


@pytest.mark.parametrize("case", sorted(AT_PLAN))
def test_refused_at_plan_naming_the_tensor(case, made, tmp_path):
    layout, tensors_change, config_change, message, named = AT_PLAN[case]
    src = copy_changed(made[layout], tmp_path / "src", tensors_change, config_change)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and message in proc.stderr and named in proc.stderr and "fix:" in proc.stderr, \
        proc.stderr
    assert "Traceback" not in proc.stderr and "\x1b" not in proc.stderr and not (tmp_path / "out").exists()


AT_EXECUTION = {
    "a NaN absmax": ("fp4", set_tensor(Q + ".absmax", at(37, float("nan"))), f"{Q + '.absmax'!r} holds NaN",
                     "first in row 37"),
    "a NaN SCB": ("int8", set_tensor("model.layers.0.self_attn.q_proj.SCB", at(5, float("inf"))), "SCB' holds NaN",
                  "first in row 5"),
    "a nested absmax that overflows": (
        "nf4-dq", lambda t: (set_tensor(Q + ".nested_absmax", at(0, 3e38))(t),
                             set_tensor(Q + ".nested_quant_map", at(255, 2.0))(t),
                             set_tensor(Q + ".absmax", at(9, 255))(t)),
        "double-quant absmax (nested_quant_map x nested_absmax + offset) is not a finite float32", "block 9"),
}


@pytest.mark.parametrize("case", sorted(AT_EXECUTION))
def test_bad_values_are_refused_at_execution(case, made, tmp_path):
    layout, change, message, where = AT_EXECUTION[case]
    src = copy_changed(made[layout], tmp_path / "src", change)
    proc = run_cli("dequant", src, tmp_path / "out", check=False)
    assert proc.returncode != 0 and message in proc.stderr and where in proc.stderr and "fix:" in proc.stderr, \
        proc.stderr
    assert Q.rsplit(".", 1)[0] in proc.stderr and not list((tmp_path / "out").glob("*.safetensors"))


def test_shard_keeping_bitsandbytes_weights_is_refused(made, tmp_path):
    proc = run_cli("shard", made["nf4-dq"], tmp_path / "out", "--mp", 2, check=False)
    assert proc.returncode != 0 and "can only be dequantized" in proc.stderr and not (tmp_path / "out").exists()


def test_a_streamed_hub_input_is_refused_before_anything_is_fetched(made, tmp_path):
    """The quant state is data, and a streamed plan has headers only: download first (the fix says how)."""
    import subprocess
    import sys

    try:
        from hub_server import HubServer, load_repo
        from test_download import REPO_ROOT, hub_env
    except ImportError:
        from tests.hub_server import HubServer, load_repo
        from tests.test_download import REPO_ROOT, hub_env

    with HubServer([load_repo("org/bnb", made["fp4"])]) as hub:
        proc = subprocess.run([sys.executable, "-m", "ckpttool", "dequant", "org/bnb", str(tmp_path / "out")],
                              env=hub_env(hub.url, tmp_path / "home"), cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=120)
    assert proc.returncode != 0 and "a streamed hub input does not have" in proc.stderr, proc.stderr
    assert "download the checkpoint first" in proc.stderr and ".weight.quant_" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_library_checkpoint_itself_is_accepted(made, tmp_path):
    """The edits above are what is refused: the unedited checkpoints dequantize."""
    for kind, src in made.items():
        shutil.copytree(src, tmp_path / kind)
        run_cli("dequant", tmp_path / kind, tmp_path / f"out-{kind}", "--quiet")
