"""The local copy of a file being written (fsmount/write_staging.py): every byte reads back as written, through
O_DIRECT where the filesystem takes it and through the page cache where it does not."""

from __future__ import annotations

import errno
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fsmount import write_staging
from fsmount.data import ChunkId, disk_cache
from fsmount.data.disk_cache import DiskCache
from fsmount.write_staging import BLOCK, DIRECT_COPIES, StagedFile, Staging

MiB = 1 << 20


class CountingFds:
    """Bytes written per descriptor opened with O_DIRECT or without, by wrapping os.open and os.pwrite."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, refuse: str = "", direct_delay: float = 0.0) -> None:
        self.direct_fds: set[int] = set()
        self.direct_bytes = 0
        self.buffered_bytes = 0
        self.direct_opens = 0
        real_open, real_pwrite = os.open, os.pwrite

        def fake_open(path, flags, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if flags & os.O_DIRECT:
                self.direct_opens += 1
                if refuse == "open":
                    raise OSError(errno.EINVAL, "Invalid argument")
                if refuse == "no fds":
                    raise OSError(errno.EMFILE, "Too many open files")
                fd = real_open(path, flags, *args, **kwargs)
                self.direct_fds.add(fd)
                return fd
            return real_open(path, flags, *args, **kwargs)

        def fake_pwrite(fd, data, offset):  # noqa: ANN001, ANN202
            if fd in self.direct_fds:
                if refuse == "write":
                    raise OSError(errno.EINVAL, "Invalid argument")
                time.sleep(direct_delay)  # a slow disk: later writes and reads must wait for this one
                n = real_pwrite(fd, data, offset)
                self.direct_bytes += n
                return n
            n = real_pwrite(fd, data, offset)
            self.buffered_bytes += n
            return n

        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "pwrite", fake_pwrite)


class DictCache:
    def __init__(self) -> None:
        self.chunks: dict[int, bytes] = {}

    def put(self, chunk: ChunkId, data: bytes) -> None:
        self.chunks[chunk.index] = bytes(data)


def read_back(staged: StagedFile, size: int, rng: random.Random) -> bytes:
    """The whole copy through read_into, in pieces of assorted sizes and alignments."""
    out, at = bytearray(), 0
    while at < size:
        n = min(size - at, rng.choice([3 * MiB, MiB, 5000, 4096 * 7, 2 * MiB + 17]))
        buf = bytearray(n)
        assert staged.read_into(at, buf)
        out += buf
        at += n
    return bytes(out)


def to_cache(staged: StagedFile, size: int, chunk_size: int) -> bytes:
    cache = DictCache()
    count = staged.to_cache(cache, lambda i: ChunkId("b", "k", "etag", chunk_size, i), size, chunk_size)
    assert count == len(cache.chunks) == -(-size // chunk_size)
    assert not staged.ok  # the copy is gone once it is in the cache
    return b"".join(cache.chunks[i] for i in range(count))


def write_deferred(staged: StagedFile, rng: random.Random) -> bytearray:
    """safetensors' save_file: extended first, then an unaligned header and 1 MiB appends, the last short."""
    size = 9 * MiB + 12345
    staged.extend(size)
    ref = bytearray(size)
    pieces = [8 + 1234] + [MiB] * 9
    at = 0
    for n in pieces:
        n = min(n, size - at)
        data = rng.randbytes(n)
        staged.write(at, memoryview(data))
        ref[at:at + n] = data
        at += n
    return ref


def write_parts(staged: StagedFile, rng: random.Random) -> bytearray:
    """A streamed file's parts, each staged as it is sent: a few at once, so not always in order."""
    part, size = 2 * MiB, 9 * MiB + 777
    ref = bytearray(rng.randbytes(size))
    starts = list(range(0, size, part))
    rng.shuffle(starts)
    for start in starts:
        staged.write(start, bytearray(ref[start:start + part]))
    return ref


def write_mixed(staged: StagedFile, rng: random.Random) -> bytearray:
    """Appends of every size, with now and then a write that does not continue the one before."""
    ref = bytearray()
    for _ in range(40):
        if ref and rng.random() < 0.2:
            at = rng.randrange(len(ref))
        else:
            at = len(ref)
        data = rng.randbytes(rng.choice([1, 100, 4096, BLOCK, BLOCK - 1, BLOCK + 4097, 3 * BLOCK + 5]))
        staged.write(at, data)
        if at + len(data) > len(ref):
            ref.extend(bytes(at + len(data) - len(ref)))
        ref[at:at + len(data)] = data
    return ref


