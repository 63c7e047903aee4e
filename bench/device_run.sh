#!/bin/bash
# Issues 16, 17 and 19 in one device call (nvidia-h100-x1), each phase under its own time limit:
#   1. start-up: import torch, CUDA context, first Triton call (bench/probes/startup_probe.sh)
#   2. Triton tiles of every dequant kernel, and DeepSeek's reference kernel beside FP8 block (bench/probes/triton_sweep.py)
#   3. RAM to RAM (tmpfs in and out) on the V3-shaped synthetic: ceilings, 7b674de (issue 17's start) for
#      the bytes, this tree on the CPU (numba and numpy gathers), on CUDA, under auto, and CUDA's steady rate
#   4. straight from the hub: download, convert and streamed convert (bench/hub_stream_bench.py); runs first,
#      on a 1.4 GB input, so a later phase running long cannot cut it off
#   5. the GPU tests
#   6. the manifest's hash against the bytes written, sampled during a run (bench/probes/hash_lag.py)
#   7. RAM to RAM on the CPU with 16, 12 and 8 workers, interleaved, three rounds
#   8. every dequant kernel per output byte, small and large tensor (QUANT_COLS), CPU and CUDA (streamed, CUDA graph, host),
#      DeepSeek's weight_dequant beside them (bench/quant_bench.py)
#   9. `shard --mp 8` keeping FP8 against `cp -r` of the same input, tmpfs to tmpfs, interleaved
#  10. `convert` from tmpfs onto the disk against `dd oflag=direct` of the same bytes, interleaved
#  12. where a RAM-to-RAM CPU conversion's threads spend their time: py-spy (its wheel in .whl) samples every thread
#      (--idle) and, in a second run, only the one holding the GIL (--gil); raw stacks in prof-*.txt
#  13. RAM to RAM on the CPU: this tree against an earlier one (bench/prev.tar.gz, `git archive COMMIT ckpttool | gzip`),
#      PREV_ROUNDS interleaved rounds (default 3), every file compared; THIS_ENV="VAR=value ..." adds this tree run under them
#      (THIS_ENV=WRAP_MODULE=bench.probes.nohash: without the manifest's hash, bench/probes/nohash.py)
#  14. RAM to RAM variants of this tree, interleaved: VARIANTS="NAME|ENV|CONVERT ARGS;..." (VAR_ROUNDS rounds), then the
#      CUDA path's steady rate under each env of STEADY ("-": none)
#  11. `--device cpu | cuda | auto` RAM to RAM on AUTO_CPUS CPUs (taskset; default 4 and 8), AUTO_REPS times, a 1.4 GB and the 10.87 GB
#      input: the data `auto`'s choice is made from
# Run from the root of a checkout with [".whl", ".seeds"] carried: .whl holds the cp312 wheels the image
# lacks (pydantic, pydantic_core, annotated-types, typing-inspection, huggingface_hub 2.4 and its httpx2,
# httpcore2, hf-xet, anyio, idna, truststore, click, typing_extensions; blake3; py-spy for phase 12), .seeds DeepSeek's kernel.py.
# The baseline is commit 7b674de: bench/base17.tar.gz (git archive 7b674de ckpttool | gzip) when the
# device's copy has no git history. PHASES=1,2,3,4,5 picks phases (the default; 6 to 10 run only when named).
set -u
OUT=${OUT:-/tmp/out17}; mkdir -p "$OUT"
PHASES=${PHASES:-1,2,3,4,5}
exec > >(tee "$OUT/log.txt") 2>&1
on() { [[ ",$PHASES," == *",$1,"* ]]; }
stamp() { echo "== $* $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"; }
python3 -V; nproc; free -g | head -2; df -h /dev/shm | tail -1; nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# The image sets PYTHONDONTWRITEBYTECODE=1 and ships no bytecode: every import there compiled its module
# from source (`import numpy` 0.35-0.40 s, `import ckpttool.cli` 0.74-0.89 s). An installed package has
# its bytecode (pip writes it), so the runs here do too: written by the first round, read after.
unset PYTHONDONTWRITEBYTECODE
# the C kernels, as `pip install -e .` builds them (setup.py)
python3 setup.py -q build_ext --inplace 2>&1 | tail -3; python3 -c "from ckpttool.kernels import native; print('C kernels:', native.library())"
python3 -c "import numpy, numba, blake3, torch, triton, pydantic, huggingface_hub; print('numpy', numpy.__version__, 'numba', numba.__version__, 'torch', torch.__version__, 'triton', triton.__version__, 'hub', huggingface_hub.__version__)"

