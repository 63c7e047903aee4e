"""A config.json that routes each token to more experts than the model has, or to none, is refused by name
(issue 39: it was passed through into the output's config, which no engine can run). Each family that reads
the field, through each command that reads a config: plan, convert, merge."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ckpttool.families.gpt_oss.demo import build_gpt_oss_checkpoint

try:
    from conftest import run_cli
except ImportError:
    from tests.conftest import run_cli


def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").unlink()
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


def _refused(proc, value) -> None:
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"num_experts_per_tok ({value}) is not in 1.." in proc.stderr and "config.json" in proc.stderr, proc.stderr


@pytest.mark.parametrize("value", [9, 0, -2])
def test_deepseek_top_k_outside_the_experts_is_refused(tiny_v3, tmp_path, value):
    """tiny-v3 has 8 routed experts: 9 is one too many; 0 and -2 route nowhere."""
    bad = _with_config(tiny_v3, tmp_path / "bad", num_experts_per_tok=value)
    _refused(run_cli("plan", bad, "--mp", 2, check=False), value)
    _refused(run_cli("convert", bad, tmp_path / "out", "--mp", 2, "--quiet", check=False), value)
    assert not (tmp_path / "out").exists()


def test_gpt_oss_top_k_outside_the_experts_is_refused_under_either_name(tmp_path):
    """gpt-oss reads num_experts_per_tok, or experts_per_token where that is missing."""
    src = build_gpt_oss_checkpoint(tmp_path / "src", mxfp4=False, seed=1)
    experts = json.loads((src / "config.json").read_text())["num_local_experts"]
    bad = _with_config(src, tmp_path / "bad", num_experts_per_tok=experts + 1)
    _refused(run_cli("plan", bad, check=False), experts + 1)
    alias = _with_config(src, tmp_path / "alias", experts_per_token=experts * 2)
    config = json.loads((alias / "config.json").read_text())
    del config["num_experts_per_tok"]
    (alias / "config.json").write_text(json.dumps(config))
    _refused(run_cli("dequant", alias, tmp_path / "out", "--quiet", check=False), experts * 2)


def test_merge_refuses_shards_whose_config_routes_past_the_experts(tiny_v3, tmp_path):
    """Not in the issue: the config beside mp shards is read by merge (without a manifest to catch the edit)."""
    run_cli("shard", tiny_v3, tmp_path / "mp", "--mp", 2, "--quiet")
    (tmp_path / "mp" / "ckpttool-manifest.json").unlink()
    config = json.loads((tmp_path / "mp" / "config.json").read_text())
    (tmp_path / "mp" / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 64}))
    _refused(run_cli("merge", tmp_path / "mp", tmp_path / "hf", "--quiet", check=False), 64)
