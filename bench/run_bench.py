"""Issue 4 benchmark: ckpttool's fused convert vs the reference two-pass pipeline vs the disk.

For one synthetic (or real) FP8 DeepSeek-V3 checkpoint, in one run on one machine:

  disk          raw disk bandwidth sized like the output: dd write (conv=fsync, and oflag=direct),
                a random-data write with fsync, a cold read, and a copy (read + write at once)
  convert       `ckpttool convert SRC DST --mp 8 --dtype bf16` (default device: auto)
  convert-cpu   the same with `--device cpu` (never imports torch)
  reference     fp8_cast_bf16.py then convert.py --model-parallel 8, from an unmodified copy of
                DeepSeek-V3's inference scripts (needs CUDA + Triton; skipped, and said so, without)
  kernel        Triton FP8 dequant kernel bandwidth vs the device's peak (bench/kernel_bench.py)
  dequant-cuda  `ckpttool dequant SRC DST --device cuda`
  dequant-cpu   `ckpttool dequant SRC DST --device cpu`
  flat          `ckpttool convert` with --max-memory on each --flat-src checkpoint: peak RSS by size
  hybrid        (off by default) reference convert.py on ckpttool's dequant output: checks the
                sharding against the reference where the reference's GPU pass cannot run

Every command runs as a child process, timed to completion and then to a `sync` (durable), with its
peak RSS (wait4 ru_maxrss, plus sampled anon/file RSS of its process tree) and the peak extra disk
used on the output filesystem (statvfs sampled every 0.1 s, minus the value before the step).
Page caches are dropped before each command when possible (root), so reads are cold and comparable.
Outputs are compared tensor by tensor (hash of every tensor's bytes) and deleted after each step.
Results are written after every step to --out (results.json, results.md), so a run cut short still
reports what it measured. Example (see bench/README.md):

    python bench/run_bench.py --src /tmp/v3-syn --out /tmp/bench-out --budget 560
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
ALL_STEPS = ["disk", "convert", "convert-cpu", "reference", "kernel", "dequant-cuda", "dequant-cpu", "flat", "hybrid"]
DEFAULT_STEPS = ["disk", "convert", "reference", "kernel", "dequant-cuda", "dequant-cpu", "flat"]
# sha256 of the published DeepSeek-V3 inference scripts this benchmark runs unmodified
SEED_SHA256 = {
    "fp8_cast_bf16.py": "4ebdf99f601c9af792d9c61d0f4af4e75ba4dae05e5f68d37ed2055c734f49d7",
    "kernel.py": "c1fb3178b0f8714b3e27580a4dcdde25ad1cad0d052c8b932bafc8489a4867e7",
    "convert.py": "22a87caf625150dd5b1291541f3d91656e045fdf331427c65c4852ee08da64cb",
}
GB = 1e9
GiB = 1 << 30


# -- measurement ---------------------------------------------------------------------------------
def fs_used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def dir_bytes(path: Path) -> int:
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def allocated_bytes(paths: list[Path]) -> int:
    """Disk blocks allocated to the files under paths (what `du` counts; includes delayed allocation)."""
    total = 0
    stack = [str(p) for p in paths]
    while stack:
        p = stack.pop()
        try:
            st = os.lstat(p)
        except OSError:
            continue
        total += st.st_blocks * 512
        if os.path.isdir(p) and not os.path.islink(p):
            try:
                stack.extend(os.path.join(p, n) for n in os.listdir(p))
            except OSError:
                pass
    return total


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False where not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def block_device(path: Path) -> str | None:
    """The /proc/diskstats name of the block device holding path (e.g. vda), or None."""
    st = os.stat(path)
    try:
        name = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve().name
    except OSError:
        return None
    return name if any(ln.split()[2:3] == [name] for ln in _read("/proc/diskstats").splitlines()) else None


def disk_bytes(device: str | None) -> tuple[int, int]:
    """(bytes read, bytes written) by the block device since boot, from /proc/diskstats."""
    if device:
        for ln in _read("/proc/diskstats").splitlines():
            f = ln.split()
            if len(f) > 9 and f[2] == device:
                return int(f[5]) * 512, int(f[9]) * 512
    return 0, 0


def _proc_tree(pid: int) -> list[int]:
    """pid and its descendants, from the parent pid in /proc/*/stat (works where the kernel has no
    /proc/PID/task/TID/children, as in some sandboxes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack.extend(children.get(p, []))
    return out


def _rss_kb(pid: int) -> dict[str, int]:
    vals = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    vals[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return vals


class Sampler(threading.Thread):
    """Peak disk use (of a filesystem, and of the files under `watch`) and peak RSS (summed over the
    process tree) while a child runs."""

    def __init__(self, fs_path: Path, watch: list[Path], interval: float = 0.1):
        super().__init__(daemon=True)
        self.fs_path, self.watch, self.interval = fs_path, watch, interval
        self.device = block_device(fs_path)
        self.started = time.monotonic()
        self.disk0 = disk_bytes(self.device)
        self.timeline: list[tuple[float, int, int]] = []  # (seconds, bytes read, bytes written) since start
        self.pid: int | None = None
        self.peak_used = fs_used(fs_path)
        self.peak_watched = allocated_bytes(watch)
        self.peak_rss_kb = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0, "RssShmem": 0}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def sample(self) -> None:
        if self.device:
            r, w = disk_bytes(self.device)
            self.timeline.append((time.monotonic() - self.started, r - self.disk0[0], w - self.disk0[1]))
        try:
            self.peak_used = max(self.peak_used, fs_used(self.fs_path))
        except OSError:
            pass
        self.peak_watched = max(self.peak_watched, allocated_bytes(self.watch))
        if self.pid is not None:
            total: dict[str, int] = {}
            for p in _proc_tree(self.pid):
                for k, v in _rss_kb(p).items():
                    total[k] = total.get(k, 0) + v
            for k, v in total.items():
                self.peak_rss_kb[k] = max(self.peak_rss_kb[k], v)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.sample()

    def disk_summary(self) -> dict:
        """Block-device bytes over the step, and per-second read/write rates (GB/s): shows whether
        the disk was kept busy or sat idle while the command computed."""
        if not self.timeline:
            return {}
        per_s, last, t_next = [], (0.0, 0, 0), 1.0
        for t, r, w in self.timeline:
            if t >= t_next:
                per_s.append((round((r - last[1]) / (t - last[0]) / GB, 2), round((w - last[2]) / (t - last[0]) / GB, 2)))
                last, t_next = (t, r, w), t_next + 1.0
        return {"device": self.device, "disk_read_bytes": self.timeline[-1][1], "disk_write_bytes": self.timeline[-1][2],
                "disk_gbs_per_second": per_s}


# Runs the command and reports its wait4 rusage. A separate small process, because a child's
# ru_maxrss includes the high-water RSS of the address space it was forked from (the kernel folds
# the old mm's peak in at exec), and this benchmark process grows while it hashes outputs.
_RUSAGE_WRAPPER = """
import json, os, sys
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)
_, status, ru = os.wait4(pid, 0)
code = os.waitstatus_to_exitcode(status)
with open(sys.argv[1], "w") as f:
    json.dump({"rc": code, "maxrss_kb": ru.ru_maxrss, "utime": ru.ru_utime, "stime": ru.ru_stime}, f)
sys.exit(code if code >= 0 else 128 - code)
"""


def run_measured(cmd: list[str], *, fs_path: Path, log_dir: Path, label: str, cwd: Path | None = None,
                 env: dict | None = None, timeout: float | None = None, drop: bool = True,
                 disk_baseline: int | None = None, bytes_written: int | None = None,
                 watch: list[Path] | None = None, prewarm: list[Path] | None = None) -> dict:
    """Run cmd to completion; wall time, time to a durable sync, peak RSS, peak extra disk (files under
    `watch`, and the whole filesystem of fs_path, which other users of the machine can disturb).
    `prewarm`: files read into the page cache after the drop, before the clock starts."""
    dropped = drop_caches() if drop else False
    warmed = sum(read_through(p) for p in prewarm or [])
    baseline = fs_used(fs_path) if disk_baseline is None else disk_baseline
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / f"{label}.out", log_dir / f"{label}.err"
    sampler = Sampler(fs_path, watch or [])
    sampler.start()
    started = time.monotonic()
    usage_path = log_dir / f"{label}.rusage.json"
    usage_path.unlink(missing_ok=True)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", _RUSAGE_WRAPPER, str(usage_path), *cmd], cwd=cwd, env=env,
                                stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        sampler.pid = proc.pid
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass

        timer = threading.Timer(timeout, kill) if timeout else None
        if timer:
            timer.start()
        proc.wait()
        if timer:
            timer.cancel()
    wall = time.monotonic() - started
    sampler.pid = None
    os.sync()  # what the step left dirty in the page cache is part of its cost
    durable = time.monotonic() - started
    sampler.stop()
    try:
        usage = json.loads(usage_path.read_text())
    except (OSError, ValueError):  # killed before it could report
        usage = {"rc": proc.returncode, "maxrss_kb": 0, "utime": 0.0, "stime": 0.0}
    rec = {
        "cmd": shlex.join(str(c) for c in cmd),
        "rc": proc.returncode, "timed_out": timed_out.is_set(),
        "wall_s": round(wall, 3), "durable_s": round(durable, 3), "sync_s": round(durable - wall, 3),
        "peak_rss_bytes": usage["maxrss_kb"] * 1024,
        "peak_tree_rss_bytes": sampler.peak_rss_kb["VmRSS"] * 1024,
        "peak_tree_rss_anon_bytes": sampler.peak_rss_kb["RssAnon"] * 1024,
        "peak_tree_rss_file_bytes": sampler.peak_rss_kb["RssFile"] * 1024,
        "peak_extra_disk_bytes": sampler.peak_watched if watch else max(0, sampler.peak_used - baseline),
        "peak_extra_disk_fs_bytes": max(0, sampler.peak_used - baseline),
        "loadavg_before": _read("/proc/loadavg").split()[:3],
        "cold_cache": dropped and not warmed, "prewarmed_bytes": warmed,
        **sampler.disk_summary(),
        "user_s": round(usage["utime"], 2), "sys_s": round(usage["stime"], 2),
    }
    if bytes_written is not None:
        rec["bytes_written"] = bytes_written
    if proc.returncode != 0:
        rec["stderr_tail"] = err_path.read_text(errors="replace")[-2000:]
    return rec


def read_through(path: Path) -> int:
    """Read every file under path once (into the page cache); bytes read."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    total = 0
    buf = bytearray(16 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total


# -- output comparison ---------------------------------------------------------------------------
def _hasher():
    try:
        import xxhash

        return "xxh3_128", xxhash.xxh3_128
    except ImportError:
        return "sha1", hashlib.sha1


def _tensor_digest(path: Path, start: int, end: int, make) -> str:
    h = make()
    chunk = 64 << 20
    buf = bytearray(min(chunk, max(end - start, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        pos = start
        while pos < end:
            n = os.preadv(f.fileno(), [view[: min(chunk, end - pos)]], pos)
            if n <= 0:
                raise OSError(f"short read in {path} at {pos}")
            h.update(view[:n])
            pos += n
    return h.hexdigest()


def read_header(path: Path) -> list[dict]:
    """[{name, dtype, shape, start, end}] with absolute byte ranges; checks that they tile the file.
    (Not ckpttool's reader: this process stays free of torch and of the code under test.)"""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    base, out = 8 + n, []
    for name, e in header.items():
        out.append({"name": name, "dtype": e["dtype"], "shape": e["shape"],
                    "start": base + e["data_offsets"][0], "end": base + e["data_offsets"][1]})
    out.sort(key=lambda t: t["start"])
    cursor = base
    for t in out:
        if t["start"] != cursor:
            raise ValueError(f"{path}: gap or overlap before tensor {t['name']}")
        cursor = t["end"]
    if cursor != path.stat().st_size:
        raise ValueError(f"{path}: data ends at {cursor}, file has {path.stat().st_size} bytes")
    return out


def digest_dir(path: Path, workers: int | None = None) -> dict[str, dict]:
    """{"file/tensor": {dtype, shape, digest}} for every tensor of every *.safetensors under path."""
    _, make = _hasher()
    jobs = [(f"{f.name}/{t['name']}", f, t) for f in sorted(path.glob("*.safetensors")) for t in read_header(f)]
    out: dict[str, dict] = {}
    with ThreadPoolExecutor(workers or min(16, os.cpu_count() or 2)) as pool:
        digests = pool.map(lambda j: _tensor_digest(j[1], j[2]["start"], j[2]["end"], make), jobs)
        for (key, _, t), d in zip(jobs, digests):
            out[key] = {"dtype": t["dtype"], "shape": list(t["shape"]), "digest": d}
    return out


def compare(a: dict[str, dict], b: dict[str, dict]) -> dict:
    differ = [k for k in a.keys() & b.keys() if a[k] != b[k]]
    missing, extra = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    return {"identical": not differ and not missing and not extra, "tensors": len(a),
            "equal": len(a.keys() & b.keys()) - len(differ), "differ": sorted(differ)[:5], "n_differ": len(differ),
            "only_in_first": missing[:5], "n_only_in_first": len(missing),
            "only_in_second": extra[:5], "n_only_in_second": len(extra)}


# -- context ---------------------------------------------------------------------------------------
def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def machine_info(work: Path, python: str) -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in _read("/proc/cpuinfo").splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next((int(ln.split()[1]) * 1024 for ln in _read("/proc/meminfo").splitlines()
                if ln.startswith("MemTotal")), 0)
    mounts = [ln.split() for ln in _read("/proc/mounts").splitlines()]
    best = ("?", "?", "?")
    for m in mounts:
        if len(m) >= 3 and (str(work.resolve()) + "/").startswith(m[1].rstrip("/") + "/") and len(m[1]) >= len(best[1]):
            best = (m[0], m[1], m[2])
    info = {
        "hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "mem_total_bytes": mem,
        "kernel": platform.release(), "python": python, "work_dir": str(work),
        "loadavg": " ".join(_read("/proc/loadavg").split()[:3]),
        "work_fs": {"device": best[0], "mount": best[1], "type": best[2],
                    "free_bytes": shutil.disk_usage(work).free},
    }
    probe = ("import json, torch\nd = {'torch': torch.__version__, 'cuda': torch.cuda.is_available()}\n"
             "if d['cuda']:\n d['gpu'] = torch.cuda.get_device_name(0)\n"
             "try:\n import triton; d['triton'] = triton.__version__\nexcept ImportError:\n d['triton'] = None\n"
             "print(json.dumps(d))")
    try:
        got = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
        info.update(json.loads(got.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError, OSError) as exc:
        info["probe_error"] = str(exc)
    info["ckpttool_source_sha256"] = source_digest()
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "ckpttool"],
                               capture_output=True, text=True, timeout=10)
        if rev.returncode == 0:
            info["ckpttool_commit"] = rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def source_digest() -> str:
    """sha256 (12 hex digits) over ckpttool's Python sources, path and bytes: names the code measured
    even where the tree was copied without its git history (the device machines carry stale git
    metadata). `python -c "from bench.run_bench import source_digest; print(source_digest())"` at a
    commit gives the same digest."""
    h = hashlib.sha256()
    for path in sorted((REPO / "ckpttool").rglob("*.py")):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def source_info(src: Path) -> dict:
    """Sizes from headers only: input bytes, FP8 bytes, what an HF BF16 conversion writes."""
    total = fp8 = out_hf = 0
    for f in sorted(src.glob("*.safetensors")):
        for t in read_header(f):
            nbytes = t["end"] - t["start"]
            total += nbytes
            if t["dtype"].startswith("F8"):
                fp8 += nbytes
                out_hf += 2 * nbytes
            elif not t["name"].endswith("_scale_inv"):
                out_hf += nbytes
    cfg = json.loads((src / "config.json").read_text())
    info = {"path": str(src), "bytes": total, "fp8_bytes": fp8, "bf16_hf_bytes": out_hf,
            "files": len(list(src.glob("*.safetensors"))), "n_routed_experts": cfg.get("n_routed_experts"),
            "num_hidden_layers": cfg.get("num_hidden_layers"), "vocab_size": cfg.get("vocab_size")}
    sidecar = Path(str(src).rstrip("/") + ".synthetic.json")
    if sidecar.exists():
        info["generated_by"] = json.loads(sidecar.read_text()).get("command")
    return info


def find_seeds(arg: str | None) -> Path | None:
    for cand in ([Path(arg)] if arg else []) + [BENCH / "_seeds", REPO.parent / "shared/seeds/deepseek_v3_inference",
                                                 REPO / "shared/seeds/deepseek_v3_inference"]:
        if all((cand / n).is_file() for n in SEED_SHA256):
            return cand
    return None


# -- the benchmark ---------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.src: Path = args.src.resolve()
        self.work: Path = (args.work or self.src.parent / "ckpttool-bench-work").resolve()
        self.out: Path = args.out.resolve()
        self.logs = self.work / "logs"
        self.python = args.python
        self.started = time.monotonic()
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.env["PYTHONUNBUFFERED"] = "1"
        self.digests: dict[str, dict] = {}
        self.res: dict = {
            "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]),
            "steps": {}, "skipped": {}, "checks": {}, "summary": {},
        }

    # bookkeeping
    def remaining(self) -> float | None:
        return None if not self.args.budget else self.args.budget - (time.monotonic() - self.started)

    def timeout(self, cap: float | None = None) -> float | None:
        left = self.remaining()
        vals = [v for v in (left, cap) if v is not None]
        return max(1.0, min(vals)) if vals else None

    def skip(self, step: str, why: str) -> None:
        self.res["skipped"][step] = why
        print(f"[bench] skip {step}: {why}", flush=True)

    def record(self, name: str, rec: dict) -> dict:
        self.res["steps"][name] = rec
        w = rec.get("bytes_written")
        rate = f", {w / rec['durable_s'] / GB:.2f} GB/s" if w and rec.get("durable_s") else ""
        print(f"[bench] {name}: rc={rec.get('rc')} {rec.get('wall_s')}s (durable {rec.get('durable_s')}s){rate}, "
              f"peak RSS {rec.get('peak_rss_bytes', 0) / GiB:.2f} GiB, "
              f"peak extra disk {rec.get('peak_extra_disk_bytes', 0) / GB:.2f} GB", flush=True)
        self.save()
        return rec

    def measure(self, name: str, cmd: list[str], *, out_dir: Path | None = None, cwd: Path | None = None,
                disk_baseline: int | None = None, cap: float | None = None, bytes_written: int | None = None,
                bytes_read: int | None = None, watch: list[Path] | None = None, inputs: list[Path] | None = None) -> dict:
        """`inputs`: what the command reads; with --warm-input they are in the page cache when it starts."""
        if watch is None and out_dir is not None:
            watch = [out_dir]
        rec = run_measured([str(c) for c in cmd], fs_path=self.work, log_dir=self.logs, label=name, cwd=cwd,
                           env=self.env, timeout=self.timeout(cap), drop=self.args.drop_caches,
                           disk_baseline=disk_baseline, bytes_written=bytes_written, watch=watch,
                           prewarm=inputs if self.args.warm_input else None)
        if bytes_read is not None:
            rec["bytes_read"] = bytes_read
        if out_dir is not None:
            rec["bytes_written"] = dir_bytes(out_dir)
            rec["output_bytes_safetensors"] = sum(p.stat().st_size for p in out_dir.glob("*.safetensors"))
        return self.record(name, rec)

    def ckpttool(self, *args: object) -> list[str]:
        return [self.python, "-m", "ckpttool", *map(str, args)]

    def fresh(self, name: str) -> Path:
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    def cleanup(self, *paths: Path) -> None:
        if self.args.keep_outputs:
            return
        for p in paths:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    def digest(self, label: str, path: Path) -> None:
        if not self.args.compare or not path.exists():
            return
        t0 = time.monotonic()
        self.digests[label] = digest_dir(path)
        print(f"[bench] hashed {label}: {len(self.digests[label])} tensors in {time.monotonic() - t0:.1f}s",
              flush=True)

    def check(self, name: str, a: str, b: str) -> None:
        if a in self.digests and b in self.digests:
            self.res["checks"][name] = compare(self.digests[a], self.digests[b])
            verdict = "IDENTICAL" if self.res["checks"][name]["identical"] else "DIFFERENT"
            print(f"[bench] check {name}: {verdict}", flush=True)
            self.save()

    def has_cuda(self) -> tuple[bool, str]:
        m = self.res["machine"]
        if not m.get("cuda"):
            return False, "no CUDA device (torch.cuda.is_available() is False)"
        if not m.get("triton"):
            return False, "triton is not installed"
        return True, ""

    # steps
    def step_disk(self) -> None:
        size = self.args.disk_bytes or self.res["source"]["bf16_hf_bytes"]
        free = shutil.disk_usage(self.work).free - (2 << 30)
        count = max(1, min(size, free) // (16 << 20))
        nbytes = count * (16 << 20)
        f = self.work / "dd-test.bin"
        dd = ["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={count}", "status=none"]
        disk: dict = {"bytes": nbytes}
        rec = self.measure("disk-write-dd-fsync", dd + ["conv=fsync"], cap=300, bytes_written=nbytes, watch=[f])
        disk["write_fsync"] = nbytes / rec["durable_s"]
        drop = self.args.drop_caches and drop_caches()
        rd = ["dd", f"if={f}", "of=/dev/null", "bs=16M", "status=none"] + ([] if drop else ["iflag=direct"])
        rec = self.measure("disk-read-cold", rd, cap=300, bytes_read=nbytes, watch=[])
        disk["read"] = nbytes / rec["wall_s"]
        # a cold read of that file while another is written: a conversion's cold input shares the disk
        rec = self.measure("disk-read+write", [self.python, BENCH / "io_probe.py", "read-write", "--dir", self.work / "rw",
                                               "--read", f, "--gib", nbytes / GiB], cap=300, watch=[])
        got = self._child_json("disk-read+write")
        if rec["rc"] == 0 and got:
            disk.update(read_write_total=got["total_gbs"] * GB, read_write_read=got["read_gbs"] * GB,
                        read_write_write=got["write_gbs"] * GB)
        shutil.rmtree(self.work / "rw", ignore_errors=True)
        f.unlink()
        rec = self.measure("disk-write-dd-direct", dd + ["oflag=direct", "conv=fsync"], cap=300, bytes_written=nbytes, watch=[f])
        if rec["rc"] == 0:
            disk["write_direct"] = nbytes / rec["durable_s"]
        f.unlink(missing_ok=True)
        # random bytes, in case the storage below treats zeros specially (compression, thin provisioning)
        code = ("import os,sys\nb=os.urandom(64<<20)\nfd=os.open(sys.argv[1],os.O_WRONLY|os.O_CREAT|os.O_TRUNC)\n"
                "for i in range(int(sys.argv[2])):\n v=memoryview(b)\n while v: v=v[os.write(fd,v):]\n"
                "os.fsync(fd)\nos.close(fd)")
        n64 = max(1, nbytes // (64 << 20))
        rec = self.measure("disk-write-random-fsync", [self.python, "-c", code, f, n64], cap=300,
                           bytes_written=n64 * (64 << 20), watch=[f])
        if rec["rc"] == 0:
            disk["write_random"] = rec["bytes_written"] / rec["durable_s"]
        f.unlink(missing_ok=True)
        # 8 threads writing 8 MiB pieces with an fdatasync per GiB, the way ckpttool writes
        rec = self.measure("disk-write-mt", [self.python, BENCH / "io_probe.py", "write-mt", "--dir", self.work / "mt",
                                             "--gib", nbytes / GiB], cap=300, watch=[self.work / "mt"])
        got = self._child_json("disk-write-mt")
        if rec["rc"] == 0 and got:
            disk["write_mt"] = got["bytes"] / rec["durable_s"]
        shutil.rmtree(self.work / "mt", ignore_errors=True)
        # read and write at once, as a conversion does: copy the source's largest file
        big = max(self.src.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        size = big.stat().st_size
        rec = self.measure("disk-copy", ["dd", f"if={big}", f"of={f}", "bs=16M", "conv=fsync", "status=none"], cap=300,
                           bytes_written=size, bytes_read=size, watch=[f])
        disk["copy"] = size / rec["durable_s"]
        f.unlink(missing_ok=True)
        disk["write_best"] = max(v for k, v in disk.items() if k.startswith("write_"))
        self.res["disk"] = disk
        self.save()

    def step_convert(self, device: str | None = None) -> None:
        dst = self.fresh("ckpttool-mp")
        label = "convert" if device is None else f"convert-{device}"
        rec = self.measure(label, self.ckpttool("convert", self.src, dst, "--mp", self.args.mp, "--dtype", "bf16",
                                                "--json", *(["--device", device] if device else []),
                                                *shlex.split(self.args.convert_args)),
                           out_dir=dst, inputs=[self.src])
        self._attach_report(rec, label)
        if rec["rc"] == 0:
            self.digest(label, dst)
            self.check(f"{label} == reference (mp shards)", label, "reference")
            self.check(f"{label} == hybrid reference (mp shards)", label, "hybrid")
        self.cleanup(dst)

    def _child_json(self, label: str) -> dict | None:
        text = (self.logs / f"{label}.out").read_text(errors="replace")
        try:
            return json.loads(text[text.index("{"):])
        except ValueError:
            return None

    def _attach_report(self, rec: dict, label: str) -> None:
        text = (self.logs / f"{label}.out").read_text(errors="replace")
        try:
            rec["ckpttool_report"] = {k: v for k, v in json.loads(text[text.index("{"):]).items()
                                      if k in ("seconds", "gb_per_s", "bytes_written", "tensors", "plan_hash", "timing")}
        except ValueError:
            pass
        self.save()

    def step_reference(self) -> None:
        ok, why = self.has_cuda()
        if not ok:
            return self.skip("reference", f"fp8_cast_bf16.py needs CUDA and Triton: {why}")
        seeds = find_seeds(self.args.seeds)
        if seeds is None:
            return self.skip("reference", "reference scripts not found (give --seeds DIR holding fp8_cast_bf16.py, "
                                          "kernel.py, convert.py)")
        copy = self.fresh("reference-scripts")
        copy.mkdir(parents=True)
        unmodified = True
        for name, sha in SEED_SHA256.items():
            shutil.copy2(seeds / name, copy / name)
            unmodified &= hashlib.sha256((copy / name).read_bytes()).hexdigest() == sha
        self.res["reference_scripts"] = {"from": str(seeds), "unmodified": unmodified}
        bf16, mp = self.fresh("reference-bf16"), self.fresh("reference-mp")
        need = 2 * self.res["source"]["bf16_hf_bytes"] + (2 << 30)
        if shutil.disk_usage(self.work).free < need:
            return self.skip("reference", f"needs {need / GB:.1f} GB free for its intermediate copy and output, "
                                          f"{shutil.disk_usage(self.work).free / GB:.1f} GB free in {self.work}")
        n_experts = self.res["source"]["n_routed_experts"]
        baseline = fs_used(self.work)  # both passes count against the same baseline: pass 1's output stays
        r1 = self.measure("reference-1-fp8_cast_bf16", [self.python, "fp8_cast_bf16.py", "--input-fp8-hf-path",
                                                        self.src, "--output-bf16-hf-path", bf16],
                          out_dir=bf16, cwd=copy, disk_baseline=baseline, watch=[bf16, mp], inputs=[self.src])
        if r1["rc"] != 0:
            return self.cleanup(bf16, mp)
        r2 = self.measure("reference-2-convert", [self.python, "convert.py", "--hf-ckpt-path", bf16, "--save-path", mp,
                                                  "--n-experts", n_experts, "--model-parallel", self.args.mp],
                          out_dir=mp, cwd=copy, disk_baseline=baseline, watch=[bf16, mp], inputs=[bf16])
        if r2["rc"] == 0:
            total = {k: r1[k] + r2[k] for k in ("wall_s", "durable_s", "bytes_written", "disk_read_bytes",
                                                  "disk_write_bytes") if k in r1 and k in r2}
            total.update(peak_rss_bytes=max(r1["peak_rss_bytes"], r2["peak_rss_bytes"]),
                         peak_tree_rss_anon_bytes=max(r1["peak_tree_rss_anon_bytes"], r2["peak_tree_rss_anon_bytes"]),
                         peak_extra_disk_bytes=max(r1["peak_extra_disk_bytes"], r2["peak_extra_disk_bytes"]),
                         peak_extra_disk_fs_bytes=max(r1["peak_extra_disk_fs_bytes"], r2["peak_extra_disk_fs_bytes"]),
                         output_bytes_safetensors=r2["output_bytes_safetensors"], rc=0,
                         cold_cache=r1["cold_cache"] and r2["cold_cache"],
                         prewarmed_bytes=r1["prewarmed_bytes"] + r2["prewarmed_bytes"])
            self.res["steps"]["reference-total"] = total
            self.digest("reference", mp)
            self.digest("reference-bf16", bf16)
            self.check("convert == reference (mp shards)", "convert", "reference")
            self.check("convert-cpu == reference (mp shards)", "convert-cpu", "reference")
            for other in ("dequant-cuda", "dequant-cpu"):
                self.check(f"{other} == reference fp8_cast_bf16 (HF)", other, "reference-bf16")
        self.cleanup(bf16, mp, copy)

    def step_kernel(self) -> None:
        ok, why = self.has_cuda()
        cmd = [self.python, BENCH / "kernel_bench.py"]
        seeds = find_seeds(self.args.seeds)
        if ok and seeds is not None:
            cmd += ["--seeds", seeds]
        if self.args.kernel_cpu or not ok:
            cmd += ["--cpu"]
        rec = run_measured([str(c) for c in cmd], fs_path=self.work, log_dir=self.logs, label="kernel",
                           env=self.env, timeout=self.timeout(300), drop=False)
        text = (self.logs / "kernel.out").read_text(errors="replace")
        try:
            self.res["kernel"] = json.loads(text[text.index("{"):])
        except ValueError:
            self.res["kernel"] = {"error": rec.get("stderr_tail", text[-2000:])}
        if not ok:
            self.res["kernel"]["cuda"] = {"skipped": why}
        print(f"[bench] kernel: {json.dumps(self.res['kernel'])[:400]}", flush=True)
        self.save()

    def step_dequant(self, device: str) -> None:
        name = f"dequant-{device}"
        if device == "cuda":
            ok, why = self.has_cuda()
            if not ok:
                return self.skip(name, why)
        dst = self.fresh(name)
        rec = self.measure(name, self.ckpttool("dequant", self.src, dst, "--device", device, "--json",
                                               *shlex.split(self.args.convert_args)), out_dir=dst, inputs=[self.src])
        self._attach_report(rec, name)
        if rec["rc"] == 0:
            self.digest(name, dst)
            self.check("dequant-cpu == dequant-cuda (HF)", "dequant-cpu", "dequant-cuda")
            self.check(f"{name} == reference fp8_cast_bf16 (HF)", name, "reference-bf16")
            if self.args.hybrid_input_from_dequant and "hybrid" in self.args.steps and "hybrid" not in self.digests:
                self.run_hybrid(dst)
        self.cleanup(dst)

    def run_hybrid(self, hf: Path) -> None:
        seeds = find_seeds(self.args.seeds)
        if seeds is None:
            return self.skip("hybrid", "reference convert.py not found (--seeds)")
        mp = self.fresh("hybrid-mp")
        rec = self.measure("hybrid-reference-convert", [self.python, seeds / "convert.py", "--hf-ckpt-path", hf,
                                                        "--save-path", mp, "--n-experts",
                                                        self.res["source"]["n_routed_experts"],
                                                        "--model-parallel", self.args.mp], out_dir=mp, cwd=seeds,
                           inputs=[hf])
        if rec["rc"] == 0:
            self.digest("hybrid", mp)
            self.check("convert == hybrid reference (mp shards)", "convert", "hybrid")
        self.cleanup(mp)

    def step_hybrid(self) -> None:
        if "hybrid" in self.digests or "hybrid-reference-convert" in self.res["steps"]:
            return
        hf = self.fresh("hybrid-hf")
        rec = self.measure("hybrid-dequant", self.ckpttool("dequant", self.src, hf, "--json"), out_dir=hf,
                           inputs=[self.src])
        if rec["rc"] == 0:
            self.run_hybrid(hf)
        self.cleanup(hf)

    def step_flat(self) -> None:
        """Peak RSS of the same convert on checkpoints of different sizes: generated ones first (--flat-gen,
        made here and deleted after), then --flat-src ones."""
        srcs: list[tuple[Path, str | None]] = [(self.work / f"flat-src-{i}", gen)
                                               for i, gen in enumerate(self.args.flat_gen or [])]
        srcs += [(Path(p).resolve(), None) for p in (self.args.flat_src or [])]
        if not srcs:
            srcs = [(self.src, None)]
        flat = []
        self.res["flat"] = {"max_memory": self.args.flat_max_memory, "runs": flat}
        for i, (src, gen) in enumerate(srcs):
            if self.remaining() is not None and self.remaining() < self.args.min_step_s:
                self.skip(f"flat-{i}", "time budget")
                continue
            if gen is not None:
                shutil.rmtree(src, ignore_errors=True)
                made = subprocess.run([self.python, "-m", "bench.make_synthetic", "--out", src, "--json",
                                       *shlex.split(gen)], cwd=REPO, env=self.env, capture_output=True, text=True)
                if made.returncode != 0:
                    self.skip(f"flat-{i}", f"make_synthetic {gen} failed: {made.stderr[-500:]}")
                    continue
            dst = self.fresh(f"flat-{i}")
            rec = self.measure(f"flat-{i}", self.ckpttool("convert", src, dst, "--mp", self.args.mp, "--dtype", "bf16",
                                                          "--max-memory", self.args.flat_max_memory, "--json",
                                                          *shlex.split(self.args.convert_args)),
                               out_dir=dst, inputs=[src])
            self.cleanup(dst)
            flat.append({"src": str(src), "generated_with": gen, "src_bytes": source_info(src)["bytes"],
                         "rc": rec["rc"], "peak_rss_bytes": rec["peak_rss_bytes"],
                         "peak_tree_rss_anon_bytes": rec["peak_tree_rss_anon_bytes"],
                         "durable_s": rec["durable_s"], "bytes_written": rec["bytes_written"]})
            if gen is not None:
                shutil.rmtree(src, ignore_errors=True)
                Path(str(src) + ".synthetic.json").unlink(missing_ok=True)
            self.save()

    # run
    def run(self) -> dict:
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.res["machine"] = machine_info(self.work, self.python)
        self.res["source"] = source_info(self.src)
        self.res["drop_caches"] = self.args.drop_caches and drop_caches()
        self.res["warm_input"] = self.args.warm_input
        if self.args.drop_caches and not self.res["drop_caches"]:
            print("[bench] cannot drop the page cache (not root?): reads may be warm", flush=True)
        self.save()
        for step in self.args.steps:
            left = self.remaining()
            if left is not None and left < self.args.min_step_s:
                self.skip(step, f"time budget ({self.args.budget:.0f}s) spent")
                continue
            print(f"[bench] --- {step} ({'no budget' if left is None else f'{left:.0f}s left'})", flush=True)
            try:
                {"disk": self.step_disk, "convert": self.step_convert, "convert-cpu": lambda: self.step_convert("cpu"),
                 "reference": self.step_reference,
                 "kernel": self.step_kernel, "dequant-cuda": lambda: self.step_dequant("cuda"),
                 "dequant-cpu": lambda: self.step_dequant("cpu"), "flat": self.step_flat,
                 "hybrid": self.step_hybrid}[step]()
            except Exception as exc:  # one broken step must not lose the others' numbers
                self.res["skipped"][step] = f"error: {type(exc).__name__}: {exc}"
                print(f"[bench] {step} failed: {exc}", flush=True)
        self.res["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.save()
        if not self.args.keep_outputs:
            shutil.rmtree(self.work / "logs", ignore_errors=True)
            try:
                self.work.rmdir()
            except OSError:
                pass
        return self.res

    def save(self) -> None:
        self.res["summary"] = summarize(self.res)
        (self.out / "results.json").write_text(json.dumps(self.res, indent=2, default=str))
        (self.out / "results.md").write_text(render_markdown(self.res))


# -- reporting -------------------------------------------------------------------------------------
def summarize(res: dict) -> dict:
    steps, s = res.get("steps", {}), {}
    conv, ref = steps.get("convert"), steps.get("reference-total")
    disk = res.get("disk", {})
    ok = lambda r: r is not None and r.get("rc") == 0  # noqa: E731
    if ok(conv):
        s["convert_gb_per_s"] = round(conv["bytes_written"] / conv["durable_s"] / GB, 3)
        s["convert_peak_rss_gib"] = round(conv["peak_rss_bytes"] / GiB, 3)
        s["convert_peak_rss_ok (<= 2 GiB)"] = conv["peak_rss_bytes"] <= 2 * GiB
        s["convert_peak_extra_disk_over_output"] = round(conv["peak_extra_disk_bytes"] / max(conv["bytes_written"], 1), 3)
        timing = conv.get("ckpttool_report", {}).get("timing", {}).get("phases_s", {})
        if timing.get("total"):
            s["convert_process_startup_s"] = round(conv["wall_s"] - timing["total"], 2)
        if ok(ref):
            s["speedup_vs_reference"] = round(ref["durable_s"] / conv["durable_s"], 2)
            s["speedup_ok (>= 3.5x)"] = s["speedup_vs_reference"] >= 3.5
            s["speedup_vs_reference_wall"] = round(ref["wall_s"] / conv["wall_s"], 2)
        if disk.get("write_best"):
            s["disk_write_best_gb_per_s"] = round(disk["write_best"] / GB, 3)
            eff = conv["bytes_written"] / disk["write_best"] / conv["durable_s"]
            s["convert_fraction_of_disk_write_bw"] = round(eff, 3)
            s["disk_bw_ok (>= 0.8)"] = eff >= 0.8
        if disk.get("read_write_total") and conv.get("disk_read_bytes") is not None:
            # with a cold input the same disk also serves the reads: measure against both streams at once
            moved = conv["disk_read_bytes"] + conv["disk_write_bytes"]
            s["convert_disk_gb_moved"] = round(moved / GB, 2)
            s["convert_fraction_of_read_write_bw"] = round(moved / conv["durable_s"] / disk["read_write_total"], 3)
    conv_cpu = steps.get("convert-cpu")
    if ok(conv_cpu):
        s["convert_cpu_gb_per_s"] = round(conv_cpu["bytes_written"] / conv_cpu["durable_s"] / GB, 3)
        s["convert_cpu_peak_rss_gib"] = round(conv_cpu["peak_rss_bytes"] / GiB, 3)
        if ok(ref):
            s["speedup_cpu_vs_reference"] = round(ref["durable_s"] / conv_cpu["durable_s"], 2)
        if disk.get("write_best"):
            s["convert_cpu_fraction_of_disk_write_bw"] = round(
                conv_cpu["bytes_written"] / disk["write_best"] / conv_cpu["durable_s"], 3)
    cpu, gpu = steps.get("dequant-cpu"), steps.get("dequant-cuda")
    if ok(cpu) and ok(gpu):
        s["dequant_cpu_over_cuda"] = round(cpu["durable_s"] / gpu["durable_s"], 2)
        s["dequant_cpu_ok (<= 1.5x)"] = s["dequant_cpu_over_cuda"] <= 1.5
    k = res.get("kernel", {}).get("ckpttool", {})
    if k.get("bytes_per_s"):
        s["kernel_gb_per_s"] = round(k["bytes_per_s"] / GB, 1)
        if k.get("fraction_of_peak"):
            s["kernel_fraction_of_peak"] = round(k["fraction_of_peak"], 3)
    runs = [r for r in res.get("flat", {}).get("runs", []) if r["rc"] == 0]
    if len(runs) >= 2:
        rss = [r["peak_rss_bytes"] for r in runs]
        s["flat_peak_rss_gib"] = [round(r / GiB, 3) for r in rss]
        s["flat_rss_ratio_max_over_min"] = round(max(rss) / min(rss), 3)
    if res.get("checks"):
        s["all_checks_identical"] = all(c["identical"] for c in res["checks"].values())
    return s


def _gb(v) -> str:
    return "" if v is None else f"{v / GB:.2f}"


def _gib(v) -> str:
    return "" if not v else f"{v / GiB:.2f}"


def render_markdown(res: dict) -> str:
    m, src = res.get("machine", {}), res.get("source", {})
    lines = [f"### {m.get('gpu') or 'CPU only'} / {m.get('cores')} cores / {m.get('mem_total_bytes', 0) / GiB:.0f} GiB"
             f" / {m.get('work_fs', {}).get('type', '?')} — {res['date']}", ""]
    lines += [f"- machine: {m.get('cpu')}, {m.get('cores')} cores, {m.get('mem_total_bytes', 0) / GiB:.1f} GiB RAM, "
              f"kernel {m.get('kernel')}, torch {m.get('torch')}, triton {m.get('triton')}, "
              f"ckpttool {m.get('ckpttool_commit', '?')} (sources {m.get('ckpttool_source_sha256', '?')}), "
              f"load average at start {m.get('loadavg')}",
              f"- work dir: {m.get('work_dir')} ({m.get('work_fs', {}).get('type')} on {m.get('work_fs', {}).get('device')})",
              f"- checkpoint: {src.get('path')}: {_gb(src.get('bytes'))} GB in {src.get('files')} files "
              f"({_gb(src.get('fp8_bytes'))} GB FP8), {src.get('num_hidden_layers')} layers, "
              f"{src.get('n_routed_experts')} experts, vocab {src.get('vocab_size')}"]
    if src.get("generated_by"):
        lines.append(f"- generated by: `{src['generated_by']}`")
    lines += [f"- command: `{res['command']}`",
              f"- page cache dropped before each command: {'yes' if res.get('drop_caches') else 'NO (reads may be warm)'}"
              + ("; then each command's input read into it (--warm-input: the disk only writes)" if res.get("warm_input") else ""),
              ""]
    lines += ["| step | wall s | durable s | GB written | GB/s | % disk write BW | peak RSS GiB | peak anon RSS GiB "
              "| peak extra disk GB | (whole fs) | input | disk GB read | disk GB written |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---:|---:|"]
    best = res.get("disk", {}).get("write_best")
    for name, r in res.get("steps", {}).items():
        w = r.get("bytes_written")
        moved = w or r.get("bytes_read")
        # a failed step's files may exist at their planned size without their data: no rate for it
        rate = moved / r["durable_s"] if moved and r.get("durable_s") and r.get("rc") == 0 else None
        pct = f"{100 * rate / best:.0f}%" if rate and best and not name.startswith("disk-") else ""
        status = "" if r.get("rc") == 0 else (" (TIMEOUT)" if r.get("timed_out") else f" (FAILED rc={r.get('rc')})")
        lines.append(f"| {name}{status} | {r.get('wall_s', 0):.1f} | {r.get('durable_s', 0):.1f} | {_gb(w)} | "
                     f"{'' if rate is None else f'{rate / GB:.2f}'} | {pct} | {_gib(r.get('peak_rss_bytes'))} | "
                     f"{_gib(r.get('peak_tree_rss_anon_bytes'))} | {_gb(r.get('peak_extra_disk_bytes'))} | "
                     f"{_gb(r.get('peak_extra_disk_fs_bytes'))} | "
                     f"{'warm' if r.get('prewarmed_bytes') else 'cold' if r.get('cold_cache') else ''} | "
                     f"{_gb(r.get('disk_read_bytes'))} | {_gb(r.get('disk_write_bytes'))} |")
    timed = {n: r["ckpttool_report"]["timing"] for n, r in res.get("steps", {}).items()
             if r.get("ckpttool_report", {}).get("timing")}
    if timed:
        lines += ["", "Where ckpttool's time went (`--json` timing: wall seconds per phase; seconds summed over threads "
                      "per activity):"]
        for n, t in timed.items():
            start = res["steps"][n]["wall_s"] - t["phases_s"].get("total", 0)
            lines.append(f"- {n}: process start-up (interpreter, imports) {start:.1f}; phases "
                         + ", ".join(f"{k} {v:.1f}" for k, v in t["phases_s"].items())
                         + "; threads " + ", ".join(f"{k} {v:.1f}" for k, v in t["thread_s"].items())
                         + "".join(f"; {k} {v}" for k, v in t.get("counts", {}).items()))
    series = {n: r["disk_gbs_per_second"] for n, r in res.get("steps", {}).items()
              if r.get("disk_gbs_per_second") and not n.startswith("disk-")}
    if series:
        lines += ["", "Disk rates per second of each command (GB/s read/written, from /proc/diskstats):"]
        lines += [f"- {n}: " + " ".join(f"{r:g}/{w:g}" for r, w in v) for n, v in series.items()]
    disk = res.get("disk")
    if disk:
        lines += ["", "Disk (GB/s): " + ", ".join(f"{k} {v / GB:.2f}" for k, v in disk.items() if k != "bytes")
                  + f" (over {disk['bytes'] / GB:.1f} GB; read is cold; write_mt is 8 threads with an fdatasync per GiB; "
                    "read_write_* is a cold read and a write at the same time; copy is dd from a source file)"]
    k = res.get("kernel")
    if k:
        lines += ["", "Dequant kernel, FP8 [7168, 18432] -> BF16 (bytes read + written / time):"]
        if "ckpttool" in k:
            c = k["ckpttool"]
            peak = k.get("peak_bytes_per_s")
            lines.append(f"- ckpttool Triton on {k.get('device')}: {c['bytes_per_s'] / GB:.0f} GB/s"
                         + (f" = {100 * c['fraction_of_peak']:.0f}% of {peak / 1e12:.2f} TB/s peak ({k.get('peak_source')})"
                            if peak else "")
                         + f", {100 * c['fraction_of_d2d_copy']:.0f}% of a measured device copy "
                           f"({k['d2d_copy_bytes_per_s'] / GB:.0f} GB/s); bit-identical to CPU: {c.get('bit_identical_to_cpu')}")
        if "reference" in k and "bytes_per_s" in k["reference"]:
            r = k["reference"]
            lines.append(f"- reference kernel.weight_dequant: {r['bytes_per_s'] / GB:.0f} GB/s; "
                         f"bit-identical to ckpttool: {r.get('bit_identical_to_ckpttool')}")
        if "cpu" in k:
            lines.append(f"- ckpttool CPU path ({k.get('cpu_threads')} threads): {k['cpu']['gb_per_s']:.2f} GB/s")
        if k.get("cuda", {}).get("skipped"):
            lines.append(f"- CUDA kernel not measured: {k['cuda']['skipped']}")
    flat = res.get("flat")
    if flat and flat.get("runs"):
        lines += ["", f"Memory flatness (`convert --max-memory {flat['max_memory']}`): " + "; ".join(
            f"{r['src_bytes'] / GB:.2f} GB input -> peak RSS {r['peak_rss_bytes'] / GiB:.2f} GiB "
            f"(anon {r['peak_tree_rss_anon_bytes'] / GiB:.2f}), {r['durable_s']:.1f}s" for r in flat["runs"])]
    if res.get("checks"):
        lines += ["", "Bit-exact checks (every tensor's bytes hashed):"]
        for name, c in res["checks"].items():
            detail = "" if c["identical"] else (f": {c['n_differ']} differ (e.g. {c['differ'][:2]}), "
                                               f"{c['n_only_in_first']} only in first, {c['n_only_in_second']} only in second")
            lines.append(f"- {name}: {'IDENTICAL' if c['identical'] else 'DIFFERENT'} ({c['tensors']} tensors){detail}")
    if res.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in res["skipped"].items())]
    if res.get("summary"):
        lines += ["", "Summary: " + ", ".join(f"{k} = {v}" for k, v in res["summary"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=Path, required=True, help="FP8 HF checkpoint (bench/make_synthetic.py output)")
    p.add_argument("--out", type=Path, required=True, help="where results.json and results.md go (keep it small)")
    p.add_argument("--work", type=Path, help="scratch dir for outputs, on the filesystem to measure "
                                            "(default: ckpttool-bench-work beside --src)")
    p.add_argument("--steps", default=",".join(DEFAULT_STEPS),
                   help=f"comma-separated, run in this order; from {','.join(ALL_STEPS)} (default without hybrid)")
    p.add_argument("--skip-reference", action="store_true", help="drop the reference step")
    p.add_argument("--seeds", help="dir with the unmodified fp8_cast_bf16.py, kernel.py, convert.py "
                                   "(default: bench/_seeds, then ../shared/seeds/deepseek_v3_inference)")
    p.add_argument("--mp", type=int, default=8)
    p.add_argument("--convert-args", default="", help="extra arguments for ckpttool convert/dequant, e.g. '--workers 16'")
    p.add_argument("--flat-gen", action="append", metavar="ARGS",
                   help="make_synthetic arguments of a checkpoint the flat step generates, measures and deletes "
                        "(repeat), e.g. '--layers 1 --experts 16'")
    p.add_argument("--flat-src", action="append", help="existing checkpoint for the flat step, after the generated "
                                                       "ones (repeat; with neither option: --src)")
    p.add_argument("--flat-max-memory", default="1GiB")
    p.add_argument("--disk-bytes", type=int, help="bytes for the disk test (default: the BF16 output size)")
    p.add_argument("--budget", type=float, default=0, help="seconds for the whole run; later steps are skipped and "
                                                          "a running command is killed when it is spent (0: none)")
    p.add_argument("--min-step-s", type=float, default=20, help="skip a step when fewer seconds than this are left")
    p.add_argument("--python", default=sys.executable, help="interpreter for ckpttool and the reference scripts")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false")
    p.add_argument("--warm-input", action="store_true",
                   help="after dropping the cache, read each command's input into it before timing (for both "
                        "ckpttool and the reference): the disk then only writes, as with input on another device")
    p.add_argument("--no-compare", dest="compare", action="store_false", help="skip the bit-exact output checks")
    p.add_argument("--keep-outputs", action="store_true", help="keep converted outputs and logs in --work")
    p.add_argument("--kernel-cpu", action="store_true", help="also time the CPU dequant path in the kernel step")
    args = p.parse_args(argv)
    args.steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in args.steps if s not in ALL_STEPS]
    if bad:
        p.error(f"unknown steps {bad}; choose from {ALL_STEPS}")
    if args.skip_reference:
        args.steps = [s for s in args.steps if s != "reference"]
    args.hybrid_input_from_dequant = True
    res = Bench(args).run()
    print()
    print(render_markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
