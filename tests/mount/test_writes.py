"""`--writable`: what real checkpoint writers do, on real mounts against moto and SeaweedFS, each read back
byte-exact (or torch.load-equal) on a fresh mount; and the rules (sequential only, no overwrite or delete
without their flags, renames, directories, read after write)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fsmount.testing.fault_proxy import Fault, FaultProxy
from tests.helpers import (
    FETCH_FAILED,
    READ_FAILED,
    REPO,
    MiB,
    S3Server,
    bucket_with,
    daemon_env,
    delete_bucket,
    mount_stats,
    mounted,
    mounted_via,
    new_bucket,
    put_objects,
    random_bytes,
    run_modelfs,
    sha,
    tmpfs,
    wait_for,
    warning_lines,
)

WRITABLE = ("--writable", "--metadata-ttl", "60")
# Warnings a test that provokes them expects.
SEQUENTIAL_ONLY = r"only sequential writes are supported"
NEEDS_OVERWRITE = r"needs --allow-overwrite"
UPLOAD_UNDER_IT = r"still uploads under this name"


def keys(server: S3Server, bucket: str) -> dict[str, int]:
    client = server.client()
    out: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", ())})
    return out


def uploads_in(server: S3Server, bucket: str) -> list[str]:
    return [u["Key"] for u in server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", ())]


def run_python(code: str, *args: str, timeout: float = 240) -> str:
    """A writer or reader in a process of its own (as a trainer is), its stdout; fails the test on error."""
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_read_only_by_default(s3: S3Server, mountpoint: Path) -> None:
    bucket = bucket_with(s3, {"a.bin": b"x"})
    with mounted(s3, bucket, mountpoint):
        for attempt in (lambda: open(mountpoint / "new.bin", "wb"), lambda: os.mkdir(mountpoint / "d"),
                        lambda: os.unlink(mountpoint / "a.bin"), lambda: open(mountpoint / "a.bin", "r+b")):
            with pytest.raises(OSError) as info:
                attempt()
            assert info.value.errno == errno.EROFS
    assert keys(s3, bucket) == {"a.bin": 1}
    delete_bucket(s3, bucket)


def test_new_files_small_and_multipart_read_back_at_once_and_on_a_fresh_mount(s3: S3Server, mountpoint: Path,
                                                                              tmp_path: Path) -> None:
    bucket = new_bucket(s3)
    small, big = random_bytes(1000, 1), random_bytes(23 * MiB + 17, 2)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M", "--max-connections", "4"):
        os.makedirs(mountpoint / "run" / "ckpt")
        (mountpoint / "run" / "small.txt").write_bytes(small)
        with open(mountpoint / "run" / "ckpt" / "big.bin", "wb") as f:
            for i in range(0, len(big), 128 * 1024 + 3):  # writes of an odd size, across part boundaries
                f.write(big[i:i + 128 * 1024 + 3])
        (mountpoint / "empty").write_bytes(b"")
        # Read after write, on the same mount: listed, stat-able, readable, final sizes.
        assert sorted(os.listdir(mountpoint)) == ["empty", "run"]
        assert sorted(os.listdir(mountpoint / "run")) == ["ckpt", "small.txt"]
        assert os.stat(mountpoint / "run" / "ckpt" / "big.bin").st_size == len(big)
        assert (mountpoint / "run" / "small.txt").read_bytes() == small
        assert sha((mountpoint / "run" / "ckpt" / "big.bin").read_bytes()) == sha(big)
        assert (mountpoint / "empty").read_bytes() == b""
    assert keys(s3, bucket) == {"run/small.txt": 1000, "run/ckpt/": 0, "run/": 0,
                                "run/ckpt/big.bin": len(big), "empty": 0}
    head = s3.client().head_object(Bucket=bucket, Key="run/ckpt/big.bin")
    assert head["ETag"].strip('"').endswith("-5")  # 5 parts of 5 MiB: a streamed multipart upload
    assert uploads_in(s3, bucket) == []
    other = tmp_path / "fresh"
    with mounted(s3, bucket, other):
        assert sha((other / "run" / "ckpt" / "big.bin").read_bytes()) == sha(big)
        assert (other / "run" / "small.txt").read_bytes() == small
    delete_bucket(s3, bucket)


def test_with_a_cache_dir_a_stored_file_is_read_back_from_the_nvme_cache(s3: S3Server, mountpoint: Path,
                                                                         tmp_path: Path) -> None:
    """A resume on the same node reads what it wrote at local speed: its chunks went into the cache."""
    bucket = new_bucket(s3)
    cache = tmp_path / "cache"
    data, small = random_bytes(21 * MiB, 5), b"{}"
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--cache-dir", str(cache), "--write-part-size", "5M"):
        (mountpoint / "ckpt.bin").write_bytes(data)
        (mountpoint / "state.json").write_bytes(small)
        wait_for("chunks cached", lambda: mount_stats(mountpoint)["writes"]["chunks_cached"], lambda n: n == 3 + 1)
        assert os.listdir(cache / "writes") == []  # the local copies are gone once in the cache
    other = tmp_path / "resume"
    with mounted(s3, bucket, other, "--cache-dir", str(cache)):
        assert sha((other / "ckpt.bin").read_bytes()) == sha(data)
        assert (other / "state.json").read_bytes() == small
        stats = mount_stats(other)
        assert stats["origin"]["bytes"] == 0 and stats["disk_cache"]["hits"] == 4, stats
    delete_bucket(s3, bucket)


def test_with_a_cache_dir_a_file_renamed_into_place_is_read_back_from_the_nvme_cache(s3: S3Server, mountpoint: Path,
                                                                                    tmp_path: Path) -> None:
    """The crash-safe save, `f.tmp` then `os.replace(f.tmp, f)`: a chunk id names the key, so every chunk stayed
    under `f.tmp`, and a resume on the same node read `f` from the origin (a fleet tester)."""
    bucket = new_bucket(s3)
    cache = tmp_path / "cache"
    data = random_bytes(21 * MiB, 6)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--cache-dir", str(cache), "--write-part-size", "5M"):
        (mountpoint / "ckpt.bin.tmp").write_bytes(data)
        os.replace(mountpoint / "ckpt.bin.tmp", mountpoint / "ckpt.bin")  # at once: its fill may still be running
        wait_for("chunks cached", lambda: mount_stats(mountpoint)["writes"]["chunks_cached"], lambda n: n == 3 + 3)
    assert keys(s3, bucket) == {"ckpt.bin": len(data)}
    other = tmp_path / "resume"
    with mounted(s3, bucket, other, "--cache-dir", str(cache)):
        assert sha((other / "ckpt.bin").read_bytes()) == sha(data)
        stats = mount_stats(other)
        assert stats["origin"]["bytes"] == 0 and stats["disk_cache"]["hits"] == 3, stats
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("writer", ["write", "save_file"])
def test_a_cache_dir_that_fills_up_costs_the_local_copy_not_the_file(s3: S3Server, mountpoint: Path,
                                                                     tmp_path: Path, writer: str) -> None:
    """A checkpoint bigger than the room left on the cache's disk: the local copy ends (one warning) and the
    file is stored all the same, byte for byte; nothing of the copy is left behind."""
    bucket = new_bucket(s3)
    small = tmp_path / "small"
    small.mkdir()
    # 36 MiB: room for a cache of 4 chunks (--cache-size 32M), not for the 40 MiB checkpoint beside it
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=36M", "tmpfs", str(small)], check=True)
    try:
        data = random_bytes(40 * MiB, 8)
        with mounted(s3, bucket, mountpoint, *WRITABLE, "--cache-dir", str(small / "cache"), "--cache-size", "32M",
                     "--write-part-size", "5M", allowed=("cannot keep written files",)):
            if writer == "write":
                with open(mountpoint / "ckpt.bin", "wb") as f:
                    for at in range(0, len(data), MiB):
                        f.write(data[at:at + MiB])
            else:  # save_file's pattern: create, ftruncate to the full size, write, close
                with open(mountpoint / "ckpt.bin", "wb") as f:
                    f.truncate(len(data))
                    f.write(data)
            assert os.listdir(small / "cache" / "writes") == []
        assert sha(s3.client().get_object(Bucket=bucket, Key="ckpt.bin")["Body"].read()) == sha(data)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("writer", ["write", "save_file"])
def test_the_local_copy_leaves_the_cache_disk_its_floor_of_free_space(s3: S3Server, mountpoint: Path, tmp_path: Path,
                                                                      writer: str) -> None:
    """B590: a checkpoint nearly as large as the cache's disk. The NVMe cache leaves 5% of a small filesystem free
    to the rest of the node; the local copy of a file being written took the disk to a few MiB (the save_file
    pattern's copy, promised its whole size, held it there until the close; a streamed one went on to ENOSPC), so
    the node's other writers on that disk failed while a checkpoint was written. Now the copy ends at the floor,
    and the file is stored all the same."""
    bucket = new_bucket(s3)
    data = random_bytes(100 * MiB, 59)
    floor = int(0.05 * 104 * MiB)  # disk_cache.MIN_FREE_SHARE of the filesystem
    with tmpfs(tmp_path / "small", "size=104M") as small:

        def free() -> int:
            st = os.statvfs(small)
            return st.f_bavail * st.f_frsize

        with mounted(s3, bucket, mountpoint, *WRITABLE, "--cache-dir", str(small / "cache"), "--cache-size", "32M",
                     "--write-part-size", "5M", allowed=("cannot keep written files",)):
            with open(mountpoint / "ckpt.bin", "wb") as f:
                if writer == "save_file":  # create, ftruncate to the full size, write, close
                    f.truncate(len(data))
                for at in range(0, len(data), MiB):
                    f.write(data[at:at + MiB])
                f.flush()
                os.fsync(f.fileno())  # the parts written so far are sent (and copied)
                # Before the close: the copy that filled the disk was still there (save_file's until the close).
                # 2 s, less than the cache's own floor check (every 5 s): a chunk-cache put racing the copy's last
                # part no longer crosses the floor (B731); the old code's copy stayed until the close, however long
                # this waits.
                wait_for("the floor left free", free, lambda n: n >= floor, timeout=2)
            assert os.listdir(small / "cache" / "writes") == []
    assert sha(s3.client().get_object(Bucket=bucket, Key="ckpt.bin")["Body"].read()) == sha(data)
    delete_bucket(s3, bucket)


@contextlib.contextmanager
def a_full_cache_disk(s3: S3Server, bucket: str, old: bytes, mountpoint: Path, tmp_path: Path, room: int,
                      ) -> Iterator[tuple[Path, Callable[[], int], int, Any]]:
    """A writable mount whose NVMe cache fills its disk up to the floor of free space (`--cache-size` larger than the
    104 MiB tmpfs gives): `old.bin` in `bucket` (`old`, 100 MiB) read whole and exact, its chunks put until the cache
    evicts to keep its floor, and less than `room` bytes left free beyond it. The tmpfs, its free bytes, the floor,
    the mount."""
    floor = int(0.05 * 104 * MiB)  # disk_cache.MIN_FREE_SHARE of the filesystem
    with tmpfs(tmp_path / "small", "size=104M") as small:

        def free() -> int:
            st = os.statvfs(small)
            return st.f_bavail * st.f_frsize

        with mounted(s3, bucket, mountpoint, *WRITABLE, "--cache-dir", str(small / "cache"), "--cache-size", "500M",
                     "--write-part-size", "5M") as m:
            assert sha((mountpoint / "old.bin").read_bytes()) == sha(old)
            wait_for("the cache at its floor", lambda: mount_stats(mountpoint)["disk_cache"]["evictions"],
                     lambda n: n > 0)
            wait_for("the reads' puts landed", free, lambda n: n - floor < room)
            yield small, free, floor, m


def test_a_checkpoint_written_on_a_full_cache_disk_replaces_old_chunks(s3: S3Server, mountpoint: Path,
                                                                       tmp_path: Path) -> None:
    """B680: a node whose NVMe cache fills its disk up to the floor of free space (here `--cache-size` larger than
    the disk gives). B590's floor ended every checkpoint's copy at its first part, so no checkpoint written on the
    node was cached; the copy has the cache evict its oldest chunks for its room, and the floor is still kept."""
    old = random_bytes(100 * MiB, 680)
    bucket = bucket_with(s3, {"old.bin": old})
    data = random_bytes(24 * MiB, 681)
    with a_full_cache_disk(s3, bucket, old, mountpoint, tmp_path, len(data) - 2 * MiB) as (small, free, floor, _):
        with open(mountpoint / "ckpt.bin", "wb") as f:
            for at in range(0, len(data), MiB):
                f.write(data[at:at + MiB])
        wait_for("chunks cached", lambda: mount_stats(mountpoint)["writes"]["chunks_cached"], lambda n: n == 3)
        assert os.listdir(small / "cache" / "writes") == []
        wait_for("the floor left free", free, lambda n: n >= floor, timeout=2)  # see the test above
    assert sha(s3.client().get_object(Bucket=bucket, Key="ckpt.bin")["Body"].read()) == sha(data)
    delete_bucket(s3, bucket)


def test_a_pre_sized_checkpoint_on_a_full_cache_disk_is_deferred(s3: S3Server, mountpoint: Path,
                                                                   tmp_path: Path) -> None:
    """B730: on a node whose NVMe cache fills its disk up to the floor of free space, a pre-sized file's copy was
    promised only room beyond the floor, so save_file (a temp file, ftruncate, writes, rename, close) streamed, and
    its rename cost a server-side copy of the whole file. The cache's chunks count as room (evicted at the copy's
    first write): the file is uploaded once from its copy under its final name, cached, and the floor is kept."""
    old = random_bytes(100 * MiB, 730)
    bucket = bucket_with(s3, {"old.bin": old})
    data = random_bytes(24 * MiB, 731)
    with a_full_cache_disk(s3, bucket, old, mountpoint, tmp_path, len(data) - 2 * MiB) as (small, free, floor, m):
        with open(mountpoint / "ckpt.bin.tmp", "wb") as f:  # save_file's order
            f.truncate(len(data))
            for at in range(0, len(data), MiB):
                f.write(data[at:at + MiB])
            f.flush()
            assert free() >= floor
            os.rename(mountpoint / "ckpt.bin.tmp", mountpoint / "ckpt.bin")
        wait_for("chunks cached", lambda: mount_stats(mountpoint)["writes"]["chunks_cached"], lambda n: n == 3)
        log = m.log()
        assert f"ckpt.bin: uploading {len(data)} bytes from its local copy" in log
        assert "no room for a local copy" not in log
        assert os.listdir(small / "cache" / "writes") == []
        assert free() >= floor
    assert keys(s3, bucket) == {"old.bin": len(old), "ckpt.bin": len(data)}
    assert sha(s3.client().get_object(Bucket=bucket, Key="ckpt.bin")["Body"].read()) == sha(data)
    delete_bucket(s3, bucket)


def test_out_of_order_write_fails_and_stores_nothing(s3: S3Server, mountpoint: Path) -> None:
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M",
                 allowed=(SEQUENTIAL_ONLY, "will not be stored")):
        fd = os.open(mountpoint / "x.bin", os.O_WRONLY | os.O_CREAT)
        try:
            os.write(fd, random_bytes(6 * MiB, 3))  # one part is on its way
            with pytest.raises(OSError) as info:
                os.pwrite(fd, b"back", 10)
            assert info.value.errno == errno.EINVAL
            with pytest.raises(OSError) as info:
                os.write(fd, b"more")  # the file is spoiled: nothing more goes in
            assert info.value.errno == errno.EIO
        finally:
            with pytest.raises(OSError) as info:
                os.close(fd)
            assert info.value.errno == errno.EIO
        assert not os.path.exists(mountpoint / "x.bin")
    assert keys(s3, bucket) == {}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("how", ["new", "rewrite", "renamed-onto"])
def test_a_file_that_fails_leaves_the_name_as_the_bucket_has_it(s3: S3Server, mountpoint: Path, how: str) -> None:
    """A file being written whose close fails (here a write out of order) leaves the tree, and the name is what the
    bucket holds: nothing for a new file, the old object for a rewrite (O_TRUNC) or for a file renamed onto it. The
    kernel kept the entry it had been given while the file was written (with the metadata TTL: for good with
    `forever`), so after `close` got EIO, `stat` still found the file, with the size it had when it failed (`ls` did
    not list a new one, and an open of it got ENOENT; a rewrite's old bytes read back under the failed one's size)."""
    old = random_bytes(1500, 53)
    bucket = bucket_with(s3, {"ckpt": old})
    name = "new.bin" if how == "new" else "ckpt"
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite",
                 allowed=(SEQUENTIAL_ONLY, "will not be stored")):
        assert os.listdir(mountpoint) == ["ckpt"]
        if how == "rewrite":
            fd = os.open(mountpoint / name, os.O_WRONLY | os.O_TRUNC)
        else:
            fd = os.open(mountpoint / (".tmp" if how == "renamed-onto" else name), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, b"new")
            if how == "renamed-onto":
                os.rename(mountpoint / ".tmp", mountpoint / name)
            assert os.stat(mountpoint / name).st_size == 3
            with pytest.raises(OSError) as info:
                os.pwrite(fd, b"x", 10)
            assert info.value.errno == errno.EINVAL
            assert os.stat(mountpoint / name).st_size == 3  # the kernel has the file's attributes now
        finally:
            with pytest.raises(OSError) as info:
                os.close(fd)
            assert info.value.errno == errno.EIO
        assert os.listdir(mountpoint) == ["ckpt"]
        if how == "new":
            assert not os.path.exists(mountpoint / name)
        else:
            assert os.stat(mountpoint / name).st_size == len(old)
            assert (mountpoint / name).read_bytes() == old
    assert keys(s3, bucket) == {"ckpt": len(old)}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("how", ["unlinked", "failed"])
def test_descriptors_of_a_file_that_left_the_tree_keep_its_attributes(s3: S3Server, mountpoint: Path,
                                                                      how: str) -> None:
    """A file being written that left the tree before it was stored (unlinked while open, or failed at the close of
    one of its descriptors) is still open through the others: fstat and lseek(SEEK_END) of them got ENOENT (its
    GETATTR asked the bucket, which never had it), where a local disk answers them, as this mount does for a stored
    file deleted while open."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, allowed=(SEQUENTIAL_ONLY, "will not be stored")):
        fd = os.open(mountpoint / "f.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        other = os.dup(fd)
        try:
            os.write(fd, b"abc")
            if how == "unlinked":
                os.unlink(mountpoint / "f.bin")
            else:
                with pytest.raises(OSError) as info:
                    os.pwrite(fd, b"x", 10)
                assert info.value.errno == errno.EINVAL
                fd, closing = -1, fd
                with pytest.raises(OSError) as info:
                    os.close(closing)  # fails the file: it leaves the tree, and `other` still has it open
                assert info.value.errno == errno.EIO
            assert not os.path.exists(mountpoint / "f.bin")
            assert os.fstat(other).st_size == 3
            assert os.lseek(other, 0, os.SEEK_END) == 3
        finally:
            for open_fd in (fd, other):
                with contextlib.suppress(OSError):  # EIO for a file that failed
                    if open_fd >= 0:
                        os.close(open_fd)
    assert keys(s3, bucket) == {}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("how", ["failed-file-closed", "reader-of-deleted-object"])
def test_a_file_whose_name_the_kernel_dropped_is_stored_at_its_last_close(s3: S3Server, mountpoint: Path,
                                                                          how: str) -> None:
    """A new file written through two descriptors while the kernel drops its entry of the name (a file of that name
    that failed before is closed now; a reader of the object deleted before it finds that gone): the descriptors'
    paths then read "NAME (deleted)" in /proc, so the close of the first found no other holder of the file and
    stored it, cut short, and the writes through the other got EIO ("write after the file was stored")."""
    old = random_bytes(20 * MiB, 55)
    bucket = bucket_with(s3, {"g": old}) if how == "reader-of-deleted-object" else new_bucket(s3)
    data = random_bytes(3 * MiB, 56)
    fds: dict[str, int] = {}
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-delete", "--chunk-size", "1M",
                 allowed=(SEQUENTIAL_ONLY, "will not be stored", FETCH_FAILED, READ_FAILED)):
        try:
            if how == "failed-file-closed":
                fds["before"] = os.open(mountpoint / "g", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                fds["before, dup"] = os.dup(fds["before"])
                with pytest.raises(OSError):
                    os.pwrite(fds["before"], b"x", 10)  # out of order: that file fails
                with pytest.raises(OSError):
                    os.close(fds.pop("before"))  # it leaves the tree; its other descriptor is closed below
            else:
                fds["before"] = os.open(mountpoint / "g", os.O_RDONLY)
                assert os.pread(fds["before"], MiB, 0) == old[:MiB]
                os.unlink(mountpoint / "g")
            fds["first"] = os.open(mountpoint / "g", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            fds["second"] = os.dup(fds["first"])
            os.write(fds["first"], data[:MiB])
            if how == "failed-file-closed":
                with pytest.raises(OSError):
                    os.close(fds.pop("before, dup"))
            else:
                with pytest.raises(OSError) as info:
                    os.pread(fds["before"], MiB, 10 * MiB)  # a chunk never fetched: the object is gone
                assert info.value.errno == errno.EIO
            os.close(fds.pop("first"))  # `second` still holds the file: nothing is stored yet
            assert keys(s3, bucket) == {}
            os.write(fds["second"], data[MiB:])
            os.close(fds.pop("second"))
        finally:
            for fd in fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
        assert (mountpoint / "g").read_bytes() == data
    assert keys(s3, bucket) == {"g": len(data)}
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("first", ["pwrite", "posix_fallocate"])
def test_a_first_write_out_of_order_fails_the_close_too(s3: S3Server, mountpoint: Path, first: str) -> None:
    """A file whose very first write was out of order (or glibc's posix_fallocate, which writes a byte per
    block where fallocate is not supported) is empty: its close returned 0 and nothing was stored."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, allowed=(SEQUENTIAL_ONLY, "will not be stored")):
        fd = os.open(mountpoint / "x.bin", os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError) as info:
                if first == "pwrite":
                    os.pwrite(fd, b"ahead", 10)
                else:
                    os.posix_fallocate(fd, 0, MiB)
            assert info.value.errno == errno.EINVAL
        finally:
            with pytest.raises(OSError) as info:
                os.close(fd)
            assert info.value.errno == errno.EIO
        assert not os.path.exists(mountpoint / "x.bin")
    assert keys(s3, bucket) == {}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_fsync_reports_on_the_bytes_so_far_and_the_file_goes_on(s3: S3Server, mountpoint: Path) -> None:
    """fsync waits for the parts sent so far and stores nothing: an S3 object cannot be appended to, and
    writers write after fsync (torch.distributed.checkpoint fsyncs its metadata file before its buffered
    bytes reach it). The close of the last descriptor stores the file."""
    bucket = new_bucket(s3)
    head, tail = random_bytes(11 * MiB, 41), random_bytes(3 * MiB, 42)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M"):
        fd = os.open(mountpoint / "f.bin", os.O_WRONLY | os.O_CREAT)
        try:
            os.write(fd, head)
            os.fsync(fd)  # two parts uploaded, one MiB waiting for the next
            assert keys(s3, bucket) == {} and uploads_in(s3, bucket) == ["f.bin"]
            os.write(fd, tail)
            os.fsync(fd)
        finally:
            os.close(fd)
        assert keys(s3, bucket) == {"f.bin": len(head) + len(tail)}
        assert sha((mountpoint / "f.bin").read_bytes()) == sha(head + tail)
    delete_bucket(s3, bucket)


# A writer whose descriptors are closed in other processes too, before it is done: a shell's subshell runs a
# command (its exit closes the inherited stdout), Python starts a subprocess (close-on-exec) and forks a child
# that exits (a DataLoader worker), and a child goes on writing after the parent closed its descriptor.
SHARED_DESCRIPTORS = """
    import os, subprocess, sys, time
    root = sys.argv[1]
    part = 6 * 1024 * 1024
    subprocess.run(["bash", "-c", "(echo line1; /bin/true; echo line2) > shell.txt"], cwd=root, check=True)
    with open(os.path.join(root, "forked.bin"), "wb") as f:
        f.write(b"a" * part)
        f.flush()
        subprocess.run(["true"], check=True)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        f.write(b"b" * part)
    fd = os.open(os.path.join(root, "handed.txt"), os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"parent ")
    pid = os.fork()
    if pid == 0:
        try:
            time.sleep(0.5)
            os.write(fd, b"child")
        finally:
            os._exit(0)  # never the parent's code below, whatever the write did
    os.close(fd)  # returns at once: the child still holds the file
    os.waitpid(pid, 0)
"""


def unit_capability_bounds() -> tuple[str, ...]:
    """`setpriv` arguments that give a command only the capabilities the systemd unit leaves the daemon."""
    unit = (REPO / "systemd" / "modelfs@.service").read_text()
    caps = next(line.partition("=")[2].split() for line in unit.splitlines()
                if line.startswith("CapabilityBoundingSet="))
    keep = ",".join("+" + cap.lower().removeprefix("cap_") for cap in caps)
    return (shutil.which("setpriv") or "setpriv", "--bounding-set", f"-all,{keep}", "--")


@pytest.mark.parametrize("capabilities", ["root", "unit"])
def test_a_close_in_another_process_leaves_the_file_open_for_the_others(s3: S3Server, mountpoint: Path,
                                                                        capabilities: str) -> None:
    """Every close(2) of a descriptor is a FLUSH, in whichever process holds it. A FLUSH stored the file, so a
    forked child's exit, or a subprocess's close-on-exec, cut the file short under its final name, and the
    writer's next write failed with EIO. Now a FLUSH stores the file only when no other descriptor of it is
    left in the opener's process tree; the last one's does. With only the systemd unit's capabilities the
    daemon must still see a root writer's descriptors (the kernel shows them to CAP_SYS_PTRACE only)."""
    if capabilities == "unit" and shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) not installed")
    wrap = unit_capability_bounds() if capabilities == "unit" else ()
    bucket = new_bucket(s3)
    part = 6 * MiB
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M", wrap=wrap):
        run_python(SHARED_DESCRIPTORS, str(mountpoint))
        assert (mountpoint / "shell.txt").read_bytes() == b"line1\nline2\n"
        assert sha((mountpoint / "forked.bin").read_bytes()) == sha(b"a" * part + b"b" * part)
        wait_for("the child's close stores handed.txt", lambda: keys(s3, bucket).get("handed.txt"),
                 lambda n: n is not None)
        assert (mountpoint / "handed.txt").read_bytes() == b"parent child"
    assert keys(s3, bucket) == {"shell.txt": 12, "forked.bin": 2 * part, "handed.txt": 12}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_torch_distributed_checkpoint_saves_and_loads(s3: S3Server, mountpoint: Path) -> None:
    """torch.distributed.checkpoint's FileSystemWriter, as a trainer saves a sharded state dict (here one
    process): it fsyncs each file, its metadata file before the buffered bytes reach it, and renames the
    metadata file into place. Loaded back on a fresh mount."""
    bucket = new_bucket(s3)
    code = """
        import sys, torch
        import torch.distributed.checkpoint as dcp
        torch.manual_seed(0)
        state = {"w": torch.randn(512, 1024), "b": torch.randn(1024), "step": torch.tensor(7)}
        if sys.argv[2] == "save":
            dcp.save(state, storage_writer=dcp.FileSystemWriter(sys.argv[1]))
        else:
            got = {k: torch.zeros_like(v) for k, v in state.items()}
            dcp.load(got, storage_reader=dcp.FileSystemReader(sys.argv[1]))
            assert all(torch.equal(got[k], state[k]) for k in state), "loaded tensors differ"
            print("equal")
    """
    with mounted(s3, bucket, mountpoint, *WRITABLE):
        run_python(code, str(mountpoint / "step-7"), "save")
    assert ".metadata" in {k.rpartition("/")[2] for k in keys(s3, bucket)}, keys(s3, bucket)
    with mounted(s3, bucket, mountpoint):
        assert run_python(code, str(mountpoint / "step-7"), "load").strip() == "equal"
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("size", [1000, 12 * MiB], ids=["one-put", "multipart"])
def test_two_mounts_creating_one_key_only_the_first_close_stores_it(s3: S3Server, mountpoint: Path,
                                                                  tmp_path: Path, size: int) -> None:
    """Two writable mounts of one bucket, without --allow-overwrite, both create ckpt.bin (each HEAD finds
    nothing) and write it; A closes first. B's final PUT or completion is create-only: B's close gets EIO
    and A's bytes stay, with no upload left behind."""
    bucket = new_bucket(s3)
    first, second = random_bytes(size, 31), random_bytes(size, 32)
    other = tmp_path / "b"
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M") as a, \
            mounted(s3, bucket, other, *WRITABLE, "--write-part-size", "5M",
                    allowed=("created meanwhile by another writer", "will not be stored")) as b:
        fa = open(a.path / "ckpt.bin", "wb")  # noqa: SIM115 - both open at once, closed below
        fb = open(b.path / "ckpt.bin", "wb")  # noqa: SIM115
        fa.write(first)
        fb.write(second)
        fa.close()
        with pytest.raises(OSError) as info:
            fb.close()
        assert info.value.errno == errno.EIO
        assert "created meanwhile by another writer" in b.log()
    assert keys(s3, bucket) == {"ckpt.bin": size}
    assert sha(s3.client().get_object(Bucket=bucket, Key="ckpt.bin")["Body"].read()) == sha(first)
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("size", [1000, 12 * MiB], ids=["one-put", "multipart"])
def test_an_o_excl_file_does_not_replace_a_key_stored_before_its_close_with_allow_overwrite(
        s3: S3Server, mountpoint: Path, size: int) -> None:
    """With --allow-overwrite an O_EXCL create checked the bucket at its create only: another writer's object stored
    before the close was replaced. Its PUT or completion is create-only, as without the flag: close gets EIO and the
    other writer's object stays, with no upload left behind."""
    bucket = new_bucket(s3)
    mine = random_bytes(size, 35)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", "--write-part-size", "5M",
                 allowed=("created meanwhile by another writer", "will not be stored")) as m:
        fd = os.open(mountpoint / "lock", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, mine)
        put_objects(s3, bucket, {"lock": b"theirs"})
        with pytest.raises(OSError) as info:
            os.close(fd)
        assert info.value.errno == errno.EIO
        assert "created meanwhile by another writer" in m.log()
        # A create without O_EXCL still replaces, as the flag allows.
        fd = os.open(mountpoint / "plain", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        put_objects(s3, bucket, {"plain": b"theirs"})
        os.write(fd, b"mine")
        os.close(fd)
    assert s3.client().get_object(Bucket=bucket, Key="lock")["Body"].read() == b"theirs"
    assert s3.client().get_object(Bucket=bucket, Key="plain")["Body"].read() == b"mine"
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_an_o_excl_file_renamed_while_written_does_not_replace_a_key_stored_at_its_old_name(
        s3: S3Server, mountpoint: Path) -> None:
    """With --allow-overwrite, an O_EXCL file renamed while written (safetensors' order, its temp file made with
    `open(p, "x")` or `mkstemp`) has its upload completed under the name it was created at, then moved. That
    completion went without the create-only condition: another writer's object stored at the old name meanwhile was
    replaced, and the move's delete then removed it, the loss O_EXCL promised against. It is create-only: close gets
    EIO, the other object stays, no upload is left."""
    bucket = new_bucket(s3)
    mine = random_bytes(12 * MiB, 36)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", "--write-part-size", "5M",
                 allowed=("created meanwhile by another writer", "will not be stored")) as m:
        fd = os.open(mountpoint / ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, mine)  # its upload has begun under ".tmp"
        os.rename(mountpoint / ".tmp", mountpoint / "model")
        put_objects(s3, bucket, {".tmp": b"theirs"})
        with pytest.raises(OSError) as info:
            os.close(fd)
        assert info.value.errno == errno.EIO
        assert "created meanwhile by another writer" in m.log()
    assert keys(s3, bucket) == {".tmp": 6}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_a_file_renamed_while_written_does_not_replace_a_key_another_mount_stored(s3: S3Server, mountpoint: Path,
                                                                                 tmp_path: Path) -> None:
    """save_file's order on mount A (write a temp file, rename it over the final name, close) while mount B
    creates the final name and closes first. A's upload began under the temp name, so A's close moves it
    by a copy, which is create-only without --allow-overwrite: A gets EIO, B's bytes stay, and neither A's
    temp object nor an upload is left."""
    bucket = new_bucket(s3)
    size = 12 * MiB
    first, second = random_bytes(size, 33), random_bytes(1000, 34)
    other = tmp_path / "b"
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M",
                 allowed=("created meanwhile by another writer", "will not be stored")) as a, \
            mounted(s3, bucket, other, *WRITABLE) as b:
        fa = open(a.path / ".tmpA", "wb")  # noqa: SIM115 - closed below, after the race
        fa.write(first)
        os.rename(a.path / ".tmpA", a.path / "model.safetensors")
        (b.path / "model.safetensors").write_bytes(second)
        with pytest.raises(OSError) as info:
            fa.close()
        assert info.value.errno == errno.EIO
        assert "created meanwhile by another writer" in a.log()
        assert sorted(os.listdir(a.path)) == ["model.safetensors"]
    assert keys(s3, bucket) == {"model.safetensors": 1000}
    assert s3.client().get_object(Bucket=bucket, Key="model.safetensors")["Body"].read() == second
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("overwrite", [False, True], ids=["create-only", "allow-overwrite"])
def test_the_old_name_of_a_file_renamed_while_written_is_busy_until_it_is_stored(s3: S3Server, mountpoint: Path,
                                                                               overwrite: bool) -> None:
    """A file renamed while it is written keeps its multipart upload under its old name until its close (an upload
    cannot be renamed): it is completed there, copied to the new name, and the old key deleted. A file stored under
    the old name meanwhile (a log rotated while written, a new `log` created) was overwritten by that completion and
    then deleted by the move (with --allow-overwrite: its close had returned 0, and it was gone from the bucket), or
    made the renamed file's close fail with EIO (create-only: "created meanwhile by another writer"). The old name is
    busy (EBUSY) until the renamed file is stored; then it can be written."""
    bucket = new_bucket(s3)
    first, second = random_bytes(6 * MiB, 51), b"second"
    flags = ("--allow-overwrite",) if overwrite else ()
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M", *flags, allowed=(UPLOAD_UNDER_IT,)):
        (mountpoint / "other").write_bytes(second)
        f = open(mountpoint / "log", "wb")  # noqa: SIM115 - closed below, after the other writes
        f.write(first)
        f.flush()  # one part is on its way: the upload began under "log"
        os.rename(mountpoint / "log", mountpoint / "log.1")
        answers = []
        for attempt in (lambda: (mountpoint / "log").write_bytes(second),
                        lambda: os.rename(mountpoint / "other", mountpoint / "log")):
            try:
                attempt()
                answers.append("ok")
            except OSError as exc:
                answers.append(errno.errorcode[exc.errno])
        f.close()  # stored as log.1 (it raised EIO when a new `log` was stored first)
        assert sha(s3.client().get_object(Bucket=bucket, Key="log.1")["Body"].read()) == sha(first)
        # Whatever was stored under "log" meanwhile is still there (it was deleted with --allow-overwrite).
        stored = {"log": second} if "ok" in answers else {}
        assert {k: v for k, v in keys(s3, bucket).items() if k == "log"} == {k: len(v) for k, v in stored.items()}
        assert answers == ["EBUSY", "EBUSY"]
        (mountpoint / "log").write_bytes(second)  # free once the renamed file is stored
        assert sorted(os.listdir(mountpoint)) == ["log", "log.1", "other"]
    assert keys(s3, bucket) == {"log": len(second), "log.1": len(first), "other": len(second)}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("then", ["unlink", "rename-away", "unlink-refused"])
