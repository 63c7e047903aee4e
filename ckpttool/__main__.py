"""`python -m ckpttool` (also what `torchrun -m ckpttool` runs)."""

from ckpttool.cli import entry

entry()
