"""CLI root: the entry point, which runs the app (cli/app.py: one module per command, registered
explicitly) and maps CkptError to a message and an exit code."""

from __future__ import annotations

import os
import sys

import click
import typer

from ckpttool.cli.app import app
from ckpttool.errors import CkptError

# typer >= 0.23 vendors its own click: usage errors and aborts come from either package
USAGE_ERRORS = tuple({click.ClickException,
                      next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")})
ABORTS = tuple({click.Abort, typer.Abort})


def main(argv: list[str] | None = None) -> int:
    """Entry point. CkptError becomes a one-paragraph message and a non-zero exit code, with no
    traceback unless CKPTTOOL_DEBUG=1. Returns the exit code when called with argv (tests)."""
    try:
        code = app(args=argv, prog_name="ckpttool", standalone_mode=False)
    except USAGE_ERRORS as exc:
        exc.show()
        code = exc.exit_code
    except ABORTS:
        print("aborted", file=sys.stderr)
        code = 130
    except CkptError as exc:
        if os.environ.get("CKPTTOOL_DEBUG") == "1":
            raise
        print(f"error: {exc}", file=sys.stderr)
        code = exc.exit_code
    code = code if isinstance(code, int) else 0
    if argv is None:
        sys.exit(code)
    return code


def entry() -> None:
    """The `ckpttool` executable and `python -m ckpttool`: main(), then leave without the
    interpreter's teardown. Whatever a command wrote is durable and closed before main() returns,
    and unloading torch and destroying a CUDA context took 0.5-1.5 s of every run's wall time
    (bench/RESULTS.md). In-process callers (tests) use main() and get SystemExit as usual."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
