"""The other ways a loader reads a file, through a real mount: each must return exactly the object's bytes.

- O_DIRECT `preadv`, large and from several threads at once: GPUDirect Storage's compatibility mode (cuFile
  without GDS falls back to O_DIRECT reads) and loaders that bypass the page cache. The kernel sends them as
  READs of up to max_read each, in parallel, at any offset; they must not be confused with a sequential
  reader's, nor short except at the end of the file.
- `sendfile` and `splice`: a file copied to a socket or a pipe (servers handing weights to another process;
  `shutil.copyfile` uses `sendfile`).
- mmap with `MADV_RANDOM` / `MADV_SEQUENTIAL`: the kernel then faults in single pages, 4 KiB READs in
  page order (both, on this kernel, for local files too), so thousands of small READs per file.
- `posix_fadvise(WILLNEED)` and `readahead(2)` before a read: read-ahead the kernel starts on its own.
The files are a safetensors model (model streaming runs beside the reader and pushes pages into the page
cache meanwhile) and a plain blob of the same size (READs only), neither a multiple of 4 KiB, over 1 MiB
chunks so that every read crosses chunk boundaries.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fsmount.testing.fault_proxy import FaultProxy
from fsmount.testing.models import write_model
from fsmount.testing.synthetic_dir import synthetic_range
from tests.helpers import (
    MiB,
    S3Server,
    bucket_with,
    drop_page_cache,
    mount_stats,
    mounted,
    mounted_via,
    new_bucket,
    random_bytes,
    sha,
    wait_for,
)

SIZE = 6 * MiB + 1234
ARGS = ("--chunk-size", "1M", "--metadata-ttl", "300")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    path = tmp_path_factory.mktemp("syscalls") / "model.safetensors"
    write_model(path, SIZE, seed=11)
    return {"m/model.safetensors": path.read_bytes(), "m/blob.bin": random_bytes(SIZE, seed=12)}


@pytest.fixture
def files(moto_server: S3Server, mountpoint: Path, sources: dict[str, bytes]) -> Iterator[dict[Path, bytes]]:
    bucket = bucket_with(moto_server, dict(sources))
    with mounted(moto_server, bucket, mountpoint, *ARGS):
        yield {mountpoint / key: data for key, data in sources.items()}


def each_cold(files: dict[Path, bytes], check: Callable[[Path, bytes], None]) -> None:
    for path, data in files.items():
        drop_page_cache(path)
        check(path, data)


def test_o_direct_reads_large_and_concurrent_are_exact(files: dict[Path, bytes]) -> None:
    def check(path: Path, data: bytes) -> None:
        rng = random.Random(path.name)
        n = len(data)
        ranges = [(rng.randrange(0, n // 4096) * 4096, rng.choice([4096, MiB, 3 * MiB + 4096, 5 * MiB]))
                  for _ in range(24)]
        ranges += [(0, n + MiB), (n // 4096 * 4096, MiB), (n - n % 4096 - 8192, 2 * MiB)]  # past the end
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            def read(r: tuple[int, int]) -> bytes:
                buf = mmap.mmap(-1, r[1])  # page-aligned, as O_DIRECT asks
                return bytes(buf[:os.preadv(fd, [buf], r[0])])

            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(read, ranges))
        finally:
            os.close(fd)
        for (offset, size), chunk in zip(ranges, got, strict=True):
            assert chunk == data[offset:offset + size], (path.name, offset, size, len(chunk))

    each_cold(files, check)


def test_sendfile_and_splice_copy_exact_bytes(files: dict[Path, bytes], tmp_path: Path) -> None:
    def check(path: Path, data: bytes) -> None:
        copy = tmp_path / f"{path.name}.copy"
        shutil.copyfile(path, copy)  # sendfile(2) on Linux
        assert copy.read_bytes() == data
        drop_page_cache(path)
        # To a socket, as a server would hand the file to a client.
        left, right = socket.socketpair()
        received: list[bytes] = []
        reader = threading.Thread(target=lambda: received.extend(iter_socket(right)), daemon=True)
        reader.start()
        with open(path, "rb") as f, left:
            offset = 0
            while offset < len(data):
                sent = os.sendfile(left.fileno(), f.fileno(), offset, len(data) - offset)
                assert sent > 0
                offset += sent
        reader.join(timeout=60)
        right.close()
        assert b"".join(received) == data
        drop_page_cache(path)
        # Through a pipe, in 64 KiB splices.
        r, w = os.pipe()
        out = bytearray()
        try:
            with open(path, "rb") as f:
                while moved := os.splice(f.fileno(), w, 1 << 16):
                    out += os.read(r, moved)
        finally:
            os.close(r)
            os.close(w)
        assert bytes(out) == data

    each_cold(files, check)


def iter_socket(sock: socket.socket) -> Iterator[bytes]:
    while block := sock.recv(1 << 20):
        yield block


@pytest.mark.parametrize("advice", ["MADV_RANDOM", "MADV_SEQUENTIAL"])
def test_mmap_with_access_advice_faults_page_by_page_and_is_exact(files: dict[Path, bytes], advice: str) -> None:
    def check(path: Path, data: bytes) -> None:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            m.madvise(getattr(mmap, advice))
            pages = list(range(0, len(data), mmap.PAGESIZE))
            if advice == "MADV_RANDOM":
                random.Random(advice).shuffle(pages)
            for offset in pages:
                assert m[offset:offset + mmap.PAGESIZE] == data[offset:offset + mmap.PAGESIZE], (path.name, offset)

    each_cold(files, check)


def test_read_ahead_hints_then_reads_are_exact(files: dict[Path, bytes]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)

    def check(path: Path, data: bytes) -> None:
        with open(path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            assert libc.readahead(f.fileno(), ctypes.c_longlong(0), ctypes.c_size_t(len(data))) == 0
            assert f.read() == data

    each_cold(files, check)


# -- read-ahead follows what is read, not how many READs came ----------------------------------------

BIG = 256 * MiB


@pytest.fixture(scope="module")
def big_bucket(moto_server: S3Server) -> str:
    return bucket_with(moto_server, {"big.bin": bytes(BIG)})


@pytest.fixture
def big_blob(moto_server: S3Server, big_bucket: str, mountpoint: Path) -> Iterator[Path]:
    """A 256 MiB file on a fresh mount at the default chunk size and read-ahead, nothing streamed, the file held
    in the daemon's memory whole if it were all fetched (so origin bytes count every chunk fetched)."""
    with mounted(moto_server, big_bucket, mountpoint, "--no-model-streaming", "--metadata-ttl", "300") as m:
        yield m.path / "big.bin"


