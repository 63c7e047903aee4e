"""The typer app, with every command registered explicitly, in the order `--help` lists them."""

from typing import Annotated

import typer

from ckpttool.version import __version__
from ckpttool.cli import demo, download, inspect, pipeline, quantize, verify

app = typer.Typer(
    name="ckpttool",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        print(f"ckpttool {__version__}")
        raise typer.Exit()


@app.callback()
def root(ctx: typer.Context,
         version: Annotated[bool, typer.Option("--version", "-V", callback=_print_version, is_eager=True,
                                              help="Print ckpttool's version and exit.")] = False,
         verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Say more: the traceback behind an error, and "
                                                                       "where a conversion's time went.")] = False
         ) -> None:
    """Convert, dequantize, shard and verify large MoE checkpoints with bounded memory.

    Example: ckpttool demo ./demo-out
    """
    ctx.obj = {"verbose": verbose}  # read by commands through the root context (cli/options.verbose)

COMMANDS = (
    ("download", download.download),
    ("dequant", pipeline.dequant),
    ("shard", pipeline.shard),
    ("convert", pipeline.convert),
    ("quantize", quantize.quantize),
    ("run", pipeline.run),
    ("plan", pipeline.plan),
    ("inspect", inspect.inspect),
    ("verify", verify.verify),
    ("merge", pipeline.merge),
    ("demo", demo.demo),
)
for _name, _command in COMMANDS:
    app.command(_name)(_command)
