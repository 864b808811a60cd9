"""Many handles: real mounts that open 1000 files at once, or open/read/close 10,000 times, and leak
nothing the daemon holds: file descriptors, memory (RSS), threads, file handles (`open_files`) or
inodes (`inodes`, the kernel-held part of the inode table, in the stats snapshot).

Everything is measured in the daemon process itself (`mounted()` execs it in place of the trampoline,
so `m.proc.pid` is the daemon) before and after. Inodes are released when the kernel sends FORGET;
`echo 2 > /proc/sys/vm/drop_caches` evicts the mount's unused dentries and inodes, which makes it send
them. RELEASE and FORGET are asynchronous to close() and to the eviction, so every "after" waits on its
condition with a deadline instead of sleeping.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest

from fsmount.config import DEFAULT_MAX_CONNECTIONS
from tests.helpers import (
    KiB,
    MiB,
    S3Server,
    drop_kernel_caches,
    fds_by_kind,
    mount_stats,
    mounted,
    new_bucket,
    proc_status,
    put_objects,
    wait_for,
)

# The chunk memory of these mounts is bounded explicitly, so RSS has a stated ceiling (config.py:
# --memory-limit bounds the daemon's RSS, chunk data gets it less RUNTIME_RESERVE).
MEMORY_LIMIT = "192M"
# How long an asynchronous RELEASE / FORGET / idle thread exit may take on a loaded 2-core machine.
SETTLE_S = 30.0
# Sockets the daemon may hold: the GET pool (max connections + 4, presigned.py), plus trio's wake-up socket
# pair and slack: a read-only mount's few metadata calls at a time reuse its boto3 connections.
MAX_SOCKETS = DEFAULT_MAX_CONNECTIONS + 4 + 4


class Sample(NamedTuple):
    rss_kib: int
    threads: int
    sockets: int
    other_fds: int
    open_files: int
    inodes: int


def sample(pid: int, mountpoint: Path) -> Sample:
    stats = mount_stats(mountpoint)
    return Sample(proc_status(pid, "VmRSS"), proc_status(pid, "Threads"), *fds_by_kind(pid),
                  stats["open_files"], stats["inodes"])


def drop_dentries_and_inodes() -> None:
    """Evict unused dentries and inodes everywhere: the kernel sends FORGET for the mount's."""
    drop_kernel_caches(2)


def forget_all(mountpoint: Path, expected: int) -> int:
    """Drop the kernel's dentries until the daemon holds `expected` inodes; return what it holds.
    Repeated until then: FORGET arrives after the eviction, and a pass can miss a dentry busy just then."""
    def probe() -> int:
        drop_dentries_and_inodes()
        return mount_stats(mountpoint)["inodes"]
    return wait_for("inodes after drop_caches", probe, lambda n: n <= expected, SETTLE_S)


def wait_no_open_files(mountpoint: Path, what: str) -> None:
    """Until the daemon holds no file handle (RELEASE is asynchronous to close())."""
    wait_for(what, lambda: mount_stats(mountpoint)["open_files"], lambda n: n == 0, SETTLE_S)


# -- 1000 files open at once ------------------------------------------------------------------------

N_FILES = 1000
# RSS the daemon may gain from its first 1000-file round (1000 inode table entries, 1000 small chunks in
# its memory cache, allocator slack; 4-5 MiB measured) and from a second identical round (0 measured).
FIRST_ROUND_RSS_MIB = 32
NEXT_ROUND_RSS_MIB = 8
# Threads: trio keeps idle workers for 10 s; a leak per handle would be 1000 of them.
THREAD_SLACK = 8


def served(mountpoint: Path) -> int:
    return sum(mount_stats(mountpoint)["served_bytes"].values())


