"""Checks every family's tests make the same way: verify against transformers' own model, and merge back."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from ckpttool.verify.run import run_verify


def verify_equals_transformers(mp_dir, hf, ids, logits, tmp_path, prompt, new_tokens, tolerance=1e-3):
    """`verify` of the shards in `mp_dir` against transformers' model of `hf` passes, generates transformers' greedy
    `ids` and logits within `tolerance` of its `logits`; returns the report for the family's own checks."""
    report = run_verify(mp_dir, prompt_ids=prompt, max_new_tokens=new_tokens, device="cpu", reference=hf,
                        logits_path=tmp_path / "logits.safetensors")
    assert report.ok, report.render(mp_dir)
    assert report.generated_ids == ids
    assert (load_file(str(tmp_path / "logits.safetensors"))["logits"] - logits).abs().max() < tolerance
    return report


def assert_same_tensors(original: dict, merged: dict) -> None:
    """The same names, dtypes and values: what merge must give back."""
    assert original.keys() == merged.keys()
    for name, tensor in original.items():
        assert tensor.dtype == merged[name].dtype and torch.equal(tensor, merged[name]), name
