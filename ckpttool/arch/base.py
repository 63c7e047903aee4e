"""What the planner asks of an architecture. Adding a family is adding one of these, not a code path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ckpttool.arch.keymap import KeyMap
from ckpttool.errors import InputError


@dataclass(frozen=True, kw_only=True)
class Arch:
    name: str
    model_types: tuple[str, ...]
    key_map: KeyMap
    parse_config: Callable[[dict, object], Any]
    """HF config.json dict (and its path, for errors) -> a typed config."""
    expected_shapes: Callable[[Any, bool], dict[str, tuple[int, ...]]]
    """(config, with_mtp) -> every weight the checkpoint should hold; checked against the headers."""
    is_mtp_tensor: Callable[[Any, str], bool]
    num_experts: Callable[[Any], int]
    vocab_size: Callable[[Any], int]
    mtp_config_key: str | None = None
    """config.json field counting MTP layers, zeroed when they are dropped."""


_REGISTRY: dict[str, Arch] = {}


def register(arch: Arch) -> Arch:
    for model_type in arch.model_types:
        _REGISTRY[model_type] = arch
    return arch


def get_arch(config: dict, source: object = "config.json") -> Arch:
    # importing the family modules registers them
    from ckpttool.arch import deepseek  # noqa: F401

    model_type = config.get("model_type")
    if model_type not in _REGISTRY:
        raise InputError(
            f"unsupported model_type {model_type!r}", file=source,
            fix=f"supported: {', '.join(sorted(_REGISTRY))}; is config.json from this checkpoint?",
        )
    return _REGISTRY[model_type]