def test_a_file_renamed_onto_a_stored_one_while_written_takes_its_place(s3: S3Server, mountpoint: Path,
                                                                        then: str) -> None:
    """save_file's order over an existing checkpoint: a temporary file renamed onto it before its close. The old
    object stays in the bucket until the new one is stored under the name, but the name is the new file's: removed
    (`rm`) or renamed away before its close, the old checkpoint came back under the name, with its old bytes in the
    bucket and on the mount (and `rm` had returned 0). It goes with the file that replaced it, as the object an
    O_TRUNC rewrite replaces does: at the rename, or at the unlink, which needs --allow-delete (EPERM without: the
    new file is then stored at its close)."""
    old = random_bytes(1500, 54)
    bucket = bucket_with(s3, {"ckpt": old})
    flags = ("--allow-overwrite",) if then == "unlink-refused" else ("--allow-overwrite", "--allow-delete")
    with mounted(s3, bucket, mountpoint, *WRITABLE, *flags, allowed=("needs --allow-delete",)):
        assert os.listdir(mountpoint) == ["ckpt"]
        fd = os.open(mountpoint / ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, b"new")
            os.rename(mountpoint / ".tmp", mountpoint / "ckpt")
            if then == "rename-away":
                os.rename(mountpoint / "ckpt", mountpoint / "moved")
            else:
                with contextlib.nullcontext() if then == "unlink" else pytest.raises(OSError) as info:
                    os.unlink(mountpoint / "ckpt")
                if then == "unlink-refused":
                    assert info.value.errno == errno.EPERM
        finally:
            os.close(fd)
        want = {"unlink": {}, "rename-away": {"moved": b"new"}, "unlink-refused": {"ckpt": b"new"}}[then]
        assert sorted(os.listdir(mountpoint)) == sorted(want)
        assert {name: (mountpoint / name).read_bytes() for name in want} == want
    assert {k: s3.client().get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys(s3, bucket)} == want
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_an_open_for_writing_of_an_empty_stored_file_is_a_touch_without_allow_overwrite(
        s3: S3Server, mountpoint: Path) -> None:
    """A lock file (filelock opens the empty file its first lock stored O_RDWR, flocks it, closes it) or a marker
    opened for writing again, without --allow-overwrite: the open works, nothing is stored at its close (the
    object is the same one: same ETag), and a write through it fails with EPERM. Before, the open itself was EPERM,
    and `hf_hub_download(local_dir=...)` failed on its second lock."""
    bucket = bucket_with(s3, {"d/.lock": b"", "full.bin": b"bytes"})
    etag = s3.client().head_object(Bucket=bucket, Key="d/.lock")["ETag"]
    with mounted(s3, bucket, mountpoint, *WRITABLE, allowed=(NEEDS_OVERWRITE,)) as m:
        lock = mountpoint / "d" / ".lock"
        for flags in (os.O_RDWR, os.O_WRONLY | os.O_CREAT, os.O_RDWR | os.O_TRUNC):
            fd = os.open(lock, flags)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                assert os.fstat(fd).st_size == 0
                with pytest.raises(OSError) as info:
                    os.write(fd, b"x")
                assert info.value.errno == errno.EPERM
            finally:
                os.close(fd)  # nothing to store: 0
            assert lock.read_bytes() == b""
        with pytest.raises(OSError) as info:
            os.open(mountpoint / "full.bin", os.O_RDWR)  # replacing bytes still needs the flag
        assert info.value.errno == errno.EPERM
        assert sum("d/.lock exists; replacing it needs --allow-overwrite" in line
                   for line in warning_lines(m.log())) == 3
    assert s3.client().head_object(Bucket=bucket, Key="d/.lock")["ETag"] == etag
    assert keys(s3, bucket) == {"d/.lock": 0, "full.bin": 5}
    delete_bucket(s3, bucket)