def origin_bytes_once_idle(mountpoint: Path) -> int:
    """Origin bytes once no fetch is running or queued (read-ahead included)."""
    def idle() -> dict:
        s = mount_stats(mountpoint)
        return s if s["fetches_inflight"] == 0 else {}
    time.sleep(0.5)  # read-ahead is queued when the READ that asks for it arrives; let the queue start
    return wait_for("the fetches to end", idle, bool)["origin"]["bytes"]


def test_small_o_direct_reads_fetch_what_they_read_not_a_window(big_blob: Path) -> None:
    """Eight sequential 4 KiB O_DIRECT reads doubled the window on each READ, to 256 MiB: 32 KiB read, the
    whole file fetched. A stream is read ahead only once it has read one chunk."""
    buf = mmap.mmap(-1, 4096)
    fd = os.open(big_blob, os.O_RDONLY | os.O_DIRECT)
    try:
        for i in range(8):
            assert os.preadv(fd, [buf], i * 4096) == 4096
        assert origin_bytes_once_idle(big_blob.parent) == 8 * MiB  # the chunk read, nothing ahead
    finally:
        os.close(fd)


def test_random_mmap_touches_fetch_what_the_kernel_reads_around_them_not_the_file(big_blob: Path) -> None:
    """The kernel reads 16 MiB around each fault of a mapped file (the mount's read_ahead_kb), READs the
    daemon took for a sequential reader and read ahead of to 256 MiB: four touches fetched the whole file.
    Now a stream is read ahead only once it has read more than the kernel's window."""
    with open(big_blob, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        for touch in (20, 84, 148, 212):
            assert m[touch * MiB] == 0
        fetched = origin_bytes_once_idle(big_blob.parent)
    # Each read-around covers 16 MiB, 2-3 chunks of 8 MiB.
    assert fetched <= 4 * 24 * MiB, fetched / MiB


def test_a_reader_that_stops_early_is_not_fetched_far_past_where_it_stopped(big_blob: Path) -> None:
    """Once proven, a stream's window doubled on every READ, to 256 MiB in eight READs: a reader that stopped after
    24 MiB (a header and a few records of a large file) had the whole 256 MiB file fetched. The window grows only
    to twice what the stream has read: the kernel's own read-ahead (up to two windows of 16 MiB past the reader)
    included, at most 3 x 56 MiB."""
    with open(big_blob, "rb", buffering=0) as f:
        for _ in range(24):
            assert len(f.read(MiB)) == MiB
        fetched = origin_bytes_once_idle(big_blob.parent)
    assert fetched <= 3 * (24 + 2 * 16) * MiB, fetched / MiB  # 144 MiB measured, against 256


# -- past 4 GiB -------------------------------------------------------------------------------------

HUGE = 6 * 1024 * MiB + 12345  # real shards are 5-10 GB
MMAP_DIGESTS = """
import hashlib, mmap, sys
with open(sys.argv[1], "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    for offset in map(int, sys.argv[2:]):
        print(hashlib.sha256(m[offset:offset + 4096]).hexdigest())
"""


def test_a_file_past_4_gib_reads_exact_across_the_32_bit_boundaries(moto_server: S3Server, proxy: FaultProxy,
                                                                     mountpoint: Path, tmp_path: Path) -> None:
    """Offsets past 2^31 and 2^32 through pread, O_DIRECT and mmap, cold and again from an NVMe cache. The
    proxy serves the 6 GiB object itself, a range at a time."""
    bucket = new_bucket(moto_server)
    moto_server.client().put_object(Bucket=bucket, Key="big/", Body=b"")
    proxy.serve_directory(bucket, "big/", ["shard.bin"], size=HUGE)

    def want(offset: int, n: int) -> bytes:
        return synthetic_range(b"big/shard.bin", HUGE, offset, offset + n)

    cache = ("--cache-dir", str(tmp_path / "cache"))
    for run in ("cold", "warm"):
        with mounted_via(proxy, moto_server, bucket, mountpoint, "--no-model-streaming", "--metadata-ttl", "300",
                         *cache):
            path = mountpoint / "big" / "shard.bin"
            assert path.stat().st_size == HUGE
            with open(path, "rb", buffering=0) as f:
                for offset in (2**31 - 5, 2**31, 2**32 - 7, 2**32, 2**32 + 8 * MiB - 1, HUGE - 4096, HUGE - 1):
                    assert os.pread(f.fileno(), 4096, offset) == want(offset, 4096), (run, offset)
                assert os.pread(f.fileno(), 10, HUGE) == b""
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                buf = mmap.mmap(-1, 2 * MiB)
                assert os.preadv(fd, [buf], 2**32 - MiB) == 2 * MiB
                assert bytes(buf) == want(2**32 - MiB, 2 * MiB), run
            finally:
                os.close(fd)
            # mmap in another process: a page fault holds this one's GIL, which the proxy's threads need to answer.
            offsets = (2**32 + 12345, 5 * 2**30 + 1, HUGE - 4096)
            res = subprocess.run([sys.executable, "-c", MMAP_DIGESTS, str(path), *map(str, offsets)],
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, res.stderr
            assert res.stdout.split() == [sha(want(offset, 4096)) for offset in offsets], run
            if run == "warm":
                assert mount_stats(mountpoint)["origin"]["bytes"] == 0  # every chunk from the NVMe cache
