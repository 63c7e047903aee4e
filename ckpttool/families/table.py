"""THE table of model families: the planner, the recipe schema (`arch:`) and verify all read it.

Adding a family is one folder (families/<name>/: its FAMILY row in __init__.py, spec.py, model.py,
weights.py, demo.py) and one entry here. ARCHITECTURE.md walks through it.
"""

from __future__ import annotations

from ckpttool.errors import InputError
from ckpttool.families.base import Family
from ckpttool.families.deepseek import FAMILY as DEEPSEEK
from ckpttool.families.deepseek_v4 import FAMILY as DEEPSEEK_V4
from ckpttool.families.dense import FAMILY as DENSE
from ckpttool.families.gpt_oss import FAMILY as GPT_OSS
from ckpttool.families.moe import FAMILY as MOE

FAMILIES: tuple[Family, ...] = (DEEPSEEK, DEEPSEEK_V4, DENSE, GPT_OSS, MOE)

MODEL_TYPES: tuple[str, ...] = tuple(sorted(t for f in FAMILIES for t in f.model_types))
"""every config.json model_type ckpttool reads"""


def family_for(config: dict, source: object = "config.json") -> Family:
    """The family of a config.json (its `model_type`); anything else is an error listing the supported ones."""
    model_type = config.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
        if isinstance(model_type, str) and model_type in family.refused_types:
            raise InputError(f"model_type {model_type!r} is not supported: {family.refused_types[model_type]}",
                             file=source, fix=f"supported: {', '.join(MODEL_TYPES)}")
    raise InputError(f"unsupported model_type {model_type!r}", file=source,
                     fix=f"supported: {', '.join(MODEL_TYPES)}; is config.json from this checkpoint?")
