"""What names a chunk of object data: the object version a handle pins, the chunk id every cache level
is keyed by, and the in-memory forms a chunk's bytes take.

Plain values only (and the allocation of a chunk buffer): nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap

# A buffer the engine hands a level to read a chunk into (it recycles its chunk buffers: anonymous mmaps).
WritableBuffer = mmap.mmap

# A chunk's bytes in memory: bytes from the origin, a (recyclable) anonymous mmap from a cache level.
# Recyclable because a fresh 8 MiB buffer costs 2048 page faults and zeroing: 0.41 against 0.16 CPU-s
# per 800 MiB read into a reused one on the dev box. An mmap rather than a bytearray: a new one is not
# zero-filled by a pass of its own, and it is freed (munmap) at once when dropped.
Chunk = bytes | WritableBuffer


def new_buffer(length: int) -> WritableBuffer:
    """A fresh chunk buffer: an anonymous mmap. Its pages are faulted in (and zeroed) by the read that
    fills it, 2048 faults per 8 MiB: ~0.4 CPU-s per GB read into fresh buffers against recycled ones,
    which is why the engine recycles them (budget.py). Transparent huge pages (MADV_HUGEPAGE) cut the
    faults to 4 per chunk but made the first cold read after a page-cache drop stall in compaction
    (2.4 against 0.6 sys CPU-s for 1 GiB, measured), so they are not asked for."""
    return mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectVersion:
    """What an open handle pins: one version of one object."""

    key: str
    etag: str
    size: int


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkId:
    """One fixed-size piece of one version of one object.

    `etag` pins the object version, so a chunk id never names two different byte strings.
    `chunk_size` is part of the id because the same index means different bytes at another size.
    """

    bucket: str
    key: str
    etag: str
    chunk_size: int
    index: int

    @property
    def offset(self) -> int:
        return self.index * self.chunk_size

    def digest(self) -> str:
        """A stable hex name for the chunk, safe to use as a file name (no key text in it)."""
        h = hashlib.sha256()
        for part in (self.bucket, self.key, self.etag, str(self.chunk_size), str(self.index)):
            data = part.encode("utf-8", "surrogateescape")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()
