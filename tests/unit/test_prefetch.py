"""Model-aware prefetch in virtual time, against the fake store: the order and extent of what it streams,
cancellation, malformed headers, and the page-cache pusher. Real mounts with mmap readers:
tests/mount/test_prefetch_mount.py."""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import fsmount.streaming
from fsmount.data import ChunkEngine
from fsmount.pagecache import PageCachePusher
from fsmount.safetensors import parse_header
from fsmount.streaming import ModelStreamer
from tests.helpers import CHUNK, LATENCY, MiB, make_engine, model_bytes, run_engine, version
from tests.unit.fake_store import FakeStore


def prefetch_rig(key: str, data: bytes, *, conns: int = 4, memory: int = 64 * MiB, push_limit: int = 0,
                 kernel_readahead: int = 0, free_memory: int = 1 << 40) -> tuple[FakeStore, ChunkEngine, ModelStreamer]:
    """A fake store holding `data` at `key`, an engine over it, and a streamer of that engine; the machine has
    `free_memory` free."""
    store = FakeStore()
    store.put(key, data)
    engine = make_engine(store, conns=conns, memory=memory)
    pusher = PageCachePusher(push_limit, kernel_readahead=kernel_readahead, free_memory=lambda: free_memory)
    return store, engine, ModelStreamer(engine, pusher, max_connections=conns)


def recorded_stores(monkeypatch) -> list[int]:  # noqa: ANN001
    """Replaces notify_store with a recorder: the offsets pushed, in the order their stores ran."""
    import fsmount.pagecache

    stored: list[int] = []
    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", lambda ino, off, data: stored.append(off))
    return stored


async def run_prefetcher(engine: ChunkEngine, streamer: ModelStreamer, body) -> None:  # noqa: ANN001
    """Run `await body()` with the engine and the streamer running; stop both after."""
    async def with_prefetcher() -> None:
        async with trio.open_nursery() as n:
            await n.start(streamer.run)
            await body()
            n.cancel_scope.cancel()

    await run_engine(engine, with_prefetcher)


async def stream_once(streamer: ModelStreamer, v) -> None:  # noqa: ANN001
    """Open the file (its stream starts), wait until the stream ended, close it."""
    streamer.opened(2, v)
    await streamer._active[(v.key, v.etag)].done.wait()
    streamer.closed(v)


