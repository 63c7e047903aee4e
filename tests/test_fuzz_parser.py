"""Issue 5, fuzzing the header and index parsers with hypothesis.

The property: whatever the bytes, `read_header` and `Checkpoint` either return a result that is
internally consistent (and, for a single file, agrees with the reference safetensors parser), or
raise InputError. Any other exception, or an example slower than the deadline, is a failure.

CI runs a bounded number of examples (well under 20 s); set CKPTTOOL_FUZZ_EXAMPLES to run longer,
e.g. `CKPTTOOL_FUZZ_EXAMPLES=20000 pytest tests/test_fuzz_parser.py` (see bench/FUZZ.md).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from ckpttool.errors import InputError
from ckpttool.io.checkpoint import INDEX_NAME, Checkpoint
from ckpttool.io.safetensors import (
    ITEMSIZES, check_tensor_name, itemsize, read_bytes, read_header, tensor_from_bytes, torch_dtype,
)

EXAMPLES = int(os.environ.get("CKPTTOOL_FUZZ_EXAMPLES", "300"))
# CI runs are derandomized (same examples every run, no flakes); a long run explores fresh ones.
FUZZ = settings(max_examples=EXAMPLES, deadline=timedelta(seconds=5),
                derandomize="CKPTTOOL_FUZZ_EXAMPLES" not in os.environ, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def scratch() -> Path:
    # Module-scoped on purpose: hypothesis reruns the test body many times per function-scoped fixture.
    with tempfile.TemporaryDirectory(prefix="ckpttool-fuzz-") as d:
        yield Path(d)


# -- generators ------------------------------------------------------------------------------------
NASTY_NAMES = ["w", "model.layers.0.mlp.experts.7.down_proj.weight", "", "a/b", "..", "a\\b", "x\x00y", "x\ny",
               "\x1b[31m", "w\u202e", "\u00e9t\u00e9", "\U0001f600", "__metadata__", " ", "a" * 300]
NASTY_DTYPES = [*ITEMSIZES, "F4", "bf16", "", "F8_E4M3FN", "I128", None, 3, ["F32"], {"F32": 1}]

good_names = st.text(alphabet="abcxyz0123456789._-", min_size=1, max_size=12)
names = st.one_of(good_names, good_names, good_names, st.sampled_from(NASTY_NAMES), st.text(max_size=8))
dims = st.one_of(st.integers(0, 4), st.integers(0, 4), st.sampled_from([-1, True, False, 2.0, 2**48 + 1, 2**64, None]))
shapes = st.one_of(st.lists(st.integers(0, 4), max_size=3), st.lists(dims, max_size=4), st.just("2x2"))
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                         st.text(max_size=8))


@st.composite
def safetensors_files(draw) -> bytes:
    """A header laid out as a correct writer would, then (unless `clean`) perturbed at the JSON, text
    and byte levels. Clean examples keep the accepting path exercised: roughly half of them parse."""
    clean = draw(st.booleans())
    header: dict = {}
    if clean and draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3))
    elif not clean and draw(st.booleans()):
        header["__metadata__"] = draw(st.one_of(
            st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
            st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
            st.dictionaries(st.text(max_size=4), json_scalars, max_size=2), json_scalars))
    entries = []
    for _ in range(draw(st.integers(0, 4))):
        name = draw(good_names if clean else names)
        nasty = not clean and draw(st.integers(0, 5)) == 0
        dtype = draw(st.sampled_from(NASTY_DTYPES if nasty else list(ITEMSIZES)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3)) if clean or draw(st.integers(0, 4)) else draw(shapes)
        entries.append([name, dtype, shape])
    # Lay the entries out contiguously, in a drawn order, as a correct writer would.
    cursor = 0
    for i in draw(st.permutations(range(len(entries)))):
        name, dtype, shape = entries[i]
        try:
            n = math.prod(shape) * itemsize(dtype) if abs(math.prod(shape)) < 1 << 20 else 0
        except (TypeError, KeyError):
            n = 0
        n = max(int(n), 0)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + n]}
        cursor += n
    data_len = cursor
    # JSON-level perturbations of one entry.
    if not clean and entries and draw(st.booleans()):
        victim = header[draw(st.sampled_from([e[0] for e in entries]))]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra", "drop"]))
        if field == "drop":
            victim.pop(draw(st.sampled_from(sorted(victim))), None)
        else:
            victim[field] = draw(st.one_of(json_scalars, st.lists(json_scalars, max_size=3),
                                           st.lists(st.integers(-4, 64), min_size=2, max_size=2)))
    text = json.dumps(header, allow_nan=True, ensure_ascii=draw(st.booleans()))
    if clean and draw(st.integers(0, 3)) == 0:
        text += " " * draw(st.integers(1, 7))  # the reference writer pads headers to 8-byte alignment
    elif not clean and draw(st.integers(0, 3)) == 0:  # textual tricks json.dumps never produces
        trick = draw(st.sampled_from(["dup", "nan", "inf", "surrogate", "deep", "bigint", "pad", "bom"]))
        text = {
            "dup": lambda t: t[:-1] + (", " if len(t) > 2 else "") + t[1:] if t != "{}" else t,
            "nan": lambda t: t.replace("0", "NaN", 1),
            "inf": lambda t: t.replace("1", "-Infinity", 1),
            "surrogate": lambda t: t.replace('"', '"\\udc80', 1),
            "deep": lambda t: t[:-1] + (", " if len(t) > 2 else "") + '"d": ' + "[" * 5000 + "]" * 5000 + "}",
            "bigint": lambda t: t.replace("0", "9" * 5000, 1),
            "pad": lambda t: t + " " * draw(st.integers(0, 7)),
            "bom": lambda t: "\ufeff" + t,
        }[trick](text)
    raw = text.encode("utf-8", "surrogatepass")
    data = draw(st.binary(min_size=data_len, max_size=data_len)) if data_len <= 64 else bytes(data_len)
    header_len = len(raw)
    if not clean and draw(st.integers(0, 5)) == 0:
        header_len = draw(st.one_of(st.integers(0, len(raw) + 16), st.sampled_from([2**63, 2**64 - 1, 100_000_001])))
    blob = bytearray(struct.pack("<Q", header_len) + raw + data)
    for _ in range(0 if clean else draw(st.integers(0, 2))):  # byte-level mutations
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "append"]))
        pos = draw(st.integers(0, max(len(blob) - 1, 0)))
        if op == "flip" and blob:
            blob[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            blob[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del blob[pos:pos + draw(st.integers(1, 4))]
        elif op == "truncate":
            del blob[pos:]
        else:
            blob += draw(st.binary(min_size=1, max_size=4))
    return bytes(blob)


def kind_of(exc: InputError) -> str:
    """The message with names and numbers blanked, for hypothesis' event statistics."""
    text = re.sub(r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|\{.*\}|\d+", "_", exc.message)
    return text.split(":")[0][:48]


# -- properties ------------------------------------------------------------------------------------
def check_consistent(path: Path) -> None:
    """The parser accepted `path`: its result must be usable as is, and match the reference parser."""
    sf = read_header(path)
    size = path.stat().st_size
    cursor = sf.data_start
    for info in sorted(sf.tensors.values(), key=lambda t: (t.start, t.end)):
        check_tensor_name(info.name, path)
        info.name.encode("utf-8")
        assert info.start == cursor and info.nbytes == math.prod(info.shape) * itemsize(info.dtype)
        cursor = info.end
    assert cursor == size
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in sf.metadata.items())
    fd = os.open(path, os.O_RDONLY)
    try:
        ours = {n: tensor_from_bytes(read_bytes(fd, i.start, i.nbytes, path), i.dtype, i.shape)
                for n, i in sf.tensors.items()}
    finally:
        os.close(fd)
    # Everything we accept, the reference accepts too, and reads the same way (we are only stricter).
    with safe_open(str(path), framework="pt") as ref:
        assert set(ref.keys()) == set(sf.tensors)
        assert (ref.metadata() or {}) == sf.metadata
        for name, info in sf.tensors.items():
            theirs = ref.get_tensor(name)
            assert tuple(theirs.shape) == info.shape == tuple(ours[name].shape)
            assert theirs.dtype == ours[name].dtype == torch_dtype(info.dtype)
            assert torch.equal(theirs.reshape(-1).view(torch.uint8), ours[name].reshape(-1).view(torch.uint8))


