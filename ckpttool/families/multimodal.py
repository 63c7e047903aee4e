"""Multimodal wrappers: the text tower of a family ckpttool reads, nested in a model whose config.json holds
it as `text_config` and whose checkpoint names it under a prefix, beside parts ckpttool carries unchanged
(a vision tower, a projector). Each wrapper is a row (`Wrapper`); `wrapped(row, text_family)` is its
Family, which reads every question about the text tower through the text family's own rows and tables.

What happens to each part:
- the text tower is converted, sharded and verified as the text family's model (its mp names are the
  text family's; merge writes it back in the hub's spelling, the row's first);
- the parts passed through keep their names, dtypes and bytes: in HF outputs where they were, in mp
  outputs whole on rank 0 (`model0-mpN.safetensors`), so `merge` puts them back byte for byte; verify
  skips them on rank 0 (and says so) and, given the reference, checks they equal its tensors.

A wrapper's checkpoints come in spellings config.json does not tell apart (the hub's
`language_model.model.layers.*`, transformers' `model.language_model.layers.*`, ...): the planner picks the
spelling its tensor names use (`Family.spelled`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Collection

from ckpttool.errors import InputError
from ckpttool.families.base import Family, Verifier
from ckpttool.families.keymap import KeyMap


@dataclass(frozen=True, slots=True)
class Spelling:
    """How one kind of checkpoint of a wrapper names its tensors."""

    title: str
    text: tuple[tuple[str, str], ...]
    """(the text family's name prefix, this spelling's), longest text prefix first where they nest"""
    passthrough: tuple[str, ...]
    """prefixes of the parts carried unchanged"""
    names: tuple[tuple[str, str], ...] = ()
    """(the text family's name template, this spelling's): tensors named one by one rather than under a prefix
    (Mistral's own names: `layers.{layer}.attention.wq.weight`), before the prefixes; a spelling with names but
    no prefixes names nothing of the text tower but these"""

    def wrap(self, name: str) -> str | None:
        """A text family's HF name (or template) in this spelling (None: one a spelling of names only lacks)."""
        if self.names and ((spelled := _respell(name, self.names, 0)) is not None or not self.text):
            return spelled
        for plain, spelled in self.text:
            if name.startswith(plain):
                return spelled + name[len(plain):]
        raise ValueError(f"{name!r} is under none of the text prefixes of {self.title}")  # a row bug

    def unwrap(self, name: str) -> str | None:
        """The text family's name of one of this spelling's text tower names; None for any other name."""
        if self.names and ((plain := _respell(name, self.names, 1)) is not None or not self.text):
            return plain
        for plain, spelled in self.text:
            if name.startswith(spelled):
                return plain + name[len(spelled):]
        return None


_FIELD = re.compile(r"\{\w+\}")


def _shape(name: str) -> str:
    return ".".join("{}" if p.isdigit() or _FIELD.fullmatch(p) else p for p in name.split("."))


@lru_cache(maxsize=None)
def _renames(names: tuple[tuple[str, str], ...], side: int) -> dict[str, tuple[str, str]]:
    return {_shape(pair[side]): (pair[side], pair[1 - side]) for pair in names}


def _respell(name: str, names: tuple[tuple[str, str], ...], side: int) -> str | None:
    """`name` (a template or a name) renamed by the pair whose `side` it matches, its numbers kept in order."""
    pair = _renames(names, side).get(_shape(name))
    if pair is None:
        return None
    source, target = pair
    values = iter(p for p, t in zip(name.split("."), source.split(".")) if _FIELD.fullmatch(t))
    return _FIELD.sub(lambda _: next(values), target)


@dataclass(frozen=True, slots=True, eq=False)  # hashed by identity: one object per row
class Wrapper:
    model_type: str
    title: str
    text_family: str
    """the name of the family that reads the text tower (families/table.py pairs them)"""
    text_types: tuple[str, ...]
    """the model_types its text config may name; the first is the class's default for one that names none"""
    spellings: tuple[Spelling, ...]
    """the first is the hub's, what merge writes"""
    defaults: dict = field(default_factory=dict)
    """the wrapper class's own defaults of the fields read here (`tie_word_embeddings`)"""
    tie_either: bool = False
    """the head is tied when either config says so (MiniMaxM3VLConfig); else the wrapper's field decides,
    whatever the text config says (Kimi_K25Config)"""
    refused: tuple[tuple[str, str], ...] = ()
    """(name prefix, why): spellings of this wrapper's checkpoints ckpttool does not read"""
    text_config: str = "text_config"


class WrappedConfig:
    """A wrapper's parsed config: the text tower's parsed config (`text`, whose fields it answers for), the
    row, and which spelling the checkpoint's names use."""

    __slots__ = ("text", "wrapper", "spelling", "text_keys")

    def __init__(self, text: Any, wrapper: Wrapper, spelling: int, text_keys: KeyMap):
        self.text, self.wrapper, self.spelling, self.text_keys = text, wrapper, spelling, text_keys

    def __getattr__(self, name: str):
        if name in WrappedConfig.__slots__:  # not yet set (copying, unpickling): no recursion through `text`
            raise AttributeError(name)
        return getattr(self.text, name)  # num_hidden_layers, num_nextn_predict_layers, ... of the text tower

    @property
    def model_type(self) -> str:
        return self.wrapper.model_type

    @property
    def spelled(self) -> Spelling:
        return self.wrapper.spellings[self.spelling]

    @property
    def keys(self) -> KeyMap:
        return _keys(self.wrapper, self.spelling, self.text_keys)

    def respelled(self, spelling: int) -> "WrappedConfig":
        return WrappedConfig(self.text, self.wrapper, spelling, self.text_keys)

    def text_name(self, name: str) -> str | None:
        return self.spelled.unwrap(name)


@lru_cache(maxsize=None)
def _keys(wrapper: Wrapper, spelling: int, text_keys: KeyMap) -> KeyMap:
    s = wrapper.spellings[spelling]
    return text_keys.renamed(s.wrap, passthrough=s.passthrough)


def text_config(wrapper: Wrapper, raw: dict, source: object) -> dict:
    """The text tower's config.json as its family reads it: `text_config`, its model_type defaulted as the
    wrapper class does, the wrapper's tie_word_embeddings (which is what ties the head), and the wrapper's
    quantization_config where the text config has none."""
    text = raw.get(wrapper.text_config)
    if not isinstance(text, dict):
        raise InputError(f"{wrapper.model_type} config.json has no {wrapper.text_config!r} object", file=source,
                         fix="use the config.json published with the checkpoint")
    model_type = text.get("model_type", wrapper.text_types[0])
    if model_type not in wrapper.text_types:
        raise InputError(f"{wrapper.text_config}.model_type {model_type!r} is not one of "
                         f"{', '.join(wrapper.text_types)}", file=source,
                         fix=f"ckpttool reads {wrapper.title} with a text tower of those types")
    tie = raw.get("tie_word_embeddings", wrapper.defaults.get("tie_word_embeddings", False))
    out = {**text, "model_type": model_type,
           "tie_word_embeddings": bool(tie or (wrapper.tie_either and text.get("tie_word_embeddings")))}
    if "quantization_config" in raw and "quantization_config" not in text:
        out["quantization_config"] = raw["quantization_config"]
    return out


def wrapped(wrapper: Wrapper, text: Family) -> Family:
    """The Family of a wrapper whose text tower `text` reads."""

    def parse(raw: dict, source: object = "config.json") -> WrappedConfig:
        cfg = text.parse_config(text_config(wrapper, raw, source), source)
        return WrappedConfig(cfg, wrapper, 0, text.keys(cfg))

    def is_mtp(cfg: WrappedConfig, name: str) -> bool:
        plain = cfg.text_name(name)
        return plain is not None and text.is_mtp_tensor(cfg.text, plain)

    def explicit(raw: dict, source: object = "config.json") -> dict:
        if text.explicit_config is None:
            return dict(raw)
        inner = raw[wrapper.text_config]
        stated = text.explicit_config(text_config(wrapper, raw, source), source)
        stated = {k: v for k, v in stated.items() if k in inner or k not in _INJECTED}
        return {**raw, wrapper.text_config: stated}

    s = wrapper.spellings[0]
    return Family(
        name=wrapper.model_type,
        model_types=(wrapper.model_type,),
        key_map=text.key_map.renamed(s.wrap, passthrough=s.passthrough),
        key_map_of=lambda cfg: cfg.keys,
        parse_config=parse,
        spelled=spelling_of,
        expected_shapes=lambda cfg, with_mtp: {cfg.spelled.wrap(n): shape for n, shape in
                                              text.expected_shapes(cfg.text, with_mtp).items()},
        is_mtp_tensor=is_mtp,
        num_experts=lambda cfg: text.num_experts(cfg.text),
        vocab_size=lambda cfg: text.vocab_size(cfg.text),
        check_mp=lambda cfg, mp: text.check_mp(cfg.text, mp),
        verifier=lambda: wrapped_verifier(wrapper, text.verifier(), parse),
        mtp_config_key=f"{wrapper.text_config}.{text.mtp_config_key}" if text.mtp_config_key else None,
        mtp_in_mp=text.mtp_in_mp,
        quantize=text.quantize,
        buffers=text.buffers,  # name endings: the same under the wrapper's prefix
        explicit_config=explicit,
    )


_INJECTED = ("model_type", "tie_word_embeddings", "quantization_config")
"""what text_config() adds to the text config for its family to read: not written into an output's text_config"""


def spelling_of(cfg: WrappedConfig, names: Collection[str]) -> WrappedConfig:
    """The config bound to the spelling under which the most names are the text tower's or passed through
    (the first on a tie); a spelling the row refuses is refused, naming a tensor and why."""
    for prefix, why in cfg.wrapper.refused:
        if (name := next((n for n in names if n.startswith(prefix)), None)) is not None:
            raise InputError(f"{cfg.wrapper.title} checkpoint named as {prefix}*: {why}", tensor=name,
                             fix="convert the checkpoint as published on the hub (or as transformers' "
                                 "save_pretrained writes it by default)")

    # the text family's own mp names (merge reads shards) tell no spelling apart: Mistral's `norm.weight` is one
    telling = [n for n in names if cfg.text_keys.to_hf(n) is None]

    def mapped(i: int) -> int:
        keys = cfg.respelled(i).keys
        return sum(keys.to_native(n) is not None for n in telling)
    return cfg.respelled(max(range(len(cfg.wrapper.spellings)), key=lambda i: (mapped(i), -i)))


def wrapped_verifier(wrapper: Wrapper, inner: Verifier, parse) -> Verifier:
    """verify's side of a wrapper: the text family's model, loaders and comparison, with the checkpoint's
    text tower read under the text family's names and the parts passed through skipped on rank 0 (their
    bytes compared with the reference's instead)."""

    def prepare(ckpt) -> None:
        """Name the text tower as the text family does; leave the parts passed through out."""
        cfg = spelling_of(parse(ckpt.config, ckpt.root / "config.json"), ckpt.tensors)
        for name in sorted(ckpt.tensors):
            plain = cfg.text_name(name)
            if plain is None and cfg.keys.passes_through(name):
                del ckpt.tensors[name]
            elif plain is not None and plain != name:
                ckpt.split(name, [(plain, ckpt.tensors[name].info.shape)])  # a rename: one part, all of it

    def load_shard(model, path, skip=None) -> dict[str, int]:
        from ckpttool.model.loading import read_shard_header

        passed = sum(passes_through(wrapper, n) for n in read_shard_header(path).tensors)
        skipped = inner.load_shard(model, path, skip=lambda n: passes_through(wrapper, n) or bool(skip and skip(n)))
        return {"MTP": skipped - passed, "vision tower and projector": passed}

    def weight_differences(model, ctx, reference, n_layers, shard) -> list[str]:
        problems = inner.weight_differences(model, ctx, reference, n_layers, shard, prepare=prepare)
        return problems + (passthrough_differences(wrapper, shard, reference) if ctx.rank == 0 else [])

    return Verifier(
        load_args=lambda raw, source: inner.load_args(text_config(wrapper, raw, source), source),
        build=inner.build,
        load_shard=load_shard,
        load_hf=lambda model, directory, n_layers: inner.load_hf(model, directory, n_layers, prepare=prepare),
        weight_differences=weight_differences,
    )


def passes_through(wrapper: Wrapper, name: str) -> bool:
    """A name some spelling passes through: what rank 0 of a wrapper's mp output holds beside the text tower."""
    return any(name.startswith(p) for s in wrapper.spellings for p in s.passthrough)


def passthrough_differences(wrapper: Wrapper, shard, reference) -> list[str]:
    """Rank 0's parts passed through against the reference's tensors of the same names: dtype, shape, bytes."""
    import os

    from ckpttool.io.checkpoint import Checkpoint
    from ckpttool.io.safetensors import read_bytes
    from ckpttool.model.loading import read_shard_header

    header = read_shard_header(shard)
    problems = []
    with Checkpoint(reference) as ckpt:
        fd = os.open(shard, os.O_RDONLY)
        try:
            for name, info in header.tensors.items():
                if not passes_through(wrapper, name):
                    continue
                theirs = ckpt.tensors.get(name)
                if theirs is None:
                    problems.append(f"{name!r} in {shard.name} is not in the reference")
                elif (info.dtype, tuple(info.shape)) != (theirs.info.dtype, tuple(theirs.info.shape)) or \
                        (read_bytes(fd, info.start, info.nbytes, shard) != ckpt.read_from(theirs.file, name)).any():
                    problems.append(f"{name!r} in {shard.name} differs from the reference's tensor")
        finally:
            os.close(fd)
    return problems


_HUB_TEXT = (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))
_TRANSFORMERS_TEXT = (("model.", "model.language_model."), ("lm_head.", "lm_head."))


