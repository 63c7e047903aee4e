"""Issue 5, input validation: a corpus of malformed checkpoints, every one rejected before any
weight is read with an InputError that names the file (and tensor) and says what to do.

Every case builds real bytes in tmp_path: hand-written safetensors files for the header parser, and
corrupted copies of a real demo checkpoint (3 shards, index, config) for index/config resolution.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from ckpttool.errors import InputError
from ckpttool.io.checkpoint import INDEX_NAME, Checkpoint
from ckpttool.io.safetensors import MAX_NDIM, read_header

SHARD1 = "model-00001-of-00003.safetensors"
SHARD2 = "model-00002-of-00003.safetensors"


# -- building blocks -------------------------------------------------------------------------------
def st_bytes(header: dict | str | bytes, data: bytes = b"", *, header_len: int | None = None) -> bytes:
    """A safetensors file from a header (dict -> JSON, str -> UTF-8 as given, bytes as given)."""
    if isinstance(header, dict):
        raw = json.dumps(header).encode()
    elif isinstance(header, str):
        raw = header.encode("utf-8", "surrogatepass")
    else:
        raw = header
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# A valid two-tensor file: "a" F32 [2, 2] at [0, 16), "b" BF16 [3] at [16, 22).
GOOD_HEADER = {"__metadata__": {"format": "pt"}, "a": entry("F32", [2, 2], 0, 16), "b": entry("BF16", [3], 16, 22)}
GOOD_DATA = bytes(range(22))


def header_with(**changes) -> dict:
    """GOOD_HEADER with top-level keys replaced (value None deletes the key)."""
    header = json.loads(json.dumps(GOOD_HEADER))
    for key, value in changes.items():
        if value is None:
            header.pop(key, None)
        else:
            header[key] = value
    return header


def rewrite_shard_header(path: Path, edit: Callable[[dict], None]) -> None:
    """Edit a real shard's header in place, keeping its data bytes."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    edit(header)
    path.write_bytes(st_bytes(header, blob[8 + n:]))


def edit_index(root: Path, edit: Callable[[dict], object]) -> None:
    """Edit the index in place; an edit that returns a dict replaces it."""
    path = root / INDEX_NAME
    index = json.loads(path.read_text())
    new = edit(index)
    path.write_text(json.dumps(new if isinstance(new, dict) else index))


@dataclass(frozen=True)
class Expect:
    load: Callable[[], object]  # raises the InputError
    file: str  # base name the error must name
    tensor: str | None  # tensor the error must name, where there is one
    says: str  # words the message must contain (case-insensitive)


CASES: dict[str, Callable[[Path, Path], Expect]] = {}


def case(fn: Callable[[Path, Path], Expect]) -> Callable[[Path, Path], Expect]:
    CASES[fn.__name__] = fn
    return fn


def bad_file(tmp: Path, blob: bytes, tensor: str | None, says: str, **kw) -> Expect:
    path = tmp / "bad.safetensors"
    path.write_bytes(blob)
    return Expect(lambda: read_header(path, **kw), path.name, tensor, says)


def bad_header(tmp: Path, header: dict | str | bytes, tensor: str | None, says: str, data: bytes = GOOD_DATA) -> Expect:
    return bad_file(tmp, st_bytes(header, data), tensor, says)


def bad_checkpoint(ckpt: Path, file: str, tensor: str | None, says: str) -> Expect:
    return Expect(lambda: Checkpoint(ckpt), file, tensor, says)


# -- file framing ----------------------------------------------------------------------------------
@case
def empty_file(tmp, ckpt):
    return bad_file(tmp, b"", None, "shorter than the 8-byte")


@case
def file_shorter_than_8_bytes(tmp, ckpt):
    return bad_file(tmp, b"\x10\x00\x00", None, "shorter than the 8-byte")


@case
def header_length_huge(tmp, ckpt):
    return bad_file(tmp, st_bytes(b"{}", header_len=2**64 - 1), None, "exceeds")