def accepted_consistently_or_refused(path: Path) -> None:
    """The parser refuses `path` with an InputError (its kind counted in hypothesis' statistics), or accepts it
    and the result passes check_consistent."""
    try:
        read_header(path)
    except InputError as exc:
        event(f"rejected: {kind_of(exc)}")
        return
    event("accepted")
    check_consistent(path)


@FUZZ
@given(blob=safetensors_files())
def test_header_parser_accepts_consistently_or_raises_input_error(scratch, blob):
    path = scratch / "fuzz.safetensors"
    path.write_bytes(blob)
    accepted_consistently_or_refused(path)


@FUZZ
@given(blob=st.binary(max_size=256), brace=st.booleans(),
       short_by=st.one_of(st.integers(0, 8), st.integers(0, 300)))
def test_random_bytes_never_escape_as_another_exception(scratch, blob, brace, short_by):
    blob = b"{" + blob if brace else blob
    path = scratch / "random.safetensors"
    path.write_bytes(struct.pack("<Q", max(len(blob) - short_by, 0)) + blob)
    accepted_consistently_or_refused(path)


# -- the index -------------------------------------------------------------------------------------
SHARDS = {"s1.safetensors": {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2)},
          "s2.safetensors": {"c": torch.zeros(3, dtype=torch.bfloat16)},
          "sub/s3.safetensors": {"d": torch.tensor(7, dtype=torch.int64)}}
