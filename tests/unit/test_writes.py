"""The write side in-process: part sizes, a file being written (NewFile) against a scripted uploader, the
namespace's record of changes, and the flags' rules. Real mounts are in tests/mount/test_writes.py."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from fsmount import namespace
from fsmount import writes as writes_module
from fsmount.cli import build_config, expand_mount_options, make_parser
from fsmount.config import ConfigError, MountConfig, StoreConfig
from fsmount.data import (
    MAX_PART_SIZE,
    MAX_PARTS,
    AccessDenied,
    ChunkId,
    MemoryBudget,
    NotFound,
    ObjectMeta,
    ObjectVersion,
    StoreError,
    TimedOut,
    TransientError,
    Unreachable,
)
from fsmount.data.uploads import Exists
from fsmount.namespace import ROOT_INODE, DirEntry, PathError
from fsmount.new_file import PART_GROWTH_EVERY, NewFile, part_size
from fsmount.tree_changes import WritableNamespace as Namespace
from fsmount.writes import RENAME_NOREPLACE, Writes
from tests.helpers import ORIGIN_UNAVAILABLE
from tests.unit.fake_store import FakeStore

MiB = 1 << 20
TiB = 1 << 40
ORIGIN = StoreConfig(bucket="b")  # what the advised `modelfs cleanup` names


def test_part_sizes_grow_so_that_a_tebibyte_fits_in_10000_parts() -> None:
    for base in (5 * MiB, 8 * MiB):
        sizes = [part_size(base, n) for n in range(1, MAX_PARTS + 1)]
        assert sizes[0] == base and sizes[PART_GROWTH_EVERY - 1] == base and sizes[PART_GROWTH_EVERY] == 2 * base
        assert all(a <= b for a, b in zip(sizes, sizes[1:], strict=False))
        assert sum(sizes) >= TiB
    assert max(part_size(8 * MiB, n) for n in range(1, MAX_PARTS + 1)) == 50 * 8 * MiB


class FakeUploads:
    """The write requests of `data.Uploads` on a FakeStore (which the namespace lists and HEADs), with a gate
    to hold parts and a fault to fail them."""

    def __init__(self, store: FakeStore) -> None:
        self.store = store
        self.bucket = store.bucket
        self.objects = store.objects
        self.parts: dict[str, dict[int, bytes]] = {}
        self.aborted: list[str] = []
        self.puts = 0
        self.gate = threading.Event()
        self.gate.set()
        self.fail_parts = False
        self.fail_finish = False
        self.refused = 0  # the next this many requests find the endpoint refusing connections (a restart)
        self.bodies: list[bytearray] = []  # every part body sent, kept (so that distinct ones have distinct ids)
        self._next = 0

    def head(self, key: str) -> ObjectMeta | None:
        """As the namespace's store answers (one bucket): the version a create finds is the one a lookup finds."""
        return self.store.meta(key) if key in self.objects else None

    def has_children(self, prefix: str) -> bool:
        return self.store.has_children(prefix)

    def put(self, key: str, body: bytes, only_if_absent: bool = False, or_plain: bool = False,
            if_version: str | None = None) -> str:
        self._check_absent(key, only_if_absent)
        self.puts += 1
        return self._store(key, bytes(body), f'"put-{len(body)}"')

    def _check_absent(self, key: str, only_if_absent: bool) -> None:
        if only_if_absent and key in self.objects:
            raise Exists(f"{key}: the key was created meanwhile by another writer")

    def _store(self, key: str, data: bytes, etag: str) -> str:
        self.store.put(key, data)
        self.store.etags[key] = etag
        return etag

    def _refuse(self) -> None:
        if self.refused > 0:
            self.refused -= 1
            raise Unreachable("cannot reach the endpoint: connection refused")

    def start(self, key: str) -> str:
        self._refuse()
        self._next += 1
        upload_id = f"u{self._next}"
        self.parts[upload_id] = {}
        return upload_id

    def put_part(self, key: str, upload_id: str, number: int, body: bytearray) -> str:
        self.gate.wait(10)
        self._refuse()
        if self.fail_parts:
            raise TransientError("part refused")
        if upload_id not in self.parts:
            raise NotFound(f"uploading part {number} of {key!r}: not found")  # NoSuchUpload: aborted
        self.parts[upload_id][number] = bytes(body)
        self.bodies.append(body)
        return f'"p{number}"'

    def finish(self, key: str, upload_id: str, etags: list[str], only_if_absent: bool = False,
               or_plain: bool = False, if_version: str | None = None) -> str:
        self._refuse()
        if self.fail_finish:
            raise TransientError("complete refused")
        self._check_absent(key, only_if_absent)
        parts = self.parts.pop(upload_id)
        assert etags == [f'"p{n}"' for n in sorted(parts)]
        return self._store(key, b"".join(parts[n] for n in sorted(parts)), f'"mp-{len(parts)}"')

    def abort(self, key: str, upload_id: str) -> None:
        self.aborted.append(key)
        self.parts.pop(upload_id, None)

    def copy(self, source: str, etag: str, key: str) -> str:
        return self._store(key, self.objects[source], '"copy"')

    def copy_part(self, key: str, upload_id: str, number: int, source: str, etag: str, start: int, end: int) -> str:
        self.parts[upload_id][number] = self.objects[source][start:end]
        return f'"p{number}"'

    def delete(self, key: str) -> None:
        self.objects.pop(key, None)

    def delete_version(self, key: str, etag: str) -> bool:
        if key in self.objects and self.store.etags.get(key) != etag:
            return False  # another object under the key now (If-Match)
        self.objects.pop(key, None)
        return True


async def call(fn: Any, *args: Any) -> Any:
    return fn(*args)


def make(memory: int = 64 * MiB, part: int = 5 * MiB, timeout: float = 30.0,
         **flags: bool) -> tuple[Writes, FakeUploads, Namespace]:
    store = FakeStore()
    ns = Namespace(store, call, prefix="", ttl=60.0)
    uploads = FakeUploads(store)
    writes = Writes(ns, uploads, MemoryBudget(memory), part_size=part, max_connections=2, timeout=timeout,  # type: ignore[arg-type]
                    allow_overwrite=flags.get("allow_overwrite", False), allow_delete=flags.get("allow_delete", False),
                    origin=ORIGIN)
    return writes, uploads, ns


@contextlib.asynccontextmanager
async def serving(writes: Writes) -> AsyncIterator[trio.Nursery]:
    """The writes' nursery of part uploads, open for the block (which may start tasks in it too)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(writes.run)
        yield nursery
        nursery.cancel_scope.cancel()


async def parts_ended(writes: Writes) -> None:
    """Wait (5 s at most) until parts in flight when their upload was aborted have ended: each gives back its
    buffer's reservation then, not at the abort."""
    with trio.move_on_after(5):
        while writes.memory.used:
            await trio.sleep(0.01)


async def new_file(writes: Writes, ns: Namespace, name: bytes) -> NewFile:
    new = await writes.create(ns.node(ROOT_INODE), name)
    assert new is not None
    return new


async def test_small_file_is_one_put_and_enters_the_tree() -> None:
    writes, uploads, ns = make()
    async with serving(writes):
        new = await new_file(writes, ns, b"a.json")
        assert await new.write(0, b"{}") == 2
        assert (await ns.lookup(ROOT_INODE, b"a.json")).writing
        meta = await new.commit()
        assert uploads.objects == {"a.json": b"{}"} and uploads.puts == 1 and uploads.parts == {}
        assert meta.etag == '"put-2"' and await new.commit() is meta  # idempotent (close after fsync)
        node = await ns.lookup(ROOT_INODE, b"a.json")
        assert not node.writing and node.size == 2 and node.etag == '"put-2"'
        assert writes.memory.used == 0


