"""The Hugging Face Hub as an input: `download` (download.py, with selection.py), a command's input named on
the hub (source.py: `repo@rev`, streamed or from the HF cache), planning from the hub's headers (remote.py) and
converting while the files arrive, with bounded disk (stream.py)."""

from ckpttool.hub.download import DownloadResult, FileReport, RemoteFile, download_checkpoint, is_repo_id

__all__ = ["DownloadResult", "FileReport", "RemoteFile", "download_checkpoint", "is_repo_id"]
