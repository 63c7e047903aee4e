"""Quantization methods of other libraries that ckpttool does not read: refused by name, saying what the checkpoint
is and how to get weights it does read, rather than the generic "not a format ckpttool reads" (and never passed
through, nor taken for another format). A checkpoint's `quantization_config.quant_method` names them, as
transformers' QuantizationMethod spells them. GGUF files are refused where a file is opened (io/safetensors.py)."""

from __future__ import annotations

from ckpttool.errors import InputError

FOREIGN = {
    "hqq": "an HQQ (Half-Quadratic Quantization, the hqq library)",
    "eetq": "an EETQ (int8 weight-only, the eetq library)",
    "torchao": "a torchao (its tensor subclasses, the torchao library)",
    "quark": "an AMD Quark (the amd-quark library)",
    "aqlm": "an AQLM (additive quantization, the aqlm library)",
    "vptq": "a VPTQ (vector post-training quantization, the vptq library)",
    "quanto": "an optimum-quanto",
    "higgs": "a HIGGS",
    "spqr": "a SpQR",
    "bitnet": "a BitNet (packed ternary weights)",
}
"""quant_method -> what the checkpoint is, for the message"""


def refusal(method: str, source: object) -> InputError:
    return InputError(f"quantization_config quant_method {method!r}: this is {FOREIGN[method]} checkpoint, which "
                      "ckpttool does not read", file=source,
                      fix="convert from the model's unquantized original (its BF16 or FP16 safetensors), or load this "
                          "checkpoint with transformers and the library that wrote it and save a dequantized copy")
