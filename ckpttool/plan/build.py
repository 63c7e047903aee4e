"""Chain the stages into a Plan: headers in, complete output description out. Reads no weights."""

from __future__ import annotations

from dataclasses import dataclass

from pathlib import Path

from ckpttool.dtypes import torch_installed
from ckpttool.errors import InputError, PlanError
from ckpttool.families.base import unstack_experts
from ckpttool.families.table import family_for
from ckpttool.formats import CKPTTOOL_QUANTIZATION, HF_QUANT_CONFIG, declared_rules
from ckpttool.io.checkpoint import Checkpoint, ShardFiles
from ckpttool.layouts.hf import HF
from ckpttool.layouts.table import of_directory, output_layout
from ckpttool.plan import dequant as dequant_stage
from ckpttool.plan import quantize as quantize_stage
from ckpttool.plan import repack as repack_stage
from ckpttool.plan.assemble import assemble
from ckpttool.plan.rewrite import files_to_copy, floating_dtype, rewrite_config
from ckpttool.plan.types import Plan, TensorPlan


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What to produce. Commands and recipes both reduce to one of these."""

    dequant: bool = False
    out_dtype: str = "BF16"
    mp: int | None = None  # ranks the output is cut for (--mp N); None: no model-parallel cut
    layout: str | None = None  # the output's layout row by name (layouts/table.py); None: mp with `mp`, else HF
    keep_mtp: bool | None = False  # None: as the layout's reference has them (HF: kept; mp: Family.mtp_in_mp)
    arch: str = "auto"  # a recipe may pin the model_type it was written for
    quantize: str | None = None  # a row of formats/outputs.py (w4a16, fp8-block, ...): quantize linear weights
    group_size: int = 128  # int4 group size
    config: Path | None = None  # --config: the model's config.json where the input has none beside it (a DCP)

    label = "converting"

    def open(self, src: Path) -> Checkpoint:
        """The inputs this job reads (headers only, until the executor reads tensors), as the layout the input
        directory is in reads them: under their HF names."""
        return of_directory(src).open(Path(src), self.config)

    def plan(self, ckpt: Checkpoint) -> Plan:
        return make_plan(ckpt, self)


def make_plan(ckpt: Checkpoint, spec: Spec) -> Plan:
    config_path = ckpt.root / "config.json"
    if not ckpt.config:
        raise InputError("config.json is missing", file=config_path,
                         fix="copy the checkpoint's config.json beside its safetensors files, or pass --config PATH")
    ours = ckpt.config.get(CKPTTOOL_QUANTIZATION)
    if isinstance(ours, dict):
        raise PlanError(f"this is ckpttool's {ours.get('format')} output (config.json {CKPTTOOL_QUANTIZATION}): "
                        "gpt-fast's weight-only layout cannot be dequantized, sharded or quantized again",
                        file=config_path, fix="convert the BF16 checkpoint it was quantized from instead")
    family = family_for(ckpt.config, config_path)
    if spec.arch != "auto" and ckpt.config.get("model_type") != spec.arch:
        raise InputError(f"recipe is for {spec.arch}, but config.json says model_type "
                         f"{ckpt.config.get('model_type')!r}", file=config_path,
                         fix="use a recipe for this architecture, or --set arch=auto")
    cfg = family.parse_config(ckpt.config, config_path)
    if family.spelled is not None:  # the config alone does not say how these tensors are named
        cfg = family.spelled(cfg, ckpt.tensors)
    stacked = unstack_experts(ckpt, family.keys(cfg), family.num_experts(cfg),
                              family.stacked_experts(cfg) if family.stacked_experts is not None else None)

    tensors = [TensorPlan(name, s.info.dtype, s.info.shape, source=name, file=s.file)
               for name, s in sorted(ckpt.tensors.items())]
    rules = _declared_rules(ckpt)
    planned = dequant_stage.check_scales(tensors, ckpt, rules)
    _check_against_config(tensors, family, cfg, ckpt, rules, planned)
    repacked, repacked_quant, not_copied = 0, None, ()
    out = output_layout(spec.layout, spec.mp)
    if not spec.dequant:  # weights the layout holds dequantized (DeepSeek-V4's wo_a in its mp files), from the input
        tensors = out.unquantized(tensors, rules, family.keys(cfg))
    if spec.quantize is not None:  # quantized weights with an exact repack into the target take it
        quantize_stage.check_mp(spec.quantize, spec.group_size, spec.mp)
        tensors, rules, repacked_quant, repacked, not_copied = repack_stage.repack(
            tensors, rules, quantize_stage.target_of(spec.quantize, spec.group_size), ckpt.config, config_path, spec.mp)
    if not spec.dequant and not (repacked and spec.mp is None):  # a repack's HF output keeps what it does not repack
        dequant_stage.refuse_kept(tensors, rules, config_path)
    notes = [*getattr(ckpt, "notes", ())]  # how the input was read (mp ranks, a DCP's left-out state)
    notes += [f"read {stacked} stacked expert tensors as per-expert weights"] if stacked else []
    if passed := sum(family.keys(cfg).passes_through(t.name) for t in tensors):
        notes.append(f"{passed} tensors outside the text model (a vision tower, a projector) passed through "
                     "unchanged" + (", whole on rank 0" if out.native_names else ""))

    mtp = [t for t in tensors if family.is_mtp_tensor(cfg, t.name)]
    keep_mtp = spec.keep_mtp if spec.keep_mtp is not None else out.keeps_mtp(family)
    if mtp and not keep_mtp:
        dropped = {t.name for t in mtp}
        tensors = [t for t in tensors if t.name not in dropped]
        notes.append(f"dropped {len(dropped)} MTP tensors (keep them with --keep-mtp)")
    if spec.quantize is not None and not torch_installed():
        raise PlanError(f"the quantize stage ({spec.quantize}) needs torch, which the core install leaves out",
                        file=config_path, fix="pip install 'ckpttool[quantize]'")
    if spec.dequant:
        tensors, n_quant = dequant_stage.dequant(tensors, rules, spec.out_dtype, planned)
        notes.append(f"dequantized {n_quant} quantized weights to {spec.out_dtype}" if n_quant else
                     "no quantized weights found: tensors are copied unchanged")

    if spec.quantize is not None:
        quantize_stage.check_mp(spec.quantize, spec.group_size, spec.mp)
        if out.quantize is not None and spec.quantize not in out.quantize:
            raise PlanError(f"{spec.quantize} output is not written in the {out.title} layout",
                            fix=f"use {' or '.join(out.quantize)}")
        unquantized = tensors
        tensors = quantize_stage.quantize(tensors, family, cfg, spec.quantize, spec.group_size,
                                          {t.name: str(ckpt.root / t.file) for t in tensors}, repacked)
        unquantized = quantize_stage.unquantized_linears(unquantized, tensors, family, cfg)
        notes.append(f"quantized {quantize_stage.count_quantized(tensors)} weights to {spec.quantize}" +
                     (f", repacked {repacked} exactly" if repacked else ""))

    input_order = sorted(ckpt.files)
    files_of = {t.name: str(ckpt.root / t.file) for t in tensors}
    tensors = out.place(tensors, family, cfg, spec.mp, files_of, input_order if of_input(ckpt) is HF else None)
    tensors = assemble(tensors, ckpt)  # an input stored in boxes (mp ranks, DCP chunks): gathered per tensor
    files = out.lay_out(tensors, input_order)

    config = rewrite_config(ckpt.config, dequantized=spec.dequant, dtype=floating_dtype(tensors),
                            mtp_key=family.mtp_config_key, mtp_dropped=bool(mtp) and not keep_mtp,
                            explicit=family.explicit_config, source=ckpt.root / "config.json")
    if spec.quantize is not None:
        config = quantize_stage.quantized_config(config, spec.quantize, spec.group_size, unquantized,
                                                  repacked_quant)
    copies = [c for c in files_to_copy(ckpt.root, ckpt.top_level_files())
              if not (spec.dequant and c == HF_QUANT_CONFIG) and c not in not_copied]
    return Plan(src=str(ckpt.root), files=files, inputs=input_fingerprints(ckpt), layout=out,
                index=out.index(files, family), config=config, copies=copies, notes=notes,
                extras=out.extras(files, tensors))


def of_input(ckpt: ShardFiles):
    """The layout row an opened input was read in (a checkpoint of another layout says so; HF otherwise)."""
    return getattr(ckpt, "layout", HF)


def _declared_rules(ckpt: Checkpoint):
    """The quantization formats config.json (and ModelOpt's hf_quant_config.json) declare; others are refused."""
    hf_quant = ckpt.side_object(HF_QUANT_CONFIG, fix="re-download it, or delete it if the checkpoint is not "
                                                     "ModelOpt-quantized")
    return declared_rules(ckpt.config.get("quantization_config"), hf_quant, ckpt.root / "config.json",
                            ckpt.root / HF_QUANT_CONFIG)


def input_fingerprints(inputs: ShardFiles) -> dict[str, dict]:
    """input file name -> its size and the sha256 of its header: what --resume checks is unchanged."""
    return {name: inputs.header_fingerprint(name) for name in sorted(inputs.files)}


def _check_against_config(tensors: list[TensorPlan], family, cfg, ckpt: Checkpoint, rules, planned) -> None:
    """The tensors must be exactly what config.json describes: a contradiction means the wrong
    config, a partial download or a different model, and would otherwise surface much later."""
    expected = family.expected_for(cfg, True, n_tensors=len(tensors), source=ckpt.root / "config.json")
    # packed weights as the model tensors they stand for (their names and shapes are the format's)
    tensors = dequant_stage.dequant(tensors, tuple(r for r in rules if not r.row.keepable), planned=planned)[0]
    scales = dequant_stage.scale_names(tensors, rules)
    passed = family.keys(cfg).passes_through  # a wrapper's vision tower: carried as it is, not of the text model
    actual = {t.name: t for t in tensors if (t.name not in scales or t.name in expected) and not passed(t.name)}
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
    mtp = {n for n in expected if family.is_mtp_tensor(cfg, n)}
    if mtp <= missing:  # MTP layers left out entirely (e.g. by a download filter) are as good as dropped
        missing -= mtp
    missing = sorted(missing)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise InputError(f"config.json implies tensor {missing[0]!r}{more}, absent from the checkpoint",
                         file=ckpt.root, tensor=missing[0],
                         fix="finish the download (every shard listed in the index) or fix config.json")

