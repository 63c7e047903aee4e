"""bitsandbytes' serialized formats (`quant_method: bitsandbytes`: what transformers' BitsAndBytesConfig saves), and
the rules such a config declares.

  bnb4:{nf4|fp4}[:nested]  X.weight (U8 [ceil(n/2), 1]: the flattened weight's 4-bit codes, two a byte, HIGH nibble
                           first) + X.weight.absmax (F32, one per `blocksize` values of the flat weight; with double
                           quant U8 codes + X.weight.nested_absmax F32 + X.weight.nested_quant_map F32 [256]) +
                           X.weight.quant_map (F32 [16]) + X.weight.quant_state.bitsandbytes__{nf4|fp4} (U8: JSON of
                           quant_type, blocksize, dtype, shape and the nested block size, dtype and offset)
                           -> X.weight, the shape its quant state says
  bnb_int8                 X.weight (I8 [N, K]) + X.SCB (F32 [N]) (+ X.weight_format, dropped: bitsandbytes 0.50
                           ignores it) -> X.weight [N, K] (LLM.int8(), `load_in_8bit`)

Formulas: kernels/bnb_cpu.py (bitsandbytes' dequantize_4bit, with the nested absmax rebuilt in fp32 first, and
int8_vectorwise_dequant), bit for bit against bitsandbytes 0.50 on the CPU (tests/test_formats_bnb.py).

The quant state is untrusted data the plan needs (the output's shape): each 4-bit weight's state and quant map
are read at plan time (AT_PLAN sides, at most AT_PLAN_BYTES), parsed as strict JSON, checked against the tensors
beside it (and the dequantized shape against config.json), and the weight is planned with the row its state
names (`QuantFormat.at_plan`): `bnb4:nf4:64:4096x11008`, or with double quant
`bnb4:nf4:64:4096x11008:256:3f25c000` (the nested block size, the fp32 bits of the nested offset), which
`named` rebuilds. Runs of output rows start at a block's first value (and a nested block's): `row_align`.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np

from ckpttool.errors import InputError, PlanError
from ckpttool.formats.resolve import Rule
from ckpttool.formats.row import AT_PLAN, BY_ROWS, DROPPED, WHOLE, Chunk, Name, QuantFormat, Side
from ckpttool.io.safetensors import loads_strict_json
from ckpttool.kernels import bnb_cpu

METHOD = "bitsandbytes"
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""the block sizes bitsandbytes' dequantize_4bit accepts"""
STATE_DTYPES = ("bfloat16", "float16", "float32")
_STATE_KEYS = {"quant_type", "blocksize", "dtype", "shape"}
_NESTED_KEYS = {"nested_blocksize", "nested_dtype", "nested_offset"}
_FIX = "this is not a bitsandbytes checkpoint as it saves them; re-download it"


# -- 4-bit ----------------------------------------------------------------------------------------------
def _sides(qt: str, nested: bool, blocks=None, nested_blocks=None) -> tuple[Side, ...]:
    """The tensors beside a 4-bit weight; `blocks(r0, r1)` / `nested_blocks` the absmax spans output rows need."""
    out = [Side("scale", Name("weight.absmax"), ("U8",) if nested else ("F32",), BY_ROWS, rows=blocks or _unplanned)]
    if nested:
        out += [Side("nested_scale", Name("weight.nested_absmax"), ("F32",), BY_ROWS, rows=nested_blocks or _unplanned),
                Side("nested_map", Name("weight.nested_quant_map"), ("F32",), WHOLE, rows=lambda r0, r1: (0, 256))]
    return (*out, Side("map", Name("weight.quant_map"), ("F32",), AT_PLAN),
            Side("state", Name(f"weight.quant_state.bitsandbytes__{qt}"), ("U8",), AT_PLAN))


def _unplanned(*_):
    raise PlanError("a bitsandbytes 4-bit weight was used before its quant state was read",
                    fix="report this: it is a bug in ckpttool")


