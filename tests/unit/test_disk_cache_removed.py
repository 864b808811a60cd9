"""The NVMe cache when an operator removes chunk files by hand while a mount uses it (`rm -rf CACHE/chunks`, a
cron `find CACHE -mtime +7 -delete`): what it counts must follow what the disk holds."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
import time
from pathlib import Path

import pytest

from fsmount.data import CacheDirBusy, cache_clear, cache_dir, disk_cache
from fsmount.data.cache_dir import CHUNKS_DIR
from fsmount.data.disk_cache import DiskCache
from tests.helpers import tmpfs
from tests.unit.test_disk_cache import BIG, chunk_file_of, chunk_id, payload, warnings_from_cache


def test_chunk_files_removed_by_hand_are_no_longer_counted(tmp_path: Path) -> None:
    """`rm -rf CACHE/chunks` to free the disk under a live mount: `modelfs stats` and the Prometheus gauges kept
    the chunks and bytes the disk no longer held, until each chunk was read or evicted (for good on a node that
    no longer reads that model)."""
    with DiskCache(tmp_path / "c", BIG, min_free_bytes=0) as cache:
        for i in range(6):
            cache.put(chunk_id(i), payload(chunk_id(i)))
        one = cache.stats.bytes_used // 6
        assert cache.forget_removed() == 0 and cache.stats.chunks == 6  # nothing removed: nothing forgotten
        for i in (0, 1):  # the oldest ones, as `find -mtime +N -delete` would
            os.unlink(chunk_file_of(cache, chunk_id(i)))
        assert cache.forget_removed() == 2
        assert (cache.stats.chunks, cache.stats.bytes_used) == (4, 4 * one)
        assert cache.get(chunk_id(2)) == payload(chunk_id(2))  # the others are still served
        shutil.rmtree(tmp_path / "c" / CHUNKS_DIR)
        cache.put(chunk_id(9), payload(chunk_id(9)))  # a put after the removal makes its shard again, and counts
        assert cache.forget_removed() == 4
        assert (cache.stats.chunks, cache.stats.bytes_used) == (1, one)
        assert cache.get(chunk_id(9)) == payload(chunk_id(9))


def test_forgetting_removed_chunks_is_bounded_per_call(tmp_path: Path, monkeypatch, caplog) -> None:  # noqa: ANN001
    """Each call looks at most FORGET_CHECK_MAX chunks (it runs every few seconds beside the reads); the next
    calls go on where it stopped. Each says how many it forgot, in words that fit: one was "1 chunk files were"."""
    caplog.set_level(logging.INFO, logger="fsmount.data.disk_cache")
    monkeypatch.setattr(disk_cache, "FORGET_CHECK_MAX", 4)
    monkeypatch.setattr(disk_cache, "FORGET_BATCH", 2)
    with DiskCache(tmp_path / "c", BIG, min_free_bytes=0) as cache:
        for i in range(10):
            cache.put(chunk_id(i), payload(chunk_id(i)))
        for i in range(9):
            os.unlink(chunk_file_of(cache, chunk_id(i)))
        assert [cache.forget_removed() for _ in range(4)] == [4, 4, 1, 0]
        said = [r.getMessage().split(": ", 1)[1] for r in caplog.records if "by something else" in r.getMessage()]
        assert said == [f"{n} removed by something else; no longer counted"
                        for n in ("4 chunk files were", "4 chunk files were", "1 chunk file was")], said
        assert cache.stats.chunks == 1 and cache.get(chunk_id(9)) == payload(chunk_id(9))


def test_a_cache_dir_removed_whole_under_a_live_cache_is_made_again(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """`rm -rf CACHE` while mounted: the next put failed on the dir's free space (ENOENT), a write episode with its
    warning, and so did every retry after it, for good on a node whose learnt names no longer changed (their save alone
    made the dir again). Now it is made again, 0700 as a new cache dir is, as `chunks/` is."""
    root = tmp_path / "c"
    with DiskCache(root, BIG, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), payload(chunk_id(1)))
        shutil.rmtree(root)
        assert cache.get(chunk_id(1)) is None
        cache.put(chunk_id(2), payload(chunk_id(2)))
        assert cache.get(chunk_id(2)) == payload(chunk_id(2))
        assert cache.stats.write_errors == 0 and not warnings_from_cache(caplog)
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


def test_a_cache_dir_made_again_is_held_as_the_removed_one_was(tmp_path: Path) -> None:
    """The lock is a flock on the cache dir itself: after `rm -rf CACHE` the dir made again was nobody's, and `modelfs
    cache clear` (refused while a mount uses the dir) emptied it under the mount; a second mount went in beside this
    one, each evicting the other's files. The dir made again is held as the removed one was."""
    root = tmp_path / "c"
    with DiskCache(root, BIG, min_free_bytes=0) as cache:
        shutil.rmtree(root)
        cache.put(chunk_id(1), payload(chunk_id(1)))
        with pytest.raises(CacheDirBusy):
            cache_clear(root)
        assert cache.get(chunk_id(1)) == payload(chunk_id(1))
    assert cache_clear(root)[0] == 1  # released at close


def test_a_cache_dir_removed_and_made_again_by_another_mount_is_left_to_it(tmp_path: Path, caplog,  # noqa: ANN001
                                                                          allowed_logs) -> None:
    """`rm -rf CACHE` under mount A, then mount B of the same dir, which finds it free (A's flock is on the directory
    removed) and makes it again: A went on writing its chunks into B's directory and evicting there by its own index,
    unlinking a file B had just written (B's reads of it then missed). A's puts now find the dir another's: refused,
    one warning naming the holder; B's files are left alone, and both serve their chunks (each file checked)."""
    allowed_logs.append(r"write failed")
    root = tmp_path / "c"
    with DiskCache(root, BIG, min_free_bytes=0) as a:
        for i in range(3):
            a.put(chunk_id(i), payload(chunk_id(i)))
        a.max_bytes = a.stats.bytes_used  # full: A's next put evicts its oldest, chunk 0
        shutil.rmtree(root)
        with DiskCache(root, BIG, min_free_bytes=0) as b:
            b.put(chunk_id(0), payload(chunk_id(0)))
            a.put(chunk_id(5), payload(chunk_id(5)))
            assert os.path.exists(chunk_file_of(b, chunk_id(0))), "A evicted B's file"
            assert not os.path.exists(chunk_file_of(b, chunk_id(5))), "A wrote into B's dir"
            assert a.stats.write_errors == 1 and a.stats.evictions == 0
            assert "in use by another modelfs mount" in warnings_from_cache(caplog)[0].getMessage()
            assert b.get(chunk_id(0)) == payload(chunk_id(0)) and b.stats.chunks == 1
            assert a.get(chunk_id(0)) == payload(chunk_id(0))  # B's file, of the same chunk: its header says so


def test_a_cache_dir_another_mount_holds_costs_no_wait_under_the_cache_lock(tmp_path: Path, monkeypatch,  # noqa: ANN001
                                                                            allowed_logs) -> None:
    """Mount A finds its removed cache dir made again and held by mount B: A's floor check (every 5 s) and a put asked
    for B's lock as a new mount does, with its wait for a holder about to say it drains (1 s), under A's cache lock,
    which every read of a cached chunk waits for (a read then waited 1 s and went to the origin); B draining, up to
    DRAINING_WAIT_S (60 s). They are refused at once."""
    allowed_logs.append(r"write failed")
    monkeypatch.setattr(cache_dir, "DRAINING_WAIT_S", 3.0)
    root = tmp_path / "c"
    with DiskCache(root, BIG, min_free_bytes=0) as a:
        a.put(chunk_id(0), payload(chunk_id(0)))
        shutil.rmtree(root)
        with DiskCache(root, BIG, min_free_bytes=0) as b:
            for draining in (False, True):
                if draining:
                    b.mark_draining()
                started = time.monotonic()
                assert a.keep_free() == 0
                a.put(chunk_id(1 + draining), payload(chunk_id(1 + draining)))
                a._write_failed_at = None  # the next put tries again at once
                assert time.monotonic() - started < cache_dir.DRAINING_GRACE_S / 2, draining
            assert a.stats.write_errors == 2 and b.stats.chunks == 0
            assert not any(os.path.exists(chunk_file_of(b, chunk_id(i))) for i in (1, 2))


def test_two_puts_that_find_the_cache_dir_made_again_at_once_take_it_once(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """`rm -rf CACHE` under a load: puts past their room check make their shard again outside the cache lock
    (`_write_tmp`) while another put checks the dir under it, and each asked for the new dir's flock. The second
    flock, this process's own through another descriptor, was refused as another mount's: that put failed, a write
    episode and its warning "in use by another modelfs mount or cache command (pid <its own>)". One takes it, the
    other finds it taken."""
    root = tmp_path / "c"
    with DiskCache(root, BIG, min_free_bytes=0) as cache:
        shutil.rmtree(root)
        os.makedirs(root)  # made again by nobody's lock (the names' save, say)
        real, calls, writers = disk_cache.acquire_dir_lock, [], []

        def and_a_put_writing_meanwhile(path, wait=True):  # noqa: ANN001, ANN202
            calls.append(path)
            if len(calls) == 1:  # the put at its room check asks: a put in `_write_tmp` remakes its shard meanwhile
                shard = os.path.dirname(chunk_file_of(cache, chunk_id(2)))
                writers.append(threading.Thread(target=cache._remake_shard, args=(shard,)))
                writers[0].start()
                writers[0].join(1)  # done, or waiting for this one's turn
            return real(path, wait)

        monkeypatch.setattr(disk_cache, "acquire_dir_lock", and_a_put_writing_meanwhile)
        cache.put(chunk_id(1), payload(chunk_id(1)))
        writers[0].join(5)
        assert cache.stats.write_errors == 0 and cache.get(chunk_id(1)) == payload(chunk_id(1))
        with pytest.raises(CacheDirBusy):
            cache_clear(root)


def test_a_put_that_the_cache_close_overtakes_says_nothing(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The unmount closes the cache while the engine's threads still put (past WRITE_DRAIN_S). A put that had passed
    its first check of `_closed` then met `_held_or_lock_again`'s EBADF at its room check: a write episode and its
    warning, "write failed (cache closed during put) ... retrying writes every 30 s", as the daemon exited. After close
    a put is a no-op, quietly, as one closed at its rename is."""
    with DiskCache(tmp_path / "c", BIG, min_free_bytes=0) as cache:
        real = disk_cache.encode_header

        def closing(chunk, data):  # noqa: ANN001, ANN202
            cache.close()  # between the put's two locked steps
            return real(chunk, data)

        monkeypatch.setattr(disk_cache, "encode_header", closing)
        cache.put(chunk_id(1), payload(chunk_id(1)))
        assert cache.stats.write_errors == 0 and cache.stats.writes == 0
        assert not os.path.exists(chunk_file_of(cache, chunk_id(1)))


def test_a_floor_check_that_evicts_nothing_says_nothing(tmp_path: Path, caplog, monkeypatch) -> None:  # noqa: ANN001
    """Chunk files the daemon cannot remove (a cache dir restored from a backup with another owner) on a disk something
    else filled: every floor check (every 5 s) logged "0 bytes evicted to keep ... free", for good."""
    with DiskCache(tmp_path / "c", BIG, min_free_bytes=0) as cache:
        cache.put(chunk_id(1), payload(chunk_id(1)))
        cache.min_free_bytes = BIG  # something else filled the disk

        def refused(path: object, **kwargs: object) -> None:
            raise PermissionError(13, "Permission denied", path)

        monkeypatch.setattr(os, "unlink", refused)
        caplog.set_level(logging.INFO, logger="fsmount.data.disk_cache")
        assert [cache.keep_free() for _ in range(3)] == [0, 0, 0]
        monkeypatch.undo()
        assert cache.stats.chunks == 1 and not [r for r in caplog.records if "evicted" in r.getMessage()]


def test_directories_removed_are_not_made_again_on_another_filesystem(tmp_path: Path, caplog,  # noqa: ANN001
                                                                      allowed_logs) -> None:
    """The cache disk unmounted lazily under the mount (`umount -l /nvme`): the cache dir's path then leads to the
    filesystem below it, and making the cache's directories again there would fill the node's root disk with a cache
    sized for the NVMe. Those puts fail instead (a write episode, one warning)."""
    allowed_logs.append(r"write failed")
    with tmpfs(tmp_path / "fs", "size=16m") as fs:  # its umount is lazy: the cache holds the dir's lock
        cache = DiskCache(fs / "c", BIG, min_free_bytes=0)
    with cache:  # `fs` unmounted: fs/c is now a path on the filesystem below it, and absent
        cache.put(chunk_id(1), payload(chunk_id(1)))
        assert cache.stats.write_errors == 1 and not (fs / "c").exists()
        assert "no longer on the cache dir's filesystem" in warnings_from_cache(caplog)[0].getMessage()
