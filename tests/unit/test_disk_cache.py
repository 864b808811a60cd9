"""DiskCache: persistence, corruption handling, eviction, full/read-only disks, concurrency, maintenance.

Plain synchronous tests; the full-disk tests mount small tmpfs filesystems (root only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import random
import shutil
import stat
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from fsmount.data import ChunkId, cache_clear, cache_stats, cache_verify, disk_cache
from fsmount.data.cache_dir import (
    CHUNKS_DIR,
    SHARD_HEX_CHARS,
    CacheDirBusy,
    bytes_for_fraction,
    chunk_path,
    free_bytes,
)
from fsmount.data.chunk_file import ALIGN, round_up
from fsmount.data.disk_cache import DiskCache, default_min_free
from fsmount.data.identity import new_buffer
from tests.helpers import CORRUPT_WARNING, KiB, MiB, expects_warning, modelfs_env, random_bytes
from tests.helpers import WRITE_FAILED_WARNING as WRITE_WARNING
from tests.helpers import tmpfs as mount_tmpfs

BIG = 1 << 40  # max_bytes / free-space floor that never binds


def chunk_file_of(cache: DiskCache, chunk: ChunkId) -> str:
    """Where `cache` keeps (or would keep) the file of `chunk`."""
    return chunk_path(os.path.join(cache.root, CHUNKS_DIR), chunk.digest())


def chunk_id(index: int, etag: str = "etag-1", key: str = "models/m/model-00001.safetensors") -> ChunkId:
    return ChunkId(bucket="weights", key=key, etag=etag, chunk_size=64 * KiB, index=index)


def payload(chunk: ChunkId, size: int = 64 * KiB) -> bytes:
    return random.Random(chunk.digest()).randbytes(size)


def file_size_of(cache: DiskCache, chunk: ChunkId) -> int:
    return os.stat(chunk_file_of(cache, chunk)).st_size


def chunk_file_size(probe_root: Path, data_len: int) -> int:
    """On-disk size (header + data) of a chunk_id() chunk, measured on a real file."""
    with DiskCache(probe_root, BIG, min_free_bytes=0) as probe:
        probe.put(chunk_id(0), payload(chunk_id(0), data_len))
        return file_size_of(probe, chunk_id(0))


def disk_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "chunks").rglob("*") if p.is_file())


def warnings_from_cache(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "fsmount.data.disk_cache" and r.levelno >= logging.WARNING]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Callable[[str], contextlib.AbstractContextManager[Path]]:
    """Factory: `with tmpfs("size=4m") as d:` mounts a fresh tmpfs at d and always unmounts it."""
    if os.geteuid() != 0:
        pytest.skip("mounting tmpfs needs root")
    return lambda options: mount_tmpfs(tmp_path / f"tmpfs{len(list(tmp_path.iterdir()))}", options)


# -- basics and persistence -------------------------------------------------------------------------


def test_put_get_contains_and_persistence_across_reopen(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    chunks = [chunk_id(i) for i in range(5)]
    with DiskCache(root, BIG, min_free_bytes=0) as cache:
        assert cache.get(chunks[0]) is None
        assert not cache.contains(chunks[0])
        for c in chunks:
            cache.put(c, payload(c))
        assert all(cache.contains(c) for c in chunks)
        assert cache.get(chunks[3]) == payload(chunks[3])
        used = cache.stats.bytes_used
        assert cache.stats.chunks == 5 and cache.stats.writes == 5
        assert used == sum(p.stat().st_size for p in disk_files(root))
        cache.put(chunks[0], payload(chunks[0]))  # already there: not rewritten
        assert cache.stats.writes == 5

    assert cache.get(chunks[0]) is None and not cache.contains(chunks[0])  # closed: misses, no raise
    cache.put(chunk_id(99), b"x")  # closed: a no-op
    assert not Path(chunk_file_of(cache, chunk_id(99))).exists()

    with DiskCache(root, BIG, min_free_bytes=0) as again:
        assert again.stats.chunks == 5 and again.stats.bytes_used == used
        for c in chunks:
            assert again.get(c) == payload(c)
        assert again.get(chunk_id(0, etag="etag-2")) is None  # other version of the object: a miss
        assert again.stats.corrupt == 0


def test_empty_chunk_and_odd_key_text_round_trip(tmp_path: Path) -> None:
    odd = ChunkId("b", "dir/ünïcode \udcff key", '"etag-with-quotes"', 8 * MiB, 12345)
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        cache.put(odd, b"")
        cache.put(chunk_id(1), b"1")
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        assert cache.get(odd) == b""
        assert cache.get(chunk_id(1)) == b"1"


def test_a_hit_on_a_stalled_disk_returns_its_bytes_without_waiting_for_the_stamp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit rewrote the chunk file's mtime in the read itself: on a filesystem frozen for a snapshot (fsfreeze) that
    utime blocked, so a chunk read whole was never returned, and every READ of a cached chunk failed at
    --read-timeout. The stamp is written from a thread of its own now."""
    import fsmount.data.disk_cache as disk_cache

    frozen = threading.Event()
    stamped: list[str] = []

    def stalled_utime(path: str, *args: object, **kwargs: object) -> None:
        frozen.wait(30)
        stamped.append(path)

    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        chunks = [chunk_id(i) for i in range(3)]
        for c in chunks:
            cache.put(c, payload(c))
            os.utime(chunk_file_of(cache, c), ns=(10**18, 10**18))  # stale stamps: every hit restamps
        monkeypatch.setattr(disk_cache.os, "utime", stalled_utime)
        began = time.monotonic()
        for c in chunks:
            assert cache.get(c) == payload(c)
        assert time.monotonic() - began < 5 and not stamped
        frozen.set()  # thawed: the stamps are written
        deadline = time.monotonic() + 10
        while len(stamped) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert stamped == [chunk_file_of(cache, c) for c in chunks]


def test_a_get_behind_a_rename_stuck_on_a_stalled_disk_is_a_miss(tmp_path: Path) -> None:
    """Renames and unlinks run under the cache lock; on a frozen filesystem one blocks, and every get waited for
    the lock behind it (a READ of a chunk in the cache failed at --read-timeout). A get waits LOCK_WAIT_S, then
    is a miss the origin serves."""
    import fsmount.data.disk_cache as disk_cache

    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), payload(chunk_id(1)))
        with cache._lock:  # what a put's rename on a frozen filesystem does to the lock
            began = time.monotonic()
            got: list = []
            getter = threading.Thread(target=lambda: got.append(cache.get(chunk_id(1))), daemon=True)
            getter.start()
            getter.join(10)
            assert got == [None]
            assert disk_cache.LOCK_WAIT_S <= time.monotonic() - began < disk_cache.LOCK_WAIT_S + 2
        assert cache.stats.lock_timeouts == 1
        assert cache.get(chunk_id(1)) == payload(chunk_id(1))


def test_hit_refreshes_persisted_lru_stamp_and_reopen_evicts_by_it(tmp_path: Path) -> None:
    chunks = [chunk_id(i) for i in range(4)]
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        for c in chunks:
            cache.put(c, payload(c))
        size = file_size_of(cache, chunks[0])
        hour_ago = time.time_ns() - 3600 * 10**9
        for age, c in enumerate(chunks):  # persisted order: chunk 0 oldest ... chunk 3 newest
            os.utime(chunk_file_of(cache, c), ns=(hour_ago + age * 10**9,) * 2)
        assert cache.get(chunks[0]) == payload(chunks[0])  # a hit stamps "now" on chunk 0 (from a thread)
        deadline = time.monotonic() + 10
        while os.stat(chunk_file_of(cache, chunks[0])).st_mtime_ns < time.time_ns() - 60 * 10**9:
            assert time.monotonic() < deadline, "the hit's stamp was not written"
            time.sleep(0.01)

    with DiskCache(tmp_path, 4 * size, min_free_bytes=0) as cache:
        cache.put(chunk_id(10), payload(chunk_id(10)))  # full: evicts the least recent, chunk 1
        assert [cache.contains(c) for c in chunks] == [True, False, True, True]
        assert cache.stats.evictions == 1

    with DiskCache(tmp_path, 2 * size, min_free_bytes=0) as cache:  # limit shrank: evicts at open
        assert cache.stats.chunks == 2 and cache.stats.bytes_used == 2 * size
        assert [cache.contains(c) for c in (chunks[0], chunk_id(10))] == [True, True]
        assert len(disk_files(tmp_path)) == 2


def test_chunks_stamped_while_the_clock_was_ahead_are_evicted_first_unless_hit_since(tmp_path: Path) -> None:
    """A node booted with its clock a year ahead, then stepped back (chrony): the chunks written before the step
    bore stamps a year ahead. A hit never restamped them (they were not older than a minute) and each reopen put
    them at the recent end, evicted last, for a year; the chunks the node used since went first."""
    chunks = [chunk_id(i) for i in range(4)]
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        for c in chunks:
            cache.put(c, payload(c))
        size = file_size_of(cache, chunks[0])
        year_ahead, hour_ago = time.time_ns() + 365 * 86400 * 10**9, time.time_ns() - 3600 * 10**9
        for c, stamp in zip(chunks, [year_ahead, year_ahead + 10**9, hour_ago, hour_ago + 10**9], strict=True):
            os.utime(chunk_file_of(cache, c), ns=(stamp, stamp))  # chunks 0 and 1 written before the step back
        assert cache.get(chunks[0]) == payload(chunks[0])  # used since the step: stamped "now" (from a thread)
        deadline = time.monotonic() + 10
        while os.stat(chunk_file_of(cache, chunks[0])).st_mtime_ns > time.time_ns() + 60 * 10**9:
            assert time.monotonic() < deadline, "the hit's stamp was not written"
            time.sleep(0.01)

    with DiskCache(tmp_path, 4 * size, min_free_bytes=0) as cache:
        cache.put(chunk_id(10), payload(chunk_id(10)))  # full: evicts the least recent, chunk 1
        assert [cache.contains(c) for c in chunks] == [True, False, True, True]


# -- corruption -------------------------------------------------------------------------------------


def flip_last_byte(path: Path, _other: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))


