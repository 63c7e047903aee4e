"""A command's input named on the hub: `namespace/name`, or `namespace/name@revision` (a branch, tag, PR
ref such as `refs/pr/3`, or commit), with `--revision` and `--token` as every `hf` command has them.

It is streamed (planned from the hub's headers, hub/remote.py) or downloaded into the HF cache first. When
the hub cannot be reached (no answer, or HTTP 5xx) the HF cache's copy is converted instead, as
huggingface_hub falls back to its cache, and a note says so; HF_HUB_OFFLINE=1 asks for the cache alone.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ckpttool.errors import InputError
from ckpttool.hub.client import HubUnreachable
from ckpttool.hub.download import download_checkpoint, is_repo_id
from ckpttool.hub.remote import RemoteRepo, offline, open_repo


def split_revision(text: str) -> tuple[str, str | None]:
    """`org/name@rev` -> (`org/name`, `rev`); without `@`, (text, None). The revision is everything after
    the first `@`, so `org/name@refs/pr/3` keeps its slashes."""
    repo_id, at, revision = text.partition("@")
    if at and not revision:
        raise InputError(f"{text!r} names no revision after '@'", fix="write namespace/name@revision, or drop the '@'")
    return repo_id, (revision if at else None)


def pick_revision(text: str, flag: str | None, recipe: str | None = None) -> tuple[str, str | None]:
    """(repo id, revision) from `repo@rev`, `--revision` and a recipe's download.revision, in that order;
    `repo@rev` and `--revision` naming two revisions is an error."""
    repo_id, at = split_revision(text)
    if at is not None and flag is not None and at != flag:
        raise InputError(f"the input names revision {at!r} and --revision {flag!r}", file=text,
                         fix="give the revision once: namespace/name@rev or --revision rev")
    return repo_id, at or flag or recipe


def open_input(repo_id: str, *, revision: str | None, token: str | None, allow_patterns: list[str] | None,
               ignore_patterns: list[str] | None, max_workers: int, verify_sha256: bool, stream: bool,
               quiet: bool) -> Path | RemoteRepo:
    """The repo planned from its headers (`stream`, online), else its copy in the HF cache, downloaded
    first (or, the hub unreachable or HF_HUB_OFFLINE set, only what the cache holds)."""
    if not is_repo_id(repo_id):
        raise InputError(f"{repo_id!r} is not a Hub repo id", fix="use namespace/name, e.g. deepseek-ai/DeepSeek-V3")
    cache_only = False
    if stream and not offline():
        try:
            return open_repo(repo_id, revision=revision, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns,
                             token=token)
        except HubUnreachable as exc:
            cache_only = True
            if not quiet:
                print(f"note: {exc.message}; converting the copy in the HF cache instead", file=sys.stderr)
    result = download_checkpoint(repo_id, revision=revision, allow_patterns=allow_patterns,
                                 ignore_patterns=ignore_patterns, max_workers=max_workers,
                                 verify_sha256=verify_sha256, token=token, quiet=quiet, local_files_only=cache_only)
    if result.offline_reason and not cache_only and not quiet and not offline():
        print(f"note: {result.offline_reason}; using the copy of {repo_id} in the HF cache", file=sys.stderr)
    return Path(result.path)
