"""The persistent local (NVMe) chunk cache: verified chunks stored as files under one directory.

It must never return bytes other than the ones stored for the requested ChunkId (every read is checked
against the header and a 64-bit hash of the data), and it must never raise from put: a full or broken
disk only costs speed.

Concurrency rules (callers are worker threads of the chunk engine):
- One `threading.Lock` guards the in-memory index, the counters and the namespace operations that
  must agree with the index: the final `os.replace` of a new file and the `os.unlink` of an evicted
  or corrupt one. Reading and writing chunk *data* (and checksumming it) happens outside the lock.
  The one read of the index without it is `contains`, a read-ahead hint that may be stale.
- Space accounting is read under that lock too: a put reserves its file size against max_bytes from
  its room check until its file is indexed (`_reserved`), and against free space only until its temp
  file is written (`_unwritten`); from then on statvfs shows those bytes. statvfs is read under the
  lock, so it and `_unwritten` describe the same moment and no put is counted twice (only the part
  of a temp file being written right now is, which errs on the side of free space).
- The local copies of files being written (write_staging) share the disk: what one is about to write (a streamed
  copy's part, a deferred copy's promise not yet written) is held against free space too (`hold`, `_held`), taken
  and given back under that lock, so a put and a copy never both count the same free bytes (B731: a put racing a
  copy's last part took the disk below the floor until the next floor check). A copy's I/O is never under the lock,
  and what a hold evicts for is a slice (HOLD_SLICE) per lock section (B800).
- A put that finds no room only because of puts in flight (they become evictable once indexed) is
  skipped quietly, like one over max_bytes; ENOSPC is raised only when the disk lacks the room even
  if every put in flight landed and everything were evicted.
- A failed write starts an episode: one warning, then puts are skipped for retry_after_s. Only a put
  that passed the pause check after the episode began can end it; a put already past that check when
  the failure happened may still succeed, but says nothing about the disk now.
- Writes bypass the page cache where the filesystem allows it (ChunkFileWriter, in chunk_file), and so
  do reads into the engine's buffers (read_chunk_direct: no copy out of the page cache, no pages to drop
  after); the writer's `direct` says whether the directory's filesystem takes O_DIRECT, for both.
- Files are never modified in place: a chunk is written to `*.tmp` and renamed over its final name.
  So a reader that opened a file always sees one complete file; if eviction unlinks it meanwhile, Linux
  keeps the open inode readable. A reader that loses the race to the unlink gets ENOENT -> a miss.
- One process per cache directory: the directory is held with flock(LOCK_EX|LOCK_NB) while open, and by
  `cache_clear` / `cache_verify`, so nothing deletes files under a live mount's index.

The directory layout and its lock are cache_dir's; the chunk file format is chunk_file's.
LRU order lives in memory (OrderedDict, most recent last) and persists across restarts as file mtime:
put sets it, a hit refreshes it (at most once per TOUCH_INTERVAL_NS, from a thread of its own: _Toucher), open
sorts by it. A stamp in the future was set while the clock was ahead (a wrong RTC that chrony then stepped back): open
counts it older than every other stamp, and a hit restamps it.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import itertools
import logging
import mmap
import os
import queue
import stat
import tempfile
import threading
import time
from typing import Self

from fsmount.data.cache_dir import (
    CHUNKS_DIR,
    SHARD_HEX_CHARS,
    TMP_SUFFIX,
    CacheDirBusy,
    acquire_dir_lock,
    bytes_for_fraction,
    chunk_path,
    counted,
    free_bytes,
    mark_draining,
    real_dir,
    release_dir_lock,
    scan_chunk_files,
    still_on,
)
from fsmount.data.chunk_file import (
    ChunkFileWriter,
    Corrupt,
    OtherFormat,
    data_offset,
    encode_header,
    read_chunk_direct,
    read_chunk_file,
)
from fsmount.data.identity import ChunkId, WritableBuffer

log = logging.getLogger(__name__)

GiB = 1024**3

# A fixed floor of free space left to the rest of the node (logs, containers, other caches).
# Mountpoint-S3 keeps 5% free by default (doc/CONFIGURATION.md "Disk Cache Size"); a byte count does not
# scale with the disk, and callers wanting Mountpoint's rule pass bytes_for_fraction(root, 0.05).
# 4 GiB is a judgement call: room for several hundred 8 MiB chunks in flight plus log growth.
DEFAULT_MIN_FREE = 4 * GiB
# ... but at most this share of the filesystem (Mountpoint's 5 %), so that a small one (a test VM's disk, a
# tmpfs) can cache at all: with the fixed 4 GiB, a 64 MiB cache dir never stored a chunk.
MIN_FREE_SHARE = 0.05
# After a failed write, puts are skipped for this long before one is tried again. A full disk rarely frees
# within seconds; 30 s bounds the wasted attempts to 2 a minute and resumes within a minute of space
# freeing. A judgement call, not a measurement.
WRITE_RETRY_S = 30.0
# A hit rewrites the file's mtime (the persisted LRU stamp) only if it is older than this, so hot chunks
# do not dirty their inode on every read. Restart order is therefore exact to within a minute.
TOUCH_INTERVAL_NS = 60 * 1_000_000_000
# Read errors that say a chunk file will not read (it is removed and written again); others are passing.
UNREADABLE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EIO, errno.EISDIR, errno.ENXIO})
# How long a get waits for the cache lock before it counts as a miss: the lock guards renames and unlinks that
# take microseconds, unless the disk stalls.
LOCK_WAIT_S = 1.0
# Touches waiting for the toucher's thread; more are dropped (only the order after a restart ages).
TOUCH_BACKLOG = 1024
# forget_removed: the least recently used chunks it looks for on disk per round (an lstat each, outside the lock), and
# per batch (those found missing are forgotten under the lock). A round stops at the first chunk still there, so a
# cache nobody touched costs one lstat; an `rm -rf CACHE/chunks` of a million chunks is counted out in ~16 rounds.
FORGET_CHECK_MAX = 65536
FORGET_BATCH = 1024
# `hold`: what it holds (and evicts for) per lock section. A deferred checkpoint's promise is its whole size, and
# evicting for it at once unlinked gigabytes of chunk files under the lock, which every read's get (a miss after
# LOCK_WAIT_S) and put waited for (B800). 64 MiB is 8 default chunks, about what a put's own eviction costs.
HOLD_SLICE = 64 << 20


class _Toucher:
    """Rewrites the mtime of chunk files that were hit, on a thread of its own. Done in the read, a utime on a
    stalled cache disk (a filesystem frozen for a snapshot, a hung NVMe) held the READ of a chunk read whole a
    moment before, and every READ of a cached chunk after it, until each failed at --read-timeout."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def touch(self, path: str) -> None:
        if self._queue.qsize() >= TOUCH_BACKLOG:
            return
        self._queue.put(path)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="disk-cache-touch", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while (path := self._queue.get()) is not None:
            try:
                os.utime(path, follow_symlinks=False)
            except OSError:
                pass  # evicted meanwhile, or a read-only fs: LRU order is still right in memory

    def close(self) -> None:
        """Ends the thread once the touches queued are done (not waited for: the disk may be stalled)."""
        self._queue.put(None)


