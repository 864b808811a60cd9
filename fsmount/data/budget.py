"""The chunk engine's memory: a byte-bounded LRU of chunks, reservations for fetches in flight, pins,
and the reuse of chunk buffers. It decides what stays in memory; it never fetches.

Rules (everything here runs in the trio thread; nothing awaits except `reserve`):
- Budget: `cached + reserved <= limit` holds at every checkpoint, but for `overdraw` (a cache read given up past
  its deadline, at most one chunk per fetch worker, until the read returns). A fetch reserves its chunk's bytes
  before it starts and `store`s the result before it `release`s the reservation (both are counted in
  between, which errs on the side of the budget). `reserve` evicts in LRU order; when nothing is
  evictable it has the reclaimers give back what they hold idle (`add_reclaimer`: the writes' recycled
  part buffers), and waits on `_changed` only if that freed nothing.
- In use: a chunk a reader is reading front to back, used less than IN_USE_S ago, is evicted for another
  chunk's fetch (`reserve(chunk=True)`) only when nothing else can be: that `reserve` waits for room
  meanwhile, at most until the oldest of them is IN_USE_S old. Other reservations evict it as any chunk.
  `_in_use[cid]` is a `_Use`: a chunk stored for a READ is in use until a READ says otherwise; one is read
  front to back once a READ began at its start (a sequential reader enters every chunk there; random reads,
  even with the kernel's read-ahead after them, almost never do); a READ that reaches the chunk's end, or a
  push to the page cache, drops the entry.
- Turns: chunk fetches that find no room get it in the order they asked for it (`_chunk_turns`), as a READ takes
  its chunks in offset order; one that fits without evicting anything takes it at once. Woken all at once, the
  latest often got it first: a READ of more chunks than memory holds had its later chunks, fetched and in use (a
  READ waits for them), hold the room its next one needed, for IN_USE_S each time (one 2 MiB O_DIRECT read in 4
  chunks of 64 KiB took 5 s with a healthy origin).
- Pins: a pinned chunk (`_pins[cid]` > 0) is not evicted until `unpin`. Only work that finishes on its
  own may pin (the write-through to the cache levels): a page-cache push may not, since it can wait
  for a READ that waits for room.
- Buffer reuse: a chunk read into a buffer of ours (an anonymous mmap; from the origin or a cache
  level) is tracked in `_served` until READs have taken as many bytes as it holds (or it was pushed to
  the page cache), then queued in `_spent`. A fetch that can use a buffer first takes one from a spent
  chunk (`take_spent_buffer`) once memory is more than SPENT_KEEP_SHARE full, or at once when a cache
  level can give the chunk back (`reuse_spent`, decided by the engine): the chunk leaves memory and
  its bytes move from `cached` to the fetch's reservation, so the budget is unchanged and nothing else
  is evicted. Failing that, a buffer
  that `reserve` evicts in LRU order is reused the same way. Only a buffer nothing else references is
  taken (sys.getrefcount: not a READ reply, a page-cache push, a waiter's fetch), so a buffer is never
  overwritten while anything can still read it.
- `_read_by_kernel`: chunks in memory that READs have taken bytes from. The kernel caches what a READ
  returned, so pushing such a chunk into the page cache would copy it there a second time.
- `_in_page_cache`: the last KERNEL_HELD_MAX chunks pushed to the page cache (`demote`), whose buffer
  was reused once spent, or that the kernel said it holds when asked (`held_by_kernel`): the page cache
  holds them (unless it dropped them since), so reading or streaming them ahead again would fetch them for
  nothing. A READ of one of them proves the kernel dropped some of it: then its file's entries go
  (`kernel_dropped`), and a model stream that runs again asks the kernel which chunks it still holds.
"""

from __future__ import annotations

import collections
import math
import mmap
import sys
from collections.abc import Callable

import trio

from fsmount.data.identity import Chunk, ChunkId

# Spent chunks (the kernel took all of their bytes, so the page cache holds them) stay in memory, a
# second copy that serves them again should the kernel drop them even while the origin is down, until
# this share of the budget is used; past it a fetch takes a spent chunk's buffer before a fresh one.
SPENT_KEEP_SHARE = 1 / 8
# Chunk ids remembered as held by the page cache: 4096 x 8 MiB chunks is 32 GiB of models.
KERNEL_HELD_MAX = 4096
# A chunk a reader is still taking READs from is not evicted for another's fetch until it has gone unused this
# long: 16 readers in 4 chunks of memory evicted each other's chunks between READs, every chunk was fetched up
# to 8 times, and READs failed at --read-timeout with a healthy origin. Waiting for room instead lets the
# readers take turns; the bound keeps a reader that stopped mid-chunk from holding its chunk.
IN_USE_S = 1.0


