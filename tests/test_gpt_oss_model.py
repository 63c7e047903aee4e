"""Issue 7, the bundled gpt-oss model: at mp 1 it matches transformers' GptOssForCausalLM (float32
logits at every position, greedy tokens through the KV cache), and at mp 2 on CPU (gloo, one process
per rank, heads/experts/vocab cut by the mp key table) it generates the same tokens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttool.families.gpt_oss.spec import GptOssConfig, shard_for_rank
from ckpttool.families.gpt_oss.demo import build_gpt_oss_checkpoint
from ckpttool.families.gpt_oss.model import Transformer
from ckpttool.model.parallel import ParallelContext

PROMPT = [0, 5, 9, 11, 3, 20, 7, 8, 30, 4]  # longer than the sliding window (4)
NEW_TOKENS = 8
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory) -> Path:
    return build_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt-oss") / "bf16", mxfp4=False, seed=5)


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def build_ours(path: Path, ctx: ParallelContext, dtype: torch.dtype) -> Transformer:
    cfg = GptOssConfig.load(path / "config.json")
    model = Transformer(cfg, ctx, dtype=dtype)
    state = {k: v.to(dtype) for k, v in shard_for_rank(hf_tensors(path), ctx.rank, ctx.world_size).items()}
    model.load_state_dict(state, strict=True)
    model.setup_caches(1, len(PROMPT) + NEW_TOKENS)
    return model


def greedy(model: Transformer) -> list[int]:
    tokens = list(PROMPT)
    logits = model(torch.tensor([tokens]), 0)
    for step in range(NEW_TOKENS):
        tokens.append(int(logits.argmax(-1)))
        if step < NEW_TOKENS - 1:
            logits = model(torch.tensor([tokens[-1:]]), len(tokens) - 1)
    return tokens


def test_mp1_matches_transformers_float32(bf16_ckpt):
    from transformers import GptOssForCausalLM  # here, so rank processes importing this module stay light

    ref = GptOssForCausalLM.from_pretrained(bf16_ckpt, dtype=torch.float32).eval()
    ours = build_ours(bf16_ckpt, ParallelContext(), torch.float32)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = ref(ids).logits
        want_tokens = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()
    got = ours(ids, 0, all_positions=True)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert greedy(ours) == want_tokens


def test_sliding_window_and_sinks_matter(bf16_ckpt):
    """The oracle comparison above would not notice them if they were no-ops on this checkpoint."""
    ours = build_ours(bf16_ckpt, ParallelContext(), torch.float32)
    base = ours(torch.tensor([PROMPT]), 0)
    for block in ours.layers:
        block.attn.sliding_window = None
    assert (ours(torch.tensor([PROMPT]), 0) - base).abs().max() > 1e-3
    ours = build_ours(bf16_ckpt, ParallelContext(), torch.float32)
    for block in ours.layers:
        block.attn.sinks.fill_(-1e4)
    assert (ours(torch.tensor([PROMPT]), 0) - base).abs().max() > 1e-3


_RANK_MAIN = """
import os, sys
from pathlib import Path
import torch
import torch.distributed as dist
from ckpttool.model.parallel import ParallelContext
sys.path.insert(0, os.environ["TEST_DIR"])
from test_gpt_oss_model import PROMPT, build_ours, greedy

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=world)
model = build_ours(Path(os.environ["CKPT"]), ParallelContext(rank, world), torch.float32)
tokens = greedy(model)
logits = model(torch.tensor([PROMPT]), 0, all_positions=True)  # caches rewritten from position 0
if rank == 0:
    torch.save({"tokens": tokens, "logits": logits}, os.environ["OUT"])
dist.destroy_process_group()
"""


def test_mp2_on_cpu_matches_mp1(bf16_ckpt, tmp_path):
    """One process per rank, as verify runs them; ranks import only ckpttool (not transformers)."""
    from conftest import free_port  # here, so rank processes importing this module stay light

    out = tmp_path / "mp2.pt"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "CKPT": str(bf16_ckpt), "OUT": str(out), "TEST_DIR": str(Path(__file__).parent)}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK_MAIN], env={**env, "RANK": str(r)}, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-4000:]
    got = torch.load(out)
    ours = build_ours(bf16_ckpt, ParallelContext(), torch.float32)
    assert got["tokens"] == greedy(ours)
    ours = build_ours(bf16_ckpt, ParallelContext(), torch.float32)
    torch.testing.assert_close(got["logits"], ours(torch.tensor([PROMPT]), 0, all_positions=True),
                               atol=1e-5, rtol=1e-5)
