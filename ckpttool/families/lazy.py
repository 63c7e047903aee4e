"""A family's verifier, imported only when verify runs (its weights module pulls in torch and the model)."""

from __future__ import annotations

import importlib
from typing import Callable


def verifier_in(package: str) -> Callable[[], object]:
    """The `VERIFIER` of `{package}.weights`, imported when first asked for: Family.verifier's value."""
    def load():
        return importlib.import_module(f"{package}.weights").VERIFIER

    return load
