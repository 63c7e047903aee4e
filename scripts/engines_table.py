"""Renders an engines report (what `pytest -m engines` proved) as docs/engines.md's tables, so the docs
says what the recorded engines run proved and nothing else.

    python scripts/engines_table.py                                   # print the tables of the committed record
    python scripts/engines_table.py --from build/engines-report.json  # print those of the last run
    python scripts/engines_table.py --from build/engines-report.json --write
        # make that run the committed record (tests/engines/report.json) and replace docs/engines.md's tables

The tier itself writes only build/engines-report.json (untracked): the committed record changes when a
person decides it should.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "tests" / "engines" / "report.json"
LAST_RUN = REPO / "build" / "engines-report.json"
README = REPO / "docs" / "engines.md"
START, END = "<!-- engines-table:start (scripts/engines_table.py) -->", "<!-- engines-table:end -->"
ENGINES = ("vllm", "llama.cpp")
_VERDICT = {"equal": "same ids", "explained": "known difference", "skipped": "skipped", "failed": "FAILED",
            "differs": "DIFFERENT ids", "not run": "not run"}


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _seeds(c: dict, engine: str) -> str:
    """How the case went over its seeds for one engine, e.g. `same ids for 1 of 3 seeds (7); 8, 107: ...`."""
    per_seed = c[engine].get("seeds", {})
    equal = [s for s, o in per_seed.items() if o.get("status") == "equal"]
    n = len(c["seeds"])
    if len(equal) == n:
        return f"same ids ({n} seeds)"
    status = c[engine]["status"]
    detail = f": {_cell(c[engine].get('detail', ''))}" if c[engine].get("detail") else ""
    if status == "skipped":
        return f"skipped{detail}"
    others = ", ".join(s for s in per_seed if s not in equal)
    head = f"same ids for {len(equal)} of {n} seeds ({', '.join(equal)}); " if equal else ""
    return f"{head}{_VERDICT[status]} for seed {others}{detail}"


def render(report: dict) -> str:
    cases = report["cases"]
    seeds = report.get("seeds_per_case", 1)
    lines = [f"| engine | version | proven: transformers' greedy ids, float32, {seeds} seeds per output | workarounds |",
             "| --- | --- | --- | --- |"]
    for engine in ENGINES:
        equal = [name for name, c in cases.items() if c[engine]["status"] == "equal"]
        other = [f"{name}: {_seeds(c, engine)}" for name, c in cases.items() if c[engine]["status"] != "equal"]
        fixes = sorted({c[engine].get("workarounds", "") for c in cases.values()} - {""})
        proven = f"{len(equal)} of {len(cases)} outputs" + ("; " + "; ".join(other) if other else "")
        lines.append(f"| {engine} | {report['engines'][engine]} | {proven} | {'; '.join(fixes) or 'none'} |")
    lines += ["", "| ckpttool output | config fields the input lacked | " + " | ".join(ENGINES) + " |",
              "| --- | --- | " + " | ".join("---" for _ in ENGINES) + " |"]
    for c in cases.values():
        lacked = ", ".join(f"`{f}`" for f in c["config fields the input lacked"]) or "-"
        lines.append(f"| {c['output']} | {lacked} | " + " | ".join(_seeds(c, e) for e in ENGINES) + " |")
    return "\n".join(lines)


def readme_block(text: str) -> str:
    """What docs/engines.md holds between the markers."""
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str]) -> None:
    source = Path(argv[argv.index("--from") + 1]) if "--from" in argv else REPORT
    table = render(json.loads(source.read_text()))
    if "--write" not in argv:
        print(table)
        return
    if source.resolve() != REPORT.resolve():
        shutil.copyfile(source, REPORT)
    text = README.read_text()
    before, rest = text.split(START, 1)
    README.write_text(f"{before}{START}\n{table}\n{END}{rest.split(END, 1)[1]}")


if __name__ == "__main__":
    main(sys.argv[1:])
