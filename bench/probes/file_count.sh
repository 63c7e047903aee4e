#!/bin/bash
# Issue 43: where the number of output files, not the cores, sets the rate. Converts one input (tmpfs) to BF16 mp M
# for each M in MPS (M files), into tmpfs and onto a real filesystem (OUTDISK), each after a dd of the same bytes
# there as its ceiling (one stream and 8 streams), one process tree on every core. Prints one JSON line per run.
#   SRC=/dev/shm/v3syn OUTDISK=/var/tmp/fc MPS="1 2 4 8" bash bench/probes/file_count.sh
set -u
SRC=${SRC:-/dev/shm/v3syn}; OUTDISK=${OUTDISK:-/var/tmp/fc}; MPS=${MPS:-1 2 4 8}
secs() { python3 -c "import time; print(time.time())"; }
for where in /dev/shm/fc "$OUTDISK"; do
  mkdir -p "$where"; df -T "$where" | tail -1
  out_bytes=""
  for m in $MPS; do
    rm -rf "$where/out"; s=$(secs)
    python3 -m ckpttool convert "$SRC" "$where/out" --mp "$m" --quiet --json > /tmp/fc.json
    w=$(python3 -c "import time; print(round(time.time() - $s, 3))")
    python3 -c "import json,sys; d=json.load(open('/tmp/fc.json')); print(json.dumps({'where': sys.argv[1], 'mp': int(sys.argv[2]), 'wall_s': float(sys.argv[3]), 'bytes': d['bytes_written'], 'processes': d['processes'], **d['timing']['phases_s'], 'gbps': round(d['bytes_written'] / d['timing']['phases_s']['total'] / 1e9, 2)}))" "$where" "$m" "$w"
    out_bytes=$(python3 -c "import json; print(json.load(open('/tmp/fc.json'))['bytes_written'])")
  done
  rm -rf "$where/out"; sync
  for streams in 1 8; do  # the ceiling: the last run's bytes written by dd in 1 or 8 files
    per=$((out_bytes / streams / 67108864)); s=$(secs)
    for ((j = 0; j < streams; j++)); do dd if=/dev/zero of="$where/dd.$j" bs=64M count=$per status=none & done; wait
    w=$(python3 -c "import time; print(round(time.time() - $s, 3))"); rm -f "$where"/dd.*; sync
    echo "{\"where\": \"$where\", \"dd_streams\": $streams, \"bytes\": $((per * streams * 67108864)), \"wall_s\": $w, \"gbps\": $(python3 -c "print(round($per * $streams * 67108864 / $w / 1e9, 2))")}"
  done
  rm -rf "$where"
done