@pytest.mark.parametrize("pattern", [write_deferred, write_parts, write_mixed])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("disk", ["fast", "slow"])
def test_the_copy_reads_back_as_written_and_bypasses_the_page_cache(tmp_path: Path, monkeypatch, pattern,
                                                                   seed: int, disk: str) -> None:
    fds = CountingFds(monkeypatch, direct_delay=0.01 if disk == "slow" else 0.0)
    rng = random.Random(seed)
    staging = Staging(str(tmp_path))
    staged = staging.open()
    assert staged is not None
    ref = pattern(staged, rng)
    assert read_back(staged, len(ref), rng) == ref
    assert staged.read_into(len(ref) - 5, bytearray(5))  # a read at an unaligned offset near the end
    assert to_cache(staged, len(ref), 4 * MiB) == ref
    # tmp_path is on ext4 here: most bytes went to the disk with O_DIRECT, not through the page cache.
    assert fds.direct_bytes >= len(ref) - 4 * BLOCK, (fds.direct_bytes, fds.buffered_bytes)
    assert os.listdir(staging.root) == []


@pytest.mark.parametrize("refuse", ["open", "write"])
def test_a_filesystem_refusing_o_direct_gets_the_copy_through_the_page_cache(tmp_path: Path, monkeypatch, caplog,
                                                                           refuse: str) -> None:
    fds = CountingFds(monkeypatch, refuse)
    caplog.set_level(logging.INFO, logger="fsmount.write_staging")
    staging = Staging(str(tmp_path))
    rng = random.Random(7)
    for _ in range(2):
        staged = staging.open()
        assert staged is not None
        ref = write_deferred(staged, rng)
        assert read_back(staged, len(ref), rng) == ref
        assert to_cache(staged, len(ref), 4 * MiB) == ref
    assert fds.direct_bytes == 0
    assert fds.direct_opens == 1  # not tried again after the refusal
    refusals = [r for r in caplog.records if "O_DIRECT not supported" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.INFO


def test_a_discarded_copy_frees_its_descriptors(tmp_path: Path) -> None:
    staging = Staging(str(tmp_path))
    staged = staging.open()
    assert staged is not None
    staged.write(0, b"x" * (BLOCK + 10))
    fds_before = len(os.listdir("/proc/self/fd"))
    staged.discard()
    assert len(os.listdir("/proc/self/fd")) == fds_before - 2  # the buffered and the O_DIRECT one
    assert not staged.ok and not staged.read_into(0, bytearray(1))
    staged.write(0, b"late")  # a write racing the discard is dropped, never raises
    assert os.listdir(staging.root) == []


@pytest.mark.parametrize("fails", ["direct", "buffered"])
def test_a_full_disk_ends_the_copy_with_one_warning(tmp_path: Path, monkeypatch, caplog, allowed_logs,
                                                    fails: str) -> None:
    """ENOSPC (not EINVAL) is no reason to leave O_DIRECT: the copy ends, is removed, and says so once."""
    allowed_logs.append("cannot keep written files")
    fds = CountingFds(monkeypatch)
    real_pwrite = os.pwrite

    def full_disk(fd, data, offset):  # noqa: ANN001, ANN202
        if (fd in fds.direct_fds) == (fails == "direct") and offset >= 2 * BLOCK:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    caplog.set_level(logging.INFO, logger="fsmount.write_staging")
    staging = Staging(str(tmp_path))
    copies = [staging.open(), staging.open()]
    for staged in copies:
        assert staged is not None
        staged.write(0, b"h" * 100)  # the unaligned head goes through the page cache
        for at in range(100, 4 * BLOCK, BLOCK):
            staged.write(at, b"x" * BLOCK)
        staged.extend(5 * BLOCK)  # settles the partial block: through the page cache
        assert not staged.ok and not staged.read_into(0, bytearray(10))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert not any("O_DIRECT not supported" in r.getMessage() for r in caplog.records)
    assert os.listdir(staging.root) == []


def test_at_most_direct_copies_hold_a_block_at_once(tmp_path: Path, monkeypatch) -> None:
    """The blocks' memory is bounded (the mount takes STAGING_BYTES out of the budget): copies past
    DIRECT_COPIES go through the page cache, and a copy that ends gives its block back."""
    fds = CountingFds(monkeypatch)
    staging = Staging(str(tmp_path))
    copies = [staging.open() for _ in range(DIRECT_COPIES + 2)]
    assert fds.direct_opens == DIRECT_COPIES
    rng = random.Random(3)
    refs = [write_deferred(staged, rng) for staged in copies if staged is not None]
    assert [read_back(staged, len(ref), rng) for staged, ref in zip(copies, refs, strict=True)] == refs
    copies[0].discard()
    copies[1].discard()
    again = [staging.open(), staging.open(), staging.open()]
    assert fds.direct_opens == DIRECT_COPIES + 2  # the two blocks given back, then the page cache again
    for staged in copies[2:] + again:
        staged.discard()
    assert staging.open() is not None and fds.direct_opens == DIRECT_COPIES + 3


def test_a_copy_without_an_o_direct_descriptor_still_works_and_the_next_one_tries_again(tmp_path: Path, monkeypatch,
                                                                                       caplog) -> None:
    fds = CountingFds(monkeypatch, refuse="no fds")
    caplog.set_level(logging.INFO, logger="fsmount.write_staging")
    staging = Staging(str(tmp_path))
    rng = random.Random(11)
    for tries in (1, 2):
        staged = staging.open()
        assert staged is not None
        ref = write_deferred(staged, rng)
        assert to_cache(staged, len(ref), 4 * MiB) == ref
        assert fds.direct_opens == tries  # EMFILE is not the filesystem refusing O_DIRECT
    assert not any(r.levelno >= logging.INFO for r in caplog.records)
    assert os.listdir(staging.root) == []


class GatedDisk:
    """O_DIRECT writes wait until `open()`: a disk that has not finished the block it was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fds = CountingFds(monkeypatch)
        self.gate = threading.Event()
        counting = os.pwrite

        def gated(fd, data, offset):  # noqa: ANN001, ANN202
            if fd in self.fds.direct_fds:
                assert self.gate.wait(10)
            return counting(fd, data, offset)

        monkeypatch.setattr(os, "pwrite", gated)

    def open(self) -> None:
        self.gate.set()


def blocked(fn, *args) -> threading.Thread:  # noqa: ANN001
    """`fn(*args)` in a thread that, 0.2 s later, has still not returned."""
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    thread.join(0.2)
    assert thread.is_alive(), f"{fn.__name__} did not wait for the disk"
    return thread


def test_a_full_block_is_written_while_the_next_one_gathers(tmp_path: Path, monkeypatch) -> None:
    """A WRITE that fills a block returns without waiting for the disk: the block goes to a staging thread and the
    second one gathers. Only the next full block, which needs the first one's buffer, waits for its write."""
    disk = GatedDisk(monkeypatch)
    staged = Staging(str(tmp_path)).open()
    assert staged is not None
    data = random.Random(5).randbytes(2 * BLOCK + 300)
    staged.write(0, data[:BLOCK])  # block 0: to the staging thread, whose disk has not written it yet
    staged.write(BLOCK, data[BLOCK:BLOCK + 100])  # gathers into the other block
    third = blocked(staged.write, BLOCK + 100, data[BLOCK + 100:])  # fills block 1: waits for block 0's buffer
    disk.open()
    third.join(10)
    assert staged.ok and read_back(staged, len(data), random.Random(1)) == data
    assert disk.fds.direct_bytes == 2 * BLOCK
    staged.discard()


def test_reads_and_writes_elsewhere_wait_for_the_block_being_written(tmp_path: Path, monkeypatch) -> None:
    """A write that does not continue the gathered bytes may land in the range of the block being written, and a
    read needs that block on the disk: both wait for it, so the copy holds the last write to every offset."""
    disk = GatedDisk(monkeypatch)
    staged = Staging(str(tmp_path)).open()
    assert staged is not None
    data = bytearray(random.Random(6).randbytes(BLOCK + 10))
    staged.write(0, bytes(data[:BLOCK]))
    rewrite = blocked(staged.write, 100, b"later")  # inside block 0, which the disk is still writing
    data[100:105] = b"later"
    reader_got = bytearray(BLOCK)
    reader = threading.Thread(target=staged.read_into, args=(0, reader_got), daemon=True)
    reader.start()
    disk.open()
    rewrite.join(10)
    reader.join(10)
    staged.write(BLOCK, bytes(data[BLOCK:]))
    assert read_back(staged, len(data), random.Random(2)) == data
    staged.discard()


def test_a_discard_waits_for_the_block_being_written_before_closing(tmp_path: Path, monkeypatch) -> None:
    """The staging thread's write is never left with a closed descriptor, whose number could name another file by
    then: `discard` (the trio thread, when a file fails) waits for it."""
    disk = GatedDisk(monkeypatch)
    staging = Staging(str(tmp_path))
    staged = staging.open()
    assert staged is not None
    staged.write(0, b"x" * BLOCK)
    discard = blocked(staged.discard)
    assert staged.ok  # nothing closed yet
    disk.open()
    discard.join(10)
    assert not staged.ok and os.listdir(staging.root) == []


def test_a_deferred_copy_is_promised_room_on_the_disk_beside_the_others(tmp_path: Path, monkeypatch) -> None:
    """A deferred file's bytes are nowhere else until close: its copy is made only where the disk has room for
    its whole size beside what other deferred copies were promised, and a discarded copy gives its room back."""
    real_statvfs = os.statvfs

    class Room:
        def __init__(self, st: os.statvfs_result):
            self.f_frsize, self.f_bavail = 4096, (10 * MiB) // 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Room(real_statvfs(path)))
    staging = Staging(str(tmp_path))
    first, second, third = staging.open(), staging.open(), staging.open()
    assert first is not None and second is not None and third is not None
    assert not first.promise(11 * MiB)
    assert first.promise(6 * MiB)
    assert not second.promise(5 * MiB)
    assert second.promise(4 * MiB)
    first.discard()
    assert third.promise(6 * MiB)
    assert not first.promise(1)  # a discarded copy promises nothing
    second.discard()
    third.discard()
    assert staging.promise(10 * MiB)


def test_the_copies_leave_the_floor_of_free_space_to_the_node(tmp_path: Path, monkeypatch, caplog,
                                                               allowed_logs) -> None:
    """B590: a copy ends (removed, one warning) where growing it would leave less than `min_free_bytes` free on its
    disk, and a deferred copy is promised only room beyond that floor; before, a copy went on until ENOSPC."""
    allowed_logs.append("cannot keep written files")
    real_statvfs = os.statvfs
    written: list[int] = []  # what the test wrote, which the disk below loses from its 10 MiB

    class Room:
        def __init__(self, st: os.statvfs_result):
            self.f_frsize, self.f_bavail, self.f_blocks = 4096, (10 * MiB - sum(written)) // 4096, 25600

    class NoSize:  # a FUSE or virtual filesystem that reports no size: only ENOSPC ends a copy there
        def __init__(self, st: os.statvfs_result):
            self.f_frsize, self.f_bavail, self.f_blocks = 4096, 0, 0

    monkeypatch.setattr(os, "statvfs", lambda path: NoSize(real_statvfs(path)))
    staged = Staging(str(tmp_path), min_free_bytes=0).open()
    assert staged is not None
    for at in range(0, 4 * MiB, MiB):
        staged.write(at, b"x" * MiB)
    assert staged.ok
    staged.discard()
    monkeypatch.setattr(os, "statvfs", lambda path: Room(real_statvfs(path)))
    caplog.set_level(logging.INFO, logger="fsmount.write_staging")
    staging = Staging(str(tmp_path), min_free_bytes=4 * MiB)
    deferred = staging.open()
    assert deferred is not None
    assert not deferred.promise(7 * MiB)  # 3 MiB would be left
    assert deferred.promise(6 * MiB)
    deferred.discard()
    staged = staging.open()
    assert staged is not None
    for at in range(0, 8 * MiB, MiB):
        staged.write(at, b"x" * MiB)
        if not staged.ok:
            break
        written.append(MiB)
    assert sum(written) == 6 * MiB and not staged.ok
    assert staged.error is not None and staged.error.errno == errno.ENOSPC
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "less than 4.00 MiB would be left free" in warnings[0], warnings
    assert os.listdir(staging.root) == []


def test_a_deferred_copy_written_past_its_promise_is_not_ended_at_the_floor(tmp_path: Path, monkeypatch) -> None:
    """B640: a deferred file's bytes are only in its copy until close, so a copy ended at the floor of free space
    failed the file (ENOSPC to its writer) on a disk that still had room, where it was written past the size its
    `ftruncate` promised. Only ENOSPC ends it, as before B590; and its WRITEs ask the disk nothing."""
    real_statvfs = os.statvfs
    written: list[int] = []
    asked: list[str] = []

    class Room:
        def __init__(self, st: os.statvfs_result):
            asked.append("statvfs")
            self.f_frsize, self.f_bavail, self.f_blocks = 4096, (10 * MiB - sum(written)) // 4096, 25600

    monkeypatch.setattr(os, "statvfs", lambda path: Room(real_statvfs(path)))
    staging = Staging(str(tmp_path), min_free_bytes=4 * MiB)
    staged = staging.open()
    assert staged is not None and staged.promise(4 * MiB)
    asked.clear()
    for at in range(0, 5 * MiB, MiB):  # one MiB past the promise, with 6 MiB free: below the floor, but room
        staged.write(at, b"x" * MiB)
        written.append(MiB)
    assert staged.ok, staged.error
    assert asked == []
    staged.discard()


def test_a_copy_at_the_floor_has_the_cache_evict_its_oldest_chunks_for_it(tmp_path: Path, monkeypatch) -> None:
    """B680: on a disk the NVMe cache fills up to its floor of free space, a streamed copy had no room beyond it
    (B590) and ended at its first part, so no checkpoint written on the node reached its cache. The cache evicts its
    least recently used chunks for the room the copy lacks, no more, and the copy is kept whole."""
    real_statvfs = os.statvfs
    disk = 40 * MiB  # a disk whose only files are the cache dir's: what is under tmp_path takes its room

    def used() -> int:
        return sum(os.lstat(os.path.join(top, name)).st_blocks * 512
                   for top, _, names in os.walk(tmp_path) for name in names)

    class Disk:
        def __init__(self, st: os.statvfs_result):
            self.f_frsize, self.f_blocks, self.f_flag = 4096, disk // 4096, 0
            self.f_bavail = max(0, disk - used()) // 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Disk(real_statvfs(path)))
    chunk = MiB
    with DiskCache(tmp_path, 1 << 30, min_free_bytes=8 * MiB) as cache:
        old = [ChunkId("b", "old", "etag", chunk, i) for i in range(40)]
        for chunk_id in old:  # 40 MiB of chunks on a 40 MiB disk: the cache stops at its floor
            cache.put(chunk_id, bytes([chunk_id.index]) * chunk)
        held = cache.stats.chunks
        assert 0 < held < 32 and disk - used() < 8 * MiB + 2 * chunk, (held, used())
        staging = Staging(str(tmp_path), min_free_bytes=cache.min_free_bytes, cache=cache)
        staged = staging.open()
        assert staged is not None
        size = 6 * MiB + 12345
        data = random.Random(680).randbytes(size)
        for at in range(0, size, 2 * MiB):  # a streamed file's parts
            staged.write(at, data[at:at + 2 * MiB])
        assert staged.ok, staged.error
        # What the copy needed, a chunk file's header and a part's rounding past it at most: not the whole cache.
        evicted = held - cache.stats.chunks
        assert 6 <= evicted <= 9, evicted
        assert disk - used() >= 8 * MiB - 2 * MiB  # the copy's last block may still be on its way to the disk
        new = lambda i: ChunkId("b", "new", "etag", chunk, i)  # noqa: E731
        assert staged.to_cache(cache, new, size, chunk) == 7
        for i in range(7):
            assert cache.get(new(i)) == data[i * chunk:(i + 1) * chunk], i
        assert not cache.contains(old[0]) and cache.contains(old[-1])  # the oldest went first
        assert os.listdir(staging.root) == []


def small_disk(tmp_path: Path, monkeypatch, disk: int) -> Callable[[], int]:
    """statvfs of a `disk`-byte filesystem whose only files are those under tmp_path; what they take, returned."""
    real_statvfs = os.statvfs

    def used() -> int:
        total = 0
        for top, _, names in os.walk(tmp_path):
            for name in names:
                try:
                    total += os.lstat(os.path.join(top, name)).st_blocks * 512
                except FileNotFoundError:  # a put's temp file renamed, or a chunk evicted, meanwhile
                    pass
        return total

    class Disk:
        def __init__(self, st: os.statvfs_result):
            self.f_frsize, self.f_blocks, self.f_flag = 4096, disk // 4096, 0
            self.f_bavail = max(0, disk - used()) // 4096

    monkeypatch.setattr(os, "statvfs", lambda path: Disk(real_statvfs(path)))
    return used


def filled_to_its_floor(cache: DiskCache, chunk: int) -> list[ChunkId]:
    old = [ChunkId("b", "old", "etag", chunk, i) for i in range(40)]
    for chunk_id in old:  # 40 MiB of chunks on a 40 MiB disk: the cache stops at its floor
        cache.put(chunk_id, bytes([chunk_id.index]) * chunk)
    return old


def test_a_pre_sized_copy_on_a_full_cache_disk_is_promised_the_room_the_cache_evicts_for_it(
        tmp_path: Path, monkeypatch) -> None:
    """B730: on a disk the NVMe cache fills up to its floor, a pre-sized file's copy was promised only room beyond
    the floor, so it was never deferred (save_file streamed, and its rename cost a server-side copy). The cache's
    chunks count as room; its first write (in a staging thread) has the cache evict for what is short, no more."""
    disk, chunk = 40 * MiB, MiB
    used = small_disk(tmp_path, monkeypatch, disk)
    with DiskCache(tmp_path, 1 << 30, min_free_bytes=8 * MiB) as cache:
        old = filled_to_its_floor(cache, chunk)
        held = cache.stats.chunks
        room = disk - used() - 8 * MiB
        assert 0 < held < 32 and room < 2 * chunk, (held, room)
        staging = Staging(str(tmp_path), min_free_bytes=cache.min_free_bytes, cache=cache)
        staged = staging.open()
        assert staged is not None
        size = 6 * MiB + 12345
        assert staged.promise(size)
        assert cache.stats.chunks == held  # nothing evicted in the trio thread
        assert not staging.promise(disk)  # never more than the cache holds
        data = random.Random(730).randbytes(size)
        for at in range(0, size, MiB):  # a deferred file's WRITEs
            staged.write(at, data[at:at + MiB])
        assert staged.ok, staged.error
        evicted = held - cache.stats.chunks
        short = -(-(size - room) // chunk)
        assert short <= evicted <= short + 1, (evicted, short)  # a chunk file's header past it at most
        new = lambda i: ChunkId("b", "new", "etag", chunk, i)  # noqa: E731
        assert staged.to_cache(cache, new, size, chunk) == 7
        for i in range(7):
            assert cache.get(new(i)) == data[i * chunk:(i + 1) * chunk], i
        assert not cache.contains(old[0]) and cache.contains(old[-1])
        assert disk - used() >= 8 * MiB - 2 * chunk  # its put evicted for it: the floor, a put's rounding aside
        assert cache._held == 0


def test_a_large_promise_evicts_a_slice_per_lock_section(tmp_path: Path, monkeypatch) -> None:
    """B800: a deferred copy's first WRITE held its whole promise with the cache at once, and on a disk the cache fills
    to its floor evicted for all of it under the cache's lock: a checkpoint's gigabytes of chunk unlinks, which every
    read's get (a miss after LOCK_WAIT_S) and put waited for. It holds and evicts a slice per lock section."""
    disk, chunk = 40 * MiB, MiB
    used = small_disk(tmp_path, monkeypatch, disk)
    monkeypatch.setattr(disk_cache, "HOLD_SLICE", 4 * MiB, raising=False)
    with DiskCache(tmp_path, 1 << 30, min_free_bytes=8 * MiB) as cache:
        filled_to_its_floor(cache, chunk)
        held = cache.stats.chunks
        room = disk - used() - 8 * MiB
        staged = Staging(str(tmp_path), min_free_bytes=cache.min_free_bytes, cache=cache).open()
        assert staged is not None
        size = 20 * MiB
        assert staged.promise(size)
        real_evict = cache._evict_locked
        freed: list[int] = []

        def evict(need: int) -> None:  # called under the lock: what one lock section evicts
            before = cache.stats.bytes_used
            real_evict(need)
            freed.append(before - cache.stats.bytes_used)

        monkeypatch.setattr(cache, "_evict_locked", evict)
        staged.write(0, random.Random(800).randbytes(MiB))
        assert staged.ok, staged.error
        assert held - cache.stats.chunks >= (size - room) // chunk  # evicted for what was short, all the same
        assert len(freed) > 1 and max(freed) <= 4 * MiB + 2 * chunk, freed
        staged.discard()
        assert cache._held == 0


@pytest.mark.parametrize("how", ["write fails", "extend fails", "no room", "deferred write fails", "deferred discarded",
                                 "read fails", "stored"])
def test_what_a_copy_holds_with_the_cache_is_given_back_however_it_ends(tmp_path: Path, monkeypatch, allowed_logs,
                                                                        how: str) -> None:
    """B731's holds guard a rule of their own: every byte a copy holds with the cache (`DiskCache.hold`) is given back
    however the copy ends (a failed write or extend, ENOSPC at the floor, a discard, a failed read, the file stored),
    else the cache would count it as taken for good and stop caching."""
    allowed_logs.append("cannot keep written files")
    disk, chunk = 40 * MiB, MiB
    small_disk(tmp_path, monkeypatch, disk)
    with DiskCache(tmp_path, 1 << 30, min_free_bytes=8 * MiB) as cache:
        filled_to_its_floor(cache, chunk)
        staging = Staging(str(tmp_path), min_free_bytes=cache.min_free_bytes, cache=cache)
        staged = staging.open()
        assert staged is not None
        data = random.Random(801).randbytes(3 * MiB + 777)
        if how.startswith("deferred"):
            assert staged.promise(8 * MiB)
        staged.write(0, data[:MiB + 5])  # a block out, a partial one gathered
        assert staged.ok and cache._held > 0, (staged.error, cache._held)

        def fail(*args: object) -> None:
            raise OSError(errno.EIO, "injected")

        if how in ("write fails", "deferred write fails"):
            monkeypatch.setattr(write_staging, "pwrite_all", fail)
            staged.write(MiB + 5, data[MiB + 5:])
            staged.write(4 * MiB, data)  # not a continuation: the gathered bytes go out, and fail
        elif how == "extend fails":
            monkeypatch.setattr(os, "ftruncate", fail)
            staged.extend(len(data))
        elif how == "no room":
            staged.write(MiB + 5, bytes(disk))  # past the floor, even with every chunk evicted: ENOSPC
        elif how == "deferred discarded":
            staged.discard()
        elif how == "read fails":
            monkeypatch.setattr(os, "preadv", fail)
            assert not staged.read_into(0, bytearray(MiB))
        else:
            staged.write(MiB + 5, data[MiB + 5:])
            assert staged.to_cache(cache, lambda i: ChunkId("b", "new", "etag", chunk, i), len(data), chunk) == 4
        assert not staged.ok
        assert cache._held == 0


def test_a_put_racing_a_copy_s_part_leaves_the_floor_free(tmp_path: Path, monkeypatch) -> None:
    """B731: a streamed copy checked its room, then wrote its part outside any lock; a chunk put between the two
    found the same free bytes and took them too, and the disk was below the floor until the cache's next floor
    check (every 5 s). The copy's part is held with the cache until it is in the file: the put evicts for it."""
    disk, chunk = 40 * MiB, MiB
    used = small_disk(tmp_path, monkeypatch, disk)
    with DiskCache(tmp_path, 1 << 30, min_free_bytes=8 * MiB) as cache:
        old = filled_to_its_floor(cache, chunk)
        staging = Staging(str(tmp_path), min_free_bytes=cache.min_free_bytes, cache=cache)
        staging._direct = False  # the part goes to the file in the write itself, which the gate holds
        staged = staging.open()
        assert staged is not None
        gate, at_gate = threading.Event(), threading.Event()
        real_pwrite_all = write_staging.pwrite_all

        def gated(fd: int, view: memoryview, offset: int) -> None:
            at_gate.set()
            assert gate.wait(10)
            real_pwrite_all(fd, view, offset)

        monkeypatch.setattr(write_staging, "pwrite_all", gated)
        part = random.Random(731).randbytes(2 * MiB)
        writer = blocked(staged.write, 0, part)  # past its room check, its bytes not yet on the disk
        assert at_gate.wait(10)
        new = ChunkId("b", "new", "etag", chunk, 0)
        cache.put(new, b"n" * chunk)
        gate.set()
        writer.join(10)
        assert staged.ok, staged.error
        assert disk - used() >= 8 * MiB, disk - used()  # no floor check ran: the put left the floor itself
        assert cache.contains(new) and not cache.contains(old[0])
        staged.discard()
        assert cache._held == 0


def test_the_cache_s_puts_leave_a_deferred_copy_the_room_it_was_promised(tmp_path: Path, monkeypatch) -> None:
    """B731: the cache's puts did not see a deferred copy's promise, so chunks read while a pre-sized checkpoint was
    written took the room promised to it, and the copy (ended only at ENOSPC, B640) took the disk below the floor, or
    failed the file. From its first WRITE the promise is held with the cache: the puts evict older chunks instead."""
    disk, chunk = 40 * MiB, MiB
    used = small_disk(tmp_path, monkeypatch, disk)
    with DiskCache(tmp_path, 1 << 30, min_free_bytes=8 * MiB) as cache:
        old = [ChunkId("b", "old", "etag", chunk, i) for i in range(20)]
        for chunk_id in old:
            cache.put(chunk_id, bytes([chunk_id.index]) * chunk)
        assert cache.stats.chunks == 20 and disk - used() > 18 * MiB  # room beyond the floor for the promise
        staged = Staging(str(tmp_path), min_free_bytes=cache.min_free_bytes, cache=cache).open()
        assert staged is not None
        size = 10 * MiB
        assert staged.promise(size)
        data = random.Random(7311).randbytes(size)
        staged.write(0, data[:MiB])
        read = [ChunkId("b", "read", "etag", chunk, i) for i in range(10)]
        for chunk_id in read:  # a model read meanwhile fills the cache
            cache.put(chunk_id, bytes([chunk_id.index]) * chunk)
        for at in range(MiB, size, MiB):
            staged.write(at, data[at:at + MiB])
        assert staged.ok, staged.error
        assert disk - used() >= 8 * MiB, disk - used()
        assert all(cache.contains(chunk_id) for chunk_id in read) and not cache.contains(old[0])
        staged.discard()
        assert cache._held == 0


def test_a_file_larger_than_half_the_cache_s_older_chunks_is_cached_whole(tmp_path: Path, monkeypatch) -> None:
    """B732: a stored file's chunks went into the cache while its whole copy still took its size on the disk, so on a
    disk the cache fills to its floor the puts of a file larger than about half the older chunks evicted the file's
    own first chunks, and the cache kept only its tail. The copy gives each chunk's bytes back once it is put."""
    disk, chunk = 40 * MiB, MiB
    used = small_disk(tmp_path, monkeypatch, disk)
    with DiskCache(tmp_path, 1 << 30, min_free_bytes=8 * MiB) as cache:
        old = filled_to_its_floor(cache, chunk)
        staged = Staging(str(tmp_path), min_free_bytes=cache.min_free_bytes, cache=cache).open()
        assert staged is not None
        size = 20 * MiB - 4321  # more than half of the ~31 chunks the cache held
        data = random.Random(732).randbytes(size)
        for at in range(0, size, 2 * MiB):
            staged.write(at, data[at:at + 2 * MiB])
        assert staged.ok, staged.error
        new = lambda i: ChunkId("b", "new", "etag", chunk, i)  # noqa: E731
        assert staged.to_cache(cache, new, size, chunk) == 20
        kept = [i for i in range(20) if cache.get(new(i)) == data[i * chunk:(i + 1) * chunk]]
        assert kept == list(range(20))
        assert cache.contains(old[-1])  # older chunks went for it, not the file's own
        assert disk - used() >= 8 * MiB


@pytest.mark.parametrize(("left", "said"), [(1, "removed 1 copy of a file (1 B)"),
                                             (2, "removed 2 copies of files (2 B)")])
def test_the_copies_a_killed_mount_left_are_counted_in_words_that_fit(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                      left: int, said: str) -> None:
    """The next mount of the dir removes them and says how many: one was "removed 1 copies of files"; and how much,
    truly: copies under 1 MiB were "(0 MiB)", as if empty."""
    (tmp_path / "writes").mkdir()
    for n in range(1, left + 1):
        (tmp_path / "writes" / str(n)).write_bytes(b"x")
    caplog.set_level(logging.INFO, logger="fsmount.write_staging")
    Staging(str(tmp_path))
    assert [r.getMessage() for r in caplog.records if said in r.getMessage()], caplog.text
    assert os.listdir(tmp_path / "writes") == []