async def test_streams_whole_data_region_in_offset_order(autojump_clock, tmp_path) -> None:  # noqa: ANN001
    store, engine, streamer = prefetch_rig("m.safetensors", model_bytes(tmp_path, 24 * MiB), memory=256 * MiB)

    async def body() -> None:
        v = version(store, "m.safetensors")
        streamer.opened(2, v)
        job = streamer._active[(v.key, v.etag)]
        await job.done.wait()
        chunks = len(engine.chunk_range(v, 0, v.size))
        # Every chunk but the first, which the header read had brought into memory: a chunk already in memory
        # is not counted again (it was, and a model loaded once could show several times its size).
        assert streamer.streamed_bytes == v.size - CHUNK
        starts = [start for _, start, _ in store.gets]
        assert sorted(starts) == [i * CHUNK for i in range(chunks)]
        # Offset order: no chunk is fetched before those more than one round of connections ahead.
        assert all(start // CHUNK <= i + 4 for i, start in enumerate(starts)), starts
        streamer.closed(v)

    await run_prefetcher(engine, streamer, body)


async def test_the_header_is_parsed_off_the_trio_thread(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A header of 100,000 tensors takes a second to parse: on the trio thread, every READ waited for it."""
    import fsmount.streaming

    threads: list[threading.Thread] = []

    def parse(data: bytes, size: int) -> object:
        threads.append(threading.current_thread())
        return parse_header(data, size)

    monkeypatch.setattr(fsmount.streaming, "parse_header", parse)
    store, engine, streamer = prefetch_rig("m.safetensors", model_bytes(tmp_path, 4 * MiB), memory=64 * MiB)

    async def body() -> None:
        v = version(store, "m.safetensors")
        await stream_once(streamer, v)
        assert streamer.streamed_bytes == v.size - CHUNK  # it streamed, so the parse worked

    await run_prefetcher(engine, streamer, body)
    assert len(threads) == 1 and threads[0] is not threading.current_thread()


async def test_a_stop_does_not_wait_for_a_parse_and_its_memory_stays_counted_until_it_ends(tmp_path,  # noqa: ANN001
                                                                                             monkeypatch) -> None:  # noqa: ANN001
    """A parse in its thread cannot be interrupted: the unmount waited for it (a hostile header's, for minutes).
    The stop leaves it behind, the memory it reserved is counted until the thread returns, and what it parsed is
    kept (the file's next open needs no parse)."""
    import time

    import fsmount.streaming

    started, go_on = threading.Event(), threading.Event()

    def slow_parse(data: bytes, size: int) -> object:
        started.set()
        go_on.wait(10)  # without the fix, the stop waits this long
        return parse_header(data, size)

    monkeypatch.setattr(fsmount.streaming, "parse_header", slow_parse)
    store, engine, streamer = prefetch_rig("m.safetensors", model_bytes(tmp_path, 4 * MiB), memory=64 * MiB)
    stopped: list[float] = []

    async def body() -> None:
        streamer.opened(2, version(store, "m.safetensors"))
        while not started.is_set():
            await trio.sleep(0.01)
        stopped.append(time.monotonic())
        streamer.stop()

    await run_prefetcher(engine, streamer, body)
    assert time.monotonic() - stopped[0] < 2
    assert engine.memory.reserved > 0  # the parse's, still running
    assert not streamer._data_ends
    go_on.set()
    with trio.fail_after(5):
        while engine.memory.reserved:
            await trio.sleep(0.01)
    v = version(store, "m.safetensors")
    assert streamer._data_ends[(v.key, v.etag)] == v.size


async def test_a_file_opened_and_not_read_is_pushed_whole_and_nothing_counts_as_served(
        autojump_clock, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The stream's own reads of the header are not READs: the header's chunk is pushed like every other (it
    was skipped as "read by the kernel"), and the stats count no byte as served to the kernel."""
    stored = recorded_stores(monkeypatch)
    store, engine, streamer = prefetch_rig("m.safetensors", model_bytes(tmp_path, 24 * MiB), memory=256 * MiB,
                                           push_limit=1 << 40)

    async def body() -> None:
        v = version(store, "m.safetensors")
        streamer.opened(2, v)
        await streamer._active[(v.key, v.etag)].done.wait()
        assert sorted(stored) == [i * CHUNK for i in engine.chunk_range(v, 0, v.size)]
        assert streamer.pusher.stored_total == v.size and streamer.skipped_read == 0
        s = engine.stats
        assert s.bytes_served_memory == s.bytes_served_level == s.bytes_served_origin == 0
        streamer.closed(v)

    await run_prefetcher(engine, streamer, body)


async def test_a_file_is_streaming_from_its_open_until_its_stream_ends(autojump_clock, tmp_path) -> None:  # noqa: ANN001
    store, engine, streamer = prefetch_rig("m.safetensors", model_bytes(tmp_path, 24 * MiB), memory=256 * MiB)

    async def body() -> None:
        v = version(store, "m.safetensors")
        assert not streamer.streaming(v)  # not open
        streamer.opened(2, v)
        assert streamer.streaming(v)
        await streamer._active[(v.key, v.etag)].done.wait()
        assert not streamer.streaming(v)  # every chunk fetched (and pushed where it could be)
        streamer.closed(v)

    await run_prefetcher(engine, streamer, body)


def test_the_push_limit_halves_at_each_eviction_under_memory_pressure() -> None:
    """Pushed pages of an open file dropped while little memory is free: the page cache cannot hold what is
    pushed. With memory free, the drop was explicit (drop_caches) and the limit stays."""
    free = [300 * MiB]
    pusher = PageCachePusher(1000 * MiB, free_memory=lambda: free[0])
    assert not pusher.evicted() and pusher.limit == 1000 * MiB  # 300 MiB free: a quarter of 1000 MiB and more
    free[0] = 200 * MiB
    assert pusher.evicted() and pusher.limit == 500 * MiB
    assert pusher.evicted() and pusher.limit == 250 * MiB
    pusher.pushed = 300 * MiB
    pusher.release(100 * MiB)
    assert pusher.limit == 250 * MiB  # files still hold pushes
    pusher.release(200 * MiB)
    assert pusher.limit == 1000 * MiB  # none does: the next load starts with the whole limit
    assert not PageCachePusher(0, free_memory=lambda: 0).evicted()  # pushes off: nothing to shrink


@pytest.mark.parametrize("pressure", [False, True])
async def test_a_file_the_kernel_dropped_is_streamed_again_unless_memory_is_short(
        autojump_clock, tmp_path, monkeypatch, pressure: bool) -> None:  # noqa: ANN001
    stored = recorded_stores(monkeypatch)
    data = model_bytes(tmp_path, 24 * MiB)
    store, engine, streamer = prefetch_rig("m.safetensors", data, memory=256 * MiB, push_limit=1 << 30,
                                           free_memory=(1 << 20) if pressure else (1 << 30))

    async def body() -> None:
        v = version(store, "m.safetensors")
        streamer.opened(2, v)
        first = streamer._active[(v.key, v.etag)]
        await first.done.wait()
        pushed = len(stored)
        streamer.dropped(v)
        job = streamer._active[(v.key, v.etag)]
        if pressure:
            assert job is first and streamer.pusher.limit == 1 << 29
        else:
            assert job is not first and job.again
            await job.done.wait()
            assert streamer.pusher.limit == 1 << 30
        assert len(stored) == pushed  # believed held still: nothing pushed again in this rig
        streamer.closed(v)

    await run_prefetcher(engine, streamer, body)


async def test_a_stream_run_again_fetches_only_the_chunks_the_kernel_says_it_lacks(
        autojump_clock, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A READ of a chunk believed held wipes the file's beliefs (kernel_lacks) and runs its stream again; that
    run asks the kernel which chunks it still holds whole (mount.Daemon.resident) and pushes only the others.
    Asked nothing (None), it pushes them all."""
    stored = recorded_stores(monkeypatch)
    store, engine, streamer = prefetch_rig("m.safetensors", model_bytes(tmp_path, 24 * MiB), memory=256 * MiB,
                                           push_limit=1 << 30)
    asked: list[tuple[int, list[tuple[int, int]]]] = []
    answers: list[list[bool] | None] = []

    async def resident(version, ino, ranges):  # noqa: ANN001, ANN202
        asked.append((ino, ranges))
        return answers.pop(0)

    streamer.resident = resident

    async def body() -> None:
        v = version(store, "m.safetensors")
        chunks = list(engine.chunk_range(v, 0, v.size))
        streamer.opened(2, v)
        await streamer._active[(v.key, v.etag)].done.wait()
        assert asked == []  # a first run asks nothing
        for answer, expect in (([i != 1 for i in chunks], [CHUNK]), (None, [i * CHUNK for i in chunks])):
            stored.clear()
            answers.append(answer)
            assert engine.kernel_lacks(v, CHUNK, CHUNK + 4096)
            streamer.dropped(v)
            job = streamer._active[(v.key, v.etag)]
            await job.done.wait()
            assert stored == expect
            ino, ranges = asked[-1]
            assert ino == 2 and ranges[0] == (0, CHUNK) and ranges[-1][1] == v.size
            job.again = False  # as if this were the file's first run again
        streamer.closed(v)

    await run_prefetcher(engine, streamer, body)


async def test_a_stop_waits_for_the_pushes_copying_and_refuses_new_ones(monkeypatch) -> None:  # noqa: ANN001
    """At a stop the pushes end before the FUSE loop stops reading requests: a notify_store waits for the locks
    of pages that a READ queued in /dev/fuse holds, and with nobody left to read it, the shielded push (and the
    daemon) waited for good. `stop` refuses new pushes and waits, bounded, for those in notify_store."""
    import fsmount.pagecache

    release = threading.Event()
    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", lambda ino, off, data: release.wait(10))
    pusher = PageCachePusher(1 << 30, pushes_at_once=2)
    stopped: list[bool] = []

    async def stop(timeout: float) -> None:
        stopped.append(await pusher.stop(timeout))

    async with trio.open_nursery() as n:
        n.start_soon(pusher.push, 2, 0, 4, lambda: b"data")
        await trio.sleep(0.05)  # in notify_store now, until `release`
        await stop(0.1)
        assert stopped == [False]  # still copying: the stop says so instead of waiting for good
        assert not await pusher.push(2, 4, 4, lambda: b"more")  # refused: no push starts during a stop
        n.start_soon(stop, 5)
        await trio.sleep(0.05)
        release.set()
    assert stopped == [False, True] and pusher.stored_total == 4


def stopping_daemon(pusher: PageCachePusher, dev: int) -> Any:
    """A `mount.Daemon` with only what its stop's end of the session reads: the pusher, the mount's device and its
    calls into the session, a mount point, an open session."""
    import types

    import fsmount.mount
    from fsmount.operations import SessionCalls

    daemon = fsmount.mount.Daemon.__new__(fsmount.mount.Daemon)
    daemon.pusher, daemon.mountpoint = pusher, "/mnt/m"
    daemon.ops = types.SimpleNamespace(device=dev, session_calls=SessionCalls())
    daemon._session_open, daemon._aborted, daemon._mount_id, daemon.shared_tier = True, None, None, None
    return daemon


def failing_engine(after: float) -> Callable[..., Awaitable[None]]:
    """An engine's `run` that starts, then fails `after` seconds on (a bug of the engine's)."""
    async def engine(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep(after)
        raise RuntimeError("a bug of the engine's")
    return engine


async def started_forever(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """A task of the mount that starts and runs until cancelled."""
    task_status.started()
    await trio.sleep_forever()


def serving_daemon(pusher: PageCachePusher, dev: int, engine: Callable[..., Awaitable[None]],
                   streams: Callable[..., Awaitable[None]] = started_forever) -> Any:
    """A `stopping_daemon` that `serve()` runs: `engine` and `streams` as its engine's and streamer's tasks, a signal
    watcher and an announcement that only wait, and no writes, caches, names or metrics (a test sets its own)."""
    import types

    daemon = stopping_daemon(pusher, dev)
    daemon.engine = types.SimpleNamespace(run=engine, levels=types.SimpleNamespace(writes_pending=0))
    daemon.streamer = types.SimpleNamespace(run=streams)
    daemon.namespace = types.SimpleNamespace(run=started_forever)  # its HEADs behind GETATTRs (none here)
    daemon._watch_signals = daemon._announce_ready = trio.sleep_forever
    daemon.writes = daemon.disk_cache = daemon.saved_names = daemon.metrics = None
    daemon._names_saving, daemon._names_failure_logged = trio.Lock(), False
    daemon._requests, daemon._served, daemon._drains = trio.CancelScope(), trio.Event(), trio.CancelScope()
    daemon._stopping, daemon.cut_short, daemon._grace = False, False, None
    return daemon


def a_kernel_holding_a_push(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, dev: int, push_stop_s: float) -> Any:
    """A fake kernel whose notify_store waits, as a push into the pages of a READ the loop cut short does, until the
    connection's fusectl `abort` (under `tmp_path`) is written (5 s at most, `gave_up`, so that a failing test ends);
    a session close that notes the pushes copying then (`closed`), a detach that notes the device (`detached`); and a
    streamer's task (`streams`) that pushes once into it."""
    import types

    import fsmount.mount
    import fsmount.pagecache

    conn = tmp_path / str((os.major(dev) << 20) | os.minor(dev))
    conn.mkdir()
    monkeypatch.setattr(fsmount.mount, "FUSECTL", str(tmp_path))
    monkeypatch.setattr(fsmount.mount, "PUSH_STOP_S", push_stop_s)
    k = types.SimpleNamespace(gave_up=[], closed=[], detached=[], pusher=PageCachePusher(1 << 30, pushes_at_once=1))

    def notify_store(ino: int, offset: int, data: bytes) -> None:
        deadline = time.monotonic() + 5
        while not (conn / "abort").exists():
            if time.monotonic() > deadline:
                k.gave_up.append(True)
                return
            time.sleep(0.01)

    async def streams(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await k.pusher.push(2, 0, 4, lambda: b"data")

    k.streams = streams
    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", notify_store)
    monkeypatch.setattr(fsmount.mount.pyfuse3, "close", lambda unmount: k.closed.append(k.pusher._copying))
    monkeypatch.setattr(fsmount.mount, "detach_aborted", lambda mountpoint, d: k.detached.append(d))
    return k


async def test_a_push_waiting_on_the_pages_of_a_read_cut_short_at_a_stop_is_ended_by_aborting_the_connection(
        monkeypatch, tmp_path, caplog, allowed_logs) -> None:  # noqa: ANN001
    """A stop cancels the READs still in flight after its grace and pyfuse3 sends no reply for them, so the kernel
    keeps their pages locked until the connection ends, and a notify_store waiting for those pages with them. `serve`
    left the session open (its close would free what the push writes to) and waited for the shielded push: the daemon
    never exited, even SIGKILLed, until someone aborted the connection (B116). Here notify_store waits, as the kernel
    does, until the connection's fusectl `abort` is written: the step that ends the session aborts it once the push
    outlives its wait, closes the session only after the push ended, and says so in one warning."""
    import fsmount.mount
    import fsmount.pagecache

    dev = os.makedev(0, 77)
    conn = tmp_path / str((os.major(dev) << 20) | os.minor(dev))
    conn.mkdir()
    monkeypatch.setattr(fsmount.mount, "FUSECTL", str(tmp_path))
    monkeypatch.setattr(fsmount.mount, "PUSH_STOP_S", 0.2)
    gave_up: list[bool] = []

    def notify_store(ino: int, offset: int, data: bytes) -> None:
        # The kernel's wait has no end of its own: only the abort ends it (and, so that this test ends, 5 s).
        deadline = time.monotonic() + 5
        while not ((conn / "abort").exists() and (conn / "abort").read_text() == "1"):
            if time.monotonic() > deadline:
                gave_up.append(True)
                return
            time.sleep(0.01)

    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", notify_store)
    closed: list[int] = []  # pushes copying when the session closed
    pusher = PageCachePusher(1 << 30, pushes_at_once=1)
    monkeypatch.setattr(fsmount.mount.pyfuse3, "close", lambda unmount: closed.append(pusher._copying))
    daemon = stopping_daemon(pusher, dev)
    allowed_logs.append("FUSE connection was aborted")
    async with trio.open_nursery() as n:
        n.start_soon(pusher.push, 2, 0, 4, lambda: b"data")
        await trio.sleep(0.05)  # in notify_store now: the READ's pages are locked
        await daemon._end_session_after_pushes()
    # The old code left the session open and waited (here until the fake kernel's 5 s) for the push.
    assert not gave_up and (conn / "abort").read_text() == "1" and closed == [0] and not daemon._session_open
    assert pusher.stored_total == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "was aborted" in warnings[0], warnings


@pytest.mark.parametrize(("euid", "advice"), [(0, "`umount -l /mnt/m` detaches it now"),
                                               (1000, "`fusermount3 -uz /mnt/m` detaches it now")])
async def test_an_aborted_mount_whose_push_outlives_the_aborts_wait_is_detached_when_the_session_closes(
        euid, advice, monkeypatch, tmp_path, caplog, allowed_logs) -> None:  # noqa: ANN001
    """A push still copying PUSH_ABORT_S after the stop aborted the connection (B116) keeps the session open, and the
    daemon waits for it; the session closes at the daemon's exit, where libfuse's unmount skips a severed connection.
    Only the stop's own close detached the aborted mount: this one stayed, ENOTCONN for everyone (B122). Its warning
    advised `umount -f`, which aborts a connection that is aborted already; a lazy unmount is what detaches the mount
    now, and one the daemon's user can run (B123)."""
    import fsmount.mount
    import fsmount.pagecache

    dev = os.makedev(0, 78)
    conn = tmp_path / str((os.major(dev) << 20) | os.minor(dev))
    conn.mkdir()
    monkeypatch.setattr(fsmount.mount, "FUSECTL", str(tmp_path))
    monkeypatch.setattr(fsmount.mount, "PUSH_STOP_S", 0.1)
    monkeypatch.setattr(fsmount.mount, "PUSH_ABORT_S", 0.1)

    def notify_store(ino: int, offset: int, data: bytes) -> None:
        deadline = time.monotonic() + 5  # the abort, then 0.5 s more: past PUSH_ABORT_S
        while not (conn / "abort").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)

    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", notify_store)
    monkeypatch.setattr(fsmount.mount.pyfuse3, "close", lambda unmount: None)
    monkeypatch.setattr(fsmount.mount.os, "geteuid", lambda: euid)
    detached: list[tuple[str, int]] = []
    monkeypatch.setattr(fsmount.mount, "detach_aborted", lambda mountpoint, d: detached.append((mountpoint, d)))
    pusher = PageCachePusher(1 << 30, pushes_at_once=1)
    daemon = stopping_daemon(pusher, dev)
    allowed_logs.append("after its connection was aborted")
    async with trio.open_nursery() as n:
        n.start_soon(pusher.push, 2, 0, 4, lambda: b"data")
        await trio.sleep(0.05)  # in notify_store now
        await daemon._end_session_after_pushes()
        assert (conn / "abort").read_text() == "1" and daemon._session_open and not detached
    daemon.end_session()  # run()'s, once the push ended
    assert detached == [("/mnt/m", dev)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and advice in warnings[0] and "umount -f" not in warnings[0], warnings


async def test_the_drops_of_kernel_entries_still_in_the_session_at_the_stop_end_before_it_closes(
        monkeypatch, tmp_path, caplog, allowed_logs) -> None:  # noqa: ANN001
    """A handler gives up on a drop of a kernel entry after INVALIDATE_WAIT_S (the directory's lock is held by a
    request in flight) and leaves its thread in pyfuse3.invalidate_entry; past DROP_THREADS a drop was queued to
    pyfuse3's own thread. The stop closed the session (pyfuse3.close frees it and closes its descriptor) with such
    calls still in libfuse, and queued ones went on calling into it (B124). Here the directory's lock is held by a
    request the stop cut short: only the connection's end lets it go. The stop waits for the calls, aborts the
    connection when they outlive SESSION_CALLS_S, and closes the session once none is in it; none starts after."""
    import fsmount.mount
    from fsmount import operations

    dev = os.makedev(0, 79)
    conn = tmp_path / str((os.major(dev) << 20) | os.minor(dev))
    conn.mkdir()
    monkeypatch.setattr(fsmount.mount, "FUSECTL", str(tmp_path))
    monkeypatch.setattr(fsmount.mount, "SESSION_CALLS_S", 0.2)
    monkeypatch.setattr(operations, "INVALIDATE_WAIT_S", 0.1)
    entered: list[bytes] = []
    in_session: list[bytes] = []

    def invalidate_entry(parent: int, name: bytes) -> None:
        entered.append(name)
        in_session.append(name)
        deadline = time.monotonic() + 5  # the kernel's wait for the lock ends with the connection (here, or 5 s)
        while not (conn / "abort").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        in_session.remove(name)

    monkeypatch.setattr(operations.pyfuse3, "invalidate_entry", invalidate_entry)
    closed: list[list[bytes]] = []  # the calls in the session when it closed
    monkeypatch.setattr(fsmount.mount.pyfuse3, "close", lambda unmount: closed.append(list(in_session)))
    monkeypatch.setattr(fsmount.mount, "detach_aborted", lambda mountpoint, d: None)
    daemon = stopping_daemon(PageCachePusher(1 << 30, pushes_at_once=1), dev)
    calls = daemon.ops.session_calls
    threads = trio.CapacityLimiter(1)
    await operations._drop_entry((1, b"a"), threads, calls)  # given up on: its thread waits for the lock
    await operations._drop_entry((1, b"b"), threads, calls)  # no thread free: queued
    await trio.sleep(0.05)
    assert sorted(in_session) == [b"a", b"b"]
    allowed_logs.append("FUSE connection was aborted to end it")
    await daemon._end_session_after_pushes()
    # The old code closed the session with both calls in it.
    assert closed == [[]] and (conn / "abort").read_text() == "1" and not daemon._session_open
    await operations._drop_entry((1, b"c"), trio.CapacityLimiter(1), calls)  # after the close: nothing
    assert sorted(entered) == [b"a", b"b"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "a kernel entry dropped" in warnings[0], warnings


@pytest.mark.parametrize("loop", ["bare", "nursery"])
async def test_a_task_of_the_mount_that_fails_ends_the_session_and_a_push_waiting_on_a_read_it_cut_short(
        monkeypatch, tmp_path, caplog, allowed_logs, loop) -> None:  # noqa: ANN001
    """A task of the mount that raises (a bug in the engine's or the streamer's) cancels `serve`'s nursery, and with
    it pyfuse3's loop: the READs in flight get no reply, so a push in notify_store waits for their pages with no end
    of its own, and the nursery for the push. Only the stop ended the session after the loop (B116): here the daemon
    never exited, its mount ENOTCONN for everyone, until someone aborted the connection (B127). Its end now runs on
    that path too: the connection is aborted, the push ends, the session closes, and the error goes on out. pyfuse3's
    loop runs its handlers in a nursery of its own, so its cancellation comes out of `main()` in an exception group,
    not as a bare Cancelled: B127's end did not run on that path, the real one (B128); both are tried here."""
    import fsmount.mount

    dev = os.makedev(0, 81)
    k = a_kernel_holding_a_push(monkeypatch, tmp_path, dev, push_stop_s=0.2)

    async def main() -> None:  # pyfuse3's loop: serves until cancelled
        if loop == "bare":
            await trio.sleep_forever()
        async with trio.open_nursery() as nursery:  # as pyfuse3.main: its session loop, a task of its nursery
            nursery.start_soon(trio.sleep_forever)

    monkeypatch.setattr(fsmount.mount.pyfuse3, "main", main)
    daemon = serving_daemon(k.pusher, dev, failing_engine(0.1), k.streams)  # fails once the push is in notify_store
    allowed_logs.append("FUSE connection was aborted")
    with pytest.raises(BaseExceptionGroup) as raised:
        await daemon.serve()
    assert raised.group_contains(RuntimeError, match="a bug of the engine's")
    # The old code waited for the push (here until the fake kernel's 5 s) and left the session open.
    assert not k.gave_up and k.closed == [0] and k.detached == [dev] and not daemon._session_open
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "was aborted to end it" in warnings[0], warnings


@pytest.mark.parametrize("claims", ["dropped", "failing", "hanging"])
async def test_a_task_of_the_mount_that_fails_drops_its_claims_and_saves_the_names(
        monkeypatch, caplog, allowed_logs, claims) -> None:  # noqa: ANN001
    """A task of the mount that fails ends the session (B127, B128), and ran none of a clean end's drains: the shared
    tier's claims stayed (other nodes waited up to CLAIM_TTL_S for the chunks) and the names learnt since the last
    round were not saved (B140). Both run now, each bounded and on its own: a drop of the claims that fails or hangs
    still lets the names be saved, and the error that ended the loop goes out."""
    import types

    import fsmount.mount

    async def main() -> None:  # as pyfuse3.main: its session loop, a task of its nursery
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)

    monkeypatch.setattr(fsmount.mount.pyfuse3, "main", main)
    monkeypatch.setattr(fsmount.mount.pyfuse3, "close", lambda unmount: None)
    monkeypatch.setattr(fsmount.mount, "CLAIM_DROP_S", 0.3)
    done: list[object] = []

    def drop_claims() -> int:
        if claims == "failing":
            raise RuntimeError("a bug of the tier's")
        if claims == "hanging":
            time.sleep(2)
        done.append("claims")
        return 2

    daemon = serving_daemon(PageCachePusher(1 << 30), os.makedev(0, 82), failing_engine(0.1))
    daemon.shared_tier = types.SimpleNamespace(drop_claims=drop_claims)
    daemon.saved_names = types.SimpleNamespace(dirty=True, path="/cache/names/n.json", snapshot=lambda: {"": "names"},
                                               save=lambda snapshot: done.append(snapshot))
    allowed_logs.append("could not be dropped after the mount's failure")
    start = time.monotonic()
    with pytest.raises(BaseExceptionGroup) as raised:
        await daemon.serve()
    assert raised.group_contains(RuntimeError, match="a bug of the engine's")
    assert time.monotonic() - start < 1.5
    # The old code ran neither: done == [].
    assert done == ([] if claims != "dropped" else ["claims"]) + [{"": "names"}], done
    assert not daemon._session_open
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == (["the shared cache's claims could not be dropped after the mount's failure: "
                         "RuntimeError(\"a bug of the tier's\")"] if claims == "failing" else []), warnings


async def test_a_task_of_the_mount_that_fails_during_the_loop_s_save_of_the_names_saves_them_again(
        monkeypatch) -> None:  # noqa: ANN001
    """A task of the mount that fails while the names task's own save is in its thread (a slow fsync) cancels that
    save, its thread abandoned, and the daemon exits before it ends. The snapshot had cleared `dirty`, so the save at
    the failure's end (B140) found nothing to write and the names of that round were lost (B142). The cancelled save
    leaves them dirty: the end's save writes them."""
    import types

    import fsmount.mount

    async def main() -> None:  # as pyfuse3.main: its session loop, a task of its nursery
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)

    monkeypatch.setattr(fsmount.mount.pyfuse3, "main", main)
    monkeypatch.setattr(fsmount.mount.pyfuse3, "close", lambda unmount: None)
    monkeypatch.setattr(fsmount.mount, "SAVE_EVERY_S", 0.05)
    saves: list[str] = []
    slow_write_done = threading.Event()

    def save(snapshot: object) -> None:
        if not saves:
            saves.append("loop's, begun")
            time.sleep(0.8)  # the loop's save: still writing as the engine fails
            slow_write_done.set()
            return
        saves.append("the end's")

    def snapshot() -> dict[str, str]:
        names.dirty = False
        return {"": "names"}

    daemon = serving_daemon(PageCachePusher(1 << 30), os.makedev(0, 82), failing_engine(0.3))
    names = types.SimpleNamespace(dirty=True, path="/cache/names/n.json", snapshot=snapshot, save=save)
    daemon.saved_names = names
    with pytest.raises(BaseExceptionGroup) as raised:
        await daemon.serve()
    assert raised.group_contains(RuntimeError, match="a bug of the engine's")
    # The old code: ["loop's, begun"], the end's save skipped as nothing was dirty.
    assert saves == ["loop's, begun", "the end's"], saves
    assert not slow_write_done.is_set(), "the loop's save ended before the failure: the test proves nothing"
    await trio.to_thread.run_sync(slow_write_done.wait, 5)


async def test_a_task_of_the_mount_that_fails_as_the_stop_ends_the_session_does_not_cut_that_end_short(
        monkeypatch, tmp_path, caplog, allowed_logs) -> None:  # noqa: ANN001
    """A stop's loop ended (main() returned) with a push waiting on the pages of a READ the stop cut short, and
    `serve` waits PUSH_STOP_S for the push before it aborts the connection (B116). A task of the mount that fails in
    that wait (a bug of the engine's, tripped by the READs the stop cancelled) cancelled it: the connection was never
    aborted, and the nursery, and so the daemon, waited for the push for good (B129). That end is shielded, as on
    the loop's own failure (B127): the connection is aborted, the push ends, the session closes, the error goes on."""
    import fsmount.mount

    dev = os.makedev(0, 82)
    k = a_kernel_holding_a_push(monkeypatch, tmp_path, dev, push_stop_s=0.6)

    async def main() -> None:  # pyfuse3's loop, ended by the stop's terminate()
        await trio.sleep(0.1)

    monkeypatch.setattr(fsmount.mount.pyfuse3, "main", main)
    # The engine fails once the loop has ended and the session's end waits for the push.
    daemon = serving_daemon(k.pusher, dev, failing_engine(0.3), k.streams)
    allowed_logs.append("FUSE connection was aborted")
    with pytest.raises(BaseExceptionGroup) as raised:
        await daemon.serve()
    assert raised.group_contains(RuntimeError, match="a bug of the engine's")
    # The old code stopped waiting at the failure, never aborted, and waited for the push (the fake kernel's 5 s).
    assert not k.gave_up and k.closed == [0] and k.detached == [dev] and not daemon._session_open
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "was aborted to end it" in warnings[0], warnings


async def test_the_stop_aborts_the_connection_once_for_a_call_and_a_push_that_both_outlive_their_waits(
        monkeypatch, caplog, allowed_logs) -> None:  # noqa: ANN001
    """The step that ends the session aborts the connection for a call into the session still under way after
    SESSION_CALLS_S (B124), and for a push still copying after PUSH_STOP_S (B116): once a stop (`_abort_once`). The
    push's warning says the connection was aborted already, not that it was aborted to end the push."""
    import fsmount.mount
    import fsmount.pagecache
    from fsmount import operations

    dev = os.makedev(0, 80)
    aborts: list[int] = []
    aborted = threading.Event()

    def abort_connection(d: int) -> None:
        aborts.append(d)
        aborted.set()

    monkeypatch.setattr(fsmount.mount, "abort_connection", abort_connection)
    monkeypatch.setattr(fsmount.mount, "SESSION_CALLS_S", 0.1)
    monkeypatch.setattr(fsmount.mount, "PUSH_STOP_S", 0.1)
    monkeypatch.setattr(operations.pyfuse3, "invalidate_entry", lambda parent, name: aborted.wait(5))

    def notify_store(ino: int, offset: int, data: bytes) -> None:
        aborted.wait(5)
        time.sleep(0.3)  # past PUSH_STOP_S after the abort, within PUSH_ABORT_S

    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", notify_store)
    monkeypatch.setattr(fsmount.mount.pyfuse3, "close", lambda unmount: None)
    monkeypatch.setattr(fsmount.mount, "detach_aborted", lambda mountpoint, d: None)
    pusher = PageCachePusher(1 << 30, pushes_at_once=1)
    daemon = stopping_daemon(pusher, dev)
    allowed_logs.append("FUSE connection was aborted")
    async with trio.open_nursery() as n:
        n.start_soon(pusher.push, 2, 0, 4, lambda: b"data")
        await operations._drop_entry((1, b"a"), trio.CapacityLimiter(0), daemon.ops.session_calls)  # queued
        await trio.sleep(0.05)
        await daemon._end_session_after_pushes()
    assert aborts == [dev] and daemon._aborted == dev and not daemon._session_open
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and "aborted already" in warnings[1], warnings


def test_what_comes_out_of_the_fuse_loop_ends_the_session_there_only_for_a_failure() -> None:
    """`serve` ends the session itself, shielded, when the loop ends on a failure (B127): an exception, or the
    cancellation of a task of the mount that failed, which pyfuse3.main's own nursery hands on in an exception group
    (B128). A KeyboardInterrupt (a Ctrl-C that no receiver takes: after the drains, SIGINT has its default action)
    ends the daemon at once, as before: not the shielded end, up to PUSH_STOP_S + PUSH_ABORT_S."""
    from fsmount.mount import _loop_failed

    def cancelled() -> trio.Cancelled:
        return trio.Cancelled._create(source="nursery")  # type: ignore[attr-defined]

    assert _loop_failed(RuntimeError("bug")) and _loop_failed(cancelled())
    assert _loop_failed(BaseExceptionGroup("pyfuse3's nursery", [cancelled()]))
    assert _loop_failed(BaseExceptionGroup("", [cancelled(), ExceptionGroup("", [OSError(5, "EIO")])]))
    assert not _loop_failed(KeyboardInterrupt())
    assert not _loop_failed(BaseExceptionGroup("", [cancelled(), KeyboardInterrupt()]))


def test_a_queued_drop_of_a_kernel_entry_that_fails_unexpectedly_leaves_the_queue_served(
        monkeypatch, caplog, allowed_logs) -> None:  # noqa: ANN001
    """The drops of kernel entries that no thread of the mount's was free for go to SessionCalls' one thread, in
    order. Only an OSError of pyfuse3.invalidate_entry (ENOENT: the kernel holds no such entry) was caught: anything
    else (a TypeError of an argument pyfuse3 does not take, a MemoryError) ended that thread, said only on stderr, and
    every later drop was queued behind it for good, never run (the kernel kept the stale entries) and held until the
    stop (B126). The queue goes on; the first failure is logged with its traceback, the others at debug level."""
    from fsmount import operations

    dropped: list[bytes] = []

    def invalidate_entry(parent: int, name: bytes) -> None:
        if name.startswith(b"bad"):
            raise TypeError(f"an argument pyfuse3 does not take: {name!r}")
        dropped.append(name)

    monkeypatch.setattr(operations.pyfuse3, "invalidate_entry", invalidate_entry)
    allowed_logs.append("a call into the FUSE session failed unexpectedly")
    calls = operations.SessionCalls()
    for name in (b"bad-1", b"a", b"bad-2", b"b"):
        calls.queue(operations._invalidate_entry, 1, name)
    deadline = time.monotonic() + 5
    while len(dropped) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # The old code's thread ended at the first: nothing after it ran, and the queue kept all three.
    assert dropped == [b"a", b"b"]
    assert calls.end(1)
    failures = [r for r in caplog.records if "failed unexpectedly" in r.getMessage()]
    assert [r.levelno for r in failures] == [logging.ERROR, logging.DEBUG], failures
    assert failures[0].exc_info is not None


def test_an_aborted_mount_that_a_daemon_not_root_cannot_detach_is_left_to_fusermount3(
        monkeypatch, caplog, allowed_logs) -> None:  # noqa: ANN001
    """umount2 is EPERM for a daemon that is not root, and so is `umount -l` for its user, which the warning advised;
    `fusermount3 -uz` detaches a user's own FUSE mount (B123). A mount of /proc/self/mountinfo stands in for the
    aborted one (umount2 is faked: nothing is unmounted)."""
    import types

    import fsmount.mount

    with open("/proc/self/mountinfo", "rb") as f:
        mounts = [line.split() for line in f]
    # the only mount at its path, which has nothing escaped
    major_minor, at = next((fields[2], fields[4]) for fields in mounts
                           if b"\\" not in fields[4] and sum(o[4] == fields[4] for o in mounts) == 1)
    major, minor = map(int, major_minor.split(b":"))
    libc = types.SimpleNamespace(umount2=lambda path, flags: -1)
    monkeypatch.setattr(fsmount.mount, "ctypes", types.SimpleNamespace(CDLL=lambda name, use_errno: libc,
                                                                        get_errno=lambda: errno.EPERM))
    monkeypatch.setattr(fsmount.mount.os, "geteuid", lambda: 1000)
    # The daemon runs fusermount3 -uz itself now (B184): faked, as this test runs as root and must unmount nothing.
    ran: list[list[str]] = []
    answer = {"rc": 1}

    def fusermount(argv, **kw):  # noqa: ANN001, ANN003, ANN202
        ran.append(argv)
        return subprocess.CompletedProcess(argv, answer["rc"], "", "" if answer["rc"] == 0 else
                                           f"fusermount3: failed to unmount {argv[-1]}: Invalid argument\n")

    monkeypatch.setattr(fsmount.mount.subprocess, "run", fusermount)
    allowed_logs.append("could not be unmounted")
    assert not fsmount.mount.detach_aborted(os.fsdecode(at), os.makedev(major, minor))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # fusermount3 -uz failed: the warning names root's lazy unmount, not the command that has just failed.
    assert len(warnings) == 1 and f"root's `umount -l {os.fsdecode(at)}` does it" in warnings[0], warnings
    assert "fusermount3: failed to unmount" in warnings[0] and ran[-1][1:] == ["-uz", os.fsdecode(at)], (warnings, ran)
    answer["rc"] = 0  # its own mount: fusermount3 detaches it, and no warning
    caplog.clear()
    assert fsmount.mount.detach_aborted(os.fsdecode(at), os.makedev(major, minor)) and len(ran) == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_header_whose_parse_would_take_half_the_chunk_memory_is_not_streamed(autojump_clock, caplog,  # noqa: ANN001
                                                                                         allowed_logs) -> None:  # noqa: ANN001
    """A header's parse takes ~15x its size, outside the chunk budget: a 97 MB header of 1.4 million tensors
    took the daemon to 1.5 GB, three at once at --memory-limit 256M to 4.3 GB. One parse at a time, its memory
    reserved from the budget; a header that would need more than half of it is not streamed (one line)."""
    import json
    import struct

    count = 12_000  # ~0.8 MB of header: ~13 MiB to parse, above half of 16 MiB
    header = json.dumps({f"t{i:05d}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
                         for i in range(count)}).encode()
    blob = struct.pack("<Q", len(header)) + header + bytes(count)
    store, engine, streamer = prefetch_rig("m.safetensors", blob, memory=16 * MiB)
    caplog.set_level(logging.INFO, logger="fsmount.streaming")

    async def body() -> None:
        v = version(store, "m.safetensors")
        streamer.opened(2, v)
        await streamer._active[(v.key, v.etag)].done.wait()
        streamer.closed(v)
        assert engine.memory.reserved == 0

    await run_prefetcher(engine, streamer, body)
    said = [r.getMessage() for r in caplog.records if "not streaming" in r.getMessage()]
    assert len(said) == 1 and "more than half of this mount's chunk memory" in said[0], said


NESTED_LISTS = b"[" * 100 + b"]" * 100
NESTED_DICTS = b'{"":' * 100 + b"0" + b"}" * 100


@pytest.mark.parametrize("items", [
    b"{}," * 1_000_000,  # a list of empty dicts: 26x its size
    b"[]," * 1_000_000,
    b",".join([NESTED_LISTS] * 8000),  # 49x
    b",".join([NESTED_DICTS] * 8000),  # 42x
    '"\u0100",'.encode() * 1_000_000,  # short strings, no containers: 21x
    b"1e1," * 1_000_000,
], ids=["empty dicts", "empty lists", "nested lists", "nested dicts", "short strings", "floats"])
def test_the_memory_reserved_for_a_parse_covers_a_hostile_header(items: bytes) -> None:
    """json.loads builds up to ~90 bytes per `[` or `{`: a flat 16x the header left a header of `{}`s (26x)
    or nested lists (49x) to take memory beyond --memory-limit. A character that makes the decoded str 4 bytes
    a character is in each (the name 😀), as it raises the peak by ~3x the header."""
    import struct
    import tracemalloc

    from fsmount.safetensors import SafetensorsError
    from fsmount.streaming import parse_cost

    header = '{"😀":['.encode() + items + b"0]}"
    blob = struct.pack("<Q", len(header)) + header + b"\0"
    tracemalloc.start()
    try:
        parse_header(blob, len(blob))
    except SafetensorsError:
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    reserved = parse_cost(blob)
    assert peak <= reserved, f"peak {peak / len(header):.1f}x the header, {reserved / len(header):.1f}x reserved"


class IndexedLevel:
    """A local cache level in a dict with an index in memory (`contains`, as DiskCache has)."""

    def __init__(self, indexed: bool) -> None:
        self.chunks: dict = {}
        if indexed:
            self.contains = self.chunks.__contains__

    def get(self, cid, buffer=None):  # noqa: ANN001, ANN201
        return self.chunks.get(cid)

    def put(self, cid, data) -> None:  # noqa: ANN001
        self.chunks[cid] = bytes(data)


@pytest.mark.parametrize("indexed", [True, False])
async def test_a_model_on_local_disk_is_streamed_only_a_few_chunks_ahead(autojump_clock, tmp_path,  # noqa: ANN001
                                                                         indexed: bool) -> None:
    """Each chunk a stream has queued holds a buffer until its push: chunks a local level says it holds take
    milliseconds, so at most NEARBY_DEPTH of them are under way at once, not 2 per connection."""
    from fsmount.streaming import NEARBY_DEPTH

    store = FakeStore()
    store.put("m.safetensors", model_bytes(tmp_path, 40 * MiB))
    level = IndexedLevel(indexed)
    running = peak = 0

    async def runner(fn, *args, limiter):  # noqa: ANN001, ANN202
        nonlocal running, peak
        async with limiter:
            running += 1
            peak = max(peak, running)
            try:
                await trio.sleep(LATENCY)
                return fn(*args)
            finally:
                running -= 1

    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=256 * MiB, max_connections=8, read_timeout=30.0,
                         levels=[level], run_blocking=runner)
    streamer = ModelStreamer(engine, PageCachePusher(0), max_connections=8)
    v = version(store, "m.safetensors")
    data = store.objects[v.key]
    for i in engine.chunk_range(v, 0, v.size):
        level.put(engine.chunk_id(v, i), data[i * CHUNK:(i + 1) * CHUNK])

    async def body() -> None:
        nonlocal peak
        await engine.read(v, 0, 100)  # the header's chunk, as the loader's first READ brings it
        peak = 0
        streamer.opened(2, v)
        await streamer._active[(v.key, v.etag)].done.wait()
        streamer.closed(v)

    await run_prefetcher(engine, streamer, body)
    assert not store.gets and streamer.streamed_bytes == v.size - CHUNK  # all of it, from the level
    assert peak <= NEARBY_DEPTH if indexed else peak == 8, peak


@pytest.mark.parametrize("files", [1, 2])
async def test_streams_together_hold_at_most_their_share_of_memory(autojump_clock, tmp_path,  # noqa: ANN001
                                                                   monkeypatch, files: int) -> None:
    """A chunk a stream fetches holds memory from its GET to its push. All streams together keep within half
    the chunk memory left beside the kernel windows of the files open (`ModelStreamer.room`), so that they
    never evict what they or a loader's read-ahead fetched before its push or READ: with 8 chunks of memory
    and two 1-chunk windows per open file, 3 chunks at most for one file and 2 for two, where each stream
    used to queue 2 per connection (8 connections). Every chunk is still fetched once, and pushed."""
    import threading

    import fsmount.pagecache

    store = FakeStore()
    models = {f"m{i}.safetensors": model_bytes(tmp_path, 12 * MiB, seed=i) for i in range(files)}
    for key, data in models.items():
        store.put(key, data)
    lock = threading.Lock()
    held = peak = 0
    stored: list[int] = []

    def notify_store(ino: int, offset: int, data: object) -> None:
        nonlocal held
        with lock:
            stored.append(offset)
            held -= offset > 0

    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", notify_store)

    async def runner(fn, *args, limiter):  # noqa: ANN001, ANN202
        nonlocal held, peak
        async with limiter:
            if fn.__name__ == "get_range" and args[2] > 0:  # chunk 0: the streams' own header reads
                with lock:
                    held += 1
                    peak = max(peak, held)
                await trio.sleep(LATENCY)
            return fn(*args)

    engine = ChunkEngine(store, chunk_size=CHUNK, memory_limit=8 * MiB, max_connections=8, read_timeout=30.0,
                         run_blocking=runner)
    streamer = ModelStreamer(engine, PageCachePusher(1 << 40, kernel_readahead=CHUNK), max_connections=8,
                             readers=lambda: files)
    versions = [version(store, key) for key in models]

    async def body() -> None:
        for ino, v in enumerate(versions, start=2):
            streamer.opened(ino, v)
        for v in versions:
            await streamer._active[(v.key, v.etag)].done.wait()
        for v in versions:
            streamer.closed(v)

    await run_prefetcher(engine, streamer, body)
    assert peak == {1: 3, 2: 2}[files], peak
    assert len(store.gets) == len(set(store.gets)), "a chunk fetched twice"
    assert len(stored) == sum(len(engine.chunk_range(v, 0, v.size)) for v in versions)


async def test_close_cancels_prefetch(autojump_clock, tmp_path) -> None:  # noqa: ANN001
    store, engine, streamer = prefetch_rig("m.safetensors", model_bytes(tmp_path, 64 * MiB), conns=2,
                                             memory=512 * MiB)

    async def body() -> None:
        v = version(store, "m.safetensors")
        streamer.opened(2, v)
        await trio.sleep(0.2)
        streamer.closed(v)
        await trio.sleep(30)
        assert len(store.gets) < 20  # of 65 chunks
        assert not streamer._active

    await run_prefetcher(engine, streamer, body)


async def test_a_file_rewritten_through_the_mount_stops_its_stream_while_handles_stay_open(
        autojump_clock, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A rewrite through the mount keeps the inode: the old version's stream would push old bytes into the pages
    of the new file. It ends at once; its handles' closes later change nothing.

    The push in flight at the rewrite ends in its thread, and only then are the stream's pushes given back: the
    test waited for it with a sleep of virtual time, which the autojump clock passes at once while that thread
    waits for a CPU (with two busy loops on its one core, `pushed` was still 3 MiB in 1 run of 9)."""
    stored = recorded_stores(monkeypatch)
    store, engine, streamer = prefetch_rig("m.safetensors", model_bytes(tmp_path, 64 * MiB), conns=2,
                                           memory=512 * MiB, push_limit=1 << 40)

    async def body() -> None:
        v = version(store, "m.safetensors")
        streamer.opened(2, v)
        streamer.opened(2, v)  # two descriptors
        job = streamer._active[(v.key, v.etag)]
        while not stored:  # pushing
            await trio.sleep(0.01)
        streamer.rewritten(v)
        assert not streamer.streaming(v) and not streamer._active
        pushed, gets = len(stored), len(store.gets)
        await trio.sleep(30)
        await job.done.wait()  # the push in flight has ended in its thread
        assert len(stored) <= pushed + 1 and len(store.gets) <= gets + 2  # at most what was in flight
        assert len(store.gets) < 20  # of 65 chunks
        streamer.closed(v)
        streamer.closed(v)
        assert streamer.pusher.pushed == 0  # what it pushed no longer counts against the push limit

    await run_prefetcher(engine, streamer, body)


async def test_malformed_header_only_disables_prefetch(autojump_clock, caplog) -> None:  # noqa: ANN001
    store, engine, streamer = prefetch_rig("bad.safetensors", (10**12).to_bytes(8, "little") + os.urandom(3 * MiB))

    async def body() -> None:
        v = version(store, "bad.safetensors")
        streamer.opened(2, v)
        await streamer._active[(v.key, v.etag)].done.wait()
        assert len(store.gets) == 1
        assert bytes(await engine.read(v, 100, 200)) == store.objects[v.key][100:200]
        streamer.closed(v)
        for _ in range(3):  # opened again and again: said at INFO once
            await stream_once(streamer, v)

    await run_prefetcher(engine, streamer, body)
    said = [r for r in caplog.records if "not streaming" in r.getMessage()]
    assert [r.levelname for r in said if r.levelno >= logging.INFO] == ["INFO"], said


async def test_a_rejected_header_is_logged_and_kept_in_one_short_line(autojump_clock, caplog) -> None:  # noqa: ANN001
    """The reason quoted a hostile header's whole shape: 1 MB of it logged, and kept for as long as the version is
    remembered as not streamed."""
    import struct

    header = b'{"t":{"dtype":"U8","shape":[' + b"0," * 500_000 + b'0],"data_offsets":[0,1]}}'
    store, engine, streamer = prefetch_rig("m.safetensors", struct.pack("<Q", len(header)) + header + b"\0",
                                           memory=256 * MiB)
    caplog.set_level(logging.INFO, logger="fsmount.streaming")

    async def body() -> None:
        v = version(store, "m.safetensors")
        await stream_once(streamer, v)
        assert len(streamer._not_streamed[(v.key, v.etag)]) < 300

    await run_prefetcher(engine, streamer, body)
    said = [r.getMessage() for r in caplog.records if "not streaming" in r.getMessage()]
    assert len(said) == 1 and len(said[0]) < 400 and "bytes for shape [0, 0," in said[0], said[0][:400]


async def test_chunks_readers_already_read_are_not_pushed_again(autojump_clock, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """READs put their bytes in the page cache; pushing the same chunk would copy it there twice."""
    stored = recorded_stores(monkeypatch)
    store, engine, streamer = prefetch_rig("m.safetensors", model_bytes(tmp_path, 12 * MiB), memory=256 * MiB,
                                             push_limit=1 << 40)

    async def body() -> None:
        v = version(store, "m.safetensors")
        await engine.read(v, 0, 3 * CHUNK + 100)  # a reader got through chunks 0-3 first
        streamer.opened(2, v)
        await streamer._active[(v.key, v.etag)].done.wait()
        chunks = len(engine.chunk_range(v, 0, v.size))
        assert sorted(stored) == [i * CHUNK for i in range(4, chunks)]
        assert streamer.skipped_read == 4 * CHUNK
        streamer.closed(v)

    await run_prefetcher(engine, streamer, body)


async def test_what_a_reader_is_about_to_read_is_left_to_its_reads(autojump_clock, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """From the end of an inode's latest READ to two kernel read-ahead windows past it (the one being read
    and the next, which the kernel may have asked for already), a sequential reader's READs take the bytes
    within moments: a push there would race them and copy those bytes twice."""
    stored = recorded_stores(monkeypatch)
    store, engine, streamer = prefetch_rig("m.safetensors", model_bytes(tmp_path, 12 * MiB), memory=256 * MiB,
                                             push_limit=1 << 40, kernel_readahead=CHUNK)
    pusher = streamer.pusher

    async def body() -> None:
        v = version(store, "m.safetensors")
        with pusher.reading(2, 0, 3 * CHUNK + 100):  # a READ of inode 2 that ended in chunk 3
            await engine.read(v, 0, 3 * CHUNK + 100)
        assert not pusher.reader_near(3, 3 * CHUNK, 4 * CHUNK)  # another inode
        assert not pusher.reader_near(2, 2 * CHUNK, 3 * CHUNK)  # behind the reader
        # Two windows of one chunk: up to 5 * CHUNK + 100.
        assert pusher.reader_near(2, 5 * CHUNK, 6 * CHUNK) and not pusher.reader_near(2, 6 * CHUNK, 7 * CHUNK)
        streamer.opened(2, v)
        await streamer._active[(v.key, v.etag)].done.wait()
        chunks = len(engine.chunk_range(v, 0, v.size))
        # 0-3 were read; 3-5 lie where the reader's next READs land; the rest is pushed ahead of it.
        assert sorted(stored) == [i * CHUNK for i in range(6, chunks)]
        assert streamer.skipped_read == 6 * CHUNK
        streamer.closed(v)

    await run_prefetcher(engine, streamer, body)


async def test_a_queued_push_asks_again_whether_it_is_wanted(monkeypatch) -> None:
    stored = recorded_stores(monkeypatch)
    pusher = PageCachePusher(1 << 40, pushes_at_once=2)
    wanted = True
    results: list[bool] = []

    async def push(offset: int) -> None:
        results.append(await pusher.push(2, offset, 4096, lambda: b"x" * 4096 if wanted else None))

    async with trio.open_nursery() as n:
        for _ in range(pusher.pushes_at_once):  # as many other pushes are running: this one queues behind them
            await pusher._turn.acquire()
        n.start_soon(push, 0)
        await trio.testing.wait_all_tasks_blocked()
        wanted = False  # meanwhile READs took the bytes
        for _ in range(pusher.pushes_at_once):
            pusher._turn.release()
        await trio.testing.wait_all_tasks_blocked()
    assert results == [False] and stored == [] and pusher.pushed == 0
    await push(4096)  # wanted() is still False: skipped at once
    wanted = True
    await push(8192)
    assert results == [False, False, True] and stored == [8192] and pusher.pushed == 4096


@pytest.mark.parametrize("at_once", [1, 2, 3])
async def test_pushes_run_in_threads_at_once_and_take_turns_in_the_order_they_were_queued(monkeypatch,
                                                                                          at_once: int) -> None:
    """notify_store releases the GIL, so `pushes_at_once` pushes copy in parallel (past one core); further
    pushes wait for a turn, first come first served, so a stream's pushes keep to its offset order."""
    import threading

    import fsmount.pagecache

    together = threading.Barrier(at_once, timeout=5)  # broken unless that many stores overlap
    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", lambda ino, off, data: together.wait())
    pusher = PageCachePusher(1 << 40, pushes_at_once=at_once)
    taken: list[int] = []
    results: dict[int, bool] = {}

    async def push(offset: int) -> None:
        results[offset] = await pusher.push(2, offset, 4096, lambda: taken.append(offset) or b"x" * 4096)

    offsets = [i * 4096 for i in range(3 * at_once)]
    async with trio.open_nursery() as n:
        for _ in range(at_once):  # every turn busy while the pushes queue
            await pusher._turn.acquire()
        for offset in offsets:
            n.start_soon(push, offset)
            await trio.testing.wait_all_tasks_blocked()
        for _ in range(at_once):
            pusher._turn.release()
    assert results == {offset: True for offset in offsets} and pusher.stored_total == len(offsets) * 4096
    # Turns go first come first served; pushes given turns at the same moment run in either order.
    assert sorted(taken) == offsets and all(abs(taken.index(o) - i) < at_once for i, o in enumerate(offsets))


@pytest.mark.parametrize(("cpus", "expected"), [({1}, 1), ({0, 1}, 1), ({0, 1, 2}, 1), (set(range(4)), 2),
                                                 (set(range(16)), 2)])
def test_pushes_go_in_parallel_only_where_the_daemon_has_the_cores(monkeypatch, cpus: set[int],
                                                                     expected: int) -> None:
    import fsmount.pagecache

    monkeypatch.setattr(fsmount.pagecache.os, "sched_getaffinity", lambda pid: cpus)
    assert fsmount.pagecache.default_pushes_at_once() == expected
    assert PageCachePusher(1 << 30).pushes_at_once == expected


def test_only_the_shards_of_the_model_opened_are_warmed() -> None:
    """Hugging Face's shard names tie the shards (and the index) of one model together; other safetensors
    files of the directory (checkpoints of other steps, an adapter, another model's shards) are not warmed."""
    from fsmount.streaming import model_of, same_model

    shard = model_of("llm/model-00001-of-00004.safetensors")
    index = model_of("llm/model.safetensors.index.json")
    assert shard == ("llm/model", "00004") and index == ("llm/model", None)
    for opened in (shard, index):
        assert opened is not None
        assert same_model(opened, "llm/model-00003-of-00004.safetensors")
        assert not same_model(opened, "llm/adapter.safetensors")
        assert not same_model(opened, "llm/model.safetensors")
        assert not same_model(opened, "llm/other-00001-of-00004.safetensors")
        assert not same_model(opened, "other/model-00002-of-00004.safetensors")
        assert not same_model(opened, "llm/model.safetensors.index.json")
    assert shard is not None and not same_model(shard, "llm/model-00001-of-00002.safetensors")  # another count
    assert model_of("ckpts/step-1000.safetensors") is None and model_of("llm/model.safetensors") is None
    assert model_of("diffusion_pytorch_model-00001-of-00002.safetensors") == ("/diffusion_pytorch_model", "00002")


SHARD_1, SHARD_2 = "llm/model-00001-of-00002.safetensors", "llm/model-00002-of-00002.safetensors"


def shards_rig(tmp_path, monkeypatch, sibling_ino: int | None):  # noqa: ANN001, ANN201
    """Two shards of one model in the fake store, a streamer that warms the second when the first opens
    (the kernel knows the second as `sibling_ino`, or not yet), and the pushes it makes, as (inode, offset)."""
    import fsmount.pagecache

    pushes: list[tuple[int, int]] = []
    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", lambda ino, off, data: pushes.append((ino, off)))
    store = FakeStore()
    store.put(SHARD_1, model_bytes(tmp_path, 6 * MiB, seed=1))
    store.put(SHARD_2, model_bytes(tmp_path, 12 * MiB, seed=2))
    engine = make_engine(store, conns=2, memory=256 * MiB)

    async def siblings(ino: int) -> list:  # noqa: ARG001
        return [(2, version(store, SHARD_1)), (sibling_ino, version(store, SHARD_2))]

    streamer = ModelStreamer(engine, PageCachePusher(1 << 40), max_connections=2, siblings=siblings)
    return store, engine, streamer, pushes


def shard_2_gets(store: FakeStore) -> list[int]:
    return sorted(start for key, start, _ in store.gets if key == SHARD_2)


@pytest.mark.parametrize("sibling_ino", [3, None])
async def test_a_shard_opened_while_it_is_warmed_is_fetched_and_pushed_once(autojump_clock, tmp_path, monkeypatch,  # noqa: ANN001
                                                                            sibling_ino: int | None) -> None:
    """Known to the kernel, the shard's warming pushed what it fetched and goes on for the handle; unknown, it
    could push nothing, and a stream of the open file pushes what the warming fetched."""
    store, engine, streamer, pushes = shards_rig(tmp_path, monkeypatch, sibling_ino=sibling_ino)

    async def body() -> None:
        one, two = version(store, SHARD_1), version(store, SHARD_2)
        streamer.opened(2, one)
        # Polled, not bounded by a virtual-time timeout: the pushes run in real threads, and the autojump
        # clock runs on meanwhile (pytest-timeout bounds a hang).
        while not shard_2_gets(store):  # the second shard is being warmed, for nobody yet
            await trio.sleep(0.01)
        warming = streamer._active[(two.key, two.etag)]
        streamer.opened(3, two)
        job = streamer._active[(two.key, two.etag)]
        assert (job is warming) == (sibling_ino is not None) and job.ino == 3 and job.handles == 1
        await job.done.wait()
        chunks = len(engine.chunk_range(two, 0, two.size))
        assert shard_2_gets(store) == [i * CHUNK for i in range(chunks)]  # each chunk fetched once
        mine = [off for ino, off in pushes if ino == 3]
        assert len(mine) == len(set(mine)), pushes  # pushed once each
        assert len(mine) >= chunks - 1, (mine, chunks)  # every chunk but one the header read took
        streamer.closed(two)
        streamer.closed(one)
        assert not streamer._active

    await run_prefetcher(engine, streamer, body)


async def test_a_shard_warmed_before_it_is_opened_is_not_streamed_again(autojump_clock, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    store, engine, streamer, pushes = shards_rig(tmp_path, monkeypatch, sibling_ino=3)

    async def body() -> None:
        one, two = version(store, SHARD_1), version(store, SHARD_2)
        streamer.opened(2, one)
        while not shard_2_gets(store):  # polled, as above
            await trio.sleep(0.01)
        while (two.key, two.etag) in streamer._active:  # until warmed, and held by no handle
            await trio.sleep(0.01)
        assert len([1 for ino, _ in pushes if ino == 3]) >= len(engine.chunk_range(two, 0, two.size)) - 1
        gets, pushed = list(store.gets), list(pushes)
        streamer.opened(3, two)
        await streamer._active[(two.key, two.etag)].done.wait()
        # Its header is read again (memory may have let it go); no chunk the page cache holds is fetched or
        # pushed a second time.
        assert store.gets == gets and pushes == pushed, (store.gets[len(gets):], pushes[len(pushed):])
        streamer.closed(two)
        streamer.closed(one)

    await run_prefetcher(engine, streamer, body)


async def test_an_index_warms_the_shards_it_names_not_an_older_sharding_beside_them(  # noqa: ANN001
        autojump_clock, tmp_path, monkeypatch) -> None:
    """A model re-sharded in place leaves the old shards (another count) beside the new ones: the index names
    the model's, and those alone are warmed."""
    import json

    store, engine, streamer, _ = shards_rig(tmp_path, monkeypatch, sibling_ino=3)
    index, stale = "llm/model.safetensors.index.json", "llm/model-00001-of-00003.safetensors"
    store.put(index, json.dumps({"metadata": {}, "weight_map": {
        "a": SHARD_1.rpartition("/")[2], "b": SHARD_2.rpartition("/")[2]}}).encode())
    store.put(stale, model_bytes(tmp_path, 4 * MiB, seed=3))
    names = (index, SHARD_1, SHARD_2, stale)

    async def siblings(ino: int) -> list:  # noqa: ARG001
        return [(None, version(store, key)) for key in names]

    streamer.siblings = siblings
    # Parsed as a header is: one at a time, its memory reserved from the chunk budget.
    import fsmount.streaming

    parses: list[tuple[bool, int, int]] = []
    real_index_shards = fsmount.streaming.index_shards

    def index_shards(data: bytes) -> set[str] | None:
        parses.append((streamer._parsing.locked(), engine.memory.reserved, fsmount.streaming.parse_cost(data)))
        return real_index_shards(data)

    monkeypatch.setattr(fsmount.streaming, "index_shards", index_shards)

    async def body() -> None:
        streamer.opened(5, version(store, index))
        while {SHARD_1, SHARD_2} - {key for key, _, _ in store.gets}:
            await trio.sleep(0.01)
        while streamer._active:
            await trio.sleep(0.01)
        assert stale not in {key for key, _, _ in store.gets}

    await run_prefetcher(engine, streamer, body)
    assert len(parses) == 1 and parses[0][0] and parses[0][1] >= parses[0][2], parses


async def test_an_index_whose_parse_would_take_half_the_chunk_memory_is_not_read(  # noqa: ANN001
        autojump_clock, tmp_path, monkeypatch, caplog) -> None:
    """json.loads of an index of `{}`s takes ~26x its size: a 12 MB one peaked at 300 MiB beside 64 MiB of chunk
    memory. One that would take more than half of it is not fetched: every shard of its stem is warmed."""
    import fsmount.streaming

    store, engine, streamer, _ = shards_rig(tmp_path, monkeypatch, sibling_ino=3)
    index = "llm/model.safetensors.index.json"
    store.put(index, b'{"weight_map": {"a": "%s"}, "x": [' % SHARD_1.rpartition("/")[2].encode()
              + b"{}," * 2_000_000 + b"{}]}")  # 6 MB: ~150 MiB to parse, above half of 256 MiB
    monkeypatch.setattr(fsmount.streaming, "index_shards", lambda data: pytest.fail("the index was parsed"))
    caplog.set_level(logging.INFO, logger="fsmount.streaming")

    async def siblings(ino: int) -> list:  # noqa: ARG001
        return [(None, version(store, key)) for key in (index, SHARD_1, SHARD_2)]

    streamer.siblings = siblings

    async def body() -> None:
        streamer.opened(5, version(store, index))
        while {SHARD_1, SHARD_2} - {key for key, _, _ in store.gets}:  # not named by the index: warmed all the same
            await trio.sleep(0.01)
        while streamer._active:
            await trio.sleep(0.01)
        assert index not in {key for key, _, _ in store.gets}

    await run_prefetcher(engine, streamer, body)
    assert any("more than half of this mount's chunk memory" in r.getMessage() for r in caplog.records)


async def test_a_model_replaced_in_the_bucket_is_warmed_again(autojump_clock, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Warmed models were remembered by name: a model retrained and uploaded under the same names was never
    warmed again on that mount."""
    store, engine, streamer, _ = shards_rig(tmp_path, monkeypatch, sibling_ino=3)

    async def warmed(one) -> None:  # noqa: ANN001
        streamer.opened(2, one)
        while not shard_2_gets(store):
            await trio.sleep(0.01)
        while (SHARD_2, version(store, SHARD_2).etag) in streamer._active:
            await trio.sleep(0.01)
        streamer.closed(one)

    async def body() -> None:
        await warmed(version(store, SHARD_1))
        first = len(shard_2_gets(store))
        streamer.opened(2, version(store, SHARD_1))  # the same version again: nothing more is warmed
        await trio.sleep(1)
        streamer.closed(version(store, SHARD_1))
        assert len(shard_2_gets(store)) == first
        store.put(SHARD_1, model_bytes(tmp_path, 6 * MiB, seed=4))
        store.put(SHARD_2, model_bytes(tmp_path, 12 * MiB, seed=5))
        store.gets.clear()
        await warmed(version(store, SHARD_1))
        assert len(shard_2_gets(store)) == first

    await run_prefetcher(engine, streamer, body)


async def test_a_file_opened_again_is_not_fetched_again_for_its_header(autojump_clock, tmp_path,  # noqa: ANN001
                                                                       monkeypatch) -> None:
    """Chunks pushed to the page cache are the first evicted from memory, chunk 0 with its header included: every
    open fetched that chunk again to parse the header (50 processes opening shards in a loop: 16 GiB from the
    origin for 2 GiB of models the page cache held)."""
    recorded_stores(monkeypatch)
    store, engine, streamer = prefetch_rig("m.safetensors", model_bytes(tmp_path, 24 * MiB), memory=6 * MiB,
                                           push_limit=1 << 40)

    async def body() -> None:
        v = version(store, "m.safetensors")
        await stream_once(streamer, v)
        # Evicted: pushed chunks go first.
        assert engine.memory.get(engine.chunk_id(v, 0), engine.chunk_length(v, 0)) is None
        gets = len(store.gets)
        for _ in range(3):
            await stream_once(streamer, v)
        assert len(store.gets) == gets, store.gets[gets:]

    await run_prefetcher(engine, streamer, body)


async def test_pushes_waiting_for_a_turn_keep_to_a_limit_lowered_meanwhile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The push limit was checked when a push came, not when its turn did: the pushes queued behind one turn all went
    through after memory pressure had halved the limit, and beyond the limit reached by those that went first (the
    audit)."""
    import fsmount.pagecache

    release = threading.Event()
    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", lambda ino, off, data: release.wait(10))
    pusher = PageCachePusher(16, pushes_at_once=1, free_memory=lambda: 0)
    done: list[bool] = []

    async def push(offset: int) -> None:
        done.append(await pusher.push(2, offset, 4, lambda: b"data"))

    async with trio.open_nursery() as n:
        for offset in (0, 4, 8):
            n.start_soon(push, offset)
            await trio.sleep(0.02)  # the first in notify_store, the others waiting for the turn, in order
        assert pusher.evicted() and pusher.limit == 8  # memory is short: the limit halves
        release.set()
    assert done == [True, True, False] and pusher.pushed == 8


def _mount_tmpfs(path: bytes, unmount: bool = False) -> None:
    """A tmpfs mounted at `path`, or the topmost mount there unmounted."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if (libc.umount2(path, 0) if unmount else libc.mount(b"tmpfs", path, b"tmpfs", 0, None)) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def _mounts_at(path: bytes) -> int:
    """How many mounts /proc/self/mountinfo has at `path` (written there with a space, tab, newline and backslash
    as octal escapes)."""
    with open("/proc/self/mountinfo", "rb") as f:
        return sum(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), line.split()[4]) == path for line in f)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
@pytest.mark.parametrize("name", [b"m \\x", b"m \xff"])
def test_an_aborted_mount_is_detached_at_a_path_that_is_not_utf8_and_not_from_under_another_mount(
        name, tmp_path, caplog, allowed_logs) -> None:  # noqa: ANN001
    """The stop detaches the mount whose connection it aborted (B116), found in /proc/self/mountinfo by its device
    and mount point. That file was read as text: a mount point that is not UTF-8 (here the mount's own; any other
    mount's line before it did the same) raised a UnicodeDecodeError out of the stop, past its drains (B121). And
    umount2 takes the topmost mount at a path: a mount made over this one was the one detached."""
    from fsmount.mount import detach_aborted

    path = os.fsencode(tmp_path) + b"/" + name
    os.mkdir(path)
    _mount_tmpfs(path)
    try:
        dev = os.stat(path).st_dev
        _mount_tmpfs(path)  # another mount over it: left alone
        allowed_logs.append("another mount was made over it")
        detach_aborted(os.fsdecode(path), dev)
        assert _mounts_at(path) == 2 and os.stat(path).st_dev != dev
        assert "another mount was made over it" in caplog.text
        _mount_tmpfs(path, unmount=True)
        detach_aborted(os.fsdecode(path), dev)  # on top again: detached
        assert _mounts_at(path) == 0
    finally:
        while _mounts_at(path):
            _mount_tmpfs(path, unmount=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs")
def test_an_aborted_mount_told_by_its_id_is_detached_and_no_other_mount_of_its_device_and_path(tmp_path) -> None:  # noqa: ANN001
    """The daemon detaches its mount when someone else aborted its connection (B139), told by the device and mount
    id it took while the mount answered: a mount of that device at that path with another id (made there since) is
    left alone."""
    from fsmount.mount import detach_aborted, mount_id

    path = os.fsencode(tmp_path) + b"/m"
    os.mkdir(path)
    _mount_tmpfs(path)
    try:
        dev = os.stat(path).st_dev
        mnt_id = mount_id(os.fsdecode(path), dev)
        assert mnt_id is not None and mount_id(os.fsdecode(path), dev + 1) is None
        assert not detach_aborted(os.fsdecode(path), dev, only=mnt_id + b"0")
        assert _mounts_at(path) == 1
        assert detach_aborted(os.fsdecode(path), dev, only=mnt_id)
        assert _mounts_at(path) == 0
    finally:
        while _mounts_at(path):
            _mount_tmpfs(path, unmount=True)


async def test_a_rewrite_s_page_drop_waiting_on_a_page_lock_does_not_hold_a_cancelled_handler(monkeypatch) -> None:  # noqa: ANN001
    """Once a rewrite of a stored file is stored, its close drops the inode's pages from a worker thread
    (`Operations._commit`), which waits for the lock of a page a READ in flight holds. A stop that cut that READ short
    (no reply: the page stays locked until the connection ends) cancels the close's handler too, but the thread was
    not abandoned: the handler, pyfuse3's loop and the daemon waited for it for good, before the end of the session
    that aborts the connection for a call still under way (B124) could run (B141). The handler now ends at its
    cancellation; the call stays counted in `SessionCalls`, which that end waits for and aborts past."""
    import types

    import fsmount.operations
    from fsmount.operations import Operations, SessionCalls

    unlocked = threading.Event()  # the connection aborted: the page unlocks

    def invalidate_inode(ino: int, attr_only: bool) -> None:
        unlocked.wait(5)

    monkeypatch.setattr(fsmount.operations.pyfuse3, "invalidate_inode", invalidate_inode)

    async def commit() -> None:
        pass

    node = types.SimpleNamespace(pages_stale=True, writing=False, etag="e1", ino=5, path="f")
    new = types.SimpleNamespace(commit=commit, node=node, stored=object(), unlinked=False)
    calls = SessionCalls()
    ops = types.SimpleNamespace(session_calls=calls)
    start = time.monotonic()
    with trio.move_on_after(0.3) as stop:  # the stop's cancellation of the handlers
        await Operations._commit(ops, new)  # type: ignore[arg-type]
    try:
        assert stop.cancelled_caught and time.monotonic() - start < 1.5  # the old code: the fake kernel's 5 s
        assert not calls.end(0.1)  # still under way: the end of the session waits for it, then aborts
    finally:
        unlocked.set()
    assert calls.end(2)


async def test_the_models_warmed_are_remembered_for_the_last_ones_opened(autojump_clock, tmp_path,  # noqa: ANN001
                                                                          monkeypatch) -> None:
    """A mount that lives through many checkpoints (a model in each step's directory) kept every model it had warmed
    for its whole life: `_warmed_models` grew by one entry each, with its files' versions."""
    monkeypatch.setattr(fsmount.streaming, "WARMED_MODELS_KEPT", 3)
    store = FakeStore()
    for step in range(10):
        store.put(f"step-{step}/model.safetensors.index.json", b'{"weight_map": {}}')
    engine = make_engine(store, conns=2, memory=64 * MiB)

    async def siblings(ino: int) -> list:  # noqa: ARG001
        return []

    streamer = ModelStreamer(engine, PageCachePusher(1 << 40), max_connections=2, siblings=siblings)

    async def body() -> None:
        for step in range(10):
            index = version(store, f"step-{step}/model.safetensors.index.json")
            streamer.opened(2 + step, index)
            await trio.sleep(0.1)
            streamer.closed(index)
        assert list(streamer._warmed_models) == ["step-7/model", "step-8/model", "step-9/model"]

    await run_prefetcher(engine, streamer, body)


async def test_a_warming_that_ends_late_keeps_the_models_order(autojump_clock, tmp_path,  # noqa: ANN001
                                                               monkeypatch) -> None:
    """The warming of a model that ended after later models were opened (its index read slowly) put its model back
    in `_warmed_models` as the newest, or brought it back after it was forgotten, so the models opened last
    were forgotten first (the test above failed one run in five on a loaded host)."""
    monkeypatch.setattr(fsmount.streaming, "WARMED_MODELS_KEPT", 2)
    store = FakeStore()
    for step in range(3):
        store.put(f"step-{step}/model.safetensors.index.json", b'{"weight_map": {}}')
    engine = make_engine(store, conns=2, memory=64 * MiB)
    read = trio.Event()

    async def siblings(ino: int) -> list:  # noqa: ARG001
        return []

    async def shards_named(index) -> set[str]:  # noqa: ANN001 - step-0's index is read once the others were opened
        if index.key.startswith("step-0/"):
            await read.wait()
        return set()

    streamer = ModelStreamer(engine, PageCachePusher(1 << 40), max_connections=2, siblings=siblings)
    monkeypatch.setattr(streamer, "_shards_named", shards_named)

    async def body() -> None:
        for step in range(3):
            streamer.opened(2 + step, version(store, f"step-{step}/model.safetensors.index.json"))
            await trio.sleep(0.1)
        read.set()
        await trio.sleep(1)
        assert list(streamer._warmed_models) == ["step-1/model", "step-2/model"]

    await run_prefetcher(engine, streamer, body)
