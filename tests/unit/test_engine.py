"""The chunk engine and per-handle read-ahead against the fake store, in trio's virtual time."""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import trio

import fsmount.data.trailing
import fsmount.readahead
from fsmount.data import (
    AccessDenied,
    ChunkEngine,
    ChunkId,
    NotFound,
    ObjectVersion,
    PreconditionFailed,
    StoreError,
    TimedOut,
    TransientError,
    Unreachable,
)
from fsmount.data.identity import new_buffer
from fsmount.data.levels import (
    DISK_THREADS,
    GET_DEADLINE_MIN_S,
    GET_DEADLINE_S,
    GONE_FOR_S,
    WRITE_DEADLINE_S,
    LevelStack,
)
from fsmount.data.store import SizeChanged
from fsmount.data.trailing import TRAIL_IDLE_S, WAITERS_CHECK_S
from fsmount.handles import OpenFile
from fsmount.readahead import LOCAL_WINDOW, ReadAhead
from tests.helpers import (
    CHUNK,
    LATENCY,
    MiB,
    make_engine,
    random_bytes,
    run_engine,
    version,
    virtual_latency_runner,
)
from tests.unit.fake_store import FakeStore


def put_object(store: FakeStore, key: str, size: int) -> bytes:
    data = random_bytes(size, seed=size)
    store.put(key, data)
    return data


# -- pure read-ahead state machine ----------------------------------------------------------------

def test_sequential_window_doubles_to_max_as_far_as_the_run_has_gone() -> None:
    ra = ReadAhead(CHUNK, 16 * MiB)
    plan = ra.on_read(0, 128 * 1024, 1 << 30)
    assert plan.ahead_end == plan.ahead_start  # not yet proven sequential
    windows = []
    off = 128 * 1024
    for _ in range(80):
        plan = ra.on_read(off, 128 * 1024, 1 << 30)
        off += 128 * 1024
        windows.append(plan.stream.window)
        assert plan.stream.window <= max(CHUNK, 2 * off)  # never more than twice what the reader has read
    assert windows[:3] == [1 * MiB, 1 * MiB, 1 * MiB]  # one chunk until the run is half a chunk
    assert windows == sorted(windows) and windows[-1] == 16 * MiB
    assert windows.index(16 * MiB) == 62  # once 8 MiB are read, 64 READs in
    assert plan.ahead_end == off + 16 * MiB


