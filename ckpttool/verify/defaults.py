"""verify's defaults and the checks of its options, apart from verify.py so the CLI can show them without
importing torch."""

from ckpttool.errors import InputError

DTYPES = ("float32", "bfloat16")
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.15}
DEFAULT_PROMPT = "hello world"


def check_options(*, device: str, dtype: str, attn_impl: str, max_new_tokens: int, prompt, prompt_ids,
                  ranks_here: int, gpus: int) -> None:
    """Refuse what verify cannot run, before any rank starts. device: "cpu" or "cuda" ("auto" resolved by then);
    ranks_here: the ranks this machine runs (every one, or torchrun's LOCAL_WORLD_SIZE); gpus: the CUDA devices
    this process sees (NCCL takes one per rank: two ranks on one GPU fail inside NCCL)."""
    if device not in ("cpu", "cuda"):
        raise InputError(f"unknown device {device!r}", fix="use --device cpu, cuda or auto")
    if device == "cuda" and gpus < ranks_here:
        raise InputError(f"verify on CUDA runs one rank per GPU: {ranks_here} ranks here need {ranks_here} GPUs, "
                         f"this machine has {gpus}",
                         fix=f"pass --device cpu (gloo, the same checks) or run on a machine with {ranks_here} GPUs")
    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}", fix="use --dtype float32 or --dtype bfloat16")
    if attn_impl not in ("absorb", "naive"):
        raise InputError(f"unknown attention form {attn_impl!r}", fix="use --attn absorb or --attn naive")
    if max_new_tokens < 1:
        raise InputError("--max-new-tokens must be at least 1")
    if prompt is not None and prompt_ids is not None:
        raise InputError("give either --prompt or --prompt-ids, not both")
