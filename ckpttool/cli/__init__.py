"""CLI root: assembles the app from one module per command and maps CkptError to an exit code."""

from __future__ import annotations

import importlib
import os
import sys

import click

from ckpttool.cli.app import app
from ckpttool.errors import CkptError

COMMAND_MODULES = ("download", "pipeline", "inspect", "verify", "merge", "demo")

for _name in COMMAND_MODULES:  # each module attaches its command(s) to `app`
    importlib.import_module(f"ckpttool.cli.{_name}")

def main(argv: list[str] | None = None) -> int:
    """Entry point. CkptError becomes a one-paragraph message and a non-zero exit code, with no
    traceback unless CKPTTOOL_DEBUG=1. Returns the exit code when called with argv (tests)."""
    try:
        code = app(args=argv, prog_name="ckpttool", standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        code = exc.exit_code
    except click.Abort:
        print("aborted", file=sys.stderr)
        code = 130
    except CkptError as exc:
        if os.environ.get("CKPTTOOL_DEBUG") == "1":
            raise
        print(f"error: {exc}", file=sys.stderr)
        code = exc.exit_code
    code = code if isinstance(code, int) else 0
    if argv is None:
        # Whatever the command wrote is durable and closed by now (fsynced before it returned), so
        # skip the interpreter's teardown: unloading torch and destroying a CUDA context took
        # 0.5-1.5 s of every run's wall time (bench/RESULTS.md).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
