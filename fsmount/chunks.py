"""The chunk engine: every byte of object data passes through here as fixed-size chunks.

A chunk is looked up in memory (byte-bounded LRU), then in the cache levels below (NVMe, later a
fleet-shared bucket), then fetched from the origin with a ranged GET pinned to the ETag. One fetch
per chunk at a time (single-flight); a fixed pool of worker tasks runs fetches in priority order
(demand reads before read-ahead). It never decides *what* to read ahead; handles do that.

Concurrency rules (everything below runs in the trio thread unless it says "in a thread"):
- `_inflight[cid]` is the one pending `_Fetch` for a chunk; it is removed only by the worker that
  finished it (or dropped it) and only if it is still the registered one. A demanded fetch that
  failed at its deadline stays registered (done, with its error) until RETRY_GRACE_S after it.
- `_queue` (a heap) and `_queued` (a Semaphore) move together: every heap push releases the
  semaphore once, so a worker that acquired it always finds an entry to pop. A priority upgrade
  pushes a new entry and empties the old one (`_QueueEntry.fetch = None`), so an entry left in the
  heap never keeps a finished fetch's bytes alive outside the memory budget.
- Memory budget: `_cached_bytes + _reserved_bytes <= memory_limit` holds at every checkpoint. A
  worker reserves a chunk's bytes before fetching and converts the reservation into cached bytes
  when it stores the result; it waits on `_budget_changed` when nothing is evictable.
- Pins: a chunk whose write-through to the cache levels is pending is pinned (`_pins[cid]` > 0) and
  not evicted until it is written, so the bytes the write holds stay counted in `_cached_bytes`, and a
  cache level slower than the origin makes fetches wait for room instead of piling chunks up outside
  the budget. Only work that finishes on its own may pin: a page-cache push may not, since it can wait
  for a READ that waits for room.
- Buffer recycling (cache-level hits only): a chunk read from a level into a buffer of ours (an
  anonymous mmap) is tracked in `_served` until READs have taken as many bytes as it holds (or it was
  pushed to the page cache), then queued in `_spent`. A fetch that can use a buffer first takes one
  from a spent chunk (`_recycled_buffer`): the chunk leaves `_memory` and its bytes move from
  `_cached_bytes` to the fetch's reservation, so the budget is unchanged and nothing else is evicted.
  Failing that, a buffer that `_reserve` evicts in LRU order is reused the same way.
  Only a buffer nothing else references is taken (sys.getrefcount: not a READ reply, a page-cache
  push, a waiter's `_Fetch`), so a buffer is never overwritten while anything can still read it.
- Cache levels and the store are blocking: they run in threads under their own CapacityLimiters.
- `_writes_pending` counts write-through tasks started and not finished; `_writes_changed` is set
  (and replaced) whenever it drops, so `drain_writes` can wait for it at unmount.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import logging
import mmap
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from fsmount.cache_level import ChunkCache, ChunkId, ObjectVersion, WritableBuffer
from fsmount.store import ObjectStore, StoreError, Unreachable

log = logging.getLogger(__name__)

DEMAND = 0
PREFETCH = 1
BACKGROUND = 2  # warming files nobody has opened yet (other shards of a model)
# Threads for cache-level I/O (NVMe reads, write-through); separate from the S3 connections.
DISK_THREADS = 8
# Write-through needs little parallelism (a chunk write is one large sequential write) and every extra
# writer thread competes with the read path for the GIL and the CPU; on the 2-core bench bed 1-2
# writers were no slower than 8 for a cold read with --cache-dir (noisy: 144-267 MB/s either way).
PUT_THREADS = 2
# A READ that joins a fetch whose deadline passed less than this long ago fails at once: it is the
# kernel re-sending the READ that just failed (same read(2)), which must not wait a second timeout.
# A READ arriving later is a new attempt by the application: it gets a new fetch and a new deadline,
# instead of inheriting the old fetch's retry chain (botocore's throttling backoff alone reaches 8 s).
RETRY_GRACE_S = 1.0
# A demanded fetch whose origin refuses connections (a server restarting) tries again after this long,
# doubling up to the maximum, until its deadline: an outage shorter than --read-timeout costs time only.
UNREACHABLE_RETRY_S = 0.25
UNREACHABLE_RETRY_MAX_S = 4.0

# A chunk's bytes in memory: bytes from the origin, a (recyclable) anonymous mmap from a cache level.
# Recyclable because a fresh 8 MiB buffer costs 2048 page faults and zeroing: 0.41 against 0.16 CPU-s
# per 800 MiB read into a reused one on the dev box. An mmap rather than a bytearray: a new one is not
# zero-filled by a pass of its own, and it is freed (munmap) at once when dropped.
Chunk = bytes | WritableBuffer

# How blocking calls run: in a worker thread under a limiter. Tests substitute a virtual-time fake.
RunBlocking = Callable[..., Awaitable[Any]]


async def run_in_thread(fn: Callable[..., Any], *args: Any, limiter: trio.CapacityLimiter) -> Any:
    # Abandoned on cancel (unmount): a GET stalled in the kernel must not hold the daemon's exit
    # for its retries; the thread ends on its own socket timeout.
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=True)


class ReadTimeout(StoreError):
    """A READ waited longer than --read-timeout for its chunk."""


@dataclasses.dataclass
class EngineStats:
    """Plain counters; updated only in the trio thread (no await between read and write)."""

    bytes_served_memory: int = 0
    bytes_served_level: int = 0
    bytes_served_origin: int = 0
    origin_requests: int = 0
    origin_bytes: int = 0
    origin_errors: int = 0
    level_hits: int = 0
    prefetch_dropped: int = 0
    fetches_inflight: int = 0
    buffers_recycled: int = 0


class _QueueEntry:
    __slots__ = ("priority", "seq", "fetch")

    def __init__(self, priority: int, seq: int, fetch: _Fetch):
        self.priority, self.seq = priority, seq
        self.fetch: _Fetch | None = fetch

    def __lt__(self, other: _QueueEntry) -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)


class _Fetch:
    __slots__ = ("cid", "length", "done", "data", "error", "owners", "demanded", "started",
                 "abandoned", "source", "deadline", "entry")

    def __init__(self, cid: ChunkId, length: int):
        self.cid = cid
        self.length = length
        self.done = trio.Event()
        self.data: Chunk | None = None
        self.error: BaseException | None = None
        self.owners: set[object] = set()
        self.demanded = False
        self.started = False
        # Dropped before it started (nobody wants it), or superseded after its deadline passed; either
        # way no longer the chunk's registered fetch for new readers.
        self.abandoned = False
        self.source = ""
        # Set at the first demand read: every READ waiting for this fetch gives up at the same
        # time, so the kernel's retry of a failed READ does not wait a second full timeout.
        self.deadline = float("inf")
        self.entry: _QueueEntry | None = None  # its place in the queue, until a worker takes it


class ChunkEngine:
    def __init__(self, store: ObjectStore, *, chunk_size: int, memory_limit: int, max_connections: int,
                 read_timeout: float, levels: Sequence[ChunkCache] = (), run_blocking: RunBlocking = run_in_thread):
        self.store = store
        self.chunk_size = chunk_size
        self.memory_limit = memory_limit
        self.read_timeout = read_timeout
        self.levels = list(levels)
        self.stats = EngineStats()
        self._run_blocking = run_blocking
        self._workers = max_connections
        self._s3_limiter = trio.CapacityLimiter(max_connections)
        self._disk_limiter = trio.CapacityLimiter(DISK_THREADS)
        self._put_limiter = trio.CapacityLimiter(PUT_THREADS)
        self._memory: collections.OrderedDict[ChunkId, Chunk] = collections.OrderedDict()
        self._cached_bytes = 0
        self._reserved_bytes = 0
        self._served: dict[ChunkId, int] = {}  # level hits in recyclable buffers: bytes READs took so far
        # Chunks in _memory that READs have taken bytes from: the kernel caches what a READ returned, so
        # pushing such a chunk into the page cache would copy it there a second time.
        self._read_by_kernel: set[ChunkId] = set()
        self._spent: collections.deque[ChunkId] = collections.deque()
        self._pins: collections.Counter[ChunkId] = collections.Counter()
        self._budget_changed = trio.Event()
        self._inflight: dict[ChunkId, _Fetch] = {}
        self._queue: list[_QueueEntry] = []
        self._queued = trio.Semaphore(0)
        self._seq = itertools.count()
        self._nursery: trio.Nursery | None = None
        self._writes_pending = 0
        self._writes_changed = trio.Event()

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the fetch workers until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for _ in range(self._workers):
                nursery.start_soon(self._worker)
            task_status.started()

    # -- memory --------------------------------------------------------------------------------

    @property
    def memory_used(self) -> int:
        return self._cached_bytes + self._reserved_bytes

    def _signal_budget(self) -> None:
        self._budget_changed.set()
        self._budget_changed = trio.Event()

    async def _reserve(self, n: int, reuse: bool = False) -> mmap.mmap | None:
        """Reserve n bytes, evicting in LRU order. With `reuse`, an evicted buffer of ours of n bytes that
        nothing else references is handed back for the new chunk instead of being freed."""
        while self.memory_used + n > self.memory_limit:
            cid = self._first_evictable()
            if cid is not None:
                data = self._memory.pop(cid)
                self._cached_bytes -= len(data)
                self._forget(cid)
                # 2 references: `data` and getrefcount's argument (_memory let go of it above).
                if reuse and type(data) is mmap.mmap and len(data) == n and sys.getrefcount(data) == 2:
                    self._reserved_bytes += n
                    self.stats.buffers_recycled += 1
                    return data
                continue
            await self._budget_changed.wait()
        self._reserved_bytes += n
        return None

    def _first_evictable(self) -> ChunkId | None:
        """The least recently used chunk that is not pinned."""
        if not self._pins:
            return next(iter(self._memory), None)
        return next((cid for cid in self._memory if cid not in self._pins), None)

    def pin(self, cid: ChunkId) -> bool:
        """Keep an in-memory chunk from eviction until `unpin`; False (nothing pinned) if it is not in
        memory, in which case the caller must not hold on to its bytes."""
        if cid not in self._memory:
            return False
        self._pins[cid] += 1
        return True

    def unpin(self, cid: ChunkId) -> None:
        self._pins[cid] -= 1
        if self._pins[cid] <= 0:
            del self._pins[cid]
            self._signal_budget()

    def _recycled_buffer(self, length: int) -> mmap.mmap | None:
        """The buffer of a spent chunk, taken out of `_memory` and `_cached_bytes` (the caller counts it
        as reserved), or None."""
        for _ in range(len(self._spent)):
            cid = self._spent.popleft()
            data = self._memory.get(cid)
            if type(data) is not mmap.mmap or len(data) != length:
                continue  # evicted (or replaced) since it was spent
            if cid in self._pins:
                self._spent.append(cid)
                continue
            # 3 references: _memory's, `data`, getrefcount's argument. Any other holder (a reply being
            # written, a push, a stale queue entry of its fetch) may still read it: try it again later.
            if sys.getrefcount(data) > 3:
                self._spent.append(cid)
                continue
            del self._memory[cid]
            self._cached_bytes -= length
            self._forget(cid)
            self.stats.buffers_recycled += 1
            return data
        return None

    def _forget(self, cid: ChunkId) -> None:
        """A chunk left _memory: drop what was tracked about it."""
        self._served.pop(cid, None)
        self._read_by_kernel.discard(cid)

    def read_by_kernel(self, cid: ChunkId) -> bool:
        """True if READs have already taken bytes of this (in-memory) chunk."""
        return cid in self._read_by_kernel

    def _note_served(self, cid: ChunkId, nbytes: int, total: int) -> None:
        if cid in self._memory:
            self._read_by_kernel.add(cid)
        served = self._served.get(cid)
        if served is None:
            return
        if served + nbytes >= total:
            del self._served[cid]
            self._spent.append(cid)
        else:
            self._served[cid] = served + nbytes

    def _release(self, n: int) -> None:
        self._reserved_bytes -= n
        self._signal_budget()

    # -- ids -----------------------------------------------------------------------------------

    def chunk_id(self, obj: ObjectVersion, index: int) -> ChunkId:
        return ChunkId(self.store.bucket, obj.key, obj.etag, self.chunk_size, index)

    def chunk_length(self, obj: ObjectVersion, index: int) -> int:
        return max(0, min(self.chunk_size, obj.size - index * self.chunk_size))

    def chunk_range(self, obj: ObjectVersion, start: int, end: int) -> range:
        """Indices of the chunks covering bytes [start, end) of obj."""
        end = min(end, obj.size)
        if end <= start:
            return range(0)
        return range(start // self.chunk_size, (end - 1) // self.chunk_size + 1)

    # -- requests ------------------------------------------------------------------------------

    def _enqueue(self, fetch: _Fetch, priority: int) -> None:
        if fetch.entry is not None:
            fetch.entry.fetch = None  # upgraded: the old entry is skipped, and holds nothing meanwhile
        fetch.entry = _QueueEntry(priority, next(self._seq), fetch)
        heapq.heappush(self._queue, fetch.entry)
        self._queued.release()

    def _fetch_for(self, cid: ChunkId, length: int, priority: int) -> _Fetch:
        fetch = self._inflight.get(cid)
        if fetch is not None and fetch.demanded and trio.current_time() > fetch.deadline + RETRY_GRACE_S:
            # Timed out a while ago and still retrying: leave it to finish in its worker (its bytes
            # still land in memory if it succeeds) and register a fresh fetch for this chunk.
            fetch.abandoned = True
        if fetch is None or fetch.abandoned:
            fetch = self._inflight[cid] = _Fetch(cid, length)
            self._enqueue(fetch, priority)
        elif priority == DEMAND and not fetch.demanded and not fetch.started:
            self._enqueue(fetch, DEMAND)  # jump the read-ahead queue; the older entry is skipped
        return fetch

    def prefetch(self, obj: ObjectVersion, index: int, owner: object) -> None:
        """Ask for a chunk ahead of need; `owner` may later `abandon` it."""
        cid = self.chunk_id(obj, index)
        if cid in self._memory:
            return
        fetch = self._fetch_for(cid, self.chunk_length(obj, index), PREFETCH)
        fetch.owners.add(owner)

    def fetch(self, obj: ObjectVersion, index: int, owner: object, priority: int = PREFETCH) -> _Fetch | Chunk:
        """Like `prefetch`, but hands back the chunk (if in memory) or its fetch to await."""
        cid = self.chunk_id(obj, index)
        data = self._memory.get(cid)
        if data is not None:
            return data
        fetch = self._fetch_for(cid, self.chunk_length(obj, index), priority)
        fetch.owners.add(owner)
        return fetch

    def in_memory(self, cid: ChunkId) -> Chunk | None:
        """The chunk's bytes if it is in memory; its place in the LRU order does not change."""
        return self._memory.get(cid)

    def demote(self, cid: ChunkId) -> None:
        """Make a chunk the first to be evicted, and its buffer free to recycle: the kernel page cache
        holds it (it was pushed there)."""
        if cid in self._memory:
            self._memory.move_to_end(cid, last=False)
            if self._served.pop(cid, None) is not None:
                self._spent.append(cid)

    def abandon(self, owner: object) -> None:
        """`owner` no longer needs its read-ahead; queued fetches nobody else wants are dropped."""
        for fetch in list(self._inflight.values()):
            if owner in fetch.owners:
                fetch.owners.discard(owner)
                if not fetch.owners and not fetch.demanded and not fetch.started:
                    fetch.abandoned = True

    def request(self, obj: ObjectVersion, start: int, end: int) -> list[tuple[ChunkId, _Fetch | Chunk]]:
        """Start (or join) the fetches covering [start, end) at demand priority; no await."""
        parts: list[tuple[ChunkId, _Fetch | Chunk]] = []
        for index in self.chunk_range(obj, start, end):
            cid = self.chunk_id(obj, index)
            data = self._memory.get(cid)
            if data is not None:
                self._memory.move_to_end(cid)
                parts.append((cid, data))
                continue
            fetch = self._fetch_for(cid, self.chunk_length(obj, index), DEMAND)
            if not fetch.demanded:
                fetch.demanded = True
                fetch.deadline = trio.current_time() + self.read_timeout
            parts.append((cid, fetch))
        return parts

    async def collect(self, parts: list[tuple[ChunkId, _Fetch | Chunk]], start: int, end: int) -> bytes | memoryview:
        """Wait for the parts of `request` and cut bytes [start, end) out of them. A read within one
        chunk is a zero-copy view of it (pyfuse3 replies from any buffer)."""
        if len(parts) == 1 and not isinstance(parts[0][1], _Fetch):
            # The common case of a sequential reader: one chunk, already in memory, no waiting.
            cid, data = parts[0]
            lo = start - cid.offset
            hi = min(end - cid.offset, len(data))
            self.stats.bytes_served_memory += hi - lo
            self._note_served(cid, hi - lo, len(data))
            return memoryview(data)[lo:hi]
        out: list[memoryview] = []
        deadline = min((p.deadline for _, p in parts if isinstance(p, _Fetch)),
                       default=trio.current_time() + self.read_timeout)
        with trio.move_on_at(deadline) as scope:
            for cid, part in parts:
                if not isinstance(part, _Fetch):
                    data, source = part, "memory"
                else:
                    await part.done.wait()
                    if part.error is not None:
                        raise part.error
                    assert part.data is not None
                    data, source = part.data, part.source
                lo = max(start - cid.offset, 0)
                hi = min(end - cid.offset, len(data))
                out.append(memoryview(data)[lo:hi])
                self._count_served(source, hi - lo)
                self._note_served(cid, hi - lo, len(data))
        if scope.cancelled_caught:
            raise ReadTimeout(f"read of {parts[0][0].key!r} timed out after {self.read_timeout:g}s")
        return out[0] if len(out) == 1 else b"".join(out)

    async def read(self, obj: ObjectVersion, start: int, end: int) -> bytes | memoryview:
        return await self.collect(self.request(obj, start, end), start, end)

    def _count_served(self, source: str, n: int) -> None:
        if source == "memory":
            self.stats.bytes_served_memory += n
        elif source == "origin":
            self.stats.bytes_served_origin += n
        else:
            self.stats.bytes_served_level += n

    # -- workers -------------------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            await self._queued.acquire()
            fetch = heapq.heappop(self._queue).fetch
            if fetch is None:
                continue  # the entry a priority upgrade left behind
            fetch.entry = None
            if fetch.started or fetch.done.is_set():
                continue
            if fetch.abandoned:
                self.stats.prefetch_dropped += 1
                self._finish(fetch)
                continue
            fetch.started = True
            await self._run_fetch(fetch)
            del fetch  # this frame waits for the next job: it must not pin the chunk's buffer meanwhile

    async def _run_fetch(self, fetch: _Fetch) -> None:
        self.stats.fetches_inflight += 1
        reuse = bool(self.levels) and fetch.length == self.chunk_size
        buffer = self._recycled_buffer(fetch.length) if reuse else None
        if buffer is not None:
            self._reserved_bytes += fetch.length  # the bytes it held as a cached chunk
        else:
            buffer = await self._reserve(fetch.length, reuse=reuse)
        try:
            data, hit_level = await self._load(fetch, buffer)
            fetch.data = data
            fetch.source = "origin" if hit_level is None else "level"
            self._store_in_memory(fetch.cid, data)
            if type(data) is mmap.mmap:
                self._served[fetch.cid] = 0
            missed = self.levels if hit_level is None else self.levels[:hit_level]
            if missed and self._nursery is not None and self.pin(fetch.cid):
                self._writes_pending += 1
                self._nursery.start_soon(self._write_through, missed, fetch.cid, data)
        except trio.Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to every waiter of this chunk
            fetch.error = exc if isinstance(exc, StoreError) else StoreError(f"{type(exc).__name__}: {exc}")
            log.warning("fetching chunk %d of %r failed: %s", fetch.cid.index, fetch.cid.key, fetch.error)
        finally:
            self._release(fetch.length)
            self.stats.fetches_inflight -= 1
            self._finish(fetch)

    def _finish(self, fetch: _Fetch) -> None:
        fetch.done.set()
        if self._inflight.get(fetch.cid) is not fetch:
            return
        if (fetch.error is not None and fetch.demanded and self._nursery is not None
                and trio.current_time() >= fetch.deadline):
            # Failed at its deadline: it stays the chunk's fetch for RETRY_GRACE_S, so the kernel's
            # immediate re-send of the READ that just failed joins it and fails at once (see _fetch_for).
            self._nursery.start_soon(self._unregister_after_grace, fetch)
            return
        del self._inflight[fetch.cid]

    async def _unregister_after_grace(self, fetch: _Fetch) -> None:
        await trio.sleep_until(fetch.deadline + RETRY_GRACE_S)
        if self._inflight.get(fetch.cid) is fetch:
            del self._inflight[fetch.cid]

    def _store_in_memory(self, cid: ChunkId, data: Chunk) -> None:
        # The reservation made for this chunk is released by the caller right after; until then
        # both are counted, which errs on the side of the budget.
        old = self._memory.pop(cid, None)
        if old is not None:
            self._cached_bytes -= len(old)
            self._forget(cid)
        self._memory[cid] = data
        self._cached_bytes += len(data)

    async def _load(self, fetch: _Fetch, buffer: mmap.mmap | None) -> tuple[Chunk, int | None]:
        """From the first cache level that has it (read into `buffer`, or a new one), else from the
        origin (the buffer is then dropped: this fetch's reservation counted it)."""
        cid, length = fetch.cid, fetch.length
        if buffer is None and self.levels and length == self.chunk_size:
            # An mmap call only: its pages are faulted in by the read that fills them.
            buffer = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for i, level in enumerate(self.levels):
            data = await self._run_blocking(level.get, cid, buffer, limiter=self._disk_limiter)
            if data is not None and len(data) == length:
                self.stats.level_hits += 1
                return data, i
        end = cid.offset + length
        backoff = UNREACHABLE_RETRY_S
        while True:
            self.stats.origin_requests += 1
            try:
                data = await self._run_blocking(self.store.get_range, cid.key, cid.etag, cid.offset, end,
                                                limiter=self._s3_limiter)
                break
            except Unreachable as exc:
                self.stats.origin_errors += 1
                # A restarting origin refuses connections for a moment: a reader that may still wait
                # (mmap readers die of a failed READ) waits for it, up to the fetch's deadline.
                wait = min(backoff, fetch.deadline - trio.current_time())
                if not fetch.demanded or wait <= 0:
                    raise
                log.debug("chunk %d of %r: %s; trying again in %.2fs", cid.index, cid.key, exc.message, wait)
                await trio.sleep(wait)
                backoff = min(2 * backoff, UNREACHABLE_RETRY_MAX_S)
            except Exception:
                self.stats.origin_errors += 1
                raise
        self.stats.origin_bytes += len(data)
        return data, None

    async def _write_through(self, levels: Sequence[ChunkCache], cid: ChunkId, data: Chunk) -> None:
        try:
            for level in levels:
                try:
                    await self._run_blocking(level.put, cid, data, limiter=self._put_limiter)
                except Exception as exc:  # noqa: BLE001 - a cache level never breaks a read
                    log.warning("cache write of chunk %d of %r failed: %s", cid.index, cid.key, exc)
        finally:
            self.unpin(cid)
            self._writes_pending -= 1
            self._writes_changed.set()
            self._writes_changed = trio.Event()

    @property
    def writes_pending(self) -> int:
        return self._writes_pending

    async def drain_writes(self, timeout: float) -> int:
        """Wait up to `timeout` s for the write-through of chunks already fetched (at unmount: a model
        read just before a restart is then all in the NVMe cache). The number still unwritten."""
        with trio.move_on_after(timeout):
            while self._writes_pending:
                await self._writes_changed.wait()
        return self._writes_pending
