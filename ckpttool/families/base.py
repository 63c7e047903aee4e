"""What the planner, the recipe schema and verify ask of a model family: one `Family` row each.

A family's home is its folder (families/<name>/): its `FAMILY` row in `__init__.py`, `spec.py`
(config read as transformers reads it, key table, expected shapes, mp rules), `model.py` (the bundled
torch model verify runs), `weights.py` (loading shards or an HF checkpoint into it) and `demo.py`
(tiny real checkpoints). The rows are listed in families/table.py, the one table every command reads.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from ckpttool.errors import InputError, PlanError
from ckpttool.families.keymap import EXPERT, KeyMap, Segment
from ckpttool.formats import FP8_SCALE, with_leaf


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """A split along whole heads: `dim` is `heads` equal groups, where `count` names the field of the
    parsed config holding `heads`. Ranks take contiguous heads; with fewer heads than ranks and
    `replicate`, rank r takes head r * heads // mp (GQA: each rank gets the KV head its queries use)."""

    dim: int
    count: str
    replicate: bool = False
    width: str | None = None
    """where one table row serves layers with different head counts (MiMo's sliding layers have twice the KV
    heads): the heads are counted from the tensor, its size along `dim` over this config field (one head's
    width); `count` then names the usual count in messages"""

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

    def rank_ranges(self, weight_shape: tuple[int, ...], cfg, mp: int, *, tensor: str | None = None,
                    file=None) -> list[tuple[int, int]]:
        """(start, length) along `dim` of each rank's share of a weight (or bias) of a parsed config."""
        size = weight_shape[self.dim]
        heads = size // getattr(cfg, self.width) if self.width else getattr(cfg, self.count)
        ranges = self.ranges(size, heads, mp)
        if isinstance(ranges, str):
            raise PlanError(ranges, file=file, tensor=tensor, fix=f"choose an --mp that fits {self.count}")
        return ranges


class ConfigArgs:
    """Mixin of verify's args dataclasses that hold the parsed config as `cfg`: the vocabulary and
    depth verify asks every family's args for."""

    __slots__ = ()

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def n_layers(self) -> int:
        return self.cfg.num_hidden_layers


Q_HEADS = HeadSplit(dim=0, count="num_attention_heads")
KV_HEADS = HeadSplit(dim=0, count="num_key_value_heads", replicate=True)
O_HEADS = HeadSplit(dim=1, count="num_attention_heads")
"""The cuts of a GQA attention (q/k/v rows on whole heads, KV heads replicated when fewer than ranks,
o columns on whole query heads), for every family whose config has num_attention_heads,
num_key_value_heads and head_dim."""


def check_gqa_heads(cfg: Any, mp: int) -> None:
    """Refuse an mp that cuts a query head or neither splits nor replicates the KV heads evenly."""
    for split in (Q_HEADS, KV_HEADS):
        heads = getattr(cfg, split.count)
        problem = split.ranges(heads * cfg.head_dim, heads, mp)
        if isinstance(problem, str):
            raise PlanError(problem, file="config.json", fix=f"choose an --mp that fits {split.count}")


@dataclass(frozen=True, kw_only=True)
class Verifier:
    """verify's side of a family (torch code, imported only when verify runs)."""

    load_args: Callable[[dict, object], Any]
    """(config.json dict, its path) -> model args (with vocab_size, n_layers, eos_token_ids)"""
    build: Callable[..., Any]
    """(args, ParallelContext, dtype, attn_impl) -> model"""
    load_shard: Callable[..., int | dict[str, int]]
    """(model, model{rank}-mp{N}.safetensors[, skip=name -> bool]) -> how many tensors it skipped (parts the
    bundled model does not run: MTP layers, and those `skip` names), or that count by what they are; every
    other tensor is loaded strictly"""
    load_hf: Callable[..., None]
    """(model, HF checkpoint dir, n_layers[, prepare=ckpt -> None]) -> None, strictly, at mp=1; `prepare` runs
    on the opened checkpoint first (a multimodal wrapper names its text tower as the text family does)"""
    weight_differences: Callable[..., list[str]]
    """(model, ctx, HF dir, n_layers, shard path[, prepare=ckpt -> None]) -> what differs from the
    reference's slices"""


