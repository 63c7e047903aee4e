"""`ckpttool merge SRC DST`: model{i}-mp{N}.safetensors back to an HF checkpoint (the inverse of shard)."""

from __future__ import annotations

import json
from typing import Annotated, Optional

import typer

from ckpttool.cli.app import app
from ckpttool.cli.options import Dst, Json, Quiet, Src
from ckpttool.execute import default_workers
from ckpttool.runner import parse_size


@app.command()
def merge(src: Src, dst: Dst,
          max_shard_size: Annotated[str, typer.Option(
              "--max-shard-size", help="Largest output file before splitting into model-0000i-of-0000n (default 50GB, as transformers).")] = "50GB",
          max_memory: Annotated[Optional[str], typer.Option("--max-memory", help="Memory budget for tensors in flight (default 4GiB).")] = None,
          workers: Annotated[Optional[int], typer.Option("--workers", min=1, help="Parallel tensor workers.")] = None,
          overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace ckpttool output already in DST.")] = False,
          resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted merge in DST.")] = False,
          dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan and exit; reads no weights.")] = False,
          quiet: Quiet = False, json_: Json = False) -> None:
    """mp shards (any layout ckpttool writes: DeepSeek, dense; BF16 or FP8 with scales) -> HF checkpoint.

    The same key table read backwards: split tensors are concatenated, replicated ones taken once, experts
    gathered from their ranks, FP8 `.scale` back to `weight_scale_inv`. shard then merge is byte-identical.

    Example: ckpttool merge ./llama-mp4 ./llama-hf
    """
    from ckpttool.merge import merge as run_merge, plan_merge

    if dry_run:
        plan = plan_merge(src, max_shard_bytes=parse_size(max_shard_size))
        report = {"src": str(src), "format": plan.format, "plan_hash": plan.hash, "tensors": plan.tensor_count,
                  "bytes_to_write": plan.bytes_to_write, "files": [{"name": f.name, "tensors": len(f.tensors),
                                                                    "bytes": f.size} for f in plan.files]}
        print(json.dumps(report, indent=2) if json_ else
              "\n".join([f"plan {plan.hash[:12]}  (merge: {src} -> hf layout)"]
                        + [f"  {f['name']}  {f['tensors']} tensors  {f['bytes'] / 1e9:.3f} GB" for f in report["files"]]))
        return
    result = run_merge(src, dst, max_shard_bytes=parse_size(max_shard_size),
                       max_memory=parse_size(max_memory or "4GiB"), workers=workers or default_workers(),
                       overwrite=overwrite, resume=resume, quiet=quiet or json_)
    if json_:
        print(json.dumps({"ok": True, **result.summary()}, indent=2))
    elif not quiet:
        print(f"merged into {len(result.plan.files)} files, {result.plan.tensor_count} tensors, "
              f"{result.bytes_written / 1e9:.3f} GB in {result.dst} ({result.seconds:.2f}s)")
