"""O_DIRECT reader pool: aligned buffers, coalescing, checksums, on the real disk."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from moeshard.moe.errors import StoreError
from moeshard.moe.storage import io


@pytest.fixture
def data_file(tmp_path):
    """A 1 MiB file of random bytes under pytest's tmp dir (ext4 here, not tmpfs)."""
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)  # [1 MiB]
    path = tmp_path / "blob.bin"
    path.write_bytes(data.tobytes())
    return path, data


def test_aligned_buffer_is_page_aligned():
    buf = io.aligned_buffer(10_000)
    assert buf.ctypes.data % 4096 == 0
    assert buf.nbytes == 12288


def test_reads_use_o_direct_on_real_disk(data_file):
    path, _ = data_file
    fd, direct = io.open_direct(path)
    os.close(fd)
    assert direct, "the test directory should be on a disk that supports O_DIRECT"


def test_coalesced_reads_and_checksums(data_file):
    path, data = data_file
    nbytes = 3000  # not a multiple of 4096: each record occupies one aligned 4 KiB block
    offsets = [8192, 4096, 12288, 65536, 0]  # 0..12288 adjacent (one run), 65536 apart
    arena = io.aligned_buffer(len(offsets) * 4096)
    reqs = [
        io.ReadRequest(
            path,
            off,
            nbytes,
            arena[i * 4096 : (i + 1) * 4096],
            (0, i),
            zlib.crc32(data[off : off + nbytes].tobytes()),
        )
        for i, off in enumerate(offsets)
    ]
    pool = io.ReaderPool(depth=2)
    assert [len(r) for r in pool.plan(reqs)] == [4, 1]
    pool.read(reqs)
    for i, off in enumerate(offsets):
        assert np.array_equal(arena[i * 4096 : i * 4096 + nbytes], data[off : off + nbytes])
    assert pool.stats.reads == 2 and pool.stats.records == 5
    pool.close()


def test_checksum_mismatch_names_record(data_file):
    path, data = data_file
    buf = io.aligned_buffer(4096)
    pool = io.ReaderPool(depth=1)
    req = io.ReadRequest(path, 4096, 100, buf, (3, 7), 12345)
    with pytest.raises(StoreError, match=r"blob.bin.*expert 7 of layer 3"):
        pool.read([req])
    pool.close()


def test_buffered_fallback(data_file):
    path, data = data_file
    buf = io.aligned_buffer(4096)
    pool = io.ReaderPool(depth=1, direct=False)
    pool.read([io.ReadRequest(path, 0, 4096, buf)])
    assert np.array_equal(buf, data[:4096])
    pool.close()


def test_busy_throughput_counts_overlapping_reads_once():
    from moeshard.moe.storage.io import busy_throughput

    # two overlapping reads (0-1 s, 0.5-2 s), a gap, one more (3-4 s); one read before start
    timeline = [(-1.0, -0.5, 999), (0.0, 1.0, 100), (0.5, 2.0, 100), (3.0, 4.0, 100)]
    busy = busy_throughput(timeline, 0.0, 5.0)
    assert busy.reads == 3
    assert busy.share == pytest.approx(3.0 / 5.0)  # busy 0-2 and 3-4
    assert busy.gbps == pytest.approx(300 / 3.0 / 1e9)
    assert busy.in_flight == pytest.approx((1.0 + 1.5 + 1.0) / 3.0)
    assert busy_throughput(timeline, 10.0, 11.0).reads == 0