def test_an_append_to_an_empty_stored_file_still_needs_allow_overwrite(s3: S3Server, mountpoint: Path) -> None:
    """An appender of an existing empty file (logging.FileHandler, mode "a"), without --allow-overwrite: its open is
    EPERM, as before empty files' opens became touches. Opened as a touch, the logger lost every record, and each
    refused write was one more warning in the daemon's log, for the whole run."""
    bucket = bucket_with(s3, {"train.log": b""})
    with mounted(s3, bucket, mountpoint, *WRITABLE, allowed=(NEEDS_OVERWRITE,)):
        try:
            fd = os.open(mountpoint / "train.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except OSError as exc:
            assert exc.errno == errno.EPERM
        else:
            os.close(fd)
            pytest.fail("an existing empty file was opened for appending without --allow-overwrite")
    assert keys(s3, bucket) == {"train.log": 0}
    delete_bucket(s3, bucket)


APPENDING = "appending to an existing file is not supported"


def test_with_allow_overwrite_an_append_to_an_empty_stored_file_writes_it_whole(s3: S3Server, mountpoint: Path) -> None:
    """`open(p, "ab")` of a stored empty file (README: an empty file needs no O_TRUNC) writes it whole from its start,
    as on a local disk (it was EOPNOTSUPP); of one with bytes it stays EOPNOTSUPP, with a warning that says why."""
    bucket = bucket_with(s3, {"train.log": b"", "full.log": b"step 1\n"})
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", allowed=(APPENDING,)) as m:
        with open(mountpoint / "train.log", "ab") as f:
            f.write(b"step 2\n")
            f.flush()
            f.write(b"step 3\n")
        assert (mountpoint / "train.log").read_bytes() == b"step 2\nstep 3\n"
        with pytest.raises(OSError) as info:
            open(mountpoint / "full.log", "ab").close()  # noqa: SIM115
        assert info.value.errno == errno.EOPNOTSUPP
        assert sum(APPENDING in line for line in warning_lines(m.log())) == 1
    client = s3.client()
    assert [client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in ("train.log", "full.log")] == [
        b"step 2\nstep 3\n", b"step 1\n"]
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_an_append_to_a_file_listed_empty_that_another_writer_filled_since_keeps_its_bytes(
        s3: S3Server, mountpoint: Path) -> None:
    """With --allow-overwrite, an append (or `r+b`) of a file this mount listed empty rewrites it whole, which is right
    only while it is empty: another node stored bytes there since (within the TTL), and `open(p, "ab")` replaced them
    with its own lines, unseen (B299). The open asks the bucket now: it opens what is there, and a file with bytes is
    EOPNOTSUPP for an append (the bucket keeps the other node's bytes); one deleted since is created anew."""
    bucket = bucket_with(s3, {"train.log": b"", "notes": b"", "gone.log": b"", "empty.log": b""})
    client = s3.client()
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", allowed=(APPENDING,)):
        assert sorted((p.name, p.stat().st_size) for p in mountpoint.iterdir()) == [
            ("empty.log", 0), ("gone.log", 0), ("notes", 0), ("train.log", 0)]
        client.put_object(Bucket=bucket, Key="train.log", Body=b"step 1\n")  # another node
        client.put_object(Bucket=bucket, Key="notes", Body=b"theirs")
        client.delete_object(Bucket=bucket, Key="gone.log")
        for name, mode in (("train.log", "ab"), ("train.log", "a+b"), ("notes", "r+b")):
            with pytest.raises(OSError) as info:
                open(mountpoint / name, mode).close()  # noqa: SIM115
            assert info.value.errno == errno.EOPNOTSUPP, (name, mode)
        assert (mountpoint / "train.log").read_bytes() == b"step 1\n"
        with open(mountpoint / "gone.log", "ab") as f:
            f.write(b"new\n")
        with open(mountpoint / "empty.log", "ab") as f:  # still empty: written whole, as before
            f.write(b"step 2\n")
        assert (mountpoint / "empty.log").read_bytes() == b"step 2\n"
    assert {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys(s3, bucket)} == {
        "train.log": b"step 1\n", "notes": b"theirs", "gone.log": b"new\n", "empty.log": b"step 2\n"}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


CHANGED_SINCE = r"another writer changed .* since this rewrite opened it"


def test_a_rewrite_that_keeps_the_opened_version_does_not_replace_another_writer_s_update(
        s3: S3Server, mountpoint: Path) -> None:
    """With --allow-overwrite an append to an empty stored file, or its `r+b`, keeps the version it opened (it is
    empty) and writes on after it; B299 asks the bucket at the open, but what another writer stored (or deleted) under
    the key between the open and the close was replaced at the close, with nothing said (B308). The store is now
    If-Match on the version opened: the close is EIO with one warning naming the key, the other writer's object stays,
    and nothing is left of the upload. Unchanged, such a rewrite is stored as before, one PUT or multipart. (moto 5.2.6
    ignores If-Match on CompleteMultipartUpload, so the multipart conflict is checked on SeaweedFS; S3 takes it.)"""
    names = ("train.log", "notes", "gone.log", "big.log", "kept.log", "kept-big.log")
    bucket = bucket_with(s3, dict.fromkeys(names, b""))
    client = s3.client()
    big, theirs_big = random_bytes(12 * MiB, 1), random_bytes(6 * MiB, 2)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", "--write-part-size", "5M",
                 allowed=(CHANGED_SINCE, r"will not be stored")) as m:
        conflicts = {"train.log": (os.O_WRONLY | os.O_APPEND, b"theirs\n"), "notes": (os.O_RDWR, b"their notes"),
                     "gone.log": (os.O_WRONLY | os.O_APPEND, None)}
        if s3.name == "seaweedfs":
            conflicts["big.log"] = (os.O_WRONLY | os.O_APPEND, theirs_big)
        for name, (flags, theirs) in conflicts.items():
            fd = os.open(mountpoint / name, flags)
            try:
                os.write(fd, big if name == "big.log" else b"mine\n")
                if theirs is None:
                    client.delete_object(Bucket=bucket, Key=name)  # another node deleted it
                else:
                    client.put_object(Bucket=bucket, Key=name, Body=theirs)  # another node stored it
            finally:
                with pytest.raises(OSError) as info:
                    os.close(fd)
            assert info.value.errno == errno.EIO, name
        for name, data in (("kept.log", b"step 1\n"), ("kept-big.log", big)):  # nobody else writing: stored
            fd = os.open(mountpoint / name, os.O_WRONLY | os.O_APPEND)
            os.write(fd, data)
            os.close(fd)
        seen = {name: (mountpoint / name).read_bytes() if (mountpoint / name).exists() else None for name in conflicts}
        warnings = [line for line in warning_lines(m.log()) if "since this rewrite opened it" in line]
        assert len(warnings) == len(conflicts), warnings
        for name in conflicts:
            assert sum(f"changed {name} " in line for line in warnings) == 1, (name, warnings)
    stored = {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys(s3, bucket)}
    expected = {"train.log": b"theirs\n", "notes": b"their notes", "big.log": theirs_big, "kept.log": b"step 1\n",
                "kept-big.log": big}
    if s3.name != "seaweedfs":
        expected["big.log"] = b""
    assert {k: sha(v) for k, v in stored.items()} == {k: sha(v) for k, v in expected.items()}
    # The mount shows what the other writer left, as the bucket holds it.
    assert {k: sha(v) if v is not None else None for k, v in seen.items()} == {
        k: sha(expected[k]) if k in expected else None for k in conflicts}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_a_deferred_rewrite_that_keeps_the_opened_version_does_not_replace_another_writer_s_update(
        s3: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    """With --cache-dir, a file extended by `ftruncate` before its first write is deferred: uploaded at close from its
    local copy (new_file). A rewrite that keeps the version it opened (`r+b` of an empty stored file, save_file's
    order) goes that way too, and is stored If-Match on that version as a streamed one is (B308): what another writer
    stored meanwhile stays, the close EIO; unchanged, it is stored (the review of B308). (moto 5.2.6 ignores If-Match
    on CompleteMultipartUpload: the multipart conflict is checked on SeaweedFS.)"""
    bucket = bucket_with(s3, {"small.bin": b"", "big.bin": b"", "kept.bin": b""})
    client = s3.client()
    small, big = random_bytes(1000, 6), random_bytes(12 * MiB, 7)
    cases = {"small.bin": (small, b"theirs"), "kept.bin": (big, None)}
    if s3.name == "seaweedfs":
        cases["big.bin"] = (big, b"theirs too")
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", "--cache-dir", str(tmp_path / "cache"),
                 "--write-part-size", "5M", allowed=(CHANGED_SINCE, r"will not be stored")) as m:
        for name, (data, theirs) in cases.items():
            fd = os.open(mountpoint / name, os.O_RDWR)
            try:
                os.ftruncate(fd, len(data))
                os.write(fd, data)
                if theirs is not None:
                    client.put_object(Bucket=bucket, Key=name, Body=theirs)
            finally:
                if theirs is None:
                    os.close(fd)
                else:
                    with pytest.raises(OSError) as info:
                        os.close(fd)
                    assert info.value.errno == errno.EIO, name
        log = m.log()
        for name, (data, _) in cases.items():
            assert f"{name}: uploading {len(data)} bytes from its local copy" in log, name
    expected = {"small.bin": b"theirs", "kept.bin": big, "big.bin": b"theirs too" if s3.name == "seaweedfs" else b""}
    assert {k: sha(client.get_object(Bucket=bucket, Key=k)["Body"].read()) for k in keys(s3, bucket)} == {
        k: sha(v) for k, v in expected.items()}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_a_rewrite_that_keeps_the_opened_version_renamed_while_written_is_stored_under_its_new_name(
        s3: S3Server, mountpoint: Path) -> None:
    """A rewrite that keeps the version it opened is stored If-Match on that version under its key (B308); renamed
    while written, the rename deletes that version (the object it replaces), and an upload begun under the old key is
    completed there before it is moved: with the condition still on, that completion found nothing there (412) and the
    close was EIO (B310). The condition goes with the rename, as a rename replaces what is at its name."""
    bucket = bucket_with(s3, {"big.log": b"", "small.log": b""})
    big = random_bytes(12 * MiB, 3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", "--allow-delete", "--write-part-size", "5M"):
        for name, data in (("big.log", big), ("small.log", b"mine\n")):
            fd = os.open(mountpoint / name, os.O_WRONLY | os.O_APPEND)
            os.write(fd, data)  # the big one's upload begins under its old key
            os.rename(mountpoint / name, mountpoint / f"moved-{name}")
            os.close(fd)
        assert sorted(p.name for p in mountpoint.iterdir()) == ["moved-big.log", "moved-small.log"]
    client = s3.client()
    assert {k: sha(client.get_object(Bucket=bucket, Key=k)["Body"].read()) for k in keys(s3, bucket)} == {
        "moved-big.log": sha(big), "moved-small.log": sha(b"mine\n")}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_a_rewrite_that_keeps_the_opened_version_renamed_while_written_leaves_another_writer_s_update(
        s3: S3Server, mountpoint: Path) -> None:
    """A rewrite that keeps the version it opened, renamed while written, deletes that version under its old name (it
    replaces it). The delete was plain: what another writer stored there since the open went with it, unseen, though
    its close would not have replaced it (B308). Only the version opened goes now (If-Match): another writer's object
    stays under the old name, and the mount shows it (B371). An upload already begun under the old key (completed
    there before it is moved, B31) is completed only over the version opened: the close is EIO, theirs stays (moto
    5.2.6 ignores If-Match on the completion, so that is checked on SeaweedFS). Renamed back to its name, it replaces
    what is there, as any rename does."""
    bucket = bucket_with(s3, {"small.log": b"", "big.log": b"", "back.log": b""})
    client = s3.client()
    big, theirs_big = random_bytes(12 * MiB, 4), random_bytes(6 * MiB, 5)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", "--allow-delete", "--write-part-size", "5M",
                 allowed=(r"another writer stored .* since this rewrite opened it", CHANGED_SINCE,
                          r"will not be stored")):
        fd = os.open(mountpoint / "small.log", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"mine\n")
            client.put_object(Bucket=bucket, Key="small.log", Body=b"theirs\n")  # another node stored it
            os.rename(mountpoint / "small.log", mountpoint / "moved-small.log")
        finally:
            os.close(fd)
        assert (mountpoint / "small.log").read_bytes() == b"theirs\n"
        assert (mountpoint / "moved-small.log").read_bytes() == b"mine\n"
        # Renamed away and back onto the other writer's object: the rename replaces it, as any rename does.
        fd = os.open(mountpoint / "back.log", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"mine\n")
            client.put_object(Bucket=bucket, Key="back.log", Body=b"theirs\n")
            os.rename(mountpoint / "back.log", mountpoint / "away.log")
            os.rename(mountpoint / "away.log", mountpoint / "back.log")
        finally:
            os.close(fd)
        if s3.name == "seaweedfs":
            fd = os.open(mountpoint / "big.log", os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, big)  # its upload begins under big.log
                client.put_object(Bucket=bucket, Key="big.log", Body=theirs_big)
                os.rename(mountpoint / "big.log", mountpoint / "moved-big.log")
            finally:
                with pytest.raises(OSError) as info:
                    os.close(fd)
            assert info.value.errno == errno.EIO
    expected = {"small.log": b"theirs\n", "moved-small.log": b"mine\n", "big.log": b"", "back.log": b"mine\n"}
    if s3.name == "seaweedfs":
        expected["big.log"] = theirs_big
    assert {k: sha(client.get_object(Bucket=bucket, Key=k)["Body"].read()) for k in keys(s3, bucket)} == {
        k: sha(v) for k, v in expected.items()}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_an_open_to_append_that_truncates_is_a_whole_rewrite(s3: S3Server, mountpoint: Path) -> None:
    """`O_WRONLY | O_APPEND | O_TRUNC` of a stored file with bytes empties it and appends: a whole rewrite, as `O_TRUNC`
    alone is (with --allow-overwrite; EPERM without, its warning naming the flag). It was EOPNOTSUPP, refused as an
    append, and its warning said that only whole rewrites (O_TRUNC) are supported, to an open that had O_TRUNC
    (B300)."""
    bucket = bucket_with(s3, {"run.log": b"old run\n"})
    flags = os.O_WRONLY | os.O_APPEND | os.O_TRUNC
    with mounted(s3, bucket, mountpoint, *WRITABLE, allowed=(NEEDS_OVERWRITE,)) as m:
        with pytest.raises(OSError) as info:
            os.close(os.open(mountpoint / "run.log", flags))
        assert info.value.errno == errno.EPERM
        assert not any(APPENDING in line for line in warning_lines(m.log()))
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite") as m:
        fd = os.open(mountpoint / "run.log", flags)
        try:
            os.write(fd, b"new run\n")
            os.write(fd, b"step 1\n")
        finally:
            os.close(fd)
        assert (mountpoint / "run.log").read_bytes() == b"new run\nstep 1\n"
    assert s3.client().get_object(Bucket=bucket, Key="run.log")["Body"].read() == b"new run\nstep 1\n"
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_without_allow_overwrite_a_refused_append_or_update_in_place_says_the_flag_is_not_enough(
        s3: S3Server, mountpoint: Path) -> None:
    """An append (`open(p, "ab")`) or an update in place (`open(p, "r+b")`, numpy's `open_memmap(mode="w+")` reopening
    the header it stored) of a stored file with bytes, without --allow-overwrite: EPERM, and the log says that only
    whole rewrites are supported. It said only that replacing the file needs --allow-overwrite (and for the append
    at info level): with the flag the open is EOPNOTSUPP all the same."""
    bucket = bucket_with(s3, {"full.log": b"step 1\n"})
    with mounted(s3, bucket, mountpoint, *WRITABLE, allowed=(APPENDING,)) as m:
        for mode in ("ab", "r+b"):
            with pytest.raises(OSError) as info:
                open(mountpoint / "full.log", mode).close()  # noqa: SIM115
            assert info.value.errno == errno.EPERM
        said = [line for line in warning_lines(m.log()) if APPENDING in line]
        assert len(said) == 1 and "needs --allow-overwrite" in said[0], said
        assert "full.log exists; replacing it needs --allow-overwrite, and only whole rewrites (O_TRUNC) are " \
            "supported" in m.log()  # the update in place: at info level, as a `touch` opens a stored file so
    assert keys(s3, bucket) == {"full.log": 7}
    delete_bucket(s3, bucket)


