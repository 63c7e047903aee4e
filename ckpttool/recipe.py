"""YAML recipes: a typed, strict schema (unknown keys are errors naming key and line) + --set overrides.

    name: deepseek-v3-mp8-bf16
    description: FP8 HF checkpoint -> 8 BF16 model-parallel shards for the reference inference code
    arch: deepseek_v3
    stages:
      - dequant: {dtype: bf16}
      - shard: {mp: 8}
    execution: {max_memory: 8GiB}

The commands `dequant`, `shard`, `convert`, `plan` and `merge` build the same Recipe in code (`preset`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ckpttool import defaults
from ckpttool.errors import RecipeError, did_you_mean
from ckpttool.families.table import MODEL_TYPES
from ckpttool.formats.outputs import FORMATS as QUANTIZE_FORMATS
from ckpttool.plan.build import Spec
from ckpttool.plan.merge import MergeSpec

DTYPE_CODES = {"bf16": "BF16", "bfloat16": "BF16", "fp16": "F16", "float16": "F16", "fp32": "F32", "float32": "F32"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DownloadStage(_Strict):
    revision: Optional[str] = None
    allow_patterns: Optional[list[str]] = None
    ignore_patterns: Optional[list[str]] = None
    max_workers: int = Field(8, ge=1, le=64)
    verify_sha256: bool = False
    """download first (cache: true): hash every file; streamed files are always hashed as they arrive"""
    max_input_files: int = Field(defaults.MAX_INPUT_FILES, ge=1, le=1024)
    """converting straight from the hub: input files on disk at once (each deleted once converted)"""
    cache: bool = False
    """download into the HF cache first (kept), then convert from there; else stream through DST"""


class DequantStage(_Strict):
    dtype: Literal["bf16", "bfloat16", "fp16", "float16", "fp32", "float32"] = "bf16"


class QuantizeStage(_Strict):
    format: Literal[QUANTIZE_FORMATS]  # a row of formats/outputs.py (fp8_block: fp8-block-deepseek)
    group_size: Literal[32, 64, 128, 256] = 128  # int4 only (the compressed-tensors rows: their preset's)


class ShardStage(_Strict):
    mp: int = Field(ge=1, le=1024)


class MergeStage(_Strict):
    """model{i}-mp{N} shards -> an HF checkpoint (the inverse of shard); takes no other stage."""

    max_shard_size: str = defaults.MAX_SHARD_SIZE

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: str) -> str:
        if defaults.parse_size(v) < 1:
            raise ValueError("must be positive")
        return v


class VerifyStage(_Strict):
    prompt: Optional[str] = None
    prompt_ids: Optional[list[int]] = None
    max_new_tokens: int = Field(4, ge=1, le=4096)
    device: Literal["cpu", "cuda", "auto"] = "auto"
    dtype: Literal["bfloat16", "float32"] = "float32"
    reference: Optional[str] = None
    """an HF checkpoint to compare logits with; `input`: the run's own input, where it fits in memory"""
    tolerance: Optional[float] = None


class Stage(_Strict):
    """One list entry: exactly one of these keys."""

    download: Optional[DownloadStage] = None
    dequant: Optional[DequantStage] = None
    quantize: Optional[QuantizeStage] = None
    shard: Optional[ShardStage] = None
    merge: Optional[MergeStage] = None
    verify: Optional[VerifyStage] = None

    @model_validator(mode="before")
    @classmethod
    def _one_key(cls, value):
        if not isinstance(value, dict) or len(value) != 1:
            raise ValueError(f"each stage is a mapping with exactly one key: {', '.join(STAGE_KINDS)}")
        key, body = next(iter(value.items()))
        return {key: {} if body is None else body}

    @property
    def kind(self) -> str:
        return next(k for k in STAGE_KINDS if getattr(self, k) is not None)

    @property
    def body(self):
        return getattr(self, self.kind)


STAGE_KINDS = tuple(Stage.model_fields)


