#!/bin/bash
# Issue 43: one machine's cores as simulated nodes (taskset), torchrun ranks rendezvousing on 127.0.0.1, against one
# process tree on all of them, RAM to RAM, the same bytes every time. Run from a checkout's root on a device machine:
#   SRC=/dev/shm/v3syn NODES="2 4" RPN="1 4" ROUNDS=2 bash bench/nodes.sh
# For each N in NODES and R in RPN: N nodes of cores/N cores each, R torchrun ranks per node, each rank forking as one
# machine does; VARIANTS adds runs with other convert flags (e.g. VARIANTS="--processes 1|--workers 8"); the same N
# nodes meeting through CKPTTOOL_NODES, without torchrun (SOCKETS=0 leaves them out); then one process tree on every core;
# PAIRED=1 runs the tree right before every node run instead (the machine drifts 10% between rounds). MP sets --mp
# (8); PER=C gives every node C cores instead of cores/N (NODES="1 2 4" PER=16: the rate against the node count). Prints one line of JSON per run: wall seconds (torchrun's start and torch's import
# included), rank 0's phases and every rank's timeline from its --json report, and the outputs' digest.
set -u
SRC=${SRC:-/dev/shm/v3syn}; DST=${DST:-/dev/shm/nodes-out}; ROUNDS=${ROUNDS:-3}; NODES=${NODES:-2}; RPN=${RPN:-1}
VARIANTS=${VARIANTS:-}; CORES=$(nproc); PORT=29511; LOGS=/tmp/nodes-logs; MP=${MP:-8}
digest() {  # the BLAKE3 of every output file, as the run's own manifest lists them (hashing 75 GB again took 75 s)
  python3 -c "import hashlib,json,sys; m=json.load(open(sys.argv[1])); print(hashlib.sha256(json.dumps(m['files'], sort_keys=True).encode()).hexdigest()[:16])" "$1/ckpttool-manifest.json"
}
now() { python3 -c "import time; print(time.time())"; }
since() { python3 -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 3))" "$1"; }
reports() {  # rank 0's bytes, processes and phases, and every rank's timeline (timing.ranks), from its --json report
  python3 - "$1" <<'EOF'
import json, sys, pathlib
root = pathlib.Path(sys.argv[1])
for f in sorted(root.rglob("stdout.log")) + sorted(root.glob("*.json")):
    try:
        d = json.loads(f.read_text())
    except ValueError:
        continue  # ranks > 0 print no report
    print(json.dumps({"bytes": d["bytes_written"], "processes": d["processes"], **d["timing"]["phases_s"],
                      "ranks": d["timing"].get("ranks")}))
    break
else:
    print("null")
EOF
}
run_tree() {  # one process tree on every core
  rm -rf "$DST" "$LOGS"; mkdir -p "$LOGS"; local t=$(now)
  python3 -m ckpttool convert "$SRC" "$DST" --mp $MP --quiet --json > "$LOGS/tree.json"; local s=$(since "$t")
  echo "{\"run\": \"tree\", \"cores\": $CORES, \"wall_s\": $s, \"out_bytes\": $(du -sb "$DST" | cut -f1), \"digest\": \"$(digest "$DST")\", \"report\": $(reports "$LOGS")}"
}
joined() {  # wait for the launched nodes ($pids; not in a subshell), then JOINED_S = seconds since $1
  local rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [ $rc = 0 ] || { echo "node run failed" >&2; tail -n 5 /tmp/node*.err >&2; }
  JOINED_S=$(since "$1"); PORT=$((PORT + 1))
}
run_nodes() {  # N simulated nodes of R ranks each; the rest: extra convert args
  local n=$1 r=$2; shift 2; rm -rf "$DST" "$LOGS"; local per=${PER:-$((CORES / n))}; local t=$(now); local pids=()
  for ((i = 0; i < n; i++)); do
    taskset -c $((i * per))-$(((i + 1) * per - 1)) python3 -m torch.distributed.run --nnodes "$n" --node-rank "$i" \
      --nproc-per-node "$r" --master-addr 127.0.0.1 --master-port $PORT --log-dir "$LOGS/node$i" --redirects 1 \
      -m ckpttool convert "$SRC" "$DST" --mp $MP --quiet --json "$@" > /tmp/node$i.out 2> /tmp/node$i.err &
    pids+=($!)
  done
  joined "$t"; local s=$JOINED_S
  echo "{\"run\": \"nodes\", \"nodes\": $n, \"ranks_per_node\": $r, \"cores_per_node\": $per, \"args\": \"$*\", \"wall_s\": $s, \"out_bytes\": $(du -sb "$DST" | cut -f1), \"digest\": \"$(digest "$DST")\", \"report\": $(reports "$LOGS")}"
}
run_sockets() {  # N simulated nodes meeting through CKPTTOOL_NODES (no torchrun, no torch); the rest: extra args
  local n=$1; shift; rm -rf "$DST" "$LOGS"; mkdir -p "$LOGS"; local per=${PER:-$((CORES / n))}; local t=$(now); local pids=()
  for ((i = 0; i < n; i++)); do
    CKPTTOOL_NODES=127.0.0.1:$PORT,$n,$i taskset -c $((i * per))-$(((i + 1) * per - 1)) \
      python3 -m ckpttool convert "$SRC" "$DST" --mp $MP --quiet --json "$@" > "$LOGS/node$i.json" 2> /tmp/node$i.err &
    pids+=($!)
  done
  joined "$t"; local s=$JOINED_S
  echo "{\"run\": \"sockets\", \"nodes\": $n, \"cores_per_node\": $per, \"args\": \"$*\", \"wall_s\": $s, \"out_bytes\": $(du -sb "$DST" | cut -f1), \"digest\": \"$(digest "$DST")\", \"report\": $(reports "$LOGS")}"
}
run_tree  # warm-up: the page cache and the kernels, not counted
pair() { [ "${PAIRED:-0}" = 0 ] || run_tree; }
for ((round = 1; round <= ROUNDS; round++)); do
  [ "${PAIRED:-0}" != 0 ] || run_tree
  for n in $NODES; do
    for r in $RPN; do pair; run_nodes "$n" "$r"; done
    [ "${SOCKETS:-1}" = 0 ] || { pair; run_sockets "$n"; }
    IFS='|' read -ra extra <<< "$VARIANTS"
    for v in "${extra[@]}"; do pair; run_nodes "$n" 1 $v; done
  done
done
rm -rf "$DST"