# one conversion of $SRC (default /dev/shm/v3syn), timed from outside: NAME TREE DST [ARGS]; prints a JSON line
cat > /tmp/wrap.py <<'PY'
import json, os, resource, subprocess, sys, time
name, tree, dst, *args = sys.argv[1:]
env = dict(os.environ, PYTHONPATH=f"/tmp/site:{tree}")
cmd = [sys.executable, "-m", os.environ.get("WRAP_MODULE", "ckpttool"), "convert", os.environ.get("SRC", "/dev/shm/v3syn"), dst, "--mp", "8", "--dtype", "bf16", "--quiet", "--json", *args]
t = time.perf_counter()
p = subprocess.Popen(cmd, env=env, cwd="/tmp", stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # not the repo root: its ckpttool/ would shadow the baseline
out, err = p.communicate()
wall = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
size = sum(f.stat().st_size for f in os.scandir(dst)) if os.path.isdir(dst) else 0
try:
    timing = json.loads(out)["timing"]
except Exception:
    timing = None
print(json.dumps({"name": name, "rc": p.returncode, "wall_s": round(wall, 2), "cpu_s": round(ru.ru_utime + ru.ru_stime, 1),
                  "gb_out": round(size / 1e9, 2), "gbps": round(size / 1e9 / wall, 2),
                  "peak_rss_gib": round(ru.ru_maxrss / 2**20, 2), "timing": timing, "stderr": err.decode()[-600:] if p.returncode else ""}))
PY

# the V3-shaped synthetic (10.87 GB in 8 files) in tmpfs, once; a command's wall seconds
v3syn() { [ -d /dev/shm/v3syn ] || python3 -m bench.make_synthetic --out /dev/shm/v3syn --layers 2 --dense-layers 1 --experts 144 --shards 8 --no-fsync | tail -1; }
# every safetensors file of /dev/shm/o equal to /dev/shm/ref's: NAME (printed with any difference)
same() { for f in /dev/shm/ref/*.safetensors; do cmp -s "$f" "/dev/shm/o/$(basename "$f")" || echo "DIFF $1 $(basename "$f")"; done; echo "cmp $1 done"; }
secs() { local t; t=$(date +%s.%N); "$@" > /dev/null || echo "FAILED: $*" >&2; awk -v a="$t" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }'; }

if on 4; then
  stamp hub
  # HUB_SYN: make_synthetic's arguments (default 1.4 GB in 13 files; the V3-shaped 10.87 GB one is phase 3's);
  # HUB_VARIANT: arguments of a second streamed run beside the default one ("--workers 8"); HUB_RATE: the
  # link in MB/s (0: input bytes / convert time); HUB_SERVER_CPUS: CPUs kept for the hub server (default 2), the
  # rest run ckpttool
  H=/dev/shm/hubsyn-$(echo "${HUB_SYN:-}" | md5sum | cut -c1-8)
  [ -d $H ] || python3 -m bench.make_synthetic --out $H ${HUB_SYN:---layers 1 --dense-layers 0 --experts 16 --vocab 16384 --shards 16} --no-fsync | tail -1
  timeout ${HUB_LIMIT:-150} python3 bench/hub_stream_bench.py --src $H --work /dev/shm/hubwork --mp 8 --reps ${HUB_REPS:-2} --rate ${HUB_RATE:-0} \
    --server-cpus ${HUB_SERVER_CPUS:-2} \
    ${HUB_VARIANT:+--stream-args "" --stream-args "$HUB_VARIANT"} | tee -a "$OUT/hub.txt"
  rm -rf /dev/shm/hubwork
fi

if on 1; then stamp start-up; timeout 120 bash bench/probes/startup_probe.sh; fi

if on 2; then stamp triton sweep; (cd bench && timeout 240 python3 triton_sweep.py --seeds ../.seeds --only ${SWEEP:-int4,nvfp4,fp8_block}) | tee "$OUT/sweep.jsonl"; fi

if on 3; then
  stamp ram to ram
  BASE=/tmp/base17; rm -rf $BASE; mkdir -p $BASE
  if [ -f bench/base17.tar.gz ]; then tar -xzf bench/base17.tar.gz -C $BASE; else git archive 7b674de ckpttool | tar -x -C $BASE; fi
  S=/dev/shm/v3syn
  [ -d $S ] || python3 -m bench.make_synthetic --out $S --layers 2 --dense-layers 1 --experts 144 --shards 8 --no-fsync | tail -1
  python3 bench/probes/ram_ceiling.py --dir /dev/shm/ceil --gb 18 --threads 1,4,16 | tee "$OUT/ceiling.json"
  run() { rm -rf /dev/shm/o; timeout 120 python3 /tmp/wrap.py "$@" | tee -a "$OUT/runs.jsonl"; }
  run base-cpu $BASE /dev/shm/o --device cpu; rm -rf /dev/shm/ref; mv /dev/shm/o /dev/shm/ref
  run new-cpu-1 $PWD /dev/shm/o --device cpu; same new-cpu
  run new-cuda-1 $PWD /dev/shm/o --device cuda; same new-cuda
  run new-cpu-2 $PWD /dev/shm/o --device cpu
  run new-cuda-2 $PWD /dev/shm/o --device cuda
  run new-cpu-3 $PWD /dev/shm/o --device cpu
  CKPTTOOL_NUMBA=0 run new-cpu-numpy $PWD /dev/shm/o --device cpu
  run new-auto $PWD /dev/shm/o --device auto
  rm -rf /dev/shm/o
  for i in 1 2; do timeout 120 python3 bench/probes/gpu_steady.py /dev/shm/v3syn /dev/shm/o --mp 8 | tee -a "$OUT/runs.jsonl"; done
  rm -rf /dev/shm/o /dev/shm/ref
  dd if=/dev/zero of=/dev/shm/dd bs=16M count=1100 2>&1 | tail -1; rm -f /dev/shm/dd
fi


if on 7; then
  stamp workers
  v3syn
  for i in 1 2 3; do for w in 16 12 8; do
    rm -rf /dev/shm/o; timeout 120 python3 /tmp/wrap.py "workers-$w" $PWD /dev/shm/o --device cpu --workers $w | tee -a "$OUT/workers.jsonl"
  done; done
  rm -rf /dev/shm/o
fi

if on 6; then
  stamp hash lag
  v3syn
  for w in 0 8; do timeout 60 python3 bench/probes/hash_lag.py /dev/shm/v3syn /dev/shm/o --workers $w | tee -a "$OUT/hashlag.jsonl"; done
  rm -rf /dev/shm/o
fi

if on 8; then
  stamp quant bench
  for c in ${QUANT_COLS:-2048 18432}; do (cd bench && timeout 150 python3 quant_bench.py --cols $c --reps 5 --seeds ../.seeds) | tee -a "$OUT/quant.json"; done
fi

if on 9; then
  stamp shard vs cp
  v3syn
  for i in 1 2 3; do
    rm -rf /dev/shm/o /dev/shm/cp
    echo "{\"round\": $i, \"cp_s\": $(secs cp -r /dev/shm/v3syn /dev/shm/cp), \"shard_s\": $(secs timeout 120 python3 -m ckpttool shard /dev/shm/v3syn /dev/shm/o --mp 8 -q), \"bytes\": $(du -sb /dev/shm/v3syn | cut -f1)}" | tee -a "$OUT/shard_cp.jsonl"
  done
  rm -rf /dev/shm/o /dev/shm/cp
fi

if on 10; then
  stamp disk vs dd
  v3syn; D=$PWD/../diskrun; mkdir -p $D; df -h $D | tail -1
  for i in 1 2 3; do
    rm -rf $D/o $D/dd; sync
    dd_s=$(secs dd if=/dev/zero of=$D/dd bs=16M count=1100 oflag=direct status=none); rm -f $D/dd; sync
    conv_s=$(secs timeout 150 python3 -m ckpttool convert /dev/shm/v3syn $D/o --mp 8 --dtype bf16 --device cpu -q)
    echo "{\"round\": $i, \"dd_s\": $dd_s, \"dd_bytes\": $((16 * 1024 * 1024 * 1100)), \"convert_s\": $conv_s, \"out_bytes\": $(du -sb $D/o | cut -f1)}" | tee -a "$OUT/disk.jsonl"
  done
  rm -rf $D
fi

if on 11; then
  stamp device by cores and size
  v3syn; SMALL=/dev/shm/smallsyn
  [ -d $SMALL ] || python3 -m bench.make_synthetic --out $SMALL --layers 1 --dense-layers 0 --experts 16 --vocab 16384 --no-fsync | tail -1
  for n in ${AUTO_CPUS:-4 8}; do for src in $SMALL /dev/shm/v3syn; do for r in $(seq ${AUTO_REPS:-1}); do for d in cpu cuda auto; do
    rm -rf /dev/shm/o
    SRC=$src timeout 150 taskset -c 0-$((n - 1)) python3 /tmp/wrap.py "cpus-$n-$d-$(basename $src)" $PWD /dev/shm/o --device $d | tee -a "$OUT/auto.jsonl"
  done; done; done; done
  rm -rf /dev/shm/o
fi

if on 13; then
  stamp this tree against bench/prev.tar.gz
  v3syn; P=/tmp/prev; rm -rf $P; mkdir -p $P; tar -xzf bench/prev.tar.gz -C $P
  for i in $(seq ${PREV_ROUNDS:-3}); do
    rm -rf /dev/shm/o; timeout 120 python3 /tmp/wrap.py "prev-$i" $P /dev/shm/o --device cpu | tee -a "$OUT/prev.jsonl"
    rm -rf /dev/shm/ref; mv /dev/shm/o /dev/shm/ref
    timeout 120 python3 /tmp/wrap.py "this-$i" $PWD /dev/shm/o --device cpu | tee -a "$OUT/prev.jsonl"
    same "this-$i vs prev"
    if [ -n "${THIS_ENV:-}" ]; then  # a variant of this tree: env assignments, e.g. CKPTTOOL_NUMBA=1
      rm -rf /dev/shm/o; env $THIS_ENV timeout 120 python3 /tmp/wrap.py "this-$THIS_ENV-$i" $PWD /dev/shm/o --device cpu | tee -a "$OUT/prev.jsonl"
    fi
  done
  rm -rf /dev/shm/o /dev/shm/ref
fi

if on 14; then
  stamp variants
  # VARIANTS: "NAME|ENV ASSIGNMENTS|CONVERT ARGS" separated by ";", VAR_ROUNDS interleaved rounds (default 3),
  # each run's files compared with the first variant's of its round
  v3syn; IFS=';' read -ra VS <<< "${VARIANTS:-base||--device cpu}"
  for i in $(seq ${VAR_ROUNDS:-3}); do
    first=1
    for v in "${VS[@]}"; do
      IFS='|' read -r name envs args <<< "$v"
      rm -rf /dev/shm/o
      env $envs timeout 120 python3 /tmp/wrap.py "$name-$i" $PWD /dev/shm/o $args | tee -a "$OUT/variants.jsonl"
      if [ $first = 1 ]; then rm -rf /dev/shm/ref; mv /dev/shm/o /dev/shm/ref; first=0; else same "$name-$i"; fi
    done
  done
  rm -rf /dev/shm/o /dev/shm/ref
  # STEADY: the CUDA path after start-up (bench/probes/gpu_steady.py) under each of these env assignments ("-": none,
  # commas between assignments)
  for e in ${STEADY:-}; do for i in 1 2; do
    [ "$e" = - ] && e=; echo "steady ${e:-base}"; env ${e//,/ } timeout 120 python3 bench/probes/gpu_steady.py /dev/shm/v3syn /dev/shm/o --mp 8 | tee -a "$OUT/steady.jsonl"
  done; done
  rm -rf /dev/shm/o
fi

if on 12; then
  stamp profile
  v3syn
  for mode in idle gil; do
    rm -rf /dev/shm/o
    timeout 120 /tmp/site/bin/py-spy record -o "$OUT/prof-$mode.txt" --format raw -r 100 --threads --$mode -- \
      python3 -m ckpttool convert /dev/shm/v3syn /dev/shm/o --mp 8 --dtype bf16 --device cpu -q 2>&1 | tail -2
  done
  rm -rf /dev/shm/o
fi

if on 5; then
  stamp gpu tests
  # the image's transformers wants its own huggingface_hub (< 2): the GPU tests run beside it, without ours
  mkdir -p /tmp/site-t; cp -r /tmp/site/pydantic* /tmp/site/annotated_types* /tmp/site/typing_inspection* /tmp/site/blake3* /tmp/site-t/
  PYTHONPATH=/tmp/site-t:$PWD CKPTTOOL_SEEDS=$PWD/.seeds timeout 240 python3 -m pytest -m gpu -o addopts='' -q -p no:cacheprovider \
    --basetemp=/tmp/pt ${GPU_TESTS:-$(grep -l "mark.gpu" tests/*.py)} 2>&1 | tail -15
fi
stamp end
