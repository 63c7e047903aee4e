"""What a layout row holds: how a checkpoint lies on disk, as an output and as an input.

A layout is one way of putting a model's tensors into files: HF (safetensors + index, HF names, each tensor
whole in one file), the model-parallel files `model{i}-mp{N}.safetensors` (the family's native names: DeepSeek's
reference layout for the MLA types, ours for the dense / MoE / gpt-oss families, DeepSeek-V4's), and torch
distributed checkpoints (`.metadata` + `.distcp`). Each is one `Layout` row (layouts/table.py); the planner,
inspect, merge and verify ask the row, never the layout's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True, kw_only=True)
class Layout:
    name: str
    """`hf`, `mp`, `dcp`: what a plan, its report and the manifest call the output's format, and `--layout`"""
    title: str
    """how inspect and the plan describe it"""
    per_rank: bool
    """its files are per model-parallel rank (a tensor's name repeats across them), not one model's"""
    native_names: bool
    """tensors are named by the family's native table (mp), not by their HF names"""
    suffix: str
    """every output file it writes ends so"""

    # -- as an output --------------------------------------------------------------------------------
    keeps_mtp: Callable[[object], bool]
    """the default for multi-token-prediction layers, given the family (`--keep-mtp` / `--drop-mtp` decide else)"""
    place: Callable[..., list]
    """(tensors, family, cfg, ranks, files_of, input_files) -> tensors renamed, cut per rank and given their output
    file (`TensorPlan.file`, `narrow`); `ranks` None where the command gave no --mp; `input_files` the input's file
    names where it is in HF layout (an HF output keeps them), else None"""
    lay_out: Callable[..., list]
    """(tensors, file_order) -> the output files (plan.types.OutFile) with every byte offset"""
    index: Callable[[list, object], dict | None]
    """(files, family) -> model.safetensors.index.json, or None where the layout has none"""
    extras: Callable[[list, object], dict[str, bytes]]
    """(files, tensors) -> other files it writes beside the tensor files, by name (DCP's `.metadata`)"""
    quantize: tuple[str, ...] | None = None
    """the quantize stage's formats an output of this layout holds (None: all)"""
    unquantized: Callable[..., list] = lambda tensors, rules, keys: tensors
    """(tensors, the rules their quantized weights resolve by, the family's key table) -> the tensors with the
    quantized weights this layout holds dequantized (the table's mp dtype column) made so; others as they are"""

    # -- as an input ---------------------------------------------------------------------------------
    holds: Callable[[Path], bool]
    """whether a directory is in this layout (inspect, convert and merge decide by it, in table order)"""
    open: Callable[..., object]
    """(directory, config) -> its tensors under their HF names (io.checkpoint.Checkpoint's interface), what convert,
    dequant, shard and plan read; `config` a config.json to read instead of the one beside them, or None"""
    listing: Callable[[Path], tuple]
    """directory -> (ranks or None, [(file, name, dtype, shape, bytes)], config.json or {}): what inspect shows"""
    read_back: str | None = None
    """None where `merge` reads it (mp); else why not and what to run instead"""
    verify: str | None = None
    """None where `verify` loads it into the bundled model (mp); else why not"""

    def __repr__(self) -> str:
        return f"Layout({self.name})"


def no_extras(files: list, tensors: list) -> dict[str, bytes]:
    return {}
