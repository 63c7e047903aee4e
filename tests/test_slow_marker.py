"""The `slow` marker (tests/slow.py, applied by conftest.py): every pattern still names a test, and `-m "not slow"`
leaves out exactly the slow tests while keeping the gpu and engines tiers out as the default run does."""

from __future__ import annotations

import ast
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

from slow import SLOW, category

TESTS = Path(__file__).resolve().parent


def _test_names() -> list[str]:
    """`file.py::test_name` (and `file.py::Class::test_name`) for every test function in tests/, from the source."""
    names = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                names.append(f"{path.name}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                names += [f"{path.name}::{node.name}::{f.name}" for f in node.body
                          if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test")]
    return names


def test_every_slow_pattern_names_a_test_that_exists():
    names = _test_names()
    assert len(names) > 300
    stale = [(reason, pattern) for reason, patterns in SLOW for pattern in patterns
             if not any(fnmatchcase(name, pattern) or fnmatchcase(name + "[", pattern) for name in names)]
    assert not stale, f"tests/slow.py patterns that match no test (renamed or removed? update tests/slow.py): {stale}"


def test_category_reads_the_file_and_test_name_only():
    assert category("tests/test_crash_safety.py::test_anything[1]") is not None
    assert category("test_verify.py::test_x") == SLOW[0][0]
    assert category("tests/test_keymap.py::test_anything") is None


def test_not_slow_leaves_out_the_slow_tests_and_the_gpu_and_engines_tiers():
    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                 *args, str(TESTS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=TESTS.parent)

    def collected(proc: subprocess.Popen) -> set[str]:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        return {line for line in out.splitlines() if "::" in line}

    both = start(), start("-m", "not slow")  # the two collections side by side: each takes seconds
    default, quick = collected(both[0]), collected(both[1])
    assert quick and quick < default
    # exactly the default run's tests (gpu and engines already left out there) that tests/slow.py does not name
    assert quick == {nodeid for nodeid in default if category(nodeid) is None}
    assert not any("test_engines.py::" in nodeid for nodeid in quick)
