#!/bin/bash
# Issue 17, one device call: RAM-to-RAM (tmpfs in and out) on the V3-shaped synthetic, ceilings, the
# previous commit vs this tree on the CPU, this tree on CUDA, peak RSS, byte-identity, GPU tests.
# Run from the root of a checkout of this branch, carry ["bench/_whl", "bench/_seeds"], where bench/_whl
# also holds the cp312 wheels of numba, llvmlite and blake3 (pip download --no-deps --only-binary=:all:
# --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform
# manylinux2014_x86_64 -d bench/_whl numba==0.68.1 llvmlite==0.50.0 blake3==1.0.11: 64 MiB with the rest).
# The baseline is commit 7b674de (issue 17's start), unpacked from git into /tmp/base17.
set -u
OUT=${OUT:-/tmp/out17}; mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
python3 -V; nproc; free -g | head -2; df -h /dev/shm | tail -1; nvidia-smi -L; uptime
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site bench/_whl/*.whl $(ls bench/_whl_llvm/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import numpy, numba, blake3, torch, triton; print('numpy', numpy.__version__, 'numba', numba.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
BASE=/tmp/base17; rm -rf $BASE; mkdir -p $BASE
# the device copy of the tree may have no git history: a tarball of the baseline beside the script wins
if [ -f bench/base17.tar.gz ]; then tar -xzf bench/base17.tar.gz -C $BASE; else git archive 7b674de ckpttool | tar -x -C $BASE; fi || exit 1
S=/dev/shm/v3syn
t0=$(date +%s.%N)
[ -d $S ] || python3 -m bench.make_synthetic --out $S --layers 2 --dense-layers 1 --experts 144 --shards 8 --no-fsync | tail -1
echo "synthetic $(echo "$(date +%s.%N) - $t0" | bc) s"
python3 bench/ram_ceiling.py --dir /dev/shm/ceil --gb 18 --threads 1,4,16 | tee "$OUT/ceiling.json"
cat > /tmp/wrap.py <<'PY'
import json, os, subprocess, sys, time
name, tree, dst, *args = sys.argv[1:]
env = dict(os.environ, PYTHONPATH=f"/tmp/site:{tree}")
cmd = [sys.executable, "-m", "ckpttool", "convert", "/dev/shm/v3syn", dst, "--mp", "8", "--dtype", "bf16", "--quiet", "--json", *args]
t = time.perf_counter()
p = subprocess.Popen(cmd, env=env, cwd="/tmp", stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # not the repo root: its ckpttool/ would shadow the baseline
out, err = p.communicate()
wall = time.perf_counter() - t
import resource
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
size = sum(f.stat().st_size for f in os.scandir(dst)) if os.path.isdir(dst) else 0
try:
    timing = json.loads(out)["timing"]
except Exception:
    timing = None
print(json.dumps({"name": name, "rc": p.returncode, "wall_s": round(wall, 2), "gb_out": round(size / 1e9, 2),
                  "gbps": round(size / 1e9 / wall, 2), "peak_rss_gib_max_so_far": round(rss, 2), "timing": timing,
                  "stderr": err.decode()[-600:] if p.returncode else ""}))
PY
run() { rm -rf /dev/shm/o; python3 /tmp/wrap.py "$@" | tee -a "$OUT/runs.jsonl"; }
# one wrapper process per run: ru_maxrss of RUSAGE_CHILDREN is then that run's peak
python3 -c "
import numpy as np; from ckpttool.kernels import fp8_cpu; import time; t=time.perf_counter()
fp8_cpu.dequant(np.zeros((128,128),np.uint8), np.ones((1,1),np.float32), 'F8_E4M3', 'BF16'); print('numba compile or cache load', round(time.perf_counter()-t,2), 's')"
run base-cpu-1 $BASE /dev/shm/o --device cpu; rm -rf /dev/shm/ref; mv /dev/shm/o /dev/shm/ref
run new-cpu-1 $PWD /dev/shm/o --device cpu
for f in /dev/shm/ref/*; do cmp -s "$f" "/dev/shm/o/$(basename "$f")" || echo "DIFF cpu $(basename "$f")"; done; echo "cmp new-cpu vs base done"
run new-cuda-1 $PWD /dev/shm/o --device cuda
for f in /dev/shm/ref/*.safetensors; do cmp -s "$f" "/dev/shm/o/$(basename "$f")" || echo "DIFF cuda $(basename "$f")"; done; echo "cmp new-cuda vs base done"
run base-cpu-2 $BASE /dev/shm/o --device cpu
run new-cpu-2 $PWD /dev/shm/o --device cpu
run new-cuda-2 $PWD /dev/shm/o --device cuda
run base-cpu-3 $BASE /dev/shm/o --device cpu
run new-cpu-3 $PWD /dev/shm/o --device cpu
run new-auto $PWD /dev/shm/o --device auto
CKPTTOOL_NUMBA=0 run new-cpu-numpy-gather $PWD /dev/shm/o --device cpu
rm -rf /dev/shm/o /dev/shm/ref
dd if=/dev/zero of=/dev/shm/dd bs=16M count=1100 2>&1 | tail -1; rm -f /dev/shm/dd
CKPTTOOL_SEEDS=$PWD/bench/_seeds timeout 200 python3 -m pytest -m gpu -o addopts='' --ignore=tests/test_download.py -q -x -p no:cacheprovider --basetemp=/tmp/pt 2>&1 | tail -6
uptime
