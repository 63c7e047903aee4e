"""Transforms on a CUDA device, overlapped: one stream and pinned staging buffers per worker thread.

A worker reads its rows straight into its pinned buffer, copies them to the GPU and runs the kernel
on its own stream, and copies the result back into the same buffer (the stream orders the copies),
which it then pwrites; while it waits on its stream, other workers' copies and kernels run. Pinned
memory lets the copies run at link speed without the driver's pageable bounce; one buffer per worker
keeps it to workers x chunk bytes.

CUDA start-up (the context, loading or compiling the Triton kernels: 1.5-2.5 s on an H200) runs on
a thread of its own. Until it is done, workers transform on the CPU instead. The kernels guarantee
the same bits on either device (tests/test_convert.py checks it), so which chunks took which path
never shows in the output.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ckpttool.errors import InputError
from ckpttool.osutil import release_free_memory
from ckpttool.timing import Timings
from ckpttool.transforms import Transform


class CudaTransforms:
    def __init__(self, device: torch.device, transforms: list[Transform], timings: Timings | None = None):
        self.device = device
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.timings = timings or Timings()
        self._lock = threading.Lock()
        self._trimmed = False
        self._local = threading.local()
        self._thread = threading.Thread(target=self._start, args=(transforms,), name="ckpttool-cuda-start",
                                        daemon=True)
        self._thread.start()

    def _start(self, transforms: list[Transform]) -> None:
        try:
            with torch.cuda.device(self.device):
                for t in transforms:  # a tiny input: creates the context, loads/compiles the kernel
                    x, scale = t.example(self.device)
                    t.apply(x, scale, torch.bfloat16)
                torch.cuda.synchronize(self.device)
        except BaseException as exc:  # noqa: BLE001 - raised by the first chunk that needs the GPU
            self.error = exc
        finally:
            self.ready.set()

    def wait(self) -> None:
        """Block until start-up is over (tests use this to force the GPU path)."""
        self.ready.wait()

    @property
    def on_gpu(self) -> bool:
        if not self.ready.is_set():
            return False
        if self.error is not None:
            raise InputError(f"CUDA dequant could not start: {type(self.error).__name__}: {self.error}",
                             fix="install Triton for your CUDA torch (pip install -e '.[gpu]'), or pass "
                                 "--device cpu (the same bits)") from self.error
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

    def apply(self, transform: Transform, x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if not self.on_gpu:
            self.timings.count("chunks_on_cpu_while_cuda_started")
            return transform.apply(x, scale, out_dtype)
        self.timings.count("chunks_on_gpu")
        stream = self._stream()
        with torch.cuda.stream(stream):
            y = transform.apply(x.to(self.device, non_blocking=True), scale.to(self.device, non_blocking=True),
                                out_dtype)
            nbytes = y.numel() * y.element_size()
            if self._size() < nbytes:
                stream.synchronize()  # x may live in the buffer being replaced
            # the same stream orders this copy after the upload of x: the result may overwrite it
            host = torch.from_numpy(self._buffer(nbytes)).view(y.dtype).reshape(y.shape)
            host.copy_(y, non_blocking=True)
            stream.synchronize()  # the rows are in host memory; the caller writes them before its next chunk
        return host

    def _stream(self) -> torch.cuda.Stream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        return stream

    def _size(self) -> int:
        buf = getattr(self._local, "buffer", None)
        return 0 if buf is None else buf.numel()

    def _buffer(self, nbytes: int) -> np.ndarray:
        """This thread's pinned uint8 buffer, grown as needed (a chunk's size is bounded, so it
        settles at one size: one buffer per worker is all the pinned memory a run holds)."""
        if self._size() < nbytes:
            self._local.buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        return self._local.buffer.numpy()[:nbytes]
