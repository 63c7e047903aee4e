"""Several machines without torchrun (issue 43): the same command on each with CKPTTOOL_NODES=HOST:PORT,N,R meets at
node 0 over a TCP socket (execute/rendezvous.py) instead of torch.distributed. Real processes on 127.0.0.1: the bytes
of one process's run, every node's timeline in node 0's report, torch never imported; and what goes wrong between
nodes (another command, a node that never comes, a stray client, a mistyped setting) is named, not hung on."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from conftest import free_port, run_cli

# the CLI with torch made unimportable: the nodes must not need it
NO_TORCH = ("import sys, runpy; sys.modules['torch'] = None; sys.argv = ['ckpttool'] + sys.argv[1:]; "
            "runpy.run_module('ckpttool', run_name='__main__')")


def _node(args, nodes: str, timeout_s: float = 60) -> subprocess.Popen:
    env = {**os.environ, "CKPTTOOL_NODES": nodes, "CKPTTOOL_JOIN_TIMEOUT_S": str(timeout_s)}
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, "-c", NO_TORCH, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _files(path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _run_nodes(argv_of, n: int, timeout_s: float = 60) -> list[tuple[int, str, str]]:
    port = free_port()
    procs = [_node(argv_of(r), f"127.0.0.1:{port},{n},{r}", timeout_s) for r in range(n)]
    outputs = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outputs)]


def test_nodes_write_one_processs_bytes_without_torch(tiny_v3, tmp_path):
    run_cli("convert", tiny_v3, tmp_path / "one", "--mp", 4, "--quiet")
    args = ["convert", tiny_v3, tmp_path / "nodes", "--mp", 4, "--json", "--workers", 1]
    results = _run_nodes(lambda r: args, 3)
    for code, out, err in results:
        assert code == 0, err[-3000:]
    assert _files(tmp_path / "nodes") == _files(tmp_path / "one")
    report = json.loads(results[0][1])  # node 0's; the others print none
    assert [r["rank"] for r in report["timing"]["ranks"]] == [0, 1, 2]
    assert results[1][1] == results[2][1] == ""


def test_a_node_running_another_command_stops_the_run_naming_it(tiny_v3, tmp_path):
    results = _run_nodes(lambda r: ["convert", tiny_v3, tmp_path / "out", "--mp", 4 if r == 0 else 2, "-q"], 2)
    assert all(code == 1 for code, _, _ in results), results
    assert "runs another command line than node 0" in results[0][2], results[0][2]
    assert "refused node 1" in results[1][2] and "Traceback" not in results[1][2], results[1][2]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


def test_a_node_that_never_comes_is_named_after_the_join_timeout(tiny_v3, tmp_path):
    port = free_port()
    proc = _node(["convert", tiny_v3, tmp_path / "out", "--mp", 4, "-q"], f"127.0.0.1:{port},3,0", timeout_s=2)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "waited for nodes [1, 2]" in err and "Traceback" not in err, err
    assert not any((tmp_path / "out").glob("*.safetensors")) if (tmp_path / "out").exists() else True


def test_a_stray_client_is_dropped_and_the_nodes_go_on(tiny_v3, tmp_path):
    port = free_port()
    args = ["convert", tiny_v3, tmp_path / "nodes", "--mp", 4, "-q"]
    node0 = _node(args, f"127.0.0.1:{port},2,0")
    for _ in range(100):  # a port scanner, then a client speaking something else, before node 1 joins
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            break
        except OSError:
            time.sleep(0.1)
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall((10 ** 12).to_bytes(8, "big"))  # a length over the cap: dropped, never allocated
    node1 = _node(args, f"127.0.0.1:{port},2,1")
    for proc in (node0, node1):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    run_cli("convert", tiny_v3, tmp_path / "one", "--mp", 4, "--quiet")
    assert _files(tmp_path / "nodes") == _files(tmp_path / "one")


def test_a_mistyped_setting_is_refused_not_run_whole_on_every_node(tiny_v3, tmp_path):
    for value, words in (("node0,2,1", "is not HOST:PORT,N,R"), ("h:29400,2,2", "0 <= R < N")):
        proc = _node(["convert", tiny_v3, tmp_path / "out", "-q"], value)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and words in err and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()


def test_a_node_killed_mid_run_fails_the_run_naming_it_and_resume_finishes(tiny_v3, tmp_path):
    port = free_port()
    args = ["convert", tiny_v3, tmp_path / "nodes", "--mp", 4, "-q", "--workers", 1, "--processes", 1]
    node0 = _node(args, f"127.0.0.1:{port},2,0")
    env = {**os.environ, "CKPTTOOL_NODES": f"127.0.0.1:{port},2,1", "CKPTTOOL_FAULT": "pwrite:2:kill"}
    node1 = subprocess.Popen([sys.executable, "-c", NO_TORCH, *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    _, err0 = node0.communicate(timeout=300)
    node1.communicate(timeout=300)
    assert node1.returncode == -9 and node0.returncode == 1, (node1.returncode, err0)
    assert "node 1 left the run" in err0 and "Traceback" not in err0, err0
    results = _run_nodes(lambda r: args + ["--resume"], 2)
    assert all(code == 0 for code, _, _ in results), results
    run_cli("convert", tiny_v3, tmp_path / "one", "--mp", 4, "--quiet")
    assert _files(tmp_path / "nodes") == _files(tmp_path / "one")


def test_convert_verify_across_nodes_verifies_once_on_node_0(tiny_v3, tmp_path):
    """`convert --verify` under CKPTTOOL_NODES: node 0 verifies the published shards; node 1 (torch.distributed
    unimportable there, so a verify would fail it) stops after the conversion."""
    port = free_port()
    args = ["convert", tiny_v3, tmp_path / "out", "--mp", 2, "--verify", "--prompt-ids", "0,5", "--json",
            "--workers", 1]
    env = {**os.environ, "CKPTTOOL_JOIN_TIMEOUT_S": "60"}
    node0 = subprocess.Popen([sys.executable, "-m", "ckpttool", *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**env, "CKPTTOOL_NODES": f"127.0.0.1:{port},2,0"})
    no_dist = NO_TORCH.replace("sys.modules['torch'] = None", "sys.modules['torch.distributed'] = None")
    node1 = subprocess.Popen([sys.executable, "-c", no_dist, *map(str, args)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**env, "CKPTTOOL_NODES": f"127.0.0.1:{port},2,1"})
    (out0, err0), (out1, err1) = node0.communicate(timeout=600), node1.communicate(timeout=600)
    assert node1.returncode == 0 and out1 == "", err1[-2000:]
    assert node0.returncode == 0, err0[-3000:]
    report = json.loads(out0)
    assert report["ok"] and report["verify"]["ok"], report["verify"]