def truncate(path: Path, _other: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def wrong_magic(path: Path, _other: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[0:8] = b"NOTMAGIC"
    path.write_bytes(bytes(raw))


def flip_key_byte(path: Path, _other: Path) -> None:
    raw = bytearray(path.read_bytes())
    pos = raw.index(b"models/")
    raw[pos] ^= 0x20
    path.write_bytes(bytes(raw))


def trailing_garbage(path: Path, _other: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\0")


def other_etags_file_at_this_path(path: Path, other: Path) -> None:
    shutil.copyfile(other, path)  # a valid chunk file, for the same key/index but another etag


def empty_file(path: Path, _other: Path) -> None:
    os.truncate(path, 0)


def zeroed_page(path: Path, _other: Path) -> None:
    """What a crash can leave of a file written without fsync: right size, one page of zeros."""
    raw = bytearray(path.read_bytes())
    raw[-20000 : -20000 + 4096] = bytes(4096)
    path.write_bytes(bytes(raw))


def key_length_past_the_block(path: Path, _other: Path) -> None:
    """The header's key length says the data starts after the first block (the size does not agree)."""
    raw = bytearray(path.read_bytes())
    struct.pack_into("<I", raw, 16, 5000)  # magic(8) version(2) reserved(2) len(bucket)(4), then len(key)
    path.write_bytes(bytes(raw))


def flip_padding_byte(path: Path, _other: Path) -> None:
    """Between header and data: harmless to the data, but the file is not what the cache wrote."""
    raw = bytearray(path.read_bytes())
    raw[ALIGN - 1] ^= 0x01
    path.write_bytes(bytes(raw))


@expects_warning(CORRUPT_WARNING)
@pytest.mark.parametrize(
    "damage",
    [
        flip_last_byte,
        flip_padding_byte,
        truncate,
        wrong_magic,
        flip_key_byte,
        trailing_garbage,
        other_etags_file_at_this_path,
        empty_file,
        zeroed_page,
        key_length_past_the_block,
    ],
)
@pytest.mark.parametrize("into", ["new-bytes", "engine-buffer"])  # the engine's buffers are read with O_DIRECT
def test_corrupt_file_is_a_counted_miss_and_deleted(tmp_path: Path, damage, caplog, allowed_logs, into: str) -> None:
    wanted, other_version = chunk_id(7), chunk_id(7, etag="etag-OTHER")
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        cache.put(wanted, payload(wanted))
        cache.put(other_version, payload(other_version))
        path, other_path = Path(chunk_file_of(cache, wanted)), Path(chunk_file_of(cache, other_version))
        assert path != other_path
        damage(path, other_path)

        assert cache.get(wanted, mmap.mmap(-1, len(payload(wanted))) if into == "engine-buffer" else None) is None
        assert cache.stats.corrupt == 1
        assert not path.exists()
        assert not cache.contains(wanted)
        assert cache.stats.chunks == 1 and cache.stats.bytes_used == other_path.stat().st_size
        assert cache.get(other_version) == payload(other_version)  # the neighbour is untouched
        assert len(warnings_from_cache(caplog)) == 1

        cache.put(wanted, payload(wanted))  # and the chunk can be cached again
        assert cache.get(wanted) == payload(wanted)


@expects_warning(CORRUPT_WARNING)
def test_only_first_corrupt_file_warns(tmp_path: Path, caplog, allowed_logs) -> None:
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        for i in range(3):
            cache.put(chunk_id(i), payload(chunk_id(i)))
            wrong_magic(Path(chunk_file_of(cache, chunk_id(i))), tmp_path)
        assert [cache.get(chunk_id(i)) for i in range(3)] == [None] * 3
        assert cache.stats.corrupt == 3
        assert len(warnings_from_cache(caplog)) == 1


def version_2_file(chunk: ChunkId, data: bytes) -> bytes:
    """A chunk file as format version 2 wrote it: the same header layout with a zlib CRC-32 of the data."""
    text = [t.encode() for t in (chunk.bucket, chunk.key, chunk.etag)]
    prefix = struct.pack(
        "<8sHHIIIQQQI", b"MFSCHUNK", 2, 0, *map(len, text), chunk.chunk_size, chunk.index, len(data),
        zlib.crc32(data),
    )
    return b"".join([prefix, *text, data])


def test_files_of_the_previous_format_version_are_dropped_and_refetched_not_called_corrupt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An upgraded node's cache is all of the old format: each file read was "dropped corrupt chunk file" (a
    warning) and counted in `corrupt`, so an alert on corrupt chunks fired on every upgraded node, and
    `modelfs cache verify` called them corrupt and exited 1. They are counted apart, told once at info level."""
    caplog.set_level(logging.INFO, logger="fsmount.data.disk_cache")
    wanted, also = chunk_id(3), chunk_id(4)
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        paths = [Path(chunk_file_of(cache, c)) for c in (wanted, also)]
    for path, chunk in zip(paths, (wanted, also), strict=True):
        path.write_bytes(version_2_file(chunk, payload(chunk)))  # whole and valid, as the old version wrote it
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        assert cache.contains(wanted)  # the index is built from names and sizes alone
        assert cache.get(wanted) is None and cache.get(also) is None
        assert (cache.stats.corrupt, cache.stats.other_format) == (0, 2)
        assert not paths[0].exists() and not cache.contains(wanted)
        told = [r for r in caplog.records if "another version of modelfs" in r.getMessage()]
        assert [r.levelname for r in told] == ["INFO"] and "format version 2.0, expected 3.0" in told[0].getMessage()
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        cache.put(wanted, payload(wanted))  # refetched: written in the current format
        assert cache.get(wanted) == payload(wanted)
    paths[1].write_bytes(version_2_file(also, payload(also)))
    assert cache_verify(tmp_path) == (1, [], 1)


def test_data_sits_at_an_aligned_offset_and_is_written_around_the_page_cache(tmp_path: Path) -> None:
    """Format 3: header, zeros up to ALIGN, data; written with O_DIRECT where the filesystem takes it."""
    data = payload(chunk_id(1), 100 * KiB + 17)  # not a multiple of the block size: padded, then truncated
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), data)
        raw = Path(chunk_file_of(cache, chunk_id(1))).read_bytes()
        assert len(raw) == ALIGN + len(data) and raw[ALIGN:] == data
        header_len = 56 + len("weights") + len(chunk_id(1).key) + len("etag-1")
        assert raw[header_len:ALIGN] == bytes(ALIGN - header_len)
        assert cache.get(chunk_id(1)) == data
        assert cache._writer._direct  # /tmp here is ext4: the O_DIRECT path ran (the fallback has its own test)


@pytest.mark.parametrize("length", [2 * MiB, 2 * MiB - 100])
def test_a_chunk_in_an_engine_buffer_is_written_from_where_it_is(tmp_path: Path, monkeypatch, length: int) -> None:
    """Data in an anonymous mmap of whole blocks (the engine's chunk buffers) goes to disk from the buffer
    itself, after the staged header; any other data is copied into the stage. Both read back exactly, and
    the O_DIRECT path ran for both."""
    data = mmap.mmap(-1, length)
    data[:] = random_bytes(length, 5)
    cache = DiskCache(tmp_path, BIG, min_free_bytes=0)
    staged: list[int] = []
    take = cache._writer._take_stage
    monkeypatch.setattr(cache._writer, "_take_stage", lambda size: staged.append(size) or take(size))
    with cache:
        cache.put(chunk_id(1), data)
        assert staged == [ALIGN if length % ALIGN == 0 else ALIGN + round_up(length)]
        raw = Path(chunk_file_of(cache, chunk_id(1))).read_bytes()
        assert len(raw) == ALIGN + length and raw[ALIGN:] == data[:]
        assert cache.get(chunk_id(1)) == data[:] and cache._writer._direct
    assert cache_verify(tmp_path) == (1, [], 0)


def o_direct_opens(monkeypatch: pytest.MonkeyPatch, refuse: bool) -> tuple[list[str], set[int]]:
    """Patch os.open: the paths opened with O_DIRECT and their descriptors, or EINVAL for each if `refuse`
    (a filesystem that does not take O_DIRECT)."""
    real_open = os.open
    attempts: list[str] = []
    direct_fds: set[int] = set()

    def fake_open(path, flags, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if not flags & os.O_DIRECT:
            return real_open(path, flags, *args, **kwargs)
        attempts.append(path)
        if refuse:
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *args, **kwargs)
        direct_fds.add(fd)
        return fd

    monkeypatch.setattr(os, "open", fake_open)
    return attempts, direct_fds


@pytest.mark.parametrize("refused_by", ["open", "write"])
def test_filesystem_refusing_o_direct_falls_back_to_buffered_writes(tmp_path: Path, monkeypatch, caplog,
                                                                    refused_by: str) -> None:
    real_pwritev = os.pwritev
    attempts, direct_fds = o_direct_opens(monkeypatch, refuse=refused_by == "open")

    def fake_pwritev(fd, buffers, offset):  # noqa: ANN001, ANN202
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", fake_pwritev)
    caplog.set_level(logging.INFO, logger="fsmount.data")
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        for i in range(3):
            cache.put(chunk_id(i), payload(chunk_id(i)))
        assert len(attempts) == 1  # turned off after the first refusal
        assert [cache.get(chunk_id(i)) for i in range(3)] == [payload(chunk_id(i)) for i in range(3)]
        assert cache.stats.writes == 3 and cache.stats.write_errors == 0
    refusals = [r for r in caplog.records if "O_DIRECT not supported" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.INFO
    assert cache_verify(tmp_path) == (3, [], 0)


class ReadsSeen:
    """preadv calls of the cache, and whether each went through a descriptor opened with O_DIRECT."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.direct: list[bool] = []
        real_preadv = os.preadv

        def preadv(fd, buffers, offset):  # noqa: ANN001, ANN202
            self.direct.append(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))
            return real_preadv(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", preadv)


@pytest.mark.parametrize("length", [2 * MiB, 2 * MiB - 100])
def test_a_hit_into_an_engine_buffer_is_one_o_direct_read(tmp_path: Path, monkeypatch, length: int) -> None:
    """A hit the engine gives a buffer for (an anonymous mmap of the data's size) is read with O_DIRECT, header
    and data in one call straight into that buffer: no copy out of the page cache. Data that does not end on
    a block boundary gets its last bytes from the staged block."""
    data = random_bytes(length, 9)
    reads = ReadsSeen(monkeypatch)
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), data)
        buffer = mmap.mmap(-1, length)
        assert cache.get(chunk_id(1), buffer) is buffer and buffer[:] == data
        assert reads.direct == [True]
        assert cache.get(chunk_id(1)) == data  # bytes of its own: through the page cache (pread), as before
        assert reads.direct == [True]


def test_a_header_longer_than_a_block_is_read_through_the_page_cache(tmp_path: Path, monkeypatch) -> None:
    """A key of several KiB pushes the data past the first block: the O_DIRECT read does not apply (the file
    is a block longer than the data plus one block), and the file is read through the page cache, exactly."""
    long_key = chunk_id(1, key="k/" + "x" * 5000)
    data = random_bytes(2 * MiB, 3)
    reads = ReadsSeen(monkeypatch)
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        cache.put(long_key, data)
        buffer = mmap.mmap(-1, len(data))
        assert cache.get(long_key, buffer) is buffer and buffer[:] == data
        assert reads.direct == [False]  # the descriptor's O_DIRECT was turned off before the read
        assert cache._writer.direct and cache.stats.corrupt == 0


def test_a_short_o_direct_read_is_read_again_not_called_corrupt(tmp_path: Path, monkeypatch) -> None:
    """A short count from the O_DIRECT read proves nothing about the file: it is read again through the
    page cache, whose checks decide (here: a whole, valid file)."""
    data = random_bytes(2 * MiB, 4)
    real_preadv = os.preadv
    direct_reads = []

    def short_preadv(fd, buffers, offset):  # noqa: ANN001, ANN202
        got = real_preadv(fd, buffers, offset)
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            direct_reads.append(got)
            return got - ALIGN
        return got

    monkeypatch.setattr(os, "preadv", short_preadv)
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), data)
        buffer = mmap.mmap(-1, len(data))
        assert cache.get(chunk_id(1), buffer) is buffer and buffer[:] == data
        assert len(direct_reads) == 1 and cache.stats.corrupt == 0 and cache.contains(chunk_id(1))