_MISTRAL_MLP = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


def _mistral_experts(prefix: str) -> tuple[tuple[str, str], ...]:
    """Routed experts one by one in Mistral's names (`experts.{expert}.w1`), under `prefix`: the only per-expert
    names transformers' conversion_mapping stacks into its `mlp.experts.gate_up_proj` on load."""
    return tuple((f"model.layers.{{layer}}.mlp.experts.{{expert}}.{a}.weight",
                  f"{prefix}layers.{{layer}}.experts.{{expert}}.{b}.weight") for a, b in _MISTRAL_MLP)


def _mistral_names() -> tuple[tuple[str, str], ...]:
    """Mistral's own names of Mistral Large 4's text tower (what its hub checkpoint and transformers 5.24's
    save_pretrained write; transformers' conversion_mapping reads them), against the MLA family's names."""
    mlp = _MISTRAL_MLP
    indexer = [(f"{n}.{leaf}", f"{n}.{leaf}") for n in ("wq_b", "wk", "weights_proj", "k_norm", "q_input_norm")
               for leaf in ("weight", "bias") if leaf == "weight" or n.endswith("norm")]
    layer = [("input_layernorm.weight", "attention_norm.weight"),
             ("post_attention_layernorm.weight", "ffn_norm.weight"),
             ("mlp.gate.weight", "gate.weight"),
             *((f"self_attn.{a}.{leaf}", f"attention.{b}.{leaf}") for a, b in
               (("q_proj", "wq"), ("kv_a_proj_with_mqa", "wkv_a_with_mqa"), ("kv_b_proj", "wkv_b"), ("o_proj", "wo"))
               for leaf in ("weight", "bias") if leaf == "weight" or a in ("kv_a_proj_with_mqa", "o_proj")),
             ("self_attn.kv_a_layernorm.weight", "attention.kv_a_norm.weight"),
             ("self_attn.softmax_scaling.scale", "attention.ssmax_scaling.s"),
             ("self_attn.softmax_scaling.bias", "attention.ssmax_scaling.b"),
             *((f"self_attn.indexer.{a}", f"attention.indexer.{b}") for a, b in indexer),
             ("self_attn.indexer.softmax_scaling.scale", "attention.indexer.ssmax_scaling.s"),
             ("self_attn.indexer.softmax_scaling.bias", "attention.indexer.ssmax_scaling.b"),
             *((f"mlp.{a}.weight", f"feed_forward.{b}.weight") for a, b in mlp),
             *((f"mlp.shared_experts.{a}.weight", f"shared_experts.{b}.weight") for a, b in mlp)]
    return (("model.embed_tokens.weight", "tok_embeddings.weight"), ("model.norm.weight", "norm.weight"),
            ("lm_head.weight", "output.weight"), ("model.rotary_emb.alpha", "lerope.alpha"),
            *((f"model.layers.{{layer}}.{a}", f"layers.{{layer}}.{b}") for a, b in layer), *_mistral_experts(""))


