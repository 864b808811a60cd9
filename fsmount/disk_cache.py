"""The persistent local (NVMe) chunk cache: verified chunks stored as files under one directory.

It must never return bytes other than the ones stored for the requested ChunkId (every read is checked
against the header and a 64-bit hash of the data), and it must never raise from put: a full or broken
disk only costs speed.

Why a fast non-cryptographic hash (XXH3-64) and not a cryptographic one: the check guards against
accidental damage only, and that is all it can meet here. Random damage (bit flips, zeroed or stale pages
from a crash, a torn write) passes with probability 2^-64; truncation and trailing bytes are caught first
by the data length in the header, which must match the file size; and the header binds the chunk id
(bucket, key, ETag, chunk size, index), compared with the one asked for, so a whole valid file of another
chunk is never served either. It is not an adversarial setting: the directory is 0700 and its files 0600,
owned by the daemon's user (root), and whoever can write there can change the daemon itself. The check
runs on every put (cold path) and every hit (warm path), on cores shared with the FUSE daemon, so its
speed is the warm path's: XXH3-64 runs at 58 GB/s on one core of the 2-core dev box, against 3.8 GB/s for
zlib.crc32 (format 2; perf put it at 16% of the daemon's CPU in a warm `cat`) and 0.85 GB/s for blake2b
(8 MiB buffers). It also takes a writable buffer, which the engine's recycled chunk buffers are.

Concurrency rules (callers are worker threads of the chunk engine):
- One `threading.Lock` guards the in-memory index, the counters and the namespace operations that
  must agree with the index: the final `os.replace` of a new file and the `os.unlink` of an evicted
  or corrupt one. Reading and writing chunk *data* (and checksumming it) happens outside the lock.
- Space accounting is read under that lock too: a put reserves its file size against max_bytes from
  its room check until its file is indexed (`_reserved`), and against free space only until its temp
  file is written (`_unwritten`); from then on statvfs shows those bytes. statvfs is read under the
  lock, so it and `_unwritten` describe the same moment and no put is counted twice (only the part
  of a temp file being written right now is, which errs on the side of free space).
- A put that finds no room only because of puts in flight (they become evictable once indexed) is
  skipped quietly, like one over max_bytes; ENOSPC is raised only when the disk lacks the room even
  if every put in flight landed and everything were evicted.
- A failed write starts an episode: one warning, then puts are skipped for retry_after_s. Only a put
  that passed the pause check after the episode began can end it; a put already past that check when
  the failure happened may still succeed, but says nothing about the disk now.
- Writes bypass the page cache (O_DIRECT) where the filesystem allows it: a put copies header + data
  into an aligned staging buffer (`_stages`, a free list under the lock; each buffer is used by one
  put at a time) and writes it in one call. Buffered writes cost 1.5-10x the CPU on the dev box (the
  page-cache copy, and first-touch faults of fresh pages under the VM) and double the memory a cold
  read takes (chunk-file pages beside the FUSE file's). The first EINVAL from O_DIRECT turns it off
  for this cache (one info line) and the put is redone buffered.
- Files are never modified in place: a chunk is written to `*.tmp` and renamed over its final name.
  So a reader that opened a file always sees one complete file; if eviction unlinks it meanwhile, Linux
  keeps the open inode readable. A reader that loses the race to the unlink gets ENOENT -> a miss.
- One process per cache directory: `root/lock` is held with flock(LOCK_EX|LOCK_NB) while open, and by
  `cache_clear` / `cache_verify`, so nothing deletes files under a live mount's index.

Layout: `root/lock` (holds the owner's pid), `root/chunks/<d[:2]>/<d>` where d = ChunkId.digest(). A chunk
file is its header, zero padding up to the next multiple of ALIGN, then the data (so the data can be
written, and read, with O_DIRECT).
LRU order lives in memory (OrderedDict, most recent last) and persists across restarts as file mtime:
put sets it, a hit refreshes it (at most once per TOUCH_INTERVAL_NS), open sorts by it.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Self

import xxhash

from .cache_level import ChunkId, WritableBuffer

log = logging.getLogger(__name__)

GiB = 1024**3

# A fixed floor of free space left to the rest of the node (logs, containers, other caches).
# Mountpoint-S3 keeps 5% free by default (doc/CONFIGURATION.md "Disk Cache Size"); a byte count does not
# scale with the disk, and callers wanting Mountpoint's rule pass bytes_for_fraction(root, 0.05).
# 4 GiB is a judgement call: room for several hundred 8 MiB chunks in flight plus log growth.
DEFAULT_MIN_FREE = 4 * GiB
# After a failed write, puts are skipped for this long before one is tried again. A full disk rarely frees
# within seconds; 30 s bounds the wasted attempts to 2 a minute and resumes within a minute of space
# freeing. A judgement call, not a measurement.
WRITE_RETRY_S = 30.0
# A hit rewrites the file's mtime (the persisted LRU stamp) only if it is older than this, so hot chunks
# do not dirty their inode on every read. Restart order is therefore exact to within a minute.
TOUCH_INTERVAL_NS = 60 * 1_000_000_000
# 2 hex chars -> 256 shard dirs. At 8 MiB chunks an 8 TB NVMe holds ~1M chunks, ~4k per dir, which
# ext4/xfs hashed directories handle well; one level keeps the open-time scan at 256 scandir calls.
SHARD_HEX_CHARS = 2
# First read of a file: the fixed prefix plus bucket/key/etag in one pread for S3's 1024-byte key limit.
HEADER_READ_BYTES = 4096
# Staging buffers kept for reuse: one per concurrent put (the chunk engine runs PUT_THREADS of them).
PUT_STAGES = 4

MAGIC = b"MFSCHUNK"
# 2: CRC-32 of the data in place of its sha256 (version 1). 3: XXH3-64 in place of CRC-32, and the data
# at an ALIGN boundary. A file of another version reads as corrupt: dropped and refetched, never misread.
FORMAT_VERSION = 3
# magic, version, reserved(0), len(bucket), len(key), len(etag), chunk_size, index, data length,
# xxh3_64(data); then bucket, key, etag as UTF-8 (surrogateescape, as ChunkId.digest encodes them); data.
_PREFIX = struct.Struct("<8sHHIIIQQQQ")
# Data offset alignment, and O_DIRECT's buffer/offset/length unit: 4096 satisfies every block device's
# logical block size and the page alignment some require of the buffer.
ALIGN = 4096

CHUNKS_DIR = "chunks"
LOCK_FILE = "lock"
TMP_SUFFIX = ".tmp"
_HEX = frozenset("0123456789abcdef")


class CacheDirBusy(Exception):
    """Another process (another modelfs mount, or a cache maintenance command) holds the cache dir."""


class _Corrupt(Exception):
    """A chunk file that is not a complete, checksummed copy of the expected chunk."""


@dataclasses.dataclass(slots=True)
class CacheStats:
    """Counters for metrics; updated under the cache lock. hits + misses = get calls (corrupt and
    read_errors are misses too, counted again on their own)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    read_errors: int = 0
    evictions: int = 0
    writes: int = 0
    write_errors: int = 0
    # while writes are paused after an error, a chunk larger than max_bytes, no room until puts in flight land
    writes_skipped: int = 0
    bytes_used: int = 0  # sum of file sizes (header + data) of indexed chunk files
    chunks: int = 0


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
        # monotonic time of the last failed write, None once the episode ends; one warning per episode
        self._write_failed_at: float | None = None
        self._write_episode = 0  # counts episodes, so a put knows whether it started inside this one
        self._corrupt_logged = False
        self._closed = False
        self._direct = True  # O_DIRECT writes, until the filesystem refuses them
        self._stages: list[mmap.mmap] = []  # free staging buffers (page-aligned anonymous maps)
        self.swept_tmp_files = 0

        os.makedirs(self.root, mode=0o700, exist_ok=True)
        os.chmod(self.root, 0o700)  # chunk data is private bucket content
        self._lock_fd = _acquire_dir_lock(self.root)
        try:
            for shard in range(16**SHARD_HEX_CHARS):
                os.makedirs(
                    os.path.join(self._chunks_dir, f"{shard:0{SHARD_HEX_CHARS}x}"), 0o700, exist_ok=True
                )
            self._rebuild_index()
            with self._lock:
                self._evict_locked(self.stats.bytes_used - self.max_bytes)  # max_bytes may have shrunk
        except BaseException:
            _release_dir_lock(self._lock_fd)
            raise

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _release_dir_lock(self._lock_fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _rebuild_index(self) -> None:
        started = time.perf_counter()
        found, self.swept_tmp_files = _scan_chunk_files(self._chunks_dir, sweep_tmp=True)
        found.sort()  # by mtime: least recently used first, as OrderedDict order expects
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

    def chunk_path(self, chunk: ChunkId) -> str:
        """Where the chunk's file lives (whether or not it is cached)."""
        return self._path(chunk.digest())

    @staticmethod
    def staging_bytes(chunk_size: int) -> int:
        """The most memory the staging buffers of puts hold (they live outside the chunk engine's
        budget, so the daemon's --memory-limit must leave room for them)."""
        return PUT_STAGES * _round_up(HEADER_READ_BYTES + chunk_size)

    def contains(self, chunk: ChunkId) -> bool:
        digest = chunk.digest()
        with self._lock:
            return not self._closed and digest in self._index

    def get(self, chunk: ChunkId, buffer: WritableBuffer | None = None) -> bytes | WritableBuffer | None:
        """The chunk's data, or None. Given a `buffer` of exactly the data's length, reads into it and
        returns it (on None its contents are undefined)."""
        digest = chunk.digest()
        with self._lock:
            if self._closed or digest not in self._index:
                self.stats.misses += 1
                return None
            self._index.move_to_end(digest)
        path = self._path(digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as err:
            self._read_failed(digest, err)
            return None
        try:
            st = os.fstat(fd)
            try:
                stored, data = _read_chunk_file(fd, st.st_size, buffer)
                if stored != chunk:
                    raise _Corrupt(f"header names {stored}")
            except _Corrupt as why:
                self._drop_corrupt(digest, path, st, str(why))
                return None
            # The bytes are about to sit in the engine's memory and the FUSE file's page cache; a third
            # copy in this file's page cache would only push other pages out.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if time.time_ns() - st.st_mtime_ns > TOUCH_INTERVAL_NS:
                try:
                    os.utime(fd)
                except OSError:
                    pass  # read-only fs: LRU order still right in memory, only the restart order ages
        except OSError as err:
            self._read_failed(digest, err)
            return None
        finally:
            os.close(fd)
        with self._lock:
            self.stats.hits += 1
        return data

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
        header = _encode_header(chunk, data)
        file_size = _data_offset(len(header)) + len(data)
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
                except OSError:
                    _unlink_quietly(tmp_path)
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
            self._write_failed(err)
        finally:
            with self._lock:
                self._writing.discard(digest)
                self._reserved -= reserved
                self._unwritten -= unwritten

    # -- internals -------------------------------------------------------------------------------

    def _path(self, digest: str) -> str:
        return os.path.join(self._chunks_dir, digest[:SHARD_HEX_CHARS], digest)

    def _make_room_locked(self, file_size: int) -> bool:
        """Evict LRU chunks so that the new file fits under max_bytes and leaves min_free_bytes free.
        False (nothing evicted, counted in writes_skipped) when even evicting everything indexed would
        not do but the puts in flight, once indexed and evictable, would; raises ENOSPC when not even
        they would, so the caller's one-warning path reports a disk filled by something else."""
        over_limit = self.stats.bytes_used + self._reserved + file_size - self.max_bytes
        # Read under the lock, as _unwritten is: a temp file is in statvfs or in _unwritten, not both.
        free = _free_bytes(self.root)
        short_of_free = self.min_free_bytes + self._unwritten + file_size - free
        if max(over_limit, short_of_free) <= self.stats.bytes_used:
            self._evict_locked(max(over_limit, short_of_free))
            return True
        # Room there would be if every put in flight landed and everything were evicted. _unwritten
        # drops out: a temp file being written may already be partly in statvfs, so this is an upper bound.
        if short_of_free - self._unwritten > self.stats.bytes_used + self._reserved:
            raise OSError(
                errno.ENOSPC,
                f"{free} bytes free, {self.min_free_bytes} must stay free, cache holds only "
                f"{self.stats.bytes_used} evictable bytes (+{self._reserved} being written) and a "
                f"{file_size}-byte chunk is waiting",
            )
        self.stats.writes_skipped += 1  # puts in flight hold the room, or all of max_bytes
        return False

    def _evict_locked(self, need: int) -> None:
        freed = 0
        while freed < need and self._index:
            digest, size = self._index.popitem(last=False)
            freed += size
            self.stats.bytes_used -= size
            self.stats.evictions += 1
            try:
                os.unlink(self._path(digest))
            except FileNotFoundError:
                pass
            except OSError as err:  # EROFS and the like: the file stays, rebuilt into the index next open
                log.debug("disk cache %s: evicting %s failed: %s", self.root, digest, err)
        self.stats.chunks = len(self._index)

    def _write_tmp(self, digest: str, header: bytes, data: bytes) -> str:
        """Write header, padding and data to a new temp file next to the chunk's final path. Once the file
        is whole, statvfs counts its bytes, so they leave _unwritten here (on failure the caller releases
        them)."""
        fd, tmp_path = tempfile.mkstemp(  # 0600, O_EXCL; same dir, so the rename is atomic
            prefix=digest[:16] + ".", suffix=TMP_SUFFIX, dir=os.path.dirname(self._path(digest))
        )
        try:
            if not (self._direct and self._write_direct(fd, tmp_path, header, data)):
                _write_all(fd, [header, bytes(_data_offset(len(header)) - len(header)), data])
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp_path)
            raise
        os.close(fd)  # no fsync: a torn file after a crash fails its checksum and is dropped on read
        with self._lock:
            self._unwritten -= _data_offset(len(header)) + len(data)
        return tmp_path

    def _write_direct(self, fd: int, tmp_path: str, header: bytes, data: bytes) -> bool:
        """Write the file through a second, O_DIRECT descriptor (`fd` is the buffered one); False
        (nothing written) if this filesystem does not take O_DIRECT, which also turns it off here."""
        offset = _data_offset(len(header))
        size = offset + len(data)
        padded = _round_up(size)
        stage = self._take_stage(padded)
        try:
            stage[: len(header)] = header
            stage[len(header) : offset] = bytes(offset - len(header))
            stage[offset:size] = data
            stage[size:padded] = bytes(padded - size)
            try:
                direct_fd = os.open(tmp_path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self._direct_refused(err)
                return False
            view = memoryview(stage)[:padded]
            try:
                try:
                    written = os.write(direct_fd, view)
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    self._direct_refused(err)
                    return False
                finally:
                    os.close(direct_fd)
                if written < padded:  # rare: the rest goes through the page cache, at its offset
                    _pwrite_all(fd, view[written:], written)
            finally:
                view.release()  # before the stage can be reused or closed
            if padded != size:
                os.ftruncate(fd, size)
            return True
        finally:
            self._give_stage(stage)

    def _take_stage(self, size: int) -> mmap.mmap:
        with self._lock:
            while self._stages:
                stage = self._stages.pop()
                if len(stage) >= size:
                    return stage
        return mmap.mmap(-1, max(size, ALIGN))

    def _give_stage(self, stage: mmap.mmap) -> None:
        with self._lock:
            if len(self._stages) < PUT_STAGES:
                self._stages.append(stage)
                return
        stage.close()

    def _direct_refused(self, err: OSError) -> None:
        if self._direct:
            self._direct = False
            log.info("disk cache %s: O_DIRECT not supported here (%s); writing through the page cache",
                     self.root, err)

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
            self.stats.misses += 1
            # ENOENT: evicted since we looked (then a re-put may already have brought it back, which the
            # lexists sees, since renames happen under this lock) or removed by someone else.
            if isinstance(err, FileNotFoundError):
                if os.path.lexists(self._path(digest)):
                    return
                size = self._index.pop(digest, None)
                if size is not None:
                    self.stats.bytes_used -= size
                    self.stats.chunks = len(self._index)
            else:
                self.stats.read_errors += 1
        if not isinstance(err, FileNotFoundError):
            log.debug("disk cache %s: reading %s failed: %s", self.root, digest, err)

    def _drop_corrupt(self, digest: str, path: str, read: os.stat_result, why: str) -> None:
        with self._lock:
            self.stats.misses += 1
            self.stats.corrupt += 1
            first = not self._corrupt_logged
            self._corrupt_logged = True
            try:
                now = os.stat(path)
                # A put may have replaced the bad file with a good one since we read it: keep that one.
                replaced = (now.st_ino, now.st_dev) != (read.st_ino, read.st_dev)
            except FileNotFoundError:
                replaced = False
            if not replaced:
                size = self._index.pop(digest, None)
                if size is not None:
                    self.stats.bytes_used -= size
                    self.stats.chunks = len(self._index)
                try:
                    os.unlink(path)
                except OSError:
                    pass  # gone already, or read-only fs: it is out of the index, so never read again
        (log.warning if first else log.debug)(
            "disk cache %s: dropped corrupt chunk file %s (%s)%s",
            self.root,
            path,
            why,
            "; further ones are logged at debug level and counted in stats.corrupt" if first else "",
        )


# -- file format ---------------------------------------------------------------------------------


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _round_up(n: int) -> int:
    """n rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def _data_offset(header_len: int) -> int:
    """Where a chunk file's data starts: the header rounded up to ALIGN."""
    return _round_up(header_len)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _checksum(data: bytes | WritableBuffer) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _encode_header(chunk: ChunkId, data: bytes) -> bytes:
    bucket, key, etag = _encode(chunk.bucket), _encode(chunk.key), _encode(chunk.etag)
    lengths = (len(bucket), len(key), len(etag))
    digest = _checksum(data)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, *lengths, chunk.chunk_size, chunk.index, len(data), digest)
    return b"".join((prefix, bucket, key, etag))


def _read_chunk_file(
    fd: int, file_size: int, buffer: WritableBuffer | None = None
) -> tuple[ChunkId, bytes | WritableBuffer]:
    """The chunk id named by the header and the data (read into `buffer` if it is the data's exact
    size), or _Corrupt unless both are whole and consistent."""
    head = os.pread(fd, min(file_size, HEADER_READ_BYTES), 0)
    if len(head) < _PREFIX.size:
        raise _Corrupt("truncated header")
    fields = _PREFIX.unpack_from(head)
    magic, version, reserved, n_bucket, n_key, n_etag, chunk_size, index, n_data, data_hash = fields
    if magic != MAGIC:
        raise _Corrupt("bad magic")
    if version != FORMAT_VERSION or reserved != 0:
        raise _Corrupt(f"format version {version}.{reserved}, expected {FORMAT_VERSION}.0")
    header_len = _PREFIX.size + n_bucket + n_key + n_etag
    data_offset = _data_offset(header_len)
    if data_offset + n_data != file_size:
        raise _Corrupt(f"file is {file_size} bytes, header says {data_offset} + {n_data}")
    if data_offset > len(head):  # a header longer than HEADER_READ_BYTES (long key or bucket)
        head = os.pread(fd, data_offset, 0)
        if len(head) != data_offset:
            raise _Corrupt("file shrank while reading")
    if head.count(0, header_len, data_offset) != data_offset - header_len:
        raise _Corrupt("padding after the header is not zero")
    bucket_end, key_end = _PREFIX.size + n_bucket, _PREFIX.size + n_bucket + n_key
    bucket, key, etag = head[_PREFIX.size : bucket_end], head[bucket_end:key_end], head[key_end:header_len]
    data: bytes | WritableBuffer
    if buffer is not None and len(buffer) == n_data:
        if os.preadv(fd, [buffer], data_offset) != n_data:
            raise _Corrupt("file shrank while reading")
        data = buffer
    else:
        data = os.pread(fd, n_data, data_offset) if n_data else b""
        if len(data) != n_data:
            raise _Corrupt("file shrank while reading")
    if _checksum(data) != data_hash:
        raise _Corrupt("data checksum mismatch")
    return ChunkId(_decode(bucket), _decode(key), _decode(etag), chunk_size, index), data


def _write_all(fd: int, parts: list[bytes]) -> None:
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        written = os.writev(fd, views)
        while written:
            if written >= len(views[0]):
                written -= len(views.pop(0))
            else:
                views[0] = views[0][written:]
                written = 0


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass  # a leftover *.tmp is swept at the next open


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _scan_chunk_files(chunks_dir: str, sweep_tmp: bool) -> tuple[list[tuple[int, str, int, str]], int]:
    """(mtime_ns, digest, size, path) of every chunk file, stat only, and the number of temp files
    removed. Names that are neither are left alone."""
    found: list[tuple[int, str, int, str]] = []
    swept = 0
    for shard in _scandir(chunks_dir):
        if len(shard.name) != SHARD_HEX_CHARS or not shard.is_dir(follow_symlinks=False):
            continue
        for entry in _scandir(shard.path):
            name = entry.name
            if name.endswith(TMP_SUFFIX):
                if sweep_tmp:  # left by a crash or kill mid-put; never renamed, so never indexed
                    try:
                        os.unlink(entry.path)
                        swept += 1
                    except FileNotFoundError:
                        pass
                continue
            if len(name) != 64 or not name.startswith(shard.name) or not _HEX.issuperset(name):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if entry.is_file(follow_symlinks=False):
                found.append((st.st_mtime_ns, name, st.st_size, entry.path))
    return found, swept


def _scandir(path: str) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            yield from entries
    except FileNotFoundError:
        return


# -- the directory lock --------------------------------------------------------------------------


def _acquire_dir_lock(root: str) -> int:
    path = os.path.join(root, LOCK_FILE)
    # Held through a read-only descriptor (flock ignores the mode): an open-for-write file would make
    # the filesystem refuse a remount read-only while we run.
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise CacheDirBusy(
            f"cache dir {root} is in use by another modelfs mount or cache command (pid {holder}); "
            f"a cache dir serves one mount at a time: unmount it or pass a different --cache-dir"
        ) from None
    try:
        with open(path, "w") as holder_file:  # only for the CacheDirBusy message of the next comer
            holder_file.write(f"{os.getpid()}\n")
    except OSError:
        pass
    return fd


def _release_dir_lock(fd: int) -> None:
    os.close(fd)  # closing the only descriptor of the open file drops the flock


# -- maintenance (modelfs cache stats|clear|verify DIR) ------------------------------------------


def cache_stats(root: str | os.PathLike[str]) -> dict[str, int | float | None]:
    """Counts from a stat-only scan; safe while a mount uses the dir. Access times are epoch seconds."""
    found, _ = _scan_chunk_files(os.path.join(os.fspath(root), CHUNKS_DIR), sweep_tmp=False)
    stamps = [mtime_ns for mtime_ns, _d, _s, _p in found]
    return {
        "chunks": len(found),
        "bytes": sum(size for _m, _d, size, _p in found),
        "oldest_access": min(stamps) / 1e9 if stamps else None,
        "newest_access": max(stamps) / 1e9 if stamps else None,
    }


def cache_clear(root: str | os.PathLike[str]) -> int:
    """Delete every chunk and temp file; the number removed. CacheDirBusy while a mount holds the dir."""
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root):
        return 0
    fd = _acquire_dir_lock(root)
    try:
        removed = 0
        for shard in _scandir(os.path.join(root, CHUNKS_DIR)):
            for entry in _scandir(shard.path):
                if entry.is_file(follow_symlinks=False):
                    os.unlink(entry.path)
                    removed += 1
        return removed
    finally:
        _release_dir_lock(fd)


