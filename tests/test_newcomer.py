"""What a new user meets first: a plain clone's tests, the CLI's help and flags, the torch-free core."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def test_reference_script_tests_skip_with_how_to_get_them_when_seeds_are_absent(tmp_path):
    """A plain clone has no ../shared: the tests that need DeepSeek's scripts skip and say why."""
    env = {**os.environ, "CKPTTOOL_SEEDS": str(tmp_path / "no-seeds")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/test_convert.py::test_shard_keeps_fp8_with_split_scales_like_reference"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "1 skipped" in proc.stdout and "CKPTTOOL_SEEDS" in proc.stdout and "inference/" in proc.stdout, \
        proc.stdout[-2000:]
