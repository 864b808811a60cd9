"""The level stack: where a chunk the engine does not hold in memory comes from. Cache levels are asked
in order (local NVMe first; a level closer to the origin later), then the origin with a ranged GET
pinned to the ETag; a chunk a level missed is written back to it in the background (to a level that
allows it, such as the shared tier, only once this node's origin reads are done: trailing.py).

It counts what it does (hits and bytes per level, origin requests, bytes, errors and GET latency, and the
bytes of chunks the origin sent more than once, among the last REFETCH_MEMORY fetched) and
those counters are the only ones of the fetch path. It never decides what to fetch or what stays in
memory: the engine asks, the stack answers.

Adding a level is one module implementing `ChunkCache` and one entry in the list the mount passes in.

Rules: every method runs in the trio thread and updates the counters there (no await between read and
write); levels and the store are blocking and run in threads under the stack's own CapacityLimiters.
`writes_pending` counts write-throughs started and not finished, trailing writes included;
`_writes_changed` is set (and replaced) whenever it drops, so `drain_writes` can wait for it at unmount.
`LatencyHistogram` is read from the metrics thread too, so it holds a lock for each update.
`_overdue[i]` counts the reads of local level i given up on their deadline (GET_DEADLINE_S) whose thread has not
returned yet: each runs in a task of its own, which holds a second reservation of its chunk's length in the
memory budget (`overdraw`, within OVERDRAW_SHARE of it, `_overdrawn`: the buffer the late read may still write
into) and decrements the count when the read returns. A read still queued for the level's limiter when given up
is cancelled instead: no thread has its buffer. While the count is above 0, and for `get_deadline` after it drops
to 0 (`_skip_until[i]`), the level is skipped: not asked, not written, and `holds` says no.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging
import math
import mmap
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import cachetools
import trio

from fsmount.data.budget import MemoryBudget
from fsmount.data.identity import Chunk, ChunkId, WritableBuffer, new_buffer
from fsmount.data.store import NotFound, ObjectStore, PreconditionFailed, StoreError, TimedOut, Unreachable, sent_etag
from fsmount.data.trailing import TrailingWrites

log = logging.getLogger(__name__)

# Threads for a cache level's reads, unless it says otherwise; separate from the S3 connections.
DISK_THREADS = 8
# Write-through needs little parallelism (a chunk write is one large sequential write) and every extra
# writer thread competes with the read path for the GIL and the CPU; on the 2-core bench bed 1-2
# writers were no slower than 8 for a cold read with --cache-dir (noisy: 144-267 MB/s either way).
PUT_THREADS = 2
# Chunk ids of the latest origin fetches remembered to count a chunk fetched again (`origin_refetched_bytes`):
# 65536 x 8 MiB is 512 GiB of models, for ~10 MiB of ids.
REFETCH_MEMORY = 65536
# A write-through that has not finished this long after it was started (waiting for its level's threads, then
# writing) is given up: the chunk's memory is let go (a put already running finishes on its own thread). A cache
# disk that stops answering (a filesystem frozen for a snapshot, a hung NVMe) otherwise held every chunk fetched
# since in memory, and every fetch then waited for memory until its READ failed. A healthy disk this far behind
# the origin is worth no more waiting either: the chunk is only not cached. A quarter of --read-timeout where that is
# less, so that READs waiting for the memory those writes hold do not fail first; never below WRITE_DEADLINE_MIN_S,
# which a burst of writes queued for the level's 2 threads on a loaded machine does not reach (a give-up is a
# warning, which a healthy disk must not get).
WRITE_DEADLINE_S = 30.0
WRITE_DEADLINE_MIN_S = 10.0
# A read of a chunk from a local level (one with `contains`: the NVMe cache) that has not answered this long is
# given up: the chunk comes from the origin instead, and the level is skipped until every read given up has
# returned. A cache disk whose reads hang (a hung NVMe, a stuck network filesystem, a chunk file another process
# holds a lease on) failed every READ of a chunk it held at --read-timeout, and once all its threads were stuck
# every fetch of the mount, since each asks the level first. A quarter of --read-timeout where that is less, so that
# the origin has the rest of the READ's time; never below GET_DEADLINE_MIN_S, which a healthy disk's 8 MiB read,
# queued behind the level's other reads on a loaded machine, does not reach (a give-up is a warning).
GET_DEADLINE_S = 10.0
GET_DEADLINE_MIN_S = 2.0
# A read given up is a warning at most this often per level (a disk that stalls now and then is one episode).
GET_WARN_EVERY_S = 300.0
# The most of the memory budget that reads given up are counted for (their buffers, until they return): past it
# they hold memory outside the budget (at most DISK_THREADS chunks per level: only reads a thread has are kept).
# Counted in full, a disk that never answers again kept the budget full, and every fetch waited for room for good.
OVERDRAW_SHARE = 0.5
# Object versions whose GET the bucket refused as gone (412: replaced, 404: deleted), remembered for GONE_FOR_S
# so that the other chunks of a version fail at once instead of each sending a GET that would be refused too
# (a reader going on through a replaced file sent one per chunk). Not for longer: a version can come back (the
# same bytes uploaded again have the same ETag).
GONE_MEMORY = 1024
GONE_FOR_S = 5.0
# Chunks whose latest origin failure is remembered, to say why a READ of one timed out.
FAILURE_MEMORY = 1024
# A demanded fetch whose origin refuses connections (a server restarting) tries again after this long,
# doubling up to the maximum, until its deadline: an outage shorter than --read-timeout costs time only.
UNREACHABLE_RETRY_S = 0.25
UNREACHABLE_RETRY_MAX_S = 4.0
# Upper bounds (seconds) of one ranged GET of a chunk (8 MiB by default, retries included): ~10 ms
# from a same-rack server, ~0.1 s at 700 MB/s, seconds when the origin is throttling.
ORIGIN_GET_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# How blocking calls run: in a worker thread under a limiter. Tests substitute a virtual-time fake.
RunBlocking = Callable[..., Awaitable[Any]]


async def wait_to_retry(exc: StoreError, backoff: float, until: float, what: str) -> float:
    """Before a request the origin refused or did not answer in time (`exc`) is sent again: sleep `backoff`, or what
    is left until `until` (trio time), and return the next backoff (doubled, up to UNREACHABLE_RETRY_MAX_S); raise
    `exc` if no time is left. Start with UNREACHABLE_RETRY_S. Reads (`LevelStack`) and writes (`writes.Writes.call`)
    both wait so."""
    wait = min(backoff, until - trio.current_time())
    if wait <= 0:
        raise exc
    log.debug("%s: %s; trying again in %.2fs", what, exc.message, wait)
    await trio.sleep(wait)
    return min(2 * backoff, UNREACHABLE_RETRY_MAX_S)


async def run_in_thread(fn: Callable[..., Any], *args: Any, limiter: trio.CapacityLimiter) -> Any:
    # Abandoned on cancel (unmount): a GET stalled in the kernel must not hold the daemon's exit
    # for its retries; the thread ends on its own socket timeout.
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=True)


class ChunkCache(Protocol):
    """The narrow interface every cache level implements: get / put by chunk id. A level only stores and
    returns whole chunks; it never talks to the origin and never decides what to fetch.
    Implementations are thread-safe and blocking: the stack calls them from worker threads."""

    def get(self, chunk: ChunkId, buffer: WritableBuffer | None = None) -> bytes | WritableBuffer | None:
        """The chunk's bytes, or None if absent or unreadable (never wrong bytes). `buffer`, if given, is
        the chunk's exact length and the level's to fill and return instead of new bytes (the engine
        recycles buffers); a level may ignore it."""
        ...

    def put(self, chunk: ChunkId, data: bytes | WritableBuffer) -> None:
        """Store a chunk; failures (full disk, read-only dir) are absorbed and logged, not raised. `data` is the
        caller's again once put returns (callers refill their buffers): a level copies what it keeps."""
        ...

    def staging_bytes(self, chunk_size: int) -> int:
        """The most memory the level holds outside the engine's budget (buffers of writes in flight); the
        mount takes it out of the budget so that --memory-limit still bounds the daemon."""
        ...


