"""The typer app object; command modules attach to it (see cli/__init__.py)."""

import typer

app = typer.Typer(
    name="ckpttool",
    help="Convert, dequantize, shard and verify large MoE checkpoints with bounded memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
