# where a ckpttool process's start-up goes, cold (page cache dropped) and warm
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
drop; /usr/bin/time -f "cold import torch: %e s (user %U)" python3 -c "import torch"
/usr/bin/time -f "warm import torch: %e s (user %U)" python3 -c "import torch"
drop; /usr/bin/time -f "cold ckpttool --help: %e s" python3 -m ckpttool convert --help > /dev/null
/usr/bin/time -f "warm ckpttool --help: %e s" python3 -m ckpttool convert --help > /dev/null
python3 -X importtime -m ckpttool convert --help 2>&1 >/dev/null | awk -F'|' '{print $2, $3}' | sort -n | tail -30 | grep -v " torch\._\| torch\.[a-z_]*\.[a-z]" | tail -12
python3 - <<'PY'
import time
t = time.perf_counter(); import torch; t1 = time.perf_counter()
ok = torch.cuda.is_available(); t2 = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize(); t3 = time.perf_counter()
from ckpttool.kernels.fp8 import dequant_fp8_block
w = torch.zeros(256, 256, dtype=torch.float8_e4m3fn, device="cuda"); s = torch.ones(2, 2, device="cuda")
dequant_fp8_block(w, s); torch.cuda.synchronize(); t4 = time.perf_counter()
dequant_fp8_block(w, s); torch.cuda.synchronize(); t5 = time.perf_counter()
print(f"import torch {t1-t:.2f}s, cuda.is_available {t2-t1:.2f}s, context {t3-t2:.2f}s, first triton dequant {t4-t3:.2f}s, second {t5-t4:.4f}s")
PY