@case
def header_length_one_over_cap(tmp, ckpt):
    blob = st_bytes(json.dumps(GOOD_HEADER), GOOD_DATA)
    cap = struct.unpack("<Q", blob[:8])[0] - 1
    return bad_file(tmp, blob, None, "exceeds", max_header_bytes=cap)


@case
def header_length_past_eof(tmp, ckpt):
    return bad_file(tmp, st_bytes(b"{}", header_len=4096), None, "past the end")


@case
def not_a_regular_file(tmp, ckpt):
    path = tmp / "fifo.safetensors"
    os.mkfifo(path)  # opening it would block forever
    return Expect(lambda: read_header(path), path.name, None, "not a regular file")


@case
def directory_instead_of_file(tmp, ckpt):
    path = tmp / "dir.safetensors"
    path.mkdir()
    return Expect(lambda: read_header(path), path.name, None, "not a regular file")


# -- header text and JSON --------------------------------------------------------------------------
@case
def header_not_utf8(tmp, ckpt):
    return bad_header(tmp, b'{"a\xff\xfe": 1}', None, "not utf-8")


@case
def header_not_json(tmp, ckpt):
    return bad_header(tmp, json.dumps(GOOD_HEADER)[:-3], None, "not valid json")


@case
def header_with_bom(tmp, ckpt):
    return bad_header(tmp, "\ufeff" + json.dumps(GOOD_HEADER), None, "does not start with '{'")


@case
def header_not_object(tmp, ckpt):
    return bad_header(tmp, "[]", None, "does not start with '{'", data=b"")


@case
def header_nan_literal(tmp, ckpt):  # Python's json accepts NaN; JSON does not
    return bad_header(tmp, json.dumps(GOOD_HEADER).replace('"format": "pt"', '"format": NaN'), None, "nan")


@case
def header_infinity_in_shape(tmp, ckpt):
    return bad_header(tmp, json.dumps(GOOD_HEADER).replace("[2, 2]", "[2, -Infinity]"), None, "infinity")


@case
def header_float_overflows_to_infinity(tmp, ckpt):
    return bad_header(tmp, json.dumps(GOOD_HEADER).replace("[2, 2]", "[2, 1e999]"), None, "infinity")


@case
def header_deeply_nested(tmp, ckpt):
    return bad_header(tmp, '{"a": ' + "[" * 200_000 + "]" * 200_000 + "}", None, "too deeply")


@case
def header_integer_with_5000_digits(tmp, ckpt):
    return bad_header(tmp, json.dumps(GOOD_HEADER).replace("[2, 2]", "[2, " + "9" * 5000 + "]"), None, "digits")


@case
def duplicate_tensor_key(tmp, ckpt):  # json.loads would silently keep the second "a"
    text = json.dumps(GOOD_HEADER)[:-1] + ', "a": ' + json.dumps(entry("F32", [2, 2], 0, 16)) + "}"
    return bad_header(tmp, text, "a", "repeats key 'a'")


@case
def duplicate_field_in_entry(tmp, ckpt):
    return bad_header(tmp, json.dumps(GOOD_HEADER).replace('"dtype": "BF16"', '"dtype": "BF16", "dtype": "F16"'),
                      "b", "repeats key 'dtype'")


@case
def duplicate_metadata_key(tmp, ckpt):
    return bad_header(tmp, json.dumps(GOOD_HEADER).replace('"format": "pt"', '"format": "pt", "format": "np"'),
                      None, "repeats key 'format'")


# -- header entries --------------------------------------------------------------------------------
@case
def unknown_dtype(tmp, ckpt):
    return bad_header(tmp, header_with(b=entry("F4", [3], 16, 22)), "b", "unknown dtype")


@case
def dtype_not_a_string(tmp, ckpt):  # used to escape as TypeError (unhashable list)
    return bad_header(tmp, header_with(b={"dtype": ["BF16"], "shape": [3], "data_offsets": [16, 22]}), "b",
                      "unknown dtype")


@case
def entry_missing_data_offsets(tmp, ckpt):
    return bad_header(tmp, header_with(b={"dtype": "BF16", "shape": [3]}), "b", "exactly dtype, shape")