class Execution(_Strict):
    max_memory: str = defaults.MAX_MEMORY
    workers: Optional[int] = Field(None, ge=1, le=256)  # in all processes; None: defaults.layout
    processes: Optional[int] = Field(None, ge=1, le=64)  # forked processes sharing the files; None: defaults.layout
    device: Literal["auto", "cpu", "cuda"] = defaults.DEVICE

    @field_validator("max_memory")
    @classmethod
    def _size(cls, v: str) -> str:
        if defaults.parse_size(v) < defaults.MIN_MAX_MEMORY:
            raise ValueError("must be at least 16MiB")
        return v


class Recipe(_Strict):
    name: str
    description: str = ""
    arch: str = "auto"
    """auto, or a config.json model_type of families/table.py that the input must have"""
    mtp: Literal["auto", "drop", "keep"] = "auto"
    """multi-token-prediction layers. auto: kept in HF outputs (vLLM and SGLang use them for speculative
    decoding); in mp shards as the family's reference layout has them (DeepSeek-V3's convert.py drops
    them, V4's keeps them: Family.mtp_in_mp)"""
    stages: list[Stage] = Field(min_length=1)
    execution: Execution = Execution()
    layout: str | None = None
    """the output's layout by its row's name (ckpttool/layouts: hf, mp, dcp); None: mp with a shard stage, else hf"""

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, v: str) -> str:
        if v != "auto" and v not in MODEL_TYPES:
            raise ValueError(f"unknown arch {v!r}{did_you_mean(v, MODEL_TYPES)}; use auto or one of "
                             f"{', '.join(MODEL_TYPES)}")
        return v

    @model_validator(mode="after")
    def _order(self) -> "Recipe":
        kinds = [s.kind for s in self.stages]
        for kind in set(kinds):
            if kinds.count(kind) > 1:
                raise ValueError(f"stage {kind!r} appears {kinds.count(kind)} times; it may appear once")
        if "download" in kinds and kinds[0] != "download":
            raise ValueError("the download stage must come first")
        if "verify" in kinds and kinds[-1] != "verify":
            raise ValueError("the verify stage must come last")
        if "verify" in kinds and "shard" not in kinds:
            raise ValueError("verify loads model-parallel shards: add a shard stage before it")
        if kinds == ["download"]:
            raise ValueError("a recipe needs a conversion stage (dequant, quantize, shard or merge) after download")
        if "merge" in kinds and set(kinds) - {"download", "merge"}:
            raise ValueError("merge turns mp shards back into an HF checkpoint: it takes no other stage")
        if "quantize" in kinds and "shard" in kinds and kinds.index("quantize") > kinds.index("shard"):
            raise ValueError("the quantize stage must come before shard")
        return self

    def stage(self, kind: str):
        return next((s.body for s in self.stages if s.kind == kind), None)

    def spec(self) -> Spec:
        dq, sh, qz = self.stage("dequant"), self.stage("shard"), self.stage("quantize")
        return Spec(dequant=dq is not None, out_dtype=DTYPE_CODES[dq.dtype] if dq else "BF16",
                    mp=sh.mp if sh else None, arch=self.arch, layout=self.layout,
                    keep_mtp=None if self.mtp == "auto" else self.mtp == "keep",
                    quantize=qz.format if qz else None, group_size=qz.group_size if qz else 128)

    def job(self, config: Path | None = None) -> Spec | MergeSpec:
        """What the runner plans and executes; `config`: the model's config.json to read instead of the input's own."""
        merge = self.stage("merge")
        if merge is not None:
            if config is not None:
                raise RecipeError("merge reads the config.json beside the shards", fix="drop --config")
            return MergeSpec(max_shard_bytes=defaults.parse_size(merge.max_shard_size))
        return self.spec() if config is None else dataclasses.replace(self.spec(), config=Path(config))


PRESET_FLAGS = {"stages.quantize.format": "--to", "stages.quantize.group_size": "--group-size", "stages.shard.mp": "--mp", "stages.download.max_input_files": "--max-input-files", "stages.merge.max_shard_size": "--max-shard-size",
                "stages.verify.device": "--device", "stages.verify.prompt_ids": "--prompt-ids",
                "stages.verify.prompt": "--prompt", "execution.max_memory": "--max-memory",
                "execution.workers": "--workers", "execution.processes": "--processes", "execution.device": "--device"}