TRUE_MAP = {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}
FILE_VALUES = ["s1.safetensors", "s2.safetensors", "../s1.safetensors", "/etc/passwd", "./s1.safetensors",
               "sub/../s1.safetensors", "", "missing.safetensors", "s1.safetensors\x00", "s1.safetensors/",
               "..\\s1.safetensors", "outside/s1.safetensors", "sub/s3.safetensors", "sub//s3.safetensors",
               "sub/./s3.safetensors", None, 1, ["s1.safetensors"], {}]


@pytest.fixture(scope="module")
def shard_dir(scratch) -> Path:
    base = scratch / "shards"
    base.mkdir()
    (base / "sub").mkdir()
    for fname, tensors in SHARDS.items():
        save_file(tensors, str(base / fname))
    (scratch / "s1.safetensors").write_bytes((base / "s1.safetensors").read_bytes())  # a target for '..'
    return base


@st.composite
def index_texts(draw) -> str | bytes:
    weight_map: dict = dict(TRUE_MAP) if draw(st.integers(0, 3)) else {}
    if draw(st.booleans()):
        weight_map["d"] = "sub/s3.safetensors"
    if draw(st.booleans()):  # clean: only real mappings, in a drawn order
        keys = draw(st.permutations(sorted(weight_map)))
        return json.dumps({"metadata": {"total_size": 42}, "weight_map": {k: weight_map[k] for k in keys}})
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.one_of(st.sampled_from(["a", "b", "c", "d", "x\x00"]), st.text(max_size=4)))
        weight_map[name] = draw(st.sampled_from(FILE_VALUES))
    for _ in range(draw(st.integers(0, 1))):
        weight_map.pop(draw(st.sampled_from(["a", "b", "c"])), None)
    index: object = {"metadata": {"total_size": draw(json_scalars)}, "weight_map": weight_map}
    if draw(st.integers(0, 5)) == 0:
        index = draw(st.sampled_from([[], None, {"weight_map": list(weight_map.items())}, {"weight_map": None}]))
    text = json.dumps(index, allow_nan=True)
    if draw(st.integers(0, 3)) == 0:
        raw = bytearray(text.encode())
        for _ in range(draw(st.integers(1, 3))):
            pos = draw(st.integers(0, max(len(raw) - 1, 0)))
            raw[pos:pos + draw(st.integers(0, 2))] = draw(st.binary(max_size=3))
        return bytes(raw)
    return text


def check_checkpoint_consistent(root: Path) -> None:
    with Checkpoint(root) as ck:
        resolved_root = root.resolve()
        index = json.loads((root / INDEX_NAME).read_text())
        assert index["weight_map"] == {n: s.file for n, s in ck.tensors.items()}
        for name, src in ck.tensors.items():
            assert resolved_root in (root / src.file).resolve().parents
            assert name in ck.files[src.file].tensors
            assert torch.equal(ck.read(name), SHARDS[src.file][name])
        assert isinstance(ck.config, dict)


@FUZZ
@given(index=index_texts(), config=st.one_of(st.none(), st.just('{"model_type": "deepseek_v3"}'), st.none(),
                                             st.text(max_size=20), st.just('{"a": 1, "a": 2}')))
def test_index_resolution_accepts_consistently_or_raises_input_error(scratch, shard_dir, index, config):
    root = scratch / "ckpt"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(shard_dir, root)
    (root / INDEX_NAME).write_bytes(index.encode("utf-8", "surrogatepass") if isinstance(index, str) else index)
    if config is not None:
        (root / "config.json").write_text(config, encoding="utf-8", errors="surrogatepass")
    try:
        Checkpoint(root).close()
    except InputError as exc:
        event(f"rejected: {kind_of(exc)}")
        return
    event("accepted")
    check_checkpoint_consistent(root)