@case
def entry_with_extra_field(tmp, ckpt):
    return bad_header(tmp, header_with(b={**entry("BF16", [3], 16, 22), "stride": [1]}), "b", "exactly dtype, shape")


@case
def entry_not_an_object(tmp, ckpt):
    return bad_header(tmp, header_with(b=["BF16", [3], [16, 22]]), "b", "exactly dtype, shape")


@case
def negative_dimension(tmp, ckpt):
    return bad_header(tmp, header_with(b=entry("BF16", [-3], 16, 22)), "b", "non-negative integers")


@case
def bool_in_shape(tmp, ckpt):  # True is an int to isinstance(); [true, 3] must not mean [1, 3]
    return bad_header(tmp, header_with(b=entry("BF16", [True, 3], 16, 22)), "b", "non-negative integers")


@case
def float_in_shape(tmp, ckpt):
    return bad_header(tmp, header_with(b=entry("BF16", [3.0], 16, 22)), "b", "non-negative integers")


@case
def shape_not_a_list(tmp, ckpt):
    return bad_header(tmp, header_with(b=entry("BF16", "3", 16, 22)), "b", "non-negative integers")


@case
def shape_product_overflows(tmp, ckpt):  # 2**40 * 2**40 * 2 bytes wraps a u64 byte count in C
    return bad_header(tmp, header_with(b=entry("BF16", [2**40, 2**40, 2**40], 16, 22)), "b", "overflows")


@case
def huge_dimension_times_zero(tmp, ckpt):  # product 0, but torch.empty((0, 2**70)) fails later
    return bad_header(tmp, header_with(b=entry("BF16", [0, 2**70], 22, 22)), "b", "too large")


@case
def too_many_dimensions(tmp, ckpt):
    return bad_header(tmp, header_with(b=entry("BF16", [1] * (MAX_NDIM + 1), 16, 18)), "b", "too many")


@case
def byte_length_not_shape_times_dtype(tmp, ckpt):
    return bad_header(tmp, header_with(a=entry("F32", [2, 3], 0, 16)), "a", "byte length 16 != 24")


@case
def offsets_reversed(tmp, ckpt):
    return bad_header(tmp, header_with(b=entry("BF16", [3], 22, 16)), "b", "0 <= begin <= end")


@case
def offsets_negative(tmp, ckpt):
    return bad_header(tmp, header_with(a=entry("F32", [2, 2], -16, 0)), "a", "0 <= begin <= end")


@case
def offsets_not_a_pair(tmp, ckpt):
    return bad_header(tmp, header_with(b={"dtype": "BF16", "shape": [3], "data_offsets": [16, 22, 22]}), "b",
                      "0 <= begin <= end")


@case
def offsets_are_bools(tmp, ckpt):
    return bad_header(tmp, header_with(b={"dtype": "U8", "shape": [1], "data_offsets": [False, True]}), "b",
                      "0 <= begin <= end")


@case
def overlapping_offsets(tmp, ckpt):
    return bad_header(tmp, header_with(b=entry("BF16", [3], 10, 16)), "b", "overlaps tensor 'a'",
                      data=GOOD_DATA[:16])


@case
def gap_between_tensors(tmp, ckpt):
    return bad_header(tmp, header_with(b=entry("BF16", [3], 18, 24)), "b", "2 unaccounted bytes",
                      data=bytes(24))


@case
def offsets_past_end_of_file(tmp, ckpt):
    return bad_header(tmp, GOOD_HEADER, "b", "file has", data=GOOD_DATA[:-2])


@case
def empty_tensor_placed_past_the_data(tmp, ckpt):
    return bad_header(tmp, header_with(z=entry("F32", [0, 7], 30, 30)), "z", "8 unaccounted bytes")


@case
def trailing_bytes_after_data(tmp, ckpt):
    return bad_header(tmp, GOOD_HEADER, None, "3 trailing bytes", data=GOOD_DATA + b"EVL")


# -- tensor names and metadata ---------------------------------------------------------------------
def renamed(name: str) -> dict:
    return header_with(b=None, **{name: entry("BF16", [3], 16, 22)})


