"""README's Families tables are generated (scripts/families_table.py) from what the tests prove
(tests/families_proven.py) and from ckpttool/families/table.py: the README says nothing else, every model type
ckpttool reads has a row, and every row names tests that exist."""

from __future__ import annotations

import ast
import importlib.util

from ckpttool.families.table import FAMILIES, MODEL_TYPES
from conftest import REPO
from families_proven import PROVEN


def _script():
    spec = importlib.util.spec_from_file_location("families_table", REPO / "scripts" / "families_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_families_tables_are_the_generated_ones():
    table = _script()
    assert table.readme_block(table.README.read_text()) == table.render(), \
        "README's Families table is stale: run python scripts/families_table.py --write"


def test_every_model_type_ckpttool_reads_has_a_row_and_every_row_reads_one():
    covered = {t for row in PROVEN for t in row.model_types}
    assert set(MODEL_TYPES) - covered == set(), "model types without a row in tests/families_proven.py"
    assert covered - set(MODEL_TYPES) == set(), "rows for model types ckpttool does not read"
    refused = {t for family in FAMILIES for t in family.refused_types}
    assert not refused & set(MODEL_TYPES)


def test_every_row_names_tests_that_exist():
    defined: dict[str, set[str]] = {}
    for row in PROVEN:
        assert row.tests, row.label
        for ref in row.tests:
            module, function = ref.split("::")
            if module not in defined:
                tree = ast.parse((REPO / "tests" / module).read_text())
                defined[module] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert function.startswith("test_") and function in defined[module], f"{row.label}: {ref} does not exist"


def test_the_check_sees_a_stale_table():
    """The comparison fails on a README whose table says something the rows do not."""
    table = _script()
    text = table.README.read_text()
    doctored = text.replace("| GLM-5 (`glm_moe_dsa`) | yes |", "| GLM-5 (`glm_moe_dsa`) | bit-exact |")
    assert doctored != text and table.readme_block(doctored) != table.render()