def cache_verify(root: str | os.PathLike[str]) -> tuple[int, list[str]]:
    """Read and check every chunk file (header names the chunk its file name hashes, data checksum);
    delete the bad ones. (good count, bad paths). Takes the dir lock, as it deletes: CacheDirBusy."""
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root):
        return 0, []
    fd = _acquire_dir_lock(root)
    try:
        found, _ = _scan_chunk_files(os.path.join(root, CHUNKS_DIR), sweep_tmp=True)
        good, bad = 0, []
        for _mtime_ns, digest, _size, path in sorted(found, key=lambda f: f[3]):
            try:
                chunk_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    stored, _data = _read_chunk_file(chunk_fd, os.fstat(chunk_fd).st_size)
                finally:
                    os.close(chunk_fd)
                if stored.digest() != digest:
                    raise _Corrupt("header names another chunk")
                good += 1
            except (OSError, _Corrupt):
                bad.append(path)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        return good, bad
    finally:
        _release_dir_lock(fd)


def bytes_for_fraction(root: str | os.PathLike[str], fraction: float) -> int:
    """`--cache-size 80%`: that fraction of the total size of the filesystem that holds (or will hold)
    root. The nearest existing parent is measured when root does not exist yet."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"cache size fraction must be in (0, 1], got {fraction}")
    path = os.path.abspath(os.fspath(root))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return int(st.f_blocks * st.f_frsize * fraction)
