#!/bin/bash
# Issue 43's control for bench/nodes.sh's PER runs: K whole, independent conversions at once, each pinned to its own
# PER cores and writing its own DST, sharing nothing but the machine (memory bandwidth, caches, tmpfs). If K such jobs
# each slow down as much as each of K nodes of one job does, the nodes' shortfall from linear is the one machine
# they share, not their coordination. Run from a checkout's root on a device machine:
#   SRC=/dev/shm/v3syn PER=4 MP=16 JOBS="1 2 4" bash bench/probes/concurrent_trees.sh
# Prints one JSON line per K: every job's total (planning to publish) and output GB/s.
set -u
SRC=${SRC:-/dev/shm/v3syn}; PER=${PER:-4}; MP=${MP:-16}; JOBS=${JOBS:-"1 2 4"}
for k in $JOBS; do
  rm -rf /dev/shm/ct-*; pids=()
  for ((i = 0; i < k; i++)); do
    taskset -c $((i * PER))-$(((i + 1) * PER - 1)) python3 -m ckpttool convert "$SRC" /dev/shm/ct-$i --mp "$MP" \
      --quiet --json > /tmp/ct-$i.json 2> /tmp/ct-$i.err &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { echo "job failed" >&2; tail -n 5 /tmp/ct-*.err >&2; }; done
  python3 - "$k" "$PER" <<'PY'
import json, sys
k, per = int(sys.argv[1]), int(sys.argv[2])
jobs = [json.load(open(f"/tmp/ct-{i}.json")) for i in range(k)]
print(json.dumps({"jobs": k, "cores_each": per, "total_s": [j["timing"]["phases_s"]["total"] for j in jobs],
                  "gbps": [round(j["bytes_written"] / j["timing"]["phases_s"]["total"] / 1e9, 2) for j in jobs]}))
PY
done
rm -rf /dev/shm/ct-*
