"""The running hash (blake3, or sha256) equals the one-shot hash of the finished file, however the writes arrive."""

from __future__ import annotations

import hashlib
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from blake3 import blake3

from ckpttool.io.hashing import PrefixHasher


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
@pytest.mark.parametrize("seed", range(5))
def test_prefix_hasher_matches_hashlib_under_out_of_order_concurrent_writes(tmp_path, seed, algorithm):
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
            hasher.written(*r)

        list(ThreadPoolExecutor(4).map(write, ranges))
        want = hashlib.sha256(data) if algorithm == "sha256" else blake3(data)
        assert hasher.result() == want.hexdigest()
    os.close(fd)
