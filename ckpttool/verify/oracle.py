"""The model `verify --reference` compares logits with: transformers' own implementation of the family
when transformers is installed and implements it, else ckpttool's bundled model run unsharded. The
report names which one answered, because only the first is independent of our own reading of
config.json (a misread rope_theta once passed a bundled-model comparison).

A quantized reference is compared through the BF16 values a conversion writes (the values the
bundled model also computes with when it dequantizes FP8 shards), so the comparison is of the model,
not of a rounding:
- MXFP4 (gpt-oss): transformers dequantizes on load (its dequant defines the format; ours equals it
  bit for bit), then every weight is rounded to bfloat16 (a no-op: MXFP4 values are bf16 values).
- FP8 blocks: the weights are dequantized by ckpttool's kernel, bit-exact with DeepSeek's reference
  kernel, into a temporary plain BF16 copy that transformers loads. transformers 5.23's own on-load
  FP8 dequant (`Fp8Dequantize`) takes `rows // scale_rows` rows per block, so it is wrong for a
  weight whose rows are not a multiple of 128 (DeepSeek's kv_a_proj_with_mqa) and is not used.
"""

from __future__ import annotations

import contextlib
import io
import json
import tempfile
from pathlib import Path

import torch

from ckpttool.families.table import family_for
from ckpttool.io.checkpoint import Checkpoint, read_config


def transformers_logits(reference: Path, prompt_ids: list[int], generated: list[int], dtype: torch.dtype,
                        device: torch.device) -> tuple[torch.Tensor | None, str]:
    """Teacher-forced float32 logits at the positions that chose each generated id, [len(generated),
    vocab], from transformers' model of `reference`, and the oracle's name; or (None, why not)."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed"
    raw = read_config(reference / "config.json")
    family = family_for(raw, reference / "config.json")
    model_type = family.transformers_types.get(raw["model_type"], raw["model_type"])
    try:
        config_class = type(transformers.AutoConfig.for_model(model_type))
    except (KeyError, ValueError):
        return None, f"transformers {transformers.__version__} has no {model_type!r} model"
    kwargs: dict = {}
    method = (raw.get("quantization_config") or {}).get("quant_method")
    if method == "mxfp4":
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    elif method not in (None, "fp8"):
        return None, f"transformers cannot dequantize a {method!r} reference here"
    auto = _auto_class(transformers, config_class)
    if auto is None:
        return None, f"transformers {transformers.__version__} has no generating model for {model_type!r}"
    with tempfile.TemporaryDirectory(prefix="ckpttool-oracle-") as tmp:
        source = _bf16_copy(reference, Path(tmp)) if method == "fp8" else reference
        config = config_class.from_dict({k: v for k, v in read_config(source / "config.json").items()
                                         if k not in ("model_type", "auto_map")})
        try:
            with _quiet(transformers):
                model = auto.from_pretrained(source, config=config, dtype=dtype, **kwargs)
        except ImportError as exc:  # a loader that needs a package this machine lacks
            return None, f"transformers could not load the reference: {exc}"
        except RuntimeError as exc:  # shapes its model does not take (LongCat-Flash's published zero experts)
            return None, f"transformers could not load the reference: {str(exc).splitlines()[0]}"
    if method == "mxfp4":
        _round_dequantized(model, reference)
    with torch.no_grad():  # a dequantizing load leaves the unquantized tensors in their stored dtype
        for param in model.parameters():
            param.data = param.data.to(device=device, dtype=dtype)
        for buffer in model.buffers():  # rotary frequencies, router biases: their own dtype
            buffer.data = buffer.data.to(device=device)
    model.eval()
    sequence = torch.tensor([prompt_ids + generated[:-1]], device=device)
    with torch.no_grad():
        logits = model(sequence).logits[0, len(prompt_ids) - 1:]
    return logits.float().cpu(), f"transformers {transformers.__version__} {type(model).__name__}"


def _auto_class(transformers, config_class):
    """The auto class whose table holds the config class: a causal LM, else an image-text-to-text model (a
    multimodal wrapper, and Mistral 4, whose Mistral4ForCausalLM transformers lists only there). Both take
    token ids alone and return logits."""
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText):
        if config_class in auto._model_mapping:
            return auto
    return None


def _bf16_copy(reference: Path, tmp: Path) -> Path:
    """The reference with every FP8 block weight dequantized to bf16 (ckpttool's kernel), its scales
    dropped and quantization_config removed, as one safetensors file: a reference is a model that
    fits one device, so holding it in memory is what loading it costs anyway."""
    from safetensors.torch import save_file

    from ckpttool.formats import FP8_BLOCK
    from ckpttool.kernels.fp8 import dequant_fp8_block

    tensors = {}
    scale_of = FP8_BLOCK.side("scale").name
    with Checkpoint(reference) as ckpt:
        for name in ckpt.tensors:
            if scale_of.base_of(name) is not None:
                continue
            scale = scale_of.of(name) if name.endswith(".weight") else None
            tensors[name] = (dequant_fp8_block(ckpt.read(name), ckpt.read(scale)) if scale in ckpt.tensors
                             else ckpt.read(name))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in read_config(reference / "config.json").items() if k != "quantization_config"}
    (tmp / "config.json").write_text(json.dumps(config))
    return tmp


def _round_dequantized(model: torch.nn.Module, reference: Path) -> None:
    """bf16-round every parameter but those the checkpoint stores in float32 (router biases)."""
    with Checkpoint(reference) as ckpt:
        kept = {name for name, src in ckpt.tensors.items() if src.info.dtype == "F32"}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in kept:
                param.data = param.data.to(torch.bfloat16)


@contextlib.contextmanager
def _quiet(transformers):
    """transformers reports layers it does not build (MTP) and progress bars on load: not verify's news."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        transformers.logging.set_verbosity(level)
