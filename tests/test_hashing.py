"""The running hash (blake3, or sha256) equals the one-shot hash of the finished file, however the writes arrive."""

from __future__ import annotations

import hashlib
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from blake3 import blake3

from ckpttool.io.hashing import PrefixHasher


@pytest.mark.parametrize("offer", [False, True])
@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("seed", range(5))
def test_prefix_hasher_matches_hashlib_under_out_of_order_concurrent_writes(tmp_path, seed, algorithm, offer):
    """With offer, as Staging.pwrite does: each writer first offers its piece (hashed from memory where it
    extends the hashed prefix, perhaps after waiting for the hashing thread), then reports it written."""
    rng = random.Random(seed)
    size = rng.randrange(1, 3 << 20)
    data = rng.randbytes(size)
    cuts = sorted({0, size, *(rng.randrange(size) for _ in range(rng.randrange(1, 60)))})
    ranges = list(zip(cuts, cuts[1:]))
    head = ranges.pop(0)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    os.ftruncate(fd, size)
    os.pwrite(fd, data[head[0]:head[1]], 0)
    rng.shuffle(ranges)
    with ThreadPoolExecutor(3) as pool:
        hasher = PrefixHasher(path, size, pool, written_prefix=head[1], algorithm=algorithm)

        def write(r):
            os.pwrite(fd, data[r[0]:r[1]], r[0])
            if offer:
                hasher.offer(r[0], memoryview(data)[r[0]:r[1]])
            hasher.written(*r)

        list(ThreadPoolExecutor(4).map(write, ranges))
        want = hashlib.sha256(data) if algorithm == "sha256" else blake3(data)
        assert hasher.result() == want.hexdigest()
    os.close(fd)


def test_a_writer_at_the_written_prefix_waits_for_a_lagging_hash_and_hashes_its_own_piece(tmp_path):
    """The hashing thread is still to re-read [0, 1 MiB) when a writer lands [1 MiB, 2 MiB) right after
    it: the writer waits, then hashes its piece from memory, so nothing after the lag is re-read (a lag
    used to last the rest of the run). A piece past a gap in the written bytes is not waited for."""
    import threading

    data = random.Random(1).randbytes(3 << 20)
    path = tmp_path / "f"
    path.write_bytes(data[: 1 << 20] + bytes(2 << 20))
    fd = os.open(path, os.O_RDWR)
    hold = threading.Event()
    pool = ThreadPoolExecutor(1)
    pool.submit(hold.wait, 10)  # the hashing thread is busy elsewhere, so it lags
    try:
        hasher = PrefixHasher(path, len(data), pool)
        hasher.written(0, 1 << 20)
        assert not hasher.offer(2 << 20, data[2 << 20:])  # past a gap: re-read later, no wait
        os.pwrite(fd, data[1 << 20: 2 << 20], 1 << 20)
        offered = []
        writer = threading.Thread(target=lambda: offered.append(hasher.offer(1 << 20, data[1 << 20: 2 << 20])))
        writer.start()
        writer.join(0.2)
        waited = writer.is_alive()  # waiting for the hash to reach its piece
        hold.set()
        writer.join(5)
        assert waited and offered == [True]
        hasher.written(1 << 20, 2 << 20)
        os.pwrite(fd, data[2 << 20:], 2 << 20)
        hasher.written(2 << 20, 3 << 20)
        assert hasher.result() == blake3(data).hexdigest()
    finally:
        hold.set()
        pool.shutdown()
        os.close(fd)