"""the recipe keys command flags set (preset), for errors worded as the flags the user typed"""


INPUT = "input"
"""verify.reference: the run's own input checkpoint"""


def preset(name: str, *, dequant: bool = False, quantize: dict | None = None, mp: int | None = None,
           keep_mtp: bool | None = None,
           merge_max_shard_size: str | None = None, verify_device: str | None = None,
           verify_prompt: str | None = None, verify_prompt_ids: list[int] | None = None, max_memory: str | None = None, workers: int | None = None, processes: int | None = None,
           device: str = defaults.DEVICE, max_input_files: int | None = None, layout: str | None = None) -> Recipe:
    """The recipe a command's flags stand for (`ckpttool convert --mp 8` is a dequant + shard recipe)."""
    stages: list[dict] = []
    if max_input_files is not None:  # only said for a hub input; a repo id streams without it too
        stages.append({"download": {"max_input_files": max_input_files}})
    if merge_max_shard_size is not None:
        stages.append({"merge": {"max_shard_size": merge_max_shard_size}})
    if dequant:
        stages.append({"dequant": {"dtype": "bf16"}})
    if quantize is not None:
        stages.append({"quantize": quantize})
    if mp is not None:
        stages.append({"shard": {"mp": mp}})
    if not any(kind in s for s in stages for kind in ("merge", "dequant", "quantize", "shard")):
        stages.append({"dequant": {"dtype": "bf16"}})
    if verify_device is not None:  # a command's --verify compares with the input it converted, where it fits
        verify = {"device": verify_device, "reference": INPUT, "prompt": verify_prompt, "prompt_ids": verify_prompt_ids}
        stages.append({"verify": {k: v for k, v in verify.items() if v is not None}})
    execution: dict = {"device": device}
    if workers is not None:
        execution["workers"] = workers
    if processes is not None:
        execution["processes"] = processes
    if max_memory:
        execution["max_memory"] = max_memory
    return validate_recipe({"name": name, "mtp": {None: "auto", True: "keep", False: "drop"}[keep_mtp], "stages": stages,
                            "execution": execution, **({"layout": layout} if layout else {})},
                           f"ckpttool {name}", flags=PRESET_FLAGS)


BUNDLED = Path(__file__).parent / "recipes"
"""the recipes shipped in the package (a checkout's recipes/ points here): `ckpttool run NAME` finds them"""


def bundled_recipes() -> list[str]:
    return sorted(p.stem for p in BUNDLED.glob("*.yaml"))


def find_recipe(arg: str | Path) -> Path:
    """A recipe file that exists, else the bundled recipe of that name (`deepseek-v3-mp8-bf16`, with
    or without .yaml, no directory part)."""
    path = Path(arg)
    if path.exists():
        return path
    name = path.name.removesuffix(".yaml")
    if path.parent == Path(".") and name in bundled_recipes():
        return BUNDLED / f"{name}.yaml"
    raise RecipeError(f"no such recipe file, and no bundled recipe of that name{did_you_mean(name, bundled_recipes())}",
                      file=path, fix=f"pass a YAML file, or a bundled recipe by name: {', '.join(bundled_recipes())}")


