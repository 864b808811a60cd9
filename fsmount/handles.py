"""Open files: each FUSE file handle pins one object version and drives read-ahead for it.

A handle turns the read-ahead plan into chunk requests and serves READs from the chunk engine.
It never talks to the store directly and never changes the version it pinned at open (a rewrite through the
mount gives its descriptor a new OpenFile: operations.Operations._rewritten).
"""

from __future__ import annotations

from fsmount.data import ChunkEngine, ObjectVersion
from fsmount.readahead import ReadAhead


class OpenFile:
    def __init__(self, fh: int, ino: int, version: ObjectVersion, engine: ChunkEngine, max_readahead: int,
                 direct: bool = False, kernel_window: int = 0, streamed: bool = True):
        self.fh = fh
        # Counted by the model streamer (ModelStreamer.opened/closed): not when the daemon itself opened it to ask the
        # page cache (residency.py), nor after a rewrite through the mount gave it the new version.
        self.streamed = streamed
        self.ino = ino
        self.version = version
        self.direct = direct  # opened with O_DIRECT: its READs bypass the page cache and say nothing of it
        self._engine = engine
        # Read ahead only of a reader proven sequential beyond what the kernel itself reads around and ahead
        # (readahead.py); an O_DIRECT handle's READs are the reader's own, so one chunk proves it.
        self.readahead = ReadAhead(engine.chunk_size, max_readahead,
                                   proven_after=engine.chunk_size if direct else kernel_window)

    async def read(self, offset: int, size: int, window_cap: int | None = None) -> bytes | memoryview:
        obj = self.version
        end = min(offset + size, obj.size)
        if offset >= end:
            return b""
        engine = self._engine
        plan = self.readahead.on_read(offset, end - offset, obj.size, window_cap,
                                      lambda at: engine.held_locally(obj, at // engine.chunk_size))
        for stream in plan.dropped:
            engine.abandon(stream)
        # Demand chunks are queued before the read-ahead ones so they are fetched first.
        parts = engine.request(obj, offset, end)
        kernel_caches = not self.direct  # O_DIRECT READs leave nothing in the page cache
        for index in engine.chunk_range(obj, plan.ahead_start, plan.ahead_end):
            engine.read_ahead(obj, index, plan.stream, kernel_caches)
        return await engine.collect(parts, offset, end, kernel_caches=kernel_caches)

    def close(self) -> None:
        for stream in self.readahead.close():
            self._engine.abandon(stream)
