"""families/keymap.py on its own, without the CLI: the one `(hf template, native template, split[, LINEAR])`
table read both ways (every row of every family's tables round-trips), the scale companions it derives, the
aliases some checkpoints use, the parts a wrapper passes through, a table renamed for a wrapper, and the tables
it refuses to build."""

from __future__ import annotations

import re

import pytest

from ckpttool.families.base import HeadSplit
from ckpttool.families.deepseek_v4.spec import KEY_MAPS as V4_KEY_MAPS
from ckpttool.families.keymap import EXPERT, LINEAR, RANK0, KeyMap, Segment
from ckpttool.families.multimodal import WRAPPERS
from ckpttool.families.table import FAMILIES, TEXT_FAMILIES
from ckpttool.formats import COMPANIONS

PLACEHOLDER = re.compile(r"\{(\w+)\}")
NUMBERS = {"layer": 13, "expert": 7}  # two digits and one, so a swapped pair shows; any other field: 5


def every_table() -> list[tuple[str, KeyMap]]:
    """(label, table) for every key table ckpttool reads: each family's, each model type's, both DeepSeek-V4
    spellings, and each multimodal wrapper's spellings of its text tower's table."""
    tables = []
    for family in FAMILIES:
        tables.append((family.name, family.key_map))
        tables += [(f"{family.name}:{t}", km) for t, km in family.key_maps.items()]
    tables += [(f"deepseek_v4:{s}", km) for s, km in V4_KEY_MAPS.items()]
    by_name = {f.name: f for f in TEXT_FAMILIES}
    for w in WRAPPERS:
        text = by_name[w.text_family].key_map
        tables += [(f"{w.model_type}:{s.title}", text.renamed(s.wrap, passthrough=s.passthrough)) for s in w.spellings]
    return tables


def filled(template: str) -> tuple[str, dict[str, int]]:
    values = {f: NUMBERS.get(f, 5) for f in PLACEHOLDER.findall(template)}
    return template.format(**values), values


@pytest.mark.parametrize("label,table", every_table(), ids=[label for label, _ in every_table()])
def test_every_row_round_trips_both_ways(label, table):
    """hf -> native -> hf gives back the name, the split and the row, for every row (scale companions
    included; a tensor held as Segments gives each of its rows, in order); no two rows claim one native name."""
    assert table.rows, label
    natives = set()
    for row in table.rows:
        hf, values = filled(row.hf)
        every = table.to_natives(hf)  # one, or one per Segment of a tensor held as several (in index order)
        assert every, f"{label}: {hf} has no row"
        assert table.to_native(hf).row is every[0].row
        mapped = next((m for m in every if m.row is row), None)
        assert mapped is not None, f"{label}: {hf} found {[m.row.native for m in every]}, not its own row {row.native}"
        if isinstance(row.split, Segment):
            assert [m.row.split.index for m in every] == list(range(len(row.split.sizes))), label
        else:
            assert len(every) == 1, label
        assert mapped.name == row.native.format(**values), f"{label}: {hf} -> {mapped.name}"
        assert mapped.split == row.split and mapped.values == values
        back = table.to_hf(mapped.name)
        assert back is not None and back.name == hf and back.row is row, f"{label}: {mapped.name} -> {back}"
        natives.add(mapped.name)
    assert len(natives) == len(table.rows), f"{label}: two rows map to one native name"


def test_lookup_is_by_shape_of_the_name():
    """Numeric components are placeholders wherever they are: layer 2 and layer 120 find the same row; a name
    with a component no row has finds nothing, both ways."""
    km = KeyMap([("model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
                  "layers.{layer}.ffn.experts.{expert}.w3.weight", EXPERT, LINEAR)])
    for layer, expert in ((2, 0), (120, 255)):
        m = km.to_native(f"model.layers.{layer}.mlp.experts.{expert}.up_proj.weight")
        assert m.name == f"layers.{layer}.ffn.experts.{expert}.w3.weight"
        assert m.values == {"layer": layer, "expert": expert} and m.split == EXPERT
    assert km.to_native("model.layers.2.mlp.experts.x.up_proj.weight") is None
    assert km.to_native("model.layers.2.mlp.experts.3.up_proj.bias") is None
    assert km.to_hf("layers.2.ffn.experts.3.w1.weight") is None


