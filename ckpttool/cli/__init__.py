"""CLI root: assembles the app from one module per command and maps CkptError to an exit code."""

from __future__ import annotations

import importlib
import os
import sys

from ckpttool.cli.app import app
from ckpttool.errors import CkptError

COMMAND_MODULES = ("pipeline", "inspect", "demo")
OPTIONAL_COMMAND_MODULES = ("verify", "download")  # added by their owners; absent until they land

for _name in COMMAND_MODULES:
    importlib.import_module(f"ckpttool.cli.{_name}")
for _name in OPTIONAL_COMMAND_MODULES:
    try:
        importlib.import_module(f"ckpttool.cli.{_name}")
    except ModuleNotFoundError as _exc:
        if _exc.name != f"ckpttool.cli.{_name}":
            raise


def main() -> None:
    """Entry point: CkptError becomes a one-paragraph message and a non-zero exit, no traceback
    unless CKPTTOOL_DEBUG=1."""
    try:
        app()
    except CkptError as exc:
        if os.environ.get("CKPTTOOL_DEBUG") == "1":
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
