"""The CUDA kernels' record of the first row holding a NaN (kernels/nan_flag.py): no fill launched per
call, so each call's cell may hold an older call's record (read as "none") or, SLOTS calls later, a newer
one's (then the kernel runs again). Run on the GPU, and through Triton's interpreter on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_CHECK = """
import torch
from ckpttool.kernels import fp8_triton, nan_flag, scaled_triton
device = "cuda" if torch.cuda.is_available() else "cpu"


def up_to(slot):  # claim cells until the next call's is `slot`
    while (nan_flag.claim(torch.device(device), lambda: None).epoch + 1) % nan_flag.SLOTS != slot:
        pass


def read_alone(first_bad):  # its row, read from its cell alone: the data is never asked
    def asked():
        raise AssertionError("the data was asked")
    first_bad.recheck = asked
    return first_bad.row()


def cells_share(first, later):
    assert later.slot == first.slot
    assert int(first.cell.item()) >> 32 == later.epoch  # the cell now holds the later call's record


def fp8(*bad):
    w = torch.zeros(384, 300, dtype=torch.uint8)
    for r, c, code in bad:
        w[r, c] = code
    w = w.view(torch.float8_e4m3fn)
    if device == "cpu":  # Triton's interpreter reads 0xFF as e4m3's -480, not e4m3fn's NaN: the same
        w = w.float()    # kernel fed float32, which holds NaN where the codes do
    return fp8_triton.dequant(w.to(device), torch.ones(3, 3, device=device), torch.bfloat16, 128)[1]


def int4(*bad):
    scale = torch.ones(64, 8, dtype=torch.bfloat16)
    for r, g in bad:
        scale[r, g] = float("nan")
    packed = torch.zeros(64, 32, dtype=torch.int32)  # every value -8: times a NaN scale, NaN
    return scaled_triton.dequant_int4(packed.to(device), scale.to(device), torch.bfloat16)[1]


for call, two_bad, one_bad, other_bad in (
        (fp8, [(311, 299, 0x7F), (200, 3, 0xFF)], [(200, 3, 0xFF)], [(5, 0, 0x7F)]),
        (int4, [(51, 7), (41, 2)], [(41, 2)], [(3, 0)])):
    bad = call(*two_bad)
    clean = call()
    assert read_alone(clean) is None and read_alone(bad) == two_bad[1][0]
    # a later call with a NaN takes the cell before the first is read: the first runs again, on a cell of its own
    first = call(*one_bad)
    up_to(first.slot)
    later = call(*other_bad)
    cells_share(first, later)
    assert later.row() == other_bad[0][0] and first.row() == one_bad[0][0], (later.row(), first.row())
    # a clean call in a cell that still holds an older call's NaN reads None
    up_to(first.slot)
    clean = call()
    assert clean.slot == first.slot and read_alone(clean) is None
print("nan_flag ok")
"""


def _run(env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-c", _CHECK], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **env}, timeout=600)
    assert proc.returncode == 0 and "nan_flag ok" in proc.stdout, proc.stderr[-4000:]


def test_cells_in_the_interpreter():
    pytest.importorskip("triton")
    _run({"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.gpu
def test_cells_on_cuda():
    import torch

    assert torch.cuda.is_available(), "the gpu marker needs a CUDA device"
    _run({})