def test_scale_companions_are_derived_with_the_weights_split():
    """Each `*.weight` row brings one row per scale companion of the format table: `X.weight_scale_inv` <->
    `Y.scale`, split as its weight, naming its weight; rows that are not weights bring none."""
    split = HeadSplit(0, "num_attention_heads")
    km = KeyMap([("model.layers.{layer}.self_attn.q_proj.weight", "layers.{layer}.attention.wq.weight", split, LINEAR),
                 ("model.layers.{layer}.self_attn.q_proj.bias", "layers.{layer}.attention.wq.bias", split),
                 ("model.norm.weight", "norm.weight", None)])
    assert COMPANIONS, "the format table names at least one scale companion"
    assert len(km.rows) == 3 + 2 * len(COMPANIONS)
    for c in COMPANIONS:
        m = km.to_native(f"model.layers.4.self_attn.q_proj.{c.hf_leaf}")
        assert m.name == f"layers.4.attention.wq.{c.native_leaf}" and m.split is split
        assert m.companion == c and m.hf_weight == "model.layers.4.self_attn.q_proj.weight"
        assert not km.is_linear(f"model.layers.4.self_attn.q_proj.{c.hf_leaf}")
        assert km.to_hf(f"layers.4.attention.wq.{c.native_leaf}").name == f"model.layers.4.self_attn.q_proj.{c.hf_leaf}"
        assert km.to_native(f"model.norm.{c.hf_leaf}").companion == c  # a norm weight has a row too: the format decides
    assert km.to_native("model.layers.4.self_attn.q_proj.bias").companion is None
    assert km.to_native("model.layers.4.self_attn.q_proj.weight").hf_weight is None
    assert km.is_linear("model.layers.4.self_attn.q_proj.weight")
    assert not km.is_linear("model.layers.4.self_attn.q_proj.bias") and not km.is_linear("model.norm.weight")


def test_hf_scale_leaf_names_every_scale_the_tables_way():
    """DeepSeek-V4's checkpoints call a weight's scale `X.scale` where V3's say `X.weight_scale_inv`."""
    rows = [("layers.{layer}.attn.wq_b.weight", "layers.{layer}.attn.wq_b.weight", 0, LINEAR)]
    km = KeyMap(rows, hf_scale_leaf="scale")
    for c in COMPANIONS:
        assert km.to_native(f"layers.3.attn.wq_b.{c.hf_leaf}") is None or c.hf_leaf == "scale"
        m = km.to_native("layers.3.attn.wq_b.scale")
        assert m is not None and m.name == f"layers.3.attn.wq_b.{c.native_leaf}" and m.split == 0
    assert V4_KEY_MAPS["deepseek"].to_native("layers.0.attn.wq_b.scale").companion is not None
    assert V4_KEY_MAPS["deepseek"].to_native("layers.0.attn.wq_b.weight_scale_inv") is None


def test_aliases_read_as_the_rows_own_name():
    """An alias is another HF spelling of a row (transformers' own module names): `canonical` gives the row's
    name, which is what lookups and outputs use; the alias itself is no row of its own."""
    row = "model.layers.{layer}.block_sparse_moe.gate.weight"
    km = KeyMap([(row, "layers.{layer}.feed_forward.gate.weight", None)],
                aliases=(("model.layers.{layer}.mlp.gate.weight", row),))
    assert km.canonical("model.layers.9.mlp.gate.weight") == "model.layers.9.block_sparse_moe.gate.weight"
    assert km.canonical("model.layers.9.block_sparse_moe.gate.weight") is None  # the row's own name is no alias
    assert km.canonical("model.layers.9.mlp.up.weight") is None
    assert km.to_native("model.layers.9.mlp.gate.weight") is None
    assert km.to_hf("layers.9.feed_forward.gate.weight").name == "model.layers.9.block_sparse_moe.gate.weight"


