"""Nodes that meet without torchrun: `CKPTTOOL_NODES=HOST:PORT,N,R` on each of N machines (as srun, ssh or a job
array starts them) makes this process node R of N; node 0 listens on HOST:PORT and the others connect to it.
It carries what torch.distributed carries under torchrun, and nothing else: node 0's set-up outcome and each node's
flag and timeline at the end, as length-prefixed JSON. No torch: a torchrun launch costs an agent and a torch import
per rank (about 10 s on the 64-core machine measured, bench/RESULTS.md "nodes"); this costs a TCP connection, and
the core install can run on many machines.

What arrives on the socket is untrusted: a message is at most MAX_MESSAGE bytes of JSON, a connection that does not
introduce itself as a node of this run (the same ckpttool, node count and command) within the join timeout is
dropped, and one that does but disagrees (another command, a rank taken twice) stops the run naming it."""

from __future__ import annotations

import hashlib
import json
import socket
import struct
import sys
import time

from ckpttool.errors import CkptError
from ckpttool.version import __version__

MAX_MESSAGE = 1 << 20
"""bytes of one message: the largest is every node's timeline, a few hundred bytes each"""
_HEADER = struct.Struct("!Q")
RUN_TIMEOUT_S = 12 * 3600
"""after joining, as torchrun ranks' barriers (distributed.RUN_TIMEOUT): then a silent node fails the run"""
SETTING = "CKPTTOOL_NODES"


def parse_nodes(text: str) -> tuple[str, int, int, int]:
    """`HOST:PORT,N,R` -> (host, port, nodes, rank), strictly: a mistyped value must not run N whole conversions."""
    try:
        address, n, r = text.split(",")
        host, port = address.rsplit(":", 1)
        nodes, rank, port_ = int(n), int(r), int(port)
    except ValueError:
        raise CkptError(f"{SETTING}={text!r} is not HOST:PORT,N,R", fix=f"set {SETTING}=node0:29400,N,R on each of "
                        "the N nodes (R = 0 .. N-1; node 0 listens on HOST:PORT), or unset it") from None
    if not (host and 0 < port_ < 65536 and nodes >= 1 and 0 <= rank < nodes):
        raise CkptError(f"{SETTING}={text!r}: needs a host, a port 1-65535, N >= 1 and 0 <= R < N",
                        fix=f"set {SETTING}=HOST:PORT,N,R with R this node's number, from 0")
    return host.strip("[]"), port_, nodes, rank


def run_identity() -> str:
    """What every node must agree on: ckpttool's version and the command line (the node's rank comes from the
    environment, so the same command runs on every node)."""
    return hashlib.sha256(json.dumps([__version__, sys.argv[1:]]).encode()).hexdigest()[:16]


def _send(sock: socket.socket, obj: object) -> None:
    data = json.dumps(obj).encode()
    if len(data) > MAX_MESSAGE:
        raise CkptError(f"a message between nodes would be {len(data)} bytes, over {MAX_MESSAGE}")
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 16))
        if not chunk:
            raise ConnectionError("closed by the other side")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> object:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > MAX_MESSAGE:
        raise ConnectionError(f"a message of {n} bytes, over {MAX_MESSAGE}")
    return json.loads(_recv_exact(sock, n))