@pytest.mark.parametrize("refused_by", ["open", "read"])
def test_filesystem_refusing_o_direct_reads_falls_back_to_the_page_cache(tmp_path: Path, monkeypatch, caplog,
                                                                         refused_by: str) -> None:
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        for i in range(3):
            cache.put(chunk_id(i), payload(chunk_id(i), 2 * MiB))
        real_preadv = os.preadv
        attempts, _ = o_direct_opens(monkeypatch, refuse=refused_by == "open")

        def fake_preadv(fd, buffers, offset):  # noqa: ANN001, ANN202
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_preadv(fd, buffers, offset)

        monkeypatch.setattr(os, "preadv", fake_preadv)
        caplog.set_level(logging.INFO, logger="fsmount.data")
        for i in range(3):
            buffer = mmap.mmap(-1, 2 * MiB)
            assert cache.get(chunk_id(i), buffer) is buffer and buffer[:] == payload(chunk_id(i), 2 * MiB)
        assert len(attempts) == 1 and not cache._writer.direct  # turned off after the first refusal
        assert cache.stats.corrupt == 0 and cache.stats.read_errors == 0
    refusals = [r for r in caplog.records if "O_DIRECT not supported" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.INFO


def test_file_removed_behind_the_cache_is_a_plain_miss(tmp_path: Path) -> None:
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), b"abc")
        os.unlink(chunk_file_of(cache, chunk_id(1)))
        assert cache.get(chunk_id(1)) is None
        assert cache.stats.corrupt == 0
        assert cache.stats.chunks == 0 and cache.stats.bytes_used == 0


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_fifo_or_symlink_in_a_chunk_files_place_is_a_quick_miss_and_is_replaced(tmp_path: Path, kind: str,
                                                                                    allowed_logs: list[str]) -> None:
    """A FIFO there held a cache thread in open(2) for good and failed every READ of the chunk at --read-timeout
    (then, fed, it turned O_DIRECT off for the whole cache); a symlink is no chunk file either. Both are a miss at
    once, and the next put of the chunk replaces them (never what a link points at)."""
    allowed_logs.append("dropped corrupt chunk file")
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    root = tmp_path / "cache"
    with DiskCache(root, BIG, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), payload(chunk_id(1)))
        path = chunk_file_of(cache, chunk_id(1))
        os.unlink(path)
        if kind == "fifo":
            os.mkfifo(path)
        else:
            os.symlink(outside, path)
        done: list[object] = []
        reader = threading.Thread(target=lambda: done.append(cache.get(chunk_id(1))), daemon=True)
        reader.start()
        reader.join(5)
        assert done == [None], "the read waited on a FIFO"
        assert cache._writer.direct == DiskCache(tmp_path / "probe", BIG, min_free_bytes=0)._writer.direct
        cache.put(chunk_id(1), payload(chunk_id(1)))
        assert cache.get(chunk_id(1)) == payload(chunk_id(1))
    assert outside.read_bytes() == b"keep"


def test_a_directory_in_a_chunk_files_place_costs_that_chunk_only(tmp_path: Path, allowed_logs: list[str]) -> None:
    """A directory there (an operator's `mkdir`, a script gone wrong) made the put of that chunk fail its rename with
    EISDIR, which started a write episode: no chunk at all was written for 30 s, and again each time that chunk was
    fetched (found by tests/mount/test_tier_fuzz.py). Only that chunk is not cached; the directory is left alone."""
    allowed_logs.append("dropped corrupt chunk file|not a chunk file")
    root = tmp_path / "cache"
    with DiskCache(root, BIG, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), payload(chunk_id(1)))
        path = chunk_file_of(cache, chunk_id(1))
        os.unlink(path)
        os.mkdir(path)
        assert cache.get(chunk_id(1)) is None
        cache.put(chunk_id(1), payload(chunk_id(1)))
        cache.put(chunk_id(2), payload(chunk_id(2)))  # any other chunk is written as before
        assert cache.get(chunk_id(2)) == payload(chunk_id(2))
        assert cache.get(chunk_id(1)) is None and os.path.isdir(path)
        assert not [p for p in Path(path).parent.iterdir() if p.name.endswith(".tmp")]


def test_a_cache_dir_whose_lock_or_chunks_is_a_symlink_touches_nothing_outside(tmp_path: Path) -> None:
    """A `lock` linked elsewhere had its target truncated to the daemon's pid (/etc/passwd, had it pointed
    there), by the mount and by `modelfs cache`; a `chunks` linked elsewhere had files there deleted (stale
    temp files) and chunk files written. Both are refused; what they point at is left as it was."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    outside = tmp_path / "outside"
    (outside / "ab").mkdir(parents=True)
    (outside / "ab" / "important.tmp").write_text("keep")
    locked = tmp_path / "c1"
    locked.mkdir()
    (locked / "lock").symlink_to(victim)
    with pytest.raises(OSError):
        DiskCache(locked, BIG, min_free_bytes=0)
    with pytest.raises(OSError):
        cache_verify(str(locked))
    linked = tmp_path / "c2"
    linked.mkdir()
    (linked / CHUNKS_DIR).symlink_to(outside)
    with pytest.raises(OSError, match="is a symlink"):
        DiskCache(linked, BIG, min_free_bytes=0)
    for command in (cache_verify, cache_clear):
        with pytest.raises(OSError, match="is a symlink"):
            command(str(linked))
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in outside.rglob("*")) == ["ab", "important.tmp"]


# -- eviction ---------------------------------------------------------------------------------------


def test_eviction_keeps_bytes_under_limit_in_lru_order(tmp_path: Path) -> None:
    size = chunk_file_size(tmp_path / "probe", 64 * KiB)
    limit = 10 * size + size // 2
    with DiskCache(tmp_path / "c", limit, min_free_bytes=0) as cache:
        for i in range(30):
            cache.put(chunk_id(i), payload(chunk_id(i)))
            assert cache.get(chunk_id(0)) == payload(chunk_id(0))  # keeps chunk 0 the most recent
            assert cache.stats.bytes_used <= limit
            assert sum(p.stat().st_size for p in disk_files(tmp_path / "c")) == cache.stats.bytes_used
        assert cache.stats.chunks == 10 and cache.stats.evictions == 20
        present = [i for i in range(30) if cache.contains(chunk_id(i))]
        assert present == [0, *range(21, 30)]
        assert cache.stats.writes == 30


def test_chunk_larger_than_the_whole_cache_is_skipped(tmp_path: Path) -> None:
    with DiskCache(tmp_path, 1000, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), b"x" * 2000)
        assert not cache.contains(chunk_id(1)) and cache.stats.writes_skipped == 1
        assert cache.stats.write_errors == 0 and disk_files(tmp_path) == []


# -- full and read-only disks -----------------------------------------------------------------------


def test_cache_bigger_than_its_filesystem_evicts_to_keep_free_space(tmpfs, caplog) -> None:
    with tmpfs("size=4m") as fs, DiskCache(fs / "c", max_bytes=BIG, min_free_bytes=512 * KiB) as cache:
        for i in range(64):  # 16 MiB through a 4 MiB filesystem
            c = chunk_id(i)
            cache.put(c, payload(c, 256 * KiB))
        assert cache.stats.write_errors == 0 and cache.stats.writes == 64
        assert cache.stats.evictions > 40
        assert _free(fs) >= 512 * KiB
        for i in range(64):
            got = cache.get(chunk_id(i))
            assert got is None or got == payload(chunk_id(i), 256 * KiB)
        assert cache.get(chunk_id(63)) == payload(chunk_id(63), 256 * KiB)  # the newest stayed
        assert warnings_from_cache(caplog) == []


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(path: Path) -> None:
    """A file of someone else's that takes all remaining space."""
    with open(path, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 64 * KiB)
            f.flush()


