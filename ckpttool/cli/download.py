"""`ckpttool download REPO_ID [DST]`: fetch a checkpoint from the Hugging Face Hub and verify every file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpttool.cli.options import Json, Quiet


def download(
    repo_id: Annotated[str, typer.Argument(help="Hub repo id, namespace/name.")],
    dst: Annotated[Optional[Path], typer.Argument(
        help="Directory to download into (absent, empty, or an earlier download); omitted: the HF cache.")] = None,
    revision: Annotated[Optional[str], typer.Option("--revision", help="Branch, tag or commit (default: main).")] = None,
    include: Annotated[Optional[list[str]], typer.Option(
        "--include", help="Fetch only files matching this glob; repeatable.")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option(
        "--exclude", help="Skip files matching this glob, e.g. 'original/*'; repeatable.")] = None,
    max_workers: Annotated[int, typer.Option("--max-workers", min=1, help="Files fetched and checked at once.")] = 8,
    verify_sha256: Annotated[bool, typer.Option(
        "--verify-sha256", help="Also hash every file against the hub's LFS sha256 (git sha1 for small files).")] = False,
    token: Annotated[Optional[str], typer.Option(
        "--token", help="Hub token; default: HF_TOKEN or the saved `hf auth login` token.")] = None,
    quiet: Quiet = False,
    json_out: Json = False,
) -> None:
    """Download a checkpoint from the Hugging Face Hub and verify every file before it is used.

    Each file's size and safetensors header are checked (and with --verify-sha256 its hash); a file that
    fails is fetched once more, then reported and deleted. HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE apply.

    Example: ckpttool download deepseek-ai/DeepSeek-V3 ./dsv3 --exclude 'original/*' --verify-sha256
    """
    from ckpttool.hub import download_checkpoint  # huggingface_hub loads only when this command runs

    result = download_checkpoint(repo_id, dst, revision=revision, allow_patterns=include, ignore_patterns=exclude,
                                 max_workers=max_workers, verify_sha256=verify_sha256, token=token,
                                 quiet=quiet)
    if json_out:
        typer.echo(json.dumps(result.to_json(), indent=2))
    elif quiet:
        typer.echo(str(result.path))  # so `DIR=$(ckpttool download -q ...)` works
    else:
        typer.echo(render_summary(result))


def render_summary(result) -> str:
    """Human summary of a ckpttool.hub.DownloadResult."""
    headers = sum(f.header_checked for f in result.files)
    hashed = [f for f in result.files if f.hash_checked]
    lines = [f"{result.repo_id}@{result.revision} (commit {result.commit[:12]})"
             f"{' from the local cache (offline)' if result.offline else ''} -> {result.path}",
             f"  {len(result.files)} files, {result.total_bytes / 1e9:.2f} GB; "
             f"{headers} safetensors headers checked"]
    if hashed:
        lines[-1] += f"; {len(hashed)} files hashed at {result.hash_gbps or 0:.2f} GB/s"
    unhashed = len(result.files) - len(hashed) if result.sha256_requested else 0
    if unhashed:
        lines.append(f"  {unhashed} files have no hub hash to check against"
                     f"{' (offline: the HF cache keeps sizes only)' if result.offline else ''}")
    if result.refetched:
        lines.append(f"  re-fetched after a failed check: {', '.join(result.refetched)}")
    return "\n".join(lines)
