"""What every call to the hub shares (download.py, remote.py, stream.py): the failures a hub call may
raise, their translation into one error naming the repo, the files and the fix, and the hub's
progress bar silenced for --quiet."""

from __future__ import annotations

from pathlib import Path

import httpx2
from huggingface_hub import constants as hf_constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)
from huggingface_hub.utils import OfflineModeIsEnabled
from huggingface_hub.utils.tqdm import tqdm as hf_tqdm

from ckpttool.errors import CkptError, InputError

HUB_FAILURES = (OSError, httpx2.HTTPError, RevisionResolutionError)  # OSError covers HfHubHTTPError too


class HubUnreachable(InputError):
    """The hub did not answer (or answered 5xx): a caller may use the HF cache instead."""

    def __init__(self, where: str, cause: str):
        self.cause = cause
        super().__init__(f"{where}: the hub at {hf_constants.ENDPOINT} cannot be reached ({cause})",
                         fix="check the network, HF_ENDPOINT and any proxy, then re-run")


def unreachable(exc: BaseException) -> bool:
    """huggingface_hub's rule for falling back to the cache (HfApi.resolve_revision, snapshot_download): no
    answer (a transport error, not a misconfigured proxy's) or the hub down (HTTP 5xx). A 4xx is an answer."""
    if isinstance(exc, httpx2.ProxyError):
        return False
    if isinstance(exc, (httpx2.TransportError, OfflineModeIsEnabled)):
        return True
    return isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code >= 500


def translate(exc: Exception, where: str, offline: bool | str, *, missing: list[str] | None = None,
              root: Path | None = None) -> CkptError:
    """A hub or transport failure as one CkptError naming the repo, the files affected and the fix.
    `offline`: True under HF_HUB_OFFLINE, or why the cache alone was asked (the hub unreachable)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    login = "pass --token or set HF_TOKEN (or run `hf auth login`)"
    if isinstance(exc, GatedRepoError):
        return InputError(f"{where} is gated and this token has not been granted access",
                          fix=f"accept the license on the model page, then {login}")
    if isinstance(exc, RepositoryNotFoundError):
        return InputError(f"{where}: repository not found, or private and no valid token was sent",
                          fix=f"check the repo id; for a private repo {login}")
    if isinstance(exc, RevisionNotFoundError):
        return InputError(f"{where}: revision not found", fix="check --revision (a branch, tag or 40-hex commit)")
    if offline is True:
        return InputError(f"{where} is not fully in the local cache and HF_HUB_OFFLINE is set ({first})",
                          fix="unset HF_HUB_OFFLINE and run once with network access")
    if offline:
        return InputError(f"{where}: {offline}, and the HF cache does not hold it ({first})",
                          fix="check the network, HF_ENDPOINT and any proxy, then re-run")
    if missing is not None:  # the transfer phase: say which files are not there
        named = f"; not fetched: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}" if missing else ""
        return InputError(f"download of {where} stopped: {type(exc).__name__}: {first}{named}",
                          file=(root / missing[0]) if missing and root else None,
                          fix="re-run the same command: finished files are kept and are not fetched again")
    if isinstance(exc, (RevisionResolutionError, LocalEntryNotFoundError)):
        return InputError(f"{where}: the hub cannot be reached and the local cache does not have it ({first})",
                          fix="check the network, HF_ENDPOINT and any proxy, then re-run")
    if unreachable(exc):
        return HubUnreachable(where, f"{type(exc).__name__}: {first}")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return InputError(f"{where}: the hub answered HTTP {status} ({first})",
                          fix="retry later; check HF_ENDPOINT and the token if it persists")
    return InputError(f"{where}: cannot reach the hub at {hf_constants.ENDPOINT} ({type(exc).__name__}: {first})",
                      fix="check the network, HF_ENDPOINT and any proxy, then re-run")


class SilentTqdm(hf_tqdm):
    """The hub's progress bar class, always disabled: --quiet without touching global hub state."""

    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