@dataclass(frozen=True, kw_only=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    """config.json `model_type` values this family reads"""
    key_map: KeyMap
    parse_config: Callable[[dict, object], Any]
    """HF config.json dict (and its path, for errors) -> a typed config."""
    expected_shapes: Callable[[Any, bool], dict[str, tuple[int, ...]]]
    """(config, with_mtp) -> every weight the checkpoint should hold; checked against the headers."""
    is_mtp_tensor: Callable[[Any, str], bool]
    num_experts: Callable[[Any], int]
    vocab_size: Callable[[Any], int]
    check_mp: Callable[[Any, int], None]
    """Raise PlanError unless every cut at this mp is even along whole units (heads, experts, vocab):
    tensor sizes alone can divide evenly and still cut a head in half."""
    verifier: Callable[[], Verifier]
    """verify's model and loaders, imported on first call (torch)"""
    mtp_config_key: str | None = None
    """config.json field counting MTP layers, zeroed when they are dropped ("text_config.x": x of the nested
    text config; the parsed config holds it under its last name)."""
    mtp_in_mp: bool = False
    """whether the family's reference mp layout keeps the MTP layers (DeepSeek-V4's convert.py does,
    V3's drops them): `--keep-mtp` / `--drop-mtp` left unsaid, mp shards follow it"""
    quantize: bool = False
    """whether the quantize stage supports this family; which weights it quantizes is the key
    table's LINEAR column (`quantizable`)"""
    key_maps: dict[str, KeyMap] = field(default_factory=dict)
    """model_type -> its own key table, where the family's model types name tensors differently
    (Mixtral's `block_sparse_moe.experts.E.w1` against Qwen's `mlp.experts.E.gate_proj`); `keys(cfg)`"""
    transformers_types: dict[str, str] = field(default_factory=dict)
    """model_type -> the transformers model_type implementing it, where transformers names it otherwise
    (Kimi-K2 ships remote code for the DeepSeek-V3 architecture): verify's oracle"""
    buffers: tuple[str, ...] = ()
    """name endings (after a `.`) of tensors transformers' model holds as buffers, not parameters (the router's
    `e_score_correction_bias`, DeepSeek-V4's `tid2eid`): the index's `total_parameters`, as transformers writes
    it (`model.num_parameters()`), leaves them out"""
    key_map_of: Callable[[Any], KeyMap] | None = None
    """parsed config -> its key table, where one model type's checkpoints come in several spellings
    (DeepSeek-V4: DeepSeek's own names, or transformers' save_pretrained's); `keys(cfg)`"""
    refused_types: dict[str, str] = field(default_factory=dict)
    """model_type -> why this family does not read it, for a relative it is often mistaken for
    (DeepSeek-V4.1 beside V4): `family_for` says so instead of listing the supported types"""
    spelled: Callable[[Any, Any], Any] | None = None
    """(parsed config, tensor names) -> the config bound to the spelling those names use, where the config
    alone does not tell (a multimodal wrapper's text tower: the hub's `language_model.model.*` or transformers'
    `model.language_model.*`); the planner calls it with the checkpoint's names before anything reads them,
    merge with the shards' (the parts a wrapper passes through keep their names there)"""
    stacked_experts: Callable[[Any], dict[str, int]] | None = None
    """config -> experts per stack kind where not num_experts (LongCat: zero experts in gate_up_proj only)"""
    explicit_config: Callable[[dict, object], dict] | None = None
    """(config.json dict, its path) -> the same config with the routing and rope fields stated that
    transformers fills from its class defaults (or hard-codes) and omits when it saves a config:
    engines read other defaults for them (vLLM and llama.cpp route a DeepSeek-V3 without
    `topk_method`/`scoring_func` with softmax). HF outputs carry this config."""

    def expected_for(self, cfg: Any, with_mtp: bool, *, n_tensors: int, source: object) -> dict[str, tuple[int, ...]]:
        """expected_shapes, after a check that costs nothing: each layer (and, where the table names
        tensors per expert, each expert) holds at least one tensor, so a config counting more of them
        than the headers hold tensors is wrong, and expanding it (1e8 experts) would run for minutes."""
        counts = {"num_hidden_layers": getattr(cfg, "num_hidden_layers", 0)}
        if self.mtp_config_key and with_mtp:  # MTP layers are layers too (a fuzzed 2^30 once ran out of memory)
            counts[self.mtp_config_key] = getattr(cfg, self.mtp_config_key.split(".")[-1], 0)
            if all(isinstance(c, int) for c in counts.values()):
                counts["layers with MTP"] = sum(counts.values())
        if any("expert" in row.fields for row in self.key_map.rows):
            counts["experts"] = self.num_experts(cfg)
        for field_name, count in counts.items():
            if not isinstance(count, int) or count < 0 or count > n_tensors:
                raise InputError(f"config.json's {field_name} = {count} cannot describe a checkpoint of {n_tensors} "
                                 "tensors", file=source, fix="use the config.json published with the checkpoint")
        return self.expected_shapes(cfg, with_mtp)

    def keys(self, cfg: Any) -> KeyMap:
        """The key table of a parsed config: the family's own choice (`key_map_of`), else by model_type."""
        if self.key_map_of is not None:
            return self.key_map_of(cfg)
        return self.key_maps.get(getattr(cfg, "model_type", None), self.key_map)

    def quantizable(self, cfg: Any, hf_name: str) -> bool:
        """Whether the quantize stage quantizes this tensor: a linear projection in the type's own key table."""
        return self.quantize and self.keys(cfg).is_linear(hf_name)


def rank_slice(key_map: KeyMap, native: str, shapes: dict[str, tuple[int, ...]], cfg: Any, rank: int,
               world: int) -> tuple[str, tuple[int, int, int] | None]:
    """The HF tensor an mp parameter comes from, and the (dim, start, length) of it this rank holds
    (None: all of it, i.e. replicated, a whole routed expert, or mp=1 but for a `Segment`). `shapes` are
    the config's HF weight shapes (expected_shapes)."""
    mapped = key_map.to_hf(native)
    if mapped is None:
        raise KeyError(f"no HF name for model parameter {native!r}")  # a model/table mismatch: a bug here
    split = mapped.split
    if split is None or split == EXPERT or (world == 1 and not isinstance(split, Segment)):
        return mapped.name, None
    shape = shapes[mapped.hf_weight or mapped.name]
    if isinstance(split, (HeadSplit, Segment)):
        start, length = split.rank_ranges(shape, cfg, world)[rank]
        dim = split.dim
    else:
        dim, length = split, shape[split] // world
        start = rank * length
    if mapped.companion is not None:
        start, length = mapped.companion.scale_range(start, length)
    return mapped.name, (dim, start, length)


def layer_index(hf_name: str) -> int | None:
    """The decoder-layer index of an HF tensor name, or None for embed/norm/head."""
    parts = hf_name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


@dataclass(frozen=True, slots=True)
class Rope:
    """A config.json's rotary embedding, read as transformers 5 reads it (modeling_rope_utils)."""

    theta: float
    type: str  # "default", "yarn", "linear", "llama3", ...
    params: dict  # the whole parameter dict (factor, beta_fast, original_max_position_embeddings, ...)


def read_rope(raw: dict, source: object, *, default_theta: float, types: tuple[str, ...]) -> Rope:
    """transformers' precedence, exactly: `rope_scaling` (older configs) replaces `rope_parameters`
    (what transformers 5 saves); `rope_theta` inside that dict wins over a top-level `rope_theta`,
    then the model's `default_theta`; the type is `rope_type`, else the legacy `type`, else default;
    scaled types without `original_max_position_embeddings` take a top-level one, else
    max_position_embeddings. A type this family's model does not implement, or per-layer-type
    (nested) parameters, are refused rather than approximated."""
    params = _rope_parameters(raw)
    if not isinstance(params, dict):
        raise InputError(f"rope parameters are a JSON {type(params).__name__}, not an object", file=source,
                         fix="use the config.json published with the checkpoint")
    params = dict(params)
    if any(isinstance(v, dict) for v in params.values()):
        raise InputError("per-layer-type rope parameters are not supported for this model", file=source,
                         fix="report this checkpoint; ckpttool reads one rope configuration per model")
    with config_fields(source):
        params["rope_theta"] = _rope_theta(params, raw, default_theta)
        kind = params.setdefault("rope_type", params.get("type", "default"))
        if kind in ("llama3", "yarn", "longrope"):
            params.setdefault("original_max_position_embeddings",
                              raw.get("original_max_position_embeddings", raw.get("max_position_embeddings")))
        theta = float(params["rope_theta"])
    if kind not in types:
        raise InputError(f"unsupported rope type {kind!r}", file=source,
                         fix=f"ckpttool's model for this family implements rope types: {', '.join(types)}")
    if not theta > 0:
        raise InputError(f"rope_theta {theta} is not a positive number", file=source,
                         fix="use the config.json published with the checkpoint")
    return Rope(theta=theta, type=kind, params=params)


def state_fields(raw: dict, fields: dict, *, theta: float | None) -> dict:
    """`raw` plus each of `fields` it lacks (None values are left out), and a top-level `rope_theta`
    where the rope parameters do not state one: the explicit config of Family.explicit_config. A value
    config.json states is kept as it is."""
    out = dict(raw)
    for name, value in fields.items():
        if name not in out and value is not None:
            out[name] = value
    if theta is not None and "rope_theta" not in out:
        out["rope_theta"] = theta
    return out


def rope_theta_of(raw: dict, default_theta: float) -> float | None:
    """The theta transformers reads (read_rope's precedence), or None where the rope parameters are
    not one flat dict (per-layer-type rope: left as config.json states it)."""
    params = _rope_parameters(raw)
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        return None
    theta = _rope_theta(params, raw, default_theta)
    return float(theta) if isinstance(theta, (int, float)) else None


def _rope_parameters(raw: dict) -> object:
    """`rope_scaling` (older configs) replaces `rope_parameters` (what transformers 5 saves)."""
    return raw.get("rope_scaling") or raw.get("rope_parameters") or {}


def _rope_theta(params: dict, raw: dict, default_theta: float) -> object:
    """`rope_theta` inside the rope parameters wins over a top-level one, then the model's default."""
    return params.get("rope_theta", raw.get("rope_theta", default_theta))


def eos_ids(raw: dict) -> tuple[int, ...]:
    """config.json's eos_token_id (an int, a list or absent) as a tuple."""
    eos = raw.get("eos_token_id")
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


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


STACKED_EXPERTS = re.compile(r"((?:\w+\.)*?model\.(?:\w+\.)*?)layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
                             r"(_scale_inv)?")
"""transformers 5's expert tensors as its models hold them (and as some checkpoints are saved): one
[E, 2I, H] `gate_up_proj` per layer (each expert's gate rows, then its up rows) and one [E, H, I]
`down_proj`, with FP8 block scales `*_scale_inv` stacked the same way; under `model.` or a wrapper's
prefix for its text tower (`model.language_model.`)"""
_STACKED_LEAVES = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}  # the native expert weights, in order


