"""The persistent NVMe chunk cache (--cache-dir) through real FUSE mounts: persistence across unmount and
kill -9, corruption on disk, replaced objects, eviction under the size limit, a full cache disk, two mounts
on one dir, and the `modelfs cache stats|clear|verify` commands on a real filled cache.

"No origin GET" is proven with the daemon's own counters: at unmount it logs (info) one line
`served bytes: memory=.. cache=.. origin=..; origin requests=N bytes=.. errors=..; cache hits=H`, where
`origin requests` counts every data GET the chunk engine sent (metadata HEAD/LIST are not data).

Write-through runs after a read has returned. Tests that need it over either wait for the chunk files
they expect (`wait_for_chunks`) or look at the cache after the unmount: the daemon drains every pending
write-through before it exits (`Daemon._drain_cache_writes`), and one it could not finish logs a warning,
which fails the test.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from fsmount.data.levels import PUT_THREADS
from tests.helpers import (
    CORRUPT_WARNING,
    WRITE_FAILED_WARNING,
    MiB,
    Mount,
    S3Server,
    daemon_env,
    file_digest,
    mount_stats,
    mounted,
    new_bucket,
    put_objects,
    random_bytes,
    run_modelfs,
    sha,
    tmpfs,
    unmount,
    wait_for,
    warning_lines,
)

CHUNK = MiB
HEADER_SLACK = 4096  # a chunk file is its data plus a header (56 bytes, bucket/key/etag text, padding to 4 KiB)
CACHE_ARGS = ("--chunk-size", "1M")
SERVED = re.compile(r"served bytes: memory=(?P<memory>\d+) cache=(?P<cache>\d+) origin=(?P<origin>\d+); "
                    r"origin requests=(?P<origin_requests>\d+) bytes=(?P<origin_bytes>\d+) "
                    r"errors=(?P<origin_errors>\d+); cache hits=(?P<cache_hits>\d+)")
INDEX_LINE = re.compile(r"disk cache \S+: (?P<chunks>\d+) chunks, (?P<bytes>\d+) bytes, "
                        r"(?P<swept>\d+) stale temp files removed")


# -- helpers --------------------------------------------------------------------------------------

def cache_args(cache: Path, size: str = "1G", *more: str) -> tuple[str, ...]:
    """The options of a mount with `cache` as its --cache-dir, of `size`, and 1 MiB chunks."""
    return ("--cache-dir", str(cache), "--cache-size", size, *more, *CACHE_ARGS)


def bucket_with_object(server: S3Server, size: int, seed: int, key: str = "w.bin") -> tuple[str, bytes]:
    """A new bucket holding one object of `size` random bytes (a single PutObject); (bucket, its bytes)."""
    bucket = new_bucket(server)
    body = random_bytes(size, seed)
    put_objects(server, bucket, {key: body})
    return bucket, body


def n_chunks(size: int) -> int:
    return -(-size // CHUNK)


def chunk_files(cache: Path) -> list[Path]:
    """Final chunk files (not temp files) under the cache dir."""
    return sorted(p for p in cache.glob("chunks/*/*") if not p.name.endswith(".tmp"))


def tmp_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("chunks/*/*.tmp"))


def cache_dir_bytes(cache: Path) -> int:
    """Sum of the sizes of every file under chunks/ (temp files included), tolerant of concurrent
    renames and unlinks."""
    total = 0
    for shard in list(os.scandir(cache / "chunks")):
        try:
            entries = list(os.scandir(shard.path))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                total += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
    return total


def wait_for_chunks(cache: Path, want: int, timeout: float = 30.0) -> None:
    """Write-through runs after the read returned: wait until `want` chunk files are on disk."""
    wait_for(f"chunk files in the cache (want {want})", lambda: len(chunk_files(cache)), lambda n: n == want,
             timeout)


def read_whole_file(server: S3Server, bucket: str, mountpoint: Path, args: tuple[str, ...], body: bytes,
                    cache: Path | None = None, allowed: tuple[str, ...] = ()) -> Mount:
    """One mount with `args` that reads w.bin whole and checks it against `body`; with `cache`, it also waits
    until every chunk of w.bin is a chunk file there. The Mount, once unmounted."""
    with mounted(server, bucket, mountpoint, *args, allowed=allowed) as m:
        assert file_digest(mountpoint / "w.bin") == sha(body)
        if cache is not None:
            wait_for_chunks(cache, n_chunks(len(body)))
    return m


def served(log: str) -> dict[str, int]:
    """The engine counters the daemon logs when it unmounts."""
    found = SERVED.findall(log)
    assert len(found) == 1, f"expected one 'served bytes' line in the daemon log, got {len(found)}"
    return {k: int(v) for k, v in SERVED.search(log).groupdict().items()}  # type: ignore[union-attr]


def index_line(log: str) -> dict[str, int]:
    m = INDEX_LINE.search(log)
    assert m is not None, "the daemon did not log its rebuilt cache index"
    return {k: int(v) for k, v in m.groupdict().items()}


def cache_cmd(action: str, cache: Path) -> subprocess.CompletedProcess:
    return run_modelfs("cache", action, str(cache))


def assert_verified(cache: Path, chunks: int) -> None:
    """`modelfs cache verify` finds exactly `chunks` chunk files, none corrupt."""
    res = cache_cmd("verify", cache)
    assert res.returncode == 0 and res.stdout.startswith(f"{chunks} chunks verified, 0 corrupt"), res


def stats(cache: Path) -> dict[str, str]:
    res = cache_cmd("stats", cache)
    assert res.returncode == 0, res.stderr
    return {line[:15].strip(): line[16:].strip() for line in res.stdout.splitlines()}  # "name:15 value"


# -- 1. persistence across unmount / remount ------------------------------------------------------

def test_cache_survives_remount_and_a_hit_never_touches_the_origin(s3: S3Server, mountpoint: Path,
                                                                    tmp_path: Path) -> None:
    size = 24 * MiB + 12345  # a partial last chunk
    bucket, body = bucket_with_object(s3, size, seed=1)
    cache = tmp_path / "cache"
    args = cache_args(cache)
    # No waiting for write-through here: unmount drains it, so every chunk read is on disk after.
    m = read_whole_file(s3, bucket, mountpoint, args, body)
    first = served(m.log())
    assert first["origin_requests"] == n_chunks(size) and first["origin_bytes"] == size
    assert first["cache_hits"] == 0
    assert stats(cache)["chunks"] == str(n_chunks(size))
    assert oct(cache.stat().st_mode & 0o777) == oct(0o700)
    assert {oct(p.stat().st_mode & 0o777) for p in chunk_files(cache)} == {oct(0o600)}

    with mounted(s3, bucket, mountpoint, *args) as m:
        assert index_line(m.log())["chunks"] == n_chunks(size)
        assert file_digest(mountpoint / "w.bin") == sha(body)
        with open(mountpoint / "w.bin", "rb") as f:  # the exact tail, from the cache
            f.seek(size - 7)
            assert f.read(100) == body[-7:]
    second = served(m.log())
    assert second["origin_requests"] == 0 and second["origin_bytes"] == 0 and second["origin"] == 0, second
    assert second["cache_hits"] == n_chunks(size)
    assert second["cache"] + second["memory"] >= size
    assert stats(cache)["chunks"] == str(n_chunks(size))


# -- 2. kill -9 of the daemon mid-read ------------------------------------------------------------

def test_kill_9_mid_read_then_remount_is_exact(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    size = 64 * MiB + 777
    bucket, body = bucket_with_object(moto_server, size, seed=2)
    cache = tmp_path / "cache"
    args = cache_args(cache, "1G", "--max-readahead", "4M", "--kernel-readahead", "1M")
    done = [0]
    reader_errors: list[int | None] = []

    def reader() -> None:
        try:
            with open(mountpoint / "w.bin", "rb", buffering=0) as f:
                while block := f.read(MiB):
                    done[0] += len(block)
                    time.sleep(0.02)  # slow enough that the kill lands mid-file
        except OSError as exc:
            reader_errors.append(exc.errno)

    with mounted(moto_server, bucket, mountpoint, *args, check_log=False) as m:
        t = threading.Thread(target=reader, daemon=True)
        t.start()
        deadline = time.monotonic() + 30
        while len(chunk_files(cache)) < 8:
            assert time.monotonic() < deadline and t.is_alive(), "the reader never got going"
            time.sleep(0.01)
        log_before_kill = m.log()
        try:
            os.kill(m.proc.pid, signal.SIGKILL)
            m.proc.wait(10)
            t.join(30)
            assert not t.is_alive(), "a reader of the dead mount hangs"
        finally:  # the dead mount answers ENOTCONN; detach it whatever happened
            subprocess.run(["fusermount3", "-uz", str(mountpoint)], check=False, capture_output=True)
    assert m.proc.returncode == -signal.SIGKILL
    assert done[0] < size and reader_errors, "the kill did not land mid-read"
    assert reader_errors[0] in (errno.ENOTCONN, errno.EIO, errno.ECONNABORTED), reader_errors
    assert warning_lines(log_before_kill) == []

    # What a crash mid-put leaves behind: temp files (a real one may be there too), plus stray names.
    left_tmp = len(tmp_files(cache))
    victim = chunk_files(cache)[0]
    (victim.parent / f"{victim.name[:16]}.abcdef.tmp").write_bytes(victim.read_bytes()[:1000])
    (cache / "chunks/00/0000000000000000.zzz.tmp").write_bytes(b"")
    cached_before = len(chunk_files(cache))

    with mounted(moto_server, bucket, mountpoint, *args) as m:
        index = index_line(m.log())
        assert index["swept"] == left_tmp + 2 and tmp_files(cache) == []
        assert index["chunks"] == cached_before
        assert file_digest(mountpoint / "w.bin") == sha(body)
        wait_for_chunks(cache, n_chunks(size))
    again = served(m.log())
    assert again["cache_hits"] == cached_before
    assert again["origin_requests"] == n_chunks(size) - cached_before
    assert_verified(cache, n_chunks(size))


# -- 3. corruption on disk ------------------------------------------------------------------------

def test_corrupt_chunk_files_are_detected_and_refetched(moto_server: S3Server, mountpoint: Path,
                                                        tmp_path: Path) -> None:
    size = 16 * MiB + 99
    bucket, body = bucket_with_object(moto_server, size, seed=3)
    cache = tmp_path / "cache"
    args = cache_args(cache)
    read_whole_file(moto_server, bucket, mountpoint, args, body, cache)

    # Full-size chunks only: the tail chunk of the file (99 bytes of data) is too small to cut 4 KiB
    # from or to flip a byte 1000 from its end, and where it sorts depends on the bucket name.
    files = sorted(chunk_files(cache), key=lambda p: -p.stat().st_size)
    flipped, truncated, bad_header, other_chunk, emptied = files[:5]
    raw = bytearray(flipped.read_bytes())
    raw[-1000] ^= 0x01  # one bit of the data
    flipped.write_bytes(bytes(raw))
    os.truncate(truncated, truncated.stat().st_size - 4096)
    with open(bad_header, "r+b") as f:  # the magic and format version
        f.write(b"\xff" * 16)
    shutil.copyfile(files[5], other_chunk)  # a whole, valid file of another chunk under this name
    emptied.write_bytes(b"")
    broken = 5

    log = read_whole_file(moto_server, bucket, mountpoint, args, body, cache, allowed=(CORRUPT_WARNING,)).log()
    dropped = re.findall(r"dropped corrupt chunk file (\S+) \((.*?)\)", log)
    assert sorted(path for path, _ in dropped) == sorted(str(p) for p in
                                                         (flipped, truncated, bad_header, other_chunk, emptied))
    reasons = dict(dropped)
    assert reasons[str(flipped)] == "data checksum mismatch"
    assert reasons[str(truncated)].startswith("file is ")
    assert reasons[str(bad_header)] == "bad magic"
    assert reasons[str(other_chunk)].startswith("header names ")
    assert reasons[str(emptied)] == "truncated header"
    assert len([line for line in warning_lines(log) if "dropped corrupt" in line]) == 1, "one warning, then debug"
    counts = served(log)
    assert counts["origin_requests"] == broken and counts["cache_hits"] == n_chunks(size) - broken
    assert_verified(cache, n_chunks(size))  # the refetched chunks were written back whole


# -- 4. an object replaced in the bucket ----------------------------------------------------------

def test_new_etag_is_never_served_from_old_chunks(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    size = 16 * MiB + 5
    bucket, old = bucket_with_object(moto_server, size, seed=4)
    new, newer = random_bytes(size, seed=40), random_bytes(size, seed=41)  # same size: only the ETag differs
    client = moto_server.client()
    cache = tmp_path / "cache"
    args = cache_args(cache)
    read_whole_file(moto_server, bucket, mountpoint, args, old, cache)

    # replaced while unmounted: the remount's fresh metadata has the new ETag, no old chunk is used
    client.put_object(Bucket=bucket, Key="w.bin", Body=new)
    with mounted(moto_server, bucket, mountpoint, *args, "--metadata-ttl", "0") as m:
        assert file_digest(mountpoint / "w.bin") == sha(new)
        wait_for_chunks(cache, 2 * n_chunks(size))
        # replaced while mounted: the next open refreshes the ETag (ttl 0)
        client.put_object(Bucket=bucket, Key="w.bin", Body=newer)
        assert file_digest(mountpoint / "w.bin") == sha(newer)
        wait_for_chunks(cache, 3 * n_chunks(size))
    counts = served(m.log())
    assert counts["cache_hits"] == 0 and counts["origin_requests"] == 2 * n_chunks(size)

    # the newest version is now served from the cache alone; old versions' chunks only age out
    counts = served(read_whole_file(moto_server, bucket, mountpoint, args, newer).log())
    assert counts["origin_requests"] == 0 and counts["cache_hits"] == n_chunks(size)
    assert stats(cache)["chunks"] == str(3 * n_chunks(size))


# -- 5. eviction under the size limit while reading -----------------------------------------------

def test_eviction_keeps_the_cache_under_its_size_while_readers_run(moto_server: S3Server, mountpoint: Path,
                                                                   tmp_path: Path) -> None:
    size = 40 * MiB + 4321
    limit = 8 * MiB
    bucket, body = bucket_with_object(moto_server, size, seed=5)
    cache = tmp_path / "cache"
    # A 4 MiB memory cache: the second pass must go through the disk cache level, not memory.
    args = cache_args(cache, "8M", "--memory-limit", "4M")
    samples: list[int] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            samples.append(cache_dir_bytes(cache))
            time.sleep(0.01)

    watcher = threading.Thread(target=sampler)
    try:
        with mounted(moto_server, bucket, mountpoint, *args) as m:
            watcher.start()
            assert file_digest(mountpoint / "w.bin") == sha(body)
            # second pass: 4 concurrent readers of random ranges while puts keep evicting
            fd = os.open(mountpoint / "w.bin", os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

                def worker(seed: int) -> list[int]:
                    rng = np.random.default_rng(seed)
                    bad = []
                    for off in rng.integers(0, size, 40):
                        n = int(rng.choice([4096, 300_000, MiB, 3 * MiB]))
                        if os.pread(fd, n, int(off)) != body[off:off + n]:
                            bad.append(int(off))
                    return bad

                with ThreadPoolExecutor(4) as pool:
                    assert [bad for found in pool.map(worker, range(4)) for bad in found] == []
            finally:
                os.close(fd)
            assert file_digest(mountpoint / "w.bin", drop_page_cache=True) == sha(body)
        # Unmounted: the write-through was drained, nothing is put or evicted any more. The sampler ran
        # until here, so it saw every put.
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
    final = cache_dir_bytes(cache)
    counts = served(m.log())
    assert counts["origin_requests"] > 2 * n_chunks(size) - limit // CHUNK, "the second pass was not re-fetched"
    assert final <= limit, f"{final / MiB:.3f} MiB after the unmount"  # the limit counts whole files, headers too
    assert 0 < len(chunk_files(cache)) <= limit // CHUNK
    # While puts and evictions run, a scan of 256 shard dirs is not atomic (it can see an evicted file and its
    # replacement both): one chunk file of slack per put that may run during it (PUT_THREADS at once). Measured
    # peaks are 8 MiB + about 1 KiB, and once, on a busy host, 9.035 MiB: nine files, two of them seen twice.
    slack = PUT_THREADS * (CHUNK + HEADER_SLACK)
    assert max(samples) <= limit + slack, f"peak {max(samples) / MiB:.3f} MiB"
    res = cache_cmd("verify", cache)
    assert res.returncode == 0 and ", 0 corrupt" in res.stdout, res


def test_recycled_buffers_of_cache_hits_never_serve_wrong_bytes(moto_server: S3Server, mountpoint: Path,
                                                               tmp_path: Path) -> None:
    """Warm reads under a small memory limit: cache hits are read into buffers that are reused once READs
    took them whole. Sequential passes (which spend buffers) race 4 random readers (which hold replies
    in flight), every byte checked, and the daemon reports that it did recycle."""
    size = 48 * MiB + 777
    bucket, body = bucket_with_object(moto_server, size, seed=11)
    cache = tmp_path / "cache"
    args = cache_args(cache)
    read_whole_file(moto_server, bucket, mountpoint, args, body)
    with mounted(moto_server, bucket, mountpoint, *args, "--memory-limit", "24M", "--no-model-prefetch") as m:
        fd = os.open(mountpoint / "w.bin", os.O_RDONLY)
        try:
            def sequential(_: int) -> list[int]:
                bad = []
                for _pass in range(3):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    for off in range(0, size, 128 * 1024):
                        if os.pread(fd, 128 * 1024, off) != body[off:off + 128 * 1024]:
                            bad.append(off)
                return bad

            def random_reads(seed: int) -> list[int]:
                rng = np.random.default_rng(seed)
                bad = []
                for off in rng.integers(0, size, 150):
                    n = int(rng.choice([4096, 200_000, MiB, 2 * MiB + 5]))
                    if os.pread(fd, n, int(off)) != body[off:off + n]:
                        bad.append(int(off))
                return bad

            assert sequential(0) == []  # alone first: nearly every chunk is READ whole, then recycled
            with ThreadPoolExecutor(6) as pool:
                jobs = [pool.submit(sequential, 0), pool.submit(sequential, 1)]
                jobs += [pool.submit(random_reads, seed) for seed in range(4)]
                assert [off for job in jobs for off in job.result()] == []
        finally:
            os.close(fd)
    counts = served(m.log())
    assert counts["origin_requests"] == 0, counts
    recycled = re.search(r"buffers recycled=(\d+)", m.log())
    assert recycled is not None and int(recycled.group(1)) >= size // CHUNK, m.log()[-600:]


# -- 6. the cache disk is full --------------------------------------------------------------------

ROOM_WARNING = r"has room for \d+ MiB of chunks only"


@pytest.mark.parametrize("options, expect", [
    # 4 MiB in all: room for 3 chunk files beside the free space the cache leaves (5 % of a disk this small; 4 GiB
    # of a big one), so the mount says so at once, and the cache evicts to keep it: no write ever fails.
    pytest.param("size=4m", ROOM_WARNING, id="tiny-disk"),
    # bytes to spare but 6 inodes left past the cache's own directories: creating a chunk file fails ENOSPC
    pytest.param("size=4200m,nr_inodes=265", WRITE_FAILED_WARNING, id="out-of-inodes"),
    # 24 MiB: the cache evicts to keep its free-space floor (1.2 MiB here) and never fails a write; a put that
    # finds the room held by puts in flight is skipped quietly (the in-process tests below). 22.8 MiB leaves
    # room for the 10+ chunk files asserted below with 8 disk threads writing.
    pytest.param("size=24m", None, id="at-free-space-floor"),
])
def test_full_cache_disk_costs_speed_not_correctness(moto_server: S3Server, mountpoint: Path, tmp_path: Path,
                                                     options: str, expect: str | None) -> None:
    size = 24 * MiB + 3
    bucket, body = bucket_with_object(moto_server, size, seed=6)
    with tmpfs(tmp_path / "cache", options) as cache:
        args = cache_args(cache, "100M")
        with mounted(moto_server, bucket, mountpoint, *args, allowed=(WRITE_FAILED_WARNING, ROOM_WARNING)) as m:
            assert file_digest(mountpoint / "w.bin") == sha(body)
            assert file_digest(mountpoint / "w.bin", drop_page_cache=True) == sha(body)  # still serving
            assert (mountpoint / "w.bin").stat().st_size == size
        # Unmounted, so every write-through has ended (drained); the tmpfs is still mounted.
        st = os.statvfs(cache)
        free = st.f_bavail * st.f_frsize
        floor = 0.05 * st.f_blocks * st.f_frsize
        held = len(chunk_files(cache))
        left_tmp = tmp_files(cache)
        warnings = warning_lines(m.log())
    # One episode of failed writes, one line: puts already in flight when it began may still succeed, but
    # they do not end it (test_a_full_disk_logs_one_warning below).
    assert len(warnings) == (1 if expect else 0), warnings
    assert expect is None or re.search(expect, warnings[0]), warnings
    assert left_tmp == []
    if options == "size=4m":
        assert 0 < held <= 3 and free >= floor, (held, free)
    elif "nr_inodes" in options:
        assert 0 < held < n_chunks(size)
    else:
        assert 10 < held < n_chunks(size) and free >= floor, (held, free)


def test_an_idle_cache_gives_back_the_free_space_something_else_took(moto_server: S3Server, mountpoint: Path,
                                                                     tmp_path: Path) -> None:
    """A warm node that only reads kept its chunks while another process filled the cache disk to the last byte:
    the free-space floor was kept by puts only. The daemon now checks it every FREE_CHECK_S and evicts the least
    recently used chunks to free it again; the file still reads exact."""
    from fsmount.mount import FREE_CHECK_S

    size = 16 * MiB
    bucket, body = bucket_with_object(moto_server, size, seed=8)
    with tmpfs(tmp_path / "cache", "size=40m") as cache:  # a floor of 5 %: 2 MiB
        with mounted(moto_server, bucket, mountpoint, *cache_args(cache, "100M")) as m:
            assert file_digest(mountpoint / "w.bin") == sha(body)
            wait_for_chunks(cache, n_chunks(size))
            st = os.statvfs(cache)
            floor = 0.05 * st.f_blocks * st.f_frsize
            with open(cache / "someone-elses-file", "wb") as f, contextlib.suppress(OSError):
                while True:
                    f.write(bytes(MiB))
            wait_for("the floor free again", lambda: os.statvfs(cache).f_bavail * st.f_frsize,
                     lambda free: free >= floor, timeout=FREE_CHECK_S + 10)
            assert 0 < len(chunk_files(cache)) < n_chunks(size)
            assert mount_stats(m.path)["disk_cache"]["evictions"] > 0
            assert file_digest(mountpoint / "w.bin", drop_page_cache=True) == sha(body)
            (cache / "someone-elses-file").unlink()


# -- 6b. the cache disk's reads hang ---------------------------------------------------------------

STALLED = r"did not return within"
READ_ONLY = (r"cannot make .* private \(Read-only file system\)",
             r"cannot make its directories \(Read-only file system\); serving what it holds")


def test_a_cache_disk_whose_reads_hang_is_read_around_until_it_answers(moto_server: S3Server, mountpoint: Path,
                                                                        tmp_path: Path) -> None:
    """A cache disk whose reads hang: every READ of a chunk it held failed at --read-timeout, and once the cache's
    reads had taken all its threads, every READ of the mount. A cache read is given up after a quarter of
    --read-timeout (2 s at least), the chunk comes from the origin, and the cache is skipped until its reads return;
    then it serves again. The hung disk: the cache dir is a second (read-only) mount of the chunk files, whose daemon
    is stopped (SIGSTOP), so every open and read of them blocks in the kernel until it goes on (SIGCONT)."""
    size = 12 * MiB + 5
    bucket, body = bucket_with_object(moto_server, size, seed=21)
    other = random_bytes(4 * MiB, 22)
    put_objects(moto_server, bucket, {"x.bin": other})
    filled = tmp_path / "filled"
    args = ("--read-timeout", "5", *CACHE_ARGS)
    with mounted(moto_server, bucket, mountpoint, "--cache-dir", str(filled), *args):  # the unmount drains writes
        assert file_digest(mountpoint / "w.bin") == sha(body)
        assert file_digest(mountpoint / "x.bin") == sha(other)
    files = chunk_files(filled)
    assert len(files) == n_chunks(size) + 4
    disk = new_bucket(moto_server)
    put_objects(moto_server, disk, {str(p.relative_to(filled)): p.read_bytes() for p in files})
    with mounted(moto_server, disk, tmp_path / "disk", "--metadata-ttl", "forever") as hung:
        with mounted(moto_server, bucket, mountpoint, "--cache-dir", str(hung.path), "--cache-size", "1G", *args,
                     allowed=(STALLED, *READ_ONLY)) as m:
            os.kill(hung.proc.pid, signal.SIGSTOP)
            try:
                began = time.monotonic()
                assert file_digest(mountpoint / "w.bin") == sha(body)
                took = time.monotonic() - began
                stalled = mount_stats(mountpoint)
            finally:
                os.kill(hung.proc.pid, signal.SIGCONT)  # the cache's reads given up return
            assert took < 4.5, f"{took:.1f}s: the reads waited for the hung cache"  # 2 s, then the origin
            assert stalled["cache_reads_given_up"] >= 1 and stalled["origin"]["bytes"] >= size, stalled
            wait_for("the cache's reads to return", m.log, lambda log: "answers again" in log)
            time.sleep(2.5)  # it is used again a deadline (2 s) after its reads returned
            assert file_digest(mountpoint / "x.bin") == sha(other)  # not in memory: from the cache again
            after = mount_stats(mountpoint)
            assert after["origin"]["bytes"] == stalled["origin"]["bytes"], after
            assert after["cache_chunk_hits"] >= stalled["cache_chunk_hits"] + 4, after
        assert len([line for line in warning_lines(m.log()) if re.search(STALLED, line)]) == 1, m.log()


# -- 7. two mounts on one cache dir ---------------------------------------------------------------

def test_second_mount_on_a_busy_cache_dir_is_refused(moto_server: S3Server, mountpoint: Path,
                                                     tmp_path: Path) -> None:
    size = 16 * MiB
    bucket, body = bucket_with_object(moto_server, size, seed=7)
    cache = tmp_path / "cache"
    args = cache_args(cache)
    second_mp = tmp_path / "mnt2"
    second_mp.mkdir()
    with mounted(moto_server, bucket, mountpoint, *args) as m:
        assert file_digest(mountpoint / "w.bin") == sha(body)
        started = time.monotonic()
        res = run_modelfs("mount", bucket, str(second_mp), "--endpoint-url", moto_server.endpoint_url, *args,
                          env=daemon_env(moto_server), timeout=90)
        assert time.monotonic() - started < 30
        assert res.returncode == 2, res  # a live mount holds it: only an operator mends that (B1042)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        assert str(cache) in lines[0] and "in use" in lines[0] and str(m.proc.pid) in lines[0], lines[0]
        assert not os.path.ismount(second_mp)
        # the first mount and its cache are untouched
        assert file_digest(mountpoint / "w.bin", drop_page_cache=True) == sha(body)
        wait_for_chunks(cache, n_chunks(size))
        assert (cache / "lock").read_text().strip() == str(m.proc.pid)
    assert_verified(cache, n_chunks(size))


# -- 8. modelfs cache stats | verify | clear ------------------------------------------------------

def test_cache_commands_on_a_real_cache(moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    size = 20 * MiB + 1
    bucket, body = bucket_with_object(moto_server, size, seed=8)
    cache = tmp_path / "cache"
    args = cache_args(cache)
    n = n_chunks(size)
    with mounted(moto_server, bucket, mountpoint, *args):
        assert file_digest(mountpoint / "w.bin") == sha(body)
        wait_for_chunks(cache, n)
        on_disk = sum(p.stat().st_size for p in chunk_files(cache))
        st = stats(cache)  # a stat-only scan, fine while mounted
        assert st["chunks"] == str(n) and st["bytes"] == f"{on_disk} ({on_disk / MiB:.2f} MiB)", st
        assert st["oldest access"] != "-" and st["newest access"] != "-"
        for action in ("clear", "verify"):  # both take the dir lock
            res = cache_cmd(action, cache)
            assert res.returncode == 1, (action, res)
            assert str(cache) in res.stderr and "in use" in res.stderr, res.stderr
            assert len(res.stderr.strip().splitlines()) == 1
        assert len(chunk_files(cache)) == n

    res = cache_cmd("verify", cache)
    assert (res.returncode, res.stdout) == (0, f"{n} chunks verified, 0 corrupt (removed)\n")
    victim = max(chunk_files(cache), key=lambda p: p.stat().st_size)  # not the 1-byte tail chunk
    raw = bytearray(victim.read_bytes())
    raw[-200] ^= 0xFF  # in the data
    victim.write_bytes(bytes(raw))
    res = cache_cmd("verify", cache)
    assert res.returncode == 1
    assert res.stdout.splitlines() == [f"{n - 1} chunks verified, 1 corrupt (removed)", f"  corrupt: {victim}"]
    assert not victim.exists()

    # Files the cache did not write are left alone, a file among the shard directories included (it made
    # `clear` fail with NotADirectoryError, and `clear` deleted foreign files in the shards).
    stray, foreign = cache / "chunks" / "stray.txt", victim.parent / "notes.txt"
    stray.write_text("x")
    foreign.write_text("y")
    res = cache_cmd("clear", cache)
    assert (res.returncode, res.stdout) == (0, f"removed {n - 1} chunk files, 1 file of the names mounts learnt "
                                               "(names/)\n"), res
    assert os.listdir(cache / "names") == []
    assert chunk_files(cache) == [foreign] and stray.read_text() == "x" and foreign.read_text() == "y"
    stray.unlink()
    foreign.unlink()
    st = stats(cache)
    assert st["chunks"] == "0" and st["bytes"] == "0 (0 B)" and st["oldest access"] == "-"
    res = cache_cmd("stats", tmp_path / "not-a-cache")
    assert res.returncode == 1 and "not-a-cache does not exist" in res.stderr  # B174
    (tmp_path / "not-a-cache").mkdir()
    res = cache_cmd("stats", tmp_path / "not-a-cache")
    assert res.returncode == 1 and "not a modelfs cache directory" in res.stderr

    m = read_whole_file(moto_server, bucket, mountpoint, args, body)  # a cleared cache is a cold cache
    assert served(m.log())["origin_requests"] == n


def test_copies_a_killed_writable_mount_left_are_shown_cleared_and_swept_by_the_next_mount(
        moto_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    """A --writable mount killed mid-file leaves its local copy in CACHE/writes/ (57 MiB in a tester's run): `cache
    stats` did not count it, `cache clear` kept it, and only the next --writable mount removed it. `stats` shows it,
    `clear` removes it, and so does the next mount of the dir, read-only or not."""
    bucket, body = bucket_with_object(moto_server, 2 * MiB, seed=31)
    cache = tmp_path / "cache"
    with mounted(moto_server, bucket, mountpoint, *cache_args(cache)):
        assert file_digest(mountpoint / "w.bin") == sha(body)
    left = cache / "writes" / "1"

    def left_by_a_killed_writer() -> None:
        left.parent.mkdir(exist_ok=True)
        left.write_bytes(b"x" * 3 * MiB)

    left_by_a_killed_writer()
    res = cache_cmd("stats", cache)
    assert "staged writes   1 file, 3.00 MiB" in res.stdout, res.stdout
    res = cache_cmd("clear", cache)
    assert res.stdout == ("removed 2 chunk files, 3.00 MiB of copies a --writable mount left in writes/, 1 file of "
                          "the names mounts learnt (names/)\n"), res
    assert not left.exists()
    left_by_a_killed_writer()
    with mounted(moto_server, bucket, mountpoint, *cache_args(cache)) as m:
        assert not left.exists()
    assert re.search(r"removed 1 copy of a file \(3\.00 MiB\) that a --writable mount left in writes/", m.log())


def test_a_mount_of_another_origin_that_does_not_answer_is_not_served_this_origin_s_names(s3: S3Server,
                                                                                          mountpoint: Path,
                                                                                          tmp_path: Path) -> None:
    """The names a cache dir keeps serve a remount while the origin does not answer, but they were kept by bucket and
    prefix alone: a mount of a bucket of the same name on another server (a typo in --endpoint-url, a staging
    server) that did not answer came up, one warning, showing this server's tree and serving its cached bytes as
    that bucket's. Now it fails as without a cache dir (the same origin down: test_faults.py)."""
    bucket = new_bucket(s3)
    put_objects(s3, bucket, {"m/config.json": b'{"a": 1}'})
    cache = tmp_path / "cache"
    with mounted(s3, bucket, mountpoint, "--cache-dir", str(cache)):
        assert (mountpoint / "m" / "config.json").read_bytes() == b'{"a": 1}'
    try:
        res = run_modelfs("mount", bucket, str(mountpoint), "--endpoint-url", "http://127.0.0.1:1", "--cache-dir",
                          str(cache), env=daemon_env(s3))
        assert res.returncode == 1 and not os.path.ismount(mountpoint), res.stderr
        assert "keeps no name of this bucket and prefix at http://127.0.0.1:1 to mount" in res.stderr, res.stderr
    finally:
        unmount(mountpoint)
