"""Every setting ckpttool reads from the environment is declared once (ckpttool/settings.py), read when used,
documented in README's Settings table, and no import writes the environment."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from ckpttool import settings

ROOT = Path(__file__).resolve().parent.parent
NOT_SETTINGS = {"CKPTTOOL_BUILD_NATIVE",  # read by setup.py at build time, documented beside it in the README
                "CKPTTOOL_QUANTIZATION"}  # a Python constant (formats/__init__.py), not an environment variable


def test_every_environment_name_in_the_package_is_a_declared_setting():
    used = set()
    for path in (ROOT / "ckpttool").rglob("*.py"):
        used |= set(re.findall(r"CKPTTOOL_[A-Z0-9_]+", path.read_text()))
    assert used - NOT_SETTINGS <= set(settings.SETTINGS), sorted(used - NOT_SETTINGS - set(settings.SETTINGS))
    assert not re.search(r"os\.environ\.get\(\s*[\"']CKPTTOOL_",
                         "".join(p.read_text() for p in (ROOT / "ckpttool").rglob("*.py") if p.name != "settings.py"))


def test_the_readme_documents_every_setting_once():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("<!-- settings-table:start -->"):readme.index("<!-- settings-table:end -->")]
    listed = re.findall(r"^\| `(CKPTTOOL_[A-Z0-9_]+)` \| `([^`]*)` \|", table, re.M)
    assert [name for name, _ in listed] == list(settings.SETTINGS)
    assert all(default == settings.SETTINGS[name].default for name, default in listed)


def test_importing_ckpttool_writes_no_environment_variable():
    code = ("import os, json, pkgutil, importlib; before = dict(os.environ); import ckpttool\n"
            "for m in pkgutil.walk_packages(ckpttool.__path__, 'ckpttool.'):\n"
            "    if not any(x in m.name for x in ('.model', '.verify', 'triton', '.cuda', 'families.', '_native')):\n"
            "        importlib.import_module(m.name)\n"
            "print(json.dumps(sorted(k for k in os.environ if os.environ.get(k) != before.get(k))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout) == []


def test_a_setting_is_read_when_used(monkeypatch):
    from ckpttool.kernels import native

    monkeypatch.setenv("CKPTTOOL_NATIVE", "0")
    assert native.library() is None  # after ckpttool.kernels.native was imported
    monkeypatch.setenv("CKPTTOOL_JOURNAL_SECONDS", "not a number")
    assert settings.get("CKPTTOOL_JOURNAL_SECONDS") == 2.0  # a mistyped knob is its default, not a crash