def load_recipe(path: Path, overrides: list[str] = ()) -> Recipe:
    path = find_recipe(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(f"cannot read recipe: {exc.strerror}", file=path) from None
    except UnicodeDecodeError as exc:
        raise RecipeError(f"recipe is not UTF-8 text (byte {exc.start})", file=path,
                          fix="save the recipe as UTF-8 YAML") from None
    import yaml  # here, not at the top: a command's flags never need it (15-40 ms of every start)

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe is not valid YAML: {exc}", file=path) from None
    except RecursionError:
        raise RecipeError("recipe is nested too deeply to be a recipe", file=path,
                          fix="a recipe is a mapping of name, stages and execution; see recipes/") from None
    if not isinstance(data, dict):
        raise RecipeError("a recipe is a YAML mapping with name and stages", file=path)
    overridden = {apply_override(data, item, path): item for item in overrides}
    return validate_recipe(data, path, text, overrides=overridden)


def validate_recipe(data: dict, source: object = "<recipe>", text: str | None = None,
                    flags: dict[str, str] | None = None, overrides: dict[tuple, str] | None = None) -> Recipe:
    """The Recipe, or a RecipeError naming the key path and line, or the `--set` that put it there
    (`overrides`: key path -> the --set item). An unknown key is reported before what its absence leaves
    missing (`mpp:` is the typo, not `mp: Field required`), with the nearest allowed key and the list of
    them. `flags` maps key paths to the command-line flags that set them, so a preset's errors name the flag."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(err["loc"][:-1])
            msg += f"{did_you_mean(str(err['loc'][-1]), allowed)}; allowed: {', '.join(allowed)}"
        loc = ".".join(str(p) for p in err["loc"])
        key = ".".join(str(p) for p in err["loc"] if not isinstance(p, int))
        for path, flag in (flags or {}).items():
            if key == path or key.startswith(path + "."):
                raise RecipeError(f"{source}: {flag}: {msg.removeprefix('Value error, ')}",
                                  fix=f"see `{source} --help` for {flag}") from None
        for path, item in (overrides or {}).items():
            if tuple(err["loc"][:len(path)]) == path:
                raise RecipeError(f"--set {item}: {loc}: {msg}", fix=_fix_for(err)) from None
        line = _line_of(text, err["loc"]) if text else None
        where = f"{source}" + (f":{line}" if line else "")
        raise RecipeError(f"{where}: {loc or '(top level)'}: {msg}", fix=_fix_for(err)) from None


def _fix_for(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        return "remove or correct that key; see docs/recipes.md for the allowed keys"
    return "see docs/recipes.md (the recipe reference)"


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys the schema allows at a pydantic location (the model there: a stage, execution, ...)."""
    model = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        model = _model_in(field.annotation) if field is not None else None
        if model is None:
            return []
    return list(model.model_fields)


def _model_in(annotation) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (Optional[X], list[X], X)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for a in typing.get_args(annotation) if (m := _model_in(a)) is not None), None)


def _line_of(text: str, loc: tuple) -> int | None:
    """Line number (1-based) of the YAML node at a pydantic error location, for messages; for a key the
    file does not have (a typo's own line is found), its parent's."""
    import yaml

    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if match is None:
                return line
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def apply_override(data: dict, item: str, source: object = "--set") -> tuple:
    """`key=value`, `execution.workers=8`, or a stage by name: `shard.mp=4`. Values are YAML. Returns the
    key path it set, as pydantic names locations (`("stages", 1, "shard", "mp")`)."""
    if "=" not in item:
        raise RecipeError(f"--set {item!r} is not key=value", fix="e.g. --set shard.mp=4")
    key, raw = item.split("=", 1)
    import yaml

    try:
        value = yaml.safe_load(raw)
    except (yaml.YAMLError, RecursionError):
        raise RecipeError(f"--set {key}: the value is not valid YAML", file=source,
                          fix="quote it, e.g. --set 'shard.mp=4' or --set \"name='my run'\"") from None
    parts = key.strip().split(".")
    stages = data.get("stages") if isinstance(data.get("stages"), list) else []
    stage = next((s for s in stages if isinstance(s, dict) and parts[0] in s), None)
    if stage is not None and len(parts) > 1:
        target, path = stage, ("stages", stages.index(stage), *parts)
    else:
        target, path = data, tuple(parts)
    for p in parts[:-1]:
        nxt = target.get(p)
        if nxt is None:
            nxt = target[p] = {}
        if not isinstance(nxt, dict):
            raise RecipeError(f"--set {key}: {p!r} is not a mapping", file=source,
                              fix="--set sets a key inside a mapping: e.g. --set shard.mp=4")
        target = nxt
    target[parts[-1]] = value
    return path