class _Use:
    """What READs did with a chunk in memory (see the module's rules): when it was last used, and whether a READ
    began at its start (None: no READ yet, for a chunk stored for one)."""

    __slots__ = ("at", "from_start")

    def __init__(self, at: float, from_start: bool | None):
        self.at, self.from_start = at, from_start

    @property
    def streaming(self) -> bool:
        return self.from_start is not False


class MemoryBudget:
    def __init__(self, limit: int):
        self.limit = limit
        self.cached = 0
        self.reserved = 0
        self.buffers_recycled = 0
        self.waiting = 0  # tasks in `reserve` waiting for room: holders of idle reservations should let go
        self._reclaimers: list[Callable[[], None]] = []
        self._chunks: collections.OrderedDict[ChunkId, Chunk] = collections.OrderedDict()
        self._pins: collections.Counter[ChunkId] = collections.Counter()
        self._served: dict[ChunkId, int] = {}  # level hits in reusable buffers: bytes READs took so far
        # Spent chunks in the order they were spent (an ordered set); a chunk that leaves memory leaves it too
        # (`_forget`): one fetched again under the same id is not spent.
        self._spent: collections.OrderedDict[ChunkId, None] = collections.OrderedDict()
        self._in_use: dict[ChunkId, _Use] = {}
        self._read_by_kernel: set[ChunkId] = set()
        self._in_page_cache: collections.OrderedDict[ChunkId, None] = collections.OrderedDict()
        self._changed = trio.Event()
        self._chunk_turns: collections.deque[object] = collections.deque()  # chunk fetches waiting for room, in order

    @property
    def used(self) -> int:
        return self.cached + self.reserved

    def reuse_spent(self, n: int) -> bool:
        """Whether a fetch of n bytes should take a spent chunk's buffer rather than a fresh one: once
        more than SPENT_KEEP_SHARE of the budget is used (see the module's rules)."""
        return self.used + n > self.limit * SPENT_KEEP_SHARE

    # -- the LRU -------------------------------------------------------------------------------

    def get(self, cid: ChunkId, length: int) -> Chunk | None:
        """The chunk's bytes if it is in memory at `length`; its place in the LRU order does not change. A chunk id
        names the ETag, not the object's size: one held at another length is another size's (a version pinned at a
        wrong size, a HEAD cut inside its Content-Length line, B209), and is not this version's to serve (B290)."""
        data = self._chunks.get(cid)
        return data if data is not None and len(data) == length else None

    def touch(self, cid: ChunkId, length: int) -> Chunk | None:
        """The chunk's bytes if it is in memory at `length` (as `get`), made the most recently used."""
        data = self._chunks.get(cid)
        if data is None or len(data) != length:
            return None
        self._chunks.move_to_end(cid)  # (its use, IN_USE_S, is noted when the READ is served: note_served)
        return data

    def store(self, cid: ChunkId, data: Chunk, demanded: bool = True) -> None:
        """Hold a fetched chunk (its fetch's reservation is released by the caller right after). A
        buffer of ours is tracked for reuse from here on. A chunk a READ waits for (`demanded`) is in use
        from here; one read ahead, once a READ touches it."""
        old = self._chunks.pop(cid, None)
        if old is not None:
            self.cached -= len(old)
            self._forget(cid)
        self._chunks[cid] = data
        self.cached += len(data)
        if demanded:
            self._in_use[cid] = _Use(trio.current_time(), None)
        if type(data) is mmap.mmap:
            self._served[cid] = 0

    def _forget(self, cid: ChunkId) -> None:
        """A chunk left memory: drop what was tracked about it."""
        self._served.pop(cid, None)
        self._spent.pop(cid, None)
        self._read_by_kernel.discard(cid)
        self._in_use.pop(cid, None)

    def _first_evictable(self, keep_in_use: bool = True) -> ChunkId | None:
        """The least recently used chunk that is neither pinned nor (with `keep_in_use`) in use (IN_USE_S)."""
        if not keep_in_use:
            return next((cid for cid in self._chunks if cid not in self._pins), None)
        now = trio.current_time()
        in_use = self._in_use
        for cid in self._chunks:
            if cid in self._pins:
                continue
            use = in_use.get(cid)
            if use is None or not use.streaming or use.at + IN_USE_S <= now:  # the same sum as _in_use_until's
                return cid
        return None

    def _in_use_until(self) -> float:
        """When the first chunk in use that is not pinned stops being in use (inf: none is)."""
        return min((use.at + IN_USE_S for cid, use in self._in_use.items() if use.streaming and cid not in self._pins),
                   default=math.inf)

    # -- reservations --------------------------------------------------------------------------

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def reserve(self, n: int, reuse: bool = False, chunk: bool = False) -> mmap.mmap | None:
        """Reserve n bytes, evicting in LRU order. With `reuse`, an evicted buffer of ours of n bytes that
        nothing else references is handed back for the new chunk instead of being freed. Only a `chunk`'s
        fetch waits for chunks in use (IN_USE_S): a larger reservation (a write part, a header's parse) would
        see the room it freed taken by chunk fetches that come in between, round after round, for as long as
        readers read. Chunk fetches take their turns in the order they came (see the module's rules)."""
        if not chunk or self.used + n <= self.limit:
            # Room now, nothing to evict: no turn to wait for. A chunk smaller than the head's (a small file, a last
            # chunk) fits where the head's does not, and waited for a write part's upload (the review).
            return await self._reserve(n, reuse, chunk)
        turn = object()
        self._chunk_turns.append(turn)
        try:
            while self._chunk_turns[0] is not turn:
                await self._changed.wait()
            return await self._reserve(n, reuse, chunk)
        finally:
            self._chunk_turns.remove(turn)
            if self._chunk_turns:
                self._signal()  # the next one's turn

    async def _reserve(self, n: int, reuse: bool, chunk: bool) -> mmap.mmap | None:
        while self.used + n > self.limit:
            cid = self._first_evictable(chunk)
            if cid is not None:
                data = self._chunks.pop(cid)
                self.cached -= len(data)
                self._forget(cid)
                # 2 references: `data` and getrefcount's argument (the LRU let go of it above).
                if reuse and type(data) is mmap.mmap and len(data) == n and sys.getrefcount(data) == 2:
                    self.reserved += n
                    self.buffers_recycled += 1
                    return data
                continue
            if self._reclaim():
                continue
            self.waiting += 1
            try:
                with trio.move_on_at(self._in_use_until() if chunk else math.inf):
                    await self._changed.wait()
            finally:
                self.waiting -= 1
        self.reserved += n
        return None

    def add_reclaimer(self, reclaim: Callable[[], None]) -> None:
        """`reclaim()` releases reservations its owner holds only to reuse them later (idle buffers): called,
        without awaiting, by a `reserve` that would otherwise wait for room."""
        self._reclaimers.append(reclaim)

    def _reclaim(self) -> bool:
        """Whether the reclaimers gave reservations back."""
        before = self.reserved
        for reclaim in self._reclaimers:
            reclaim()
        return self.reserved < before

    def take_spent_buffer(self, length: int) -> mmap.mmap | None:
        """The buffer of a spent chunk, taken out of memory with its bytes moved from `cached` to
        `reserved` (the caller's reservation), or None."""
        for _ in range(len(self._spent)):
            cid = next(iter(self._spent))
            data = self._chunks.get(cid)  # in memory: leaving it, a chunk leaves `_spent` too (`_forget`)
            if type(data) is not mmap.mmap or len(data) != length:
                del self._spent[cid]
                continue
            if cid in self._pins:
                self._spent.move_to_end(cid)
                continue
            # 3 references: the LRU's, `data`, getrefcount's argument. Any other holder (a reply being
            # written, a push, a stale queue entry of its fetch) may still read it: try it again later.
            if sys.getrefcount(data) > 3:
                self._spent.move_to_end(cid)
                continue
            del self._chunks[cid]
            self.cached -= length
            self.reserved += length
            self._forget(cid)
            self.buffers_recycled += 1
            self.held_by_kernel(cid)
            return data
        return None

    def release(self, n: int) -> None:
        self.reserved -= n
        self._signal()

    def overdraw(self, n: int) -> None:
        """Count n bytes held now, without waiting for room: memory a thread writes into after its caller gave it
        up (a cache read past its deadline, levels.py), which exists whether or not there is room. `reserve`
        evicts or waits until the budget holds again; waiting here instead could wait forever, for room that only
        the waiters themselves would free (every fetch in flight giving up at once in a full budget)."""
        self.reserved += n

    # -- pins ----------------------------------------------------------------------------------

    def pin(self, cid: ChunkId) -> bool:
        """Keep an in-memory chunk from eviction until `unpin`; False (nothing pinned) if it is not in
        memory, in which case the caller must not hold on to its bytes."""
        if cid not in self._chunks:
            return False
        self._pins[cid] += 1
        return True

    @property
    def pinned(self) -> int:
        """Chunks pinned (waiting for their write-through)."""
        return len(self._pins)

    def unpin(self, cid: ChunkId) -> None:
        self._pins[cid] -= 1
        if self._pins[cid] <= 0:
            del self._pins[cid]
            self._signal()

    # -- what READs and the page cache took ----------------------------------------------------

    def note_served(self, cid: ChunkId, lo: int, hi: int, total: int, kernel_caches: bool = True) -> None:
        """A READ took bytes [lo, hi) of the chunk (of `total`); a reusable buffer wholly taken is spent. Not
        `kernel_caches` (an O_DIRECT READ): the page cache holds none of it, so the chunk is not counted as read
        by the kernel, nor spent (a spent chunk whose buffer is taken is believed held by the page cache)."""
        if cid in self._chunks:
            if kernel_caches:
                self._read_by_kernel.add(cid)
            self._note_use(cid, lo, hi, total)
        if not kernel_caches:
            return
        served = self._served.get(cid)
        if served is None:
            return
        if served + hi - lo >= total:
            del self._served[cid]
            self._spent[cid] = None
        else:
            self._served[cid] = served + hi - lo

    def _note_use(self, cid: ChunkId, lo: int, hi: int, total: int) -> None:
        """Whether the chunk stays in use after a READ of [lo, hi) (the module's rules)."""
        use = self._in_use.get(cid)
        was = use is not None and use.streaming
        if hi >= total:
            self._in_use.pop(cid, None)
            now_streaming = False
        elif use is None:
            self._in_use[cid] = _Use(trio.current_time(), lo == 0)
            now_streaming = lo == 0
        else:
            use.at, use.from_start = trio.current_time(), lo == 0 or bool(use.from_start)
            now_streaming = use.from_start
        if was and not now_streaming:
            self._signal()  # a reserve waiting for room may take it now

    def in_page_cache(self, cid: ChunkId) -> bool:
        """True if the kernel took all of the chunk: it was pushed, or READs took all of it and its buffer
        was reused (unless the kernel dropped it since; a READ then fetches it)."""
        return cid in self._in_page_cache

    def held_by_kernel(self, cid: ChunkId) -> None:
        """The page cache holds all of the chunk (pushed, read whole, or seen there: residency.py)."""
        self._in_page_cache[cid] = None
        self._in_page_cache.move_to_end(cid)
        if len(self._in_page_cache) > KERNEL_HELD_MAX:
            self._in_page_cache.popitem(last=False)

    def kernel_dropped(self, cid: ChunkId) -> bool:
        """A READ came for bytes of `cid`, so the kernel does not hold them. If it was believed to (pushed, or
        read whole), it dropped them since (evicted them, or the page cache was dropped), and with them, most
        likely, the rest of that file, whose pages aged together: every chunk of that object version believed
        held is forgotten, so that read-ahead and model streaming fetch them again. True if there was a belief.
        (Believed held wrongly, a chunk the kernel still has is at most fetched once more for nothing.)"""
        if cid not in self._in_page_cache:
            return False
        same = (cid.bucket, cid.key, cid.etag, cid.chunk_size)
        for held in [c for c in self._in_page_cache if (c.bucket, c.key, c.etag, c.chunk_size) == same]:
            del self._in_page_cache[held]
        return True

    def read_by_kernel(self, cid: ChunkId) -> bool:
        """True if READs have already taken bytes of this (in-memory) chunk."""
        return cid in self._read_by_kernel

    def demote(self, cid: ChunkId) -> None:
        """Make a chunk the first to be evicted, and its buffer free to reuse: the kernel page cache
        holds it (it was pushed there)."""
        self.held_by_kernel(cid)
        if self._in_use.pop(cid, None) is not None:
            self._signal()
        if cid in self._chunks:
            self._chunks.move_to_end(cid, last=False)
            if self._served.pop(cid, None) is not None:
                self._spent[cid] = None
