"""Trailing writes: a chunk write to a slow, remote cache level (the shared tier) that waits until this
node's origin reads are done, so that a node loading a model alone is not slowed by filling the tier.

The level decides whether its writes may trail (`trails()`: the shared tier says no once another node
may be waiting for them). A write trails only when a local level written before it (the NVMe cache)
holds the chunk: the chunk's memory is then released at once, and the write reads the chunk back from
that level when it runs. Without a local copy the write goes at once, as before.

Queued writes run, TRAIL_WORKERS at a time, as soon as any of these holds:
- no origin GET has been in flight for TRAIL_IDLE_S (the load is done, or paused);
- the oldest has waited TRAIL_MAX_S (well below the tier's claim TTL, so a claim is never taken for a
  dead node's while its chunk trails), or more than TRAIL_MAX_BYTES trail (what is left to write when a
  long load ends, and what an unmount right after it has to drain, stays bounded while the tier keeps up;
  behind a tier slower than the origin the queue grows on, up to the share below), or the queue is within a
  chunk of TRAIL_LOCAL_SHARE of the local level's size (its copies must outlast their turn: past that share a
  write is not queued, it goes at once, from memory);
- the level no longer trails (another node was seen) or a listing of its waiting markers
  (`look_for_waiters`, every WAITERS_CHECK_S while writes trail) finds another node waiting;
- the mount is draining its writes (unmount).
A chunk the local level no longer holds when its turn comes (evicted, corrupt) is given up: the level's
`abandon` drops its claim, and the write is counted in `dropped`.

Rules: everything here runs in the trio thread; the deque, the counters and `_origin_*` are touched
only there, with no await between a read and its write. Blocking calls (local reads, the level's put,
the marker listing) run in threads under the limiters the level stack hands in.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol

import trio

from fsmount.data.identity import ChunkId, WritableBuffer, new_buffer

log = logging.getLogger(__name__)

# A load counts as done once no origin GET has been in flight this long (read-ahead keeps GETs going
# back to back while a reader streams, so gaps this long are pauses of the reader, not of the pipeline).
TRAIL_IDLE_S = 0.5
# The longest a write trails: below the shared tier's CLAIM_TTL_S (30 s), so nodes waiting on its claim
# never take the claim for a dead node's.
TRAIL_MAX_S = 20.0
TRAIL_MAX_BYTES = 4 << 30
# And at most this share of the local level's size (`max_bytes`): a write whose chunk the local level evicted
# before its turn is given up, so a node loading alone a model larger than its NVMe cache wrote next to nothing to
# the tier (7 of 50 chunks on a 64 MiB cache, B254), and the next node fetched the rest from the origin, alike.
TRAIL_LOCAL_SHARE = 0.25
# Trailing writes run this many at a time, each with one chunk buffer of its own (held outside the
# engine's budget: the shared tier counts them in its staging_bytes).
TRAIL_WORKERS = 2
# How often a node with trailing writes lists the tier's waiting markers.
WAITERS_CHECK_S = 0.5
# How often a queued write looks again at its conditions.
POLL_S = 0.05


class TrailingLevel(Protocol):
    """A cache level whose writes may trail (shared_tier.SharedTier)."""

    def trails(self) -> bool: ...

    def look_for_waiters(self) -> bool: ...

    def put(self, chunk: ChunkId, data: bytes | WritableBuffer) -> None: ...

    def abandon(self, chunk: ChunkId) -> None: ...


class LocalLevel(Protocol):
    """A level that keeps a local copy the trailing write reads back (disk_cache.DiskCache); its `max_bytes`, if it
    has one, bounds what trails (TRAIL_LOCAL_SHARE)."""

    def contains(self, chunk: ChunkId) -> bool: ...

    def get(self, chunk: ChunkId, buffer: WritableBuffer | None = None) -> bytes | WritableBuffer | None: ...


RunBlocking = Callable[..., Awaitable[Any]]


class Queued(NamedTuple):
    """One write waiting for its turn: the chunk, where it goes and where it is read back from."""

    cid: ChunkId
    length: int
    level: TrailingLevel
    put_limiter: trio.CapacityLimiter
    local: LocalLevel
    get_limiter: trio.CapacityLimiter
    queued_at: float  # trio time


class TrailingWrites:
    def __init__(self, run_blocking: RunBlocking, chunk_size: int, on_done: Callable[[], None]):
        self._run_blocking = run_blocking
        self._chunk_size = chunk_size
        self._on_done = on_done  # one call per queued write once it ran or was given up
        self._queue: collections.deque[Queued] = collections.deque()
        self._workers = 0
        self._queued_bytes = 0
        self._origin_in_flight = 0
        self._origin_idle_since = 0.0
        self._draining = False
        self._waiters_checked_at = 0.0
        self._waiter_check_running = False
        self.queued = 0  # writes that trailed (counted when queued)
        self.dropped = 0  # trailing writes given up: the local copy was gone by their turn

    # -- what the level stack tells it --

    def origin_started(self) -> None:
        self._origin_in_flight += 1

    def origin_finished(self) -> None:
        self._origin_in_flight -= 1
        if not self._origin_in_flight:
            self._origin_idle_since = trio.current_time()

    def drain(self) -> None:
        """Unmount: run every queued write now."""
        self._draining = True

    def __len__(self) -> int:
        return len(self._queue)

    def offer(self, nursery: trio.Nursery, cid: ChunkId, length: int, level: Any, put_limiter: trio.CapacityLimiter,
              local: Any, get_limiter: trio.CapacityLimiter) -> bool:
        """Queue the write of `cid` to `level` if it may trail and `local` holds the chunk; False: write it now."""
        if self._draining or not getattr(level, "trails", None) or not level.trails() or not local.contains(cid):
            return False
        if self._queued_bytes + length > self._share(local):
            # The local copies of what trails already fill their share: written from memory, at once. Not past
            # TRAIL_MAX_BYTES, which only starts the queue: a write from memory is pinned until written, so a lone
            # node's load past it was held back to the tier's write speed where the local level had room (B255).
            return False
        self._queue.append(Queued(cid, length, level, put_limiter, local, get_limiter, trio.current_time()))
        self._queued_bytes += length
        self.queued += 1
        if self._workers < TRAIL_WORKERS:
            self._workers += 1
            nursery.start_soon(self._worker, nursery)
        return True

    # -- running them --

    @staticmethod
    def _share(local: Any) -> float:
        """The most bytes that may trail with copies on `local` (its TRAIL_LOCAL_SHARE; no bound if it has no size)."""
        size = getattr(local, "max_bytes", None)
        return math.inf if size is None else size * TRAIL_LOCAL_SHARE

    def _may_run(self, head: Queued) -> bool:
        now = trio.current_time()
        return (self._draining or not head.level.trails() or now - head.queued_at >= TRAIL_MAX_S
                or self._queued_bytes > TRAIL_MAX_BYTES
                or self._queued_bytes + self._chunk_size > self._share(head.local)  # full: offers go at once
                or (not self._origin_in_flight and now - self._origin_idle_since >= TRAIL_IDLE_S))

    async def _worker(self, nursery: trio.Nursery) -> None:
        buffer: WritableBuffer | None = None
        try:
            while self._queue:
                head = self._queue[0]
                if not self._may_run(head):
                    self._check_waiters(nursery, head.level, head.put_limiter)
                    await trio.sleep(POLL_S)
                    continue
                cid, length, level, put_limiter, local, get_limiter, _ = self._queue.popleft()
                self._queued_bytes -= length
                try:
                    if buffer is None:
                        buffer = new_buffer(self._chunk_size)
                    into = buffer if length == self._chunk_size else None
                    data = await self._run_blocking(local.get, cid, into, limiter=get_limiter)
                    if data is not None and len(data) == length:
                        await self._run_blocking(level.put, cid, data, limiter=put_limiter)
                    else:
                        self.dropped += 1
                        log.info("chunk %d of %r left the local cache before its trailing write: not written "
                                 "to %s", cid.index, cid.key, level)
                        await self._run_blocking(level.abandon, cid, limiter=put_limiter)
                except trio.Cancelled:
                    raise
                except Exception as exc:  # noqa: BLE001 - a cache level never breaks a read
                    log.warning("trailing cache write of chunk %d of %r failed: %s", cid.index, cid.key, exc)
                finally:
                    self._on_done()
        finally:
            self._workers -= 1

    def _check_waiters(self, nursery: trio.Nursery, level: TrailingLevel, limiter: trio.CapacityLimiter) -> None:
        now = trio.current_time()
        if self._waiter_check_running or now - self._waiters_checked_at < WAITERS_CHECK_S:
            return
        self._waiter_check_running = True
        self._waiters_checked_at = now
        nursery.start_soon(self._look_for_waiters, level, limiter)

    async def _look_for_waiters(self, level: TrailingLevel, limiter: trio.CapacityLimiter) -> None:
        try:
            await self._run_blocking(level.look_for_waiters, limiter=limiter)
        except Exception as exc:  # noqa: BLE001 - the level logs its own failures; this is a hint only
            log.debug("looking for waiting nodes failed: %s", exc)
        finally:
            self._waiter_check_running = False
