"""The Hugging Face Hub as an input: `download` (download.py), planning from the hub's headers
(remote.py) and converting while the files arrive, with bounded disk (stream.py)."""

from ckpttool.hub.download import DownloadResult, FileReport, RemoteFile, download_checkpoint, is_repo_id, resolve_input

__all__ = ["DownloadResult", "FileReport", "RemoteFile", "download_checkpoint", "is_repo_id", "resolve_input"]
