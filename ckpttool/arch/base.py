"""What the planner asks of an architecture. Adding a family is adding one of these, not a code path."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

from ckpttool.arch.keymap import KeyMap
from ckpttool.errors import InputError


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """A split along whole heads: `dim` is `heads` equal groups, where `count` names the field of the
    parsed config holding `heads`. Ranks take contiguous heads; with fewer heads than ranks and
    `replicate`, rank r takes head r * heads // mp (GQA: each rank gets the KV head its queries use)."""

    dim: int
    count: str
    replicate: bool = False

    def ranges(self, size: int, heads: int, mp: int) -> list[tuple[int, int]] | str:
        """(start, length) along `dim` per rank, or why no such cut exists."""
        if heads <= 0 or size % heads:
            return f"dim {self.dim} ({size}) is not {heads} whole heads"
        group = size // heads
        if heads % mp == 0:
            part = size // mp
            return [(r * part, part) for r in range(mp)]
        if self.replicate and mp % heads == 0:
            return [((r * heads // mp) * group, group) for r in range(mp)]
        need = f"mp dividing {heads}" + (f" or a multiple of {heads}" if self.replicate else "")
        return f"{heads} heads ({self.count}) cannot be cut evenly over mp={mp}: choose an {need}"


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
    check_mp: Callable[[Any, int], None] = lambda cfg, mp: None
    """Raise PlanError unless every cut at this mp is even along whole units (heads, experts, vocab):
    tensor sizes alone can divide evenly and still cut a head in half."""
    mtp_config_key: str | None = None
    """config.json field counting MTP layers, zeroed when they are dropped."""
    quantizable: Callable[[str], bool] | None = None
    """HF weight name -> whether the quantize stage turns it into a low-precision weight (linear
    projections); None: this family has no quantize support."""


_REGISTRY: dict[str, Arch] = {}


def register(arch: Arch) -> Arch:
    for model_type in arch.model_types:
        _REGISTRY[model_type] = arch
    return arch


def get_arch(config: dict, source: object = "config.json") -> Arch:
    # importing the family modules registers them
    from ckpttool.arch import deepseek, dense, gpt_oss  # noqa: F401

    model_type = config.get("model_type")
    if model_type not in _REGISTRY:
        raise InputError(
            f"unsupported model_type {model_type!r}", file=source,
            fix=f"supported: {', '.join(sorted(_REGISTRY))}; is config.json from this checkpoint?",
        )
    return _REGISTRY[model_type]


def attention_shapes(shapes: dict, prefix: str, hidden: int, q_out: int, kv_out: int, *,
                     qkv_bias: bool, o_bias: bool) -> None:
    """HF q/k/v/o projection shapes (and biases) of a standard multi-head / GQA attention block."""
    for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
        shapes[f"{prefix}self_attn.{proj}.weight"] = (out, hidden)
        if qkv_bias:
            shapes[f"{prefix}self_attn.{proj}.bias"] = (out,)
    shapes[f"{prefix}self_attn.o_proj.weight"] = (hidden, q_out)
    if o_bias:
        shapes[f"{prefix}self_attn.o_proj.bias"] = (hidden,)


@contextmanager
def config_fields(source: object):
    """Reading a family's fields out of config.json: a missing or mistyped field becomes an error
    naming the file, not a KeyError from deep inside a parser."""
    try:
        yield
    except KeyError as exc:
        raise InputError(f"config.json lacks required field {exc.args[0]!r}", file=source,
                         fix="use the config.json published with the checkpoint") from None
    except (TypeError, ValueError) as exc:
        raise InputError(f"config.json has a field of the wrong type: {exc}", file=source,
                         fix="use the config.json published with the checkpoint") from None
