"""The maintained benchmarks (bench/__main__.py's table) each run tiny on the CPU, on a tiny FP8 DeepSeek-V3
checkpoint: a change that breaks one fails here, not on the next measuring day. No timing is asserted (numbers
live in bench/RESULTS.md); each run must finish and print its result (`convert`: both steps exit 0 in its
results.json)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from conftest import REPO

ENTRY = REPO / "bench" / "__main__.py"
if not ENTRY.is_file():  # an unpacked sdist: bench/ is the checkout's, not part of a release (MANIFEST.in)
    pytest.skip("bench/ is not in this tree (an sdist carries the tests, not the benchmarks)", allow_module_level=True)
spec = importlib.util.spec_from_file_location("bench_entry", ENTRY)
bench = sys.modules["bench_entry"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(bench)


@pytest.mark.parametrize("name", [b.name for b in bench.BENCHMARKS])
def test_each_maintained_benchmark_runs_tiny(name, tiny_v3, tmp_path):
    done = bench.smoke(bench.BY_NAME[name], tiny_v3, tmp_path)
    assert bench.BY_NAME[name].expect in done.stdout
    if name == "convert":
        results = json.loads((tmp_path / "out" / "results.json").read_text())
        assert {step: rec["rc"] for step, rec in results["steps"].items()} == {"convert": 0, "dequant-cpu": 0}
        assert results["summary"]["convert_gb_per_s"] > 0 and results["summary"]["convert_peak_rss_gib"] > 0


def test_the_entry_point_lists_runs_and_refuses_unknown_names(capsys):
    assert bench.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(b.name in listed and f"bench/{b.module}.py" in listed for b in bench.BENCHMARKS)
    assert bench.main(["run", "no-such-bench"]) == 2
    assert "one of convert" in capsys.readouterr().err
    assert bench.main([]) == 2
    for b in bench.BENCHMARKS:
        assert (REPO / "bench" / f"{b.module}.py").is_file(), b.module
