"""Dequant on a CUDA device, overlapped: one stream and pinned staging buffers per worker thread.

A worker reads its rows straight into its pinned buffer, copies them to the GPU and runs the kernel
on its own stream, and copies the result back into the same buffer (the stream orders the copies),
which it then pwrites; while it waits on its stream, other workers' copies and kernels run. Pinned
memory lets the copies run at link speed without the driver's pageable bounce; one buffer per worker
keeps it to workers x chunk bytes.

Start-up runs on a thread of its own: importing torch (4-6 s on the benchmark machine, most of a
small conversion's wall time), creating the CUDA context and loading or compiling the Triton
kernels (1.5-2.5 s on an H200). Until it is done, workers transform on the CPU with numpy instead.
Both devices give the same bits (tests/test_convert.py checks it), so which chunks took which path
never shows in the output. With `--device auto`, a machine whose torch sees no CUDA device simply
stays on the CPU.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ckpttool.dtypes import CARRIERS, torch_dtype
from ckpttool.errors import InputError
from ckpttool.execute.device import no_cuda
from ckpttool.execute.osutil import release_free_memory
from ckpttool.formats import Chunk, QuantFormat
from ckpttool.kernels.fp8_cpu import NaNCodes
from ckpttool.timing import Timings

_FIX = "install Triton for your CUDA torch (pip install 'ckpttool[triton]'), or pass --device cpu (the same bits)"


class CudaTransforms:
    def __init__(self, device: str, transforms: list[QuantFormat], timings: Timings | None = None):
        """device: "cuda[:N]" (no CUDA is an error) or "auto" (no CUDA: stay on the CPU)."""
        self.device_name = device
        self.device = None  # a torch.device, once torch is imported
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.unavailable = False
        self.timings = timings or Timings()
        self.torch = None
        self._lock = threading.Lock()
        self._trimmed = False
        self._local = threading.local()
        self._thread = threading.Thread(target=self._start, args=(transforms,), name="ckpttool-cuda-start",
                                        daemon=True)
        self._thread.start()

    def _start(self, transforms: list[QuantFormat]) -> None:
        t0 = time.perf_counter()
        try:
            import torch

            if not torch.cuda.is_available():
                if self.device_name == "auto":
                    self.unavailable = True
                    return
                raise no_cuda()
            device = torch.device("cuda" if self.device_name == "auto" else self.device_name)
            with torch.cuda.device(device):
                for t in transforms:  # a tiny input: creates the context, loads/compiles the kernel
                    t.cuda(t.example(device), torch.bfloat16)
                torch.cuda.synchronize(device)
            self.torch, self.device = torch, device
        except BaseException as exc:  # noqa: BLE001 - raised by the first chunk that needs the GPU
            self.error = exc
        finally:
            self.timings.add("cuda_start", time.perf_counter() - t0)
            self.ready.set()

    def wait(self) -> None:
        """Block until start-up is over (tests use this to force the GPU path)."""
        self.ready.wait()

    @property
    def on_gpu(self) -> bool:
        if not self.ready.is_set() or self.unavailable:
            return False
        if self.error is not None:
            if isinstance(self.error, InputError):
                raise self.error
            raise InputError(f"CUDA dequant could not start: {type(self.error).__name__}: {self.error}",
                             fix=_FIX) from self.error
        if not self._trimmed:  # once: the CPU chunks' freed temporaries go back before pinned memory comes
            with self._lock:
                if not self._trimmed:
                    self._trimmed = True
                    release_free_memory()
        return True

    def staging(self, nbytes: int) -> np.ndarray | None:
        """This thread's pinned buffer, at least nbytes (size it for the chunk's input and output
        both: the result is copied back over the input), or None while on the CPU."""
        if not self.on_gpu:
            return None
        return self._buffer(nbytes)

    def apply(self, transform: QuantFormat, chunk: Chunk, out_dtype: str) -> np.ndarray:
        """`transform` on a chunk (numpy rows and the side rows they need): on the GPU once it has started,
        else on the CPU. Returns numpy rows in out_dtype's carrier."""
        if not self.on_gpu:
            self.timings.count("chunks_on_cpu_while_cuda_started" if not self.unavailable else "chunks_on_cpu")
            return transform.cpu(chunk, out_dtype, None)
        self.timings.count("chunks_on_gpu")
        torch = self.torch
        stream = self._stream()

        def upload(a: np.ndarray, dtype: str):
            return torch.from_numpy(a).view(torch_dtype(dtype)).to(self.device, non_blocking=True)

        with torch.cuda.stream(stream):
            on_gpu = Chunk(upload(chunk.values, chunk.dtype), chunk.dtype,
                           {role: upload(a, chunk.side_dtypes[role]) for role, a in chunk.sides.items()},
                           chunk.side_dtypes, chunk.global_scale)
            y, first_bad = transform.cuda(on_gpu, torch_dtype(out_dtype))
            nbytes = y.numel() * y.element_size()
            if self._size() < nbytes:
                stream.synchronize()  # x may live in the buffer being replaced
            # the same stream orders this copy after the upload of x: the result may overwrite it
            buf = self._buffer(nbytes)
            torch.from_numpy(buf).view(y.dtype).reshape(y.shape).copy_(y, non_blocking=True)
            flag = self._flag()
            if first_bad is not None:
                flag.copy_(first_bad.cell, non_blocking=True)  # rides on the sync below: no wait of its own
            stream.synchronize()  # the rows are in host memory; the caller writes them before its next chunk
            # decoded on the call's own device and stream: a cell a later call took runs the kernel again there
            if first_bad is not None and (row := first_bad.decode(int(flag[0]))) is not None:
                raise NaNCodes(row)  # the executor names the file, the tensor and the tensor's row
        carrier = CARRIERS[out_dtype]  # a quantize row's leaves (scales, codes, shapes) come in their own dtypes:
        if carrier.itemsize != y.element_size():  # their bytes, as unsigned integers of that size
            carrier = CARRIERS[f"U{8 * y.element_size()}"]
        return buf.view(carrier).reshape(tuple(y.shape))

    def _flag(self):
        """This thread's pinned int64 for a kernel's first-bad-row cell (kernels/nan_flag.py)."""
        flag = getattr(self._local, "flag", None)
        if flag is None:
            flag = self._local.flag = self.torch.empty(1, dtype=self.torch.int64, pin_memory=True)
        return flag

    def _stream(self):
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = self.torch.cuda.Stream(self.device)
        return stream

    def _size(self) -> int:
        buf = getattr(self._local, "buffer", None)
        return 0 if buf is None else buf.numel()

    def _buffer(self, nbytes: int) -> np.ndarray:
        """This thread's pinned uint8 buffer, grown as needed (a chunk's size is bounded, so it
        settles at one size: one buffer per worker is all the pinned memory a run holds)."""
        if self._size() < nbytes:
            self._local.buffer = self.torch.empty(max(nbytes, 1), dtype=self.torch.uint8, pin_memory=True)
        return self._local.buffer.numpy()[:nbytes]
