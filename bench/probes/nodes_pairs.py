"""Summarise bench/nodes.sh's JSON lines: each node run against the tree run just before it (PAIRED=1), or against
the round's tree otherwise. Ratio = that tree's total / the run's total (rank 0's planning to publish), so >= 0.9
is issue 43's bar; GB/s: all output bytes over rank 0's total, where the line has out_bytes. Usage: python3 bench/probes/nodes_pairs.py RESULTS.jsonl [...]"""

from __future__ import annotations

import json
import sys


def rows(lines):
    tree = None
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        report = d.get("report") or {}
        total = report.get("total")
        rate = d["out_bytes"] / total / 1e9 if d.get("out_bytes") and total else None
        if d["run"] == "tree":
            tree = total
            yield f"tree, {d['cores']} cores", None, total, d["wall_s"], 0, rate, d["digest"]
            continue
        name = f"{d['nodes']} x {d['cores_per_node']}"
        name += f", {d['ranks_per_node']} rank(s)/node" if d["run"] == "nodes" else ", CKPTTOOL_NODES"
        name += f" {d['args']}" if d.get("args") else ""
        waits = [r["phases_s"].get("hash_wait", 0) for r in report.get("ranks") or []]
        yield name, tree, total, d["wall_s"], max(waits, default=0), rate, d["digest"]


def main(paths):
    for path in paths:
        with open(path) as f:
            for name, tree, total, wall, wait, rate, digest in rows(f):
                ratio = f"{tree / total:.2f}" if tree and total else "-"
                gbs = f"{rate:.2f} GB/s" if rate else ""
                print(f"{name:40s} tree {tree} run {total} ratio {ratio} wall {wall} hash_wait {wait:.2f} {gbs} {digest}")


if __name__ == "__main__":
    main(sys.argv[1:])
