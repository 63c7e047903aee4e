"""Renders README's Families tables: what the tests prove for each model type (tests/families_proven.py, the
one place those claims are typed) and the model types refused with a reason (`Family.refused_types` of
ckpttool/families/table.py), so the README says what the code reads and the tests prove, and nothing else.

    python scripts/families_table.py            # print the tables
    python scripts/families_table.py --write    # replace them in README.md, between the markers
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
START, END = "<!-- families-table:start (scripts/families_table.py) -->", "<!-- families-table:end -->"
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from ckpttool.families.table import FAMILIES  # noqa: E402
from families_proven import PROVEN  # noqa: E402


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    lines = ["| family (`model_type`) | dequant / convert | shard --mp | merge back | verify vs transformers | notes |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in PROVEN:
        cells = (row.label, row.convert, row.shard, row.merge, row.verify, row.notes)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    refused = sorted((t, why) for family in FAMILIES for t, why in family.refused_types.items())
    if refused:
        lines += ["", "Refused, with the reason (`Family.refused_types`):", "",
                  "| `model_type` | why it is refused |", "| --- | --- |"]
        lines += [f"| `{t}` | {_cell(why)} |" for t, why in refused]
    return "\n".join(lines)


def readme_block(text: str) -> str:
    """What README.md holds between the markers."""
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str]) -> None:
    table = render()
    if "--write" not in argv:
        print(table)
        return
    text = README.read_text()
    before, rest = text.split(START, 1)
    README.write_text(f"{before}{START}\n{table}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