# A level may also have `abandon(chunk)`: called (in a worker thread) when a chunk it missed will not be
# put after all (its origin fetch failed, or memory no longer held it). The shared tier drops its claim
# there, so other nodes fetch the chunk at once instead of waiting for a write that never comes.
# A local level with an index in memory may also have `contains(chunk) -> bool`, answered without I/O and
# safe to call from the trio thread: the chunks it holds come back in milliseconds, so the engine's
# callers read them ahead less far (a chunk read ahead sits in a buffer of its own until it is taken).


class LatencyHistogram:
    """Cumulative-bucket histogram of durations; thread-safe."""

    def __init__(self, bounds: Sequence[float] = ORIGIN_GET_BUCKETS):
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # last slot: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        slot = bisect.bisect_left(self.bounds, seconds)
        with self._lock:
            self._counts[slot] += 1
            self._sum += seconds

    def read(self) -> tuple[list[tuple[float, int]], int, float]:
        """([(upper bound, cumulative count)...] ending with +Inf, count, sum)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return cumulative, running, total


@dataclasses.dataclass
class LevelStats:
    """Plain counters, written in the trio thread."""

    origin_requests: int = 0
    origin_bytes: int = 0
    origin_errors: int = 0
    # Of origin_bytes, those of chunks the origin had sent before: evicted from memory (or dropped by the
    # kernel) before every READ that wanted them came, so the origin sent them again.
    origin_refetched_bytes: int = 0
    level_hits: list[int] = dataclasses.field(default_factory=list)  # chunks found, per level
    level_misses: list[int] = dataclasses.field(default_factory=list)  # chunks asked for and not found
    level_bytes: list[int] = dataclasses.field(default_factory=list)  # bytes loaded, per level
    # Of level_bytes, those of chunks this daemon had not fetched from the origin (REFETCH_MEMORY): bytes the
    # origin did not send. A chunk it did fetch and then loaded back from a level (given up from memory once
    # the page cache had it, as memory does beside a cache level) saved the origin nothing.
    level_saved_bytes: list[int] = dataclasses.field(default_factory=list)
    writes_given_up: int = 0  # write-throughs given up on their deadline (WRITE_DEADLINE_S)
    reads_given_up: int = 0  # reads of a local level given up on their deadline (GET_DEADLINE_S)

    @property
    def hits(self) -> int:
        return sum(self.level_hits)

    @property
    def loaded_bytes(self) -> int:
        """Bytes loaded from the cache levels."""
        return sum(self.level_bytes)

    @property
    def saved_bytes(self) -> int:
        """Bytes loaded from the cache levels that the origin had not sent to this daemon."""
        return sum(self.level_saved_bytes)


class LevelStack:
    def __init__(self, store: ObjectStore, levels: Sequence[ChunkCache], *, max_connections: int, chunk_size: int,
                 run_blocking: RunBlocking = run_in_thread, write_deadline: float = WRITE_DEADLINE_S,
                 get_deadline: float = GET_DEADLINE_S, memory: MemoryBudget | None = None):
        self.store = store
        self.write_deadline = write_deadline
        self.get_deadline = get_deadline
        self._memory = memory  # where a read given up keeps its buffer counted (None: uncounted, in tests)
        self.levels = list(levels)
        n = len(self.levels)
        self.stats = LevelStats(level_hits=[0] * n, level_misses=[0] * n, level_bytes=[0] * n,
                                level_saved_bytes=[0] * n)
        self._fetched: collections.OrderedDict[ChunkId, None] = collections.OrderedDict()  # latest origin fetches
        # (bucket, key, etag, size pinned) -> the refusal, for GONE_FOR_S. Both are touched by the trio thread only.
        # The size is part of the version: a version pinned at a wrong size (SizeChanged: a HEAD cut inside its
        # Content-Length line) is refused with the right ETag, and the same ETag at the right size is read.
        self._gone: cachetools.TTLCache[tuple[str, str, str, int | None], StoreError] = cachetools.TTLCache(
            GONE_MEMORY, GONE_FOR_S, timer=trio.current_time)
        self.origin_latency = LatencyHistogram()
        self._run_blocking = run_blocking
        self._s3_limiter = trio.CapacityLimiter(max_connections)
        # Each level gets its own threads: a local disk wants few, a network level (the shared tier) as
        # many as the origin; a level may say how many with `threads` / `put_threads`.
        self._get_limiters = [trio.CapacityLimiter(getattr(level, "threads", DISK_THREADS)) for level in self.levels]
        self._put_limiters = [trio.CapacityLimiter(getattr(level, "put_threads", PUT_THREADS))
                              for level in self.levels]
        self._contains: list[Callable[[ChunkId], bool] | None] = [getattr(level, "contains", None)
                                                                  for level in self.levels]
        self._overdue = [0] * n  # reads given up and not returned yet, per level (see the module's rules)
        self._skip_until = [-math.inf] * n  # and skipped until then after they returned (trio time)
        self._overdrawn = 0  # bytes those reads hold that the budget counts (budget.overdraw), all levels
        # For level reads: each takes its level's limiter itself first (_get_within_deadline), queued where it can
        # be dropped; the thread call then waits for nothing more.
        self._unlimited = trio.CapacityLimiter(math.inf)
        self._warned_at = [-math.inf] * n  # the last warning of a read given up, per level
        self._writes_pending = 0
        self._writes_changed = trio.Event()
        self._given_up_at = -math.inf  # trio time of the last write-through given up (WRITE_DEADLINE_S)
        # (trio time, message) of the latest origin GET of a chunk that failed or was refused, for the chunks
        # fetched last: why a READ of one of them is timing out (`origin_failure`). Trio thread only.
        self._origin_failures: cachetools.LRUCache[ChunkId, tuple[float, str]] = cachetools.LRUCache(FAILURE_MEMORY)
        # For the claims of writes given up: their level's put threads may all be the stuck ones.
        self._abandon_limiter = trio.CapacityLimiter(PUT_THREADS)
        self.trailing = TrailingWrites(run_blocking, chunk_size, self._write_done)

    def origin_failure(self, cid: ChunkId, since: float) -> str | None:
        """Why the origin last failed to send chunk `cid` (refused, or failed in the end), if it did at or after
        `since` (trio time)."""
        failure = self._origin_failures.get(cid)
        return failure[1] if failure is not None and failure[0] >= since else None

    def current_again(self, bucket: str, key: str, etag: str, size: int | None) -> None:
        """The bucket holds this version (again): what a GET that found it gone said no longer holds. (Wrongly told,
        the next GET finds it gone again; one request.)"""
        self._gone.pop((bucket, key, etag, size), None)

    def holds(self, cid: ChunkId) -> bool:
        """Whether a local level says it holds the chunk (its `contains`, no I/O) and answers; False if none can
        tell."""
        return any(contains is not None and not self._skipped(i) and contains(cid)
                   for i, contains in enumerate(self._contains))

    def lookups(self, level: ChunkCache) -> tuple[int, int]:
        """(hits, misses) of one of the levels: a miss is any lookup that did not return the chunk whole
        (absent, corrupt, unreadable)."""
        i = self.levels.index(level)
        return self.stats.level_hits[i], self.stats.level_misses[i]

    def loaded_bytes(self, level: ChunkCache) -> int:
        """Bytes of chunks one of the levels returned."""
        return self.stats.level_bytes[self.levels.index(level)]

    def saved_bytes(self, level: ChunkCache) -> int:
        """Of those, bytes of chunks the origin had not sent to this daemon (LevelStats.level_saved_bytes)."""
        return self.stats.level_saved_bytes[self.levels.index(level)]

    def __bool__(self) -> bool:
        """True if there is any cache level below memory."""
        return bool(self.levels)

    async def load(self, cid: ChunkId, length: int, buffer: mmap.mmap | None,
                   retry_until: Callable[[], float], nursery: trio.Nursery | None = None,
                   size: int | None = None) -> tuple[Chunk, int | None]:
        """The chunk and the index of the level that had it (read into `buffer` if given, else a new
        one), or from the origin with index None. While the origin refuses connections, or a try timed out, the GET
        is tried again until `retry_until()` (a deadline on trio's clock, re-read at each try). With a `nursery`, a read
        from a local level is given up after `get_deadline` (the read goes on in a task there). `size`: the object
        size the version was pinned at, which the origin's answer must say (`store.SizeChanged`); the chunk id
        does not carry it, so the levels' interface (get/put by chunk id) does not see it."""
        if buffer is None and length == cid.chunk_size:
            # An mmap call only: its pages are faulted in by the read that fills them, and the buffer is
            # reused for later chunks once READs took it (budget.py).
            buffer = new_buffer(length)
        for i, level in enumerate(self.levels if sent_etag(cid.etag) else ()):  # (no ETag: see `missed`)
            contains = self._contains[i]
            if contains is not None and (self._skipped(i) or not contains(cid)):
                # Not held (the index says so without a thread), or the level's reads hang: a miss.
                self.stats.level_misses[i] += 1
                continue
            if contains is not None and nursery is not None:
                answered, data = await self._get_within_deadline(nursery, i, cid, buffer, length)
                if not answered:
                    self.stats.level_misses[i] += 1
                    buffer = data  # a buffer of its own: the late read may still write into the old one
                    continue
            else:
                data = await self._run_blocking(level.get, cid, buffer, limiter=self._get_limiters[i])
            if data is not None and len(data) == length:
                self.stats.level_hits[i] += 1
                self.stats.level_bytes[i] += length
                if cid not in self._fetched:
                    self.stats.level_saved_bytes[i] += length
                return data, i
            self.stats.level_misses[i] += 1
        return await self._from_origin(cid, length, buffer, retry_until, size), None

    async def _get_within_deadline(self, nursery: trio.Nursery, i: int, cid: ChunkId, buffer: mmap.mmap | None,
                                   length: int) -> tuple[bool, Any]:
        """(True, level i's answer: bytes or None), or, if it did not come within `get_deadline`, (False, a buffer
        for the chunk from the origin). A read still queued for the level's threads then is dropped (nothing has
        its buffer, which is handed back); one a thread has goes on in its task, and keeps its buffer counted in the
        budget (within OVERDRAW_SHARE of it) until it returns (_overdue)."""
        done = trio.Event()
        outcome: list[Any] = []
        given_up, reading, counted = False, False, 0
        queued = trio.CancelScope()

        async def get() -> None:
            nonlocal reading
            try:
                with queued:
                    async with self._get_limiters[i]:  # queued here, cancellable: no thread has the buffer yet
                        reading = True
                        outcome.append(await self._run_blocking(self.levels[i].get, cid, buffer,
                                                                limiter=self._unlimited))
            except Exception as exc:  # noqa: BLE001 - raised again in load, or dropped if given up
                outcome.append(exc)
            finally:
                done.set()
                if given_up:
                    self._read_returned(i, counted)

        nursery.start_soon(get)
        with trio.move_on_after(self.get_deadline):
            await done.wait()
        if done.is_set():
            if not outcome:  # its task was cancelled first (unmount): a miss
                return True, None
            if isinstance(outcome[0], Exception):
                raise outcome[0]
            return True, outcome[0]
        self.stats.reads_given_up += 1
        self._warn_given_up(i, cid)
        if not reading:  # behind the level's stuck reads: dropped, and its buffer is the origin's to fill
            queued.cancel()
            self._skip_until[i] = max(self._skip_until[i], trio.current_time() + self.get_deadline)
            return False, buffer
        # No await from here until given_up is set: the task's finally must see it if the read returns.
        given_up = True
        self._overdue[i] += 1
        if self._memory is not None:
            # The old buffer, until its read returns (budget.overdraw: never waits). Counted within a share of the
            # budget only: fetches must go on beside reads that never return (a dead disk).
            counted = min(length, max(0, int(self._memory.limit * OVERDRAW_SHARE) - self._overdrawn))
            self._overdrawn += counted
            self._memory.overdraw(counted)
        return False, new_buffer(length) if length == cid.chunk_size else None

    def _warn_given_up(self, i: int, cid: ChunkId) -> None:
        now = trio.current_time()
        if now - self._warned_at[i] >= GET_WARN_EVERY_S:
            self._warned_at[i] = now
            log.warning("a read of chunk %d of %r from cache level %d did not return within %g s (a stalled cache "
                        "disk?): read from the origin; the level is skipped until its reads return, and %g s more",
                        cid.index, cid.key, i, self.get_deadline, self.get_deadline)

    def _read_returned(self, i: int, counted: int) -> None:
        if self._memory is not None:
            self._memory.release(counted)
            self._overdrawn -= counted
        self._overdue[i] -= 1
        if not self._overdue[i]:
            # Not at once: a disk a little slower than the deadline gave up a read, came back, and gave up the next
            # (a full deadline's wait each time, for every fetch in flight).
            self._skip_until[i] = trio.current_time() + self.get_deadline
            log.info("cache level %d answers again: its reads given up have returned; it is used again in %g s", i,
                     self.get_deadline)

    def _skipped(self, i: int) -> bool:
        """Whether level i's reads hang, or did less than `get_deadline` ago (see the module's rules)."""
        return bool(self._overdue[i]) or trio.current_time() < self._skip_until[i]

    async def _from_origin(self, cid: ChunkId, length: int, buffer: mmap.mmap | None,
                           retry_until: Callable[[], float], size: int | None = None) -> Chunk:
        version = (cid.bucket, cid.key, cid.etag, size)
        gone = self._gone.get(version)
        if gone is not None:
            error = gone.detached()
            error.reported = True  # logged with the GET that found it gone
            raise error
        # One fetch of a chunk is one error if it fails in the end, and one latency sample, its retries
        # included (each refused try counted as an error: a 30 s outage that no reader noticed showed 88).
        backoff = UNREACHABLE_RETRY_S
        started = time.monotonic()
        try:
            while True:
                self.stats.origin_requests += 1
                self.trailing.origin_started()
                try:
                    data = await self._run_blocking(self.store.get_range, cid.key, cid.etag, cid.offset,
                                                    cid.offset + length, buffer, size, limiter=self._s3_limiter)
                    break
                except (Unreachable, TimedOut) as exc:
                    # A restarting origin refuses connections for a moment: a reader that may still wait
                    # (mmap readers die of a failed READ) waits for it, up to the fetch's deadline. A try that timed
                    # out took --read-timeout: tried again only while a READ waits for the chunk (one that asked
                    # while it ran), not for read-ahead, nor for the READ whose deadline it outlasted. Tried in the
                    # store's thread 5 times, as many chunks as --max-connections that stall on every try would
                    # hold every fetch thread for 10 minutes, and READs of healthy chunks fail meanwhile.
                    self._origin_failures[cid] = (trio.current_time(), exc.message)
                    backoff = await wait_to_retry(exc, backoff, retry_until(), f"chunk {cid.index} of {cid.key!r}")
                except (PreconditionFailed, NotFound) as exc:
                    # (SizeChanged too: the server's size is not the one pinned, and will not be at the next try.)
                    # A copy: the error raised holds, in its traceback, the frames of this fetch, and through them
                    # its buffer, which the budget no longer counts once the fetch failed.
                    self._gone[version] = exc.detached()
                    raise
                finally:
                    self.trailing.origin_finished()
        except Exception as exc:
            self.stats.origin_errors += 1
            self._origin_failures[cid] = (trio.current_time(), getattr(exc, "message", None) or str(exc))
            raise
        finally:
            self.origin_latency.observe(time.monotonic() - started)
        self.stats.origin_bytes += len(data)
        if cid in self._fetched:
            self.stats.origin_refetched_bytes += len(data)
            self._fetched.move_to_end(cid)
        else:
            self._fetched[cid] = None
            if len(self._fetched) > REFETCH_MEMORY:
                self._fetched.popitem(last=False)
        return data

    # -- write-through -------------------------------------------------------------------------

    def missed(self, hit: int | None, cid: ChunkId) -> list[ChunkCache]:
        """The levels asked before the one that had the chunk (all of them after an origin fetch), but for those
        skipped while their reads hang. None for a chunk of an object the server gave no ETag: the cache levels
        outlive the object's versions, and could not tell two of them apart (old bytes for a replaced object)."""
        if not sent_etag(cid.etag):
            return []
        levels = self.levels if hit is None else self.levels[:hit]
        return [level for i, level in enumerate(levels) if not self._skipped(i)]

    def start_write(self, nursery: trio.Nursery, levels: Sequence[ChunkCache], cid: ChunkId, data: Chunk,
                    done: Callable[[], None]) -> None:
        """Write the chunk to `levels` in the background; `done()` once it is written (or failed)."""
        self._writes_pending += 1
        nursery.start_soon(self._write, nursery, levels, cid, data, done)

    async def _write(self, nursery: trio.Nursery, levels: Sequence[ChunkCache], cid: ChunkId, data: Chunk,
                     done: Callable[[], None]) -> None:
        try:
            written: list[ChunkCache] = []
            for level in levels:
                i = self.levels.index(level)
                # A level whose writes may trail gets them once the origin reads are done, read back
                # from a local level written just before (the chunk's memory is let go meanwhile).
                local = next((w for w in written if hasattr(w, "contains")), None)
                if local is not None and self.trailing.offer(nursery, cid, len(data), level, self._put_limiters[i],
                                                             local, self._get_limiters[self.levels.index(local)]):
                    self._writes_pending += 1  # until the trailing write ran (_write_done)
                    continue
                try:
                    with trio.move_on_after(self.write_deadline) as deadline:
                        await self._run_blocking(level.put, cid, data, limiter=self._put_limiters[i])
                except Exception as exc:  # noqa: BLE001 - a cache level never breaks a read
                    log.warning("cache write of chunk %d of %r failed: %s", cid.index, cid.key, exc)
                else:
                    if deadline.cancelled_caught:
                        self._write_given_up(cid)
                        abandon = getattr(level, "abandon", None)
                        if abandon is not None:  # the shared tier's claim on it: others need not wait for it
                            nursery.start_soon(self._abandon, abandon, cid, self._abandon_limiter)
                    else:
                        written.append(level)
        finally:
            done()
            self._write_done()

    def _write_given_up(self, cid: ChunkId) -> None:
        self.stats.writes_given_up += 1
        if self._given_up_at < trio.current_time() - self.write_deadline:  # once per episode
            log.warning("a cache write of chunk %d of %r did not finish within %g s (a stalled cache disk?): "
                        "given up; while writes stall, fetched chunks wait for them only in part of the chunk "
                        "memory", cid.index, cid.key, self.write_deadline)
        self._given_up_at = trio.current_time()

    def writes_stalled(self) -> bool:
        """Whether a write-through was given up on its deadline in the last `write_deadline` s."""
        return trio.current_time() - self._given_up_at < self.write_deadline

    def _write_done(self) -> None:
        self._writes_pending -= 1
        self._writes_changed.set()
        self._writes_changed = trio.Event()

    def start_abandon(self, nursery: trio.Nursery, levels: Sequence[ChunkCache], cid: ChunkId) -> None:
        """Tell `levels` (those with `abandon`) in the background that `cid` will not be written to them."""
        for level in levels:
            abandon = getattr(level, "abandon", None)
            if abandon is not None:
                nursery.start_soon(self._abandon, abandon, cid, self._put_limiters[self.levels.index(level)])

    async def _abandon(self, abandon: Callable[[ChunkId], None], cid: ChunkId, limiter: trio.CapacityLimiter) -> None:
        try:
            await self._run_blocking(abandon, cid, limiter=limiter)
        except Exception as exc:  # noqa: BLE001 - a cache level never breaks a read
            log.warning("cache level: giving up chunk %d of %r failed: %s", cid.index, cid.key, exc)

    @property
    def writes_pending(self) -> int:
        return self._writes_pending

    async def drain_writes(self, timeout: float) -> int:
        """Wait up to `timeout` s for the write-through of chunks already fetched (at unmount: a model
        read just before a restart is then all in the NVMe cache). The number still unwritten."""
        self.trailing.drain()
        with trio.move_on_after(timeout):
            while self._writes_pending:
                await self._writes_changed.wait()
        return self._writes_pending