@pytest.mark.timeout(180)
def test_1000_files_open_at_once_leak_nothing(s3: S3Server, tmp_path: Path) -> None:
    """1000 distinct files open at once, each read, all closed, twice over: the daemon holds 1000 handles
    and 1000 inodes while they are open and none after (RELEASE, then FORGET), its fds and threads do
    not follow the handles, and its RSS stays within bounds and does not grow on the second round."""
    rng = random.Random(1000)
    files = {f"many/f{i:04d}.bin": rng.randbytes(rng.randrange(1, 4 * KiB)) for i in range(N_FILES)}
    bucket = new_bucket(s3)
    put_objects(s3, bucket, files)
    mountpoint = tmp_path / "mnt"
    with mounted(s3, bucket, mountpoint, "--memory-limit", MEMORY_LIMIT) as m:
        pid = m.proc.pid
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:4] == [b"-m", b"fsmount", b"mount"]
        # The root is the one inode the kernel never forgets.
        assert forget_all(mountpoint, 1) == 1
        idle = sample(pid, mountpoint)
        after: list[Sample] = []
        for _ in range(2):
            served_before = served(mountpoint)
            assert sorted(os.listdir(mountpoint / "many")) == sorted(k.split("/")[1] for k in files)
            fds = {key: os.open(mountpoint / key, os.O_RDONLY) for key in files}
            try:
                during = sample(pid, mountpoint)
                assert during.open_files == N_FILES, during
                assert during.inodes == N_FILES + 2, during  # each file, the directory and the root
                order = list(files)
                rng.shuffle(order)
                for key in order:
                    assert os.pread(fds[key], 8 * KiB, 0) == files[key], key
                # The READs reached the daemon (the first round's pages went with their inodes).
                assert served(mountpoint) - served_before >= sum(map(len, files.values()))
                # File handles are not file descriptors in the daemon.
                during = sample(pid, mountpoint)
                assert during.other_fds == idle.other_fds, (idle, during)
                assert during.sockets <= MAX_SOCKETS, during
            finally:
                for fd in fds.values():
                    os.close(fd)
            wait_no_open_files(mountpoint, "open_files after close")
            forget_all(mountpoint, 1)
            after.append(sample(pid, mountpoint))
        print(f"idle {idle}; after round 1 {after[0]}; after round 2 {after[1]}")
    first, second = after
    assert first.inodes == second.inodes == 1, after
    assert first.other_fds == second.other_fds == idle.other_fds, (idle, after)
    assert max(first.sockets, second.sockets) <= MAX_SOCKETS, after
    assert max(first.threads, second.threads) <= idle.threads + THREAD_SLACK, (idle, after)
    assert first.rss_kib - idle.rss_kib <= FIRST_ROUND_RSS_MIB * 1024, (idle, first)
    assert second.rss_kib - first.rss_kib <= NEXT_ROUND_RSS_MIB * 1024, (first, second)
    # --memory-limit bounds the daemon's RSS (config.py).
    assert second.rss_kib <= int(MEMORY_LIMIT[:-1]) * 1024, second


# -- 10,000 open/read/close cycles -----------------------------------------------------------------

CYCLES = 10_000
WARMUP_CYCLES = 1000
THREADS = 4
# After the warm-up nothing should grow at all (0 measured); a leak of 1 KiB per cycle would be 10 MiB.
CYCLES_RSS_MIB = 8
# How often the dentries are dropped while the cycles run, so LOOKUP and FORGET race with the opens.
CHURN_INTERVAL_S = 0.1


def cycle(mountpoint: Path, files: dict[str, bytes], n: int, seed: int) -> int:
    """n open/pread/close cycles over `files`; the pages are dropped after each read, so every read
    reaches the daemon. Returns the bytes read."""
    rng = random.Random(seed)
    keys = sorted(files)
    total = 0
    for _ in range(n):
        key = rng.choice(keys)
        data = files[key]
        fd = os.open(mountpoint / key, os.O_RDONLY)
        try:
            off = rng.randrange(len(data))
            got = os.pread(fd, 64 * KiB, off)
            assert got == data[off:off + 64 * KiB], (key, off)
            total += len(got)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return total


