"""Pushing streamed chunks into the kernel page cache (pyfuse3.notify_store), so later READs and mmap
faults of those pages never reach the daemon.

It never pushes from the trio thread (the call blocks in the kernel) and never over a range whose READ
is being served; bytes pushed for files that are still open never exceed `limit` (a file's share is
given back with `release` when its last handle closes).

Under memory pressure (the kernel evicts pushed pages of a file still open while little memory is free:
a pod at its cgroup limit, a host full) the limit is halved at each eviction seen, until no file holds
pushes any more (`evicted`).

It also leaves alone what a reader is about to READ: the range from the end of an inode's latest READ
to two of the kernel's read-ahead windows past it (`reader_window`). A sequential reader's READs take
those bytes within moments, and a push racing them copies them into the page cache a second time (a
`cat` got 10-25 % of its bytes twice); random readers' faults elsewhere are still pushed ahead of them.
Two windows: the kernel keeps a sequential reader's next window requested while it reads the current
one (asynchronous read-ahead), and those READs may still wait in /dev/fuse, unseen by the daemon. With
one window a warm `cat` still got 3-9 % of its bytes twice, with two 1-3 % (bench/RESULTS.md).

Concurrency: `_reading` and `_reader_at` are changed only in the trio thread (`reading()` context), and so is
`limit` (`evicted`, `release`; `evicted` reads /proc/meminfo and the cgroup's counters there, ~0.1 ms, once
per eviction seen);
`push` checks them there before handing the data to a worker thread. Up to `pushes_at_once` pushes copy at
once, each in its own thread; `pushed`, `stored_total`, `_copying` and `_copying_into` are counted in the trio
thread around them.
A stop (`stop`) refuses new pushes and waits for those copying while the FUSE loop still answers READs.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pyfuse3
import trio

from fsmount import sysmem

if TYPE_CHECKING:
    from fsmount.data import Chunk

log = logging.getLogger(__name__)

# Default share of MemAvailable that may be pushed: the page cache is the kernel's to evict, but
# pushing more than the machine can hold would only evict what was pushed a moment earlier.
DEFAULT_PUSH_FRACTION = 0.5
# Inodes whose latest READ is remembered (a few dozen bytes each).
READERS_MAX = 4096
# Pushes that may run at once, each in a thread of its own, where the daemon may use PARALLEL_PUSH_CPUS
# CPUs or more (a core each for the trio thread, the fetch threads and two pushes). notify_store copies
# with the GIL released (pyfuse3's `with nogil:`), and two pushes from two threads overlapped in the kernel,
# so one at a time would cap model streaming at one core's copy rate. With fewer cores, one: on one client
# core two at once pushed more of a loader's bytes ahead of its READs, which cost the daemon more CPU per
# byte than the READs they replaced (bench/RESULTS.md).
PARALLEL_PUSHES = 2
PARALLEL_PUSH_CPUS = 4
# Read-ahead windows a sequential reader has requested past its position: the one it reads, the next.
KERNEL_WINDOWS_AHEAD = 2
# The kernel dropping pushed pages of a file still open while less than this share of the push limit is free
# (nothing holds it, not even the page cache: MemFree, or the cgroup's unused memory) is memory pressure, not
# an explicit drop (drop_caches, which leaves memory free). In a 900 MiB cgroup (a pod) a 1 GiB model read
# with safe_open was fetched 2.2-2.9 times: each push evicted pages pushed before, the loader's READs fetched
# them again, and the stream ran once more for the pages dropped (bench/RESULTS.md).
PRESSURE_FREE_SHARE = 1 / 4
# How often a stop looks whether the pushes in flight have ended (`stop`, `settled`).
STOP_POLL_S = 0.01
# The longest a rewrite's open waits for a push into its inode that was copying (`settled`): one chunk's copy,
# unless it waits for pages a READ holds, which the trio thread answers meanwhile.
SETTLE_WAIT_S = 5.0


def default_pushes_at_once() -> int:
    """PARALLEL_PUSHES where this process may run on PARALLEL_PUSH_CPUS CPUs or more, else 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return PARALLEL_PUSHES if cpus >= PARALLEL_PUSH_CPUS else 1


def default_push_limit() -> int:
    """DEFAULT_PUSH_FRACTION of the memory available: MemAvailable, or what the daemon's cgroup has left where
    that is less (pushed pages are charged to the daemon's cgroup, which evicts them at its limit)."""
    avail = sysmem.available()
    return int(avail * DEFAULT_PUSH_FRACTION) if avail is not None else 0