@case
def name_with_nul(tmp, ckpt):
    return bad_header(tmp, renamed("model.embed\x00.weight"), "model.embed\\x00.weight", "U+0000")


@case
def name_with_escape_sequence(tmp, ckpt):  # would repaint the user's terminal in an error message
    return bad_header(tmp, renamed("x\x1b[2Jy"), "x\\x1b[2Jy", "U+001B")


@case
def name_with_newline(tmp, ckpt):
    return bad_header(tmp, renamed("layer\nfake: ok"), "layer\\x0afake: ok", "U+000A")


@case
def name_with_bidi_override(tmp, ckpt):
    return bad_header(tmp, renamed("weight\u202egpj.exe"), "weight\\u202egpj.exe", "U+202E")


@case
def name_with_lone_surrogate(tmp, ckpt):  # "\ud800" in JSON decodes to a str no writer can encode
    return bad_header(tmp, json.dumps(renamed("w")).replace('"w"', '"w\\ud800"'), "w\\ud800", "U+D800")


@case
def name_with_slash(tmp, ckpt):
    return bad_header(tmp, renamed("../../etc/passwd"), "../../etc/passwd", "path separator")


@case
def name_with_backslash(tmp, ckpt):
    return bad_header(tmp, renamed("..\\evil"), "..\\evil", "path separator")


@case
def name_empty(tmp, ckpt):
    return bad_header(tmp, renamed(""), None, "non-empty string")


@case
def metadata_not_a_map(tmp, ckpt):
    return bad_header(tmp, header_with(__metadata__=["format", "pt"]), None, "__metadata__ must map strings")


@case
def metadata_value_not_a_string(tmp, ckpt):
    return bad_header(tmp, header_with(__metadata__={"format": "pt", "step": 1000}), None,
                      "__metadata__ must map strings")


@case
def metadata_null(tmp, ckpt):
    return bad_header(tmp, json.dumps(GOOD_HEADER).replace('{"format": "pt"}', "null"), None,
                      "__metadata__ must map strings")


# -- index -----------------------------------------------------------------------------------------
@case
def index_not_json(tmp, ckpt):
    (ckpt / INDEX_NAME).write_text('{"weight_map": {')
    return bad_checkpoint(ckpt, INDEX_NAME, None, "not valid json")


@case
def index_duplicate_tensor(tmp, ckpt):  # json keeps the last mapping silently
    text = (ckpt / INDEX_NAME).read_text()
    first = '"model.embed_tokens.weight": "model-00001-of-00003.safetensors"'
    assert first in text
    (ckpt / INDEX_NAME).write_text(text.replace(first, first + ', "model.embed_tokens.weight": "' + SHARD2 + '"'))
    return bad_checkpoint(ckpt, INDEX_NAME, "model.embed_tokens.weight", "repeats key")


@case
def index_without_weight_map(tmp, ckpt):
    edit_index(ckpt, lambda ix: ix.pop("weight_map"))
    return bad_checkpoint(ckpt, INDEX_NAME, None, "weight_map")


@case
def index_weight_map_is_a_list(tmp, ckpt):
    edit_index(ckpt, lambda ix: {**ix, "weight_map": list(ix["weight_map"].items())})
    return bad_checkpoint(ckpt, INDEX_NAME, None, "weight_map")


@case
def index_weight_map_empty(tmp, ckpt):
    edit_index(ckpt, lambda ix: {**ix, "weight_map": {}})
    return bad_checkpoint(ckpt, INDEX_NAME, None, "weight_map")


@case
def index_value_not_a_string(tmp, ckpt):  # used to escape as TypeError (unhashable list)
    edit_index(ckpt, lambda ix: ix["weight_map"].update({"model.norm.weight": [SHARD1]}))
    return bad_checkpoint(ckpt, INDEX_NAME, "model.norm.weight", "not a file name")


@case
def index_value_null(tmp, ckpt):
    edit_index(ckpt, lambda ix: ix["weight_map"].update({"model.norm.weight": None}))
    return bad_checkpoint(ckpt, INDEX_NAME, "model.norm.weight", "not a file name")


