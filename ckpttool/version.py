"""The package's version, in the bottom layer: the plan, the manifest and `--version` all say it."""

__version__ = "0.1.0"