def test_a_disk_filled_by_something_else_makes_an_idle_cache_give_back_its_floor(tmpfs) -> None:
    """The floor of free space was kept by puts only: a warm node that only reads kept its chunks while logs or
    container images filled the disk to the last byte. keep_free (the daemon calls it every few seconds) evicts
    the least recently used chunks until the floor is free again, and nothing while it is."""
    with tmpfs("size=4m") as fs, DiskCache(fs / "c", BIG, min_free_bytes=MiB) as cache:
        stored = [chunk_id(i) for i in range(8)]
        for c in stored:  # 2 MiB of chunks
            cache.put(c, payload(c, 256 * KiB))
        assert cache.keep_free() == 0 and cache.stats.evictions == 0
        _fill(fs / "someone-elses-file")
        assert _free(fs) < 64 * KiB

        assert cache.keep_free() >= MiB - _free(fs)
        assert _free(fs) >= MiB
        kept = [c for c in stored if cache.get(c) is not None]
        assert kept == stored[-len(kept):] and 0 < len(kept) < len(stored)  # the least recently used went
        for c in kept:
            assert cache.get(c) == payload(c, 256 * KiB)
        assert cache.keep_free() == 0  # the floor is free again


def test_keep_free_leaves_a_read_only_cache_dir_alone(tmpfs) -> None:  # noqa: ANN001
    with tmpfs("size=4m") as fs:
        with DiskCache(fs / "c", BIG, 0) as cache:
            cache.put(chunk_id(1), payload(chunk_id(1)))
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        try:
            with DiskCache(fs / "c", BIG, min_free_bytes=8 * MiB) as cache:  # more than the filesystem
                assert cache.keep_free() == 0
                assert cache.get(chunk_id(1)) == payload(chunk_id(1))
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(fs)], check=True)


@expects_warning(WRITE_WARNING)
def test_disk_full_of_foreign_data_absorbs_puts_with_one_warning(tmpfs, caplog, allowed_logs) -> None:
    with tmpfs("size=4m") as fs, DiskCache(fs / "c", BIG, min_free_bytes=0, retry_after_s=0) as cache:
        stored = [chunk_id(i) for i in range(4)]
        for c in stored:
            cache.put(c, payload(c, 128 * KiB))
        _fill(fs / "someone-elses-file")
        assert _free(fs) < 128 * KiB

        for i in range(10, 20):  # each 1 MiB: more than evicting all 512 KiB of cache could free
            cache.put(chunk_id(i), payload(chunk_id(i), MiB))
        assert cache.stats.write_errors == 10 and cache.stats.writes == 4
        assert len(warnings_from_cache(caplog)) == 1
        assert "write failed" in warnings_from_cache(caplog)[0].getMessage()
        for c in stored:  # nothing was evicted for writes that could not succeed
            assert cache.get(c) == payload(c, 128 * KiB)
        assert not list((fs / "c").rglob("*.tmp"))
        assert (cache._reserved, cache._unwritten) == (0, 0)

        os.unlink(fs / "someone-elses-file")  # space frees: the next put is tried and succeeds
        cache.put(chunk_id(30), payload(chunk_id(30), MiB))
        assert cache.get(chunk_id(30)) == payload(chunk_id(30), MiB)
        assert any("resumed" in r.getMessage() for r in caplog.records)


@expects_warning(WRITE_WARNING)
def test_real_enospc_from_the_kernel_is_absorbed(tmpfs, caplog, allowed_logs) -> None:
    # Out of inodes: statvfs still shows free bytes, so the write itself fails with ENOSPC.
    with tmpfs("size=4m,nr_inodes=300") as fs, DiskCache(fs / "c", BIG, 0, retry_after_s=0) as cache:
        room = os.statvfs(fs).f_favail
        assert 5 < room < 50
        for i in range(room + 10):
            cache.put(chunk_id(i), payload(chunk_id(i), 4 * KiB))
        assert cache.stats.writes == room and cache.stats.write_errors == 10
        assert len(warnings_from_cache(caplog)) == 1
        assert "No space left" in warnings_from_cache(caplog)[0].getMessage()
        for i in range(room):
            assert cache.get(chunk_id(i)) == payload(chunk_id(i), 4 * KiB)
        assert not list((fs / "c").rglob("*.tmp"))
        assert (cache._reserved, cache._unwritten) == (0, 0)


@expects_warning(WRITE_WARNING)
def test_read_only_filesystem_pauses_writes_then_resumes(tmpfs, caplog, allowed_logs) -> None:
    with tmpfs("size=4m") as fs, DiskCache(fs / "c", BIG, 0, retry_after_s=3600) as cache:
        cache.put(chunk_id(1), payload(chunk_id(1)))
        os.utime(chunk_file_of(cache, chunk_id(1)), ns=(10**18, 10**18))  # stale stamp: a hit will restamp
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        for i in range(2, 12):
            cache.put(chunk_id(i), payload(chunk_id(i)))
        # One attempt failed with EROFS; the other nine were skipped without touching the disk.
        assert cache.stats.write_errors == 1 and cache.stats.writes_skipped == 9
        assert len(warnings_from_cache(caplog)) == 1
        assert "Read-only" in warnings_from_cache(caplog)[0].getMessage()
        assert cache.get(chunk_id(1)) == payload(chunk_id(1))  # its restamp fails with EROFS, unseen

        subprocess.run(["mount", "-o", "remount,rw", str(fs)], check=True)
        cache.retry_after_s = 0  # the retry deadline has passed
        cache.put(chunk_id(20), payload(chunk_id(20)))
        assert cache.get(chunk_id(20)) == payload(chunk_id(20))
        assert cache.stats.write_errors == 1 and len(warnings_from_cache(caplog)) == 1


# -- concurrency ------------------------------------------------------------------------------------