@case
def index_points_outside_with_dotdot(tmp, ckpt):
    shutil.copy(ckpt / SHARD1, tmp / SHARD1)  # the target exists: only the path itself is wrong
    edit_index(ckpt, lambda ix: ix["weight_map"].update({k: "../" + SHARD1 for k, v in ix["weight_map"].items()
                                                         if v == SHARD1}))
    return bad_checkpoint(ckpt, INDEX_NAME, None, "not a plain path inside")


@case
def index_points_at_absolute_path(tmp, ckpt):
    target = str((tmp / SHARD1).resolve())
    shutil.copy(ckpt / SHARD1, target)
    edit_index(ckpt, lambda ix: ix["weight_map"].update({k: target for k, v in ix["weight_map"].items()
                                                         if v == SHARD1}))
    return bad_checkpoint(ckpt, INDEX_NAME, None, "not a plain path inside")


@case
def index_path_with_dot_component(tmp, ckpt):  # "./x" and "x" would load one shard twice
    edit_index(ckpt, lambda ix: ix["weight_map"].update({"model.norm.weight": "./" + SHARD1}))
    return bad_checkpoint(ckpt, INDEX_NAME, None, "not a plain path inside")


@case
def index_path_with_backslash(tmp, ckpt):
    edit_index(ckpt, lambda ix: ix["weight_map"].update({"model.norm.weight": "..\\" + SHARD1}))
    return bad_checkpoint(ckpt, INDEX_NAME, None, "not a plain path inside")


@case
def index_names_missing_shard(tmp, ckpt):
    (ckpt / SHARD2).unlink()
    return bad_checkpoint(ckpt, INDEX_NAME, None, "missing")


@case
def index_names_tensor_its_file_lacks(tmp, ckpt):
    edit_index(ckpt, lambda ix: ix["weight_map"].update({"model.layers.9.ghost.weight": SHARD1}))
    return bad_checkpoint(ckpt, SHARD1, "model.layers.9.ghost.weight", "does not hold it")


@case
def index_maps_tensor_to_wrong_shard(tmp, ckpt):
    edit_index(ckpt, lambda ix: ix["weight_map"].update({"model.embed_tokens.weight": SHARD2}))
    return bad_checkpoint(ckpt, SHARD2, "model.embed_tokens.weight", "does not hold it")


@case
def shard_tensor_missing_from_index(tmp, ckpt):
    edit_index(ckpt, lambda ix: ix["weight_map"].pop("model.embed_tokens.weight"))
    return bad_checkpoint(ckpt, SHARD1, "model.embed_tokens.weight", "does not map it")


@case
def index_tensor_name_with_nul(tmp, ckpt):
    edit_index(ckpt, lambda ix: ix["weight_map"].update({"bad\x00name": SHARD1}))
    return bad_checkpoint(ckpt, INDEX_NAME, "bad\\x00name", "U+0000")


@case
def index_nan_literal(tmp, ckpt):
    edit_index(ckpt, lambda ix: ix["metadata"].update({"total_size": float("nan")}))  # json.dumps writes NaN
    return bad_checkpoint(ckpt, INDEX_NAME, None, "nan")


@case
def index_is_a_directory(tmp, ckpt):
    (ckpt / INDEX_NAME).unlink()
    (ckpt / INDEX_NAME).mkdir()
    return bad_checkpoint(ckpt, INDEX_NAME, None, "not a regular file")


@case
def index_dangling_symlink(tmp, ckpt):  # not "no index, glob the shards": the user meant an index
    (ckpt / INDEX_NAME).unlink()
    (ckpt / INDEX_NAME).symlink_to(tmp / "nowhere.json")
    return bad_checkpoint(ckpt, INDEX_NAME, None, "cannot read index")


@case
def shard_truncated(tmp, ckpt):
    last = max(read_header(ckpt / SHARD2).tensors.values(), key=lambda t: t.end).name
    blob = (ckpt / SHARD2).read_bytes()
    (ckpt / SHARD2).write_bytes(blob[:-100])
    return bad_checkpoint(ckpt, SHARD2, last, "file has")