def inodes_held_open(mountpoint: Path, keys: list[str]) -> int:
    """The daemon's inode count while every key is open: open files pin their dentries, so a
    drop_caches elsewhere on the machine cannot change it while we look."""
    fds = [os.open(mountpoint / key, os.O_RDONLY) for key in keys]
    try:
        return mount_stats(mountpoint)["inodes"]
    finally:
        for fd in fds:
            os.close(fd)


def run_cycles(mountpoint: Path, files: dict[str, bytes], n: int, seed: int) -> int:
    with ThreadPoolExecutor(THREADS) as pool:
        return sum(pool.map(lambda i: cycle(mountpoint, files, n // THREADS, seed + i), range(THREADS)))


@pytest.mark.timeout(180)
def test_10000_open_read_close_cycles_leak_nothing(s3: S3Server, tmp_path: Path) -> None:
    """10,000 open/pread/close cycles from 4 threads over 5 files, while the kernel's dentries are dropped
    every 0.1 s (so the files are forgotten and looked up again all along): bytes exact, inode numbers
    stable, the daemon never holds more than the 5 files and the root, and its fds, threads, RSS and
    inodes are the same after as before; open_files returns to 0 and every inode is forgotten at the end."""
    rng = random.Random(10_000)
    files = {f"h{i}.bin": rng.randbytes(size) for i, size in enumerate((1, 33, 4 * KiB, 100 * KiB, MiB + 3))}
    bucket = new_bucket(s3)
    put_objects(s3, bucket, files)
    mountpoint = tmp_path / "mnt"
    with mounted(s3, bucket, mountpoint, "--memory-limit", MEMORY_LIMIT) as m:
        pid = m.proc.pid
        inos = {key: os.stat(mountpoint / key).st_ino for key in files}
        run_cycles(mountpoint, files, WARMUP_CYCLES, 0)
        inodes_before = inodes_held_open(mountpoint, list(files))
        wait_no_open_files(mountpoint, "open_files after warm-up")
        before = sample(pid, mountpoint)
        served_before = served(mountpoint)

        stop = threading.Event()
        held: list[int] = []

        def churn() -> None:
            while not stop.wait(CHURN_INTERVAL_S):
                drop_dentries_and_inodes()
                held.append(mount_stats(mountpoint)["inodes"])

        churner = threading.Thread(target=churn)
        churner.start()
        started = time.monotonic()
        try:
            read = run_cycles(mountpoint, files, CYCLES, 100)
        finally:
            stop.set()
            churner.join()
        elapsed = time.monotonic() - started
        # Every READ reached the daemon (the kernel may ask for more than pread did: read-ahead).
        assert served(mountpoint) - served_before >= read
        wait_no_open_files(mountpoint, "open_files after the cycles")
        for key in files:  # the files come back; FORGET did not change what a name means
            assert os.stat(mountpoint / key).st_ino == inos[key], key
        inodes_after = inodes_held_open(mountpoint, list(files))
        wait_no_open_files(mountpoint, "open_files after the check")
        after = sample(pid, mountpoint)
        forgotten = forget_all(mountpoint, 1)
        print(f"{CYCLES} cycles in {elapsed:.1f}s, {len(held)} drops (inodes held {min(held, default=0)}.."
              f"{max(held, default=0)}); before {before}; after {after}")
    assert held and max(held) <= len(files) + 1, held
    assert forgotten == 1
    assert inodes_before == inodes_after == len(files) + 1, (inodes_before, inodes_after)
    assert after.other_fds == before.other_fds, (before, after)
    assert after.sockets <= MAX_SOCKETS, after
    assert after.threads <= before.threads + THREAD_SLACK, (before, after)
    assert after.rss_kib - before.rss_kib <= CYCLES_RSS_MIB * 1024, (before, after)