def test_readers_during_puts_and_evictions_never_see_wrong_bytes(tmp_path: Path) -> None:
    n_chunks, size = 300, 32 * KiB
    expected = {i: payload(chunk_id(i), size) for i in range(n_chunks)}
    limit = 20 * chunk_file_size(tmp_path / "probe", size)
    cache = DiskCache(tmp_path / "c", max_bytes=limit, min_free_bytes=0)
    done = threading.Event()
    wrong: list[int] = []
    hits = [0] * 8

    def writer() -> None:
        for _round in range(3):
            for i in range(n_chunks):
                cache.put(chunk_id(i), expected[i])
        done.set()

    def reader(slot: int) -> None:
        rng = random.Random(slot)
        while not done.is_set():
            i = rng.randrange(n_chunks)
            got = cache.get(chunk_id(i))
            if got is not None:
                hits[slot] += 1
                if got != expected[i]:
                    wrong.append(i)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(8)]
    threads.append(threading.Thread(target=writer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    cache.close()
    assert wrong == []
    assert sum(hits) > 0 and cache.stats.evictions > 500
    assert cache.stats.corrupt == 0 and cache.stats.read_errors == 0
    assert cache.stats.bytes_used <= cache.max_bytes
    assert cache.stats.bytes_used == sum(p.stat().st_size for p in disk_files(tmp_path / "c"))
    assert (cache._reserved, cache._unwritten) == (0, 0)


def test_eight_writers_at_the_free_space_floor_skip_quietly_and_keep_it(tmpfs, caplog) -> None:
    """8 threads (the daemon's disk limiter) against room for about 3 chunk files above the floor: puts that
    find the room held by puts in flight are skipped, none fails, and the floor holds."""
    size, n = 256 * KiB, 64
    with tmpfs("size=8m") as fs, DiskCache(fs / "c", BIG, min_free_bytes=0) as cache:
        cache.min_free_bytes = _free(fs) - 3 * size - size // 2
        chunks = [chunk_id(i) for i in range(n)]
        data = {c: payload(c, size) for c in chunks}
        start = threading.Barrier(8)

        def writer(mine: list[ChunkId]) -> None:
            start.wait()
            for c in mine:
                cache.put(c, data[c])

        threads = [threading.Thread(target=writer, args=(chunks[t::8],)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert cache.stats.write_errors == 0 and warnings_from_cache(caplog) == []
        assert cache.stats.writes + cache.stats.writes_skipped == n, cache.stats
        assert cache.stats.writes >= 3 and 1 <= cache.stats.chunks <= 3, cache.stats
        assert (cache._reserved, cache._unwritten) == (0, 0)
        # The accounting counts file sizes; tmpfs rounds each file up to a 4 KiB page.
        assert _free(fs) >= cache.min_free_bytes - 3 * 4 * KiB
        for c in chunks:
            got = cache.get(c)
            assert got is None or got == data[c]
        assert not list((fs / "c").rglob("*.tmp"))


# -- exclusive use, permissions, temp files -----------------------------------------------------------


def test_second_cache_on_same_dir_is_refused_until_first_closes(tmp_path: Path) -> None:
    first = DiskCache(tmp_path / "c", BIG, min_free_bytes=0)
    with pytest.raises(CacheDirBusy) as busy:
        DiskCache(tmp_path / "c", BIG, min_free_bytes=0)
    assert "another modelfs mount" in str(busy.value)
    assert str(tmp_path / "c") in str(busy.value)
    assert f"pid {os.getpid()}" in str(busy.value)
    with pytest.raises(CacheDirBusy):
        cache_clear(tmp_path / "c")
    with pytest.raises(CacheDirBusy):
        cache_verify(tmp_path / "c")
    first.close()
    DiskCache(tmp_path / "c", BIG, min_free_bytes=0).close()


def test_a_second_cache_is_refused_even_once_the_lock_file_is_removed(tmp_path: Path) -> None:
    """An operator's `rm -rf CACHE/*` removed the `lock` file a live mount held its flock on: a second mount of
    the dir then went ahead, and the two evicted each other's files, each within its own --cache-size."""
    with DiskCache(tmp_path / "c", BIG, min_free_bytes=0):
        for entry in (tmp_path / "c").iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        with pytest.raises(CacheDirBusy) as busy:
            DiskCache(tmp_path / "c", BIG, min_free_bytes=0)
        assert f"(pid {os.getpid()})" in str(busy.value)  # the holder /proc/locks shows: the `lock` file is gone
        with pytest.raises(CacheDirBusy):
            cache_verify(tmp_path / "c")


def test_a_cache_dir_held_by_an_older_modelfs_through_its_lock_file_is_refused(tmp_path: Path) -> None:
    """Versions before the directory lock flock only `lock`: one still running after an upgrade must keep a new
    mount and `modelfs cache clear` out (they would delete files under its index)."""
    (tmp_path / "c").mkdir()
    held = os.open(tmp_path / "c" / "lock", os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what an older daemon holds
        with pytest.raises(CacheDirBusy):
            DiskCache(tmp_path / "c", BIG, min_free_bytes=0)
        with pytest.raises(CacheDirBusy):
            cache_clear(tmp_path / "c")
    finally:
        os.close(held)
    DiskCache(tmp_path / "c", BIG, min_free_bytes=0).close()


def operators_writes_folder(root: Path) -> tuple[list[Path], list[Path]]:
    """A `writes/` of an operator's in a folder given as --cache-dir, beside two copies of modelfs's own: (what is
    the operator's, what modelfs staged)."""
    elsewhere = root.parent / f"{root.name}-elsewhere"
    elsewhere.mkdir()
    (elsewhere / "target").write_text("linked")
    writes = root / "writes"
    (writes / "project").mkdir(parents=True)
    (writes / "project" / "notes.txt").write_text("precious")
    (writes / "notes.txt").write_text("mine")
    (writes / "12").mkdir()  # named as a copy, but a folder
    (writes / "12" / "inside").write_text("deep")
    (writes / "13").symlink_to(elsewhere / "target")  # named as a copy, but a symlink
    (writes / "014").write_text("not a name modelfs gives")
    for name in ("1", "7"):
        (writes / name).write_bytes(b"x" * 100)
    theirs = [writes / "project" / "notes.txt", writes / "notes.txt", writes / "12" / "inside", writes / "13",
              writes / "014", elsewhere / "target"]
    return theirs, [writes / "1", writes / "7"]


def test_cache_clear_and_every_mount_remove_only_the_copies_modelfs_staged_in_writes(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """An existing folder given as --cache-dir lost its whole `writes/` subfolder (rmtree) to `modelfs cache clear`,
    a read-only mount and a --writable one: only regular files named as the staging names its copies are removed."""
    from fsmount.config import CacheSize, MountConfig, StoreConfig
    from fsmount.mount import open_disk_cache
    from fsmount.write_staging import Staging

    def read_only_mount(root: Path) -> None:
        cfg = MountConfig(store=StoreConfig(bucket="b"), mountpoint="/nonexistent", cache_dir=str(root),
                          cache_size=CacheSize(bytes=1 << 30), memory_limit=256 << 20)
        open_disk_cache(cfg).close()

    def writable_mount(root: Path) -> None:
        Staging(str(root)).block_writer.shutdown()

    for n, sweep in enumerate((cache_clear, read_only_mount, writable_mount)):
        root = tmp_path / f"c{n}"
        root.mkdir()
        theirs, ours = operators_writes_folder(root)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            sweep(root)
        assert [p for p in theirs if not p.is_symlink() and not p.exists()] == [], sweep
        assert (root / "writes" / "13").is_symlink() and (root / "writes" / "13").read_text() == "linked"
        assert [p for p in ours if p.exists()] == [], sweep
        assert any("left 5 entries in writes/" in r.getMessage() for r in caplog.records), sweep


def test_a_cache_size_the_disk_cannot_hold_is_said_once_at_mount(tmp_path: Path, monkeypatch, caplog) -> None:  # noqa: ANN001
    """`--cache-size 500G` on a 40 MiB disk started with no word: the cache holds what the disk has free beyond the
    floor it leaves (it evicts to keep that floor), and the mount now says so in one line. A size that fits says
    nothing."""
    from fsmount.config import CacheSize, MountConfig, StoreConfig
    from fsmount.mount import open_disk_cache

    real_statvfs = os.statvfs

    def small_disk(path):  # noqa: ANN001, ANN202 - 40 MiB, 38 MiB of it free
        st = real_statvfs(path)
        return os.statvfs_result((4096, 4096, 10240, 9728, 9728, st.f_files, st.f_ffree, st.f_favail, st.f_flag,
                                  st.f_namemax))

    monkeypatch.setattr(os, "statvfs", small_disk)
    said = []
    for n, size in enumerate((500 << 30, 34 << 20)):
        cfg = MountConfig(store=StoreConfig(bucket="b"), mountpoint="/nonexistent", cache_dir=str(tmp_path / f"c{n}"),
                          cache_size=CacheSize(bytes=size), memory_limit=256 << 20)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fsmount"):
            open_disk_cache(cfg).close()
        said.append([r.getMessage() for r in caplog.records if "--cache-size" in r.getMessage()])
    big, fits = said
    assert len(big) == 1 and "--cache-size 500.00 GiB is more than its filesystem can give it" in big[0], big
    assert "beyond the 2.00 MiB it leaves free (36.00 MiB now)" in big[0], big
    assert fits == []


def test_the_room_a_disk_gives_the_cache_is_measured_for_stats(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`modelfs stats` said "of 200 GiB" of a cache whose disk had room for 37 GiB (a new user's trial): the cache
    measures what it can hold as its disk stands, at mount and at each floor check (`keep_free`): its chunks plus
    the free space beyond its floor, less what puts in flight and copies hold, at most --cache-size."""
    from fsmount.config import CacheSize, MountConfig, StoreConfig
    from fsmount.mount import open_disk_cache

    real_statvfs = os.statvfs
    free_blocks = [9728]  # of 10240 blocks of 4 KiB: 38 MiB of a 40 MiB disk

    def small_disk(path):  # noqa: ANN001, ANN202
        st = real_statvfs(path)
        return os.statvfs_result((4096, 4096, 10240, free_blocks[0], free_blocks[0], st.f_files, st.f_ffree,
                                  st.f_favail, st.f_flag, st.f_namemax))

    monkeypatch.setattr(os, "statvfs", small_disk)
    cfg = MountConfig(store=StoreConfig(bucket="b"), mountpoint="/nonexistent", cache_dir=str(tmp_path / "c"),
                      cache_size=CacheSize(bytes=500 << 30), memory_limit=256 << 20)
    cache = open_disk_cache(cfg)
    try:
        assert cache.min_free_bytes == 2 * MiB
        assert cache.room_bytes == 36 * MiB  # at mount
        free_blocks[0] = 4608  # something else took 20 MiB: 18 MiB free
        assert cache.keep_free() == 0
        assert cache.room_bytes == 16 * MiB
        assert cache.hold(4 * MiB)  # a copy of a file being written takes 4 MiB of it
        cache.keep_free()
        assert cache.room_bytes == 12 * MiB
        cache.unhold(4 * MiB)
        free_blocks[0] = 256  # 1 MiB free, under the floor, and the cache holds nothing to evict
        cache.keep_free()
        assert cache.room_bytes == 0
    finally:
        cache.close()
    small = DiskCache(tmp_path / "fits", max_bytes=4 * MiB, min_free_bytes=2 * MiB)
    try:
        free_blocks[0] = 9728
        small.keep_free()
        assert small.room_bytes == 4 * MiB  # --cache-size, where the disk gives more
    finally:
        small.close()


def test_a_writes_entry_that_is_not_a_directory_is_left_alone_and_a_writable_mount_refuses_it(tmp_path: Path) -> None:
    """Refused as a setting (exit 2): only moving it, or another cache dir, mends it (B1083)."""
    from fsmount.config import CacheSize, MountConfig, StoreConfig
    from fsmount.mount import SettingError, open_disk_cache

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "1").write_text("linked")
    for name, make in (("file", lambda p: p.write_text("a file")), ("link", lambda p: p.symlink_to(elsewhere))):
        root = tmp_path / name
        root.mkdir()
        make(root / "writes")
        cache_clear(root)
        cfg = MountConfig(store=StoreConfig(bucket="b"), mountpoint="/nonexistent", cache_dir=str(root),
                          cache_size=CacheSize(bytes=1 << 30), memory_limit=256 << 20)
        open_disk_cache(cfg).close()
        with pytest.raises(SettingError) as refused:
            open_disk_cache(dataclasses.replace(cfg, writable=True))
        assert f"{root / 'writes'} is not a directory of its own" in str(refused.value)
        assert "\n" not in str(refused.value)
        assert os.path.lexists(root / "writes")
    assert (elsewhere / "1").read_text() == "linked" and (tmp_path / "file" / "writes").read_text() == "a file"


OPEN_CACHE_DIR = """
import sys
from fsmount.config import CacheSize, MountConfig, StoreConfig
from fsmount.mount import MountError, open_disk_cache
cfg = MountConfig(store=StoreConfig(bucket="b"), mountpoint="/nonexistent", cache_dir=sys.argv[1],
                  cache_size=CacheSize(bytes=1 << 30), memory_limit=256 << 20)
try:
    open_disk_cache(cfg).close()
except MountError as exc:
    print(exc)
"""


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0, reason="needs root and setpriv")
def test_a_cache_dir_whose_parent_cannot_be_reached_is_not_said_to_be_on_a_disk_not_mounted(tmp_path: Path) -> None:
    """A cache dir below another user's 0700 directory was said to go in a directory that "does not exist (a disk not
    mounted yet?)" (B262's check took every failed stat of it for a missing one), where it was there and closed to
    this user: "Permission denied", as before B262 (B293). A file where it should be is not a disk not mounted."""
    from fsmount.config import CacheSize, MountConfig, StoreConfig
    from fsmount.mount import MountError, open_disk_cache

    locked = tmp_path / "locked"
    (locked / "models").mkdir(parents=True)
    os.chown(locked, 65534, 65534)
    locked.chmod(0o700)
    cache = locked / "models" / "cache"
    # root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH: another user's 0700 directory is closed to it.
    res = subprocess.run([shutil.which("setpriv"), "--bounding-set", "-dac_override,-dac_read_search", "--",
                          sys.executable, "-c", OPEN_CACHE_DIR, str(cache)],
                         capture_output=True, text=True, timeout=60, env=modelfs_env())
    assert res.stdout == (f"cannot use cache dir {cache}: {locked / 'models'}, the directory it goes in: Permission "
                          "denied\n"), res.stdout + res.stderr
    (tmp_path / "afile").write_bytes(b"x")
    cfg = MountConfig(store=StoreConfig(bucket="b"), mountpoint="/nonexistent", cache_dir=str(tmp_path / "afile" / "c"),
                      cache_size=CacheSize(bytes=1 << 30), memory_limit=256 << 20)
    with pytest.raises(MountError) as refused:
        open_disk_cache(cfg)
    assert str(refused.value) == (f"cannot use cache dir {tmp_path / 'afile' / 'c'}: {tmp_path / 'afile'}, the "
                                  "directory it goes in, is not a directory")


def test_a_cache_dir_that_is_a_symlink_to_a_disk_not_mounted_yet_is_retried_not_refused_for_good(
        tmp_path: Path) -> None:
    """`--cache-dir /var/cache/modelfs`, a symlink to /nvme/modelfs, started before /nvme was mounted: "it exists and
    is not a directory", a SettingError (exit status 2), which the unit never started again, so the node came up
    without its mount once the disk was there (B294). Now a MountError (status 1, started again) that names the
    link's target; the target is not made, and once it is there the cache dir opens through the link."""
    from fsmount.config import CacheSize, MountConfig, StoreConfig
    from fsmount.mount import MountError, open_disk_cache

    link = tmp_path / "cache"
    link.symlink_to(tmp_path / "nvme" / "modelfs")
    cfg = MountConfig(store=StoreConfig(bucket="b"), mountpoint="/nonexistent", cache_dir=str(link),
                      cache_size=CacheSize(bytes=1 << 30), memory_limit=256 << 20)
    with pytest.raises(MountError) as refused:
        open_disk_cache(cfg)
    assert type(refused.value) is MountError, refused.value  # not a SettingError: status 1
    assert str(refused.value) == (f"cannot use cache dir {link}: it is a symlink to {tmp_path / 'nvme' / 'modelfs'}, "
                                  "which is not there (a disk not mounted yet?); modelfs does not make a symlink's "
                                  "target")
    assert not (tmp_path / "nvme").exists()
    (tmp_path / "nvme" / "modelfs").mkdir(parents=True)  # the disk is mounted
    open_disk_cache(cfg).close()
    assert (tmp_path / "nvme" / "modelfs" / "chunks").is_dir() and link.is_symlink()


def test_a_lock_file_modelfs_did_not_write_is_not_overwritten_and_the_dir_is_refused_by_name(tmp_path: Path) -> None:
    """An existing folder given as --cache-dir had its own `lock` file replaced by the daemon's pid."""
    from fsmount.config import CacheSize, MountConfig, StoreConfig
    from fsmount.mount import MountError, open_disk_cache

    for n, text in enumerate(("precious\n", "4242 draining\n" * 10, "12 13\n", "\x00" * 8)):
        root = tmp_path / f"c{n}"
        root.mkdir()
        (root / "lock").write_text(text)
        with pytest.raises(OSError, match="is not a modelfs lock file"):
            DiskCache(root, BIG, min_free_bytes=0)
        with pytest.raises(OSError, match="is not a modelfs lock file"):
            cache_clear(root)
        cfg = MountConfig(store=StoreConfig(bucket="b"), mountpoint="/nonexistent", cache_dir=str(root),
                          cache_size=CacheSize(bytes=1 << 30), memory_limit=256 << 20)
        with pytest.raises(MountError) as refused:
            open_disk_cache(cfg)
        assert str(root / "lock") in str(refused.value) and "\n" not in str(refused.value)
        assert (root / "lock").read_text() == text
    # What modelfs itself leaves there (a pid; a draining holder's; a crash between write and truncate; an empty file
    # a read-only open created) still opens, and gets this process's pid.
    for n, text in enumerate(("", "4242\n", "4242 draining\n", "42\n42 draining\n")):
        root = tmp_path / f"ours{n}"
        root.mkdir()
        (root / "lock").write_text(text)
        DiskCache(root, BIG, min_free_bytes=0).close()
        assert (root / "lock").read_text() == f"{os.getpid()}\n"


def test_chunk_dirs_removed_under_a_live_cache_are_made_again(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """`rm -rf CACHE/chunks/*` while mounted: every put failed (its shard was gone) for the rest of the mount,
    one warning, and every read of those models went to the origin again."""
    with DiskCache(tmp_path / "c", BIG, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), payload(chunk_id(1)))
        for how in ("shards", "chunks"):
            if how == "shards":
                for shard in (tmp_path / "c" / CHUNKS_DIR).iterdir():
                    shutil.rmtree(shard)
            else:
                shutil.rmtree(tmp_path / "c" / CHUNKS_DIR)
            for i in range(1, 6):  # as the engine goes: a miss (the file is gone: forgotten), a fetch, a put
                assert cache.get(chunk_id(i)) is None
                cache.put(chunk_id(i), payload(chunk_id(i)))
                assert cache.get(chunk_id(i)) == payload(chunk_id(i))
        assert cache.stats.write_errors == 0 and not warnings_from_cache(caplog)


def test_an_unreadable_chunk_file_is_removed_and_written_again(tmp_path: Path, caplog, allowed_logs,  # noqa: ANN001
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk file the daemon cannot read (root's 0600 file in a cache restored from a backup, for a daemon that
    runs as another user): it stayed indexed, its read failed at every lookup (logged at debug), and the re-put
    after each origin fetch was skipped as a chunk already held."""
    allowed_logs.append(r"reading chunk file .* failed")
    real_open = DiskCache._open_for_read
    with DiskCache(tmp_path / "c", BIG, min_free_bytes=0) as cache:
        for i in range(3):
            cache.put(chunk_id(i), payload(chunk_id(i)))
        used = cache.stats.bytes_used

        def refused(self: DiskCache, path: str, direct: bool) -> tuple[int, os.stat_result]:
            raise PermissionError(errno.EACCES, "Permission denied", path)

        monkeypatch.setattr(DiskCache, "_open_for_read", refused)
        for i in range(3):
            assert cache.get(chunk_id(i)) is None
        assert cache.stats.read_errors == 3 and cache.stats.chunks == 0 and cache.stats.bytes_used == 0
        assert not disk_files(tmp_path / "c")
        monkeypatch.setattr(DiskCache, "_open_for_read", real_open)
        for i in range(3):  # fetched again from the origin: written again
            cache.put(chunk_id(i), payload(chunk_id(i)))
            assert cache.get(chunk_id(i)) == payload(chunk_id(i))
        assert cache.stats.bytes_used == used
    assert len(warnings_from_cache(caplog)) == 1


def test_a_chunks_dir_that_cannot_be_chmod_ed_is_used_as_it_is(tmp_path: Path, caplog, allowed_logs,  # noqa: ANN001
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache dir restored from a backup with another owner: the chmod of `chunks/` needs CAP_FOWNER, which the
    systemd unit does not keep, and the mount was refused (restarted every 5 s by systemd). Now a chunks/ already
    0700 is left alone, and one that cannot be made so is used with a warning."""
    allowed_logs.append(r"cannot make .* private")
    (tmp_path / "c" / CHUNKS_DIR).mkdir(parents=True, mode=0o700)
    (tmp_path / "c" / CHUNKS_DIR).chmod(0o700)

    def refuse(path: object, mode: int, **kwargs: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", path)

    monkeypatch.setattr(os, "chmod", refuse)
    with DiskCache(tmp_path / "c", BIG, min_free_bytes=0) as cache:  # already private: not even tried
        cache.put(chunk_id(1), payload(chunk_id(1)))
    assert not warnings_from_cache(caplog)
    monkeypatch.undo()
    (tmp_path / "c" / CHUNKS_DIR).chmod(0o755)
    monkeypatch.setattr(os, "chmod", refuse)
    with DiskCache(tmp_path / "c", BIG, min_free_bytes=0) as cache:
        assert cache.get(chunk_id(1)) == payload(chunk_id(1))
    assert ["cannot make" in r.getMessage() for r in warnings_from_cache(caplog)] == [True]


def test_a_read_only_cache_dir_serves_what_it_holds(tmpfs, caplog, allowed_logs) -> None:  # noqa: ANN001
    """A warm cache on a disk mounted read-only was refused at mount (its chmod, then its shards): it serves
    what it holds now, and its puts are one write episode."""
    allowed_logs.append(r"write failed|cannot make")
    with tmpfs("size=4m") as fs:
        with DiskCache(fs / "c", BIG, 0) as cache:
            cache.put(chunk_id(1), payload(chunk_id(1)))
        shutil.rmtree(fs / "c" / CHUNKS_DIR / chunk_id(9).digest()[:SHARD_HEX_CHARS], ignore_errors=True)
        (fs / "c" / CHUNKS_DIR).chmod(0o755)
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        try:
            with DiskCache(fs / "c", BIG, 0, retry_after_s=3600) as cache:
                assert cache.get(chunk_id(1)) == payload(chunk_id(1))
                cache.put(chunk_id(9), payload(chunk_id(9)))
                assert cache.get(chunk_id(9)) is None and cache.stats.write_errors == 1
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(fs)], check=True)


def test_lock_is_held_against_other_processes(tmp_path: Path) -> None:
    with DiskCache(tmp_path, BIG, min_free_bytes=0):
        code = (
            "import sys\nfrom fsmount.data import DiskCache, CacheDirBusy\n"
            f"try:\n    DiskCache({str(tmp_path)!r}, 1 << 40, 0)\nexcept CacheDirBusy as e:\n"
            "    print(e); sys.exit(3)\n"
        )
        other = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
        assert other.returncode == 3, other.stderr
        assert "another modelfs mount" in other.stdout


def test_permissions(tmp_path: Path) -> None:
    """Chunk data is private, but an existing directory (a disk's root, a directory other services share)
    keeps its mode: `chunks/` below it is 0700."""
    existing = tmp_path / "existing"
    existing.mkdir()
    os.chmod(existing, 0o1777)
    (existing / "someone-elses.txt").write_bytes(b"x")
    for root, mode in ((tmp_path / "new" / "cache", 0o700), (existing, 0o1777)):
        with DiskCache(root, BIG, min_free_bytes=0) as cache:
            cache.put(chunk_id(1), b"data")
            path = Path(chunk_file_of(cache, chunk_id(1)))
            assert stat.S_IMODE(root.stat().st_mode) == mode
            assert stat.S_IMODE((root / "chunks").stat().st_mode) == 0o700
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert stat.S_IMODE((root / "lock").stat().st_mode) == 0o600


def test_leftover_temp_files_are_swept_at_open(tmp_path: Path) -> None:
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), b"kept")
        shard = Path(chunk_file_of(cache, chunk_id(1))).parent
    (shard / "0123456789abcdef.x1y2z3.tmp").write_bytes(b"half a chunk")
    (tmp_path / "chunks" / "ff" / "whatever.tmp").write_bytes(b"")
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        assert cache.swept_tmp_files == 2
        assert not list(tmp_path.rglob("*.tmp"))
        assert cache.stats.chunks == 1 and cache.get(chunk_id(1)) == b"kept"


# -- index rebuild at scale ---------------------------------------------------------------------------


@expects_warning(CORRUPT_WARNING)
@pytest.mark.timeout(240)  # a bound on a hang, not a speed assertion: the times are printed
def test_index_rebuild_of_100k_chunk_files(tmp_path: Path, allowed_logs) -> None:
    n = 100_000
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        paths = [chunk_file_of(cache, chunk_id(i)) for i in range(n)]
    started = time.perf_counter()
    for path in paths:  # tiny fake files: the rebuild only stats, it never reads them
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"0123456789")
        os.close(fd)
    old = time.time_ns() - 10**12
    os.utime(paths[500], ns=(old, old))  # the persisted LRU order: this one is the oldest
    print(f"\ncreated {n} files in {time.perf_counter() - started:.2f} s")

    started = time.perf_counter()
    cache = DiskCache(tmp_path, BIG, min_free_bytes=0)
    elapsed = time.perf_counter() - started
    print(f"index rebuild of {n} chunk files: {elapsed:.2f} s")
    try:
        # Every file indexed, at its size, and nothing else.
        assert cache.stats.chunks == n and cache.stats.bytes_used == 10 * n
        assert sorted(cache._index) == sorted(os.path.basename(p) for p in paths)
        assert set(cache._index.values()) == {10}
        assert next(iter(cache._index)) == os.path.basename(paths[500])
        assert cache.get(chunk_id(3)) is None and cache.stats.corrupt == 1  # fake content is caught
    finally:
        cache.close()


# -- maintenance functions ----------------------------------------------------------------------------


def test_cache_stats_counts_stamps_in_the_future_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A chunk used while the clock was ahead (a wrong RTC that chrony then stepped back) keeps a stamp in the future,
    which the cache counts as older than every other (evicted first). `modelfs cache stats` showed it as the newest
    access, a date to come. Such stamps are counted apart, and the accesses shown are the others'."""
    from fsmount import cli

    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        for i in range(3):
            cache.put(chunk_id(i), payload(chunk_id(i), 1000))
        paths = [Path(chunk_file_of(cache, chunk_id(i))) for i in range(3)]
    ahead = time.time_ns() + 86_400 * 10**9  # a day ahead
    for i, p in enumerate(paths):
        os.utime(p, ns=(ahead if i == 2 else 1_700_000_000 * 10**9 + i * 10**9,) * 2)
    stats = cache_stats(tmp_path)
    assert (stats["oldest_access"], stats["newest_access"], stats["future_stamps"]) == (
        1_700_000_000.0, 1_700_000_001.0, 1)
    assert cli.main(["cache", "stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    shown = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_700_000_001))
    assert f"newest access   {shown}\n" in out, out
    assert "future stamps   1 chunk (used while this machine's clock was ahead; the cache counts it as the " \
           "oldest)\n" in out, out
    for p in paths:
        os.utime(p, ns=(ahead,) * 2)
    assert cli.main(["cache", "stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "oldest access   -\nnewest access   -\n" in out and "future stamps   3 chunks (" in out, out


def test_cache_stats_clear_verify(tmp_path: Path) -> None:
    assert cache_stats(tmp_path / "absent") == {
        "chunks": 0,
        "bytes": 0,
        "oldest_access": None,
        "newest_access": None,
        "future_stamps": 0,
        "staged_files": 0,
        "staged_bytes": 0,
    }
    assert cache_clear(tmp_path / "absent") == (0, 0, 0) and cache_verify(tmp_path / "absent") == (0, [], 0)
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        for i in range(5):
            cache.put(chunk_id(i), payload(chunk_id(i), 1000))
        paths = [Path(chunk_file_of(cache, chunk_id(i))) for i in range(5)]
        for i, p in enumerate(paths):
            os.utime(p, ns=(1_700_000_000 * 10**9 + i * 10**9,) * 2)
        stats = cache_stats(tmp_path)  # works while the cache is open
        assert stats == {
            "chunks": 5,
            "bytes": sum(p.stat().st_size for p in paths),
            "oldest_access": 1_700_000_000.0,
            "newest_access": 1_700_000_004.0,
            "future_stamps": 0,
            "staged_files": 0,
            "staged_bytes": 0,
        }

    flip_last_byte(paths[1], paths[1])
    shutil.copyfile(paths[2], paths[3])  # a valid file under another chunk's name
    good, bad, _other = cache_verify(tmp_path)
    assert good == 3 and sorted(bad) == sorted([str(paths[1]), str(paths[3])])
    assert not paths[1].exists() and not paths[3].exists() and paths[2].exists()
    assert cache_verify(tmp_path) == (3, [], 0)

    (paths[0].parent / "junk.tmp").write_bytes(b"")
    # What a --writable mount killed mid-file left: hidden from `stats` and kept by `clear` (57 MiB in a tester's
    # run, hundreds of GB for a checkpoint), until the next --writable mount of the dir.
    (tmp_path / "writes").mkdir()
    (tmp_path / "writes" / "1").write_bytes(b"x" * 5000)
    assert cache_stats(tmp_path)["staged_files"] == 1 and cache_stats(tmp_path)["staged_bytes"] == 5000
    assert cache_clear(tmp_path) == (4, 5000, 0)
    assert list((tmp_path / "writes").iterdir()) == []
    (tmp_path / "writes").rmdir()
    elsewhere = tmp_path.parent / f"{tmp_path.name}-elsewhere"
    elsewhere.mkdir()
    (elsewhere / "1").write_bytes(b"y")
    (tmp_path / "writes").symlink_to(elsewhere)  # counted as removed, and removed nothing
    assert cache_stats(tmp_path)["staged_files"] == 0 and cache_clear(tmp_path) == (0, 0, 0)
    assert (elsewhere / "1").read_bytes() == b"y"
    (tmp_path / "writes").unlink()
    assert disk_files(tmp_path) == []
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as cache:
        assert cache.stats.chunks == 0 and cache.get(chunk_id(0)) is None


def test_bytes_for_fraction(tmpfs) -> None:
    with tmpfs("size=4m") as fs:
        assert bytes_for_fraction(fs, 0.5) == 2 * MiB
        assert bytes_for_fraction(fs / "not" / "yet", 1.0) == 4 * MiB  # measured at the nearest parent
        for bad in (0.0, -0.1, 1.5):
            with pytest.raises(ValueError):
                bytes_for_fraction(fs, bad)


# -- puts in flight, deterministically in-process ------------------------------------------------
# Regressions found through the real-mount test tests/mount/test_disk_cache_mount.py::
# test_full_cache_disk_costs_speed_not_correctness (the free-space floor and out-of-inodes cases); a mount
# shows them only by timing, so these drive DiskCache directly, holding one put in flight: before or after
# writing its temp file (the windows every put in flight passes through).

CHUNK = MiB  # the chunk size of the mount tests' --chunk-size 1M


def _chunk(index: int) -> ChunkId:
    return ChunkId("b", "w.bin", '"etag"', CHUNK, index)


class _HeldPut:
    """Runs `cache.put(chunk, data)` in a thread and holds it after (or just before) its temp file is
    written; `written` is set once it is held."""

    def __init__(self, cache: DiskCache, chunk: ChunkId, data: bytes, before_write: bool = False):
        self.written, self.release = threading.Event(), threading.Event()
        real = cache._write_tmp

        def write_tmp_then_wait(digest: str, header: bytes, body: bytes) -> str:
            if digest != chunk.digest():
                return real(digest, header, body)
            path = "" if before_write else real(digest, header, body)
            self.written.set()
            self.release.wait(10)
            return real(digest, header, body) if before_write else path

        cache._write_tmp = write_tmp_then_wait  # type: ignore[method-assign]
        self.thread = threading.Thread(target=cache.put, args=(chunk, data))
        self.thread.start()
        assert self.written.wait(10)

    def finish(self) -> None:
        self.release.set()
        self.thread.join(10)


def test_a_put_in_flight_is_counted_once_against_the_free_space_floor(tmpfs) -> None:  # noqa: ANN001
    # Was: its reservation and, once its temp file was written, statvfs both counted it, and the shortfall
    # raised ENOSPC: a spurious 'write failed' warning and 30 s without cache writes.
    data = random_bytes(CHUNK, seed=9)
    with tmpfs("size=16m") as fs, DiskCache(fs / "cache", max_bytes=1 << 30) as cache:
        free = _free(fs)
        cache.min_free_bytes = free - 3 * MiB  # room for 2 chunk files above the floor, not 3
        held = _HeldPut(cache, _chunk(0), data)  # its 1 MiB is on the disk, and statvfs shows it
        try:
            cache.put(_chunk(1), data)  # 1 MiB written + 1 MiB new <= 3 MiB: fits
        finally:
            held.finish()
        assert (cache.stats.write_errors, cache.stats.writes, cache.stats.chunks) == (0, 2, 2), cache.stats
        assert (cache._reserved, cache._unwritten) == (0, 0)


@pytest.mark.parametrize("before_write", [False, True], ids=["temp-file-written", "temp-file-not-yet-written"])
def test_no_room_because_of_puts_in_flight_is_a_quiet_skip(tmpfs, before_write: bool) -> None:  # noqa: ANN001
    data = random_bytes(CHUNK, seed=11)
    with tmpfs("size=16m") as fs, DiskCache(fs / "cache", max_bytes=1 << 30) as cache:
        free = _free(fs)
        cache.min_free_bytes = free - 3 * MiB // 2  # room for one chunk file above the floor, not two
        held = _HeldPut(cache, _chunk(0), data, before_write)
        try:
            cache.put(_chunk(1), data)  # the room is the held put's, and nothing is evictable yet
            assert (cache.stats.writes_skipped, cache.stats.write_errors, cache.stats.writes) == (1, 0, 0)
        finally:
            held.finish()
        assert (cache.stats.writes, cache.stats.chunks) == (1, 1), cache.stats
        cache.put(_chunk(1), data)  # now chunk 0 is indexed: evicted to make the room, no pause
        assert (cache.stats.writes, cache.stats.evictions, cache.stats.write_errors) == (2, 1, 0), cache.stats
        assert cache.get(_chunk(1)) == data and not cache.contains(_chunk(0))
        assert (cache._reserved, cache._unwritten) == (0, 0)


@pytest.mark.parametrize("retry_after_s", [30.0, 0.0], ids=["paused", "retried-at-once"])
@expects_warning(WRITE_WARNING)
def test_a_full_disk_logs_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture, retry_after_s: float,
                                      allowed_logs: list[str]) -> None:
    # Was: the success of a put that started before the failure ended the episode, so the next failing put
    # warned again (plus an info 'writes succeed again'): one warning per put in flight, not one line.
    data = random_bytes(CHUNK, seed=10)
    with DiskCache(tmp_path / "cache", max_bytes=1 << 30, min_free_bytes=0, retry_after_s=retry_after_s) as cache:
        held = _HeldPut(cache, _chunk(0), data)  # started while the disk still had room
        full = threading.Event()
        full.set()  # from here on the disk is full: every new temp file fails
        real = cache._write_tmp

        def write_unless_full(digest: str, header: bytes, body: bytes) -> str:
            if full.is_set() and digest != _chunk(0).digest():
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(digest, header, body)

        cache._write_tmp = write_unless_full  # type: ignore[method-assign]
        cache.put(_chunk(1), data)  # fails: the one warning
        held.finish()  # the put from before the failure lands, and says nothing about the disk now
        assert cache.stats.writes == 1 and cache.contains(_chunk(0))
        cache.put(_chunk(2), data)  # the disk is still full: skipped while paused, else tried and failed
        assert cache.stats.write_errors == (1 if retry_after_s else 2), cache.stats
        assert cache.stats.writes_skipped == (1 if retry_after_s else 0), cache.stats
        warned = [r.getMessage() for r in caplog.records if "write failed" in r.getMessage()]
        assert len(warned) == 1, warned
        assert not any("succeed again" in r.getMessage() for r in caplog.records)

        full.clear()  # space frees: the first put tried after the pause ends the episode
        cache.retry_after_s = 0
        cache.put(_chunk(3), data)
        assert cache.get(_chunk(3)) == data
        assert [r.getMessage() for r in caplog.records if "succeed again" in r.getMessage()] != []
        full.set()  # a new episode: a new warning
        cache.put(_chunk(4), data)
    warned = [r.getMessage() for r in caplog.records if "write failed" in r.getMessage()]
    assert len(warned) == 2, warned


def test_a_cache_size_share_of_a_filesystem_without_a_size_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    """A cache dir on a FUSE or virtual filesystem (statvfs: 0 blocks) gave 80 % of nothing, and the mount
    failed with "max_bytes must be > 0 and min_free_bytes >= 0, got 0, 0"."""
    from fsmount.data.cache_dir import bytes_for_fraction

    real = os.statvfs(tmp_path)
    assert bytes_for_fraction(tmp_path, 0.5) == int(real.f_blocks * real.f_frsize * 0.5)
    empty = os.statvfs_result((4096, 4096, 0, 0, 0, 0, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: empty)
    with pytest.raises(ValueError, match="reports a size of 0"):
        bytes_for_fraction(tmp_path / "cache", 0.8)
    # Given in bytes, the message's advice, it is a cache: no free-space floor to keep of a size nobody knows
    # (it refused the mount with the same message), and its puts are bounded by --cache-size alone.
    assert default_min_free(tmp_path) == 0 and free_bytes(str(tmp_path)) == sys.maxsize
    with DiskCache(tmp_path / "cache", 2 * 64 * KiB + 2 * ALIGN, min_free_bytes=default_min_free(tmp_path)) as cache:
        for i in range(3):
            cache.put(chunk_id(i), payload(chunk_id(i)))
        assert cache.get(chunk_id(2)) == payload(chunk_id(2)) and cache.stats.chunks == 2


def test_a_mount_waits_for_a_cache_dir_whose_holder_is_draining_and_is_refused_by_a_live_one(
        tmp_path: Path) -> None:
    """`modelfs unmount X && modelfs mount X` failed "cache dir in use" while the old daemon, unmounted, still
    wrote its last chunks (to a shared tier: 2.7 s). A holder that says it is draining is waited for; a live mount
    is refused at once, as before."""
    from fsmount.data.cache_dir import CacheDirBusy

    first = DiskCache(tmp_path, BIG, min_free_bytes=0)
    began = time.monotonic()
    with pytest.raises(CacheDirBusy, match=rf"in use by another modelfs mount or cache command \(pid {os.getpid()}\)"):
        DiskCache(tmp_path, BIG, min_free_bytes=0)
    assert time.monotonic() - began < 3  # a live holder: refused (after DRAINING_GRACE_S), not waited for
    first.mark_draining()
    threading.Timer(0.5, first.close).start()  # its drains end
    began = time.monotonic()
    with DiskCache(tmp_path, BIG, min_free_bytes=0) as second:
        assert 0.4 < time.monotonic() - began < 5
        second.put(chunk_id(1), payload(chunk_id(1)))
        # Its lock file replaced meanwhile by what it cannot write (`rm -rf CACHE/*` and worse; the dir's own flock
        # outlives it): said best effort, never raised (it ended the unmounted daemon before its drains).
        os.unlink(tmp_path / "lock")
        (tmp_path / "lock").mkdir()
        second.mark_draining()
    (tmp_path / "lock").rmdir()


def test_a_draining_word_left_in_the_lock_by_a_gone_daemon_does_not_make_the_next_comer_wait_for_a_live_holder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only cache dir keeps the `lock` text of the last daemon that could write it: "PID draining" of a
    daemon long gone. Beside a live read-only mount of it, `modelfs cache verify` (and a second mount) waited
    DRAINING_WAIT_S, saying it waited for that unmounted daemon, then was refused naming its dead pid. The holder
    /proc/locks shows counts: refused at once, naming the live holder."""
    import fsmount.data.cache_dir as cache_dir
    from fsmount.data.cache_dir import CacheDirBusy, acquire_dir_lock, release_dir_lock

    monkeypatch.setattr(cache_dir, "DRAINING_WAIT_S", 3.0)  # the old code's wait, shortened
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that holds nothing
    live = acquire_dir_lock(str(tmp_path))  # the live holder: this process, through its own descriptor
    timer = threading.Timer(0.5, release_dir_lock, [live])
    try:
        (tmp_path / "lock").write_text(f"{gone.pid} draining\n")  # what a read-only holder could not write over
        began = time.monotonic()
        with pytest.raises(CacheDirBusy, match=rf"\(pid {os.getpid()}\)"):
            acquire_dir_lock(str(tmp_path))
        assert time.monotonic() - began < cache_dir.DRAINING_GRACE_S + 1.5  # refused, not waited for
        # A holder that says so itself is still waited for (its own pid with the word).
        (tmp_path / "lock").write_text(f"{os.getpid()} draining\n")
        timer.start()
        began = time.monotonic()
        second = acquire_dir_lock(str(tmp_path))
        assert 0.4 < time.monotonic() - began < 3
        release_dir_lock(second)
    finally:
        if timer.ident is None:  # never started: still ours to release
            release_dir_lock(live)
        else:
            timer.join()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_fifo_or_directory_in_a_chunk_files_place_read_into_an_engine_buffer_is_dropped(
        tmp_path: Path, kind: str, allowed_logs: list[str]) -> None:
    """Read into the engine's buffer (O_DIRECT, the real read path), a FIFO or a directory refused the open with
    EINVAL, which passed for a passing error: the index kept the chunk, every read of it was a miss and every put
    was skipped as held, until a remount (the audit)."""
    allowed_logs.append("dropped corrupt chunk file")
    with DiskCache(tmp_path / "cache", BIG, min_free_bytes=0) as cache:
        data = payload(chunk_id(1))
        cache.put(chunk_id(1), data)
        path = chunk_file_of(cache, chunk_id(1))
        os.unlink(path)
        if kind == "fifo":
            os.mkfifo(path)
        else:
            os.mkdir(path)
        assert cache.get(chunk_id(1), new_buffer(len(data))) is None
        assert not cache.contains(chunk_id(1))  # dropped: the next put writes it again
        if kind == "directory":
            os.rmdir(path)  # what the cache does not remove itself (a directory of someone's)
        cache.put(chunk_id(1), data)
        assert bytes(cache.get(chunk_id(1), new_buffer(len(data)))) == data


def test_keep_free_where_chunks_cannot_be_removed_keeps_serving_them(tmpfs, monkeypatch) -> None:  # noqa: ANN001
    """A disk below its floor whose chunk files cannot be removed (another owner's warm cache, `chattr +i`): each
    check dropped chunks from the index, freeing nothing, until none was served (the review)."""
    with tmpfs("size=4m") as fs:
        stored = [chunk_id(i) for i in range(8)]
        with DiskCache(fs / "c", BIG, min_free_bytes=0) as cache:
            for c in stored:
                cache.put(c, payload(c, 256 * KiB))
        _fill(fs / "someone-elses-file")
        with DiskCache(fs / "c", BIG, min_free_bytes=MiB) as cache:
            def refused(path: str, *args: object, **kwargs: object) -> None:
                raise PermissionError(errno.EPERM, "Operation not permitted", path)

            with monkeypatch.context() as patched:
                patched.setattr(disk_cache.os, "unlink", refused)
                assert [cache.keep_free() for _ in range(3)] == [0, 0, 0]
            assert [c for c in stored if cache.get(c) == payload(c, 256 * KiB)] == stored
            assert cache.keep_free() > 0  # removable again: the floor is freed
