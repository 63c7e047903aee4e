#!/bin/bash
# Issue 43: one machine's cores as simulated nodes (taskset), torchrun ranks rendezvousing on 127.0.0.1, against one
# process tree on all of them, RAM to RAM, the same bytes every time. Run from a checkout's root on a device machine:
#   SRC=/dev/shm/v3syn NODES="2 4" ROUNDS=3 bash bench/nodes.sh
# For each N in NODES: N nodes of cores/N cores each, one torchrun rank per node, (a) each rank forking as one machine
# does (this tree) and (b) --processes 1 per rank (every release before it); then one process tree on every core.
# Prints one line of JSON per run (wall seconds, output bytes, GB/s) and every output's digest against the first.
set -u
SRC=${SRC:-/dev/shm/v3syn}; DST=${DST:-/dev/shm/nodes-out}; ROUNDS=${ROUNDS:-3}; NODES=${NODES:-2}
CORES=$(nproc); PORT=29511
digest() {  # the BLAKE3 of every output file, as the run's own manifest lists them (hashing 75 GB again took 75 s)
  python3 -c "import hashlib,json,sys; m=json.load(open(sys.argv[1])); print(hashlib.sha256(json.dumps(m['files'], sort_keys=True).encode()).hexdigest()[:16])" "$1/ckpttool-manifest.json"
}
now() { python3 -c "import time; print(time.time())"; }
since() { python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 3))" "$1"; }
phases() {  # bytes written, processes and phase seconds from a --json report
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps({'bytes': d['bytes_written'], 'processes': d['processes'], **d['timing']['phases_s']}))" "$1" 2>/dev/null || echo null
}
run_tree() {  # one process tree on every core
  rm -rf "$DST"; local t=$(now)
  python3 -m ckpttool convert "$SRC" "$DST" --mp 8 --quiet --json > /tmp/tree.json; local s=$(since "$t")
  echo "{\"run\": \"tree\", \"cores\": $CORES, \"wall_s\": $s, \"digest\": \"$(digest "$DST")\", \"report\": $(phases /tmp/tree.json)}"
}
run_nodes() {  # N simulated nodes, one rank each; $2: extra convert args
  local n=$1; shift; rm -rf "$DST"; local per=$((CORES / n)); local t=$(now); local pids=()
  for ((i = 0; i < n; i++)); do
    taskset -c $((i * per))-$(((i + 1) * per - 1)) python3 -m torch.distributed.run --nnodes "$n" --node-rank "$i" \
      --nproc-per-node 1 --master-addr 127.0.0.1 --master-port $PORT \
      -m ckpttool convert "$SRC" "$DST" --mp 8 --quiet --json "$@" > /tmp/node$i.log 2> /tmp/node$i.err &
    pids+=($!)
  done
  local rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done
  local s=$(since "$t"); PORT=$((PORT + 1))
  [ $rc = 0 ] || { echo "node run failed"; tail -5 /tmp/node*.err; }
  echo "{\"run\": \"nodes\", \"nodes\": $n, \"cores_per_node\": $per, \"args\": \"$*\", \"wall_s\": $s, \"digest\": \"$(digest "$DST")\", \"report\": $(phases /tmp/node0.log)}"
}
run_tree  # warm-up: the page cache and the kernels, not counted
for ((r = 1; r <= ROUNDS; r++)); do
  run_tree
  for n in $NODES; do run_nodes "$n"; run_nodes "$n" --processes 1; done
done
rm -rf "$DST"
