"""Renders tests/engines/report.json (written by `pytest -m engines`) as the README's Engines tables, so
the README says what the last engines run proved and nothing else.

    python scripts/engines_table.py            # print the tables
    python scripts/engines_table.py --write    # replace them in README.md, between the markers
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "tests" / "engines" / "report.json"
README = REPO / "README.md"
START, END = "<!-- engines-table:start (scripts/engines_table.py) -->", "<!-- engines-table:end -->"
ENGINES = ("vllm", "llama.cpp")
_VERDICT = {"equal": "same ids", "skipped": "skipped", "failed": "FAILED", "differs": "DIFFERENT ids",
            "not run": "not run"}


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render(report: dict) -> str:
    cases = report["cases"]
    lines = ["| engine | version | proven: transformers' greedy ids, float32 | workarounds |", "| --- | --- | --- | --- |"]
    for engine in ENGINES:
        equal = [name for name, c in cases.items() if c[engine]["status"] == "equal"]
        other = [f"{name}: {_VERDICT[c[engine]['status']]} ({_cell(c[engine].get('detail', ''))})"
                 for name, c in cases.items() if c[engine]["status"] != "equal"]
        fixes = sorted({c[engine].get("workarounds", "") for c in cases.values()} - {""})
        proven = f"{len(equal)} of {len(cases)} outputs" + ("; " + "; ".join(other) if other else "")
        lines.append(f"| {engine} | {report['engines'][engine]} | {proven} | {'; '.join(fixes) or 'none'} |")
    lines += ["", "| ckpttool output | config fields the input lacked | " + " | ".join(ENGINES) + " |",
              "| --- | --- | " + " | ".join("---" for _ in ENGINES) + " |"]
    for c in cases.values():
        cells = [_VERDICT[c[e]["status"]] + (f": {_cell(c[e]['detail'])}" if c[e]["status"] == "skipped" else "")
                 for e in ENGINES]
        lacked = ", ".join(f"`{f}`" for f in c["config fields the input lacked"]) or "-"
        lines.append(f"| {c['output']} | {lacked} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_block(text: str) -> str:
    """What README.md holds between the markers."""
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str]) -> None:
    table = render(json.loads(REPORT.read_text()))
    if "--write" not in argv:
        print(table)
        return
    text = README.read_text()
    before, rest = text.split(START, 1)
    README.write_text(f"{before}{START}\n{table}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
