"""The on-disk form of one cached chunk: a header that names the chunk (bucket, key, ETag, chunk size,
index) and checksums its data, zero padding to the next ALIGN boundary, then the data (so the data can
be written, and read, with O_DIRECT). Reading a file checks all of it; anything else is `Corrupt`.

Why a fast non-cryptographic hash (XXH3-64) and not a cryptographic one: the check guards against
accidental damage only, and that is all it can meet here. Random damage (bit flips, zeroed or stale pages
from a crash, a torn write) passes with probability 2^-64; truncation and trailing bytes are caught first
by the data length in the header, which must match the file size; and the header binds the chunk id,
compared with the one asked for, so a whole valid file of another chunk is never served either. It is not
an adversarial setting: the directory is 0700 and its files 0600, owned by the daemon's user (root), and
whoever can write there can change the daemon itself. The check runs on every put (cold path) and every
hit (warm path), on cores shared with the FUSE daemon, so its speed is the warm path's: XXH3-64 runs at
58 GB/s on one core of the 2-core dev box, against 3.8 GB/s for zlib.crc32 and 0.85 GB/s for blake2b
(8 MiB buffers). It also takes a writable buffer, which the engine's recycled chunk buffers are.

Functions over file descriptors, and the writer that writes a file's bytes; no cache policy.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import struct
import threading
from collections.abc import Callable

import xxhash

from fsmount.data.identity import ChunkId, WritableBuffer

log = logging.getLogger(__name__)

MAGIC = b"MFSCHUNK"
# Version 1 checksummed the data with sha256, 2 with CRC-32; 3 uses XXH3-64 and puts the data at an
# ALIGN boundary. A file of another version reads as corrupt: dropped and refetched, never misread.
FORMAT_VERSION = 3
# magic, version, reserved(0), len(bucket), len(key), len(etag), chunk_size, index, data length,
# xxh3_64(data); then bucket, key, etag as UTF-8 (surrogateescape, as ChunkId.digest encodes them); data.
PREFIX = struct.Struct("<8sHHIIIQQQQ")
# Data offset alignment, and O_DIRECT's buffer/offset/length unit: 4096 satisfies every block device's
# logical block size and the page alignment some require of the buffer.
ALIGN = 4096
# First read of a file: the fixed prefix plus bucket/key/etag in one pread for S3's 1024-byte key limit.
HEADER_READ_BYTES = 4096


class Corrupt(Exception):
    """A chunk file that is not a complete, checksummed copy of the expected chunk."""


class OtherFormat(Corrupt):
    """A chunk file of another format version: written by another version of modelfs, not damaged. Unusable all
    the same, but not a sign of a failing disk (an upgraded node's whole cache is of the old format)."""


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def round_up(n: int) -> int:
    """n rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def data_offset(header_len: int) -> int:
    """Where a chunk file's data starts: the header rounded up to ALIGN."""
    return round_up(header_len)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def checksum(data: bytes | WritableBuffer) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _decode(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def encode_header(chunk: ChunkId, data: bytes | WritableBuffer) -> bytes:
    bucket, key, etag = _encode(chunk.bucket), _encode(chunk.key), _encode(chunk.etag)
    lengths = (len(bucket), len(key), len(etag))
    digest = checksum(data)
    prefix = PREFIX.pack(MAGIC, FORMAT_VERSION, 0, *lengths, chunk.chunk_size, chunk.index, len(data), digest)
    return b"".join((prefix, bucket, key, etag))


def read_chunk_file(
    fd: int, file_size: int, buffer: WritableBuffer | None = None
) -> tuple[ChunkId, bytes | WritableBuffer]:
    """The chunk id named by the header and the data (read into `buffer` if it is the data's exact
    size), or Corrupt unless both are whole and consistent."""

    def read_into(target: WritableBuffer, offset: int) -> int:
        return os.preadv(fd, [target], offset)

    return _parse(lambda n, offset: os.pread(fd, n, offset), read_into, file_size, buffer)


# Each reading thread's staging for O_DIRECT reads: the first ALIGN bytes of a file (its header) and the
# ALIGN-sized block holding the data's last bytes, which need not fill it.
_direct_stage = threading.local()


def read_chunk_direct(
    fd: int, file_size: int, buffer: WritableBuffer | None
) -> tuple[ChunkId, bytes | WritableBuffer] | None:
    """`read_chunk_file` for a descriptor opened with O_DIRECT, in one preadv straight into `buffer`
    (no page-cache copy); None, with nothing known of the file, where that does not apply: `buffer` is
    not a page-aligned mmap of exactly the data's length, the header does not fit the first ALIGN bytes
    (a key of several KiB), or the read came back short. The caller then reads the file without O_DIRECT;
    `buffer`'s contents are undefined either way unless the chunk is returned."""
    n_data = file_size - ALIGN
    if type(buffer) is not mmap.mmap or len(buffer) != n_data or n_data <= 0:
        return None
    stage = getattr(_direct_stage, "buffer", None)
    if stage is None:
        stage = _direct_stage.buffer = mmap.mmap(-1, 2 * ALIGN)
    whole = n_data - n_data % ALIGN
    views = [memoryview(stage)[:ALIGN], memoryview(buffer)[:whole]]
    if whole < n_data:
        views.append(memoryview(stage)[ALIGN:])
    try:
        got = os.preadv(fd, views, 0)
    finally:
        for view in views:
            view.release()
    if got != file_size:
        return None  # short: read it again through the page cache, whose checks say what is wrong
    fields = PREFIX.unpack_from(stage)
    if data_offset(PREFIX.size + fields[3] + fields[4] + fields[5]) != ALIGN:
        return None
    if whole < n_data:
        buffer[whole:] = stage[ALIGN : ALIGN + n_data - whole]

    def read_into(target: WritableBuffer, offset: int) -> int:
        return n_data  # read above, straight into `buffer`, which _parse passes here (header checked first)

    return _parse(lambda n, offset: stage[offset : min(offset + n, ALIGN)], read_into, file_size, buffer)


def read_chunk_stream(read: Callable[[int], bytes], readinto: Callable[[WritableBuffer], int], size: int,
                      buffer: WritableBuffer | None = None) -> tuple[ChunkId, bytes | WritableBuffer]:
    """`read_chunk_file` for a chunk file read once, front to back (the body of a GET of `size` bytes): the
    header is read first, then the data straight into `buffer` when it is the data's exact size."""
    head = bytearray()

    def pread(n: int, offset: int) -> bytes:
        end = min(offset + n, size)
        while len(head) < end:
            got = read(end - len(head))
            if not got:
                break
            head.extend(got)
        return bytes(head[offset:end])

    def read_into(target: WritableBuffer, offset: int) -> int:
        if offset != len(head):  # the header was read exactly up to the data (data_start is a read size)
            raise Corrupt("chunk data does not follow its header")
        return readinto(target)

    return _parse(pread, read_into, size, buffer)


def encode_chunk(chunk: ChunkId, data: bytes | WritableBuffer) -> list[bytes | WritableBuffer]:
    """The parts of a whole chunk file: header, zero padding, data."""
    header = encode_header(chunk, data)
    return [header, bytes(data_offset(len(header)) - len(header)), data]


def _parse(pread: Callable[[int, int], bytes], read_into: Callable[[WritableBuffer, int], int], size: int,
           buffer: WritableBuffer | None) -> tuple[ChunkId, bytes | WritableBuffer]:
    head = pread(min(size, HEADER_READ_BYTES), 0)
    if len(head) < PREFIX.size:
        raise Corrupt("truncated header")
    fields = PREFIX.unpack_from(head)
    magic, version, reserved, n_bucket, n_key, n_etag, chunk_size, index, n_data, data_hash = fields
    if magic != MAGIC:
        raise Corrupt("bad magic")
    if version != FORMAT_VERSION or reserved != 0:
        raise OtherFormat(f"format version {version}.{reserved}, expected {FORMAT_VERSION}.0")
    header_len = PREFIX.size + n_bucket + n_key + n_etag
    data_start = data_offset(header_len)
    if data_start + n_data != size:
        raise Corrupt(f"file is {size} bytes, header says {data_start} + {n_data}")
    if data_start > len(head):  # a header longer than HEADER_READ_BYTES (long key or bucket)
        head = pread(data_start, 0)
        if len(head) != data_start:
            raise Corrupt("file shrank while reading")
    if head.count(0, header_len, data_start) != data_start - header_len:
        raise Corrupt("padding after the header is not zero")
    bucket_end, key_end = PREFIX.size + n_bucket, PREFIX.size + n_bucket + n_key
    bucket, key, etag = head[PREFIX.size : bucket_end], head[bucket_end:key_end], head[key_end:header_len]
    data: bytes | WritableBuffer
    if buffer is not None and len(buffer) == n_data:
        if read_into(buffer, data_start) != n_data:
            raise Corrupt("file shrank while reading")
        data = buffer
    else:
        data = pread(n_data, data_start) if n_data else b""
        if len(data) != n_data:
            raise Corrupt("file shrank while reading")
    if checksum(data) != data_hash:
        raise Corrupt("data checksum mismatch")
    return ChunkId(_decode(bucket), _decode(key), _decode(etag), chunk_size, index), data


def write_all(fd: int, parts: list[bytes]) -> None:
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        written = os.writev(fd, views)
        while written:
            if written >= len(views[0]):
                written -= len(views.pop(0))
            else:
                views[0] = views[0][written:]
                written = 0

# Staging buffers kept for reuse: one per concurrent put (the level stack runs PUT_THREADS of them).
PUT_STAGES = 4


class ChunkFileWriter:
    """Writes a chunk file's bytes (header, padding, data) into a new file descriptor.

    Thread-safe. Writes bypass the page cache (O_DIRECT) where the filesystem allows it: a write copies
    header + data into an aligned staging buffer (`_stages`, a free list under `_lock`; each buffer is
    used by one write at a time) and writes it in one call. Buffered writes cost 1.5-10x the CPU on the
    dev box (the page-cache copy, and first-touch faults of fresh pages under the VM) and double the
    memory a cold read takes (chunk-file pages beside the FUSE file's). The first EINVAL from O_DIRECT
    turns it off for the directory (`direct`, one info line): the write is redone buffered, and the cache's
    reads, which ask `direct` too and report their own refusal here (`refuse_direct`), go buffered as well."""

    def __init__(self, where: str):
        self.where = where  # for the log line
        self._lock = threading.Lock()
        self._direct = True  # O_DIRECT writes and reads, until the filesystem refuses them
        self._stages: list[mmap.mmap] = []  # free staging buffers (page-aligned anonymous maps)

    @staticmethod
    def staging_bytes(chunk_size: int) -> int:
        """The most memory the staging buffers hold."""
        return PUT_STAGES * round_up(HEADER_READ_BYTES + chunk_size)

    def write(self, fd: int, path: str, header: bytes, data: bytes | WritableBuffer) -> None:
        """Write the whole file through `fd` (opened for writing at `path`, empty)."""
        if not (self._direct and self._write_direct(fd, path, header, data)):
            write_all(fd, [header, bytes(data_offset(len(header)) - len(header)), data])

    def _write_direct(self, fd: int, tmp_path: str, header: bytes, data: bytes | WritableBuffer) -> bool:
        """Write the file through a second, O_DIRECT descriptor (`fd` is the buffered one); False
        (nothing written) if this filesystem does not take O_DIRECT, which also turns it off here.
        Data in a page-aligned buffer of whole blocks (the engine's chunk buffers: anonymous mmaps) is
        written from where it is, after the header's own staged block(s): no copy into the stage (0.08-0.11
        user CPU-s per GiB on the dev box)."""
        offset = data_offset(len(header))
        size = offset + len(data)
        in_place = isinstance(data, mmap.mmap) and len(data) % ALIGN == 0
        padded = round_up(size)
        stage = self._take_stage(offset if in_place else padded)
        try:
            stage[: len(header)] = header
            stage[len(header) : offset] = bytes(offset - len(header))
            if in_place:
                padded = size
            else:
                stage[offset:size] = data
                stage[size:padded] = bytes(padded - size)
            try:
                direct_fd = os.open(tmp_path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self.refuse_direct(err)
                return False
            views = [memoryview(stage)[:offset], memoryview(data)] if in_place else [memoryview(stage)[:padded]]
            try:
                try:
                    written = os.pwritev(direct_fd, views, 0)
                except OSError as err:
                    if err.errno != errno.EINVAL:
                        raise
                    self.refuse_direct(err)
                    return False
                finally:
                    os.close(direct_fd)
                at = 0
                for view in views:  # rare: a short write; the rest goes through the page cache, at its offset
                    if written < at + len(view):
                        pwrite_all(fd, view[max(0, written - at):], max(written, at))
                    at += len(view)
            finally:
                for view in views:
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

    @property
    def direct(self) -> bool:
        """Whether chunk files of this directory are written and read with O_DIRECT."""
        return self._direct

    def refuse_direct(self, err: OSError) -> None:
        """The filesystem refused O_DIRECT (EINVAL): writes and reads go through the page cache from now on.
        Only ever turns off, so racing threads at worst each see a refusal; one line is logged."""
        if self._direct:
            self._direct = False
            log.info("disk cache %s: O_DIRECT not supported here (%s); chunk files are written and read through "
                     "the page cache", self.where, err)