def test_overwrite_and_delete_need_their_flags(s3: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    bucket = bucket_with(s3, {"a.bin": b"old", "d/b.bin": b"bee"})
    with mounted(s3, bucket, mountpoint, *WRITABLE, allowed=(NEEDS_OVERWRITE, "needs --allow-delete")) as m:
        for attempt, err in ((lambda: open(mountpoint / "a.bin", "wb"), errno.EPERM),
                             (lambda: os.unlink(mountpoint / "a.bin"), errno.EPERM),
                             (lambda: os.rmdir(mountpoint / "d"), errno.EPERM),
                             (lambda: os.rename(mountpoint / "a.bin", mountpoint / "c.bin"), errno.EPERM)):
            with pytest.raises(OSError) as info:
                attempt()
            assert info.value.errno == err
        (mountpoint / "new.bin").write_bytes(b"new")
        with pytest.raises(OSError) as info:
            os.rename(mountpoint / "new.bin", mountpoint / "a.bin")  # onto an existing key
        assert info.value.errno == errno.EPERM
        os.rename(mountpoint / "new.bin", mountpoint / "renamed.bin")  # a file this mount wrote
    assert keys(s3, bucket) == {"a.bin": 3, "d/b.bin": 3, "renamed.bin": 3}
    # A refused delete names its flag once (a checkpoint rotation's rmtree failed with EPERM and no hint).
    refusals = [line for line in warning_lines(m.log()) if "needs --allow-delete" in line]
    assert len(refusals) == 2 and "deleting a.bin needs --allow-delete (further refusals" in refusals[0], refusals
    other = tmp_path / "other"
    with mounted(s3, bucket, other, *WRITABLE, "--allow-overwrite", "--allow-delete", allowed=("is not renamed",)):
        (other / "a.bin").write_bytes(b"replaced")
        assert (other / "a.bin").read_bytes() == b"replaced"
        os.rename(other / "renamed.bin", other / "a.bin")
        assert (other / "a.bin").read_bytes() == b"new"
        assert sorted(os.listdir(other)) == ["a.bin", "d"]
        with pytest.raises(OSError) as info:
            os.rmdir(other / "d")
        assert info.value.errno == errno.ENOTEMPTY
        with pytest.raises(OSError) as info:
            os.rename(other / "d", other / "e")
        assert info.value.errno == errno.EXDEV
        os.unlink(other / "d" / "b.bin")
        os.rmdir(other / "d")
        assert os.listdir(other) == ["a.bin"]
    assert keys(s3, bucket) == {"a.bin": 3}
    delete_bucket(s3, bucket)


def test_mkdir_is_visible_at_once_and_empty_and_rmdir_removes_it(s3: S3Server, mountpoint: Path,
                                                                 tmp_path: Path) -> None:
    bucket = bucket_with(s3, {"keep/x": b"1"})
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-delete"):
        os.listdir(mountpoint)  # the root's listing is cached before the change
        os.mkdir(mountpoint / "new")
        assert sorted(os.listdir(mountpoint)) == ["keep", "new"]
        assert os.listdir(mountpoint / "new") == []
        with pytest.raises(FileExistsError):
            os.mkdir(mountpoint / "new")
        os.mkdir(mountpoint / "gone")
        os.rmdir(mountpoint / "gone")
        assert sorted(os.listdir(mountpoint)) == ["keep", "new"]
        assert mount_stats(mountpoint)["writes"]["deletes"] == 1  # an rmdir is a delete, as its refusal is
        os.rename(mountpoint / "new", mountpoint / "moved")  # an empty directory
        assert sorted(os.listdir(mountpoint)) == ["keep", "moved"]
    other = tmp_path / "other"
    with mounted(s3, bucket, other):
        assert sorted(os.listdir(other)) == ["keep", "moved"]
        assert os.listdir(other / "moved") == []
    delete_bucket(s3, bucket)


def test_renaming_a_directory_this_mount_did_not_make_needs_allow_delete(s3: S3Server, mountpoint: Path) -> None:
    """An empty directory's rename puts its new marker and deletes the old one: without --allow-delete that delete
    went ahead for a directory another had made, as a file's is refused (EPERM). One this mount made moves freely."""
    bucket = bucket_with(s3, {"theirs/": b""})
    with mounted(s3, bucket, mountpoint, *WRITABLE, allowed=(r"directory this mount did not write needs",)):
        with pytest.raises(OSError) as info:
            os.rename(mountpoint / "theirs", mountpoint / "moved")
        assert info.value.errno == errno.EPERM
        os.mkdir(mountpoint / "mine")
        os.rename(mountpoint / "mine", mountpoint / "mine2")
        assert sorted(os.listdir(mountpoint)) == ["mine2", "theirs"]
    assert keys(s3, bucket) == {"theirs/": 0, "mine2/": 0}
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-delete"):
        os.rename(mountpoint / "theirs", mountpoint / "moved")
    assert keys(s3, bucket) == {"moved/": 0, "mine2/": 0}
    delete_bucket(s3, bucket)


def test_a_directory_made_again_where_one_was_removed_takes_new_files(s3: S3Server, mountpoint: Path) -> None:
    """rmdir, then mkdir of the same name, while something still holds the removed directory (a shell's cwd, an open
    descriptor, a dentry the kernel had not evicted yet: a fuzzer's run hit it with none of its own): the new directory
    got the removed one's inode number, and the kernel, which still had that inode marked dead, refused every name in
    it (ENOENT) until it evicted it. A directory made again is a new inode."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-delete"):
        os.mkdir(mountpoint / "d")
        held = os.open(mountpoint / "d", os.O_RDONLY)
        try:
            os.rmdir(mountpoint / "d")
            os.mkdir(mountpoint / "d")
            (mountpoint / "d" / "f").write_bytes(b"new")
            assert os.listdir(mountpoint / "d") == ["f"]
        finally:
            os.close(held)
        (mountpoint / "d" / "g").write_bytes(b"more")
        assert sorted(os.listdir(mountpoint / "d")) == ["f", "g"]
    assert keys(s3, bucket) == {"d/": 0, "d/f": 3, "d/g": 4}
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("overwrite", [(), ("--allow-overwrite",)], ids=["", "allow-overwrite"])
def test_a_name_another_writer_made_of_the_other_kind_is_not_hidden_or_hiding(s3: S3Server, mountpoint: Path,
                                                                              overwrite: tuple[str, ...]) -> None:
    """A name both a file and a directory in the bucket is shown as the directory. While this mount's listing said
    the names were free, another writer made a directory `run` and a file `latest`: a file created or renamed onto
    `run` was stored and never seen (close 0, then `run` listed as a directory), and `mkdir latest` hid the stored
    file (S3 holds both keys; SeaweedFS refused the second, EIO). They are refused with the errno a local disk gives."""
    bucket = bucket_with(s3, {"step.tmp": b"ckpt"})
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-delete", *overwrite,
                 allowed=(r"of that name is in the bucket", NEEDS_OVERWRITE)):
        os.mkdir(mountpoint / "empty")
        assert sorted(os.listdir(mountpoint)) == ["empty", "step.tmp"]  # listed: the names below are free here
        put_objects(s3, bucket, {"run/rank0.pt": b"theirs", "latest": b"step-10", "ckpt.pt": b"theirs too"})
        if not overwrite:  # a file of the same kind: its create is refused, and the name shown as it is
            with pytest.raises(OSError) as info:
                open(mountpoint / "ckpt.pt", "wb")
            assert info.value.errno == errno.EPERM
            assert (mountpoint / "ckpt.pt").read_bytes() == b"theirs too"
        for attempt, err in ((lambda: open(mountpoint / "run", "wb"), errno.EISDIR),
                             (lambda: os.replace(mountpoint / "step.tmp", mountpoint / "run"), errno.EISDIR),
                             (lambda: os.mkdir(mountpoint / "latest"), errno.EEXIST),
                             (lambda: os.makedirs(mountpoint / "latest", exist_ok=True), errno.EEXIST),
                             (lambda: os.rename(mountpoint / "empty", mountpoint / "latest"), errno.ENOTDIR)):
            with pytest.raises(OSError) as info:
                attempt()
            assert info.value.errno == err
        # And this mount shows what the other writer made, not the names its listing had.
        assert (mountpoint / "run").is_dir() and (mountpoint / "latest").read_bytes() == b"step-10"
        assert sorted(os.listdir(mountpoint)) == ["ckpt.pt", "empty", "latest", "run", "step.tmp"]
        assert (mountpoint / "step.tmp").read_bytes() == b"ckpt"
    assert keys(s3, bucket) == {"step.tmp": 4, "empty/": 0, "run/rank0.pt": 6, "latest": 7, "ckpt.pt": 10}
    delete_bucket(s3, bucket)


def test_an_o_excl_create_or_mknod_onto_a_directory_another_writer_made_is_eexist(s3: S3Server,
                                                                                 mountpoint: Path) -> None:
    """`open(O_CREAT|O_EXCL)` and `mknod` of a name a local disk holds a directory at are EEXIST (the name exists;
    EISDIR is a create without O_EXCL's). Where another writer made the directory since this mount listed the name
    free, the mount said EISDIR: a lock taker that waits on EEXIST (`open(p, "x")`) failed instead."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, allowed=(r"of that name is in the bucket",)):
        assert os.listdir(mountpoint) == []  # listed: the names below are free here
        put_objects(s3, bucket, {"a/x": b"1", "b/x": b"2"})
        with pytest.raises(OSError) as info:
            os.open(mountpoint / "a", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        assert info.value.errno == errno.EEXIST
        with pytest.raises(OSError) as info:
            os.mknod(mountpoint / "b", stat.S_IFREG | 0o644)
        assert info.value.errno == errno.EEXIST
        assert (mountpoint / "a").is_dir() and (mountpoint / "b").is_dir()
    assert keys(s3, bucket) == {"a/x": 1, "b/x": 1}
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("overwrite", [(), ("--allow-overwrite",)], ids=["create-only", "allow-overwrite"])
def test_a_mknod_that_loses_the_race_for_its_name_to_another_writer_is_eexist(s3: S3Server, mountpoint: Path,
                                                                              overwrite: tuple[str, ...]) -> None:
    """`mknod(p, S_IFREG)` is an O_EXCL create and close: its HEAD finds the name free, its create-only PUT finds the
    key another mount stored in between (412). A local disk says EEXIST; the mount said EIO (a lock taker that
    waits on EEXIST failed instead). The other writer's object stays, and the name is found as that file."""
    bucket = new_bucket(s3)
    with FaultProxy(s3.endpoint_url) as proxy, \
            mounted_via(proxy, s3, bucket, mountpoint, *WRITABLE, *overwrite, allowed=(r"created meanwhile",)):
        held = proxy.inject(Fault.LATENCY, seconds=60, op="put", times=1)  # the mknod's PUT, held until cleared
        failed: list[int] = []

        def make() -> None:
            try:
                os.mknod(mountpoint / "lock", stat.S_IFREG | 0o644)
            except OSError as exc:
                failed.append(exc.errno)

        maker = threading.Thread(target=make)
        maker.start()
        try:
            wait_for("the mknod's PUT at the proxy", lambda: held.hits)
            put_objects(s3, bucket, {"lock": b"theirs"})  # the other mount's, after the HEAD, before the PUT
        finally:
            proxy.clear()
            maker.join(60)
        assert failed == [errno.EEXIST]
        assert (mountpoint / "lock").read_bytes() == b"theirs"
    assert keys(s3, bucket) == {"lock": 6}
    delete_bucket(s3, bucket)


def test_names_the_read_side_would_skip_are_refused(s3: S3Server, mountpoint: Path) -> None:
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE):
        with pytest.raises(OSError) as info:
            open(mountpoint / b"bad\xff".decode("utf-8", "surrogateescape"), "wb")
        assert info.value.errno == errno.EINVAL
    assert keys(s3, bucket) == {}
    delete_bucket(s3, bucket)


def test_a_key_longer_than_a_bucket_takes_is_refused_before_anything_is_written(s3: S3Server,
                                                                                mountpoint: Path) -> None:
    """A checkpoint under a deep run directory whose key passes 1024 bytes: SeaweedFS (as S3) refused it only at the
    upload (EIO at a write or the close, which `save_file` drops: it returned and nothing was stored), and moto stored
    a key S3 would refuse. The create, mkdir or rename is ENAMETOOLONG; a key of exactly 1024 bytes is stored."""
    bucket = new_bucket(s3)
    deep = "a" * 250 + "/" + "b" * 250 + "/" + "c" * 250 + "/" + "d" * 250  # its marker key: 1004 bytes
    with mounted(s3, bucket, mountpoint, *WRITABLE):
        os.makedirs(mountpoint / deep)
        (mountpoint / deep / ("f" * 20)).write_bytes(b"1024")  # a key of 1024 bytes
        os.mkdir(mountpoint / deep / ("g" * 19))  # a marker key of 1024 bytes
        for attempt in (lambda: open(mountpoint / deep / ("h" * 21), "wb"),
                        lambda: os.mkdir(mountpoint / deep / ("i" * 20)),
                        lambda: os.rename(mountpoint / deep / ("f" * 20), mountpoint / deep / ("j" * 21))):
            with pytest.raises(OSError) as info:
                attempt()
            assert info.value.errno == errno.ENAMETOOLONG
        assert sorted(os.listdir(mountpoint / deep)) == ["f" * 20, "g" * 19]
    assert keys(s3, bucket) == {"a" * 250 + "/": 0, deep[:501] + "/": 0, deep[:752] + "/": 0, deep + "/": 0,
                                deep + "/" + "f" * 20: 4, deep + "/" + "g" * 19 + "/": 0}
    delete_bucket(s3, bucket)


def test_a_file_being_written_shows_its_last_writes_time(s3: S3Server, mountpoint: Path) -> None:
    """`ls -l`/`stat` of a checkpoint being written: its size so far and, as on a local disk, the time it last grew.
    Its mtime stayed at its create, so a watcher saw a file that grew and never changed."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M"):
        with open(mountpoint / "ckpt.pt", "wb", buffering=0) as f:
            f.write(b"a" * MiB)
            first = os.stat(mountpoint / "ckpt.pt")
            f.write(b"b" * (5 * MiB))  # a part begins its upload
            second = os.stat(mountpoint / "ckpt.pt")
            assert (first.st_size, second.st_size) == (MiB, 6 * MiB)
            assert second.st_mtime_ns > first.st_mtime_ns
        assert os.stat(mountpoint / "ckpt.pt").st_mtime_ns >= second.st_mtime_ns
    delete_bucket(s3, bucket)


def test_a_file_being_written_is_busy_for_other_handles(s3: S3Server, mountpoint: Path) -> None:
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite"):
        with open(mountpoint / "w.bin", "wb") as f:
            f.write(b"abc")
            f.flush()
            for mode in ("rb", "wb"):
                with pytest.raises(OSError) as info:
                    open(mountpoint / "w.bin", mode)
                assert info.value.errno == errno.EBUSY
            assert os.stat(mountpoint / "w.bin").st_size == 3
            assert os.listdir(mountpoint) == ["w.bin"]
        assert (mountpoint / "w.bin").read_bytes() == b"abc"
    delete_bucket(s3, bucket)


def test_an_open_of_a_shard_still_being_written_says_why_it_is_busy_in_the_log(s3: S3Server, mountpoint: Path) -> None:
    """A resume that opens a rank's shard before that rank's last close gets EBUSY (README): the log said nothing of
    it, even at debug level, so "Device or resource busy" on a checkpoint had no explanation (B880). Each refusal of
    the file (to read it, to write it, a rename onto it) is said at info level, once per file, the rest at debug."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite") as m:
        (mountpoint / "step-100").mkdir()
        shard = mountpoint / "step-100" / "shard-1.bin"
        (mountpoint / "other").write_bytes(b"other")
        with open(shard, "wb") as f:
            f.write(b"rank 1")
            f.flush()
            for attempt in (lambda: open(shard, "rb"), lambda: open(shard, "wb"),  # noqa: SIM115
                            lambda: os.rename(mountpoint / "other", shard)):
                with pytest.raises(OSError) as info:
                    attempt()
                assert info.value.errno == errno.EBUSY
        assert shard.read_bytes() == b"rank 1"
        said = [line for line in m.log().splitlines() if "step-100/shard-1.bin: " in line and "EBUSY" in line]
        assert len(said) == 3, said
        assert " INFO fsmount.writes: step-100/shard-1.bin: an open to read it fails with EBUSY: this mount is " \
               "writing it, and it is stored (and can be opened) at its last close" in said[0]
        assert [" DEBUG " in line for line in said] == [False, True, True]
        assert "a rename of other onto it" in said[2]
    delete_bucket(s3, bucket)


def test_links_and_fifos_are_refused_with_a_line_that_says_why(s3: S3Server, mountpoint: Path) -> None:
    """`ln -s step-100 latest` (a trainer's pointer to its last checkpoint), a hard link, a FIFO: EPERM (README),
    and the log said nothing of it, even at debug level (B883). The first refusal of each kind says so at info level,
    naming the path and saying S3 has none; the others go at debug level. No warning: healthy tools probe for links
    and carry on without them (B980: git's link-then-rename of each object file, below)."""
    bucket = bucket_with(s3, {"ckpt/step-100/model.pt": b"weights"})
    with mounted(s3, bucket, mountpoint, *WRITABLE) as m:
        ckpt = mountpoint / "ckpt"
        for attempt in (lambda: os.symlink("step-100", ckpt / "latest"),
                        lambda: os.symlink("step-100", ckpt / "last"),
                        lambda: os.link(ckpt / "step-100" / "model.pt", ckpt / "last.pt"),
                        lambda: os.mkfifo(ckpt / "fifo")):
            with pytest.raises(OSError) as info:
                attempt()
            assert info.value.errno == errno.EPERM
        said = [line.split(" fsmount.writes: ", 1)[-1] for line in m.log().splitlines()
                if " INFO fsmount.writes: " in line and "(S3 has none)" in line]
        assert said == ["ckpt/latest: symlinks are not supported (S3 has none): EPERM (further ones are logged at "
                        "debug level)",
                        "ckpt/last.pt: hard links are not supported (S3 has none): EPERM (further ones are logged at "
                        "debug level)",
                        "ckpt/fifo: FIFOs, sockets and device files are not supported (S3 has none): EPERM (further "
                        "ones are logged at debug level)"], said
        assert "ckpt/last: symlinks are not supported" in m.log()  # at debug level
        assert warning_lines(m.log()) == []
        assert sorted(os.listdir(ckpt)) == ["step-100"]
    assert keys(s3, bucket) == {"ckpt/step-100/model.pt": 7}
    delete_bucket(s3, bucket)


def test_a_link_then_rename_as_git_stores_objects_leaves_the_log_without_warnings(s3: S3Server,
                                                                                 mountpoint: Path) -> None:
    """git stores each object file by link(tmp, name), and on failure rename(tmp, name); huggingface_hub and conda
    probe for links the same way. Each file is stored under its name, and the refusals are no warning: a healthy
    job's log got one for what the tool handles (B980)."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE) as m:
        objects = mountpoint / "objects"
        objects.mkdir()
        for i in range(3):
            tmp = objects / f"tmp_obj_{i}"
            tmp.write_bytes(b"object %d" % i)
            try:
                os.link(tmp, objects / f"obj{i}")
            except PermissionError:
                os.rename(tmp, objects / f"obj{i}")
        assert sorted(os.listdir(objects)) == ["obj0", "obj1", "obj2"]
        assert [(objects / f"obj{i}").read_bytes() for i in range(3)] == [b"object 0", b"object 1", b"object 2"]
        assert warning_lines(m.log()) == []
    assert keys(s3, bucket) == {"objects/": 0, "objects/obj0": 8, "objects/obj1": 8, "objects/obj2": 8}
    delete_bucket(s3, bucket)


def test_a_truncate_of_a_stored_file_says_why_it_is_refused(s3: S3Server, mountpoint: Path) -> None:
    """`truncate -s 0 latest` (or `os.truncate`) of a stored file is EOPNOTSUPP, and the log said nothing of it,
    even at debug level (B881): the warning names the file and says what works instead; the file stays as stored."""
    bucket = bucket_with(s3, {"ckpt/latest": b"300"})
    for extra, flag_said in (((), True), (("--allow-overwrite",), False)):
        with mounted(s3, bucket, mountpoint, *WRITABLE, *extra, allowed=(r"a truncate of a stored file",)) as m:
            for size in (0, 10):
                with pytest.raises(OSError) as info:
                    os.truncate(mountpoint / "ckpt" / "latest", size)
                assert info.value.errno == errno.EOPNOTSUPP
            os.truncate(mountpoint / "ckpt" / "latest", 3)  # its own size: nothing to change
            said = warning_lines(m.log())
            assert len(said) == 2, said
            assert "ckpt/latest: a truncate of a stored file (to 0 bytes from 3) is not supported: S3 objects cannot " \
                   "be changed in place; rewrite it whole (an open with O_TRUNC" in said[0]
            assert ("which needs --allow-overwrite" in said[0]) == flag_said
            assert (mountpoint / "ckpt" / "latest").read_bytes() == b"300"
    assert s3.client().get_object(Bucket=bucket, Key="ckpt/latest")["Body"].read() == b"300"
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("how", ["rewrite", "renamed-onto"])
def test_a_listing_while_a_stored_file_is_replaced_shows_the_file_being_written(s3: S3Server, mountpoint: Path,
                                                                                how: str) -> None:
    """`ls` of a directory while a stored file in it is replaced by one being written (an O_TRUNC rewrite, or
    save_file's temporary file renamed onto it before its close): readdirplus handed the kernel the cached listing's
    entry, the old version, as an inode of its own. `stat` then showed the old size, an open for reading read the
    old bytes (EBUSY, as for any file being written), and an open for writing began a second writer of the key,
    which stored an empty object at its close while the first was still written; after the first close the mount
    showed 0 bytes for the 12 in the bucket. The name is the file being written, whatever the listing says."""
    bucket = bucket_with(s3, {"ckpt": random_bytes(1500, 52)})
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite"):
        assert os.listdir(mountpoint) == ["ckpt"]  # the listing, with the stored version, is cached
        if how == "rewrite":
            fd = os.open(mountpoint / "ckpt", os.O_WRONLY | os.O_TRUNC)
        else:
            fd = os.open(mountpoint / ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, b"new")
            if how == "renamed-onto":
                os.rename(mountpoint / ".tmp", mountpoint / "ckpt")
            assert os.listdir(mountpoint) == ["ckpt"]
            assert os.stat(mountpoint / "ckpt").st_size == 3
            for flags in (os.O_RDONLY, os.O_WRONLY | os.O_TRUNC):
                with pytest.raises(OSError) as info:
                    os.close(os.open(mountpoint / "ckpt", flags))
                assert info.value.errno == errno.EBUSY
            os.write(fd, b" and more")
        finally:
            os.close(fd)
        assert os.stat(mountpoint / "ckpt").st_size == 12
        assert (mountpoint / "ckpt").read_bytes() == b"new and more"
    assert s3.client().get_object(Bucket=bucket, Key="ckpt")["Body"].read() == b"new and more"
    assert keys(s3, bucket) == {"ckpt": 12}
    delete_bucket(s3, bucket)


def test_an_overwrite_beside_a_reader_of_the_old_version_is_stored_at_its_close(s3: S3Server, mountpoint: Path) -> None:
    """`with open(p, "wb")` while the same process still reads the file it replaces: the reader's descriptor
    counted as another holder, so close(2) returned 0 at once, the file was stored only at RELEASE (a reopen got
    EBUSY meanwhile), and a failed upload could reach nobody but the log. The close stores it now."""
    bucket = new_bucket(s3)
    old, new = random_bytes(3 * MiB, 21), random_bytes(3 * MiB, 22)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite"):
        (mountpoint / "ckpt.bin").write_bytes(old)
        with open(mountpoint / "ckpt.bin", "rb") as reader:
            assert reader.read(MiB) == old[:MiB]
            with open(mountpoint / "ckpt.bin", "wb") as writer:
                writer.write(new)
            assert s3.client().get_object(Bucket=bucket, Key="ckpt.bin")["Body"].read() == new
            assert (mountpoint / "ckpt.bin").read_bytes() == new
            # As on a local disk: the same file (an O_TRUNC rewrite through the mount keeps the inode), rewritten.
            assert reader.read() == new[MiB:]
    delete_bucket(s3, bucket)


def test_a_rewrite_beside_a_reader_of_the_old_version_shows_no_old_bytes_once_stored(s3: S3Server,
                                                                                      mountpoint: Path) -> None:
    """A rewrite through the mount keeps the inode (O_TRUNC). A descriptor of the old version read on from the
    daemon's memory after the store, and its replies went into the inode's pages: a new open then read old bytes
    in the middle of the new file (a new user's checkpoint rewritten beside an evaluator, silently). Now that
    descriptor reads the new file once it is stored, and the first open after the rewrite drops what it read of
    the old one while the new was written."""
    bucket = new_bucket(s3)
    old, new = random_bytes(32 * MiB, 23), random_bytes(32 * MiB, 24)
    s3.client().put_object(Bucket=bucket, Key="ckpt.bin", Body=old)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", "--chunk-size", "1M"):
        path = mountpoint / "ckpt.bin"
        reader = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(reader, len(old), 0) == old  # every chunk in the daemon's memory
            with open(path, "wb") as writer:
                writer.write(new[:16 * MiB])
                writer.flush()
                # While the new file is written, the old descriptor may still read old bytes (README), which go
                # into the inode's pages (up to the size written so far, the kernel's size of the file now).
                assert os.pread(reader, MiB, 8 * MiB) in (old[8 * MiB:9 * MiB], new[8 * MiB:9 * MiB])
                writer.write(new[16 * MiB:])
            assert s3.client().get_object(Bucket=bucket, Key="ckpt.bin")["Body"].read() == new
            # What it read of the old version while the new was written is gone from the inode's pages too.
            assert os.pread(reader, MiB, 8 * MiB) == new[8 * MiB:9 * MiB]
            assert os.pread(reader, 4 * MiB, 4 * MiB) == new[4 * MiB:8 * MiB]
            assert sha(path.read_bytes()) == sha(new)
            assert sha(os.pread(reader, len(new), 0)) == sha(new)
        finally:
            os.close(reader)
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("cache_dir", [False, True], ids=["streamed", "cache-dir"])
def test_a_writing_descriptor_bypasses_the_page_cache_and_one_large_write_is_stored_in_order(
        s3: S3Server, mountpoint: Path, tmp_path: Path, cache_dir: bool) -> None:
    """Writing descriptors are direct I/O (operations._writer_handle): the writer's own descriptor reads nothing
    back from the page cache before the file is stored (EBUSY, as any other handle), and one write() far above
    the kernel's 1 MiB requests (sent from the writer's buffer, not from page-cache pages) is stored in order."""
    bucket = new_bucket(s3)
    data = random_bytes(40 * MiB + 4101, 17)
    extra = ["--cache-dir", str(tmp_path / "cache")] if cache_dir else []
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M", *extra):
        fd = os.open(mountpoint / "big.bin", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            assert os.write(fd, data[:4101]) == 4101
            with pytest.raises(OSError) as info:
                os.pread(fd, 4096, 0)  # through the page cache this would have read the bytes just written
            assert info.value.errno == errno.EBUSY
            assert os.write(fd, data[4101:]) == len(data) - 4101
        finally:
            os.close(fd)
        assert sha((mountpoint / "big.bin").read_bytes()) == sha(data)
    with mounted(s3, bucket, mountpoint):
        assert sha((mountpoint / "big.bin").read_bytes()) == sha(data)
    delete_bucket(s3, bucket)


def test_shell_tools(s3: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    """What a user types: `>` (the shell dup2()s the file onto stdout and closes it before writing: a flush
    with nothing written must not store the file), dd, cp, touch, mv, rm -r."""
    bucket = new_bucket(s3)
    src = tmp_path / "src.bin"
    src.write_bytes(random_bytes(9 * MiB + 1, 8))
    script = f"""
        set -e
        echo hello > greeting.txt
        dd if={src} of=dd.bin bs=1M status=none
        cp {src} cp.bin
        touch empty
        mkdir -p a/b
        mv cp.bin a/b/
        echo again > greeting.txt
        rm -r a/b
    """
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", "--allow-delete",
                 allowed=("only whole rewrites",)):
        subprocess.run(["bash", "-c", textwrap.dedent(script)], cwd=mountpoint, check=True, timeout=120)
        assert sorted(os.listdir(mountpoint)) == ["a", "dd.bin", "empty", "greeting.txt"]
        assert (mountpoint / "greeting.txt").read_text() == "again\n"
        assert (mountpoint / "dd.bin").read_bytes() == src.read_bytes()
        appended = subprocess.run(["bash", "-c", "echo more >> greeting.txt"], cwd=mountpoint, capture_output=True,
                                  text=True)
        assert appended.returncode != 0 and "Operation not supported" in appended.stderr  # S3 cannot append
    for flags in ((), ("--allow-overwrite",)):
        with mounted(s3, bucket, mountpoint, *WRITABLE, *flags):  # the log check fails the test on a warning
            # `touch` of a stored file replaces nothing: it works, with no warning (with --allow-overwrite it
            # logged "only whole rewrites" at each one).
            subprocess.run(["touch", "dd.bin"], cwd=mountpoint, check=True, timeout=60)
    assert keys(s3, bucket) == {"greeting.txt": 6, "dd.bin": src.stat().st_size, "empty": 0, "a/": 0}
    delete_bucket(s3, bucket)


def test_an_empty_file_just_closed_opens_at_once(s3: S3Server, mountpoint: Path) -> None:
    """Markers (`DONE`, `_SUCCESS`): an empty file is stored at RELEASE, which the kernel sends only after
    close(2) returned, so an open right after the close must wait for it, not get EBUSY. A file another
    descriptor still writes stays EBUSY."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite"):
        for i in range(20):
            marker = mountpoint / f"DONE-{i}"
            open(marker, "w").close()  # noqa: SIM115 - the close, then at once the open, is the point
            assert marker.read_bytes() == b""
        script = "for i in $(seq 20); do : > t$i; : > t$i; cat t$i; done"
        subprocess.run(["bash", "-c", script], cwd=mountpoint, check=True, timeout=60)
        with open(mountpoint / "busy", "wb") as f:
            f.write(b"x")
            with pytest.raises(OSError) as info:
                open(mountpoint / "busy").close()  # noqa: SIM115
            assert info.value.errno == errno.EBUSY
    assert len(keys(s3, bucket)) == 41
    delete_bucket(s3, bucket)


def test_a_writable_mount_has_room_to_spare(s3: S3Server, mountpoint: Path) -> None:
    """df and shutil.disk_usage: a bucket has no size, so a writable mount reports 1 EiB free (it reported
    0, and a writer that checks free space first would refuse to save); a read-only one reports none."""
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE):
        usage = shutil.disk_usage(mountpoint)
        assert usage.free == usage.total >= 1 << 60 and usage.used == 0
        assert os.statvfs(mountpoint).f_favail >= 1 << 32
    with mounted(s3, bucket, mountpoint):
        assert shutil.disk_usage(mountpoint).free == 0
    delete_bucket(s3, bucket)


