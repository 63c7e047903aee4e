"""What a verify stage needs, checked before its conversion starts (no torch): a prompt it can encode, and
an input small enough to serve as the reference."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ckpttool.dtypes import itemsize
from ckpttool.errors import RecipeError
from ckpttool.io.checkpoint import Checkpoint

REFERENCE_RAM_FRACTION = 0.25
"""verify's reference runs unsharded in float32 on one process: the input is compared only when its
float32 size is at most this share of the machine's memory"""


def check_prompt_source(src: Path | set[str]) -> None:
    """A verify stage that continues a text prompt needs the input's tokenizer.json (copied beside the
    output) and the `tokenizers` package: said before converting, not after publishing. `src`: the input
    directory, or the names of a hub repo's files."""
    has = (src / "tokenizer.json").is_file() if isinstance(src, Path) else "tokenizer.json" in src
    missing = None if has else "the input has no tokenizer.json to encode it with"
    if missing is None and importlib.util.find_spec("tokenizers") is None:
        missing = "the `tokenizers` package is not installed (pip install 'ckpttool[verify]')"
    if missing:
        raise RecipeError(f"the verify stage continues a text prompt, and {missing}",
                          file=src if isinstance(src, Path) else None,
                          fix="give token ids instead: --prompt-ids 0,5,9 (convert --verify), or "
                              "verify: {prompt_ids: [0, 5, 9]} in a recipe")


def input_reference(src: Path) -> tuple[Path | None, str | None]:
    """The input as verify's reference where loading it whole is safe here, else (None, why not)."""
    with Checkpoint(src) as ckpt:
        elements = sum(t.info.nbytes // itemsize(t.info.dtype) for t in ckpt.tensors.values())
    need = elements * 4
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > REFERENCE_RAM_FRACTION * ram:
        return None, (f"comparing with the input would load it whole in float32 ({need / 2**30:.1f} GiB, over "
                      f"{REFERENCE_RAM_FRACTION:.0%} of this machine's {ram / 2**30:.0f} GiB); run "
                      "`ckpttool verify DST --reference SRC` on a larger machine")
    return src, None
