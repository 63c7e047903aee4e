"""Architecture registry: model_type -> the tables and rules the planner needs."""

from __future__ import annotations

from ckpttool.arch.base import Arch, get_arch, register

__all__ = ["Arch", "get_arch", "register"]