class PageCachePusher:
    def __init__(self, limit: int, kernel_readahead: int = 0, pushes_at_once: int | None = None,
                 free_memory: Callable[[], int | None] = sysmem.free):
        self.limit = limit
        self.initial_limit = limit
        self._free_memory = free_memory
        self.reader_window = KERNEL_WINDOWS_AHEAD * kernel_readahead
        self._reader_at: collections.OrderedDict[int, int] = collections.OrderedDict()  # ino -> end of its latest READ
        self.pushed = 0
        self.stored_total = 0  # every byte notify_store put in the page cache (a counter: never given back)
        self._reading: dict[int, list[tuple[int, int]]] = {}
        self.pushes_at_once = pushes_at_once or default_pushes_at_once()
        self._turn = trio.Semaphore(self.pushes_at_once)  # FIFO: turns go in the order pushes came
        self._disabled = limit <= 0
        self._copying = 0  # pushes in notify_store now
        self._copying_into: collections.Counter[int] = collections.Counter()  # of those, how many into each inode

    @property
    def enabled(self) -> bool:
        return not self._disabled

    @contextlib.contextmanager
    def reading(self, ino: int, start: int, end: int) -> Iterator[None]:
        """Marks a READ in flight so no push overlaps it."""
        ranges = self._reading.setdefault(ino, [])
        entry = (start, end)
        self._reader_at[ino] = end
        self._reader_at.move_to_end(ino)
        if len(self._reader_at) > READERS_MAX:
            self._reader_at.popitem(last=False)
        ranges.append(entry)
        try:
            yield
        finally:
            ranges.remove(entry)
            if not ranges:
                del self._reading[ino]

    def _busy(self, ino: int, start: int, end: int) -> bool:
        return any(s < end and start < e for s, e in self._reading.get(ino, ()))

    def reader_near(self, ino: int, start: int, end: int) -> bool:
        """Whether [start, end) of `ino` lies where its latest reader's next READs are about to land."""
        at = self._reader_at.get(ino)
        return at is not None and start < at + self.reader_window and at < end

    def beside_readers(self, memory: int, readers: int) -> int:
        """Of `memory` bytes of chunks, what is left for fetching ahead beside the chunks that `readers` files
        being read sequentially have READs requested for (`reader_window` bytes each); never below 0."""
        return max(0, memory - max(1, readers) * self.reader_window)

    def release(self, nbytes: int) -> None:
        self.pushed = max(0, self.pushed - nbytes)
        if self.pushed == 0 and self.limit < self.initial_limit:
            self.limit = self.initial_limit  # no file holds pushes: the next load starts with the whole limit

    def evicted(self) -> bool:
        """The kernel dropped pages it was believed to hold of a file still open. True if memory is short (less
        than PRESSURE_FREE_SHARE of the mount's push limit free): the page cache cannot hold what is pushed, so
        pushing more would only evict what was pushed before the loader got to it. The limit is then halved,
        until no file holds pushes any more (`release`). False after an explicit drop, with memory free."""
        free = self._free_memory()
        if self._disabled or free is None or free >= self.initial_limit * PRESSURE_FREE_SHARE:
            return False
        self.limit //= 2
        log.info("the kernel evicted pushed pages with %d MiB free: pushing at most %d MiB until the files close",
                 free >> 20, self.limit >> 20)
        return True

    async def stop(self, timeout: float) -> bool:
        """No more pushes; waits (at most `timeout`) for those copying to end. Called before the FUSE loop stops
        reading requests: a notify_store waits for the locks of pages a READ queued in /dev/fuse holds, and once
        nobody reads that READ, the push, shielded, waited for good, and the daemon with it (even SIGKILL left a
        zombie until the connection was aborted). True if none is left."""
        self._disabled = True
        with trio.move_on_after(timeout):
            while self._copying:
                await trio.sleep(STOP_POLL_S)
        return not self._copying

    async def settled(self, ino: int, timeout: float = SETTLE_WAIT_S) -> bool:
        """Waits (at most `timeout`) until no push into `ino` is copying; True if none is. A rewrite in place keeps
        the inode and its stream stops at the O_TRUNC open (`ModelStreamer.rewritten`), but a push already in
        notify_store ends its copy: after the kernel emptied the inode at the open, its old pages stayed in the new
        file's cache, the last one zero-filled past the old version's end (B95's zeros, for a mapping of the old
        version). The open answers once it ended, so the kernel's truncate at the open's reply drops them."""
        with trio.move_on_after(timeout):
            while self._copying_into[ino]:
                await trio.sleep(STOP_POLL_S)
        return not self._copying_into[ino]

    async def push(self, ino: int, offset: int, length: int, take: Callable[[], Chunk | None]) -> bool:
        """Store `length` bytes at `offset` of `ino` in the page cache; False if skipped. At most
        `pushes_at_once` run at once, the others wait for a turn in the order they came, and the bytes are
        taken only when this one's turn comes: `take` returns them, or None
        when they are no longer wanted (READs took them meanwhile, or they left the daemon's memory).
        So queued pushes hold no chunk: a queued push cannot keep bytes the memory budget let go of,
        and cannot block a READ whose pages the kernel locked, which a push of that range waits for."""
        if self._disabled or self.pushed + length > self.limit:
            return False
        async with self._turn:
            # Again: the limit may have been lowered (`evicted`) or reached by the pushes that went first.
            if self._disabled or self.pushed + length > self.limit or self._busy(ino, offset, offset + length):
                return False
            data = take()
            if data is None:
                return False
            self.pushed += len(data)
            try:
                # Shielded: a push that ran is counted by its caller (streaming gives a file's pushes back
                # when it closes); a cancelled wait would leave these bytes counted forever. It is one
                # bounded copy into the page cache, and the trio thread stays free to answer READs.
                with trio.CancelScope(shield=True):
                    self._copying += 1
                    self._copying_into[ino] += 1
                    try:
                        await trio.to_thread.run_sync(pyfuse3.notify_store, ino, offset, data)
                    finally:
                        self._copying -= 1
                        self._copying_into[ino] -= 1
                        if not self._copying_into[ino]:
                            del self._copying_into[ino]
            except OSError as exc:
                self.pushed -= len(data)
                if exc.errno == errno.ENOSYS:
                    log.info("the kernel does not support notify_store; page-cache push disabled")
                    self._disabled = True
                else:
                    log.debug("notify_store of inode %d at %d failed: %s", ino, offset, exc)
                return False
        self.stored_total += len(data)
        return True
