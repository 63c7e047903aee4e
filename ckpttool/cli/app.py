"""The typer app, with every command registered explicitly, in the order `--help` lists them."""

import typer

from ckpttool.cli import demo, download, inspect, pipeline, verify

app = typer.Typer(
    name="ckpttool",
    help="Convert, dequantize, shard and verify large MoE checkpoints with bounded memory.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

COMMANDS = (
    ("download", download.download),
    ("dequant", pipeline.dequant),
    ("shard", pipeline.shard),
    ("convert", pipeline.convert),
    ("run", pipeline.run),
    ("plan", pipeline.plan),
    ("inspect", inspect.inspect),
    ("verify", verify.verify),
    ("merge", pipeline.merge),
    ("demo", demo.demo),
)
for _name, _command in COMMANDS:
    app.command(_name)(_command)