class SocketGroup:
    """Node 0 and its peers, connected once; `broadcast` and `all_gather` are collective, in the same order on
    every node, as torch.distributed's object collectives are."""

    def __init__(self, host: str, port: int, nodes: int, rank: int, *, join_timeout: float, identity: str):
        self.rank, self.nodes = rank, nodes
        self.peers: dict[int, socket.socket] = {}  # node 0: every other node's connection; others: {0: node 0}
        hello = {"ckpttool": __version__, "nodes": nodes, "run": identity}
        deadline = time.monotonic() + join_timeout
        try:
            if rank == 0:
                self._accept(host, port, hello, deadline)
            else:
                self._connect(host, port, {**hello, "rank": rank}, deadline)
        except BaseException:
            self.close()
            raise
        for sock in self.peers.values():
            sock.settimeout(RUN_TIMEOUT_S)  # after joining, a fast node waits as long as the slowest node's share takes

    def _accept(self, host: str, port: int, hello: dict, deadline: float) -> None:
        try:
            server = socket.create_server((host, port))
        except OSError as exc:
            raise CkptError(f"node 0 cannot listen on {host}:{port} ({exc.strerror or exc})",
                            fix=f"give {SETTING} a host name of this machine and a free port") from None
        with server:
            while len(self.peers) < self.nodes - 1:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, self.nodes)) - set(self.peers))
                    raise CkptError(f"node 0 waited for nodes {missing} to join at {host}:{port}; they did not",
                                    fix=f"start the same command on every node with {SETTING}=HOST:PORT,"
                                        f"{self.nodes},R (R = 1 .. {self.nodes - 1}) within the join timeout "
                                        "(CKPTTOOL_JOIN_TIMEOUT_S)") from None
                conn.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    theirs = _recv(conn)
                except (OSError, ValueError):  # not a node of ours (a port scan, a stray client): dropped
                    conn.close()
                    continue
                if not (isinstance(theirs, dict) and theirs.get("ckpttool") is not None):
                    conn.close()
                    continue
                r = theirs.get("rank")
                problem = self._disagreement(theirs, hello, r)
                if problem is not None:
                    _send(conn, {"refused": problem})
                    conn.close()
                    raise CkptError(f"a node that joined at {host}:{port} {problem}",
                                    fix="start the same ckpttool and command on every node, each with its own R")
                self.peers[r] = conn
            for conn in self.peers.values():
                _send(conn, {"joined": self.nodes})

    def _disagreement(self, theirs: dict, hello: dict, r: object) -> str | None:
        if theirs.get("ckpttool") != hello["ckpttool"] or theirs.get("nodes") != hello["nodes"]:
            return (f"runs ckpttool {theirs.get('ckpttool')!r} with {theirs.get('nodes')!r} nodes, this one "
                    f"{hello['ckpttool']} with {hello['nodes']}")
        if theirs.get("run") != hello["run"]:
            return "runs another command line than node 0"
        if not isinstance(r, int) or not 0 < r < self.nodes or r in self.peers:
            return f"says it is node {r!r}, taken or out of 1 .. {self.nodes - 1}"
        return None

    def _connect(self, host: str, port: int, hello: dict, deadline: float) -> None:
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic()))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise CkptError(f"node {self.rank} could not reach node 0 at {host}:{port} ({exc})",
                                    fix=f"start node 0 (R = 0) of the same command, and check that {host}:{port} "
                                        "is reachable from this machine") from None
                time.sleep(0.2)
        self.peers[0] = sock
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        _send(sock, hello)
        try:
            answer = _recv(sock)
        except (OSError, ValueError) as exc:
            raise CkptError(f"node {self.rank} joined {host}:{port} but got no answer ({exc})",
                            fix="check that node 0 runs the same command") from None
        if not isinstance(answer, dict) or "joined" not in answer:
            why = answer.get("refused") if isinstance(answer, dict) else answer
            raise CkptError(f"node 0 at {host}:{port} refused node {self.rank}: it {why}",
                            fix="start the same ckpttool and command on every node, each with its own R")

    def broadcast(self, obj: object) -> object:
        """Node 0's `obj` on every node."""
        if self.rank == 0:
            for sock in self.peers.values():
                _send(sock, obj)
            return obj
        return self._from(0)

    def all_gather(self, obj: object) -> list:
        """Every node's `obj`, in node order, on every node."""
        if self.rank != 0:
            _send(self.peers[0], obj)
            return self._from(0)
        everyone = [obj] + [self._from(r) for r in range(1, self.nodes)]
        for sock in self.peers.values():
            _send(sock, everyone)
        return everyone

    def _from(self, r: int) -> object:
        try:
            return _recv(self.peers[r])
        except (OSError, ValueError) as exc:
            raise CkptError(f"node {r} left the run ({exc})",
                            fix="see that node's error; the work journalled stays for --resume") from None

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        self.peers.clear()