def test_cp_a_into_the_mount_goes_on_without_xattrs(s3: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    """xattrs and ACLs are not stored: ENOTSUP, after which `cp -a` and `mv` carry on (after EPERM they exit 1)."""
    bucket = new_bucket(s3)
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "w.bin").write_bytes(random_bytes(3 * MiB, 9))
    (src / "config.json").write_text("{}")
    os.setxattr(src / "config.json", "user.origin", b"trainer")
    with mounted(s3, bucket, mountpoint, *WRITABLE):
        subprocess.run(["cp", "-a", str(src), str(mountpoint / "ckpt")], check=True, capture_output=True, timeout=60)
        with pytest.raises(OSError) as info:
            os.setxattr(mountpoint / "ckpt" / "config.json", "user.origin", b"x")
        assert info.value.errno == errno.ENOTSUP
    assert keys(s3, bucket) == {"ckpt/": 0, "ckpt/sub/": 0, "ckpt/sub/w.bin": 3 * MiB, "ckpt/config.json": 2}
    delete_bucket(s3, bucket)


def rsync(src: Path, dst: Path, *flags: str) -> tuple[int, list[str], str]:
    """`rsync -a -i FLAGS src/ dst/`: its exit status, the files it sent (its `>f` lines) and its stderr."""
    res = subprocess.run(["rsync", "-a", "-i", *flags, f"{src}/", f"{dst}/"], capture_output=True, text=True,
                         timeout=120)
    return res.returncode, sorted(line.split(" ", 1)[1] for line in res.stdout.splitlines() if line.startswith(">f")), \
        res.stderr