def unstack_experts(ckpt, keys: KeyMap, n_experts: int, held: dict[str, int] | None = None) -> int:
    """Read a checkpoint in transformers 5's own spelling as the key table's: stacked expert tensors
    as the table's per-expert weights (each part is a contiguous byte range of the stack, so nothing
    is copied; under `model.` or a wrapper's prefix for its text tower), and each name the table lists as
    an alias as the row's name. Returns how many stacks were split. A table that names the stacked tensors
    itself (gpt-oss) keeps them, and their scales. `held`: Family.stacked_experts."""
    for name in sorted(ckpt.tensors):
        canonical = keys.canonical(name)
        if canonical is None:
            continue
        src = ckpt.tensors[name]
        if canonical in ckpt.tensors:
            raise InputError(f"checkpoint holds both {canonical!r} and {name!r}, two spellings of one tensor",
                             file=ckpt.root / src.file, tensor=name,
                             fix="the checkpoint mixes transformers' own names and the published ones; re-download it")
        ckpt.split(name, [(canonical, src.info.shape)])
    split = 0
    for name in sorted(ckpt.tensors):
        match = STACKED_EXPERTS.fullmatch(name)
        if match is None or any(keys.to_native(n) is not None for n in (name, name.removesuffix("_scale_inv"))):
            continue  # a stack the table keeps, and its scales (gpt-oss's FP8 experts: formats/fp8_experts.py)
        prefix, layer, kind, scale = match.groups()
        per_expert = {r.native.split(".")[-2]: r.hf for r in keys.rows if r.split == EXPERT and r.companion is None
                      and r.hf.startswith(prefix + "layers.{layer}.")}
        leaves, src, experts = _STACKED_LEAVES[kind], ckpt.tensors[name], (held or {}).get(kind, n_experts)
        shape = src.info.shape
        if any(leaf not in per_expert for leaf in leaves) or len(shape) != 3 or shape[0] != experts \
                or shape[1] % len(leaves):
            raise InputError(f"stacked expert tensor of shape {list(shape)} is not [{experts} experts, "
                             f"{len(leaves)} x rows, columns] of the model config.json describes" +
                             (" (an FP8 scale block would straddle gate and up rows)" if scale else ""),
                             file=ckpt.root / src.file, tensor=name,
                             fix="check that config.json belongs to this checkpoint")
        rows, parts = shape[1] // len(leaves), []
        for e in range(experts):
            for leaf in leaves:
                weight = per_expert[leaf].format(layer=int(layer), expert=e)
                parts.append((with_leaf(weight, FP8_SCALE.hf_leaf) if scale else weight, (rows, shape[2])))
        ckpt.split(name, parts)
        split += 1
    return split
