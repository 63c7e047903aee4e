"""A plain command joins a process group only when torchrun launched it: RANK / WORLD_SIZE /
MASTER_ADDR left over in a shell mean a single process, and a real torchrun rank whose peers never
come gives up within the join timeout with an error naming the variables, never a hang."""

from __future__ import annotations

import time

import pytest

from conftest import free_port, run_cli, run_cli_process

CONVERT = ("--mp", "2", "--quiet", "--workers", "2")
TORCHRUN = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _tree(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def clean(tiny_v3, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    run_cli("convert", tiny_v3, out, *CONVERT)
    return _tree(out)


@pytest.mark.parametrize("env", [
    {"RANK": "1", "WORLD_SIZE": "2"},
    {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "10.255.255.1", "MASTER_PORT": "29500"},
    {"RANK": "x", "WORLD_SIZE": "", "LOCAL_RANK": "3"},
])
def test_leftover_variables_mean_a_single_process(tiny_v3, tmp_path, clean, env):
    started = time.monotonic()
    proc = run_cli_process("convert", tiny_v3, tmp_path / "out", *CONVERT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 60
    assert _tree(tmp_path / "out") == clean


def test_a_torchrun_rank_whose_peers_never_come_gives_up_naming_the_variables(tiny_v3, tmp_path):
    env = {"TORCHELASTIC_RUN_ID": "stray", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "CKPTTOOL_JOIN_TIMEOUT_S": "3"}
    started = time.monotonic()
    proc = run_cli_process("convert", tiny_v3, tmp_path / "out", *CONVERT, env=env, timeout=120)
    assert time.monotonic() - started < 60
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "could not join" in proc.stderr and "MASTER_ADDR" in proc.stderr and "fix:" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was set up by a rank that never joined


def test_an_impossible_rank_is_an_error(tiny_v3, tmp_path):
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "5", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = run_cli_process("convert", tiny_v3, tmp_path / "out", *CONVERT, env=env, timeout=120)
    assert proc.returncode == 1 and "RANK='5'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