@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed")
@pytest.mark.parametrize("overwrite", [False, True], ids=["create-only", "allow-overwrite"])
def test_rsync_as_the_readme_says_skips_what_is_stored_and_sends_what_changed(s3: S3Server, mountpoint: Path,
                                                                            tmp_path: Path, overwrite: bool) -> None:
    """Times set by utime are not kept (a bucket keeps none): a stored file shows its store time, later than its
    source's, so `rsync -a` sends every file again at each run, and `-u` skips them, on a fresh mount too. The
    README said `rsync` needs `--inplace`: with --allow-overwrite its second run then failed (exit 23, EOPNOTSUPP:
    an in-place update opens the stored file without O_TRUNC), where without `--inplace` a changed file is written
    to a temporary name and renamed over the stored one. Without --allow-overwrite `--inplace` keeps a changed
    file's refusal (EPERM) from leaving rsync's temporary object behind (B134)."""
    bucket = new_bucket(s3)
    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    big = random_bytes(6 * MiB + 3, 60)
    (src / "w.bin").write_bytes(big)
    (src / "sub" / "cfg.json").write_text("{}")
    an_hour_ago = time.time() - 3600
    for path in (src / "w.bin", src / "sub" / "cfg.json"):
        os.utime(path, (an_hour_ago, an_hour_ago))  # checkpoints written before the sync
    advice = ("-u",) if overwrite else ("-u", "--inplace")
    flags = ("--allow-overwrite",) if overwrite else ()
    dst = mountpoint / "ckpt"
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M", *flags,
                 allowed=(NEEDS_OVERWRITE, "only whole rewrites", "needs --allow-delete")):
        assert rsync(src, dst, *advice) == (0, ["sub/cfg.json", "w.bin"], "")
        assert rsync(src, dst, *advice) == (0, [], "")  # nothing changed: nothing sent
        code, sent, _ = rsync(src, dst)
        assert sent == ["sub/cfg.json", "w.bin"]  # without -u: sent again, each time (times are not kept)
        assert code == (0 if overwrite else 23)  # create-only: the renames onto them were refused
        if overwrite:
            # The old advice: an in-place update of a stored file is refused (only whole rewrites).
            code, sent, err = rsync(src, dst, "--inplace")
            assert (code, sent) == (23, ["sub/cfg.json", "w.bin"]) and "Operation not supported" in err
        # Create-only without --inplace, rsync's temporary objects stay (its unlink of them needs --allow-delete).
        assert len(list(dst.rglob(".*"))) == (0 if overwrite else 2)
    client = s3.client()
    for key in keys(s3, bucket):
        if "/." in key:
            client.delete_object(Bucket=bucket, Key=key)
    (src / "sub" / "cfg.json").write_text('{"step": 2}')  # changed after the sync
    with mounted(s3, bucket, mountpoint, *WRITABLE, *flags, allowed=(NEEDS_OVERWRITE,)):  # a fresh mount
        code, sent, err = rsync(src, dst, *advice)
        assert sent == ["sub/cfg.json"]  # w.bin's store time is still later than its source's
        if overwrite:
            assert (code, err) == (0, "")
            assert (dst / "sub" / "cfg.json").read_text() == '{"step": 2}'
        else:
            assert code == 23 and "Operation not permitted" in err  # replacing it needs --allow-overwrite
            assert (dst / "sub" / "cfg.json").read_text() == "{}"
        assert (dst / "w.bin").read_bytes() == big
    assert keys(s3, bucket) == {"ckpt/": 0, "ckpt/sub/": 0, "ckpt/w.bin": len(big),
                                "ckpt/sub/cfg.json": len('{"step": 2}') if overwrite else 2}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_tar_x_over_stored_files_needs_allow_delete_or_overwrite(s3: S3Server, mountpoint: Path,
                                                                  tmp_path: Path) -> None:
    """`tar x` sets each file's mode and times after writing it (accepted, not stored): exit 0. Over files already
    stored it unlinks each first, which needs --allow-delete (with --allow-overwrite alone: "File exists", exit 2,
    the stored file untouched); `tar x --overwrite` rewrites them with O_TRUNC, which --allow-overwrite allows."""
    bucket = new_bucket(s3)
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "w.bin").write_bytes(random_bytes(6 * MiB, 61))
    archive = tmp_path / "a.tar"
    subprocess.run(["tar", "cf", str(archive), "-C", str(src), "d"], check=True)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M", "--allow-overwrite",
                 allowed=(r"needs --allow-delete",)):
        untar = ["tar", "xf", str(archive), "-C", str(mountpoint)]
        assert subprocess.run(untar, capture_output=True, timeout=120).returncode == 0
        again = subprocess.run(untar, capture_output=True, text=True, timeout=120)
        assert again.returncode == 2 and "File exists" in again.stderr
        assert subprocess.run([*untar, "--overwrite"], capture_output=True, timeout=120).returncode == 0
        assert (mountpoint / "d" / "w.bin").read_bytes() == (src / "d" / "w.bin").read_bytes()
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", "--allow-delete"):
        assert subprocess.run(untar, capture_output=True, timeout=120).returncode == 0
    assert keys(s3, bucket) == {"d/": 0, "d/w.bin": 6 * MiB}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("name", ["with space.bin", "plus+sign.bin", "ünïcödé-ß.bin", "percent%20.bin"])
