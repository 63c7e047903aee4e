"""`ckpttool verify DIR`: load the mp shards into the bundled model, generate, compare, report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpttool.cli.options import Json, Quiet, require_torch
from ckpttool.errors import InputError
from ckpttool.verify.defaults import DEFAULT_PROMPT, DEFAULT_TOLERANCE


def parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--prompt-ids {text!r} is not a comma-separated list of integers",
                         fix="pass e.g. --prompt-ids 0,5,9") from None


def verify(
    directory: Annotated[Path, typer.Argument(help="Directory with model{i}-mp{N}.safetensors and config.json.")],
    mp: Annotated[Optional[int], typer.Option("--mp", min=1, help="Ranks to run; default: from the file names.")] = None,
    prompt: Annotated[Optional[str], typer.Option(
        "--prompt", help=f"Text to continue, tokenized with DIR/tokenizer.json (default {DEFAULT_PROMPT!r}).")] = None,
    prompt_ids: Annotated[Optional[str], typer.Option(
        "--prompt-ids", help="Token ids to continue instead of --prompt, e.g. 0,5,9.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Greedy tokens to generate.")] = 8,
    device: Annotated[str, typer.Option("--device", help="cpu (gloo) | cuda (NCCL, one GPU per rank) | auto (cuda if enough GPUs).")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="Compute dtype: float32 | bfloat16.")] = "float32",
    reference: Annotated[Optional[Path], typer.Option(
        "--reference", help="HF checkpoint to compare logits with (the same model, run unsharded at mp=1).")] = None,
    tolerance: Annotated[Optional[float], typer.Option(
        "--tolerance", help=f"Max abs logit difference allowed (default {DEFAULT_TOLERANCE}).")] = None,
    attn: Annotated[str, typer.Option("--attn", help="Attention form: absorb | naive (same results).")] = "absorb",
    json_: Json = False,
    quiet: Quiet = False,
) -> None:
    """Prove a conversion: run the shards at mp=N, generate greedily, compare with the HF checkpoint.

    Checks, each PASS/FAIL: shards load strictly (every tensor, no extras, equal shapes); logits are
    finite; with --reference, logits match the unsharded model within --tolerance. Exit 0 only if all pass.
    --reference loads the whole HF checkpoint on rank 0: meant for models that fit one device.

    Example: ckpttool verify ./tiny-mp2 --reference ./tiny-hf --prompt-ids 0,5,9 --json

    Under torchrun each process is one rank: torchrun --nproc-per-node 8 $(which ckpttool) verify ./V3-mp8 --device cuda
    """
    require_torch("verify", "verify")
    from ckpttool.verify.run import reports_here, run_verify  # torch loads only when this command runs

    ids = parse_ids(prompt_ids) if prompt_ids is not None else None
    report = run_verify(directory, reference=reference, prompt=prompt, prompt_ids=ids, max_new_tokens=max_new_tokens,
                        device=device, dtype=dtype, tolerance=tolerance, mp=mp, attn_impl=attn)
    if reports_here():
        if json_:
            print(json.dumps(report.to_json()))
        elif not quiet or not report.ok:
            print(report.render(directory))
    if not report.ok:
        raise typer.Exit(1)