def test_a_window_over_chunks_a_local_level_holds_reaches_local_window_only() -> None:
    """Chunks on local disk take milliseconds: reading them the whole window ahead only takes buffers early.
    Chunks only the origin has still get the whole window, in the same stream."""
    ra = ReadAhead(CHUNK, 256 * MiB)
    on_disk_from = 512 * MiB  # the second half of the file is on local disk
    asked: list[tuple[int, int]] = []

    def held_locally(at: int) -> bool:
        asked.append((at, ra.streams[0].ahead_to))
        return at >= on_disk_from

    ahead = {}
    for i in range(1024):
        plan = ra.on_read(i * MiB, MiB, 1 << 30, None, held_locally)
        ahead[i] = plan.stream.ahead_to - plan.stream.next_offset
    assert min(ahead[i] for i in range(128, 250)) >= 255 * MiB  # in the origin's half: the whole window
    assert max(ahead[i] for i in range(on_disk_from // MiB, 1023)) <= LOCAL_WINDOW
    assert min(ahead[i] for i in range(on_disk_from // MiB, 1000)) > 0  # ahead still, only not as far
    # It is asked about the first byte the plan would read ahead, nothing else.
    assert all(at == max(ahead_to, at) for at, ahead_to in asked)


def test_prefetch_ranges_do_not_overlap() -> None:
    ra = ReadAhead(CHUNK, 8 * MiB)
    covered = []
    for i in range(40):
        p = ra.on_read(i * MiB, MiB, 1 << 30)
        if p.ahead_end > p.ahead_start:
            covered.append((p.ahead_start, p.ahead_end))
    for (_, a1), (b0, _) in zip(covered, covered[1:], strict=False):
        assert a1 <= b0


def test_a_forward_skip_within_what_was_read_ahead_keeps_the_stream_and_its_window() -> None:
    ra = ReadAhead(CHUNK, 64 * MiB)
    for i in range(16):
        ra.on_read(i * MiB, MiB, 1 << 30)
    window = ra.streams[0].window
    assert window == 32 * MiB and ra.streams[0].ahead_to == 48 * MiB
    plan = ra.on_read(16 * MiB + 10 * MiB, MiB, 1 << 30)  # skip 10 MiB forward, into what was read ahead
    assert len(ra.streams) == 1 and plan.stream.window == window
    assert plan.ahead_end == 27 * MiB + window


def test_skips_past_what_was_read_ahead_prove_nothing() -> None:
    """`torch.load(mmap=True)` reads each record's zip header, a few MiB apart across the whole file: READs that
    joined one stream, proved it and read the file ahead to 256 MiB. Each skip past what was read ahead starts the
    proof over."""
    ra = ReadAhead(CHUNK, 256 * MiB, proven_after=16 * MiB)
    offset = 0
    for i in range(60):
        plan = ra.on_read(offset, MiB, 1 << 40)
        assert plan.ahead_end == plan.ahead_start == 0 and plan.stream.window == 0, i
        offset += MiB + (2 + i % 5) * MiB  # the next record's header, 2-6 MiB on
    assert len(ra.streams) == 1
    # The same READs read one after the other are a sequential reader.
    for i in range(18):
        plan = ra.on_read(offset + i * MiB, MiB, 1 << 40)
    assert plan.stream.window > 0 and plan.ahead_end > plan.ahead_start


def test_far_seek_and_random_access_do_not_prefetch() -> None:
    ra = ReadAhead(CHUNK, 64 * MiB)
    rng = random.Random(1)
    for _ in range(50):
        plan = ra.on_read(rng.randrange(0, 1 << 40) & ~0xFFF, 4096, 1 << 41)
        assert plan.ahead_end - plan.ahead_start == 0
    assert len(ra.streams) <= ra.max_streams


def test_no_window_until_the_stream_has_read_more_than_the_kernel_reads_around_a_fault() -> None:
    """A mmap fault makes the kernel send 16 MiB of READs around it; 4 KiB reads are 4 KiB read. Neither is a
    sequential reader yet, however many adjacent READs it took."""
    ra = ReadAhead(CHUNK, 256 * MiB, proven_after=16 * MiB)
    for i in range(16):
        plan = ra.on_read(100 * MiB + i * MiB, MiB, 1 << 40)
        assert plan.ahead_end == plan.ahead_start == 0 and plan.stream.window == 0
    for i in range(64):
        plan = ra.on_read(i * 4096, 4096, 1 << 40)
        assert plan.ahead_end == plan.ahead_start == 0
    # The next READ of the first stream proves it: the window grows from there, doubling per READ up to twice
    # the run (17 MiB read: 34 MiB), then with the run, to the maximum once 128 MiB are read.
    plan = ra.on_read(116 * MiB, MiB, 1 << 40)
    assert plan.stream.window == CHUNK and plan.ahead_end == 117 * MiB + CHUNK
    windows = []
    for i in range(1, 113):
        plan = ra.on_read((116 + i) * MiB, MiB, 1 << 40)
        windows.append(plan.stream.window)
    assert windows[:7] == [2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB, 46 * MiB, 48 * MiB]
    assert windows[-1] == 256 * MiB and windows.index(256 * MiB) == 110


def test_backward_read_within_buffer_keeps_stream() -> None:
    ra = ReadAhead(CHUNK, 64 * MiB)
    for i in range(4):
        ra.on_read(i * MiB, MiB, 1 << 30)
    ra.on_read(2 * MiB, MiB, 1 << 30)  # reordered kernel readahead request
    assert len(ra.streams) == 1 and ra.streams[0].next_offset == 4 * MiB


def test_four_interleaved_readers_each_get_a_stream() -> None:
    ra = ReadAhead(CHUNK, 32 * MiB)
    quarter = 256 * MiB
    for step in range(20):
        for r in range(4):
            plan = ra.on_read(r * quarter + step * MiB, MiB, 1 << 30)
    assert len(ra.streams) == 4
    assert all(s.window == 32 * MiB for s in ra.streams)
    assert plan.ahead_end > plan.ahead_start or plan.stream.ahead_to >= plan.stream.next_offset


def test_dropped_streams_are_reported() -> None:
    ra = ReadAhead(CHUNK, 32 * MiB, max_streams=2)
    ra.on_read(0, MiB, 1 << 40)
    ra.on_read(1 << 34, MiB, 1 << 40)
    plan = ra.on_read(1 << 36, MiB, 1 << 40)
    assert len(plan.dropped) == 1 and plan.dropped[0].next_offset == MiB


# -- engine + handle with the fake store ----------------------------------------------------------

async def test_sequential_read_is_exact_and_prefetches(autojump_clock) -> None:  # noqa: ANN001
    store = FakeStore()
    data = put_object(store, "m", 40 * MiB + 123)
    engine = make_engine(store)

    async def body() -> None:
        h = OpenFile(1, 2, version(store, "m"), engine, max_readahead=16 * MiB)
        out = bytearray()
        off = 0
        start = trio.current_time()
        while True:
            chunk = await h.read(off, 128 * 1024)
            if not chunk:
                break
            out += chunk
            off += len(chunk)
        elapsed = trio.current_time() - start
        assert bytes(out) == data
        # 41 chunks at 50 ms each: serial would take 2 s; read-ahead with 4 connections far less.
        assert elapsed < 41 * LATENCY / 2.5
        assert len(store.gets) == 41  # every chunk fetched exactly once
        h.close()

    await run_engine(engine, body)


async def test_a_read_of_a_chunk_believed_in_the_page_cache_has_its_file_read_ahead_again(autojump_clock) -> None:  # noqa: ANN001, E501
    """Chunks pushed (or read whole) are believed held by the page cache and not read ahead. A READ of one
    proves the kernel dropped it since (evicted, or the page cache dropped): every belief about that file goes,
    so a sequential re-read is read ahead again instead of waiting for each chunk in turn; other files keep
    theirs. Operations.read calls kernel_lacks before each READ, as here."""
    store = FakeStore()
    data = put_object(store, "m", 40 * MiB + 123)
    put_object(store, "other", 4 * MiB)
    engine = make_engine(store)
    m, other = version(store, "m"), version(store, "other")
    for v in (m, other):
        for index in engine.chunk_range(v, 0, v.size):
            engine.memory.demote(engine.chunk_id(v, index))  # as model streaming does after each push

    async def body() -> None:
        h = OpenFile(1, 2, m, engine, max_readahead=16 * MiB)
        out = bytearray()
        dropped = []
        start = trio.current_time()
        held = {v.key: lambda v=v: [engine.memory.in_page_cache(engine.chunk_id(v, i))
                                    for i in engine.chunk_range(v, 0, v.size)] for v in (m, other)}
        while len(out) < len(data):
            dropped.append(engine.kernel_lacks(m, len(out), len(out) + 128 * 1024))
            if len(dropped) == 1:
                assert not any(held["m"]()) and all(held["other"]())
            out += await h.read(len(out), 128 * 1024)
        elapsed = trio.current_time() - start
        assert bytes(out) == data
        # The first READ told; later ones find only chunks READs took whole since (believed held again).
        assert dropped[0] and not any(dropped[1:])
        assert engine.stats.pagecache_drops == 1  # what `modelfs stats` shows
        # Read ahead as a first read is (test_sequential_read_is_exact_and_prefetches); each chunk in turn
        # would take 41 latencies.
        assert elapsed < 41 * LATENCY / 2.5
        h.close()

    await run_engine(engine, body)


async def test_random_reads_fetch_single_chunks(autojump_clock) -> None:  # noqa: ANN001
    store = FakeStore()
    data = put_object(store, "m", 64 * MiB)
    engine = make_engine(store)
    rng = random.Random(7)

    async def body() -> None:
        h = OpenFile(1, 2, version(store, "m"), engine, max_readahead=64 * MiB)
        for _ in range(20):
            off = rng.randrange(0, len(data) - 4096)
            assert await h.read(off, 4096) == data[off:off + 4096]
        assert len(store.gets) <= 20 * 2  # a read can straddle two chunks; no read-ahead

    await run_engine(engine, body)


async def test_single_flight_many_readers_one_fetch(autojump_clock) -> None:  # noqa: ANN001
    store = FakeStore()
    data = put_object(store, "m", 4 * MiB)
    engine = make_engine(store)

    async def body() -> None:
        results = []

        async def reader(i: int) -> None:
            results.append(bytes(await engine.read(version(store, "m"), i * 1000, i * 1000 + 5000)))

        async with trio.open_nursery() as n:
            for i in range(16):
                n.start_soon(reader, i)
        assert len(store.gets) == 1
        assert sorted(results) == sorted(data[i * 1000:i * 1000 + 5000] for i in range(16))

    await run_engine(engine, body)


async def test_four_interleaved_readers_share_chunks(autojump_clock) -> None:  # noqa: ANN001
    store = FakeStore()
    data = put_object(store, "m", 128 * MiB)
    engine = make_engine(store, conns=8, memory=256 * MiB)

    async def body() -> None:
        h = OpenFile(1, 2, version(store, "m"), engine, max_readahead=8 * MiB)
        quarter = len(data) // 4
        outs = [bytearray() for _ in range(4)]
        for step in range(quarter // (256 * 1024)):
            for r in range(4):
                off = r * quarter + step * 256 * 1024
                outs[r] += await h.read(off, 256 * 1024)
        assert b"".join(outs) == data
        assert len(store.gets) == 128  # each chunk once: no thrash, no tiny reads
        assert len(h.readahead.streams) == 4

    await run_engine(engine, body)


async def test_close_during_prefetch_drops_queued_fetches(autojump_clock) -> None:  # noqa: ANN001
    store = FakeStore()
    put_object(store, "m", 256 * MiB)
    engine = make_engine(store, conns=2, memory=512 * MiB)

    async def body() -> None:
        h = OpenFile(1, 2, version(store, "m"), engine, max_readahead=128 * MiB)
        for i in range(8):
            await h.read(i * MiB, MiB)
        h.close()
        await trio.sleep(10)
        # Only what was already running (2 connections) finished after close.
        assert len(store.gets) < 8 + 2 + 2
        assert engine.stats.readahead_dropped > 0
        assert not engine._inflight

    await run_engine(engine, body)


async def test_a_chunk_the_origin_sends_again_is_counted(autojump_clock) -> None:  # noqa: ANN001
    """Bytes the origin sent twice (a chunk evicted from memory before a READ wanted it again) show in the
    stats, so that over-fetch under a small --memory-limit is visible without comparing sizes by hand."""
    store = FakeStore()
    data = put_object(store, "m", 8 * CHUNK)
    engine = make_engine(store, memory=4 * CHUNK)
    v = version(store, "m")

    async def body() -> None:
        assert await engine.read(v, 0, 10) == data[:10]
        assert await engine.read(v, 20, 30) == data[20:30]  # in memory: no GET
        assert engine.levels.stats.origin_refetched_bytes == 0
        for i in range(1, 8):  # four chunks of memory: chunk 0 is evicted
            assert await engine.read(v, i * CHUNK, i * CHUNK + 10) == data[i * CHUNK:i * CHUNK + 10]
        assert engine.levels.stats.origin_refetched_bytes == 0
        assert await engine.read(v, 5, 15) == data[5:15]
        stats = engine.levels.stats
        assert stats.origin_refetched_bytes == CHUNK and stats.origin_bytes == 9 * CHUNK

    await run_engine(engine, body)


async def test_memory_limit_is_never_exceeded(autojump_clock) -> None:  # noqa: ANN001
    store = FakeStore()
    files = {f"f{i}": put_object(store, f"f{i}", 32 * MiB + i) for i in range(4)}
    limit = 8 * MiB
    engine = make_engine(store, memory=limit, conns=8)
    peak = 0

    async def body() -> None:
        nonlocal peak

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, engine.memory.used)
                await trio.sleep(0.001)

        async def reader(key: str) -> None:
            h = OpenFile(1, 2, version(store, key), engine, max_readahead=64 * MiB)
            out = bytearray()
            while chunk := await h.read(len(out), 512 * 1024, window_cap=limit // 8):
                out += chunk
            assert bytes(out) == files[key]
            h.close()

        async with trio.open_nursery() as n:
            n.start_soon(watch)
            async with trio.open_nursery() as readers:
                for key in files:
                    readers.start_soon(reader, key)
            n.cancel_scope.cancel()
        assert 0 < peak <= limit

    await run_engine(engine, body)


async def test_sixteen_readers_in_four_chunks_of_memory_take_turns_instead_of_evicting_each_other(  # noqa: ANN001
        autojump_clock) -> None:
    """Each chunk a reader is reading front to back stays until it has gone unused IN_USE_S: 16 readers in 4 chunks
    of memory evicted each other's chunks between READs, fetched every chunk up to 8 times and timed out."""
    store = FakeStore()
    files = {f"f{i}": put_object(store, f"f{i}", 4 * CHUNK + i) for i in range(16)}
    engine = make_engine(store, memory=4 * CHUNK, conns=16, timeout=5.0)

    async def reader(key: str) -> None:
        v, out = version(store, key), bytearray()
        while len(out) < v.size:
            out += await engine.read(v, len(out), len(out) + CHUNK // 8)
            await trio.sleep(0.001)
        assert bytes(out) == files[key]

    async def body() -> None:
        async with trio.open_nursery() as readers:
            for key in files:
                readers.start_soon(reader, key)

    await run_engine(engine, body)
    assert len(store.gets) == sum(-(-len(d) // CHUNK) for d in files.values())  # every chunk once


async def test_a_chunk_read_at_random_or_left_mid_way_holds_no_room_past_in_use_s(autojump_clock) -> None:  # noqa: ANN001
    """A chunk entered in its middle is random access, even if READs go on from there: it is evicted at once when
    room is needed (keeping those cost 16 random readers 39 EIO). A chunk a reader began at its start and then
    left holds its room IN_USE_S, no longer."""
    from fsmount.data.budget import IN_USE_S

    store = FakeStore()
    data = put_object(store, "m", 10 * CHUNK)
    engine = make_engine(store, memory=4 * CHUNK, conns=4, timeout=5.0)
    v = version(store, "m")

    async def timed_read(index: int, offset: int) -> float:
        start = trio.current_time()
        lo = index * CHUNK + offset
        assert await engine.read(v, lo, lo + 100) == data[lo:lo + 100]
        return trio.current_time() - start

    async def body() -> None:
        for index in range(4):
            await timed_read(index, CHUNK // 2)
            await timed_read(index, CHUNK // 2 + 100)  # read on from there, as the kernel's read-ahead of a pread is
        assert await timed_read(4, CHUNK // 2) == pytest.approx(LATENCY)
        for index in range(5, 9):
            await timed_read(index, 0)  # memory is now 4 chunks begun at their start
        took = await timed_read(9, 0)  # waits until the first of them (3 reads ago) has gone unused IN_USE_S
        assert IN_USE_S - 3 * LATENCY <= took <= IN_USE_S + LATENCY

    await run_engine(engine, body)


@pytest.mark.parametrize("readers", [1, 2])
async def test_a_read_of_more_chunks_than_memory_holds_gets_them_in_turn(autojump_clock, readers: int) -> None:  # noqa: ANN001
    """One READ of 16 chunks in 4 chunks of memory (an O_DIRECT read of 1 MiB over 64 KiB chunks), or two at once: the
    chunk fetches get room in the order they asked, so the READ takes each chunk as it lands and frees its room for
    the next. Woken all at once, later chunks took the room first and, in use (their READ waits for them), held it
    IN_USE_S while the READ waited for an earlier one: 1.25-2.2 s for 0.2 s of GETs, EIO at a 3 s --read-timeout."""
    from fsmount.data.budget import IN_USE_S

    store = FakeStore()
    files = {f"m{i}": put_object(store, f"m{i}", 16 * CHUNK + i) for i in range(readers)}
    engine = make_engine(store, memory=4 * CHUNK, conns=16, timeout=30.0)
    took: list[float] = []

    async def read(key: str) -> None:
        start = trio.current_time()
        assert await engine.read(version(store, key), 0, 16 * CHUNK) == files[key][:16 * CHUNK]
        took.append(trio.current_time() - start)

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            for key in files:
                nursery.start_soon(read, key)

    await run_engine(engine, body)
    assert max(took) <= readers * 16 / 4 * LATENCY + LATENCY < IN_USE_S, took
    assert len(store.gets) == 16 * readers  # every chunk once


async def test_store_error_reaches_the_reader_and_is_not_cached(autojump_clock, allowed_logs) -> None:  # noqa: ANN001
    allowed_logs.append("fetching chunk .* failed")
    store = FakeStore()
    data = put_object(store, "m", 3 * MiB)
    engine = make_engine(store)
    failures = [1]

    def fault(key: str, start: int, end: int) -> None:
        if failures:
            failures.pop()
            raise TransientError("injected")

    store.fault = fault

    async def body() -> None:
        with pytest.raises(StoreError):
            await engine.read(version(store, "m"), 0, 100)
        assert await engine.read(version(store, "m"), 0, 100) == data[:100]

    await run_engine(engine, body)


async def test_a_version_the_bucket_refused_fails_its_other_chunks_without_a_get_for_a_while(  # noqa: ANN001
        autojump_clock, allowed_logs) -> None:
    """A replaced object: one refused GET marks its version gone for GONE_FOR_S, not for good (the same bytes
    uploaded again are the same version)."""
    allowed_logs.append("fetching chunk .* failed")
    store = FakeStore()
    data = put_object(store, "m", 4 * MiB)
    engine = make_engine(store)
    old = version(store, "m")

    async def body() -> None:
        store.put("m", b"new" + data[3:])
        for index in range(3):
            with pytest.raises(PreconditionFailed):
                await engine.read(old, index * MiB, index * MiB + 100)
        assert len(store.gets) == 1
        store.put("m", data)  # the old bytes again: the same ETag
        await trio.sleep(GONE_FOR_S)
        assert await engine.read(old, 2 * MiB, 2 * MiB + 100) == data[2 * MiB:2 * MiB + 100]
        assert len(store.gets) == 2

    await run_engine(engine, body)


@pytest.mark.parametrize("etag", [True, False], ids=["etag", "no-etag"])
async def test_a_version_pinned_at_another_size_than_the_origin_s_is_refused_not_read_short(  # noqa: ANN001
        autojump_clock, allowed_logs, etag: bool) -> None:
    """A version pinned at a size smaller than the object's (a HEAD cut inside its Content-Length line), with its right
    ETag: every GET matched, and the file read back short as if whole. The size reaches the store's GET, which refuses
    it (SizeChanged, a PreconditionFailed): no bytes served, one GET (not retried), the version gone (B209). Where the
    server gives no ETag, the size is the one thing an answer says of the version: an object replaced by one of
    another size is refused so too."""
    allowed_logs.append("fetching chunk .* failed")
    store = FakeStore()
    data = put_object(store, "m", 3 * MiB)
    engine = make_engine(store)
    short = dataclasses.replace(version(store, "m"), size=MiB + 10, **({} if etag else {"etag": ""}))

    async def body() -> None:
        with pytest.raises(SizeChanged, match=f"object is {3 * MiB} bytes, its version was pinned at {MiB + 10}"):
            await engine.read(short, 0, 100)
        assert len(store.gets) == 1 and engine.levels._gone  # noqa: SLF001 - gone, as a 412's version
        whole = dataclasses.replace(short, size=len(data))
        assert await engine.read(whole, 0, 100) == data[:100]  # the size the store says: read

    await run_engine(engine, body)


@pytest.mark.parametrize("first", ["short", "whole"])
async def test_a_fetch_pinned_at_another_size_of_the_same_etag_is_not_joined(autojump_clock, allowed_logs,  # noqa: ANN001
                                                                              first: str) -> None:
    """Two handles of one ETag pinned at two sizes (the one a HEAD cut inside its Content-Length line gave, and the
    right one the next lookup gave, B209) read the same chunk at once: the chunk id has no size, so the second joined
    the first's fetch and got its answer. The right handle got the wrong one's SizeChanged (EIO, its good inode
    superseded), or the wrong one got the bytes unchecked. Each now has a fetch of its own size (B213)."""
    allowed_logs.append("fetching chunk .* failed")
    store = FakeStore()
    data = put_object(store, "m", 3 * MiB)
    engine = make_engine(store)
    whole = version(store, "m")
    short = dataclasses.replace(whole, size=MiB + 10)
    outcomes: dict[str, object] = {}

    async def read(which: str, obj: ObjectVersion) -> None:
        try:
            outcomes[which] = bytes(await engine.read(obj, 0, 100))
        except SizeChanged as exc:
            outcomes[which] = exc

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            order = [("short", short), ("whole", whole)] if first == "short" else [("whole", whole), ("short", short)]
            nursery.start_soon(read, *order[0])
            await trio.sleep(LATENCY / 2)  # its GET in flight
            nursery.start_soon(read, *order[1])
        assert outcomes["whole"] == data[:100]
        assert isinstance(outcomes["short"], SizeChanged)

    await run_engine(engine, body)


@pytest.mark.parametrize("short_by", [MiB - 10, -MiB // 2], ids=["pinned-smaller", "pinned-larger"])
async def test_a_chunk_in_memory_is_not_served_to_a_version_pinned_at_another_size(autojump_clock,  # noqa: ANN001
                                                                                   allowed_logs, short_by: int) -> None:
    """A right handle read the file, so its chunks are in memory; a handle of the same ETag pinned at another size (a
    HEAD cut inside its Content-Length line, B209) then read its last chunk. The chunk id names no size, so the chunk
    in memory was served without a GET to refuse it: the file read back short as if whole (pinned smaller), or a
    READ came back short in the middle (pinned larger). A chunk in memory now counts only at the length its version
    gives; otherwise the version's own GET decides: SizeChanged, no bytes (B290)."""
    allowed_logs.append("fetching chunk .* failed")
    store = FakeStore()
    data = put_object(store, "m", 3 * MiB - MiB // 2)
    engine = make_engine(store)
    whole = version(store, "m")
    other = dataclasses.replace(whole, size=whole.size - short_by)
    last = (other.size - 1) // MiB * MiB  # the other handle's last chunk, held in memory at another length

    async def body() -> None:
        assert await engine.read(whole, 0, len(data)) == data
        gets = len(store.gets)
        with pytest.raises(SizeChanged):
            await engine.read(other, last, other.size)
        assert len(store.gets) == gets + 1  # its own GET, refused
        assert await engine.read(whole, 0, len(data)) == data  # the right handle is served as before

    await run_engine(engine, body)


@pytest.mark.parametrize("down_s, outcome", [(3.0, "exact"), (3600.0, "error")])
async def test_an_unreachable_origin_is_waited_for_until_the_deadline(autojump_clock, allowed_logs,  # noqa: ANN001
                                                                      down_s: float, outcome: str) -> None:
    """Connections refused (a restarting origin): a demand read waits for it up to --read-timeout, with
    backed-off retries, and gets exact bytes if it returns in time, an error at the deadline if not."""
    allowed_logs.append("fetching chunk .* failed")
    store = FakeStore()
    data = put_object(store, "m", 3 * MiB)
    engine = make_engine(store, timeout=30.0)
    attempts: list[float] = []

    def fault(key: str, start: int, end: int) -> None:
        attempts.append(trio.current_time())
        if trio.current_time() < down_s:
            raise Unreachable("connection refused")

    store.fault = fault

    async def body() -> None:
        start = trio.current_time()
        if outcome == "exact":
            assert await engine.read(version(store, "m"), 0, 100) == data[:100]
            assert trio.current_time() - start < 30.0
        else:
            with pytest.raises(StoreError, match=r"timed out after 30s \(the origin: connection refused\)"):
                await engine.read(version(store, "m"), 0, 100)  # says why, not "timed out" alone
            assert trio.current_time() - start <= 30.0 + LATENCY
            await trio.sleep(5)  # the fetch gives up at its deadline
            assert engine.stats.fetches_inflight == 0
            # Backed off, not a tight loop: 0.25 s doubling to 4 s within 30 s is 11 requests.
            assert len(attempts) <= 12, attempts
        assert len(attempts) >= 2
        # One fetch: one error if it failed in the end, none for the tries that were refused on the way, and one
        # latency sample, its retries included.
        stats = engine.levels.stats
        assert (stats.origin_errors, stats.origin_requests) == (int(outcome == "error"), len(attempts))
        assert engine.levels.origin_latency.read()[1] == 1

    await run_engine(engine, body)


def timing_out_runner(stalls: dict[int, int], timeout: float):  # noqa: ANN201
    """Blocking calls run as `virtual_latency_runner`'s, but a GET of chunk i, `stalls[i]` times, takes `timeout`
    and ends in `TimedOut`, as the store's GET of a head or body that stalled for --read-timeout does."""
    async def run(fn, *args, limiter):  # noqa: ANN001, ANN202
        async with limiter:
            if fn.__name__ == "get_range":
                index = args[2] // CHUNK
                if stalls.get(index, 0) > 0:
                    stalls[index] -= 1
                    await trio.sleep(timeout)
                    raise TimedOut(f"GET of chunk {index}: timed out")
                await trio.sleep(LATENCY)
            return fn(*args)
    return run


async def test_chunks_that_time_out_on_every_try_hold_no_thread_past_their_reads(autojump_clock,  # noqa: ANN001
                                                                                 allowed_logs) -> None:
    """B420: with --max-connections 2, two chunks whose GET times out on every try: their READs fail at their
    deadline, and their fetches end with the try that outlasted it, so the READ of a healthy chunk waiting for a
    thread gets one then, and a READ after gets one at once. Tried again for nobody, they held both threads for 5
    tries of --read-timeout."""
    allowed_logs.append("fetching chunk .* failed")
    store = FakeStore()
    data = put_object(store, "m", 4 * MiB)
    stalls = {0: 100, 1: 100}
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=64 * MiB, max_connections=2, read_timeout=10.0,
                         run_blocking=timing_out_runner(stalls, 10.0))
    v = version(store, "m")

    async def body() -> None:
        async def stalled_read(index: int) -> None:
            with pytest.raises(StoreError, match="timed out after 10s"):
                await engine.read(v, index * MiB, index * MiB + 100)

        async def healthy_read(index: int) -> None:
            assert await engine.read(v, index * MiB, index * MiB + 100) == data[index * MiB:index * MiB + 100]
            assert trio.current_time() == pytest.approx(10 + LATENCY)  # the first thread free

        async with trio.open_nursery() as nursery:
            for index in (0, 1):
                nursery.start_soon(stalled_read, index)
            await trio.sleep(5)
            nursery.start_soon(healthy_read, 2)
        start = trio.current_time()
        assert await engine.read(v, 3 * MiB, 3 * MiB + 100) == data[3 * MiB:3 * MiB + 100]
        assert trio.current_time() - start == pytest.approx(LATENCY)
        assert stalls == {0: 99, 1: 99}  # one try each
        assert engine.stats.fetches_inflight == 0

    await run_engine(engine, body)


async def test_a_try_that_timed_out_is_tried_again_while_a_read_waits(autojump_clock) -> None:  # noqa: ANN001
    """B420: a chunk read ahead whose GET timed out, and that a READ asked for while it ran, is tried again for that
    READ (until its deadline): the READ gets its bytes, not the timeout of a try begun before it asked."""
    store = FakeStore()
    data = put_object(store, "m", 2 * MiB)
    stalls = {0: 1}
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=64 * MiB, max_connections=2, read_timeout=10.0,
                         run_blocking=timing_out_runner(stalls, 10.0))
    v = version(store, "m")

    async def body() -> None:
        engine.fetch(v, 0, object())  # read ahead: its first try times out at 10 s
        await trio.sleep(5)
        assert await engine.read(v, 0, 100) == data[:100]  # asked at 5 s: its deadline is 15 s
        assert trio.current_time() == pytest.approx(10 + 0.25 + LATENCY)  # after the backoff, one try more
        assert stalls == {0: 0}

    await run_engine(engine, body)


async def test_changed_object_is_an_error_never_mixed_bytes(autojump_clock, allowed_logs) -> None:  # noqa: ANN001
    allowed_logs.append("fetching chunk .* failed")
    store = FakeStore()
    put_object(store, "m", 3 * MiB)
    v = version(store, "m")
    engine = make_engine(store)

    async def body() -> None:
        assert len(await engine.read(v, 0, 100)) == 100
        store.put("m", os.urandom(3 * MiB))
        with pytest.raises(StoreError, match="changed"):
            await engine.read(v, 2 * MiB, 2 * MiB + 100)

    await run_engine(engine, body)


async def test_a_repeated_read_of_a_stalled_chunk_fails_at_the_first_deadline(autojump_clock) -> None:  # noqa: ANN001
    """The kernel re-sends a READ that failed; the retry must not wait a second full timeout."""
    store = FakeStore()
    put_object(store, "m", 2 * MiB)
    engine = make_engine(store, timeout=5.0, latency=3600.0)

    async def body() -> None:
        start = trio.current_time()
        with pytest.raises(StoreError, match="timed out"):
            await engine.read(version(store, "m"), 0, 100)
        with pytest.raises(StoreError, match="timed out"):
            await engine.read(version(store, "m"), 4096, 8192)
        assert trio.current_time() - start == pytest.approx(5.0)

    await run_engine(engine, body)


async def test_a_later_read_of_a_timed_out_chunk_gets_a_fresh_fetch(autojump_clock) -> None:  # noqa: ANN001
    """A fetch still retrying long after its deadline is not inherited by a new read(2): that read starts
    its own GET, which succeeds as soon as the origin answers again."""
    store = FakeStore()
    data = put_object(store, "m", 2 * MiB)
    stalled = True
    gets_started = 0

    async def run(fn, *args, limiter):  # noqa: ANN001, ANN202
        nonlocal gets_started
        async with limiter:
            if fn.__name__ == "get_range":
                gets_started += 1
                await trio.sleep(3600.0 if stalled else LATENCY)
            return fn(*args)

    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=64 * MiB, max_connections=4,
                         read_timeout=5.0, run_blocking=run)

    async def body() -> None:
        nonlocal stalled
        v = version(store, "m")
        with pytest.raises(StoreError, match="timed out"):
            await engine.read(v, 0, 100)
        stalled = False
        await trio.sleep(10.0)  # the first GET is still stalled; the application tries again
        start = trio.current_time()
        assert await engine.read(v, 0, 100) == data[:100]
        assert trio.current_time() - start == pytest.approx(LATENCY)
        assert gets_started == 2

    await run_engine(engine, body)


def stalling_runner(stalled: set[str]):  # noqa: ANN201
    """GETs of the keys in `stalled` hang for an hour; the others take LATENCY (virtual time)."""
    async def run(fn, *args, limiter):  # noqa: ANN001, ANN202
        async with limiter:
            if fn.__name__ == "get_range":
                await trio.sleep(3600.0 if args[0] in stalled else LATENCY)
            return fn(*args)
    return run


async def test_a_read_timeout_names_only_its_own_chunk_s_origin_failure(autojump_clock, allowed_logs) -> None:  # noqa: ANN001, E501
    """The timeout's cause was the stack's latest origin failure, whatever chunk it was of: a READ that timed out on a
    stalled GET was said to have failed for another object's 404 (the second review)."""
    allowed_logs.append("fetching chunk .* failed")
    store = FakeStore()
    put_object(store, "stalled", 2 * CHUNK)
    put_object(store, "gone", 2 * CHUNK)
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=16 * CHUNK, max_connections=4, read_timeout=5.0,
                         run_blocking=stalling_runner({"stalled"}))

    def fault(key: str, start: int, end: int) -> None:
        if key == "gone":
            raise NotFound("no such key 'gone'")

    store.fault = fault
    stalled, gone = version(store, "stalled"), version(store, "gone")

    async def body() -> None:
        with pytest.raises(StoreError, match="no such key"):
            await engine.read(gone, 0, 100)
        with pytest.raises(StoreError) as timed_out:
            await engine.read(stalled, 0, 100)
        assert "timed out after 5s" in str(timed_out.value) and "the origin" not in str(timed_out.value)

    await run_engine(engine, body)


@pytest.mark.parametrize("answered", ["nothing", "origin", "level"])
async def test_reads_that_come_just_after_a_timeout_with_the_origin_silent_fail_at_once(autojump_clock,  # noqa: ANN001
                                                                                       answered: str) -> None:
    """READs the kernel held behind the ones that timed out belong to the same read(2) calls: with an origin
    that finished nothing meanwhile they fail at once, not a timeout later (12 readers failed at twice
    --read-timeout). Past RETRY_GRACE_S a READ gets a timeout of its own; a fetch that succeeded during the wait, from
    the origin or a level (`answered`), means nothing is failed at once, nor is a chunk a local level holds."""
    from fsmount.data.engine import RETRY_GRACE_S

    store = FakeStore()
    data = put_object(store, "m", 8 * CHUNK)
    put_object(store, "fast", CHUNK)
    level = IndexedLevel()
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=64 * MiB, max_connections=8, read_timeout=5.0,
                         levels=[level], run_blocking=stalling_runner({"m"}))
    v = version(store, "m")
    level.chunks[engine.chunk_id(v, 7)] = data[7 * CHUNK:]

    async def fails_after(chunk: int) -> float:
        start = trio.current_time()
        with pytest.raises(StoreError, match="timed out"):
            await engine.read(v, chunk * CHUNK, chunk * CHUNK + 100)
        return trio.current_time() - start

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fails_after, 0)
            await trio.sleep(1.0)
            if answered == "origin":
                await engine.read(version(store, "fast"), 0, 100)
            elif answered == "level":  # a shared tier serves the fleet while the origin is down
                await engine.read(v, 7 * CHUNK, 7 * CHUNK + 100)
        await trio.sleep(0.2)
        if answered != "nothing":
            assert await fails_after(1) == pytest.approx(5.0)
            return
        assert await fails_after(1) == 0.0
        assert await engine.read(v, 7 * CHUNK, 7 * CHUNK + 100) == data[7 * CHUNK:7 * CHUNK + 100]
        await trio.sleep(RETRY_GRACE_S)
        assert await fails_after(2) == pytest.approx(5.0)

    await run_engine(engine, body)


class MemoryLevel:
    """A cache level in a dict; fills the engine's buffer when it gets one, as DiskCache does."""

    def __init__(self) -> None:
        self.chunks: dict = {}

    def get(self, cid, buffer=None):  # noqa: ANN001, ANN201
        data = self.chunks.get(cid)
        if data is not None and buffer is not None and len(buffer) == len(data):
            buffer[:] = data
            return buffer
        return data

    def put(self, cid, data) -> None:  # noqa: ANN001
        self.chunks[cid] = bytes(data)


class IndexedLevel(MemoryLevel):
    """A local level with an index in memory (`contains`, as DiskCache has); records the chunks asked of it."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def contains(self, cid) -> bool:  # noqa: ANN001
        return cid in self.chunks

    def get(self, cid, buffer=None):  # noqa: ANN001, ANN201
        self.asked.append(cid.index)
        return super().get(cid, buffer)


@pytest.mark.parametrize("indexed", [True, False])
async def test_a_reader_of_chunks_on_local_disk_is_read_ahead_only_the_local_window(autojump_clock, monkeypatch,  # noqa: ANN001
                                                                                   indexed: bool) -> None:
    """Each chunk read ahead holds a buffer of its own until READs take it: chunks a local level says it
    holds are read ahead LOCAL_WINDOW far, not --max-readahead. A level that cannot tell gets the whole
    window, as before."""
    monkeypatch.setattr(fsmount.readahead, "LOCAL_WINDOW", 4 * MiB)
    store = FakeStore()
    data = put_object(store, "m", 64 * MiB)
    level = IndexedLevel() if indexed else MemoryLevel()
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=256 * MiB, max_connections=4, read_timeout=30.0,
                         levels=[level], run_blocking=virtual_latency_runner(store))
    v = version(store, "m")
    for i in range(64):
        level.put(engine.chunk_id(v, i), data[i * CHUNK:(i + 1) * CHUNK])
    farthest = []

    async def body() -> None:
        h = OpenFile(1, 2, v, engine, max_readahead=32 * MiB)
        for off in range(0, 24 * MiB, 128 * 1024):
            assert await h.read(off, 128 * 1024) == data[off:off + 128 * 1024]
            await trio.sleep(0.001)
            inflight = [cid.index for cid in engine._inflight] + [cid.index for cid in engine.memory._chunks]
            farthest.append(max(inflight) * CHUNK - (off + 128 * 1024))
        h.close()

    await run_engine(engine, body)
    assert not store.gets  # every chunk came from the level
    if indexed:
        assert max(farthest) <= 4 * MiB, max(farthest)
    else:
        assert max(farthest) >= 24 * MiB, max(farthest)


class SlowLevel(MemoryLevel):
    """A cache level whose put takes PUT_S virtual seconds (through the engine's runner)."""

    PUT_S = 1.0


async def slow_put_runner(fn, *args, limiter):  # noqa: ANN001, ANN201
    """Blocking calls in virtual time: a put takes SlowLevel.PUT_S, anything else LATENCY."""
    async with limiter:
        await trio.sleep(SlowLevel.PUT_S if fn.__name__ == "put" else LATENCY)
        return fn(*args)


@pytest.mark.parametrize("timeout, unwritten", [(60.0, 0), (2.5, 2)])  # 2 puts at a time, 1 s each
async def test_unmount_drains_write_through_within_its_bound(autojump_clock, timeout: float,  # noqa: ANN001
                                                             unwritten: int) -> None:
    """Chunks fetched just before unmount still reach the cache level (a model read right before a node
    restart must be warm after it), but never for longer than the bound."""
    store = FakeStore()
    data = put_object(store, "m", 6 * MiB)
    level = SlowLevel()

    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=64 * MiB, max_connections=4,
                         read_timeout=30.0, levels=[level], run_blocking=slow_put_runner)

    async def body() -> None:
        assert await engine.read(version(store, "m"), 0, 6 * MiB) == data
        assert engine.levels.writes_pending == 6 and not level.chunks  # 2 put threads, 1 s a put
        assert engine.levels.lookups(level) == (0, 6)  # each chunk asked of the level once, then the origin
        start = trio.current_time()
        assert await engine.levels.drain_writes(timeout) == unwritten
        assert len(level.chunks) == 6 - unwritten
        assert trio.current_time() - start <= timeout

    await run_engine(engine, body)


async def test_a_write_through_backlog_stays_inside_the_memory_budget(autojump_clock) -> None:  # noqa: ANN001
    """A cache level slower than the origin: chunks waiting for their write-through stay in memory and
    in the budget (the reader waits for room) instead of piling up outside it."""
    store = FakeStore()
    data = put_object(store, "m", 48 * CHUNK)
    level = SlowLevel()

    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=8 * CHUNK, max_connections=4,
                         read_timeout=3600.0, levels=[level], run_blocking=slow_put_runner)
    v = version(store, "m")
    peak_unwritten = 0

    async def watch() -> None:
        nonlocal peak_unwritten
        while True:
            # Every chunk a write-through holds is either in memory (counted) or the budget is broken.
            peak_unwritten = max(peak_unwritten, engine.levels.writes_pending)
            assert engine.memory.used <= engine.memory.limit
            await trio.sleep(0.01)

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            for i in range(48):
                got = await engine.read(v, i * CHUNK, (i + 1) * CHUNK)
                assert bytes(got) == data[i * CHUNK:(i + 1) * CHUNK]
                del got
            assert await engine.levels.drain_writes(3600.0) == 0
            nursery.cancel_scope.cancel()
        assert peak_unwritten <= 8, peak_unwritten
        assert len(level.chunks) == 48

    await run_engine(engine, body)


async def stalled_put_runner(fn, *args, limiter):  # noqa: ANN001, ANN201
    """A cache disk frozen for good: a put never returns; anything else takes LATENCY (virtual time)."""
    async with limiter:
        await trio.sleep(math.inf if fn.__name__ == "put" else LATENCY)
        return fn(*args)


@pytest.mark.parametrize("read_timeout", [120.0, 20.0])
async def test_a_cache_level_whose_writes_stall_costs_no_read(autojump_clock, caplog, allowed_logs,  # noqa: ANN001
                                                              read_timeout: float) -> None:
    """A cache disk that stops answering (fsfreeze for a snapshot, a hung NVMe): every chunk fetched since waited in
    memory for its write, and once the memory was full every READ failed at --read-timeout. A write is given up
    after WRITE_DEADLINE_S, and while writes stall chunks are written through only in part of the memory."""
    allowed_logs.append(r"did not finish within|cache writes stall")
    store = FakeStore()
    data = put_object(store, "m", 48 * CHUNK)
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=8 * CHUNK, max_connections=4,
                         read_timeout=read_timeout, levels=[SlowLevel()], run_blocking=stalled_put_runner)
    v = version(store, "m")

    async def body() -> None:
        began = trio.current_time()
        for i in range(48):
            got = await engine.read(v, i * CHUNK, (i + 1) * CHUNK)
            assert bytes(got) == data[i * CHUNK:(i + 1) * CHUNK]
            del got
        # One deadline's wait (a quarter of the READs' at most), then the reads go on at the origin's pace.
        assert engine.levels.write_deadline == min(WRITE_DEADLINE_S, max(10.0, read_timeout / 4))
        assert trio.current_time() - began < engine.levels.write_deadline + 10
        assert engine.levels.stats.writes_given_up >= 1 and engine.stats.writes_skipped > 0
        assert engine.memory.used <= engine.memory.limit

    await run_engine(engine, body)
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 2  # once each, not per chunk


def hanging_get_runner(hang: trio.Event, asked: list):  # noqa: ANN201
    """A cache disk whose reads hang until `hang` is set (a hung NVMe), each noted in `asked` as it starts; GETs
    take LATENCY (virtual time)."""
    async def run(fn, *args, limiter):  # noqa: ANN001, ANN202
        async with limiter:
            if fn.__name__ == "get":
                asked.append(args[0].index)
                await hang.wait()
            elif fn.__name__ == "get_range":
                await trio.sleep(LATENCY)
            return fn(*args)
    return run


@pytest.mark.parametrize("read_timeout", [120.0, 5.0])
async def test_a_cache_level_whose_reads_hang_is_given_up_for_the_origin_until_it_answers(  # noqa: ANN001
        autojump_clock, caplog, allowed_logs, read_timeout: float) -> None:
    """A cache disk whose reads hang: every READ of a chunk it held failed at --read-timeout, and once the level's
    threads were all stuck, every fetch of the mount. A read of a local level is given up after its deadline (a
    quarter of the READ's, at least GET_DEADLINE_MIN_S): the chunk comes from the origin, the level is skipped
    until the read returns, and the buffer it may still write into stays counted in the memory budget."""
    allowed_logs.append(r"did not return within")
    store = FakeStore()
    data = put_object(store, "m", 12 * CHUNK)
    level = IndexedLevel()
    hang, asked = trio.Event(), []
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=6 * CHUNK, max_connections=4,
                         read_timeout=read_timeout, levels=[level], run_blocking=hanging_get_runner(hang, asked))
    v = version(store, "m")
    for i in range(12):
        level.put(engine.chunk_id(v, i), data[i * CHUNK:(i + 1) * CHUNK])
    deadline = min(GET_DEADLINE_S, max(GET_DEADLINE_MIN_S, read_timeout / 4))

    async def body() -> None:
        began = trio.current_time()
        assert bytes(await engine.read(v, 0, CHUNK)) == data[:CHUNK]
        assert trio.current_time() - began == pytest.approx(deadline + LATENCY)
        assert engine.levels.stats.reads_given_up == 1 and len(store.gets) == 1
        assert not engine.held_locally(v, 1)  # read ahead as the origin's chunks meanwhile
        began = trio.current_time()
        for i in range(1, 8):  # the level is skipped: no deadline's wait per chunk
            assert bytes(await engine.read(v, i * CHUNK, (i + 1) * CHUNK)) == data[i * CHUNK:(i + 1) * CHUNK]
        assert trio.current_time() - began <= 7 * LATENCY + 1e-9
        assert engine.levels.stats.reads_given_up == 1 and asked == [0]
        # Counted: the buffer the hung read holds, beside the chunks in memory.
        assert engine.memory.reserved == CHUNK and engine.memory.used <= engine.memory.limit
        hang.set()  # the disk answers again
        await trio.sleep(LATENCY)
        assert engine.memory.reserved == 0 and not engine.held_locally(v, 9)  # skipped one deadline more
        await trio.sleep(deadline)
        assert engine.held_locally(v, 9)
        gets = len(store.gets)
        for i in range(8, 12):
            assert bytes(await engine.read(v, i * CHUNK, (i + 1) * CHUNK)) == data[i * CHUNK:(i + 1) * CHUNK]
        assert len(store.gets) == gets  # from the level again
        assert engine.levels.stats.level_hits[0] == 4

    await run_engine(engine, body)
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


def engine_over_a_hanging_level(memory_chunks: int) -> tuple[ChunkEngine, object, bytes, trio.Event, list]:
    """An engine of 16 connections and `memory_chunks` of memory over a level that holds all 40 chunks of "m" and
    whose reads hang until the Event is set: (engine, the object's version, its bytes, the Event, the reads asked)."""
    store = FakeStore()
    data = put_object(store, "m", 40 * CHUNK)
    level = IndexedLevel()
    hang, asked = trio.Event(), []
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=memory_chunks * CHUNK, max_connections=16,
                         read_timeout=8.0, levels=[level], run_blocking=hanging_get_runner(hang, asked))
    v = version(store, "m")
    for i in range(40):
        level.put(engine.chunk_id(v, i), data[i * CHUNK:(i + 1) * CHUNK])
    return engine, v, data, hang, asked


@pytest.mark.parametrize("memory_chunks", [16, 4])
async def test_every_fetch_giving_up_a_hung_cache_read_at_once_in_full_memory_goes_on(autojump_clock,  # noqa: ANN001
                                                                                       allowed_logs,  # noqa: ANN001
                                                                                       memory_chunks: int) -> None:
    """16 fetches in flight give up their hung cache reads together in a budget that their reservations fill: each
    waited for room for a second buffer, room only they could free, and the mount stayed dead after the disk came
    back (the review of this change). The buffer a late read holds is counted without waiting (overdraw)."""
    allowed_logs.append(r"did not return within")
    engine, v, data, hang, _ = engine_over_a_hanging_level(memory_chunks)
    got: dict[int, bool] = {}

    async def reader(i: int) -> None:
        got[i] = bytes(await engine.read(v, i * CHUNK, (i + 1) * CHUNK)) == data[i * CHUNK:(i + 1) * CHUNK]

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(reader, i)
            await trio.sleep(3.0)
            hang.set()
        assert got == dict.fromkeys(range(16), True)
        assert bytes(await engine.read(v, 39 * CHUNK, 40 * CHUNK)) == data[39 * CHUNK:]
        assert engine.memory.reserved == 0 and engine.memory.used <= engine.memory.limit

    await run_engine(engine, body)


async def test_a_cache_disk_that_never_answers_again_leaves_the_mount_working_in_a_small_budget(  # noqa: ANN001
        autojump_clock, allowed_logs) -> None:  # noqa: ANN001
    """Every read given up was counted in full against the budget: with a disk that never answers again, 16
    fetches' worth of late buffers in a 4-chunk budget kept it full, and every later fetch waited for room for good
    (the second review). Reads still queued for the level's threads are dropped (nothing has their buffer), and
    those a thread has are counted within half the budget."""
    allowed_logs.append(r"did not return within")
    engine, v, data, _, asked = engine_over_a_hanging_level(4)  # its Event never set
    got: dict[int, bool] = {}

    async def reader(i: int) -> None:
        got[i] = bytes(await engine.read(v, i * CHUNK, (i + 1) * CHUNK)) == data[i * CHUNK:(i + 1) * CHUNK]

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(reader, i)
        began = trio.current_time()
        for i in range(16, 40):  # long after: the level is skipped, and the budget has room
            await reader(i)
        assert got == dict.fromkeys(range(40), True)
        assert trio.current_time() - began < 24 * 5 * LATENCY
        assert len(asked) <= DISK_THREADS  # only the reads a thread had are still out
        assert engine.memory.reserved <= engine.memory.limit // 2

    await run_engine(engine, body)


def slow_get_runner(seconds: float):  # noqa: ANN201
    """A cache disk whose every read takes `seconds` (virtual time); GETs take LATENCY."""
    async def run(fn, *args, limiter):  # noqa: ANN001, ANN202
        async with limiter:
            await trio.sleep(seconds if fn.__name__ == "get" else LATENCY)
            return fn(*args)
    return run


async def test_a_cache_disk_a_little_slower_than_the_deadline_is_one_episode(autojump_clock, caplog,  # noqa: ANN001
                                                                              allowed_logs) -> None:  # noqa: ANN001
    """Reads of 3 s against a 2 s deadline: the level was used again as soon as its read returned, so every read
    waited the whole deadline and warned. It stays skipped a deadline more, and warns once."""
    allowed_logs.append(r"did not return within")
    store = FakeStore()
    data = put_object(store, "m", 8 * CHUNK)
    level = IndexedLevel()
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=16 * CHUNK, max_connections=2, read_timeout=5.0,
                         levels=[level], run_blocking=slow_get_runner(3.0))
    v = version(store, "m")
    for i in range(8):
        level.put(engine.chunk_id(v, i), data[i * CHUNK:(i + 1) * CHUNK])

    async def body() -> None:
        waits = []
        for i in range(5):
            began = trio.current_time()
            assert bytes(await engine.read(v, i * CHUNK, (i + 1) * CHUNK)) == data[i * CHUNK:(i + 1) * CHUNK]
            waits.append(trio.current_time() - began)
            await trio.sleep(0.5)
        assert engine.levels.stats.reads_given_up <= 2 and sum(w > 1.0 for w in waits) <= 2, waits

    await run_engine(engine, body)
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1


class ClaimingLevel(MemoryLevel):
    """A level that records what it was told would not be written to it (the shared tier drops a claim)."""

    def __init__(self) -> None:
        super().__init__()
        self.abandoned: list = []

    def abandon(self, cid) -> None:  # noqa: ANN001
        self.abandoned.append(cid)


async def test_a_failed_origin_fetch_is_abandoned_to_the_levels_that_missed(autojump_clock,  # noqa: ANN001
                                                                            allowed_logs) -> None:  # noqa: ANN001
    """A chunk the levels missed and the origin failed to send is given up to each level (so the shared
    tier drops its claim at once); a chunk that was fetched is written, never given up."""
    allowed_logs.append("fetching chunk .* failed")
    store = FakeStore()
    data = put_object(store, "m", 2 * CHUNK)
    level = ClaimingLevel()
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=64 * MiB, max_connections=4, read_timeout=30.0,
                         levels=[level], run_blocking=virtual_latency_runner(store))

    def fault(key: str, start: int, end: int) -> None:
        if start == 0:
            raise AccessDenied("injected")

    store.fault = fault
    v = version(store, "m")

    async def body() -> None:
        with pytest.raises(StoreError):
            await engine.read(v, 0, 100)
        assert await engine.read(v, CHUNK, CHUNK + 100) == data[CHUNK:CHUNK + 100]
        assert await engine.levels.drain_writes(60.0) == 0
        await trio.sleep(1.0)  # the background abandon
        assert level.abandoned == [engine.chunk_id(v, 0)]
        assert set(level.chunks) == {engine.chunk_id(v, 1)}

    await run_engine(engine, body)


class TrailingTier(ClaimingLevel):
    """A shared tier's part in trailing writes: it `trails()` until `fleet` is set, or until a listing of
    waiting markers (`look_for_waiters`) finds `waiter` set; records when each chunk was put."""

    def __init__(self) -> None:
        super().__init__()
        self.fleet = False
        self.waiter = False
        self.listings = 0
        self.put_at: dict = {}

    def trails(self) -> bool:
        return not self.fleet

    def look_for_waiters(self) -> bool:
        self.listings += 1
        self.fleet = self.fleet or self.waiter
        return self.waiter

    def put(self, cid, data) -> None:  # noqa: ANN001
        self.put_at[cid] = trio.current_time()
        super().put(cid, data)


@dataclasses.dataclass
class TrailingBed:
    """An engine of 1 MiB chunks over an NVMe-like level and a trailing tier (or the tier alone), GETs
    taking LATENCY virtual seconds, and one object "m" in its store."""

    engine: ChunkEngine
    v: object  # the object's ObjectVersion
    data: bytes
    nvme: IndexedLevel
    tier: TrailingTier
    get_ends: list[float]  # the virtual time each origin GET ended


def trailing_engine(size: int, local: bool = True, nvme: IndexedLevel | None = None, tier_put_s: float = 0.0,
                    ) -> TrailingBed:
    """`tier_put_s`: virtual seconds each chunk write to the tier takes (0: at once)."""
    store = FakeStore()
    data = put_object(store, "m", size)
    nvme, tier = nvme or IndexedLevel(), TrailingTier()
    get_ends: list[float] = []

    async def run(fn, *args, limiter):  # noqa: ANN001, ANN202
        async with limiter:
            if fn.__name__ == "get_range":
                await trio.sleep(LATENCY)
                get_ends.append(trio.current_time())
            elif fn == tier.put:
                await trio.sleep(tier_put_s)
            return fn(*args)

    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=64 * MiB, max_connections=4, read_timeout=30.0,
                         levels=[nvme, tier] if local else [tier], run_blocking=run)
    return TrailingBed(engine, version(store, "m"), data, nvme, tier, get_ends)


async def read_chunk_by_chunk(engine: ChunkEngine, v, data: bytes, pause: float,  # noqa: ANN001
                              after: dict | None = None) -> None:
    """A reader taking the object one chunk at a time, `pause` virtual seconds apart (a loader's pace:
    the origin's GETs never stop for TRAIL_IDLE_S); `after[i]()` runs once chunk i was read."""
    for i in range(len(data) // CHUNK):
        assert await engine.read(v, i * CHUNK, (i + 1) * CHUNK) == data[i * CHUNK:(i + 1) * CHUNK]
        if after and i in after:
            after[i]()
        await trio.sleep(pause)


@pytest.mark.parametrize("local", [True, False])
async def test_tier_writes_of_a_node_alone_trail_its_origin_reads(autojump_clock, local: bool) -> None:  # noqa: ANN001
    """A node loading alone writes nothing to the shared tier while its origin GETs run (the tier's server
    is not kept busy storing while it serves the load), then writes every chunk, read back from its NVMe
    cache, exact. Without a local copy to read back, the writes go at once, holding the chunk's memory."""
    bed = trailing_engine(24 * CHUNK, local)
    engine, v, data, tier, get_ends = bed.engine, bed.v, bed.data, bed.tier, bed.get_ends

    async def body() -> None:
        await read_chunk_by_chunk(engine, v, data, pause=0.02)
        if local:
            assert not tier.put_at and len(engine.levels.trailing) == 24 and engine.levels.writes_pending == 24
        await trio.sleep(30.0)
        assert engine.levels.writes_pending == 0

    await run_engine(engine, body)
    assert len(get_ends) == 24
    assert {cid.index: bytes(d) for cid, d in tier.chunks.items()} == \
        {i: data[i * CHUNK:(i + 1) * CHUNK] for i in range(24)}
    first_put = min(tier.put_at.values())
    if local:
        assert first_put >= get_ends[-1] + TRAIL_IDLE_S, (first_put, get_ends[-1])
        assert engine.levels.trailing.queued == 24 and engine.levels.trailing.dropped == 0
        assert not tier.abandoned
    else:
        assert first_put < get_ends[-1] and engine.levels.trailing.queued == 0


async def test_tier_writes_go_at_once_once_another_node_is_seen_or_found_waiting(autojump_clock) -> None:  # noqa: ANN001
    """A node that met another node (its own claim lost: `trails()` turns False) writes at once; a node
    still trailing lists the waiting markers every WAITERS_CHECK_S and, once one shows up, writes what
    trailed at once, long before its load ends."""
    bed = trailing_engine(40 * CHUNK)
    engine, v, data, tier, get_ends = bed.engine, bed.v, bed.data, bed.tier, bed.get_ends
    marked: list[float] = []

    def another_node_waits() -> None:
        tier.waiter = True
        marked.append(trio.current_time())

    async def body() -> None:
        await read_chunk_by_chunk(engine, v, data, pause=0.05, after={9: another_node_waits})
        await trio.sleep(30.0)

    await run_engine(engine, body)
    assert tier.listings >= 1
    first_10 = [tier.put_at[engine.chunk_id(v, i)] for i in range(10)]
    assert max(first_10) <= marked[0] + 2 * WAITERS_CHECK_S, (first_10, marked)
    assert max(first_10) < get_ends[-1] - 1.0
    later = [tier.put_at[engine.chunk_id(v, i)] for i in range(12, 40)]
    assert all(t < get_ends[-1] for t in later[:-4])  # written as they come, no longer trailing
    assert len(tier.chunks) == 40 and engine.levels.trailing.queued < 14


async def test_a_tier_write_trails_at_most_trail_max_s(autojump_clock, monkeypatch) -> None:  # noqa: ANN001
    """A long load does not hold a chunk's tier write (and its claim) past TRAIL_MAX_S."""
    monkeypatch.setattr(fsmount.data.trailing, "TRAIL_MAX_S", 1.0)
    bed = trailing_engine(40 * CHUNK)
    engine, v, data, tier, get_ends = bed.engine, bed.v, bed.data, bed.tier, bed.get_ends
    queued_at: dict = {}

    async def body() -> None:
        await read_chunk_by_chunk(engine, v, data, pause=0.05,
                                  after={i: (lambda i=i: queued_at.setdefault(i, trio.current_time()))
                                         for i in range(40)})
        await trio.sleep(30.0)

    await run_engine(engine, body)
    assert get_ends[-1] > 3.0 + get_ends[0]  # a load of several TRAIL_MAX_S
    for i in range(40):
        assert tier.put_at[engine.chunk_id(v, i)] <= queued_at[i] + 1.0 + 2 * 0.05 + 2 * LATENCY, i


async def test_no_more_than_trail_max_bytes_trail(autojump_clock, monkeypatch) -> None:  # noqa: ANN001
    """What is left to write when a long load ends (and what an unmount right after has to drain) stays
    bounded: past TRAIL_MAX_BYTES the oldest writes run while the load goes on."""
    monkeypatch.setattr(fsmount.data.trailing, "TRAIL_MAX_BYTES", 4 * CHUNK)
    bed = trailing_engine(24 * CHUNK)
    engine, v, data, tier, get_ends = bed.engine, bed.v, bed.data, bed.tier, bed.get_ends
    trailing_at_most = 0

    def note() -> None:
        nonlocal trailing_at_most
        trailing_at_most = max(trailing_at_most, len(engine.levels.trailing))

    async def body() -> None:
        await read_chunk_by_chunk(engine, v, data, pause=0.02, after={i: note for i in range(24)})
        assert len(engine.levels.trailing) <= 5
        await trio.sleep(30.0)

    await run_engine(engine, body)
    assert trailing_at_most <= 5, trailing_at_most
    assert sum(t < get_ends[-1] for t in tier.put_at.values()) >= 18
    assert len(tier.chunks) == 24 and engine.levels.trailing.queued == 24


class SmallNvme(IndexedLevel):
    """A local level of `max_bytes` that evicts its oldest chunks to make room, as a full DiskCache does."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self.max_bytes = max_bytes

    def put(self, cid, data) -> None:  # noqa: ANN001
        super().put(cid, data)
        while sum(map(len, self.chunks.values())) > self.max_bytes:
            del self.chunks[next(iter(self.chunks))]


async def test_a_model_larger_than_the_nvme_cache_is_written_to_the_tier(autojump_clock) -> None:  # noqa: ANN001
    """B254: a node loading alone a model larger than its NVMe cache held every tier write back until the load ended,
    and by then the cache had evicted the most of their copies: 32 of 40 chunks given up, never in the tier (7 of 50
    on a mount with a 64 MiB cache), and the next node fetched them from the origin. What trails is now at most a
    quarter of the local level's size; past it a write goes at once, from memory, as without a local level."""
    bed = trailing_engine(40 * CHUNK, nvme=SmallNvme(8 * CHUNK))
    engine, v, data, tier = bed.engine, bed.v, bed.data, bed.tier

    async def body() -> None:
        await read_chunk_by_chunk(engine, v, data, pause=0.05)
        await trio.sleep(30.0)
        assert engine.levels.writes_pending == 0

    await run_engine(engine, body)
    trailing = engine.levels.trailing
    assert len(tier.chunks) >= 38 and trailing.dropped <= 2, (len(tier.chunks), trailing.queued, trailing.dropped)
    assert all(bytes(d) == data[cid.index * CHUNK:(cid.index + 1) * CHUNK] for cid, d in tier.chunks.items())
    assert trailing.queued >= 2  # writes still trail, as far as the share allows


async def test_a_node_alone_is_not_held_back_by_a_slow_tier_past_trail_max_bytes(autojump_clock,  # noqa: ANN001
                                                                                 monkeypatch) -> None:
    """B255: past TRAIL_MAX_BYTES (4 GiB), B254 sent a node's further tier writes at once from memory, pinned until
    written, even where its NVMe cache had room for them to trail: a node loading alone a model larger than 4 GiB
    was held back to the tier's write speed, which trailing is there to spare it. Only the NVMe cache's share
    bounds what is offered; TRAIL_MAX_BYTES only starts the queue."""
    monkeypatch.setattr(fsmount.data.trailing, "TRAIL_MAX_BYTES", 4 * CHUNK)
    n = 160
    bed = trailing_engine(n * CHUNK, nvme=SmallNvme(1024 * CHUNK), tier_put_s=0.5)
    engine, v, data, tier = bed.engine, bed.v, bed.data, bed.tier

    async def body() -> None:
        started = trio.current_time()
        await read_chunk_by_chunk(engine, v, data, pause=0.02)
        took = trio.current_time() - started
        alone = n * (LATENCY + 0.02)
        assert took < 1.5 * alone, (took, alone)
        await trio.sleep(200.0)
        assert engine.levels.writes_pending == 0

    await run_engine(engine, body)
    assert len(tier.chunks) == n and engine.levels.trailing.queued == n and engine.levels.trailing.dropped == 0
    assert all(bytes(d) == data[cid.index * CHUNK:(cid.index + 1) * CHUNK] for cid, d in tier.chunks.items())


async def test_a_trailing_write_whose_local_copy_is_gone_is_given_up_and_its_claim_dropped(autojump_clock,  # noqa: ANN001
                                                                                           ) -> None:
    bed = trailing_engine(8 * CHUNK)
    engine, v, data, nvme, tier = bed.engine, bed.v, bed.data, bed.nvme, bed.tier

    async def body() -> None:
        await read_chunk_by_chunk(engine, v, data, pause=0.02)
        del nvme.chunks[engine.chunk_id(v, 3)]  # evicted before its turn
        await trio.sleep(30.0)
        assert engine.levels.writes_pending == 0

    await run_engine(engine, body)
    assert tier.abandoned == [engine.chunk_id(v, 3)]
    assert sorted(cid.index for cid in tier.chunks) == [0, 1, 2, 4, 5, 6, 7]
    assert engine.levels.trailing.dropped == 1


async def test_unmount_runs_trailing_writes_at_once(autojump_clock) -> None:  # noqa: ANN001
    bed = trailing_engine(8 * CHUNK)
    engine, v, data, tier, get_ends = bed.engine, bed.v, bed.data, bed.tier, bed.get_ends

    async def body() -> None:
        await read_chunk_by_chunk(engine, v, data, pause=0.0)
        assert await engine.levels.drain_writes(60.0) == 0

    await run_engine(engine, body)
    assert len(tier.chunks) == 8
    assert max(tier.put_at.values()) < get_ends[-1] + TRAIL_IDLE_S


def warm_engine(store: FakeStore, key: str, memory: int) -> tuple[ChunkEngine, MemoryLevel]:
    """An engine over a level that already holds every chunk of `key`."""
    level = MemoryLevel()
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=memory, max_connections=4, read_timeout=30.0,
                         levels=[level], run_blocking=virtual_latency_runner(store))
    v = version(store, key)
    for i in range(-(-v.size // CHUNK)):
        level.chunks[engine.chunk_id(v, i)] = store.objects[key][i * CHUNK:(i + 1) * CHUNK]
    return engine, level


async def test_level_hits_read_whole_recycle_their_buffers_and_stay_exact(autojump_clock) -> None:  # noqa: ANN001
    store = FakeStore()
    data = put_object(store, "m", 40 * CHUNK + 123)
    engine, level = warm_engine(store, "m", memory=64 * MiB)
    handle = OpenFile(1, 1, version(store, "m"), engine, max_readahead=8 * CHUNK)

    async def body() -> None:
        for off in range(0, len(data), 256 * 1024):  # 4 READs a chunk, as the kernel sends them
            got = await handle.read(off, 256 * 1024)
            assert bytes(got) == data[off:off + 256 * 1024]
            del got  # pyfuse3 drops its reply buffer once written
            assert engine.memory.used <= engine.memory.limit
        assert engine.memory.buffers_recycled >= 25, engine.stats
        assert engine.levels.stats.origin_requests == 0
        # Each chunk was looked up once, and found: the stack is where level hits are counted.
        assert engine.levels.lookups(level) == (41, 0)
        assert engine.levels.stats.loaded_bytes == len(data)

    await run_engine(engine, body)


async def test_a_buffer_anything_still_reads_is_never_recycled(autojump_clock) -> None:  # noqa: ANN001
    """A reply view held across later reads (as a READ in flight, a page-cache push or a waiter would
    hold one) keeps its chunk's buffer out of the pool: its bytes never change under it."""
    store = FakeStore()
    data = put_object(store, "m", 30 * CHUNK)
    engine, _ = warm_engine(store, "m", memory=64 * MiB)
    v = version(store, "m")

    async def body() -> None:
        held = await engine.read(v, 0, CHUNK)  # chunk 0, read whole: spent, but this view still reads it
        for i in range(1, 30):
            assert bytes(await engine.read(v, i * CHUNK, (i + 1) * CHUNK)) == data[i * CHUNK:(i + 1) * CHUNK]
        assert engine.memory.buffers_recycled >= 20, engine.stats
        assert bytes(held) == data[:CHUNK]

    await run_engine(engine, body)


async def test_a_chunk_loaded_back_from_a_level_after_the_origin_sent_it_saved_no_egress() -> None:
    """Beside a cache level, memory gives a chunk up once the page cache has it, and a READ of it again loads it
    from the level: that saved the origin nothing, yet counted as egress saved (280 MiB "saved" on a cold load
    of a 293 MiB model)."""
    store = FakeStore()
    data = put_object(store, "m", 2 * CHUNK)
    level = MemoryLevel()
    stack = LevelStack(store, [level], max_connections=2, chunk_size=CHUNK)
    v = version(store, "m")
    first, second = (ChunkId(store.bucket, "m", v.etag, CHUNK, i) for i in range(2))
    got, hit = await stack.load(first, CHUNK, None, lambda: 0.0)
    assert hit is None and bytes(got) == data[:CHUNK]  # from the origin
    level.put(first, got)
    level.put(second, data[CHUNK:])  # as a cache filled by an earlier mount
    for cid in (first, second):
        _, hit = await stack.load(cid, CHUNK, None, lambda: 0.0)
        assert hit == 0
    assert stack.loaded_bytes(level) == 2 * CHUNK
    assert stack.saved_bytes(level) == stack.stats.saved_bytes == CHUNK  # the second chunk only


async def test_a_queued_fetch_a_stream_waits_for_survives_a_read_timeout_and_a_read_again(autojump_clock,  # noqa: ANN001
                                                                                           allowed_logs) -> None:
    """Every worker busy: a READ of a chunk model streaming had queued timed out, and the application read it again
    past RETRY_GRACE_S. The queued fetch was dropped unstarted for a new one, and the stream's wait for it ended with
    neither bytes nor error (AssertionError), which stopped the file's stream (the audit)."""
    from fsmount.data.engine import RETRY_GRACE_S

    store = FakeStore()
    data = put_object(store, "m", 2 * CHUNK)
    put_object(store, "busy", CHUNK)

    async def run(fn, *args, limiter):  # noqa: ANN001, ANN202 - the one connection is busy for 8 s
        async with limiter:
            if fn.__name__ == "get_range":
                await trio.sleep(8.0 if args[0] == "busy" else LATENCY)
            return fn(*args)

    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=16 * CHUNK, max_connections=1, read_timeout=5.0,
                         run_blocking=run)
    v, stream = version(store, "m"), object()

    async def body() -> None:
        engine.fetch(version(store, "busy"), 0, object())  # takes the one connection for 8 s
        await trio.sleep(0.1)
        part = engine.fetch(v, 0, stream)  # model streaming queues chunk 0
        with pytest.raises(StoreError, match="timed out"):
            await engine.read(v, 0, 100)
        await trio.sleep(RETRY_GRACE_S + 0.5)
        assert await engine.read(v, 100, 200) == data[100:200]  # a read again, once the connection is free
        assert bytes(await part.wait()) == data[:CHUNK]  # the stream's wait: the chunk's bytes

    await run_engine(engine, body)


def tracked_buffers(monkeypatch: pytest.MonkeyPatch) -> list:
    """Weak references to every chunk buffer the level stack makes from here on (to see none outlives its use)."""
    import weakref

    import fsmount.data.levels

    buffers: list[weakref.ref] = []

    def tracked(length: int):  # noqa: ANN202
        buffer = new_buffer(length)
        buffers.append(weakref.ref(buffer))
        return buffer

    monkeypatch.setattr(fsmount.data.levels, "new_buffer", tracked)
    return buffers


async def test_a_version_found_gone_holds_no_chunk_buffer(autojump_clock, allowed_logs,  # noqa: ANN001
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A 412 (replaced) or 404 is remembered for GONE_FOR_S, and the fetch keeps its error for its waiters: both kept
    the exception raised, whose traceback holds the fetch's frames and its chunk buffer, which the budget no longer
    counts (8 MiB a version beyond --memory-limit, for a burst of replaced shards; the audit)."""
    import gc

    allowed_logs.append("fetching chunk .* failed")
    buffers = tracked_buffers(monkeypatch)
    store = FakeStore()
    data = put_object(store, "m", 2 * CHUNK)
    engine = make_engine(store)
    old = version(store, "m")

    async def body() -> None:
        store.put("m", b"new" + data[3:])
        with pytest.raises(PreconditionFailed) as refused:
            await engine.read(old, 0, 100)
        del refused
        assert buffers and engine.levels._gone  # noqa: SLF001 - remembered as gone, and a buffer was used
        assert engine.memory.used == 0
        gc.collect()
        assert [ref() for ref in buffers] == [None] * len(buffers)

    await run_engine(engine, body)


async def test_a_chunk_fetched_again_after_it_was_spent_is_not_taken_as_spent(autojump_clock) -> None:  # noqa: ANN001
    """A spent chunk evicted, then fetched again under the same id: its stale entry in the spent queue let a fetch take
    the new copy's buffer while READs had taken 128 KiB of it, and believe the page cache held it all (the audit)."""
    from fsmount.data.budget import MemoryBudget

    memory = MemoryBudget(4 * CHUNK)
    cid = ChunkId("bucket", "m", '"e"', CHUNK, 0)
    first = new_buffer(CHUNK)
    memory.store(cid, first, demanded=False)
    memory.note_served(cid, 0, CHUNK, CHUNK)  # read whole: spent
    assert await memory.reserve(4 * CHUNK) is None  # evicts it (and frees the buffer)
    memory.release(4 * CHUNK)
    del first
    memory.store(cid, new_buffer(CHUNK), demanded=False)  # only memory holds it: its buffer could be taken
    again = id(memory.get(cid, CHUNK))
    memory.note_served(cid, 0, 128 * 1024, CHUNK)
    assert memory.take_spent_buffer(CHUNK) is None
    assert id(memory.get(cid, CHUNK)) == again and not memory.in_page_cache(cid)


async def test_o_direct_reads_leave_no_belief_that_the_page_cache_holds_their_chunks(autojump_clock) -> None:  # noqa: ANN001
    """O_DIRECT READs leave nothing in the page cache, yet their chunks, read whole and their buffers reused, were
    believed held there: read-ahead then skipped them, and a second pass of the same handle got none (0.9 s of
    virtual time the first pass, 3.2 s the second; the audit)."""
    store = FakeStore()
    data = put_object(store, "m", 64 * CHUNK)
    engine = make_engine(store, memory=8 * CHUNK)
    v = version(store, "m")
    handle = OpenFile(1, 2, v, engine, 4 * CHUNK, direct=True)

    async def one_pass() -> float:
        start = trio.current_time()
        for off in range(0, v.size, CHUNK):
            assert bytes(await handle.read(off, CHUNK)) == data[off:off + CHUNK]
        return trio.current_time() - start

    async def body() -> None:
        first = await one_pass()
        assert not any(engine.memory.in_page_cache(engine.chunk_id(v, i)) for i in range(64))
        handle.readahead = ReadAhead(CHUNK, 4 * CHUNK, proven_after=CHUNK)  # a second reader, as the first
        assert await one_pass() == pytest.approx(first, rel=0.25)

    await run_engine(engine, body)


async def test_a_read_failed_at_once_after_a_timeout_says_so(autojump_clock) -> None:  # noqa: ANN001
    """A READ that came just after another timed out, with the origin silent, fails at once (RETRY_GRACE_S), and its
    warning said it "timed out after 120s" though it waited for nothing (a tester)."""
    store = FakeStore()
    put_object(store, "m", 4 * CHUNK)
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=64 * MiB, max_connections=8, read_timeout=5.0,
                         run_blocking=stalling_runner({"m"}))
    v = version(store, "m")

    async def body() -> None:
        with pytest.raises(StoreError, match=r"read of 'm' timed out after 5s"):
            await engine.read(v, 0, 100)
        start = trio.current_time()
        with pytest.raises(StoreError, match=r"read of 'm' failed at once: a read just before timed out after 5s, "
                                             r"with nothing fetched meanwhile"):
            await engine.read(v, CHUNK, CHUNK + 100)
        assert trio.current_time() == start

    await run_engine(engine, body)


async def test_a_failed_fetch_s_error_holds_no_chunk_buffer_for_its_waiters(autojump_clock, allowed_logs,  # noqa: ANN001
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch's error is kept for its waiters (RETRY_GRACE_S at least). Kept as raised, it held the fetch's frames,
    and their chunk buffer, outside the budget: through its traceback, and through the context of an error raised
    while handling another (`raise TransientError(...) from None` in an `except OSError`, as the store's GET does),
    and each waiter's re-raise added its frames (the audit, then the review)."""
    import gc

    allowed_logs.append("fetching chunk .* failed")
    buffers = tracked_buffers(monkeypatch)

    def get_range(key: str, etag: str, start: int, end: int, buffer=None, size=None):  # noqa: ANN001, ANN202
        def receive(into) -> None:  # noqa: ANN001 - holds the buffer, as the store's body read does
            raise OSError("connection reset")
        try:
            receive(buffer)
        except OSError as exc:
            raise TransientError(f"GET {key!r}: {exc}") from None

    store = FakeStore()
    put_object(store, "m", 2 * CHUNK)
    store.get_range = get_range
    engine = make_engine(store)
    v = version(store, "m")

    async def body() -> None:
        for _ in range(2):  # the READ, and the kernel's re-send of it: both join the failed fetch
            with pytest.raises(TransientError):
                await engine.read(v, 0, 100)
        assert buffers and engine.memory.used == 0
        gc.collect()
        assert [ref() for ref in buffers] == [None] * len(buffers)

    await run_engine(engine, body)


async def test_chunks_of_an_object_without_an_etag_are_neither_cached_nor_read_from_a_cache(autojump_clock) -> None:  # noqa: ANN001
    """A server that gives no ETag (a tester's proxy stripped it from HEAD): chunk ids of all the object's versions
    were one, and a cache level, which outlives them, served a replaced object's old bytes. Such chunks skip the
    levels: from the origin each time a fetch wants them, never written to a cache."""
    from fsmount.data import ObjectVersion

    store = FakeStore()
    data = put_object(store, "m", 2 * CHUNK)
    level = MemoryLevel()
    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=64 * MiB, max_connections=4, read_timeout=30.0,
                         levels=[level], run_blocking=virtual_latency_runner(store))
    unversioned = ObjectVersion("m", "", len(data))
    level.chunks[engine.chunk_id(unversioned, 1)] = b"x" * CHUNK  # an older version's bytes, cached by an older node

    async def body() -> None:
        assert bytes(await engine.read(unversioned, 0, 2 * CHUNK)) == data
        await trio.sleep(1)  # write-throughs, if any, land
        assert list(level.chunks) == [engine.chunk_id(unversioned, 1)]  # nothing written

    await run_engine(engine, body)


async def test_a_chunk_fetch_that_fits_is_not_held_behind_one_that_does_not(autojump_clock) -> None:  # noqa: ANN001
    """Chunk fetches that find no room take turns, but one that fits now without evicting anything goes at once: a
    small file's chunk waited behind a full chunk's read-ahead for the room a write part held until its upload ended
    (the review)."""
    from fsmount.data.budget import MemoryBudget

    memory = MemoryBudget(100)
    await memory.reserve(80)  # a write part being uploaded: nothing to evict
    got: list[int] = []

    async def fetch(n: int) -> None:
        await memory.reserve(n, chunk=True)
        got.append(n)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fetch, 50)  # no room until the part is uploaded
        await trio.sleep(0.01)
        nursery.start_soon(fetch, 20)  # fits now
        await trio.sleep(1)
        assert got == [20]
        memory.release(80)
    assert got == [20, 50]
