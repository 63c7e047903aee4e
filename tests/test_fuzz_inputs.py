"""Fuzzing what users and downloads hand ckpttool besides safetensors bytes: recipe YAML, --set
overrides and config.json. The property: the command either works or prints `error:` / `fix:` from a
CkptError (exit 1 or 2), never an exception the code does not check (the CLI's 'unexpected'
catch-all), and never slowly (a config with 1e8 experts must fail fast, not expand them).

Bounded and derandomized for CI; CKPTTOOL_FUZZ_EXAMPLES runs longer, like tests/test_fuzz_parser.py."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpttool.errors import CkptError
from ckpttool.recipe import load_recipe
from conftest import REPO, run_cli

EXAMPLES = int(os.environ.get("CKPTTOOL_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=timedelta(seconds=5), derandomize="CKPTTOOL_FUZZ_EXAMPLES" not in os.environ,
                database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
RECIPE = (REPO / "recipes" / "deepseek-v3-mp8-bf16.yaml").read_text()

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                         st.sampled_from([1e8, 10**8, -1, 0, 2**63, 1e400, "1e8", "deepseek_v3", "llama", "gpt_oss"]))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                 st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=6)
yaml_snippets = st.sampled_from(["[", "]", "{", "}", ":", "- ", "\n", "  ", "!!python/object:os.system", "&a", "*a",
                                 "<<: *a", "'", '"', "\t", "\x00", "1e400", "~", "?", "|", ">", "%YAML 1.1", "---"])
keys = st.sampled_from(["name", "arch", "mtp", "stages", "execution", "execution.workers", "execution.max_memory",
                        "execution.device", "shard.mp", "dequant.dtype", "stages.0", "stages.0.shard", "verify.prompt",
                        "download.allow_patterns", "", ".", "a..b", "shard", "quantize.format", "merge.max_shard_size"])


def _check_cli(proc) -> None:
    if proc.returncode != 0:
        assert proc.returncode in (1, 2), proc.stderr
        assert proc.stderr.startswith("error: ") and "fix: " in proc.stderr, proc.stderr
        assert "error: unexpected" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@FUZZ
@given(cut=st.integers(0, len(RECIPE)), insert=st.lists(yaml_snippets | st.text(max_size=6), max_size=4),
       raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_recipe_text_is_a_recipe_or_a_recipe_error(tmp_path_factory, cut, insert, raw):
    path = tmp_path_factory.mktemp("r") / "r.yaml"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text(RECIPE[:cut] + "".join(insert) + RECIPE[cut:], encoding="utf-8", errors="surrogatepass") \
            if not any("\ud800" <= c <= "\udfff" for c in "".join(insert)) else path.write_text(RECIPE)
    try:
        recipe = load_recipe(path)
        recipe.job()
    except CkptError:
        pass


@FUZZ
@given(items=st.lists(st.tuples(keys | st.text(max_size=10), st.booleans(),
                                 json_values.map(json.dumps) | yaml_snippets | st.text(max_size=10)), max_size=4))
def test_set_overrides_are_applied_or_refused(tmp_path_factory, items):
    path = tmp_path_factory.mktemp("r") / "r.yaml"
    path.write_text(RECIPE)
    overrides = [f"{k}={v}" if eq else f"{k}{v}" for k, eq, v in items]
    try:
        load_recipe(path, overrides).job()
    except CkptError:
        pass


@pytest.fixture(scope="module")
def shards_only(tiny_v3, tmp_path_factory):
    """The tiny checkpoint's files without config.json, to pair with fuzzed configs."""
    root = tmp_path_factory.mktemp("fuzz-config")
    for p in tiny_v3.iterdir():
        if p.name != "config.json":
            (root / p.name).symlink_to(p)
    return root, json.loads((tiny_v3 / "config.json").read_text())


@FUZZ
@given(edits=st.dictionaries(st.sampled_from(["model_type", "hidden_size", "num_hidden_layers", "n_routed_experts",
                                              "num_attention_heads", "vocab_size", "q_lora_rank", "kv_lora_rank",
                                              "first_k_dense_replace", "n_group", "topk_group", "num_nextn_predict_layers",
                                              "quantization_config", "moe_intermediate_size", "intermediate_size",
                                              "torch_dtype", "scoring_func", "num_key_value_heads", "head_dim",
                                              "tie_word_embeddings", "num_local_experts", "rope_scaling"]),
                             json_values, max_size=3),
       drop=st.lists(st.sampled_from(["model_type", "hidden_size", "n_routed_experts", "quantization_config"]), max_size=2),
       mp=st.sampled_from(["1", "2"]))
def test_a_config_is_planned_or_refused_quickly(tmp_path_factory, shards_only, edits, drop, mp):
    root, config = shards_only
    d = tmp_path_factory.mktemp("c")
    for p in root.iterdir():
        (d / p.name).symlink_to(os.readlink(p))
    config = {k: v for k, v in {**config, **edits}.items() if k not in drop}
    (d / "config.json").write_text(json.dumps(config))
    _check_cli(run_cli("plan", d, "--mp", mp, check=False))