async def test_parts_stream_in_order_and_memory_is_bounded_with_backpressure() -> None:
    writes, uploads, ns = make(memory=20 * MiB, part=5 * MiB)  # room for 2 parts (half the budget each at most)
    data = bytes(range(256)) * (4 * 23 * MiB // 1024)  # 23 MiB: 4 full parts and a short one
    async with serving(writes) as nursery:
        new = await new_file(writes, ns, b"big.bin")
        uploads.gate.clear()  # parts hold on: the writer must wait for room
        written = 0

        async def writer() -> None:
            nonlocal written
            for i in range(0, len(data), MiB):
                written += await new.write(i, data[i:i + MiB])

        nursery.start_soon(writer)
        await trio.sleep(0.2)
        assert written < len(data)
        assert writes.memory.used <= writes.memory.limit
        uploads.gate.set()
        while written < len(data):
            await trio.sleep(0.01)
        meta = await new.commit()
        assert uploads.objects["big.bin"] == data and meta.size == len(data) and meta.etag == '"mp-5"'
        assert writes.memory.used == 0 and writes.stats.parts_uploaded == 5


async def test_extending_ftruncate_of_an_empty_file_stores_zeros_for_what_was_never_written(
        allowed_logs: list[str]) -> None:
    allowed_logs.append("truncate to 5 after 4 bytes")
    writes, uploads, ns = make()
    async with serving(writes):
        new = await new_file(writes, ns, b"st")
        new.truncate(12 * MiB)
        await new.write(0, b"head")
        with pytest.raises(PathError) as info:
            new.truncate(5)
        assert info.value.errno == errno.EOPNOTSUPP
        await new.commit()
        assert uploads.objects["st"] == b"head" + bytes(12 * MiB - 4)


async def test_a_write_off_the_end_spoils_the_file_and_commit_aborts(caplog: pytest.LogCaptureFixture,
                                                                    allowed_logs: list[str]) -> None:
    allowed_logs.append("only sequential writes")
    writes, uploads, ns = make()
    async with serving(writes):
        new = await new_file(writes, ns, b"x")
        await new.write(0, bytes(6 * MiB))  # a part is sent: the upload began
        with pytest.raises(PathError) as info:
            await new.write(10, b"back")
        assert info.value.errno == errno.EINVAL
        with pytest.raises(PathError) as info:
            await new.write(6 * MiB, b"more")
        assert info.value.errno == errno.EIO
        with pytest.raises(PathError) as info:
            await new.commit()
        assert info.value.errno == errno.EIO
        assert uploads.objects == {} and uploads.aborted == ["x"] and uploads.parts == {}
        with pytest.raises(PathError):
            await ns.lookup(ROOT_INODE, b"x")
        await parts_ended(writes)
        assert writes.memory.used == 0 and writes.stats.files_failed == 1


@pytest.mark.parametrize("fault", ["parts", "finish"])
async def test_a_failed_upload_is_eio_at_close_and_aborted(fault: str, allowed_logs: list[str]) -> None:
    allowed_logs.append("will not be stored")
    writes, uploads, ns = make()
    setattr(uploads, f"fail_{fault}", True)
    async with serving(writes):
        new = await new_file(writes, ns, b"x")
        try:
            await new.write(0, bytes(11 * MiB))
        except PathError:
            pass  # a part failed before the last write: the write says so already
        with pytest.raises(PathError) as info:
            await new.commit()
        assert info.value.errno == errno.EIO
        assert uploads.objects == {} and uploads.aborted == ["x"]


async def test_uploads_left_unaborted_are_named_with_the_cleanup_command_of_exactly_their_keys(
        allowed_logs: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """The warnings advised `modelfs cleanup BUCKET --prefix KEY` (which finds nothing: the prefix becomes 'KEY/') or,
    at unmount, a bucket-wide `--older-than 0` (which aborts other mounts' live uploads), and neither named the
    mount's endpoint: each names exactly its keys now, with the options that reach the bucket."""
    allowed_logs.extend(["could not be aborted", "will not be stored"])
    writes, uploads, ns = make()
    writes._origin = StoreConfig(bucket="b", endpoint_url="http://10.0.0.9:9000", region="eu-west-1",
                                 profile="ckpt writer")

    class Left:
        def __init__(self, key: str) -> None:
            self.upload_key = key

    def refused(key: str, upload_id: str) -> None:
        raise AccessDenied(f"aborting {key!r}: access denied")

    uploads.abort = refused  # type: ignore[method-assign]
    options = "--endpoint-url http://10.0.0.9:9000 --region eu-west-1 --profile 'ckpt writer'"
    async with serving(writes):
        new = await new_file(writes, ns, b"a b.bin")
        await new.write(0, bytes(6 * MiB))  # a part sent: a multipart upload
        await new.abort()
        # A file whose abort never began when the unmount's time for them ran out.
        writes._open = {Left("d.bin"), Left("c.bin")}  # type: ignore[arg-type]
        await writes.abort_all()
    said = [r.getMessage() for r in caplog.records if "could not be aborted" in r.getMessage()]
    assert said == [f"the upload of a b.bin could not be aborted (aborting 'a b.bin': access denied); "
                    f"`modelfs cleanup b {options} --key 'a b.bin' --older-than 0` removes it",
                    f"2 uploads could not be aborted at unmount; `modelfs cleanup b {options} --key c.bin --key d.bin "
                    f"--older-than 0` removes them"], said


async def test_after_the_mount_s_failure_uploads_are_aborted_without_the_threads_its_parts_left(
        allowed_logs: list[str]) -> None:
    """A task of the mount failed: the writes' tasks are cancelled with its nursery, and the requests of the parts
    in flight go on in their abandoned threads, each holding a slot of the writes' limiter (both here, stalled), so
    an abort through `call` waits for one. The failure's abort goes straight through the store: done at once, and
    the parts that land later fail (B147)."""
    allowed_logs.append("was still being written when the mount failed")
    writes, uploads, ns = make()
    uploads.gate.clear()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(writes.run)
            new = await new_file(writes, ns, b"x")
            await new.write(0, bytes(11 * MiB))  # parts 1 and 2 sent, stalled in their threads
            with trio.fail_after(5):
                while writes._limiter.borrowed_tokens < 2:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        with trio.move_on_after(0.5) as waited:
            await writes.call(uploads.abort, "y", "u0")
        assert waited.cancelled_caught, "the limiter had a slot: the test proves nothing"
        start = trio.current_time()
        await writes.abort_after_failure()
        assert trio.current_time() - start < 2  # the parts' threads stall for 10 s
        assert uploads.aborted == ["x"] and uploads.parts == {} and not writes._open
        assert new.take_upload() is None  # its parts see the upload gone
    finally:
        uploads.gate.set()


@pytest.mark.parametrize("end", ["failed", "stopped"])
async def test_a_file_whose_close_was_storing_it_as_the_mount_ended_is_not_said_to_be_unstored(
        end: str, allowed_logs: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """The close of a file is completing its upload as the mount ends: a task of the mount fails (no grace: the close
    is cut short at once), or a stop's grace runs out. The completion goes on in its abandoned thread and lands, the
    file stored; the end's abort then finds no upload. The end's warning said "it is not stored (...; its upload is
    aborted)" for a file the bucket held whole (B154)."""
    allowed_logs.append(f"when the mount {end}")
    writes, uploads, ns = make()
    sent, land = threading.Event(), threading.Event()
    finish = uploads.finish

    def held_finish(*args: Any) -> str:
        sent.set()
        land.wait(10)
        return finish(*args)

    uploads.finish = held_finish  # type: ignore[method-assign]
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(writes.run)
            new = await new_file(writes, ns, b"x")
            await new.write(0, bytes(11 * MiB))  # parts 1 and 2: a multipart upload
            nursery.start_soon(new.commit)  # the close
            with trio.fail_after(5):
                while not sent.is_set():
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()  # the close cut short, its completion left in its thread
        land.set()
        with trio.fail_after(5):
            while "x" not in uploads.objects:
                await trio.sleep(0.01)
        await (writes.abort_after_failure() if end == "failed" else writes.abort_all())
    finally:
        land.set()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("x ")]
    assert said == [f"x was being stored when the mount {end} (its close was cut short): the bucket may or may not "
                    f"hold it ({11 * MiB} bytes written)"], said
    assert uploads.objects["x"] == bytes(11 * MiB)


async def test_an_endpoint_that_refuses_connections_for_a_while_costs_a_write_only_time(
        allowed_logs: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """A server restarting refuses connections: the requests of a file being written (its start, parts and
    completion) are tried again with backoff within --read-timeout, as reads are. A 20 s restart lost the
    checkpoint at once. Past the timeout the file fails, EIO at close."""
    data = bytes(range(256)) * (11 * MiB // 256)
    writes, uploads, ns = make()
    async with serving(writes):
        new = await new_file(writes, ns, b"ckpt.bin")
        uploads.refused = 3  # the start and two tries of the first part: 0.25 + 0.5 + 1 s of backoff
        for i in range(0, len(data), MiB):
            await new.write(i, data[i:i + MiB])
        await new.commit()
        assert uploads.objects["ckpt.bin"] == data and uploads.refused == 0

    allowed_logs.append("will not be stored")
    writes, uploads, ns = make(timeout=1.0)
    async with serving(writes):
        new = await new_file(writes, ns, b"lost.bin")
        uploads.refused = 1000
        start = trio.current_time()
        with pytest.raises(PathError) as info:
            for i in range(0, len(data), MiB):
                await new.write(i, data[i:i + MiB])
            await new.commit()
        assert info.value.errno == errno.EIO and trio.current_time() - start < 3.0
        assert "lost.bin" not in uploads.objects
    # Said as it was: refused, never sent (a "timed out" tells the writer the bucket may hold it).
    failed = [r.getMessage() for r in caplog.records if "will not be stored" in r.getMessage()]
    assert failed and all("cannot reach the endpoint" in m and "timed out" not in m for m in failed), failed


@pytest.mark.parametrize("size", [1000, 11 * MiB], ids=["one-put", "multipart"])
@pytest.mark.parametrize("allow_overwrite", [False, True])
async def test_a_key_another_writer_stored_meanwhile_is_replaced_only_with_allow_overwrite(
        size: int, allow_overwrite: bool, allowed_logs: list[str]) -> None:
    """The HEAD at create found nothing; another mount stores the key while this one writes it. Without
    --allow-overwrite the final PUT or completion is create-only: close is EIO, the other writer's bytes
    stay, the upload is aborted. With it, the last close wins."""
    allowed_logs.append("will not be stored")
    writes, uploads, ns = make(allow_overwrite=allow_overwrite)
    async with serving(writes):
        new = await new_file(writes, ns, b"ckpt")
        await new.write(0, bytes(size))
        uploads.store.put("ckpt", b"theirs")  # the other mount's close
        if allow_overwrite:
            await new.commit()
            assert uploads.objects["ckpt"] == bytes(size)
        else:
            with pytest.raises(PathError) as info:
                await new.commit()
            assert info.value.errno == errno.EIO
            assert uploads.objects["ckpt"] == b"theirs"
            assert uploads.aborted == ([] if size < 5 * MiB else ["ckpt"]) and uploads.parts == {}


@pytest.mark.parametrize("allow_overwrite", [False, True])
async def test_rename_while_written_stores_under_the_final_name(allow_overwrite: bool) -> None:
    writes, uploads, ns = make(allow_overwrite=allow_overwrite)
    async with serving(writes):
        root = ns.node(ROOT_INODE)
        small = await new_file(writes, ns, b".tmp1")  # no part sent yet: stored under the new name at once
        await small.write(0, b"x")
        await writes.rename(small.node, root, b"small", None, 0)
        await small.commit()
        big = await new_file(writes, ns, b".tmp2")  # its upload began under .tmp2: moved by a copy at close
        await big.write(0, bytes(7 * MiB))
        await writes.rename(big.node, root, b"big", None, 0)
        assert {e.name for e in await ns.listing(root)} == {b"small", b"big"}
        await big.commit()
        assert set(uploads.objects) == {"small", "big"} and len(uploads.objects["big"]) == 7 * MiB
        # Without --allow-overwrite the copy is a multipart upload of one UploadPartCopy part, completed
        # create-only; with it, one CopyObject.
        assert (await ns.lookup(ROOT_INODE, b"big")).etag == ('"copy"' if allow_overwrite else '"mp-1"')
        assert uploads.parts == {}


@pytest.mark.parametrize("allow_overwrite", [False, True])
async def test_a_file_renamed_while_written_replaces_a_key_stored_meanwhile_only_with_allow_overwrite(
        allow_overwrite: bool, allowed_logs: list[str]) -> None:
    """safetensors' pattern (write a temp file, rename it, close) racing another mount that stores the final
    name first. Without --allow-overwrite the move's completion is create-only: close is EIO, the other
    writer's bytes stay, and neither the temp object nor an upload is left behind."""
    allowed_logs.append("will not be stored")
    writes, uploads, ns = make(allow_overwrite=allow_overwrite)
    async with serving(writes):
        root = ns.node(ROOT_INODE)
        new = await new_file(writes, ns, b".tmp3")
        await new.write(0, bytes(7 * MiB))
        await writes.rename(new.node, root, b"model", None, 0)
        uploads.store.put("model", b"theirs")  # the other mount's close
        if allow_overwrite:
            await new.commit()
            assert uploads.objects["model"] == bytes(7 * MiB)
        else:
            with pytest.raises(PathError) as info:
                await new.commit()
            assert info.value.errno == errno.EIO
            assert uploads.objects["model"] == b"theirs"
        assert set(uploads.objects) == {"model"} and uploads.parts == {}


@pytest.mark.parametrize("allow_overwrite", [False, True])
async def test_a_move_leaves_a_file_another_mount_stored_under_the_old_name_meanwhile(
        allow_overwrite: bool, allowed_logs: list[str]) -> None:
    """A rename is a copy, then a delete of the old key. Another mount storing a file under the old name between
    the two (a log rotated while written, a new log stored at once) lost it to that delete, which was
    unconditional; it is If-Match on the version copied now, and the other file stays (one warning)."""
    allowed_logs.append("another writer has stored a new log since: it is left as it is")
    writes, uploads, ns = make(allow_overwrite=allow_overwrite)
    uploads.store.put("log", b"first")
    copy_part, copy = uploads.copy_part, uploads.copy

    def then_theirs(*args: Any) -> str:
        etag = (copy_part if len(args) > 3 else copy)(*args)
        uploads.store.put("log", b"theirs")  # the other mount's close, just after the copy
        return etag

    uploads.copy_part = uploads.copy = then_theirs  # type: ignore[method-assign]
    async with serving(writes):
        node = await ns.lookup(ROOT_INODE, b"log")
        meta = await writes.move_object(ObjectMeta("log", 5, node.etag, 0), "log.1")
    assert meta.key == "log.1" and uploads.objects == {"log": b"theirs", "log.1": b"first"}


@pytest.mark.parametrize("connections", [1, 2])
async def test_a_copy_above_copy_object_max_is_cut_into_parts_s3_takes(connections: int) -> None:
    """A 12 GiB move (CopyObject takes at most 5 GiB): UploadPartCopy parts of at most MAX_PART_SIZE that
    cover the object exactly, even with one connection."""
    writes, uploads, ns = make(allow_overwrite=True)
    writes._max_connections = connections
    size = 12 * (1 << 30)
    uploads.objects["big"] = b""  # only the ranges are recorded; nothing is copied
    uploads.store.etags["big"] = '"e"'
    ranges: list[tuple[int, int]] = []

    def copy_part(key: str, upload_id: str, number: int, source: str, etag: str, start: int, end: int) -> str:
        ranges.append((start, end))
        uploads.parts[upload_id][number] = b""
        return f'"p{number}"'

    uploads.copy_part = copy_part  # type: ignore[method-assign]
    async with serving(writes):
        meta = await writes.move_object(ObjectMeta("big", size, '"e"', 0), "moved")
    ranges.sort()
    assert meta.key == "moved" and ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert max(end - start for start, end in ranges) <= MAX_PART_SIZE and "big" not in uploads.objects


async def test_overwrite_and_delete_need_their_flags(allowed_logs: list[str]) -> None:
    allowed_logs.append("needs --allow")
    writes, uploads, ns = make()
    uploads.store.put("old", b"1")
    root = ns.node(ROOT_INODE)
    # A create that finds the key (stored since this mount found the name free) is an open of it (refused below), and
    # an exclusive one EEXIST.
    assert await writes.create(root, b"old") is None
    with pytest.raises(PathError) as info:
        await writes.create(root, b"old", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    assert info.value.errno == errno.EEXIST
    node = await ns.lookup(ROOT_INODE, b"old")
    for attempt in (lambda: writes.unlink(node), lambda: writes.rename(node, root, b"new", None, 0)):
        with pytest.raises(PathError) as info:
            await attempt()
        assert info.value.errno == errno.EPERM
    assert writes.stats.deletes_refused == 2  # counted: a trainer's rotation swallows the EPERM
    with pytest.raises(PathError) as info:
        await writes.open_existing(node, 0o1)
    assert info.value.errno == errno.EPERM


async def test_a_directory_renamed_onto_an_empty_one_replaces_it(allowed_logs: list[str]) -> None:
    """rename(2) replaces an empty directory (EISDIR before), needs --allow-overwrite as a rename onto a file does, and
    is ENOTEMPTY onto one with anything in it."""
    allowed_logs.append("needs --allow-overwrite")
    for overwrite in (False, True):
        writes, uploads, ns = make(allow_overwrite=overwrite)
        async with serving(writes):
            root = ns.node(ROOT_INODE)
            a, b, full = [await writes.mkdir(root, name) for name in (b"a", b"b", b"full")]
            uploads.store.put("full/x", b"x")
            with pytest.raises(PathError) as info:
                await writes.rename(a, root, b"full", full, 0)
            assert info.value.errno == (errno.ENOTEMPTY if overwrite else errno.EPERM)
            if not overwrite:
                with pytest.raises(PathError) as info:
                    await writes.rename(a, root, b"b", b, 0)
                assert info.value.errno == errno.EPERM
                continue
            await writes.rename(a, root, b"b", b, 0)
            assert set(uploads.objects) == {"b/", "full/", "full/x"}
            moved = await ns.lookup(ROOT_INODE, b"b")
            assert moved.ino == a.ino and moved.path == "b" and await ns.dir_is_empty(moved)
            with pytest.raises(PathError) as info:
                await ns.lookup(ROOT_INODE, b"a")
            assert info.value.errno == errno.ENOENT


async def test_names_another_writer_filled_after_this_mount_found_them_free() -> None:
    """What the bucket holds at a name this mount said was free decides, as on a local disk: a mkdir there is EEXIST,
    a RENAME_NOREPLACE onto it EEXIST (with --allow-overwrite, which would replace it otherwise), and with it a create
    that does not truncate opens what is there (None) instead of replacing it; one that truncates replaces it."""
    writes, uploads, ns = make(allow_overwrite=True, allow_delete=True)
    async with serving(writes):
        root = ns.node(ROOT_INODE)
        mine = await new_file(writes, ns, b"mine")
        await mine.commit()
        for name in (b"dir", b"file"):
            with pytest.raises(PathError):
                await ns.lookup(ROOT_INODE, name)
        uploads.store.put("dir/x", b"x")
        uploads.store.put("file", b"theirs")
        with pytest.raises(PathError) as info:
            await writes.mkdir(root, b"dir")
        assert info.value.errno == errno.EEXIST
        node = await ns.lookup(ROOT_INODE, b"mine")
        for name in (b"dir", b"file"):
            with pytest.raises(PathError) as info:
                await writes.rename(node, root, name, None, RENAME_NOREPLACE)
            assert info.value.errno == errno.EEXIST
        assert await writes.create(root, b"file", os.O_WRONLY | os.O_CREAT | os.O_APPEND) is None
        with pytest.raises(PathError) as info:
            await writes.create(root, b"file", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        assert info.value.errno == errno.EEXIST
        assert uploads.objects == {"mine": b"", "dir/x": b"x", "file": b"theirs"}
        uploads.store.put("file2", b"theirs")
        new = await writes.create(root, b"file2", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)  # no HEAD: replaces it
        assert new is not None
        await new.write(0, b"new")
        await new.commit()
        assert uploads.objects["file2"] == b"new"


async def test_a_stored_file_renamed_onto_a_name_looked_up_before_is_found_there() -> None:
    """torch.save to a temporary name, then os.replace: the rename looked the target up first (not there, so
    remembered as missing); the file must be found under its new name at once, not after the TTL."""
    writes, uploads, ns = make()
    async with serving(writes):
        root = ns.node(ROOT_INODE)
        new = await new_file(writes, ns, b"s.pt.tmp")
        await new.write(0, b"weights")
        await new.commit()
        with pytest.raises(PathError) as info:
            await ns.lookup(ROOT_INODE, b"s.pt")
        assert info.value.errno == errno.ENOENT
        await writes.rename(await ns.lookup(ROOT_INODE, b"s.pt.tmp"), root, b"s.pt", None, 0)
        node = await ns.lookup(ROOT_INODE, b"s.pt")
        assert node.size == 7 and uploads.objects == {"s.pt": b"weights"}
        with pytest.raises(PathError) as info:
            await ns.lookup(ROOT_INODE, b"s.pt.tmp")
        assert info.value.errno == errno.ENOENT


async def test_a_listing_under_way_gets_the_changes_made_meanwhile() -> None:
    store = FakeStore()
    store.put("a", b"1")
    ns = Namespace(store, call, prefix="", ttl=60.0)
    root = ns.node(ROOT_INODE)
    pages = store.list_pages

    def slow_pages(prefix: str):  # noqa: ANN202 - the change lands while this listing is under way
        ns._stored(ns.begin_file("b"), ObjectMeta("b", 1, '"b"', 0))
        ns.removed("a", is_dir=False)
        return pages(prefix)

    store.list_pages = slow_pages  # type: ignore[method-assign]
    assert {e.name for e in await ns.listing(root)} == {b"b"}
    store.list_pages = pages  # type: ignore[method-assign]
    # Once a listing that began after the change lands, the bucket's word is final again.
    store.put("b", b"1")
    del store.objects["a"]
    await ns._list("")
    assert ns._changes == {}


def test_flags_and_fstab_forms() -> None:
    argv = expand_mount_options(["mount", "b", "/m", "-o", "rw,writable,allow_delete,write_part_size=16M"])
    cfg = build_config(make_parser().parse_args(argv))
    assert cfg.writable and cfg.allow_delete and not cfg.allow_overwrite and cfg.write_part_size == 16 * MiB
    assert (cfg.file_mode, cfg.dir_mode) == (0o644, 0o755)
    ro = build_config(make_parser().parse_args(["mount", "b", "/m"]))
    assert not ro.writable and (ro.file_mode, ro.dir_mode) == (0o444, 0o555)
    store = StoreConfig(bucket="b")
    for bad in ({"allow_delete": True}, {"allow_overwrite": True}, {"writable": True, "write_part_size": MiB},
                {"writable": True, "write_part_size": 64 * MiB, "memory_limit": 160 * MiB}):
        with pytest.raises(ConfigError):
            MountConfig(store=store, mountpoint="/m", **bad)  # type: ignore[arg-type]


def test_store_errors_of_writes_are_store_errors() -> None:
    assert issubclass(TransientError, StoreError)


class FakeCache:
    """A ChunkCache that keeps what it is given."""

    def __init__(self) -> None:
        self.chunks: dict[ChunkId, bytes] = {}

    def get(self, chunk: ChunkId, buffer: Any = None) -> None:
        return None

    def put(self, chunk: ChunkId, data: bytes) -> None:
        self.chunks[chunk] = bytes(data)

    def staging_bytes(self, chunk_size: int) -> int:
        return 0


@pytest.mark.parametrize("declared", [True, False], ids=["ftruncate-first", "streamed"])
async def test_with_a_local_copy_a_file_extended_first_is_uploaded_once_under_its_final_name(
        tmp_path: Path, declared: bool) -> None:
    """save_file's pattern (create, ftruncate, write, rename, close) with --cache-dir: no server-side copy;
    either way the stored file's chunks reach the cache."""
    store = FakeStore()
    ns = Namespace(store, call, prefix="", ttl=60.0)
    uploads, cache = FakeUploads(store), FakeCache()
    copies: list[str] = []
    uploads.copy_part = lambda key, *args: copies.append(key) or FakeUploads.copy_part(uploads, key, *args)
    chunk = 4 * MiB

    def chunk_id(version: ObjectVersion, index: int) -> ChunkId:
        return ChunkId("bucket", version.key, version.etag, chunk, index)

    writes = Writes(ns, uploads, MemoryBudget(64 * MiB), part_size=5 * MiB, max_connections=2, timeout=30.0,  # type: ignore[arg-type]
                    allow_overwrite=False, allow_delete=False, origin=ORIGIN,
                    cache=(cache, str(tmp_path), chunk_id, chunk))
    data = bytes(range(256)) * (13 * MiB // 256)
    tail = 3 * MiB if declared else 0  # declared but never written: zeros (a hole in the local copy)
    async with serving(writes):
        new = await new_file(writes, ns, b".tmpA1")
        if declared:
            new.truncate(len(data) + tail)
        for i in range(0, len(data), MiB):
            await new.write(i, data[i:i + MiB])
        await writes.rename(new.node, ns.node(ROOT_INODE), b"model.safetensors", None, 0)
        meta = await new.commit()
        await writes.drain_cache_fills()
        data += bytes(tail)
        assert uploads.objects == {"model.safetensors": data} and meta.etag == ('"mp-4"' if declared else '"mp-1"')
        assert copies == ([] if declared else ["model.safetensors"])
        assert b"".join(cache.chunks[chunk_id(ObjectVersion(meta.key, meta.etag, meta.size), i)]
                        for i in range(-(-len(data) // chunk))) == data
        assert os.listdir(tmp_path / "writes") == [] and writes.memory.used == 0


async def test_unlinking_a_file_being_written_drops_it_without_allow_delete() -> None:
    """A temporary file deleted before it is closed (tempfile's cleanup after a failed rename): its upload is
    aborted, later writes go nowhere, its close stores nothing, and no --allow-delete is needed."""
    writes, uploads, ns = make()
    async with serving(writes):
        new = await new_file(writes, ns, b".tmpX")
        await new.write(0, bytes(6 * MiB))  # the upload began
        await writes.unlink(new.node)
        assert await new.write(6 * MiB, b"more") == 4
        assert await new.commit() is None
        assert uploads.objects == {} and uploads.aborted == [".tmpX"] and writes.stats.files_failed == 0
        assert {e.name for e in await ns.listing(ns.node(ROOT_INODE))} == set()
        await parts_ended(writes)
        assert writes.memory.used == 0


async def test_a_directory_opened_while_files_in_it_were_written_lists_what_became_of_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """opendir takes the entries once; a file still being written then (an empty file is stored at RELEASE,
    just after close returned) may be stored or dropped before READDIR comes. Stored, it is listed as the
    version stored; dropped, it is left out, and the listing goes on: an error there ends it, since glibc's
    readdir takes ENOENT for the end of the directory (`os.listdir` gave [] on SeaweedFS)."""
    import pyfuse3

    from fsmount.operations import Operations, Owner

    listed: list[tuple[bytes, int]] = []
    monkeypatch.setattr(pyfuse3, "readdir_reply",
                        lambda token, name, attr, next_id: listed.append((name, attr.st_size)) or True)
    writes, uploads, ns = make()
    ops = Operations(ns, None, None, None, max_readahead=0, owner=Owner(0, 0, 0o644, 0o755),  # type: ignore[arg-type]
                     writes=writes)
    async with serving(writes):
        gone = await new_file(writes, ns, b"a-gone")
        kept = await new_file(writes, ns, b"b-kept")
        later = await new_file(writes, ns, b"c-later")
        fh = await ops.opendir(ROOT_INODE, None)  # type: ignore[arg-type]
        await writes.unlink(gone.node)
        assert await gone.commit() is None
        await kept.write(0, b"xyz")
        await kept.commit()
        await ops.readdir(fh, 0, None)  # type: ignore[arg-type]
        assert listed == [(b".", 0), (b"..", 0), (b"b-kept", 3), (b"c-later", 0)]
        assert not ns.entry_node(ns.node(ROOT_INODE), DirEntry(b"b-kept", False, None), time.monotonic()).writing
        await later.commit()


@pytest.mark.parametrize("size", [3 * MiB, 13 * MiB], ids=["one-put", "short-last-part"])
async def test_the_last_short_part_is_sent_from_its_buffer_not_a_copy(size: int) -> None:
    """A short last part (or a file smaller than a part) was sliced out of its buffer, a copy outside the memory
    budget: 4 writers closing files with 64M parts went 40 MiB past --memory-limit. It is cut in place, and its
    reservation still goes back whole."""
    writes, uploads, ns = make(part=5 * MiB)
    sent: dict[int, bytes | bytearray] = {}

    def keep(key: str, upload_id: str, number: int, body: bytearray) -> str:
        # A full part's buffer is used again for a later part: kept as a copy. The last is kept as it went out.
        sent[number] = bytes(body) if len(body) == 5 * MiB else body
        return f'"p{number}"'

    def keep_put(key: str, body: bytearray, only_if_absent: bool = False, or_plain: bool = False,
                 if_version: str | None = None) -> str:
        sent[1] = body
        return '"put"'

    uploads.put_part = keep  # type: ignore[method-assign]
    uploads.put = keep_put  # type: ignore[method-assign]
    uploads.finish = lambda *args: '"mp"'  # type: ignore[method-assign]
    data = os.urandom(size)
    async with serving(writes):
        new = await new_file(writes, ns, b"short.bin")
        for i in range(0, size, MiB):
            await new.write(i, data[i:i + MiB])
        await new.sync()  # the full parts are sent: the commit sends the short one alone
        tracemalloc.start()
        try:
            await new.commit()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert b"".join(sent[n] for n in sorted(sent)) == data
    assert peak < MiB // 2, f"{peak} bytes allocated to send the last {size % (5 * MiB)} bytes"
    assert writes.memory.used == 0


def distinct(objects: list[bytearray]) -> int:
    return len({id(obj) for obj in objects})


def slow_parts(uploads: FakeUploads, seconds: float = 0.02) -> None:
    """Parts take a while, so that the writer waits for a slot (as it does when the server is slower)."""
    put_part = uploads.put_part

    def slowly(*args: Any) -> str:
        time.sleep(seconds)
        return put_part(*args)

    uploads.put_part = slowly  # type: ignore[method-assign]


async def test_a_write_is_copied_once_into_its_part_buffer() -> None:
    """The bytes of a WRITE go straight into the part buffer: no temporary copy of them on the way (a
    bytearray slice assigned a memoryview makes one, a second pass over every byte written)."""
    writes, uploads, ns = make(part=5 * MiB)
    data = os.urandom(MiB)
    async with serving(writes):
        new = await new_file(writes, ns, b"once.bin")
        await new.write(0, data)  # the part buffer is allocated here
        tracemalloc.start()
        try:
            await new.write(MiB, data)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        await new.commit()
    assert peak < MiB // 8, f"{peak} bytes allocated while writing 1 MiB into a part buffer"
    assert uploads.objects["once.bin"] == data + data


async def test_part_buffers_are_recycled_and_every_part_keeps_its_bytes() -> None:
    """A streamed upload of 10 full parts fills at most parts_per_file buffers, a part being sent never
    shares its buffer with the one filling, and the budget gets every reservation back."""
    writes, uploads, ns = make(part=5 * MiB)
    slow_parts(uploads)
    data = os.urandom(50 * MiB + 123)  # 10 full parts and a short one (its own, shorter body)
    async with serving(writes):
        new = await new_file(writes, ns, b"big.bin")
        for i in range(0, len(data), MiB):
            await new.write(i, data[i:i + MiB])
        await new.commit()
    assert uploads.objects["big.bin"] == data and len(uploads.bodies) == 11
    # The short part's body is a copy, and may be sent before the 10th: compare the full ones.
    assert distinct([body for body in uploads.bodies if len(body) == 5 * MiB]) <= writes.parts_per_file
    assert writes.memory.used == 0


async def test_a_deferred_upload_reads_its_parts_into_recycled_buffers(tmp_path: Path) -> None:
    store = FakeStore()
    ns = Namespace(store, call, prefix="", ttl=60.0)
    uploads = FakeUploads(store)
    slow_parts(uploads)
    writes = Writes(ns, uploads, MemoryBudget(64 * MiB), part_size=5 * MiB, max_connections=2, timeout=30.0,  # type: ignore[arg-type]
                    allow_overwrite=False, allow_delete=False, origin=ORIGIN,
                    cache=(FakeCache(), str(tmp_path), lambda v, i: ChunkId("b", v.key, v.etag, 4 * MiB, i), 4 * MiB))
    data = os.urandom(40 * MiB)
    async with serving(writes):
        new = await new_file(writes, ns, b".tmpB")
        new.truncate(len(data))
        for i in range(0, len(data), MiB):
            await new.write(i, data[i:i + MiB])
        await writes.rename(new.node, ns.node(ROOT_INODE), b"model.safetensors", None, 0)
        await new.commit()
        await writes.drain_cache_fills()
    assert uploads.objects == {"model.safetensors": data} and len(uploads.bodies) == 8
    assert distinct(uploads.bodies) <= writes.parts_per_file
    assert writes.memory.used == 0


async def test_a_file_that_stops_writing_gives_its_recycled_buffers_to_another_file() -> None:
    """A file left open after its parts went out keeps their buffers for its next parts, but they are the
    budget's to take back: another writer that finds no room gets them (it waited forever before)."""
    writes, uploads, ns = make(memory=15 * MiB, part=5 * MiB)  # room for 3 part buffers
    slow_parts(uploads)
    async with serving(writes):
        idle = await new_file(writes, ns, b"idle.bin")
        for i in range(12):
            await idle.write(i * MiB, bytes(MiB))  # 2 parts sent, the third filling
        with trio.fail_after(5):
            while idle._in_flight:
                await trio.sleep(0.01)
        assert writes.memory.used == 15 * MiB  # the filling buffer and the 2 sent parts' buffers, kept
        other = await new_file(writes, ns, b"other.bin")
        data = os.urandom(30 * MiB)
        with trio.fail_after(10):
            for i in range(0, len(data), MiB):
                await other.write(i, data[i:i + MiB])
            await other.commit()
        assert uploads.objects["other.bin"] == data
        await idle.commit()
    assert uploads.objects["idle.bin"] == bytes(12 * MiB)
    assert writes.memory.used == 0


async def test_a_part_that_succeeds_after_its_file_was_dropped_gives_its_memory_back() -> None:
    writes, uploads, ns = make(part=5 * MiB)
    succeed_anyway, entered = uploads.put_part, threading.Event()

    def put_part(key: str, upload_id: str, number: int, body: bytearray) -> str:
        entered.set()
        uploads.gate.wait(10)
        uploads.parts.setdefault(upload_id, {})  # the server took the part before it saw the abort
        return succeed_anyway(key, upload_id, number, body)

    uploads.put_part = put_part  # type: ignore[method-assign]
    async with serving(writes):
        new = await new_file(writes, ns, b".tmpC")
        uploads.gate.clear()
        await new.write(0, bytes(6 * MiB))  # part 1 goes out, and is held
        assert await trio.to_thread.run_sync(entered.wait, 5)
        await writes.unlink(new.node)
        uploads.gate.set()
        await parts_ended(writes)
    assert uploads.bodies and writes.memory.used == 0


async def test_a_last_request_that_times_out_is_said_to_have_maybe_landed(
        autojump_clock, caplog: pytest.LogCaptureFixture, allowed_logs: list[str]) -> None:  # noqa: ANN001
    """A single PUT given up after --read-timeout may yet land (here it does): the log said "the file will
    not be stored" and the bucket then held it. Close is still EIO."""
    allowed_logs.append("the bucket may or may not hold it now")
    writes, uploads, ns = make()
    stored = uploads.put

    def put(*args: Any, **kwargs: Any) -> str:  # named as the request it stands for, as the log names it
        time.sleep(2)  # real seconds: the trio clock jumps past the 30 s timeout meanwhile
        return stored(*args, **kwargs)

    uploads.put = put  # type: ignore[method-assign]
    autojump_clock.autojump_threshold = 0.5  # the other requests' threads answer before the clock jumps
    async with serving(writes):
        new = await new_file(writes, ns, b"x")
        await new.write(0, b"data")
        with pytest.raises(PathError) as info:
            await new.commit()
        assert info.value.errno == errno.EIO
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == ["x: put timed out after 30s; the bucket may or may not hold it now (close gets EIO)"], said


async def test_a_request_given_up_on_is_named_without_its_helpers_underscore(autojump_clock) -> None:  # noqa: ANN001
    """`Writes.call` names a request by its function: a create's probe (`_has_children`, B221) timed out as
    "_has_children timed out"; it is the bucket's `has_children` that did."""
    writes, _, _ = make()

    def _has_children(prefix: str) -> bool:
        time.sleep(2)  # real seconds: the trio clock jumps past the 30 s timeout meanwhile
        return False

    autojump_clock.autojump_threshold = 0.5
    with pytest.raises(TimedOut, match=r"^has_children timed out after 30s$"):
        await writes.call(_has_children, "d/")


async def test_a_pre_sized_file_whose_local_copy_fills_the_disk_gets_enospc(tmp_path: Path, monkeypatch,  # noqa: ANN001
                                                                            caplog: pytest.LogCaptureFixture,
                                                                            allowed_logs: list[str]) -> None:
    """save_file's pattern (ftruncate to its size first) keeps the bytes only in the cache dir until close. When
    something else fills that disk after its room was promised, the writer got EIO, and the log said the files
    "are stored, but not cached" beside "will not be stored". It gets ENOSPC, and the log says why."""
    allowed_logs.extend(["cannot keep written files", "will not be stored"])
    store = FakeStore()
    ns = Namespace(store, call, prefix="", ttl=60.0)
    uploads = FakeUploads(store)
    writes = Writes(ns, uploads, MemoryBudget(64 * MiB), part_size=5 * MiB, max_connections=2, timeout=30.0,  # type: ignore[arg-type]
                    allow_overwrite=False, allow_delete=False, origin=ORIGIN,
                    cache=(FakeCache(), str(tmp_path), lambda v, i: ChunkId("b", v.key, v.etag, 4 * MiB, i), 4 * MiB))
    real_pwrite = os.pwrite

    def full_disk(fd, data, offset):  # noqa: ANN001, ANN202
        if offset >= 8 * MiB:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    async with serving(writes):
        new = await new_file(writes, ns, b"model.safetensors")
        new.truncate(40 * MiB)
        with pytest.raises(PathError) as info:
            for i in range(0, 40 * MiB, MiB):
                await new.write(i, bytes(MiB))
        assert info.value.errno == errno.ENOSPC
        with pytest.raises(PathError):
            await new.commit()
    said = " / ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "its local copy in the cache dir failed (No space left on device)" in said, said
    assert "a pre-sized file, whose bytes are only there until it is closed, fails" in said, said
    assert uploads.objects == {}


def test_botocore_signs_without_awscrt_which_copies_every_part() -> None:
    """With awscrt installed, botocore's CRT signer made an io.BytesIO of each part's bytearray: a copy outside
    the memory budget (4 writers of 32M parts: 376 MiB of RSS under --memory-limit 256M). The package turns it
    off before botocore is imported, unless the environment says otherwise."""
    code = ("import fsmount, os, botocore.compat as c; "
            "print(os.environ['BOTO_DISABLE_CRT'], c.HAS_CRT)")
    env = {k: v for k, v in os.environ.items() if k != "BOTO_DISABLE_CRT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["true", "False"]
    env["BOTO_DISABLE_CRT"] = "false"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "false"


async def test_a_rename_right_after_the_close_of_an_empty_file_stores_it_under_the_new_name() -> None:
    """`touch tmp && mv tmp DONE`: an empty file is stored at RELEASE, which comes after close(2) returned, so the
    rename came while its PUT was under way, only renamed it in this mount, and the PUT stored `tmp` (the audit)."""
    writes, uploads, ns = make()
    gate = threading.Event()
    put = uploads.put
    uploads.put = lambda key, body, *conditions: gate.wait(10) and put(key, body, *conditions)
    async with serving(writes) as nursery:
        root = ns.node(ROOT_INODE)
        new = await new_file(writes, ns, b"tmp")
        new.closed_empty = True
        nursery.start_soon(new.commit)  # RELEASE: the PUT waits at the gate
        await trio.sleep(0.05)
        threading.Timer(0.2, gate.set).start()
        await writes.rename(new.node, root, b"DONE", None, 0)
        assert uploads.objects == {"DONE": b""} and new.node.path == "DONE"
        assert (await ns.lookup(ROOT_INODE, b"DONE")).size == 0


async def test_a_rename_whose_copy_is_done_does_not_fail_when_the_old_key_cannot_be_deleted(
        allowed_logs: list[str]) -> None:
    """The copy made, the delete of the old key failed: the rename (and the close of a file renamed while written,
    save_file's order) got EIO though the object was under its new name, and a retry found the name taken (the
    audit). It is done, with a warning that the old key is left."""
    allowed_logs.append(r"was copied to \S+, but could not be deleted \(delete refused\): it is left in the bucket")
    writes, uploads, ns = make()
    delete = uploads.delete
    refusals = [2]

    def flaky_delete(key: str) -> None:
        if refusals[0]:
            refusals[0] -= 1
            raise TransientError("delete refused")
        delete(key)

    uploads.delete = flaky_delete
    async with serving(writes):
        root = ns.node(ROOT_INODE)
        a = await new_file(writes, ns, b"a")
        await a.write(0, b"weights")
        await a.commit()
        await writes.rename(a.node, root, b"b", None, 0)  # no EIO
        assert (await ns.lookup(ROOT_INODE, b"b")).size == 7 and uploads.objects["b"] == b"weights"
        big = await new_file(writes, ns, b".tmp")  # its upload begins under .tmp
        await big.write(0, bytes(6 * MiB))
        await writes.rename(big.node, root, b"model.safetensors", None, 0)
        meta = await big.commit()  # moved at close: stored under its name, no EIO
        assert meta is not None and meta.key == "model.safetensors"
        assert len(uploads.objects["model.safetensors"]) == 6 * MiB


async def test_a_stored_file_renamed_away_is_not_found_under_its_old_name_when_those_bytes_come_back() -> None:
    """After `mv a b`, the same bytes stored at `a` again (the same ETag) were looked up as the moved node, whose
    reads go to key `b` (the audit)."""
    writes, uploads, ns = make(allow_delete=True)
    async with serving(writes):
        root = ns.node(ROOT_INODE)
        a = await new_file(writes, ns, b"a")
        await a.write(0, b"weights")
        await a.commit()
        etag = uploads.store.etags["a"]
        await writes.rename(await ns.lookup(ROOT_INODE, b"a"), root, b"b", None, 0)
        uploads.store.put("a", b"weights")  # another writer stores the same bytes at `a`
        uploads.store.etags["a"] = etag
        ns._negative.pop("a", None)  # noqa: SLF001 - as the kernel's next lookup after the negative entry's TTL
        assert (await ns.lookup(ROOT_INODE, b"a")).path == "a"


async def test_two_extending_ftruncates_promise_the_cache_disk_the_larger_size_only(tmp_path: Path) -> None:
    """Each extending ftruncate of the empty file promised its size on the cache disk, and the discard gave back
    only the last: 1 GiB leaked per such file, until pre-sized files streamed instead (the audit)."""
    store = FakeStore()
    ns = Namespace(store, call, prefix="", ttl=60.0)
    writes = Writes(ns, FakeUploads(store), MemoryBudget(64 * MiB), part_size=5 * MiB, max_connections=2,  # type: ignore[arg-type]
                    timeout=30.0, allow_overwrite=False, allow_delete=False, origin=ORIGIN,
                    cache=(FakeCache(), str(tmp_path), lambda v, i: ChunkId("b", v.key, v.etag, 4 * MiB, i), 4 * MiB))
    async with serving(writes):
        new = await new_file(writes, ns, b"model.safetensors")
        new.truncate(4 * MiB)
        new.truncate(8 * MiB)
        assert writes._staging._promised == 8 * MiB  # noqa: SLF001
        new.truncate(2 * MiB)
        assert writes._staging._promised == 2 * MiB  # noqa: SLF001
        await new.write(0, b"x")
        await writes.unlink(new.node)
        assert writes._staging._promised == 0  # noqa: SLF001


async def test_unlinking_a_file_whose_local_copy_is_stalled_leaves_the_trio_thread_free(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropping a local copy waits for its write in flight: done in the trio thread, an unlink of a file being
    written (or an unmount) froze every FUSE request while the cache disk stalled (the audit)."""
    import fsmount.write_staging

    store = FakeStore()
    ns = Namespace(store, call, prefix="", ttl=60.0)
    writes = Writes(ns, FakeUploads(store), MemoryBudget(64 * MiB), part_size=5 * MiB, max_connections=2,  # type: ignore[arg-type]
                    timeout=30.0, allow_overwrite=False, allow_delete=False, origin=ORIGIN,
                    cache=(FakeCache(), str(tmp_path), lambda v, i: ChunkId("b", v.key, v.etag, 4 * MiB, i), 4 * MiB))
    stalled = threading.Event()
    real = fsmount.write_staging.pwrite_all
    monkeypatch.setattr(fsmount.write_staging, "pwrite_all",
                        lambda *args, **kw: stalled.wait(10) and real(*args, **kw))
    ticks = []

    async def tick() -> None:
        while True:
            ticks.append(trio.current_time())
            await trio.sleep(0.02)

    async with serving(writes) as nursery:
        new = await new_file(writes, ns, b"model.safetensors")
        new.truncate(8 * MiB)
        await new.write(0, bytes(2 * MiB))  # its block goes to the disk in the background, which stalls
        nursery.start_soon(tick)
        threading.Timer(0.5, stalled.set).start()
        start = trio.current_time()
        await writes.unlink(new.node)
        assert trio.current_time() - start >= 0.3  # it did wait for the write
        assert len([t for t in ticks if t >= start]) >= 10  # and the loop answered meanwhile


@pytest.mark.parametrize("size", [7, 7 * MiB], ids=["one_put", "upload_begun"])
async def test_a_rewrite_renamed_before_its_close_leaves_nothing_under_the_old_name(size: int) -> None:
    """open(f, O_TRUNC), write, rename to g, close: g got the new bytes and f kept the old ones, which this mount
    showed again after the TTL (the audit; a rewrite whose upload began under f was moved away from there already).
    The rename deletes f, which needs --allow-delete (a file this mount did not write)."""
    writes, uploads, ns = make(allow_overwrite=True, allow_delete=True)
    uploads.store.put("f", b"old")
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    async with serving(writes):
        root = ns.node(ROOT_INODE)
        new = await writes.open_existing(await ns.lookup(ROOT_INODE, b"f"), os.O_WRONLY | os.O_TRUNC)
        await new.write(0, data)
        await writes.rename(new.node, root, b"g", None, 0)
        with pytest.raises(PathError):
            await ns.lookup(ROOT_INODE, b"f")  # gone from this mount at the rename
        assert {e.name for e in await ns.listing(root)} == {b"g"}
        await new.commit()
        assert uploads.objects == {"g": data}


async def test_unlinking_a_file_being_rewritten_deletes_the_object_it_replaces(allowed_logs: list[str]) -> None:
    """rm of a file being rewritten (O_TRUNC) dropped only the upload: the old object stayed, and the file came back
    with its old bytes (the audit). With --allow-delete the old object goes; without, the rm is refused and the
    rewrite goes on."""
    allowed_logs.append("needs --allow-delete")
    for allow_delete in (True, False):
        writes, uploads, ns = make(allow_overwrite=True, allow_delete=allow_delete)
        uploads.store.put("f", b"old")
        async with serving(writes):
            new = await writes.open_existing(await ns.lookup(ROOT_INODE, b"f"), os.O_WRONLY | os.O_TRUNC)
            await new.write(0, b"new")
            if allow_delete:
                await writes.unlink(new.node)
                assert uploads.objects == {}
                with pytest.raises(PathError):
                    await ns.lookup(ROOT_INODE, b"f")
            else:
                with pytest.raises(PathError) as info:
                    await writes.unlink(new.node)
                assert info.value.errno == errno.EPERM
                await new.commit()
                assert uploads.objects == {"f": b"new"}


async def test_a_rename_that_waited_for_a_failed_commit_leaves_no_ghost(allowed_logs: list[str]) -> None:
    """A rename waited for a commit in flight, which failed: moved all the same, the dropped file came back under the
    new name as a node nothing would store or drop, and creating that name got EBUSY until unmount (the review)."""
    allowed_logs.append("will not be stored")
    writes, uploads, ns = make()
    gate = threading.Event()

    def failing_put(key: str, body: bytes, only_if_absent: bool = False, or_plain: bool = False,
                    if_version: str | None = None) -> str:
        gate.wait(10)
        raise TransientError("put refused")

    uploads.put = failing_put
    async with serving(writes) as nursery:
        root = ns.node(ROOT_INODE)
        new = await new_file(writes, ns, b"tmp")
        new.closed_empty = True

        async def release() -> None:
            with pytest.raises(PathError):
                await new.commit()

        nursery.start_soon(release)
        await trio.sleep(0.05)
        threading.Timer(0.2, gate.set).start()
        with pytest.raises(PathError) as info:
            await writes.rename(new.node, root, b"DONE", None, 0)
        assert info.value.errno == errno.ENOENT
        with pytest.raises(PathError):
            await ns.lookup(ROOT_INODE, b"DONE")
        uploads.put = FakeUploads.put.__get__(uploads)
        again = await new_file(writes, ns, b"DONE")  # not EBUSY
        await again.commit()
        assert uploads.objects == {"DONE": b""}


async def test_without_allow_delete_a_rewrite_renamed_away_is_refused(allowed_logs: list[str]) -> None:
    """The rename of a rewrite deletes the object it replaces: with --allow-overwrite alone, open(f, O_TRUNC), mv f g,
    rm g deleted f from the bucket (the review). The rename needs --allow-delete, as a stored file's does."""
    allowed_logs.append("needs --allow-delete")
    writes, uploads, ns = make(allow_overwrite=True)
    uploads.store.put("f", b"precious")
    async with serving(writes):
        root = ns.node(ROOT_INODE)
        new = await writes.open_existing(await ns.lookup(ROOT_INODE, b"f"), os.O_WRONLY | os.O_TRUNC)
        with pytest.raises(PathError) as info:
            await writes.rename(new.node, root, b"g", None, 0)
        assert info.value.errno == errno.EPERM
        await new.write(0, b"new")
        await new.commit()
        assert uploads.objects == {"f": b"new"}


async def test_an_unlink_of_a_rewrite_whose_delete_fails_keeps_the_rewrite(allowed_logs: list[str]) -> None:
    """rm of a file being rewritten dropped the upload first: its delete of the old object failing then lost the new
    bytes and kept the old (the review). The old object goes first; failing, the rewrite is still there."""
    writes, uploads, ns = make(allow_overwrite=True, allow_delete=True)
    uploads.store.put("f", b"old")

    def refused(key: str) -> None:
        raise TransientError("delete refused")

    delete, uploads.delete = uploads.delete, refused
    async with serving(writes):
        new = await writes.open_existing(await ns.lookup(ROOT_INODE, b"f"), os.O_WRONLY | os.O_TRUNC)
        await new.write(0, b"new")
        with pytest.raises(StoreError):
            await writes.unlink(new.node)
        uploads.delete = delete
        await new.commit()
        assert uploads.objects == {"f": b"new"}


# -- changes kept for listings under way ----------------------------------------------------------

async def test_changes_are_kept_only_for_listings_under_way() -> None:
    """A change this mount makes is patched into listings of its directory under way when they land. A directory
    written and never listed (a checkpoint saver: the kernel's LOOKUP of a new name is a HEAD, not a listing)
    kept a record of every file, ~300 B each, for the life of the mount (the audit)."""
    writes, _uploads, ns = make()
    async with serving(writes):
        d = await writes.mkdir(ns.node(ROOT_INODE), b"ckpt")
        for i in range(200):
            with pytest.raises(PathError):
                await ns.lookup(d.ino, b"step-%06d.pt" % i)  # the kernel's LOOKUP before CREATE: ENOENT
            new = await writes.create(d, b"step-%06d.pt" % i)
            await new.write(0, b"x")
            await new.commit()
            ns.forget(new.node.ino, 1)  # closed and forgotten by the kernel
    assert not ns._lists_under_way and ns._changes == {}
    assert len(await ns.listing(d)) == 200


async def test_an_emptiness_check_keeps_the_changes_a_listing_under_way_still_needs() -> None:
    """`rmdir d` (and `mv d e`) lists `d` itself. Its listing forgot every change made before it began, although an
    `ls d` begun earlier, still under way, lacked them: that listing landed without the file just stored through
    this mount, was cached, and the file was ENOENT for the TTL (the audit)."""
    store = FakeStore()
    store.put("d/a", b"a")
    delays = [0.6, 0.1]  # the first listing (`ls d`) is slow (a big directory, one page of it here); the next not

    async def ask(fn: Any, *args: Any) -> Any:
        result = fn(*args)
        if fn is namespace.listing_page:
            await trio.sleep(delays.pop(0) if delays else 0)
        return result

    ns = Namespace(store, ask, prefix="", ttl=60.0)
    writes = Writes(ns, FakeUploads(store), MemoryBudget(64 * MiB), part_size=5 * MiB,  # type: ignore[arg-type]
                    max_connections=2, timeout=30.0, allow_overwrite=False, allow_delete=True, origin=ORIGIN)
    async with serving(writes) as nursery:
        d = await ns.lookup(ROOT_INODE, b"d")
        nursery.start_soon(ns.listing, d)  # `ls d`: reads the bucket now (d/a only), lands in 0.6 s
        await trio.sleep(0.1)
        new = await writes.create(d, b"x")  # another process writes d/x
        await new.write(0, b"xyz")
        await new.commit()
        with pytest.raises(PathError) as exc:
            await writes.rmdir(d)  # a third: `rmdir d` while `ls d` is under way
        assert exc.value.errno == errno.ENOTEMPTY
        await trio.sleep(0.6)  # the `ls d` listing has landed and is cached
    assert {e.name for e in await ns.listing(d)} == {b"a", b"x"}
    assert (await ns.lookup(d.ino, b"x")).size == 3
    assert ns._changes == {}  # no listing is under way any more


async def test_the_unmount_aborts_the_uploads_of_files_still_open_at_once(monkeypatch: pytest.MonkeyPatch,
                                                                           allowed_logs: list[str]) -> None:
    """Each abort waits up to ABORT_TIMEOUT_S for the store, shielded: one after another, N stalled aborts took N
    times that, and ABORT_ALL_S, meant to bound them all, cut the loop short of the files after the first."""
    allowed_logs.append("could not be aborted|still being written")
    monkeypatch.setattr(writes_module, "ABORT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(writes_module, "ABORT_ALL_S", 1.0)
    writes, uploads, ns = make()
    answer = threading.Event()

    def stalled(key: str, upload_id: str) -> None:
        answer.wait(10)

    uploads.abort = stalled  # type: ignore[method-assign]
    try:
        async with serving(writes):
            for name in (b"a", b"b", b"c", b"d"):
                new = await new_file(writes, ns, name)
                await new.write(0, bytes(6 * MiB))  # a part sent: a multipart upload
            started = trio.current_time()
            await writes.abort_all()
            took = trio.current_time() - started
    finally:
        answer.set()
    assert took < 0.9, took
    assert not writes._open


async def test_a_rewrite_s_open_waits_for_a_push_into_its_inode_still_copying(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rewrite in place keeps the inode; its O_TRUNC open stops the old version's stream, but a push already in
    notify_store ended its copy after the kernel had emptied the inode at the open: the old pages stayed in the new
    file's cache, the last zero-filled past the old end (B95's zeros, for a mapping of the old version; seen in a
    review, B103). The open now answers only once the push into that inode ended, so the kernel's truncate at the
    reply drops what it stored; a push into another inode is not waited for."""
    import types

    import fsmount.pagecache
    from fsmount.operations import Operations, Owner
    from fsmount.pagecache import PageCachePusher

    release, copying = threading.Event(), threading.Event()

    def notify_store(ino: int, offset: int, data: object) -> None:
        copying.set()
        release.wait(10)

    monkeypatch.setattr(fsmount.pagecache.pyfuse3, "notify_store", notify_store)
    writes, uploads, ns = make(allow_overwrite=True)
    uploads.store.put("m.bin", b"old")
    uploads.store.put("other.bin", b"other")
    pusher = PageCachePusher(1 << 30, pushes_at_once=2)
    rewritten: list[str] = []
    streamer = types.SimpleNamespace(rewritten=lambda version: rewritten.append(version.key))
    ops = Operations(ns, None, streamer, pusher, max_readahead=0, owner=Owner(0, 0, 0o644, 0o755),  # type: ignore[arg-type]
                     writes=writes)
    ctx = types.SimpleNamespace(pid=os.getpid(), uid=0, gid=0, umask=0o022)
    opened: list[Any] = []

    async def open_for_rewrite(ino: int) -> None:
        opened.append(await ops.open(ino, os.O_WRONLY | os.O_TRUNC, ctx))  # type: ignore[arg-type]

    async with serving(writes) as nursery:
        node = await ns.lookup(ROOT_INODE, b"m.bin")
        other = await ns.lookup(ROOT_INODE, b"other.bin")
        nursery.start_soon(pusher.push, node.ino, 0, 3, lambda: b"old")
        await trio.to_thread.run_sync(copying.wait, 5)
        with trio.fail_after(5):
            await open_for_rewrite(other.ino)  # another inode's push is not waited for
        nursery.start_soon(open_for_rewrite, node.ino)
        await trio.sleep(0.3)
        assert len(opened) == 1 and rewritten == ["other.bin", "m.bin"]  # the stream stopped; the open waits
        release.set()
        with trio.fail_after(5):
            while len(opened) < 2:
                await trio.sleep(0.01)
        assert pusher.stored_total == 3
        for info in opened:
            await ops.release(info.fh)
    assert uploads.objects["m.bin"] == b"" and uploads.objects["other.bin"] == b""


async def test_two_appenders_of_an_empty_file_at_once_start_one_rewrite() -> None:
    """With --allow-overwrite an append to an empty stored file asks the bucket first whether it still is (B299):
    two such opens at once, both waiting on that HEAD, both went on to start a file of the one inode (the second
    must be EBUSY, as any open of a file being written is)."""
    writes, uploads, ns = make(allow_overwrite=True)
    uploads.store.put("log", b"")
    async with serving(writes):
        node = await ns.lookup(ROOT_INODE, b"log")

        async def slow(fn: Any, *args: Any) -> Any:  # a HEAD that takes a while, as a real one does
            await trio.sleep(0.01)
            return fn(*args)

        ns._ask = slow  # noqa: SLF001 - the store call `make` gave it, which never waits
        await trio.sleep(namespace.ONE_CALL_S)  # the lookup's answer is no answer for the open
        got: list[NewFile | int] = []

        async def append() -> None:
            try:
                got.append(await writes.open_existing(node, os.O_WRONLY | os.O_APPEND))
            except PathError as exc:
                got.append(exc.errno)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(append)
            nursery.start_soon(append)
        assert sorted(map(type, got), key=str) == sorted([NewFile, int], key=str) and errno.EBUSY in got, got
        new = next(g for g in got if isinstance(g, NewFile))
        await new.write(0, b"line\n")
        await new.commit()
        assert uploads.objects == {"log": b"line\n"}


def handlers_of_names(ns: Namespace, writes: Writes) -> tuple[Any, Any]:
    """The FUSE handlers (`Operations`) over `ns` and `writes` for the requests that work on names: no read path (an
    engine and a streamer that do nothing), no page-cache pusher. Them, and the context of a request of root's."""
    import types

    from fsmount.operations import Operations, Owner

    engine = types.SimpleNamespace(chunk_size=MiB, current_again=lambda version: None)
    streamer = types.SimpleNamespace(opened=lambda ino, version: None, closed=lambda ino: None)
    ops = Operations(ns, engine, streamer, None, max_readahead=0, owner=Owner(0, 0, 0o644, 0o755),  # type: ignore[arg-type]
                     writes=writes)
    return ops, types.SimpleNamespace(pid=os.getpid(), uid=0, gid=0, umask=0o022)


async def test_a_create_s_open_of_a_file_the_kernel_forgot_succeeds_while_the_origin_is_away(
        allowed_logs: list[str]) -> None:
    """The kernel sends CREATE for a name its LOOKUP just found free; the bucket holding a file there (another writer
    stored it), the create opens it (writes.create). While the origin was away (or just back, within DOWN_FAST_FAIL_S
    of a request that got no answer), that file's name resolved from the node kept when the kernel forgot its inode
    (B246), which is not in the inode table: the open of it was ENOENT (`touch` of a file that is there: "No such
    file or directory"), where the same create of a name whose inode the kernel still holds opened it (B303)."""
    import pyfuse3

    allowed_logs.append(ORIGIN_UNAVAILABLE)
    writes, uploads, ns = make()
    store = uploads.store
    for name in ("held", "kept"):
        store.put(name, b"")  # empty: `touch` opens it as a reader (writes.open_existing)
    store.put("full", b"xyz")  # not empty: its open for writing is EPERM (no --allow-overwrite)
    ops, ctx = handlers_of_names(ns, writes)
    async with serving(writes):
        held = await ns.lookup(ROOT_INODE, b"held")
        kept = await ns.lookup(ROOT_INODE, b"kept")
        full = await ns.lookup(ROOT_INODE, b"full")
        for node in (kept, full):
            ns.forget(node.ino, 1)  # the kernel dropped the dentry and forgot the inode (drop_caches, memory pressure)
        store.head = store.has_children = lambda *args: _unreachable()  # type: ignore[method-assign]
        with pytest.raises(Unreachable):  # the origin stops answering: the namespace's next requests fail at once
            await ns.lookup(ROOT_INODE, b"other")
        del store.head, store.has_children  # back: the create's own HEAD finds the file
        for node in (held, kept):
            name = node.path.encode()
            info, attr = await ops.create(ROOT_INODE, name, 0o644, os.O_WRONLY | os.O_CREAT, ctx)  # type: ignore[arg-type]
            assert attr.st_ino == node.ino and attr.st_size == 0
            assert ns.node(node.ino).lookups == 1 + (node is held)
            await ops.release(info.fh)
        with pytest.raises(pyfuse3.FUSEError) as exc:  # the kernel gets no entry: the lookup counted is given back
            await ops.create(ROOT_INODE, b"full", 0o644, os.O_WRONLY | os.O_CREAT, ctx)  # type: ignore[arg-type]
        assert exc.value.errno == errno.EPERM
        assert full.ino not in ns._nodes and ns._forgotten[full.ino] is full and full.lookups == 0  # kept, as before
    assert uploads.objects == {"held": b"", "kept": b"", "full": b"xyz"}


@pytest.mark.parametrize("looked_up", [False, True], ids=["resolved-by-the-rename", "looked-up-by-the-kernel-first"])
async def test_a_rename_onto_a_name_resolved_from_a_kept_node_replaces_it_for_good(looked_up: bool,
                                                                                   allowed_logs: list[str]) -> None:
    """`os.replace(tmp, name)` while the origin was away (or just back, within DOWN_FAST_FAIL_S), `name` a file whose
    inode the kernel had forgotten: the target resolves from the node kept for it (B246), by the rename's own `_child`
    (not in the inode table: B303 named it among the resolves that need no inode number), or by the kernel's LOOKUP of
    the target before its RENAME (which puts it back in the table, as create's does). The renamed file is then the
    name's version in this mount, looked up and, once the kernel forgets it too, from its own kept node while the
    origin is still away: the replaced version's kept node never answers again."""
    import pyfuse3

    allowed_logs.append(ORIGIN_UNAVAILABLE)
    writes, uploads, ns = make(allow_overwrite=True)
    store = uploads.store
    store.put("model.pt", b"old bytes")
    store.put("other.pt", b"other")
    ops, ctx = handlers_of_names(ns, writes)
    async with serving(writes):
        kept = await ns.lookup(ROOT_INODE, b"model.pt")
        ns.forget(kept.ino, 1)  # the kernel dropped the dentry and forgot the inode
        new = await new_file(writes, ns, b"model.pt.tmp")
        await new.write(0, b"new")
        await new.commit()
        tmp = ns.node(new.node.ino)  # held: its create's count
        store.head = store.has_children = lambda *args: _unreachable()  # type: ignore[method-assign]
        with pytest.raises(Unreachable):  # the origin stops answering: the namespace's next requests fail at once
            await ns.lookup(ROOT_INODE, b"other.pt")
        if looked_up:
            assert (await ops.lookup(ROOT_INODE, b"model.pt", ctx)).st_ino == kept.ino  # type: ignore[arg-type]
        assert await ns.resolve(ROOT_INODE, b"model.pt") is kept  # what the rename's target resolves to
        await ops.rename(ROOT_INODE, b"model.pt.tmp", ROOT_INODE, b"model.pt", 0, ctx)  # type: ignore[arg-type]
        assert uploads.objects == {"model.pt": b"new", "other.pt": b"other"}
        if looked_up:
            assert kept.superseded
            ns.forget(kept.ino, 1)  # the kernel forgets the replaced inode
        node = await ns.lookup(ROOT_INODE, b"model.pt")
        assert node is tmp and node.size == 3 and (await ns.open_file(node.ino)).size == 3
        ns.forget(node.ino, 2)  # closed and forgotten by the kernel: its create's count and this lookup's
        node = await ns.lookup(ROOT_INODE, b"model.pt")  # from its kept node
        assert node is tmp and (await ns.open_file(node.ino)).size == 3
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await ops.lookup(ROOT_INODE, b"model.pt.tmp", ctx)  # type: ignore[arg-type]
        assert exc.value.errno == errno.ENOENT
        del store.head, store.has_children  # back
        node = await ns.lookup(ROOT_INODE, b"model.pt")
        assert node.ino == tmp.ino and node.size == 3


def _unreachable() -> None:
    raise Unreachable("cannot reach the endpoint")


async def test_while_the_origin_is_away_a_name_a_create_or_mkdir_found_taken_is_listed_and_resolves(
        allowed_logs: list[str]) -> None:
    """`ls d` kept its listing; another writer deleted `d/f` (a lookup found it gone) and stored it again, and made
    `d/sub/`; this mount's `open(O_CREAT | O_EXCL)` of `d/f` and `mkdir d/sub` found them taken (EEXIST). While the
    origin was away `ls d` did not show them and `stat` of them was EIO, though this mount had just found them there."""
    allowed_logs.append(ORIGIN_UNAVAILABLE)
    writes, uploads, ns = make()
    store = uploads.store
    store.put("d/f", b"12345")
    store.put("d/g", b"123")
    async with serving(writes):
        d = await ns.lookup(ROOT_INODE, b"d")
        assert {e.name for e in await ns.listing(d)} == {b"f", b"g"}
        del store.objects["d/f"]
        ns._listings.clear()  # its TTL ran out: the next lookup asks the bucket
        with pytest.raises(PathError):
            await ns.lookup(d.ino, b"f")
        store.put("d/f", b"1234567")
        store.put("d/sub/x", b"x")
        for attempt in (lambda: writes.create(d, b"f", os.O_WRONLY | os.O_CREAT | os.O_EXCL),
                        lambda: writes.mkdir(d, b"sub")):
            with pytest.raises(PathError) as info:
                await attempt()
            assert info.value.errno == errno.EEXIST
        store.head = store.has_children = store.list_pages = lambda *args: _unreachable()  # type: ignore[method-assign]
        listed = {e.name: e for e in await ns.listing(d)}
        assert set(listed) == {b"f", b"g", b"sub"} and listed[b"f"].meta.size == 7 and listed[b"sub"].is_dir
        assert (await ns.lookup(d.ino, b"f")).size == 7
        assert (await ns.lookup(d.ino, b"sub")).is_dir