def test_names_written_are_the_keys_and_list_back(s3: S3Server, mountpoint: Path, name: str) -> None:
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE):
        (mountpoint / "d").mkdir()
        (mountpoint / "d" / name).write_bytes(name.encode())
        assert os.listdir(mountpoint / "d") == [name]
    assert keys(s3, bucket) == {"d/": 0, f"d/{name}": len(name.encode())}
    other = mountpoint.parent / "fresh"
    with mounted(s3, bucket, other):
        assert os.listdir(other / "d") == [name]
        assert (other / "d" / name).read_bytes() == name.encode()
    delete_bucket(s3, bucket)


@pytest.mark.parametrize("cache_dir", [False, True], ids=["streamed", "cache-dir"])
def test_safetensors_save_file_temp_ftruncate_rename(s3: S3Server, mountpoint: Path, tmp_path: Path,
                                                     cache_dir: bool) -> None:
    """safetensors 0.8: a temp file beside the target, ftruncate to the full size, sequential writes, and
    the rename over the target before the file is closed. Streamed, the upload began under the temp name
    and the object is moved by a server-side copy at close; with --cache-dir the file is uploaded once,
    from the local copy, under its final name."""
    import numpy as np
    from safetensors.numpy import load_file

    bucket = new_bucket(s3)
    rng = np.random.default_rng(7)
    tensors = {"big": rng.standard_normal((3 * 1024, 1024), dtype=np.float32),  # 12 MiB: a multipart upload
               "small": np.arange(10, dtype=np.int64)}
    ref = tmp_path / "ref.safetensors"
    code = """
        import sys, numpy as np
        from safetensors.numpy import save_file
        rng = np.random.default_rng(7)
        t = {"big": rng.standard_normal((3 * 1024, 1024), dtype=np.float32), "small": np.arange(10, dtype=np.int64)}
        for path in sys.argv[1:]:
            save_file(t, path, metadata={"format": "np"})
    """
    cache = ("--cache-dir", str(tmp_path / "cache")) if cache_dir else ()
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M", *cache) as m:
        (mountpoint / "model").mkdir()
        run_python(code, str(ref), str(mountpoint / "model" / "model.safetensors"))
        assert os.listdir(mountpoint / "model") == ["model.safetensors"]
        assert sha((mountpoint / "model" / "model.safetensors").read_bytes()) == sha(ref.read_bytes())
        assert ("server-side copy" in m.log()) is not cache_dir
    assert set(keys(s3, bucket)) == {"model/", "model/model.safetensors"}
    assert uploads_in(s3, bucket) == []
    other = tmp_path / "fresh"
    with mounted(s3, bucket, other):
        assert sha((other / "model" / "model.safetensors").read_bytes()) == sha(ref.read_bytes())
        loaded = load_file(other / "model" / "model.safetensors")
        assert all(np.array_equal(loaded[k], v) for k, v in tensors.items())
    delete_bucket(s3, bucket)


