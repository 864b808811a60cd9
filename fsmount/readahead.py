"""Per-handle read-ahead planning: which bytes to fetch ahead of the reader, as a pure state machine.

A handle keeps a few independent sequential streams, so interleaved readers sharing one handle (or
the kernel's reordered readahead requests) are each seen as sequential. It does no I/O and holds no
data: the handle turns its plans into chunk requests.

A stream is read ahead only once it has read more than `proven_after` bytes: the kernel's own read-ahead
window for a page-cache handle, one chunk for an O_DIRECT one. The kernel reads around every mmap fault
(read_ahead_kb of READs, 16 MiB as the mount sets it) and ahead of every small read(2), so a handful of
adjacent READs says nothing of the reader: when the window doubled on each of them, ten random touches of a
mapped 572 MiB file fetched 516 MiB, eight 4 KiB reads 264 MiB, and `torch.load(mmap=True)` of a .pt file
(small reads of each record's header) the whole file before one tensor was read.

What proves a stream, and how far its window grows, is its current run: the bytes it read with no forward skip
of more than RUN_GAP past where it was, beyond what was read ahead for it. Such a skip starts the proof over,
and the window doubles per READ but never past RUN_SHARE times the run, as Mountpoint-S3 grows its window only
as the reader consumes it: a reader that stops after 24 MiB of a large file is not fetched 256 MiB ahead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fsmount.config import MiB

# Mountpoint-S3: reads up to 16 MiB past the expected offset still count as sequential.
FORWARD_SEEK_TOLERANCE = 16 * MiB
# The kernel sends up to read_ahead_kb of READs at once and they may be served out of order, so a
# read this far behind a stream's position still belongs to it (default kernel readahead, 16 MiB).
BACKWARD_SEEK_TOLERANCE = 16 * MiB
# A forward skip of more than this (the kernel's largest READ) past a stream's position, beyond what was read
# ahead for it, starts the stream's proof over: READs of one sequential reader come in order or a little behind.
RUN_GAP = 1 * MiB
# A stream's window is at most this many times its current run.
RUN_SHARE = 2
# Enough for tensor-parallel ranks / loader threads sharing one handle (4-8 in practice).
MAX_STREAMS = 8
# How far ahead of a reader chunks a local cache level holds are read: a local NVMe read of a chunk takes
# milliseconds, and every chunk ahead holds a buffer of its own until READs take it (first-touch faults of
# fresh buffers cost ~0.4 CPU-s per GB on the dev box). Chunks only the origin has get the whole window.
LOCAL_WINDOW = 32 * MiB


@dataclasses.dataclass(eq=False)
class Stream:
    """One sequential reader. Identity matters: it owns the read-ahead it started."""

    next_offset: int
    window: int = 0
    ahead_to: int = 0
    last_used: int = 0
    run: int = 0  # bytes of the READs of its current run (since its last skip past RUN_GAP)


@dataclasses.dataclass
class Plan:
    stream: Stream
    ahead_start: int
    ahead_end: int
    dropped: list[Stream]


class ReadAhead:
    def __init__(self, chunk_size: int, max_window: int, *, proven_after: int = 0, max_streams: int = MAX_STREAMS,
                 forward_tolerance: int = FORWARD_SEEK_TOLERANCE,
                 backward_tolerance: int = BACKWARD_SEEK_TOLERANCE):
        self.chunk_size = chunk_size
        self.max_window = max_window
        self.proven_after = proven_after
        self.max_streams = max_streams
        self.forward_tolerance = forward_tolerance
        self.backward_tolerance = backward_tolerance
        self.streams: list[Stream] = []
        self._clock = 0

    def _match(self, offset: int) -> Stream | None:
        best = None
        for s in self.streams:
            ahead = max(self.forward_tolerance, s.window)
            if s.next_offset - self.backward_tolerance <= offset <= s.next_offset + ahead:
                if best is None or abs(offset - s.next_offset) < abs(offset - best.next_offset):
                    best = s
        return best

    def on_read(self, offset: int, size: int, file_size: int, window_cap: int | None = None,
                held_locally: Callable[[int], bool] | None = None) -> Plan:
        """Record a read of [offset, offset+size) and say what to read ahead. `held_locally(offset)` says
        whether a local cache level holds the byte at `offset`: if it holds the first byte the plan would
        read ahead, the window is at most LOCAL_WINDOW."""
        self._clock += 1
        end = offset + size
        dropped: list[Stream] = []
        stream = self._match(offset)
        if stream is None:
            # A new reader or a random access: no read-ahead until it proves sequential.
            stream = Stream(next_offset=end, ahead_to=end)
            if len(self.streams) >= self.max_streams:
                oldest = min(self.streams, key=lambda s: s.last_used)
                self.streams.remove(oldest)
                dropped.append(oldest)
            self.streams.append(stream)
        else:
            in_run = offset - stream.next_offset <= RUN_GAP
            if not in_run and offset >= stream.ahead_to:
                stream.window = stream.run = 0  # skipped past what was read ahead: to be proven again
            if end > stream.next_offset:
                stream.next_offset = end
            if in_run and stream.run + size > self.proven_after:
                # Doubling from one chunk to the maximum, as Mountpoint-S3 and gcsfuse grow theirs, as far as the run
                # has gone. A skip within what was read ahead keeps the window but does not grow it: random
                # readers land near some stream often enough on a small file.
                grown = min(stream.window * 2, RUN_SHARE * (stream.run + size))
                stream.window = min(self.max_window, max(self.chunk_size, grown))
        stream.run += size
        stream.last_used = self._clock
        window = stream.window if window_cap is None else min(stream.window, window_cap)
        start = max(stream.ahead_to, stream.next_offset)
        stop = min(file_size, stream.next_offset + window)
        if stop > start and window > LOCAL_WINDOW and held_locally is not None and held_locally(start):
            stop = min(stop, stream.next_offset + LOCAL_WINDOW)  # asked only when there is something to plan
        if stop > start:
            stream.ahead_to = stop
        else:
            start = stop = 0
        return Plan(stream, start, stop, dropped)

    def close(self) -> list[Stream]:
        streams, self.streams = self.streams, []
        return streams