@dataclasses.dataclass(slots=True)
class CacheStats:
    """Counters for metrics; updated under the cache lock. Hits and misses are the level stack's to count
    (every get is one of them); these are what only the cache itself sees."""

    corrupt: int = 0
    # Chunk files another version of modelfs wrote in another format (chunk_file.OtherFormat): dropped as they are
    # read, as corrupt ones are, but counted apart: an upgraded node's cache is not a failing disk.
    other_format: int = 0
    lock_timeouts: int = 0  # gets that found the cache lock held past LOCK_WAIT_S (a stalled disk): misses
    read_errors: int = 0
    evictions: int = 0
    writes: int = 0
    write_errors: int = 0
    # while writes are paused after an error, a chunk larger than max_bytes, no room until puts in flight land
    writes_skipped: int = 0
    bytes_used: int = 0  # sum of file sizes (header + data) of indexed chunk files
    chunks: int = 0


class NotAChunkFile(OSError):
    """What is at a chunk file's path is not a regular file (a FIFO, a symlink, a directory): never read."""


class DiskCache:
    """ChunkCache over a local directory. The constructor opens it (takes the lock, sweeps `*.tmp`,
    rebuilds the index from file sizes and mtimes without reading data) and raises CacheDirBusy if
    another process holds it; close() releases it. After close, get/contains miss and put is a no-op,
    so worker threads still draining at shutdown never see an exception."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        max_bytes: int,
        min_free_bytes: int = DEFAULT_MIN_FREE,
        retry_after_s: float = WRITE_RETRY_S,
    ) -> None:
        if max_bytes <= 0 or min_free_bytes < 0:
            raise ValueError(
                f"max_bytes must be > 0 and min_free_bytes >= 0, got {max_bytes}, {min_free_bytes}"
            )
        self.root = os.path.abspath(os.fspath(root))
        self.max_bytes = max_bytes
        self.min_free_bytes = min_free_bytes
        self.retry_after_s = retry_after_s
        self.stats = CacheStats()
        self._chunks_dir = os.path.join(self.root, CHUNKS_DIR)
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[str, int] = collections.OrderedDict()  # digest -> file size
        self._writing: set[str] = set()  # digests with a put in flight, so a chunk is written once
        self._reserved = 0  # file bytes of puts in flight until indexed: counted against max_bytes
        self._unwritten = 0  # file bytes of puts in flight until their temp file is written: free space
        self._held = 0  # bytes the local copies of written files hold against free space (`hold`)
        # What the cache can hold as its disk stands, as `keep_free` last measured it (every FREE_CHECK_S of the
        # mount): its chunks, plus the free space beyond the floor that puts in flight and copies do not take, at most
        # max_bytes. None until measured, or where the filesystem is read-only or reports no size. Read without the
        # lock (stats): one int.
        self.room_bytes: int | None = None
        # monotonic time of the last failed write, None once the episode ends; one warning per episode
        self._write_failed_at: float | None = None
        self._write_episode = 0  # counts episodes, so a put knows whether it started inside this one
        self._corrupt_logged = False
        self._other_format_logged = False
        self._unreadable_logged = False
        self._remade_logged = False
        self._closed = False
        # Writes chunk files, and says whether this filesystem takes O_DIRECT (tmpfs and some overlays
        # refuse it with EINVAL): hits are read with O_DIRECT straight into the engine's buffer as long as it does.
        self._writer = ChunkFileWriter(self.root)
        self.swept_tmp_files = 0
        self._toucher = _Toucher()

        # Chunk data is private bucket content: a directory made here is 0700, and so are `chunks/` and its
        # shards whatever the directory above them. An existing directory keeps its mode: it may be a disk's
        # root or a directory other services share (`--cache-dir /nvme`), and its owner chose who enters it.
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._lock_fd = acquire_dir_lock(self.root)
        self._lock_fd_guard = threading.Lock()  # the swap of `_lock_fd` (`_lock_again`) against its release (`close`)
        self._relocking = threading.Lock()  # one `_lock_again` at a time; taken before `_lock_fd_guard`, never `_lock`
        self._dev = os.stat(self.root).st_dev  # its filesystem: directories removed are made again only there
        try:
            os.makedirs(self._chunks_dir, mode=0o700, exist_ok=True)
            real_dir(self._chunks_dir)  # not a symlink out of the cache dir (chmod below would follow it too)
            self._make_private()
            try:
                self._make_shards()
            except OSError as exc:
                if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise
                # A read-only cache dir (a warm cache on a disk mounted read-only): it serves what it holds, and
                # its first put starts a write episode (one warning).
                log.warning("disk cache %s: cannot make its directories (%s); serving what it holds", self.root,
                            exc.strerror or exc)
            self._rebuild_index()
            with self._lock:
                self._evict_locked(self.stats.bytes_used - self.max_bytes)  # max_bytes may have shrunk
        except BaseException:
            release_dir_lock(self._lock_fd)
            raise

    def _make_private(self) -> None:
        """`chunks/` 0700. Only changed where it is not: a chmod of a directory another user owns needs CAP_FOWNER,
        which the systemd unit does not keep, and a read-only cache dir refuses it; a cache dir restored from a
        backup was refused whole for that."""
        mode = stat.S_IMODE(os.stat(self._chunks_dir).st_mode)
        if mode == 0o700:
            return
        try:
            os.chmod(self._chunks_dir, 0o700)
        except OSError as exc:
            if mode & 0o077:
                log.warning("disk cache %s: cannot make %s private (%s): other users may read the cached chunks",
                            self.root, self._chunks_dir, exc.strerror or exc)

    def _make_shards(self, only: str | None = None) -> None:
        """The shard directories under `chunks/` (or `only`, one of them), made again where missing. A symlink in
        a shard's place is removed, never followed: chunks are written only here."""
        shards = [only] if only is not None else [
            os.path.join(self._chunks_dir, f"{shard:0{SHARD_HEX_CHARS}x}") for shard in range(16**SHARD_HEX_CHARS)]
        for path in shards:
            if os.path.islink(path):
                os.unlink(path)
                log.warning("disk cache %s: %s was a symlink; removed", self.root, path)
            os.makedirs(path, 0o700, exist_ok=True)

    # -- lifecycle -------------------------------------------------------------------------------

    def mark_draining(self) -> None:
        """Say in the dir's `lock` that this mount is gone and only its writes go on: a mount of the dir started
        meanwhile waits for them instead of being refused (cache_dir.DRAINING)."""
        mark_draining(self.root)

    def close(self) -> None:
        # Not waiting for good for a lock that a rename stuck on a stalled disk holds (an unmount then hung until
        # systemd's SIGKILL): past LOCK_WAIT_S the flag is set without it (a bool; a put that reads it late only
        # writes one more file, which the next mount indexes).
        locked = self._lock.acquire(timeout=LOCK_WAIT_S)
        try:
            if self._closed:
                return
            self._closed = True
        finally:
            if locked:
                self._lock.release()
        self._toucher.close()
        with self._lock_fd_guard:
            release_dir_lock(self._lock_fd)

    def keep_free(self) -> int:
        """Evict the least recently used chunks while the filesystem has less than min_free_bytes free, as a put
        would: another process (logs, container images) filled it while no put came. What the local copies of
        written files hold (`hold`) counts as taken. The bytes evicted."""
        with self._lock:
            if self._closed:
                return 0
            try:
                # A read-only filesystem (a warm cache on a disk mounted read-only) is filled by nobody, and may say
                # it has no room (squashfs): its chunks stay.
                if os.statvfs(self.root).f_flag & os.ST_RDONLY:
                    return 0
                free = free_bytes(self.root)
            except OSError as err:  # the dir removed under the mount: puts say so
                log.debug("disk cache %s: free space unknown: %s", self.root, err)
                return 0
            short_of_free = self.min_free_bytes + self._unwritten + self._held - free
            self.room_bytes = max(0, min(self.max_bytes, self.stats.bytes_used - short_of_free))
            if not self._index:
                return 0
            try:
                self._held_or_lock_again()
            except OSError as err:
                log.debug("disk cache %s: free space unknown: %s", self.root, err)
                return 0
            if short_of_free <= 0:
                return 0
            before = self.stats.bytes_used
            self._evict_locked(short_of_free)
            evicted = before - self.stats.bytes_used
        if evicted:  # chunk files it cannot remove (another owner's) evict nothing: said every 5 s, for good
            log.info("disk cache %s: %d bytes evicted to keep %d bytes free (something else fills its filesystem)",
                     self.root, evicted, self.min_free_bytes)
        return evicted

    def hold(self, size: int, must: bool = False) -> bool:
        """Hold `size` bytes of free space beyond the floor for a local copy of a file being written (write_staging),
        until `unhold`: puts count them as their own bytes in flight (`_unwritten`), so a put and the copy never
        both take the same free bytes (B731). Where the disk is short of them, the least recently used chunks are
        evicted for what is short, no more (B680). False, nothing held, where that does not make the room, unless
        `must` (a deferred copy's promise: its bytes are nowhere else, so puts leave it the room they find); True
        on a closed cache or a filesystem that reports no size (free_bytes), where nothing is counted. Held and evicted
        for a slice (HOLD_SLICE) per lock section, the lock let go between them (B800)."""
        evicted = 0
        taken = 0  # held so far: a slice (HOLD_SLICE) per lock section, so reads' gets and puts come in between
        while True:
            with self._lock:
                if self._closed:
                    self._held += size - taken
                    return True
                step = min(size - taken, HOLD_SLICE)
                try:
                    short = self.min_free_bytes + self._unwritten + self._held + step - free_bytes(self.root)
                    if short > 0 and self._index and not os.statvfs(self.root).f_flag & os.ST_RDONLY:
                        self._held_or_lock_again()
                        before = self.stats.bytes_used
                        self._evict_locked(short)
                        freed = before - self.stats.bytes_used
                        evicted += freed
                        # Not statvfs again: a block this copy held and wrote meanwhile would count twice (as a put
                        # does).
                        short -= freed
                except OSError as err:  # the dir removed under the mount: puts say so
                    log.debug("disk cache %s: free space unknown: %s", self.root, err)
                    short = 0 if must else 1
                if short > 0 and not must:
                    self._held -= taken
                    held = False
                    break
                self._held += step
                taken += step
                if taken >= size:
                    held = True
                    break
            time.sleep(0)  # the GIL to a thread waiting for the lock, which the release woke
        if evicted:
            log.debug("disk cache %s: %d bytes evicted for %d bytes of a written file's copy beyond the %d kept free",
                      self.root, evicted, size, self.min_free_bytes)
        return held

    def unhold(self, size: int) -> None:
        """Give back `size` bytes `hold` took (written, so free space shows them now; or not to be written)."""
        with self._lock:
            self._held -= size

    @property
    def evictable_bytes(self) -> int:
        """What the cache holds, read without its lock (a count that may be a put or an eviction behind): the room a
        deferred copy's promise may count on having evicted for it (write_staging), asked in the trio thread."""
        return self.stats.bytes_used

    def forget_removed(self) -> int:
        """Forget the least recently used chunks whose files someone else removed (an operator's `rm -rf CACHE/chunks`
        or `find CACHE -mtime +7 -delete`, to free the disk): they stayed counted in `modelfs stats` and the
        Prometheus gauges, chunks and bytes the disk no longer held, until each was read or evicted. Looks from the
        least recently used end, where such a removal starts, and stops at the first chunk still there (at most
        FORGET_CHECK_MAX a call). The number forgotten."""
        forgotten = checked = 0
        while checked < FORGET_CHECK_MAX:
            with self._lock:
                if self._closed:
                    return forgotten
                batch = list(itertools.islice(self._index, FORGET_BATCH))
            if not batch:
                break
            checked += len(batch)
            missing = []
            for digest in batch:
                if not self._gone(digest):
                    break  # the rest are more recent: they were put or read after this one
                missing.append(digest)
            with self._lock:
                # Again under the lock, which puts rename under: one may have brought a chunk back meanwhile.
                for digest in missing:
                    if self._gone(digest) and self._forget_locked(digest):
                        forgotten += 1
            if len(missing) < len(batch):
                break
        if forgotten:
            log.info("disk cache %s: %s removed by something else; no longer counted", self.root,
                     counted(forgotten, "chunk file was", "chunk files were"))
        return forgotten

    def _gone(self, digest: str) -> bool:
        """Whether nothing is at the chunk's path (a file the daemon may not stat, or a disk error, is not gone)."""
        try:
            os.lstat(self._path(digest))
        except (FileNotFoundError, NotADirectoryError):
            return True
        except OSError:
            return False
        return False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _rebuild_index(self) -> None:
        started = time.perf_counter()
        found, self.swept_tmp_files = scan_chunk_files(self._chunks_dir, sweep_tmp=True)
        # By mtime: least recently used first, as OrderedDict order expects. Stamps in the future were set before the
        # clock was stepped back, so before every stamp of now: counted as the oldest, they sat at the recent end,
        # evicted last, until the clock caught up with them (a year for an RTC a year ahead).
        now = time.time_ns()
        found.sort(key=lambda f: (f[0] <= now, f))
        for _mtime_ns, digest, size, _path in found:
            self._index[digest] = size
        self.stats.chunks = len(self._index)
        self.stats.bytes_used = sum(self._index.values())
        log.info(
            "disk cache %s: %d chunks, %d bytes, %d stale temp files removed, index built in %.2f s",
            self.root,
            self.stats.chunks,
            self.stats.bytes_used,
            self.swept_tmp_files,
            time.perf_counter() - started,
        )

    # -- ChunkCache ------------------------------------------------------------------------------

    def staging_bytes(self, chunk_size: int) -> int:
        """The most memory the staging buffers of puts hold (they live outside the chunk engine's
        budget, so the daemon's --memory-limit must leave room for them)."""
        return ChunkFileWriter.staging_bytes(chunk_size)

    def contains(self, chunk: ChunkId) -> bool:
        """Whether the chunk is indexed: a hint for read-ahead, called from the trio thread, so it does not
        wait for the lock (a puts' rename or an eviction's unlinks may hold it). One dict lookup is atomic
        under the GIL; the answer may be stale by the time it is used, which costs only speed."""
        return not self._closed and chunk.digest() in self._index

    def get(self, chunk: ChunkId, buffer: WritableBuffer | None = None) -> bytes | WritableBuffer | None:
        """The chunk's data, or None. Given a `buffer` of exactly the data's length, reads into it and
        returns it (on None its contents are undefined)."""
        digest = chunk.digest()
        if not self._lock.acquire(timeout=LOCK_WAIT_S):
            # A rename or unlink under the lock is stuck on a stalled disk (a filesystem frozen for a snapshot,
            # a hung NVMe): a miss, which the origin serves, instead of a READ that waits for the disk.
            self.stats.lock_timeouts += 1  # unlocked: a counter for metrics, off by one at worst
            return None
        try:
            if self._closed or digest not in self._index:
                return None
            self._index.move_to_end(digest)
        finally:
            self._lock.release()
        path = self._path(digest)
        direct = self._writer.direct and type(buffer) is mmap.mmap
        try:
            fd, st = self._open_for_read(path, direct)
        except NotAChunkFile as err:
            try:
                self._drop_corrupt(digest, path, os.lstat(path), str(err))  # so the next put writes a real one
            except OSError:
                pass
            return None
        except OSError as err:
            self._read_failed(digest, err)
            return None
        try:
            try:
                read = self._read_direct(fd, st.st_size, buffer) if direct else None
                if read is None:
                    if direct:  # not for O_DIRECT after all: the same descriptor, through the page cache
                        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
                    read = read_chunk_file(fd, st.st_size, buffer)
                    # The bytes are about to sit in the engine's memory and the FUSE file's page cache; a
                    # third copy in this file's page cache would only push other pages out.
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                stored, data = read
                if stored != chunk:
                    raise Corrupt(f"header names {stored}")
            except Corrupt as why:
                self._drop_corrupt(digest, path, st, why)
                return None
            # Either way: a stamp in the future (the clock since stepped back) was never refreshed.
            if abs(time.time_ns() - st.st_mtime_ns) > TOUCH_INTERVAL_NS:
                self._toucher.touch(path)
        except OSError as err:
            self._read_failed(digest, err)
            return None
        finally:
            os.close(fd)
        return data

    def _open_for_read(self, path: str, direct: bool) -> tuple[int, os.stat_result]:
        # O_NONBLOCK: a FIFO in a chunk file's place opened at once (its read then fails) instead of holding a
        # cache thread for good, and every READ of that chunk to --read-timeout; O_NOFOLLOW: a symlink is no
        # chunk file either. Neither changes a regular file's reads.
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW
        try:
            if direct:
                try:
                    return self._regular(os.open(path, flags | os.O_DIRECT))
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    if not stat.S_ISREG(os.lstat(path).st_mode):
                        # A FIFO or a directory refuses O_DIRECT: raised as the EINVAL it is, it kept its index
                        # entry, a miss on every read and a put skipped as held, until a remount (the audit).
                        raise NotAChunkFile(errno.EINVAL, "not a regular file") from None
                    self._writer.refuse_direct(err)
            return self._regular(os.open(path, flags))
        except OSError as err:
            if err.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
                raise NotAChunkFile(errno.ELOOP, "a symlink, not a chunk file") from None
            raise

    @staticmethod
    def _regular(fd: int) -> tuple[int, os.stat_result]:
        """The descriptor and its stat (the one fstat of a read), if it is a regular file."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotAChunkFile(errno.EINVAL, "not a regular file")
        except OSError:
            os.close(fd)
            raise
        return fd, st

    def _read_direct(self, fd: int, size: int, buffer: WritableBuffer | None
                     ) -> tuple[ChunkId, bytes | WritableBuffer] | None:
        try:
            return read_chunk_direct(fd, size, buffer)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
            self._writer.refuse_direct(err)
            return None

    def put(self, chunk: ChunkId, data: bytes | WritableBuffer) -> None:
        digest = chunk.digest()
        with self._lock:
            if self._closed or digest in self._writing:
                return
            if digest in self._index:  # same id means same bytes: only the access order changes
                self._index.move_to_end(digest)
                return
            if (
                self._write_failed_at is not None
                and time.monotonic() < self._write_failed_at + self.retry_after_s
            ):
                self.stats.writes_skipped += 1
                return
            # A retry inside an episode of failed writes; only its success may end that episode.
            retry_of = self._write_episode if self._write_failed_at is not None else None
            self._writing.add(digest)
        header = encode_header(chunk, data)
        file_size = data_offset(len(header)) + len(data)
        reserved = unwritten = 0
        try:
            if file_size > self.max_bytes:
                with self._lock:
                    self.stats.writes_skipped += 1
                return
            with self._lock:
                if not self._make_room_locked(file_size):
                    return
                reserved = unwritten = file_size
                self._reserved += file_size
                self._unwritten += file_size
            tmp_path = self._write_tmp(digest, header, data)
            unwritten = 0  # _write_tmp released it once the file was whole
            with self._lock:
                try:
                    if self._closed:
                        raise OSError(errno.EBADF, "cache closed during put")
                    os.replace(tmp_path, self._path(digest))
                except IsADirectoryError:
                    # A directory where this chunk's file goes (not ours to remove): this chunk is not cached. As a
                    # failed write it stopped every chunk's writes for retry_after_s, each time this one was fetched.
                    unlink_quietly(tmp_path)
                    self.stats.writes_skipped += 1
                    log.info("disk cache %s: a directory is where chunk file %s goes; that chunk is not cached",
                             self.root, digest)
                    return
                except OSError:
                    unlink_quietly(tmp_path)
                    if self._closed:
                        return
                    raise
                self._index[digest] = file_size
                self.stats.bytes_used += file_size
                self.stats.chunks = len(self._index)
                self.stats.writes += 1
                if self._write_failed_at is not None and retry_of == self._write_episode:
                    self._write_failed_at = None
                    log.info("disk cache %s: writes succeed again, cache filling resumed", self.root)
        except OSError as err:
            if not self._closed:  # closed meanwhile (`_held_or_lock_again`'s EBADF): a no-op, as any put after close
                self._write_failed(err)
        finally:
            with self._lock:
                self._writing.discard(digest)
                self._reserved -= reserved
                self._unwritten -= unwritten

    # -- internals -------------------------------------------------------------------------------

    def _path(self, digest: str) -> str:
        return chunk_path(self._chunks_dir, digest)

    def _make_room_locked(self, file_size: int) -> bool:
        """Evict LRU chunks so that the new file fits under max_bytes and leaves min_free_bytes free.
        False (nothing evicted, counted in writes_skipped) when even evicting everything indexed would
        not do but the puts in flight, once indexed and evictable, would; raises ENOSPC when not even
        they would, so the caller's one-warning path reports a disk filled by something else."""
        self._held_or_lock_again()
        over_limit = self.stats.bytes_used + self._reserved + file_size - self.max_bytes
        # Read under the lock, as _unwritten is: a temp file is in statvfs or in _unwritten, not both.
        try:
            free = free_bytes(self.root)
        except FileNotFoundError:
            # The whole cache dir was removed under the mount (`rm -rf CACHE`): every put failed (a write episode),
            # for good where nothing else made it again.
            self._remake_shard(None)
            free = free_bytes(self.root)
        short_of_free = self.min_free_bytes + self._unwritten + self._held + file_size - free
        if max(over_limit, short_of_free) <= self.stats.bytes_used:
            self._evict_locked(max(over_limit, short_of_free))
            return True
        # Room there would be if every put in flight landed and everything were evicted. _unwritten
        # drops out: a temp file being written may already be partly in statvfs, so this is an upper bound. So does
        # what the copies of written files hold: that room is theirs for now, not a disk filled by something else.
        if short_of_free - self._unwritten - self._held > self.stats.bytes_used + self._reserved:
            raise OSError(
                errno.ENOSPC,
                f"{free} bytes free, {self.min_free_bytes} must stay free, cache holds only "
                f"{self.stats.bytes_used} evictable bytes (+{self._reserved} being written) and a "
                f"{file_size}-byte chunk is waiting",
            )
        self.stats.writes_skipped += 1  # puts in flight hold the room, or all of max_bytes
        return False

    def _evict_locked(self, need: int) -> None:
        """Evict least recently used chunks until `need` bytes are freed, or one cannot be removed (a read-only or
        immutable file, another owner's cache dir): that one stays indexed and served, and eviction stops there.
        Dropped from the index, such chunks freed nothing, and the floor check (`keep_free`) emptied the index of a
        cache whose files all stayed on disk, served no more until a remount (the review)."""
        freed = 0
        while freed < need and self._index:
            digest, size = next(iter(self._index.items()))
            try:
                os.unlink(self._path(digest))
            except FileNotFoundError:
                pass
            except OSError as err:
                log.debug("disk cache %s: evicting %s failed: %s", self.root, digest, err)
                break
            del self._index[digest]
            freed += size
            self.stats.bytes_used -= size
            self.stats.evictions += 1
        self.stats.chunks = len(self._index)

    def _write_tmp(self, digest: str, header: bytes, data: bytes) -> str:
        """Write header, padding and data to a new temp file next to the chunk's final path. Once the file
        is whole, statvfs counts its bytes, so they leave _unwritten here (on failure the caller releases
        them)."""
        shard = os.path.dirname(self._path(digest))
        # 0600, O_EXCL; in the chunk's own directory, so the rename is atomic.
        try:
            fd, tmp_path = tempfile.mkstemp(prefix=digest[:16] + ".", suffix=TMP_SUFFIX, dir=shard)
        except FileNotFoundError:
            self._remake_shard(shard)
            fd, tmp_path = tempfile.mkstemp(prefix=digest[:16] + ".", suffix=TMP_SUFFIX, dir=shard)
        try:
            self._writer.write(fd, tmp_path, header, data)
        except BaseException:
            os.close(fd)
            unlink_quietly(tmp_path)
            raise
        os.close(fd)  # no fsync: a torn file after a crash fails its checksum and is dropped on read
        with self._lock:
            self._unwritten -= data_offset(len(header)) + len(data)
        return tmp_path

    def _remake_shard(self, shard: str | None) -> None:
        """`shard` (every shard if None), `chunks/` or the cache dir itself was removed under the mount (an operator's
        `rm -rf CACHE/chunks/*`): every put failed until the next mount. Made again, never through a symlink, and 0700
        as at open (the cache dir came back with the umask's mode)."""
        still_on(self._chunks_dir, self._dev, "the NVMe cache")
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._held_or_lock_again()
        os.makedirs(self._chunks_dir, mode=0o700, exist_ok=True)
        real_dir(self._chunks_dir)
        self._make_shards(shard)
        (log.debug if self._remade_logged else log.info)(
            "disk cache %s: %s was removed under the mount; made again (and so any other directory of it)",
            self.root, shard or self.root)
        self._remade_logged = True

    def _held_or_lock_again(self) -> None:
        """Before a put or an eviction (under the cache lock): the cache dir is still the directory this cache holds,
        or it is taken (`_lock_again`; OSError EBUSY where another holds it). `rm -rf CACHE` and a second mount of
        CACHE, which found it free and made it again: this one wrote its chunks there and evicted there by its own
        index, each mount removing the other's files (B113). Gone altogether: the put makes it again
        (`_remake_shard`, which asks here too, without the cache lock)."""
        if self._holds_root() is False:
            # One thread at a time, asking again once its turn comes: a put making its shard again in `_write_tmp`
            # asks without the cache lock, and this process's second flock of the new dir, through a descriptor of
            # its own, was refused as another mount's (a failed put, its warning naming this daemon's pid) (B119).
            with self._relocking:
                if self._holds_root() is False:
                    self._lock_again()

    def _holds_root(self) -> bool | None:
        """Whether the cache dir is the directory whose flock this cache holds; None where it is gone."""
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return None
        with self._lock_fd_guard:  # not a descriptor close released (and the number reused)
            if self._closed:
                raise OSError(errno.EBADF, "cache closed during put")
            held = os.fstat(self._lock_fd)
        return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)

    def _lock_again(self) -> None:
        """The cache dir is another directory than the one whose flock this cache holds (removed whole, made again):
        that one is taken too, or refused. Nobody's, `modelfs cache clear` (which refuses while a mount uses the dir)
        emptied it under the mount, and a second mount of it went in beside this one, each evicting the other's
        files. Asked without acquire_dir_lock's waits: a put's room check and the floor check ask under the cache lock,
        which every read of a cached chunk waits for (while another mount held the dir, each floor check, every 5 s,
        held it 1 s; a draining one, up to DRAINING_WAIT_S)."""
        try:
            fd = acquire_dir_lock(self.root, wait=False)
        except CacheDirBusy as exc:  # another mount or command took the new directory first: not written here
            raise OSError(errno.EBUSY, str(exc)) from None
        with self._lock_fd_guard:
            if self._closed:  # closed meanwhile: what it held is released, and so is this
                release_dir_lock(fd)
                return
            release_dir_lock(self._lock_fd)
            self._lock_fd = fd

    def _write_failed(self, err: OSError) -> None:
        with self._lock:
            self.stats.write_errors += 1
            first = self._write_failed_at is None
            if first:
                self._write_episode += 1
            self._write_failed_at = time.monotonic()
        if first:
            log.warning(
                "disk cache %s: write failed (%s); serving cached chunks read-only, retrying writes every "
                "%g s",
                self.root,
                err,
                self.retry_after_s,
            )

    def _read_failed(self, digest: str, err: OSError) -> None:
        with self._lock:
            # ENOENT: evicted since we looked (then a re-put may already have brought it back, which the
            # lexists sees, since renames happen under this lock) or removed by someone else.
            if isinstance(err, FileNotFoundError):
                if not os.path.lexists(self._path(digest)):
                    self._forget_locked(digest)
                return
            self.stats.read_errors += 1
            if err.errno not in UNREADABLE_ERRNOS:  # out of descriptors or memory for a moment: the file is fine
                log.debug("disk cache %s: reading %s failed: %s", self.root, digest, err)
                return
            # Unreadable (a file of another owner, restored from a backup; a bad block): forgotten and removed,
            # so that the chunk's next put writes one that reads. Kept indexed, every read of it went to the
            # origin and its put was skipped as a chunk already held, for good.
            if self._forget_locked(digest):
                unlink_quietly(self._path(digest))
            first = not self._unreadable_logged
            self._unreadable_logged = True
        (log.warning if first else log.debug)(
            "disk cache %s: reading chunk file %s failed (%s); it is removed and written again at the chunk's next "
            "fetch", self.root, self._path(digest), err.strerror or err)

    def _forget_locked(self, digest: str) -> bool:
        """Take a chunk out of the index (the lock held); whether it was in it."""
        size = self._index.pop(digest, None)
        if size is None:
            return False
        self.stats.bytes_used -= size
        self.stats.chunks = len(self._index)
        return True

    def _drop_corrupt(self, digest: str, path: str, read: os.stat_result, why: str | Corrupt) -> None:
        other = isinstance(why, OtherFormat)
        with self._lock:
            if other:
                self.stats.other_format += 1
                first = not self._other_format_logged
                self._other_format_logged = True
            else:
                self.stats.corrupt += 1
                first = not self._corrupt_logged
                self._corrupt_logged = True
            try:
                now = os.lstat(path)
                # A put may have replaced the bad file with a good one since we read it: keep that one.
                replaced = (now.st_ino, now.st_dev) != (read.st_ino, read.st_dev)
            except FileNotFoundError:
                replaced = False
            if not replaced:
                self._forget_locked(digest)
                try:
                    os.unlink(path)
                except OSError:
                    pass  # gone already, or read-only fs: it is out of the index, so never read again
        if other:
            (log.info if first else log.debug)(
                "disk cache %s: chunk files another version of modelfs wrote (%s) are dropped as they are read, and "
                "fetched again (`modelfs cache clear` drops them all at once); counted in stats.other_format",
                self.root, why)
            return
        (log.warning if first else log.debug)(
            "disk cache %s: dropped corrupt chunk file %s (%s)%s",
            self.root,
            path,
            why,
            "; further ones are logged at debug level and counted in stats.corrupt" if first else "",
        )


def default_min_free(root: str | os.PathLike[str]) -> int:
    """The free space a cache at `root` leaves to the rest of the node: DEFAULT_MIN_FREE, or MIN_FREE_SHARE of
    a smaller filesystem; none on a filesystem that reports a size of 0 (free_bytes), where --cache-size, given in
    bytes, is the only bound."""
    try:
        return min(DEFAULT_MIN_FREE, bytes_for_fraction(root, MIN_FREE_SHARE))
    except ValueError:
        return 0


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # a leftover *.tmp is swept at the next open