def _check4(nested: bool):
    def check(w_shape, sides, names, file) -> None:
        """Header shapes alone (the quant state's numbers are checked by `_plan`)."""
        if len(w_shape) != 2 or w_shape[1] != 1:
            raise InputError(f"packed 4-bit weight is {list(w_shape)}, not [n/2, 1] (bitsandbytes' uint8 storage)",
                             file=file, tensor=names["state"], fix=_FIX)
        want = {"scale": 1, "map": (16,), "state": 1, **({"nested_scale": 1, "nested_map": (256,)} if nested else {})}
        for role, shape in want.items():
            got = tuple(sides[role])
            if (len(got) != shape) if isinstance(shape, int) else (got != shape):
                raise InputError(f"{role} shape {list(got)}: expected " + ("one dimension" if isinstance(shape, int)
                                 else str(list(shape))), file=file, tensor=names[role], fix=_FIX)
    return check


def _shown(value: object) -> str:
    """A value read from a quant state, for a message: repr (which escapes control characters), at most 60 long."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(doc: dict, key: str, ok, why: str, where) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not ok(v):
        raise InputError(f"quant state {key} {_shown(v)}: {why}", **where, fix=_FIX)
    return v


def _plan(qt: str, nested: bool):
    def at_plan(w_shape, shapes, data, names, file) -> QuantFormat:
        """The row of one weight, from its quant state (JSON) and quant map, checked against the tensors."""
        where = {"file": file, "tensor": names["state"]}
        doc = loads_strict_json(data["state"].tobytes(), what=f"quant state {names['state']!r}", fix=_FIX, file=file)
        if not isinstance(doc, dict):
            raise InputError(f"quant state is {type(doc).__name__}, not an object", **where, fix=_FIX)
        keys = _STATE_KEYS | (_NESTED_KEYS if nested else set())
        if set(doc) != keys:
            extra, missing = [_shown(k) for k in sorted(set(doc) - keys)[:5]], sorted(keys - set(doc))
            raise InputError(f"quant state keys differ from bitsandbytes' {'double-quant ' if nested else ''}4-bit "
                             f"state: {'unexpected ' + ', '.join(extra) if extra else ''}"
                             f"{'; ' if extra and missing else ''}{'missing ' + ', '.join(missing) if missing else ''}"
                             + ("" if nested or not set(doc) & _NESTED_KEYS else
                                " (it says double quant, but there is no nested_absmax beside it)"), **where, fix=_FIX)
        if doc["quant_type"] != qt or doc["dtype"] not in STATE_DTYPES:
            raise InputError(f"quant state says quant_type {_shown(doc['quant_type'])}, dtype {_shown(doc['dtype'])}: expected "
                             f"{qt!r} (its name) and one of {', '.join(STATE_DTYPES)}", **where, fix=_FIX)
        bs = _int(doc, "blocksize", lambda v: v in BLOCKSIZES, f"bitsandbytes' block sizes are {BLOCKSIZES}", where)
        shape = doc["shape"]
        if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                                    and v > 0 for v in shape)):
            raise InputError(f"quant state shape {_shown(shape)}: expected [rows, columns] (a Linear4bit weight)", **where,
                             fix=_FIX)
        rows, cols = shape
        if cols % 2:
            raise InputError(f"quant state shape {shape}: an odd number of columns splits a byte between rows",
                             **where, fix="ckpttool reads bitsandbytes weights whose rows are whole bytes")
        n = rows * cols
        blocks = -(-n // bs)
        if tuple(w_shape) != (n // 2, 1) or tuple(shapes["scale"]) != (blocks,):
            values = _sides(qt, nested)[-1].name.base_of(names["state"])
            raise InputError(f"quant state says {shape} in blocks of {bs}: {values} is {list(w_shape)} and its "
                             f"absmax {list(shapes['scale'])}, expected [{n // 2}, 1] and [{blocks}]", **where, fix=_FIX)
        if not np.array_equal(data["map"], bnb_cpu.CODES[qt]):
            raise InputError(f"quant map is not bitsandbytes' {qt} table (which bitsandbytes dequantizes with)",
                             file=file, tensor=names["map"], fix=_FIX)
        if not nested:
            return bnb4_row(qt, bs, rows, cols)
        nbs = _int(doc, "nested_blocksize", lambda v: 0 < v <= 1 << 20, "a positive block size", where)
        offset, ok = doc["nested_offset"], False
        if isinstance(offset, (int, float)) and not isinstance(offset, bool):
            with np.errstate(over="ignore"):
                offset = np.float32(float(offset)) if abs(offset) < 1e39 else np.float32(np.inf)
            ok = bool(np.isfinite(offset))
        if doc["nested_dtype"] != "float32" or not ok:
            raise InputError(f"quant state nested_dtype {_shown(doc['nested_dtype'])}, nested_offset "
                             f"{_shown(doc['nested_offset'])}: expected float32 and a finite float32 number", **where,
                             fix=_FIX)
        if tuple(shapes["nested_scale"]) != (-(-blocks // nbs),):
            raise InputError(f"nested absmax is {list(shapes['nested_scale'])}: {blocks} blocks in nested blocks of "
                             f"{nbs} need [{-(-blocks // nbs)}]", file=file, tensor=names["nested_scale"], fix=_FIX)
        return bnb4_row(qt, bs, rows, cols, nbs, int(offset.view(np.uint32)))
    return at_plan


def _title(qt: str, nested: bool) -> str:
    return f"bitsandbytes {qt.upper()}" + (" (double quant)" if nested else "")


@functools.lru_cache(maxsize=None)
def template_row(qt: str, nested: bool) -> QuantFormat:
    """What a config declares: the tensors of a 4-bit weight, planned per weight from its quant state."""
    def unplanned(*_):
        return _unplanned()

    return QuantFormat(
        name=f"bnb4:{qt}" + (":nested" if nested else ""), title=_title(qt, nested), values=Name("weight"),
        value_dtypes=("U8",), sides=_sides(qt, nested), check=_check4(nested), out_shape=unplanned, cpu=unplanned,
        cuda=unplanned, example=unplanned, keepable=False, at_plan=_plan(qt, nested))


@functools.lru_cache(maxsize=None)
def bnb4_row(qt: str, bs: int, rows: int, cols: int, nbs: int = 0, offset_bits: int = 0) -> QuantFormat:
    """The row of one 4-bit weight of shape [rows, cols] in blocks of `bs` (nested blocks of `nbs` with the offset
    whose fp32 bits are `offset_bits`, where nbs > 0)."""
    nested = nbs > 0
    offset = np.uint32(offset_bits).view(np.float32)
    span = bs * (nbs or 1)  # values a run must start on a multiple of: a (nested) block's first
    align = span // math.gcd(cols, span)

    def absmax(c: Chunk) -> np.ndarray:
        if not nested:
            return c.sides["scale"]
        return bnb_cpu.nested_absmax(c.sides["scale"], c.sides["nested_map"], c.sides["nested_scale"], nbs, offset)

    def check_sides(sides) -> str | None:
        if not nested:
            return None
        bad = bnb_cpu.nested_absmax_finite(sides["scale"], sides["nested_map"], sides["nested_scale"], nbs, offset)
        return None if bad is None else (f"double-quant absmax (nested_quant_map x nested_absmax + offset) is not a "
                                         f"finite float32 (block {bad} of the run)")

    def cpu(c: Chunk, out: str, into):
        return bnb_cpu.dequant_4bit(c.values, absmax(c), bnb_cpu.CODES[qt], bs, out, into).reshape(-1, cols)

    def cuda(c: Chunk, out_dtype):
        import torch

        from ckpttool.dtypes import dtype_code
        from ckpttool.kernels.fp8_cpu import value_tables

        host = Chunk(None, c.dtype, {r: v.cpu().numpy() for r, v in c.sides.items()}, c.side_dtypes)
        table = value_tables(bnb_cpu.CODES[qt], absmax(host), dtype_code(out_dtype)).reshape(-1)
        table = torch.from_numpy(table.view(table.dtype.str.replace("u", "i"))).to(c.values.device)
        packed = c.values.view(torch.uint8).reshape(-1).to(torch.int64)
        base = (torch.arange(packed.shape[0], device=packed.device) * 2 // bs) * 16
        words = torch.stack((table[base + (packed >> 4)], table[base + (packed & 15)]), dim=1)
        return words.reshape(-1, cols).view(out_dtype), None  # a gather of the CPU's tables: no NaN to find

    def example(dev) -> Chunk:
        import torch

        n = align * cols
        blocks = -(-n // bs)
        sides = {"scale": torch.full((blocks,), 1 if nested else 0.5, dtype=torch.uint8 if nested else torch.float32,
                                     device=dev)}
        if nested:
            sides |= {"nested_scale": torch.ones(-(-blocks // nbs), device=dev),
                      "nested_map": torch.zeros(256, device=dev)}
        return Chunk(torch.zeros(n // 2, 1, dtype=torch.uint8, device=dev), "U8", sides,
                     {"scale": "U8" if nested else "F32", "nested_scale": "F32", "nested_map": "F32"})

    def blocks(r0: int, r1: int) -> tuple[int, int]:
        return r0 * cols // bs, -(-r1 * cols // bs)

    def nested_blocks(r0: int, r1: int) -> tuple[int, int]:
        return r0 * cols // span, -(-r1 * cols // span)

    name = f"bnb4:{qt}:{bs}:{rows}x{cols}" + (f":{nbs}:{offset_bits:08x}" if nested else "")
    return QuantFormat(
        name=name, title=_title(qt, nested), values=Name("weight"), value_dtypes=("U8",),
        sides=_sides(qt, nested, blocks, nested_blocks), check=_check4(nested), out_shape=lambda s: (rows, cols),
        row_align=align, source_span=lambda r0, r1, s: (0, r0 * cols // 2, r1 * cols // 2), cpu=cpu, cpu_into=True,
        cuda=cuda, example=example, keepable=False, check_sides=check_sides)


# -- LLM.int8() -------------------------------------------------------------------------------------------
def _check8(w_shape, sides, names, file) -> None:
    if len(w_shape) != 2 or tuple(sides["scale"]) != (w_shape[0],):
        raise InputError(f"SCB shape {list(sides['scale'])} for int8 weight {list(w_shape)}: expected [{w_shape[0]}] "
                         "(one scale per row)" if len(w_shape) == 2 else f"int8 weight is {list(w_shape)}, not 2-D",
                         file=file, tensor=names["scale"], fix=_FIX)


def _int8_cuda(c: Chunk, out_dtype):
    import torch

    from ckpttool.dtypes import dtype_code
    from ckpttool.kernels import grouped

    codes = c.values.view(torch.uint8)
    table = bnb_cpu.int8_tables(c.scale.reshape(-1).cpu().numpy(), dtype_code(out_dtype))
    table = torch.from_numpy(table.view(table.dtype.str.replace("u", "i"))).to(codes.device)
    which = torch.arange(codes.shape[0], dtype=torch.int32, device=codes.device).reshape(-1, 1)
    return grouped.gather_torch(codes, which, table, max(codes.shape[1], 1)).view(out_dtype), None


def _int8_example(dev) -> Chunk:
    import torch

    return Chunk(torch.zeros(1, 2, dtype=torch.int8, device=dev), "I8", {"scale": torch.ones(1, device=dev)},
                 {"scale": "F32"})


BNB_INT8 = QuantFormat(
    name="bnb_int8", title="bitsandbytes LLM.int8()", values=Name("weight"), value_dtypes=("I8",),
    sides=(Side("scale", Name("SCB"), ("F32",), BY_ROWS), Side("dropped", Name("weight_format"), read=DROPPED)),
    check=_check8, out_shape=lambda s: s, cpu=lambda c, out, into: bnb_cpu.dequant_int8(c.values, c.scale, out, into),
    cpu_into=True, cuda=_int8_cuda, example=_int8_example, keepable=False)

TEMPLATES = tuple(template_row(qt, nested) for qt in bnb_cpu.CODES for nested in (False, True))
ROWS = (BNB_INT8, *TEMPLATES)
_NAMED = re.compile(r"bnb4:(nf4|fp4):(\d+):(\d+)x(\d+)(?::(\d+):([0-9a-f]{8}))?")


def named(name: str) -> QuantFormat | None:
    """The row a plan's transform name stands for (4-bit rows are made for each weight's quant state)."""
    m = _NAMED.fullmatch(name)
    if m is None or int(m[2]) not in BLOCKSIZES or int(m[4]) % 2 or not int(m[3]) or (m[5] is not None and not int(m[5])):
        return None
    return bnb4_row(m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5] or 0), int(m[6] or "0", 16))


# -- config.json ----------------------------------------------------------------------------------------
def _refuse(what: str, source) -> InputError:
    return InputError(f"bitsandbytes quantization_config {what} is not a layout ckpttool reads", file=source,
                      fix="ckpttool reads bitsandbytes' serialized 4-bit (nf4, fp4, double quant or not, uint8 "
                          "storage) and 8-bit (LLM.int8()) weights; dequantize this checkpoint with bitsandbytes")


def declared(quant: dict, source) -> tuple[Rule, ...]:
    """The rules of transformers' BitsAndBytesConfig, read as its quantizer reads them when it loads a checkpoint:
    load_in_4bit (each weight's quant type and double quant come from its quant state, as bitsandbytes reads
    them: every 4-bit row is declared) or load_in_8bit, less llm_int8_skip_modules (transformers'
    should_convert_module: a pattern matched from the start to a module boundary, or a suffix)."""
    four, eight = bool(quant.get("load_in_4bit")), bool(quant.get("load_in_8bit"))
    if four == eight:
        raise _refuse(f"load_in_4bit {quant.get('load_in_4bit')!r}, load_in_8bit {quant.get('load_in_8bit')!r}", source)
    qt, storage = quant.get("bnb_4bit_quant_type", "fp4"), quant.get("bnb_4bit_quant_storage", "uint8")
    if four and (qt not in bnb_cpu.CODES or storage not in (None, "uint8")):
        raise _refuse(f"bnb_4bit_quant_type {qt!r}, bnb_4bit_quant_storage {storage!r}", source)
    if eight and quant.get("llm_int8_has_fp16_weight"):
        raise _refuse("llm_int8_has_fp16_weight true (fp16 weights, not int8)", source)
    skip = quant.get("llm_int8_skip_modules") or []
    if not isinstance(skip, list) or not all(isinstance(k, str) and k for k in skip):
        raise _refuse(f"llm_int8_skip_modules {skip!r} (a list of module names or patterns)", source)
    ignore = []
    for key in skip:
        try:
            re.compile(key)
        except re.error:
            raise _refuse(f"llm_int8_skip_modules entry {key!r} (not a regular expression)", source) from None
        ignore += [f"re:(?:{key})(?:(?<=\\.)|(?=\\.|$))", f"re:.*{re.escape(key)}$"]
    origin = "quantization_config (bitsandbytes " + ("4-bit)" if four else "8-bit)")
    return tuple(Rule(row, origin, ignore=tuple(ignore)) for row in (TEMPLATES if four else (BNB_INT8,)))