def test_a_refused_save_file_leaves_nothing_behind(s3: S3Server, mountpoint: Path) -> None:
    """save_file over an existing model without --allow-overwrite: its rename is refused (EPERM), safetensors
    deletes its temporary file before closing it, and the upload of that file is dropped: no stray object."""
    bucket = bucket_with(s3, {"model.safetensors": b"old"})
    code = """
        import sys, numpy as np
        from safetensors.numpy import save_file
        save_file({"w": np.ones((1024, 2048), dtype=np.float32)}, sys.argv[1])
    """
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M", allowed=(NEEDS_OVERWRITE,)):
        res = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(mountpoint / "model.safetensors")],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode != 0 and "Operation not permitted" in res.stderr, res.stderr[-2000:]
        assert os.listdir(mountpoint) == ["model.safetensors"]
    assert keys(s3, bucket) == {"model.safetensors": 3}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_a_writer_killed_mid_file_leaves_what_it_wrote_under_the_name_it_wrote_to(s3: S3Server,
                                                                                  mountpoint: Path) -> None:
    """`kill -9` of a checkpoint writer (README "A writer killed mid-file"): the kernel's close of its descriptors is
    a close like any other, so what it wrote is stored under its temporary name, a multipart upload completed and
    none left for `modelfs cleanup`; a file `ftruncate` extended first (save_file's order) keeps that size, zeros
    where nothing was written; the final name a rename would have replaced is untouched."""
    bucket = bucket_with(s3, {"ckpt.pt": b"the previous checkpoint"})
    writer = """
        import os, sys, time
        path, extend, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        if extend:
            os.ftruncate(fd, extend)
        os.write(fd, os.urandom(size)[:size // 2] + b"w" * (size - size // 2))
        os.fsync(fd)
        print("written", flush=True)
        time.sleep(60)
        os.replace(path, os.path.join(os.path.dirname(path), "ckpt.pt"))  # never reached
    """
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-overwrite", "--write-part-size", "5M"):
        for name, extend, size in (("ckpt.pt.tmp", 0, 7 * MiB), ("model.safetensors.tmp", 3 * MiB, MiB)):
            proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(writer), str(mountpoint / name),
                                     str(extend), str(size)], stdout=subprocess.PIPE, text=True)
            try:
                assert proc.stdout is not None and proc.stdout.readline() == "written\n"
            finally:
                proc.kill()
                proc.wait()
            stored = wait_for(f"{name} stored", lambda name=name: keys(s3, bucket).get(name))
            assert stored == max(extend, size)
            data = (mountpoint / name).read_bytes()
            assert len(data) == stored and data[size - 1:size] == b"w" and data[size:] == bytes(stored - size)
        assert (mountpoint / "ckpt.pt").read_bytes() == b"the previous checkpoint"
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


@pytest.mark.seaweedfs
def test_a_file_whose_upload_cleanup_aborted_says_the_upload_is_gone(seaweed_server: S3Server,
                                                                     mountpoint: Path) -> None:
    """`modelfs cleanup --older-than 0` run while a checkpoint is written (or a lifecycle rule that aborts incomplete
    uploads) aborts its multipart upload: the file fails (EIO) and nothing is stored, as it should, but the warning
    said "uploading part 2 of 'ckpt/live.bin': not found", as if the key were missing (B882). It names the upload's
    abort (NoSuchUpload) and what does it. SeaweedFS only: moto 5 answers a part of an aborted upload with a 500,
    where S3 and SeaweedFS say NoSuchUpload."""
    s3 = seaweed_server
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M", allowed=(r"NoSuchUpload",)) as m:
        (mountpoint / "ckpt").mkdir()
        fd = os.open(mountpoint / "ckpt" / "live.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, random_bytes(6 * MiB, 61))  # part 1 goes: the upload is begun
            wait_for("the upload", lambda: uploads_in(s3, bucket), lambda u: u == ["ckpt/live.bin"])
            res = run_modelfs("cleanup", bucket, "--endpoint-url", s3.endpoint_url, "--older-than", "0",
                              env=daemon_env(s3))
            assert res.returncode == 0 and "aborted 1" in res.stdout, res.stdout + res.stderr
            with pytest.raises(OSError) as info:
                for i in range(8):  # a later part finds the upload gone
                    os.write(fd, random_bytes(5 * MiB, 62 + i))
                os.fsync(fd)
            assert info.value.errno == errno.EIO
        finally:
            with pytest.raises(OSError) as closed:
                os.close(fd)
        assert closed.value.errno == errno.EIO
        said = [line for line in warning_lines(m.log()) if "ckpt/live.bin" in line]
        assert said and "the bucket no longer has this file's multipart upload (NoSuchUpload): it was aborted from " \
                         "outside this mount" in said[0], said
        assert "not found" not in said[0]
        assert not (mountpoint / "ckpt" / "live.bin").exists()
    assert keys(s3, bucket) == {"ckpt/": 0}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_np_savez_fails_with_nothing_stored_and_through_a_bytesio_is_stored(s3: S3Server, mountpoint: Path) -> None:
    """np.savez (zipfile) seeks back to patch each member's header: the README's `EINVAL`, then `EIO` at the close,
    and no name left; the workaround it gives, savez into memory and one sequential write, is read back whole."""
    import io

    import numpy as np

    bucket = new_bucket(s3)
    arrays = {"weights": np.arange(300_000, dtype=np.float32), "step": np.array(7)}
    with mounted(s3, bucket, mountpoint, *WRITABLE, allowed=(SEQUENTIAL_ONLY, "will not be stored")):
        with pytest.raises(OSError) as info:
            np.savez(mountpoint / "state.npz", **arrays)
        assert info.value.errno in (errno.EINVAL, errno.EIO)
        assert os.listdir(mountpoint) == []
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        (mountpoint / "state.npz").write_bytes(buffer.getvalue())
        with np.load(mountpoint / "state.npz") as loaded:
            assert (loaded["weights"] == arrays["weights"]).all() and int(loaded["step"]) == 7
    assert keys(s3, bucket) == {"state.npz": len(buffer.getvalue())}
    assert uploads_in(s3, bucket) == []
    delete_bucket(s3, bucket)


def test_torch_save_and_load(s3: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    bucket = new_bucket(s3)
    code = """
        import sys, torch
        torch.manual_seed(3)
        state = {"w": torch.randn(1024, 2048), "b": torch.arange(7), "step": 12}
        torch.save(state, sys.argv[1])
    """
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--write-part-size", "5M"):
        run_python(code, str(mountpoint / "state.pt"))
        (tmp_path / "ref").mkdir()
        run_python(code, str(tmp_path / "ref" / "state.pt"))  # the same name: torch.save records it
        assert sha((mountpoint / "state.pt").read_bytes()) == sha((tmp_path / "ref" / "state.pt").read_bytes())
    other = tmp_path / "fresh"
    with mounted(s3, bucket, other):
        got = torch.load(other / "state.pt")
        want = torch.load(tmp_path / "ref" / "state.pt")
        assert got.keys() == want.keys() and got["step"] == 12
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    delete_bucket(s3, bucket)


TRANSFORMERS_ROUND_TRIP = """
    import json, sys, torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast
    where, action = sys.argv[1], sys.argv[2]
    if action == "save":
        torch.manual_seed(0)
        model = BertModel(BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128))
        vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "hello", "world"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(where)
        model.save_pretrained(where)
        torch.save(model.state_dict(), sys.argv[3])
    else:
        model = BertModel.from_pretrained(where)
        tok = PreTrainedTokenizerFast.from_pretrained(where)
        want = torch.load(sys.argv[3])
        got = model.state_dict()
        assert set(got) == set(want), set(got) ^ set(want)
        assert all(torch.equal(got[k], want[k]) for k in want)
        print(json.dumps(tok("hello world")["input_ids"]))
"""


def test_transformers_save_pretrained_from_pretrained(s3: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE):
        run_python(TRANSFORMERS_ROUND_TRIP, str(mountpoint / "bert"), "save", str(tmp_path / "ref.pt"))
        names = set(os.listdir(mountpoint / "bert"))
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    other = tmp_path / "fresh"
    with mounted(s3, bucket, other):
        out = run_python(TRANSFORMERS_ROUND_TRIP, str(other / "bert"), "load", str(tmp_path / "ref.pt"))
        assert json.loads(out) == [2, 3]
    delete_bucket(s3, bucket)


ROTATION = """
    import json, os, shutil, sys, torch
    from safetensors.torch import save_file
    root, keep = sys.argv[1], 3
    torch.manual_seed(1)
    for step in range(1, 6):
        d = os.path.join(root, f"checkpoint-{step}")
        os.makedirs(d)
        save_file({"w": torch.full((256, 1024), float(step))}, os.path.join(d, "model.safetensors"))
        torch.save({"exp_avg": torch.full((256, 1024), step * 0.5)}, os.path.join(d, "optimizer.pt"))
        with open(os.path.join(d, "trainer_state.json"), "w") as f:
            json.dump({"global_step": step}, f)
        torch.save({"cpu": torch.get_rng_state()}, os.path.join(d, "rng_state.pth"))
        kept = sorted((n for n in os.listdir(root) if n.startswith("checkpoint-")), key=lambda n: int(n[11:]))
        for old in kept[:-keep]:
            shutil.rmtree(os.path.join(root, old))
    print(json.dumps(sorted(os.listdir(root))))
"""


def test_checkpoint_rotation_with_rmtree(s3: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    bucket = new_bucket(s3)
    with mounted(s3, bucket, mountpoint, *WRITABLE, "--allow-delete"):
        out = run_python(ROTATION, str(mountpoint / "run"))
        assert json.loads(out) == ["checkpoint-3", "checkpoint-4", "checkpoint-5"]
    assert {k.split("/")[1] for k in keys(s3, bucket)} - {""} == {"checkpoint-3", "checkpoint-4", "checkpoint-5"}
    other = tmp_path / "fresh"
    with mounted(s3, bucket, other):
        assert sorted(os.listdir(other / "run")) == ["checkpoint-3", "checkpoint-4", "checkpoint-5"]
        for step in (3, 4, 5):
            d = other / "run" / f"checkpoint-{step}"
            assert sorted(os.listdir(d)) == ["model.safetensors", "optimizer.pt", "rng_state.pth",
                                             "trainer_state.json"]
            assert torch.equal(load_file(d / "model.safetensors")["w"], torch.full((256, 1024), float(step)))
            assert torch.equal(torch.load(d / "optimizer.pt")["exp_avg"], torch.full((256, 1024), step * 0.5))
            assert json.loads((d / "trainer_state.json").read_text()) == {"global_step": step}
    delete_bucket(s3, bucket)


def test_rename_of_a_large_file_being_written_copies_in_parts(seaweed_server: S3Server, mountpoint: Path,
                                                             tmp_path: Path) -> None:
    """A file renamed while open whose upload had begun under the old name is moved at close by a server-side
    copy, in parallel UploadPartCopy parts above 64 MiB."""
    s3 = seaweed_server
    bucket = new_bucket(s3)
    data = random_bytes(70 * MiB + 5, 9)
    with mounted(s3, bucket, mountpoint, *WRITABLE):
        fd = os.open(mountpoint / ".tmp123", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, len(data))
            for i in range(0, len(data), MiB):
                os.write(fd, data[i:i + MiB])
            os.rename(mountpoint / ".tmp123", mountpoint / "final.bin")
            assert os.listdir(mountpoint) == ["final.bin"]
        finally:
            os.close(fd)
        assert sha((mountpoint / "final.bin").read_bytes()) == sha(data)
    assert keys(s3, bucket) == {"final.bin": len(data)}
    shutil.rmtree(tmp_path / "unused", ignore_errors=True)
    delete_bucket(s3, bucket)