@case
def shard_header_lies_about_dtype(tmp, ckpt):
    def edit(header):
        header["model.embed_tokens.weight"]["dtype"] = "F32"  # BF16 bytes, F32 claimed: length no longer fits
    rewrite_shard_header(ckpt / SHARD1, edit)
    return bad_checkpoint(ckpt, SHARD1, "model.embed_tokens.weight", "byte length")


# -- config and directory --------------------------------------------------------------------------
@case
def config_not_json(tmp, ckpt):
    (ckpt / "config.json").write_text("{'hidden_size': 256}")
    return bad_checkpoint(ckpt, "config.json", None, "not valid json")


@case
def config_with_bom(tmp, ckpt):  # Python's json refuses it too, but with advice to decode as utf-8-sig
    (ckpt / "config.json").write_bytes(b"\xef\xbb\xbf" + (ckpt / "config.json").read_bytes())
    return bad_checkpoint(ckpt, "config.json", None, "byte-order mark")


@case
def config_not_an_object(tmp, ckpt):
    (ckpt / "config.json").write_text("[256]")
    return bad_checkpoint(ckpt, "config.json", None, "not an object")


@case
def config_duplicate_key(tmp, ckpt):
    text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(text.replace('"hidden_size": 256', '"hidden_size": 256, "hidden_size": 512'))
    return bad_checkpoint(ckpt, "config.json", None, "repeats key 'hidden_size'")


@case
def config_infinity_literal(tmp, ckpt):
    text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(text.replace('"rope_theta": 10000.0', '"rope_theta": Infinity'))
    return bad_checkpoint(ckpt, "config.json", None, "infinity")


@case
def same_tensor_in_two_shards_without_index(tmp, ckpt):
    (ckpt / INDEX_NAME).unlink()
    shutil.copy(ckpt / SHARD1, ckpt / "copy-of-shard1.safetensors")
    return bad_checkpoint(ckpt, SHARD1, None, "two shards")


@case
def directory_without_safetensors(tmp, ckpt):
    for p in ckpt.glob("*.safetensors*"):
        p.unlink()
    return bad_checkpoint(ckpt, ckpt.name, None, "no *.safetensors")


@case
def checkpoint_directory_missing(tmp, ckpt):
    return bad_checkpoint(tmp / "no-such-dir", "no-such-dir", None, "does not exist")


# -- the test --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_template(tiny_v3) -> Path:
    """The session's tiny FP8 DeepSeek-V3 checkpoint (conftest); cases corrupt copies of it, never it."""
    return tiny_v3


def test_corpus_is_large_enough():
    assert len(CASES) >= 35


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_input_is_rejected(name, tmp_path, demo_template):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(demo_template, ckpt)
    expect = CASES[name](tmp_path, ckpt)
    with pytest.raises(InputError) as info:
        expect.load()
    err = info.value
    text = str(err)
    assert expect.says.lower() in err.message.lower(), text
    assert err.file is not None and Path(err.file).name == expect.file, text
    assert f"file {err.file}" in text
    if expect.tensor is not None:
        assert err.tensor == expect.tensor, text
        assert repr(expect.tensor) in text
    assert err.fix and f"fix: {err.fix}" in text, "every error must say what to do"
    # Printed errors must not carry raw control characters (terminal escapes, NUL, newlines in names).
    first_line, _, fix_line = text.partition("\n  fix: ")
    assert not any(ord(c) < 32 or ord(c) == 127 for c in first_line + fix_line), repr(text)
    assert len(text) < 1000, "hostile headers must not turn into huge messages"


# -- what must still be accepted ---------------------------------------------------------------------
def test_valid_file_parses(tmp_path):
    path = tmp_path / "ok.safetensors"
    path.write_bytes(st_bytes(GOOD_HEADER, GOOD_DATA))
    sf = read_header(path)
    assert sf.metadata == {"format": "pt"}
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in sf.tensors.values()] == [
        ("a", "F32", (2, 2), 16), ("b", "BF16", (3,), 6)]