WRAPPERS: tuple[Wrapper, ...] = (
    Wrapper(
        "kimi_k25", "Kimi-K2.5 / K2.6", "deepseek", text_types=("deepseek_v3", "kimi_k2"),
        spellings=(
            Spelling("the hub's", _HUB_TEXT, passthrough=("vision_tower.", "mm_projector.")),
            Spelling("transformers' (save_original_format=False)", _TRANSFORMERS_TEXT,
                     passthrough=("model.vision_tower.", "model.mm_projector.")),
            # transformers 5.24's save_pretrained reverses its load-time renames, and its `blocks` -> `layers`
            # for the vision tower turns the text tower's layers into `blocks` too (it reads them back)
            Spelling("transformers 5.24's save_pretrained", (("model.layers.", "language_model.model.blocks."),
                                                              *_HUB_TEXT),
                     passthrough=("vision_tower.", "mm_projector.", "model.mm_projector.")),
        ),
        defaults={"tie_word_embeddings": True}),
    Wrapper(
        "minimax_m3_vl", "MiniMax-M3", "minimax_m3", text_types=("minimax_m3_vl_text",),
        spellings=(Spelling("the hub's (and transformers 5.24's save_pretrained)", _HUB_TEXT,
                            passthrough=("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")),),
        tie_either=True,
        refused=(("model.language_model.", "transformers' own names (save_original_format=False) fuse each MLP's "
                                           "gate_up_proj and rename the indexer, which ckpttool does not read"),)),
    Wrapper(
        "qwen3_5_moe", "Qwen3.5 / 3.6 MoE", "gated_deltanet", text_types=("qwen3_5_moe_text",),
        spellings=(Spelling("the hub's (and transformers 5.24's save_pretrained)",
                            (("model.", "model.language_model."), ("lm_head.", "lm_head."), ("mtp.", "mtp.")),
                            passthrough=("model.visual.",)),),
        defaults={"tie_word_embeddings": False}),  # the wrapper's field ties the head (Qwen3_5MoeConfig)
    Wrapper(
        "mistral_large4", "Mistral Large 4", "deepseek", text_types=("mistral_large4_text",),
        spellings=(
            # the published checkpoint's multi-token-prediction head (`mtp_dspark.*`), which transformers 5.24
            # ignores on load, is carried unchanged too
            Spelling("Mistral's own (the hub's, and transformers 5.24's save_pretrained)", (),
                     passthrough=("vision_encoder.", "pre_mm_projector_norm.", "patch_merger.",
                                  "vision_language_adapter.", "mtp_dspark."), names=_mistral_names()),
            # transformers' own names hold the experts stacked; read one by one (and so written by merge and HF
            # outputs) they take Mistral's expert names, which transformers stacks on load: its own per-expert
            # names (mlp.experts.E.gate_proj) it would leave unloaded
            Spelling("transformers' (save_original_format=False)", _TRANSFORMERS_TEXT,
                     passthrough=("model.vision_tower.", "model.multi_modal_projector."),
                     names=_mistral_experts("model.language_model.")),
        ),
        defaults={"tie_word_embeddings": False}),
)
"""Every multimodal wrapper ckpttool reads; families/table.py pairs each with the family of its text tower."""
