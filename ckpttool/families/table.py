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
from ckpttool.families.gated_deltanet import FAMILY as GATED_DELTANET
from ckpttool.families.gpt_oss import FAMILY as GPT_OSS
from ckpttool.families.kimi_linear import FAMILY as KIMI_LINEAR
from ckpttool.families.llama4 import FAMILY as LLAMA4
from ckpttool.families.mimo import FAMILY as MIMO
from ckpttool.families.minimax_m3 import FAMILY as MINIMAX_M3
from ckpttool.families.moe import FAMILY as MOE
from ckpttool.families.multimodal import WRAPPERS, wrapped

TEXT_FAMILIES: tuple[Family, ...] = (DEEPSEEK, DEEPSEEK_V4, DENSE, GATED_DELTANET, GPT_OSS, KIMI_LINEAR, LLAMA4, MIMO, MOE,
                                     MINIMAX_M3)
_BY_NAME = {f.name: f for f in TEXT_FAMILIES}

FAMILIES: tuple[Family, ...] = (*TEXT_FAMILIES, *(wrapped(w, _BY_NAME[w.text_family]) for w in WRAPPERS))
"""every family: the text families, and each multimodal wrapper (families/multimodal.py) over its text tower's"""

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