def test_header_exactly_at_cap_is_accepted(tmp_path):
    path = tmp_path / "ok.safetensors"
    blob = st_bytes(GOOD_HEADER, GOOD_DATA)
    path.write_bytes(blob)
    read_header(path, max_header_bytes=struct.unpack("<Q", blob[:8])[0])


def test_space_padded_header_and_empty_file_are_accepted(tmp_path):
    # safetensors pads headers with spaces to 8-byte alignment; a file with no tensors is legal
    path = tmp_path / "ok.safetensors"
    path.write_bytes(st_bytes(json.dumps(GOOD_HEADER) + "     ", GOOD_DATA))
    assert set(read_header(path).tensors) == {"a", "b"}
    path.write_bytes(st_bytes(b"{}  "))
    assert read_header(path).tensors == {}


def test_scalar_and_zero_size_tensors_round_trip(tmp_path):
    import torch
    from safetensors.torch import save_file

    tensors = {"scalar": torch.tensor(3.5), "empty": torch.zeros(0, 5, dtype=torch.bfloat16),
               "vec": torch.arange(4, dtype=torch.int64)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with Checkpoint(tmp_path) as ck:
        assert ck.tensors["scalar"].info.shape == ()
        for name, want in tensors.items():
            assert torch.equal(ck.read(name), want), name


def test_demo_checkpoint_loads(demo_template):
    with Checkpoint(demo_template) as ck:
        assert len(ck.files) == 3 and ck.config["model_type"] == "deepseek_v3"
        assert ck.total_bytes == json.loads((demo_template / INDEX_NAME).read_text())["metadata"]["total_size"]


def test_symlinked_shard_outside_the_directory_is_followed(tmp_path, demo_template):
    """Decision: symlinks are followed wherever they point, because the Hugging Face cache keeps
    each snapshot's shards as symlinks into ../../blobs. Only the index *text* is policed."""
    ckpt = tmp_path / "snapshot"
    shutil.copytree(demo_template, ckpt)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (ckpt / SHARD1).rename(blobs / "abc123")
    (ckpt / SHARD1).symlink_to(Path("..") / "blobs" / "abc123")
    with Checkpoint(ckpt) as ck:
        assert ck.read("model.embed_tokens.weight").shape[0] == 1024


# -- the CLI turns these into a message and an exit code ----------------------------------------------
@pytest.fixture
def hostile_index_checkpoint(tmp_path, demo_template) -> Path:
    pytest.importorskip("ckpttool.cli.inspect", reason="`ckpttool inspect` has not landed yet")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(demo_template, ckpt)
    edit_index(ckpt, lambda ix: ix["weight_map"].update({"model.norm.weight": "../../etc/passwd"}))
    return ckpt


def test_cli_reports_without_traceback(hostile_index_checkpoint):
    """A real process: one-paragraph error on stderr, non-zero exit, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("CKPTTOOL_DEBUG", None)
    proc = subprocess.run([sys.executable, "-c", "from ckpttool.cli import main; main()",
                           "inspect", str(hostile_index_checkpoint)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and INDEX_NAME in proc.stderr and "fix:" in proc.stderr, proc.stderr


def test_cli_debug_variable_shows_the_traceback(hostile_index_checkpoint, monkeypatch):
    from ckpttool.cli import main  # in-process: the same main(), without paying a second interpreter start

    monkeypatch.setenv("CKPTTOOL_DEBUG", "1")
    monkeypatch.setattr(sys, "argv", ["ckpttool", "inspect", str(hostile_index_checkpoint)])
    with pytest.raises(InputError, match="not a plain path inside"):
        main()


def test_cli_rejects_a_bad_single_file(tmp_path, monkeypatch, capsys):
    pytest.importorskip("ckpttool.cli.inspect", reason="`ckpttool inspect` has not landed yet")
    from ckpttool.cli import main

    path = tmp_path / "bad.safetensors"
    path.write_bytes(st_bytes(renamed("x\x1b[2Jy"), GOOD_DATA))
    monkeypatch.delenv("CKPTTOOL_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["ckpttool", "inspect", str(path)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "bad.safetensors" in err and "U+001B" in err and "\x1b" not in err and "fix:" in err, err
