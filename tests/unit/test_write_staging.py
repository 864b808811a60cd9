"""The local copy of a file being written (fsmount/write_staging.py): every byte reads back as written, through
O_DIRECT where the filesystem takes it and through the page cache where it does not."""

from __future__ import annotations

import errno
import logging
import os
import random
from pathlib import Path

import pytest

from fsmount.data import ChunkId
from fsmount.write_staging import BLOCK, DIRECT_COPIES, StagedFile, Staging

MiB = 1 << 20


class CountingFds:
    """Bytes written per descriptor opened with O_DIRECT or without, by wrapping os.open and os.pwrite."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, refuse: str = "") -> None:
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
def test_the_copy_reads_back_as_written_and_bypasses_the_page_cache(tmp_path: Path, monkeypatch, pattern,
                                                                   seed: int) -> None:
    fds = CountingFds(monkeypatch)
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
