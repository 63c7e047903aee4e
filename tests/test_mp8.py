"""The headline path at mp 8, on what CI has: `convert --mp 8` then `verify` with 8 gloo ranks.
(The same at real V3 dims on eight GPUs with NCCL is issue 9's device run.)"""

from __future__ import annotations

import json

from ckpttool.families.deepseek.demo import build_checkpoint
from conftest import load_dir, run_cli


def test_convert_mp8_then_verify_with_eight_gloo_ranks(tmp_path):
    src = build_checkpoint(tmp_path / "hf", "tiny-v3", seed=5,
                           overrides={"num_attention_heads": 8, "num_key_value_heads": 8, "n_routed_experts": 16})
    run_cli("convert", src, tmp_path / "mp8", "--mp", 8, "--dtype", "bf16", "--quiet")
    shards = load_dir(tmp_path / "mp8")
    assert sorted(shards) == [f"model{i}-mp8.safetensors" for i in range(8)]
    for rank in range(8):
        experts = {int(k.split(".")[4]) for k in shards[f"model{rank}-mp8.safetensors"] if ".experts." in k}
        assert experts == {2 * rank, 2 * rank + 1}
    proc = run_cli("verify", tmp_path / "mp8", "--reference", src, "--prompt-ids", "0,5,9,11",
                   "--max-new-tokens", 3, "--json", check=False)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], report
    assert report["mp"] == 8 and len(report["generated_ids"]) == 3
    assert all(c["ok"] for c in report["checks"].values())
    assert report["max_abs_logit_diff"] < 1e-3
