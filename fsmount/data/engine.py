"""The chunk engine: every byte of object data passes through here as fixed-size chunks.

A chunk is looked up in memory (`MemoryBudget`), then in the level stack (cache levels, then the
origin). One fetch per chunk at a time (single-flight); a fixed pool of worker tasks runs fetches in
priority order (demand reads, then read-ahead and model streaming, then background warming) and every
demanded fetch has a deadline. It never decides *what* to read ahead: handles and the model streamer
do that, through `request` / `read_ahead` / `fetch`.

Concurrency rules (everything runs in the trio thread):
- `_inflight[cid]` is the one pending `Fetch` for a chunk; it is removed only by the worker that
  finished it (or dropped it) and only if it is still the registered one. A demanded fetch that
  failed at its deadline stays registered (done, with its error) until RETRY_GRACE_S after it.
  A request pinned at another object size than the registered fetch's (`Fetch.size`) does not join
  it: a fresh one takes its place, and the old one goes on for its own waiters, unregistered.
- `_queue` (a heap) and `_queued` (a Semaphore) move together: every heap push releases the
  semaphore once, so a worker that acquired it always finds an entry to pop. A priority upgrade
  pushes a new entry and empties the old one (`_QueueEntry.fetch = None`), so an entry left in the
  heap never keeps a finished fetch's bytes alive outside the memory budget.
- A fetch reserves its bytes in the budget before it loads (a worker waits there when nothing is
  evictable) and stores the result before releasing the reservation.
- A chunk whose write-through to the cache levels is pending is pinned in the budget until it is
  written, so the bytes the write holds stay counted, and a cache level slower than the origin makes
  fetches wait for room instead of piling chunks up outside the budget.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import math
from collections.abc import Sequence

import trio

from fsmount.data.budget import MemoryBudget
from fsmount.data.identity import Chunk, ChunkId, ObjectVersion
from fsmount.data.levels import (
    GET_DEADLINE_MIN_S,
    GET_DEADLINE_S,
    WRITE_DEADLINE_MIN_S,
    WRITE_DEADLINE_S,
    ChunkCache,
    LevelStack,
    RunBlocking,
    run_in_thread,
)
from fsmount.data.store import ObjectStore, StoreError

log = logging.getLogger(__name__)

DEMAND = 0  # a READ waits for it
AHEAD = 1  # read-ahead of an open handle, model streaming of an open file
BACKGROUND = 2  # warming files nobody has opened yet (other shards of a model)
# A READ that joins a fetch whose deadline passed less than this long ago fails at once: it is the
# kernel re-sending the READ that just failed (same read(2)), which must not wait a second timeout.
# A READ arriving later is a new attempt by the application: it gets a new fetch and a new deadline,
# instead of inheriting the old fetch's retry chain (botocore's throttling backoff alone reaches 8 s).
RETRY_GRACE_S = 1.0
# The same grace holds for the other READs of that moment while no fetch (from the origin or a level) succeeded
# during the whole wait of the READ that timed out: a new demanded fetch of a chunk no local level holds fails at
# once. Those READs had waited in the kernel behind the ones that failed (its background queue, beyond
# --fuse-max-background) and belong to the same read(2) calls, which otherwise failed at twice --read-timeout (12
# readers of 16 MiB each).
# Chunks waiting for their write to a cache level are pinned in memory, which holds back fetches while a disk is
# slower than the origin (every chunk still gets cached). While writes stall (one was given up on its deadline:
# levels.WRITE_DEADLINE_S), at most this share of the chunk memory: beyond it a chunk is not written through, so
# fetches go on in the rest (a frozen cache disk pinned all of it, and every READ failed at --read-timeout).
WRITE_PIN_SHARE = 0.75


class ReadTimeout(StoreError):
    """A READ waited longer than --read-timeout for its chunk."""


@dataclasses.dataclass
class EngineStats:
    """Plain counters; updated only in the trio thread (no await between read and write)."""

    bytes_served_memory: int = 0
    bytes_served_level: int = 0
    bytes_served_origin: int = 0
    readahead_dropped: int = 0
    pagecache_drops: int = 0  # READs that showed the kernel had dropped pages it was believed to hold
    writes_skipped: int = 0  # fetched chunks not written to the cache levels while writes stall (WRITE_PIN_SHARE)
    fetches_inflight: int = 0


class _QueueEntry:
    __slots__ = ("priority", "seq", "fetch")

    def __init__(self, priority: int, seq: int, fetch: Fetch):
        self.priority, self.seq = priority, seq
        self.fetch: Fetch | None = fetch

    def __lt__(self, other: _QueueEntry) -> bool:
        return (self.priority, self.seq) < (other.priority, other.seq)


class Fetch:
    """One chunk on its way into memory; `await fetch.wait()` for its bytes."""

    __slots__ = ("cid", "length", "size", "done", "data", "error", "owners", "demanded", "started",
                 "abandoned", "source", "deadline", "entry")

    def __init__(self, cid: ChunkId, length: int, size: int | None = None):
        self.cid = cid
        self.length = length
        self.size = size  # the object's, as its version was pinned: what the origin's answer must say (B209)
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
        self.deadline = math.inf
        self.entry: _QueueEntry | None = None  # its place in the queue, until a worker takes it

    async def wait(self) -> Chunk:
        """The chunk's bytes once fetched; raises the fetch's StoreError if it failed."""
        await self.done.wait()
        if self.error is not None:
            # A copy for each waiter: raised, the kept one would gather every waiter's frames (and the chunks they cut).
            raise self.error.detached()
        if self.data is None:  # dropped unstarted: nobody was to wait for it (engine.abandon)
            raise StoreError(f"the fetch of chunk {self.cid.index} of {self.cid.key!r} was dropped")
        return self.data

    def retry_until(self) -> float:
        """Until when an unreachable origin, or a GET that timed out, is tried again: the deadline of a READ
        waiting for it."""
        return self.deadline if self.demanded else -math.inf


class ChunkEngine:
    def __init__(self, store: ObjectStore, *, chunk_size: int, memory_limit: int, max_connections: int,
                 read_timeout: float, levels: Sequence[ChunkCache] = (), run_blocking: RunBlocking = run_in_thread):
        self.bucket = store.bucket
        self.chunk_size = chunk_size
        self.read_timeout = read_timeout
        self.memory = MemoryBudget(memory_limit)
        self.levels = LevelStack(store, levels, max_connections=max_connections, chunk_size=chunk_size,
                                 run_blocking=run_blocking,
                                 write_deadline=min(WRITE_DEADLINE_S, max(WRITE_DEADLINE_MIN_S, read_timeout / 4)),
                                 get_deadline=min(GET_DEADLINE_S, max(GET_DEADLINE_MIN_S, read_timeout / 4)),
                                 memory=self.memory)
        self.stats = EngineStats()
        self._workers = max_connections
        self._inflight: dict[ChunkId, Fetch] = {}
        self._queue: list[_QueueEntry] = []
        self._queued = trio.Semaphore(0)
        self._seq = itertools.count()
        self._nursery: trio.Nursery | None = None
        self._writes_behind = False  # whether write-throughs are being skipped
        self._writes_behind_told = False  # the first time is a warning, the others debug (a slow disk flaps)
        # When a READ last timed out, and when a fetch last succeeded (`_origin_silent`); trio time.
        self._read_timed_out_at = -math.inf
        self._answered_at = -math.inf

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the fetch workers until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for _ in range(self._workers):
                nursery.start_soon(self._worker)
            task_status.started()

    # -- ids -----------------------------------------------------------------------------------

    def current_again(self, obj: ObjectVersion) -> None:
        """The namespace holds `obj` current, as of an answer newer than any GET that found it gone."""
        self.levels.current_again(self.bucket, obj.key, obj.etag, obj.size)

    def chunk_id(self, obj: ObjectVersion, index: int) -> ChunkId:
        return ChunkId(self.bucket, obj.key, obj.etag, self.chunk_size, index)

    def chunk_length(self, obj: ObjectVersion, index: int) -> int:
        return max(0, min(self.chunk_size, obj.size - index * self.chunk_size))

    def chunk_range(self, obj: ObjectVersion, start: int, end: int) -> range:
        """Indices of the chunks covering bytes [start, end) of obj."""
        end = min(end, obj.size)
        if end <= start:
            return range(0)
        return range(start // self.chunk_size, (end - 1) // self.chunk_size + 1)

    # -- requests ------------------------------------------------------------------------------

    def _enqueue(self, fetch: Fetch, priority: int) -> None:
        if fetch.entry is not None:
            fetch.entry.fetch = None  # upgraded: the old entry is skipped, and holds nothing meanwhile
        fetch.entry = _QueueEntry(priority, next(self._seq), fetch)
        heapq.heappush(self._queue, fetch.entry)
        self._queued.release()

    def _fetch_for(self, cid: ChunkId, length: int, priority: int, size: int | None = None) -> Fetch:
        fetch = self._inflight.get(cid)
        if fetch is not None and fetch.demanded and trio.current_time() > fetch.deadline + RETRY_GRACE_S:
            if fetch.started:
                # Timed out a while ago and still retrying: leave it to finish in its worker (its bytes
                # still land in memory if it succeeds) and register a fresh fetch for this chunk.
                fetch.abandoned = True
            else:
                # Still queued (every worker busy): it has no retry chain to drop, and others may wait for it (a
                # model stream), which a fetch dropped unstarted would leave with neither bytes nor error. The
                # next demand gives it a deadline of its own (`request`).
                fetch.demanded = False
                fetch.deadline = math.inf
        if fetch is None or fetch.abandoned or fetch.size != size:
            # A fetch for a handle pinned at another size of the same ETag (a HEAD cut inside its Content-Length
            # line, B209; the chunk id does not carry the size) is not joined: its GET checks its own size, and the
            # handle of the right size, opened after the wrong one's EIO, got that EIO from it (B213). It goes on
            # for its own waiters, as an abandoned one does, and this one takes its place.
            fetch = self._inflight[cid] = Fetch(cid, length, size)
            self._enqueue(fetch, priority)
        elif priority == DEMAND and not fetch.demanded and not fetch.started:
            self._enqueue(fetch, DEMAND)  # jump the read-ahead queue; the older entry is skipped
        return fetch

    def held_locally(self, obj: ObjectVersion, index: int) -> bool:
        """Whether a local cache level holds the chunk (a hint): it can be had in milliseconds, so reading
        it far ahead only takes memory (a buffer each, fresh at first) early."""
        return self.levels.holds(self.chunk_id(obj, index))

    def kernel_lacks(self, obj: ObjectVersion, start: int, end: int) -> bool:
        """A READ of [start, end) came through the page cache: the kernel does not hold those bytes. Where it
        was believed to, the belief is dropped for the whole file (`MemoryBudget.kernel_dropped`) and True
        returned; without that, read-ahead skipped every chunk of a file read again after the kernel evicted
        it, each fetched only when its own READ came, and model streaming skipped them all."""
        for index in self.chunk_range(obj, start, end):
            if self.memory.kernel_dropped(self.chunk_id(obj, index)):
                self.stats.pagecache_drops += 1
                log.debug("the page cache dropped %r: its chunks are read ahead and streamed again", obj.key)
                return True
        return False

    def read_ahead(self, obj: ObjectVersion, index: int, owner: object, kernel_caches: bool = True) -> None:
        """Ask for a chunk ahead of need; `owner` may later `abandon` it. A chunk the kernel took whole is
        not asked for again: the page cache has it (a READ fetches it, should the kernel have dropped it);
        but for a reader whose READs bypass the page cache (O_DIRECT: not `kernel_caches`)."""
        cid = self.chunk_id(obj, index)
        if not kernel_caches or not self.memory.in_page_cache(cid):
            self._fetch(cid, obj, index, owner, AHEAD)

    def fetch(self, obj: ObjectVersion, index: int, owner: object, priority: int = AHEAD) -> Fetch | Chunk:
        """Queue a chunk now (queue order is request order) and hand back its bytes if they are in memory,
        else its `Fetch` to await later; `owner` may `abandon` it."""
        return self._fetch(self.chunk_id(obj, index), obj, index, owner, priority)

    def _fetch(self, cid: ChunkId, obj: ObjectVersion, index: int, owner: object, priority: int) -> Fetch | Chunk:
        length = self.chunk_length(obj, index)
        data = self.memory.get(cid, length)
        if data is not None:
            return data
        fetch = self._fetch_for(cid, length, priority, obj.size)
        fetch.owners.add(owner)
        return fetch

    def abandon(self, owner: object) -> None:
        """`owner` no longer needs what it asked for ahead; queued fetches nobody else wants are dropped."""
        for fetch in list(self._inflight.values()):
            if owner in fetch.owners:
                fetch.owners.discard(owner)
                if not fetch.owners and not fetch.demanded and not fetch.started:
                    fetch.abandoned = True

    def request(self, obj: ObjectVersion, start: int, end: int) -> list[tuple[ChunkId, Fetch | Chunk]]:
        """Start (or join) the fetches covering [start, end) at demand priority; no await."""
        parts: list[tuple[ChunkId, Fetch | Chunk]] = []
        for index in self.chunk_range(obj, start, end):
            cid = self.chunk_id(obj, index)
            length = self.chunk_length(obj, index)
            data = self.memory.touch(cid, length)  # (held at another length: another size's, B290)
            if data is not None:
                parts.append((cid, data))
                continue
            fetch = self._fetch_for(cid, length, DEMAND, obj.size)
            if not fetch.demanded:
                fetch.demanded = True
                now = trio.current_time()
                silent = self._origin_silent(now) and not self.levels.holds(cid)
                # Failing at once, it shares the deadline that passed: it starts no grace of its own.
                fetch.deadline = self._read_timed_out_at if silent else now + self.read_timeout
            parts.append((cid, fetch))
        return parts

    def _origin_silent(self, now: float) -> bool:
        """Whether a READ timed out less than RETRY_GRACE_S ago and no fetch succeeded during its whole wait (from
        the origin or a level: a shared tier serves the fleet while the origin is down): a READ that comes now
        fails at once instead of waiting a timeout of its own (see RETRY_GRACE_S)."""
        return (now - self._read_timed_out_at < RETRY_GRACE_S
                and self._answered_at < self._read_timed_out_at - self.read_timeout)

    async def collect(self, parts: list[tuple[ChunkId, Fetch | Chunk]], start: int, end: int, *,
                      served: bool = True, kernel_caches: bool = True) -> bytes | memoryview:
        """Wait for the parts of `request` and cut bytes [start, end) out of them. A read within one
        chunk is a zero-copy view of it (pyfuse3 replies from any buffer). `served`: the bytes answer a
        READ (counted in the stats), which the kernel caches unless not `kernel_caches` (O_DIRECT): a chunk
        READs took is then not pushed, and once taken whole it is believed held by the page cache."""
        if len(parts) == 1 and not isinstance(parts[0][1], Fetch) and served:
            # The common case of a sequential reader: one chunk, already in memory, no waiting.
            cid, data = parts[0]
            lo = start - cid.offset
            hi = min(end - cid.offset, len(data))
            self.stats.bytes_served_memory += hi - lo
            self.memory.note_served(cid, lo, hi, len(data), kernel_caches)
            return memoryview(data)[lo:hi]
        out: list[memoryview] = []
        started = trio.current_time()
        deadline = min((p.deadline for _, p in parts if isinstance(p, Fetch)), default=started + self.read_timeout)
        with trio.move_on_at(deadline) as scope:
            for cid, part in parts:
                if isinstance(part, Fetch):
                    data, source = await part.wait(), part.source
                else:
                    data, source = part, "memory"
                lo = max(start - cid.offset, 0)
                hi = min(end - cid.offset, len(data))
                out.append(memoryview(data)[lo:hi])
                if served:
                    self._count_served(source, hi - lo)
                    self.memory.note_served(cid, lo, hi, len(data), kernel_caches)
        if scope.cancelled_caught:
            self._read_timed_out_at = max(self._read_timed_out_at, deadline)
            # Why, where the origin said (a refused connection it was waiting out): the warning said only "timed
            # out", and the cause was at debug level.
            failed = next(filter(None, (self.levels.origin_failure(cid, deadline - self.read_timeout)
                                        for cid, part in parts if isinstance(part, Fetch))), None)
            why = f" (the origin: {failed})" if failed else ""
            key = parts[0][0].key
            if deadline <= started:  # it waited for nothing (RETRY_GRACE_S): "timed out after 120s" was not so
                error = ReadTimeout(f"read of {key!r} failed at once: a read just before timed out after "
                                    f"{self.read_timeout:g}s, with nothing fetched meanwhile{why}")
                error.reported = True  # the read that timed out was the episode's warning (the kernel re-sends it)
                raise error
            raise ReadTimeout(f"read of {key!r} timed out after {self.read_timeout:g}s{why}")
        return out[0] if len(out) == 1 else b"".join(out)

    async def read(self, obj: ObjectVersion, start: int, end: int) -> bytes | memoryview:
        """Bytes [start, end) of obj to answer a READ with (`request` then `collect`)."""
        return await self.collect(self.request(obj, start, end), start, end)

    async def peek(self, obj: ObjectVersion, start: int, end: int) -> bytes | memoryview:
        """Bytes [start, end) of obj for the daemon's own use (a safetensors header to parse), fetched at
        demand priority like a READ's but not served to the kernel: not counted as served, and their
        chunk is still pushed into the page cache by model streaming."""
        return await self.collect(self.request(obj, start, end), start, end, served=False)

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
                self.stats.readahead_dropped += 1
                self._finish(fetch)
                continue
            fetch.started = True
            await self._run_fetch(fetch)
            del fetch  # this frame waits for the next job: it must not pin the chunk's buffer meanwhile

    async def _run_fetch(self, fetch: Fetch) -> None:
        self.stats.fetches_inflight += 1
        reuse = fetch.length == self.chunk_size
        # A fresh buffer costs page faults; a spent chunk's costs its second copy (the page cache has
        # the first): given up at once when a cache level holds the chunk too, else past a share of memory.
        spent = reuse and (bool(self.levels) or self.memory.reuse_spent(fetch.length))
        buffer = self.memory.take_spent_buffer(fetch.length) if spent else None
        if buffer is None:
            buffer = await self.memory.reserve(fetch.length, reuse=reuse, chunk=True)
        try:
            data, hit = await self.levels.load(fetch.cid, fetch.length, buffer, fetch.retry_until, self._nursery,
                                               fetch.size)
            del buffer  # a level or the origin filled it (it is `data`), or a level's own bytes replace it
            fetch.data = data
            fetch.source = "origin" if hit is None else "level"
            self._answered_at = trio.current_time()  # the origin, or a level (a shared tier serves while it is down)
            self.memory.store(fetch.cid, data, fetch.demanded)
            missed = self.levels.missed(hit, fetch.cid)
            if missed and self._nursery is not None:
                cid = fetch.cid
                if self._writes_keep_up() and self.memory.pin(cid):
                    self.levels.start_write(self._nursery, missed, cid, data, lambda: self.memory.unpin(cid))
                else:
                    self.levels.start_abandon(self._nursery, missed, cid)
        except trio.Cancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to every waiter of this chunk
            # Detached: the frames of this fetch hold its buffer, which the budget stops counting below.
            fetch.error = (exc if isinstance(exc, StoreError) else StoreError(f"{type(exc).__name__}: {exc}")
                           ).detached()
            # A warning only where a reader waited for it: read-ahead and streaming fetches that fail (an outage
            # logged one line per chunk of every shard being warmed) are fetched again when a READ wants them.
            warn = fetch.demanded and not fetch.error.reported
            (log.warning if warn else log.debug)(
                "fetching chunk %d of %r failed: %s", fetch.cid.index, fetch.cid.key, fetch.error)
            if warn:
                fetch.error.reported = True
            if self._nursery is not None:
                self.levels.start_abandon(self._nursery, self.levels.levels, fetch.cid)
        finally:
            self.memory.release(fetch.length)
            self.stats.fetches_inflight -= 1
            self._finish(fetch)

    def _writes_keep_up(self) -> bool:
        """Whether a chunk may wait in memory for its write-through (WRITE_PIN_SHARE)."""
        behind = (self.memory.pinned * self.chunk_size >= WRITE_PIN_SHARE * self.memory.limit
                  and self.levels.writes_stalled())
        if behind != self._writes_behind:
            self._writes_behind = behind
            if behind:
                (log.debug if self._writes_behind_told else log.warning)(
                    "cache writes stall (%d chunks waiting): fetched chunks are not written to the cache until "
                    "they finish", self.memory.pinned)
                self._writes_behind_told = True
            else:
                log.debug("cache writes keep up again: fetched chunks are written to the cache")
        if behind:
            self.stats.writes_skipped += 1
        return not behind

    def _finish(self, fetch: Fetch) -> None:
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

    async def _unregister_after_grace(self, fetch: Fetch) -> None:
        await trio.sleep_until(fetch.deadline + RETRY_GRACE_S)
        if self._inflight.get(fetch.cid) is fetch:
            del self._inflight[fetch.cid]
