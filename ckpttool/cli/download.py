"""`ckpttool download REPO_ID [FILES]...`: fetch a checkpoint (or some of its files) from the Hugging Face
Hub, as `hf download` does, and verify every file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ckpttool.cli.options import Json, Quiet, Revision, Token


def _legacy_destination(files: list[str], local_dir: Optional[Path]) -> Optional[Path]:
    """`ckpttool download REPO DST`, as earlier versions took it: a single argument that is a path (./d,
    ../d, /d, ~/d, or a directory that exists), never a bare name, which `hf download` reads as a file, nor
    `name/`, its folder of the repo."""
    if len(files) != 1 or local_dir is not None:
        return None
    text = files[0]
    if text.startswith(("./", "../", "/", "~")) or text in (".", "..") or \
            (not text.endswith("/") and Path(text).expanduser().is_dir()):
        return Path(text).expanduser()
    return None


def download(
    repo_id: Annotated[str, typer.Argument(help="Hub repo id, namespace/name (or namespace/name@revision).")],
    files: Annotated[Optional[list[str]], typer.Argument(
        help="Files to fetch, as `hf download` takes them (config.json; original/ for a folder); none: every file "
             "--include/--exclude select. A single path (./dir, /dir, ~/dir, or a directory that exists) is the "
             "destination, as --local-dir, as earlier versions took it.")] = None,
    local_dir: Annotated[Optional[Path], typer.Option(
        "--local-dir", help="Download into this directory (absent, empty, or an earlier download of this repo) "
                            "instead of the HF cache.")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option(
        "--cache-dir", help="The HF cache to download into (default: HF_HUB_CACHE, ~/.cache/huggingface/hub).")] = None,
    revision: Revision = None,
    include: Annotated[Optional[list[str]], typer.Option(
        "--include", help="Fetch only files matching this glob, e.g. '*.safetensors'; repeatable.")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option(
        "--exclude", help="Skip files matching this glob, e.g. 'original/*'; repeatable.")] = None,
    max_workers: Annotated[int, typer.Option("--max-workers", min=1, help="Files fetched and checked at once.")] = 8,
    verify_sha256: Annotated[bool, typer.Option(
        "--verify-sha256", help="Also hash every file against the hub's LFS sha256 (git sha1 for small files).")] = False,
    token: Token = None,
    quiet: Quiet = False,
    json_out: Json = False,
) -> None:
    """Download a checkpoint, or some of its files, from the Hugging Face Hub and verify every file.

    Each file's size and safetensors header are checked (and with --verify-sha256 its hash); a file that
    fails is fetched once more, then reported and deleted. When the hub cannot be reached, the HF cache's
    copy is checked and used, as huggingface_hub does. HF_ENDPOINT, HF_TOKEN, HF_HUB_CACHE and
    HF_HUB_OFFLINE apply.

    Example: ckpttool download deepseek-ai/DeepSeek-V3 --local-dir ./dsv3 --exclude 'original/*' --verify-sha256

    Example: ckpttool download deepseek-ai/DeepSeek-V3 config.json   (one file into the HF cache; prints its path)
    """
    from ckpttool.hub import download_checkpoint  # huggingface_hub loads only when this command runs
    from ckpttool.hub.source import pick_revision

    files = list(files or [])
    legacy = _legacy_destination(files, local_dir)
    if legacy is not None:
        files, local_dir = [], legacy
    if files and (include or exclude) and not quiet:  # as `hf download`
        print("note: --include/--exclude are ignored: files are named", file=sys.stderr)
    repo_id, revision = pick_revision(repo_id, revision)
    result = download_checkpoint(repo_id, local_dir, revision=revision, files=files or None,
                                 allow_patterns=None if files else include, ignore_patterns=None if files else exclude,
                                 max_workers=max_workers, verify_sha256=verify_sha256, token=token, quiet=quiet,
                                 cache_dir=cache_dir)
    one = files[0] if len(files) == 1 and not files[0].endswith("/") else None  # `hf download REPO FILE`: its path
    if json_out:
        typer.echo(json.dumps({**result.to_json(), **({"file": str(result.path / one)} if one else {})}, indent=2))
    elif quiet:
        typer.echo(str(result.path / one if one else result.path))  # so `DIR=$(ckpttool download -q ...)` works
    else:
        typer.echo(render_summary(result, one))


def render_summary(result, one: str | None = None) -> str:
    """Human summary of a ckpttool.hub.DownloadResult (`one`: the single file asked for)."""
    headers = sum(f.header_checked for f in result.files)
    hashed = [f for f in result.files if f.hash_checked]
    cached = f" from the local cache ({result.offline_reason})" if result.offline else ""
    lines = [f"{result.repo_id}@{result.revision} (commit {result.commit[:12]}){cached} -> "
             f"{result.path / one if one else result.path}",
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
