"""Layouts: how a checkpoint lies on disk (HF, model-parallel shards, torch distributed checkpoints), one row
each (row.py says what a row holds, table.py is the table)."""
