"""Chain the stages into a Plan: headers in, complete output description out. Reads no weights."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from ckpttool.arch import get_arch
from ckpttool.errors import InputError, PlanError
from ckpttool.io.checkpoint import Checkpoint
from ckpttool.plan import Plan, TensorPlan, layout
from ckpttool.stages import dequant as dequant_stage
from ckpttool.stages import quantize as quantize_stage
from ckpttool.stages.rewrite import files_to_copy, hf_index, rewrite_config
from ckpttool.stages.shard import mp_file, shard


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What to produce. Commands and recipes both reduce to one of these."""

    dequant: bool = False
    out_dtype: str = "BF16"
    mp: int | None = None  # None: HF layout (input file names, index); N: model{i}-mp{N}.safetensors
    keep_mtp: bool = False
    arch: str = "auto"  # a recipe may pin the model_type it was written for
    quantize: str | None = None  # fp8_block | int8 | int4: quantize linear weights (stages/quantize.py)
    group_size: int = 128  # int4 group size


def make_plan(ckpt: Checkpoint, spec: Spec) -> Plan:
    config_path = ckpt.root / "config.json"
    if not ckpt.config:
        raise InputError("config.json is missing", file=config_path,
                         fix="copy the checkpoint's config.json beside its safetensors files")
    arch = get_arch(ckpt.config, config_path)
    if spec.arch != "auto" and ckpt.config.get("model_type") != spec.arch:
        raise InputError(f"recipe is for {spec.arch}, but config.json says model_type "
                         f"{ckpt.config.get('model_type')!r}", file=config_path,
                         fix="use a recipe for this architecture, or --set arch=auto")
    cfg = arch.parse_config(ckpt.config, config_path)

    tensors = [TensorPlan(name, s.info.dtype, s.info.shape, source=name, file=s.file)
               for name, s in sorted(ckpt.tensors.items())]
    dequant_stage.check_scales(tensors, ckpt)
    _check_against_config(tensors, arch, cfg, ckpt)
    notes = []

    mtp = [t for t in tensors if arch.is_mtp_tensor(cfg, t.name)]
    if mtp and not spec.keep_mtp:
        dropped = {t.name for t in mtp}
        tensors = [t for t in tensors if t.name not in dropped]
        notes.append(f"dropped {len(dropped)} MTP tensors (keep them with --keep-mtp)")
    if spec.dequant:
        tensors, n_quant = dequant_stage.dequant(tensors, spec.out_dtype)
        notes.append(f"dequantized {n_quant} quantized weights to {spec.out_dtype}" if n_quant else
                     "no quantized weights found: tensors are copied unchanged")

    if spec.quantize is not None:
        if spec.mp is not None and spec.quantize != "fp8_block":
            raise PlanError(f"{spec.quantize} output is HF layout only", fix="drop the shard stage, or use fp8_block")
        n_before = len(tensors)
        tensors = quantize_stage.quantize(tensors, arch, spec.quantize, spec.group_size,
                                          {t.name: str(ckpt.root / t.file) for t in tensors})
        notes.append(f"quantized {len(tensors) - n_before} weights to {spec.quantize}")

    input_order = sorted(ckpt.files)
    if spec.mp is None:
        files = layout(tensors, input_order)
        index = hf_index(files)
        fmt = "hf"
    else:
        files_of = {t.name: str(ckpt.root / t.file) for t in tensors}
        tensors = shard([t.with_(file=None) for t in tensors], arch, cfg, spec.mp, files_of)
        files = layout(tensors, [mp_file(r, spec.mp) for r in range(spec.mp)])
        index = None
        fmt = "mp"

    config = rewrite_config(ckpt.config, dequant_to=spec.out_dtype if spec.dequant else None,
                            mtp_key=arch.mtp_config_key, mtp_dropped=bool(mtp) and not spec.keep_mtp)
    if spec.quantize is not None:
        config = quantize_stage.rewrite_config(config, spec.quantize, spec.group_size)
    inputs = {name: {"size": sf.path.stat().st_size,
                     "header_sha256": hashlib.sha256(_header_bytes(sf.path, sf.header_size)).hexdigest()}
              for name, sf in sorted(ckpt.files.items())}
    return Plan(src=str(ckpt.root), files=files, inputs=inputs, format=fmt, index=index, config=config,
                copies=files_to_copy(ckpt.root), notes=notes)


def _header_bytes(path, header_size: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(8 + header_size)


def _check_against_config(tensors: list[TensorPlan], arch, cfg, ckpt: Checkpoint) -> None:
    """The tensors must be exactly what config.json describes: a contradiction means the wrong
    config, a partial download or a different model, and would otherwise surface much later."""
    expected = arch.expected_shapes(cfg, True)
    scales = dequant_stage.scale_names(tensors)
    actual = {t.name: t for t in tensors if t.name not in scales or t.name in expected}
    config_path = ckpt.root / "config.json"
    for name, t in actual.items():
        if name not in expected:
            raise PlanError("tensor is not part of the model config.json describes", file=ckpt.root / t.file,
                            tensor=name, fix="check that config.json belongs to this checkpoint")
        if tuple(expected[name]) != t.shape:
            raise InputError(f"shape {list(t.shape)} contradicts config.json, which implies {list(expected[name])}",
                             file=ckpt.root / t.file, tensor=name,
                             fix=f"check that {config_path} belongs to this checkpoint")
    missing = set(expected) - set(actual)
    mtp = {n for n in expected if arch.is_mtp_tensor(cfg, n)}
    if mtp <= missing:  # MTP layers left out entirely (e.g. by a download filter) are as good as dropped
        missing -= mtp
    missing = sorted(missing)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise InputError(f"config.json implies tensor {missing[0]!r}{more}, absent from the checkpoint",
                         file=ckpt.root, tensor=missing[0],
                         fix="finish the download (every shard listed in the index) or fix config.json")