def test_the_families_aliases_are_rows_of_their_tables():
    """Every alias a family's table lists (Mixtral's and MiniMax-M2's routers, MiMo's sinks) reads as a name
    that table maps."""
    seen = 0
    for label, km in every_table():
        for alias, hf in km._alias_pairs:
            name, values = filled(alias)
            assert km.canonical(name) == hf.format(**values), label
            assert km.to_native(km.canonical(name)) is not None, label
            seen += 1
    assert seen >= 3


@pytest.mark.parametrize("aliases,why", [
    ((("a.{layer}.gate.weight", "a.{layer}.router.weight"),), "not another spelling of one row"),  # no such row
    ((("a.{layer}.w1.weight", "a.{layer}.w3.weight"),), "not another spelling of one row"),  # the alias is a row
    ((("a.gate.weight", "a.{layer}.w3.weight"),), "changes placeholders"),
])
def test_bad_aliases_are_refused(aliases, why):
    rows = [("a.{layer}.w1.weight", "b.{layer}.w1.weight", 0), ("a.{layer}.w3.weight", "b.{layer}.w3.weight", 0)]
    with pytest.raises(ValueError, match=why):
        KeyMap(rows, aliases=aliases)


@pytest.mark.parametrize("rows,why", [
    ([("a.{layer}.w.weight", "b.{layer}.w.weight", 0), ("a.{expert}.w.weight", "c.{expert}.w.weight", 0)],
     "two rows with the same template"),
    ([("a.{layer}.w.weight", "b.{layer}.w.weight", 0), ("c.{layer}.w.weight", "b.{layer}.w.weight", 0)],
     "two rows with the same template"),
    ([("a.{layer}.w.weight", "b.w.weight", 0)], "changes placeholders"),
    ([("a.{layer}.w.weight", "b.{expert}.w.weight", 0)], "changes placeholders"),
])
def test_ambiguous_tables_are_refused(rows, why):
    """A table that could map one name two ways, or lose a layer number, is never built."""
    with pytest.raises(ValueError, match=why):
        KeyMap(rows)


def test_passthrough_parts_keep_their_names_on_rank0():
    """A wrapper's vision tower: carried whole, on rank 0, under its HF name, both ways; nothing else is."""
    km = KeyMap([("model.norm.weight", "norm.weight", None)], passthrough=("vision_tower.", "mm_projector."))
    for name in ("vision_tower.blocks.0.attn.qkv.weight", "mm_projector.proj.0.bias"):
        assert km.passes_through(name)
        for m in (km.to_native(name), km.to_hf(name)):
            assert m.name == name and m.split == RANK0 and m.companion is None
    assert not km.passes_through("model.norm.weight") and km.to_native("model.norm.weight").split is None
    assert km.to_native("vision_towers.x") is None


def test_renamed_table_prefixes_hf_names_only():
    """`renamed` puts a wrapper's prefix on every HF template (aliases too), keeps the native side, derives the
    scale rows once more (never twice) and keeps the scale leaf."""
    base = KeyMap([("model.layers.{layer}.mlp.gate.weight", "layers.{layer}.ffn.gate.weight", None),
                   ("model.layers.{layer}.mlp.up_proj.weight", "layers.{layer}.ffn.w3.weight", 0, LINEAR)],
                  hf_scale_leaf="scale",
                  aliases=(("model.layers.{layer}.mlp.router.weight", "model.layers.{layer}.mlp.gate.weight"),))
    km = base.renamed(lambda n: "language_model." + n, passthrough=("vision_tower.",))
    assert len(km.rows) == len(base.rows)
    m = km.to_native("language_model.model.layers.1.mlp.up_proj.weight")
    assert m.name == "layers.1.ffn.w3.weight" and m.split == 0 and km.is_linear(m.row.hf.format(layer=1))
    assert km.to_native("language_model.model.layers.1.mlp.up_proj.scale").companion is not None
    assert km.to_native("model.layers.1.mlp.up_proj.weight") is None
    assert km.to_hf("layers.1.ffn.gate.weight").name == "language_model.model.layers.1.mlp.gate.weight"
    assert km.canonical("language_model.model.layers.1.mlp.router.weight") == \
        "language_model.model.layers.1.mlp.gate.weight"
    assert km.passes_through("vision_tower.x") and not base.passes_through("vision_tower.x")
