"""The narrow interface every chunk-cache level implements, the chunk id that keys it, and the object
version a chunk belongs to.

A level (memory, local NVMe, later a fleet-shared bucket) only stores and returns whole chunks by
`ChunkId`; it never talks to the origin and never decides what to fetch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
from typing import Protocol

# A buffer the engine hands a level to read a chunk into (it recycles its chunk buffers: anonymous mmaps).
WritableBuffer = mmap.mmap


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


class ChunkCache(Protocol):
    """get / put / contains by chunk id. Implementations are thread-safe and blocking: the chunk
    engine calls them from worker threads, never from the trio thread."""

    def get(self, chunk: ChunkId, buffer: WritableBuffer | None = None) -> bytes | WritableBuffer | None:
        """The chunk's bytes, or None if absent or unreadable (never wrong bytes). `buffer`, if given, is
        the chunk's exact length and the level's to fill and return instead of new bytes (the engine
        recycles buffers); a level may ignore it."""
        ...

    def put(self, chunk: ChunkId, data: bytes | WritableBuffer) -> None:
        """Store a chunk; failures (full disk, read-only dir) are absorbed and logged, not raised."""
        ...
