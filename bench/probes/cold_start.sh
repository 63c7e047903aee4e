#!/bin/bash
# Issue 43's cold first run: what a fresh machine pays once. Run on a FRESH device machine, before anything else
# touches its memory: (1) the imports a run pays (torch for a torchrun rank's process group, ckpttool's CLI), each
# twice; (2) GB of tmpfs written twice by 8 parallel dd's (first: memory the VM never touched; second: freed and
# reused). If the first write is much slower than the second, a first conversion's extra time is the machine's
# (the hypervisor backing guest pages on first touch), not ckpttool's.
#   GB=80 bash bench/probes/cold_start.sh
set -u
GB=${GB:-80}; SHM=${SHM:-/dev/shm}
t() {  # seconds a command takes, or null when it fails
  local s=$(date +%s.%N); "$@" > /dev/null 2>&1 || { echo null; return; }
  python3 -c "print(round($(date +%s.%N) - $s, 3))"; }
for i in 1 2; do
  echo "{\"probe\": \"import\", \"round\": $i, \"torch_distributed_s\": $(t python3 -c 'import torch.distributed'), \"ckpttool_cli_s\": $(t python3 -c 'import ckpttool.cli.app')}"
done
write() { for j in 0 1 2 3 4 5 6 7; do dd if=/dev/zero of=$SHM/touch.$j bs=64M count=$((GB * 16 / 8)) status=none & done; wait; }
for i in 1 2; do
  s=$(t write); rm -f $SHM/touch.*
  echo "{\"probe\": \"tmpfs_write\", \"round\": $i, \"gb\": $GB, \"seconds\": $s}"
done
