"""One file this mount is writing (`--writable`): sequential bytes in, a streaming multipart upload out,
with bounded memory.

Bytes are copied from each WRITE into a part buffer. A full buffer becomes a part, uploaded in the
background while the next one fills; the upload begins with the first full part, and a file closed
before that is one PUT. A file holds at most `--max-connections` + 1 part buffers (the one filling and
those uploading), reserved from the engine's `MemoryBudget`, so they count against `--memory-limit`; a
writer whose parts cannot leave fast enough waits in `write` for one of them (backpressure): more
buffered parts would not upload any faster. Part sizes grow every PART_GROWTH_EVERY parts (see
`part_size`), so files up to 255,000 x `--write-part-size` (2 TiB at 8 MiB) fit in S3's 10,000 parts.

Only appends are accepted: a write anywhere but at the current end fails (EINVAL) and the file can no
longer become an object. The one exception is an extending `ftruncate` of a file with nothing written
yet (safetensors' `save_file` does it): the size is recorded, and what was never written is uploaded
as zeros at close.

Such a file is about to be renamed (save_file writes a temporary file, renames it, then closes it), and
an upload that began under the temporary name can only be moved by a server-side copy of the whole
object (a second pass over every byte for the server). So with `--cache-dir` such a file is *deferred*:
its WRITEs go straight to the local copy (write_staging; no part buffers, and the never-written tail is
a hole in it), and at close it is uploaded from there, once, under its final name, `--max-connections`
parts at once. Without a local copy, or where the cache's disk has no room for the whole file beside the
other deferred files, it streams, and is moved at close.

`commit` (the close of its last descriptor, or RELEASE) completes the upload, or aborts it and fails with
EIO; a file never appears in the bucket half-written. `sync` (fsync) waits for the parts sent so far and
reports a failure, but stores nothing: the file stays open for more bytes.

Rules (everything runs in the trio thread; store calls run in threads under `Writes`' limiter):
- `_lock` serialises `write`, `truncate`'s caller checks and `commit`, so parts are numbered in offset
  order whatever the kernel interleaves. `write` takes it before its first await: WRITEs that pyfuse3 reads
  one after the other (the pieces of one asynchronous O_DIRECT write, sent at once) queue on it in that order.
- A part task owns its buffer, its reservation and its slot (of `_slots`) from the moment it is
  started; it records its ETag or the first failure in `error`, and releases its slot. The filling
  buffer's reservation and slot are `_buf`'s: released by whoever drops `_buf` (`_drop_buffer`).
  `_idle` is set whenever no part is in flight.
- Part buffers are recycled: a part whose request returned successfully hands its buffer, reservation
  included, to `_free`, where the file's next part of the same size takes it (a fresh 8 MiB buffer is
  zeroed and faulted in, then unmapped when dropped: a third of the daemon's CPU in a deferred upload,
  measured). A buffer in `_free` is idle memory another file or a fetch may need: `release_free` gives
  every one back, and the budget calls it (through `Writes`, a reclaimer of `MemoryBudget`) whenever a
  `reserve` would otherwise wait for room, and `_recycle` does not keep one while a task waits there.
  (Holding them regardless deadlocked: 4 writers under --memory-limit 256M.) Only a successful request
  gives its buffer on: a request given up on time-out may still be sending from it in its thread, and it
  fails the file. `_free` holds at most `parts_per_file` buffers, and is emptied for good when the file
  is stored or dropped (`_recycling` turns False: a part that succeeds after an abort releases its own).
- `error` once set never clears; `stored` once set never changes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import trio

from fsmount.data import (
    MAX_PART_SIZE,
    MAX_PARTS,
    Exists,
    MemoryBudget,
    ObjectMeta,
    Replaced,
    StoreError,
    TimedOut,
    Uploads,
    multipart_etag,
    put_etag,
)
from fsmount.namespace import Node, PathError
from fsmount.write_staging import StagedFile

log = logging.getLogger(__name__)

# The part size grows by the base size every this many parts: 200 x (1 + 2 + ... + 50) = 255,000 base
# parts in 10,000, and the largest part is 50 x the base (400 MiB at 8 MiB).
PART_GROWTH_EVERY = 200
# Zeros for the never-written tail of an extended file, appended this many bytes at a time.
ZEROS = bytes(1 << 20)


class Writes(Protocol):
    """What a file being written needs of the mount's writes (writes.Writes)."""

    memory: MemoryBudget
    uploads: Uploads
    parts_per_file: int

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any: ...
    def spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None: ...
    def key_of(self, node: Node) -> str: ...
    def register(self, new: NewFile) -> None: ...
    def unregister(self, new: NewFile) -> None: ...
    def count_part(self, n: int) -> None: ...
    def stored(self, new: NewFile) -> None: ...
    def dropped(self, new: NewFile) -> None: ...
    async def move_object(self, meta: ObjectMeta, key: str) -> ObjectMeta: ...
    async def abort_upload(self, key: str, upload_id: str) -> bool: ...
    async def discard_staged(self, staged: StagedFile) -> None: ...
    async def drop_object(self, key: str) -> None: ...
    def stage_open(self) -> StagedFile | None: ...
    async def stage(self, staged: StagedFile | None, offset: int, data: bytes | bytearray | memoryview) -> None: ...
    async def stage_extend(self, staged: StagedFile | None, size: int) -> None: ...
    def fill_cache(self, staged: StagedFile | None, meta: ObjectMeta) -> None: ...
    async def read_staged(self, staged: StagedFile | None, offset: int, buf: bytearray) -> bool: ...


def part_size(base: int, number: int) -> int:
    """The size of part `number` (1-based) of an upload whose first parts are `base` bytes."""
    return min(MAX_PART_SIZE, base * (1 + (number - 1) // PART_GROWTH_EVERY))


class NewFile:
    def __init__(self, writes: Writes, node: Node, base_part_size: int):
        self._writes = writes
        self.node = node
        self._base = base_part_size
        self.written = 0  # bytes accepted, all at the end
        self.declared = 0  # the size an extending ftruncate of the empty file asked for
        self.error: str | None = None
        self.stored: ObjectMeta | None = None
        self.unlinked = False  # unlinked while open: its upload is gone, what it is sent is dropped
        # The path of the stored file it replaces, whose object stays in the bucket until this one is stored under the
        # same key: the one it rewrites (an O_TRUNC open; `replaced` is then its own node), or one it was renamed
        # onto (`replaced`: that file's node). Renamed or unlinked before that, the old object is deleted (Writes).
        self.replaces: str | None = None
        self.replaced: Node | None = None
        # The key it was created at with O_EXCL: stored there, its PUT or completion is create-only as without
        # --allow-overwrite (another mount's file stored there since the create's HEAD is not replaced: close EIO).
        self.excl_key: str | None = None
        # A rewrite that keeps the bytes of the stored version it opened (opened without O_TRUNC: an append to an
        # empty file, `r+`): (its key, that version's ETag). Its store there is If-Match on that version: another
        # writer's object stored under the key since the open is not replaced (close EIO). Cleared by a rename that
        # deletes that version (Writes.rename, If-Match on it): the file is then stored as a rename stores. Kept where
        # that delete found another writer's object there, for an upload begun under the key (B371).
        self.if_version: tuple[str, str] | None = None
        # Its store was refused because another writer stored the key since the create found it free (`Exists`): a
        # mknod says EEXIST then, as a local disk does (a close can only say EIO).
        self.taken_meanwhile = False
        # Its last request (the PUT, or the completion) was sent: a close cut short after that (the mount's end) may
        # have stored it in its abandoned thread, whatever the writer was told (Writes._not_stored).
        self.storing = False
        self.handles = 0  # open file handles on it
        self.opener: int | None = None  # the process that opened it (holders.py), None where unknown
        # A descriptor of it was closed while it was still empty and nothing was written since: it is stored
        # at RELEASE, which the kernel sends only after close(2) returned (see Writes.settle).
        self.closed_empty = False
        self.busy_said = False  # an EBUSY for it was logged at info level (Writes.busy): the others go at debug level
        self.settled = trio.Event()  # set once it is stored or dropped: no longer a file being written
        self._lock = trio.Lock()
        self._buf: bytearray | None = None
        self._fill = 0
        self._parts = 0  # parts started
        self._etags: dict[int, str] = {}
        self._key: str | None = None  # the key the multipart upload is under, once it began
        self._upload_id: str | None = None
        self._in_flight = 0
        self._idle = trio.Event()
        self._idle.set()
        self._slots = trio.Semaphore(writes.parts_per_file)
        self._sent = 0  # bytes handed to parts so far: the next part's offset
        self._staged = writes.stage_open()  # with --cache-dir: the local copy for the NVMe cache
        self._deferred = False  # WRITEs go to the local copy only; uploaded at close (see above)
        self._free: list[bytearray] = []  # idle part buffers, each still reserved (see the rules)
        self._recycling = True  # until the file is stored or dropped

    @property
    def size(self) -> int:
        return max(self.written, self.declared)

    @property
    def upload_key(self) -> str | None:
        """The key of this file's multipart upload, once it has one."""
        return self._key

    def _fail(self, message: str, outcome: str = "the file will not be stored") -> None:
        if self.error is None:
            self.error = message
            log.warning("%s: %s; %s", self.node.path, message, outcome)

    # -- bytes in --------------------------------------------------------------------------------

    async def write(self, offset: int, data: bytes) -> int:
        self.closed_empty = False  # still in use through another descriptor (a shell's dup2)
        async with self._lock:
            if self.unlinked:
                return len(data)  # as on a local disk: writes to an unlinked file go nowhere
            if self.stored is not None:
                log.warning("%s: write after the file was stored (its last descriptor was closed); S3 objects "
                            "cannot be appended to", self.node.path)
                raise PathError(errno.EIO)
            if self.error is not None:
                raise PathError(errno.EIO)
            if offset != self.written:
                self._fail(f"write at offset {offset}, but only sequential writes are supported (the next "
                           f"write must be at offset {self.written}, where the bytes written so far end)")
                raise PathError(errno.EINVAL)
            await self._append(memoryview(data))
            # As a local disk's write: `ls -l` of a file being written shows when it last grew, not when it was made.
            self.node.size, self.node.mtime_ns = self.size, time.time_ns()
            return len(data)

    def truncate(self, size: int) -> None:
        """`ftruncate`/`truncate` to `size`: only to the size it has, or extending a file still empty."""
        if size == self.size:
            return
        if self.written == 0 and self.stored is None and self.error is None:
            self.declared = size
            self.node.size, self.node.mtime_ns = self.size, time.time_ns()
            self._deferred = size > 0 and self._staged is not None and self._staged.ok
            if self._deferred and not self._staged.promise(size):
                # Its bytes would be nowhere else until close: a copy that filled the disk would fail the file.
                log.info("%s: no room for a local copy of %d bytes in the cache directory: it streams, and is "
                         "not cached on this node", self.node.path, size)
                self._deferred = False
                self._staged.discard()  # nothing written yet: nothing to wait for
                self._staged = None
            return
        log.warning("%s: truncate to %d after %d bytes were written is not supported (only sequential "
                    "writes)", self.node.path, size, self.written)
        raise PathError(errno.EOPNOTSUPP)

    async def _append(self, view: memoryview) -> None:
        if self._deferred:
            await self._writes.stage(self._staged, self.written, view)
            if self._staged is None or not self._staged.ok:
                # Its bytes are only in the local copy until close (pre-sized: see above), so the file is lost.
                # The writer is told why: ENOSPC when the cache disk filled up (something else filled it
                # after `promise`), which it read as a plain EIO.
                exc = self._staged.error if self._staged is not None else None
                self._fail(f"its local copy in the cache dir failed ({exc.strerror if exc else 'closed'}); a "
                           "pre-sized file is held only there until it is closed")
                raise PathError(exc.errno if exc is not None and exc.errno == errno.ENOSPC else errno.EIO)
            self.written += len(view)
            return
        while view:
            if self._buf is None:
                await self._new_buffer()
            buf = self._buf
            assert buf is not None
            take = min(len(view), len(buf) - self._fill)
            # Through a memoryview: a bytearray slice assigned a memoryview first copies it into a temporary
            # bytearray (a second copy of every byte written, into fresh pages).
            with memoryview(buf) as target:
                target[self._fill:self._fill + take] = view[:take]
            self._fill += take
            self.written += take
            view = view[take:]
            if self._fill == len(buf):
                await self._send_part()
            if self.error is not None:
                raise PathError(errno.EIO)

    async def _new_buffer(self) -> None:
        number = self._parts + 1
        if number > MAX_PARTS:
            self._fail(f"larger than {MAX_PARTS} parts can hold")
            raise PathError(errno.EFBIG)
        size = part_size(self._base, number)
        memory = self._writes.memory
        if size > memory.limit // 2:
            self._fail(f"part {number} ({size} bytes) does not fit in half of --memory-limit's chunk memory")
            raise PathError(errno.EFBIG)
        await self._slots.acquire()
        self._buf = await self._part_buffer(size)
        self._fill = 0

    async def _part_buffer(self, size: int) -> bytearray:
        """A buffer of `size` bytes with its reservation: a recycled one if there is one that size."""
        while self._free:
            buf = self._free.pop()
            if len(buf) == size:
                return buf
            self._writes.memory.release(len(buf))
        await self._writes.memory.reserve(size)
        return bytearray(size)

    def _recycle(self, buf: bytearray) -> None:
        """A part's request returned successfully: its buffer (and reservation) is kept for the next part,
        unless a task waits for room in the budget."""
        if (self._recycling and self.error is None and not self._writes.memory.waiting
                and len(self._free) < self._writes.parts_per_file):
            self._free.append(buf)
        else:
            self._writes.memory.release(len(buf))

    def release_free(self) -> None:
        """Give back the idle recycled buffers and their reservations (the budget needs the room)."""
        while self._free:
            self._writes.memory.release(len(self._free.pop()))

    def _drop_free(self) -> None:
        self._recycling = False
        self.release_free()

    def _release(self, reserved: int) -> None:
        """A part buffer is gone: its reservation and its slot go back."""
        self._writes.memory.release(reserved)
        self._slots.release()

    def _drop_buffer(self) -> None:
        """Let go of the filling buffer (abandoned), and of its reservation and slot."""
        if self._buf is not None:
            self._release(len(self._buf))
            self._buf, self._fill = None, 0

    async def _send_part(self) -> None:
        """Hand the filled buffer to a background part upload (the first one begins the upload)."""
        buf, n = self._buf, self._fill
        assert buf is not None
        self._buf, self._fill = None, 0
        self._parts += 1
        if self._upload_id is None:
            self._key = self._writes.key_of(self.node)
            try:
                self._upload_id = await self._writes.call(self._writes.uploads.start, self._key)
            except Exception as exc:  # noqa: BLE001 - a bug too must fail this file: half set up, a close stored
                # the bytes after this part alone (the fault fuzzer)
                self._release(len(buf))
                if not isinstance(exc, StoreError):
                    log.exception("%s: starting its upload failed unexpectedly", self.node.path)
                self._fail(exc.message if isinstance(exc, StoreError) else "starting its upload failed unexpectedly")
                raise PathError(errno.EIO) from None
            self._writes.register(self)
        self._in_flight += 1
        self._idle = trio.Event()
        self._writes.spawn(self._put_part, self._parts, buf, n, self._sent, self._key, self._upload_id)
        self._sent += n

    async def _put_part(self, number: int, buf: bytearray, n: int, offset: int, key: str, upload_id: str) -> None:
        """One part (the first `n` bytes of `buf`), in the writes' nursery: nothing may leave it but its result
        in `_etags` or `error`."""
        sent = False
        reserved = len(buf)
        body = buf
        try:
            # A short last part is cut in place, not sliced out (a copy sat outside the budget); its reservation
            # stays whole until the part is done.
            del buf[n:]
            await self._writes.stage(self._staged, offset, body)
            if self.error is None and self._upload_id == upload_id:
                self._etags[number] = await self._writes.call(self._writes.uploads.put_part, key, upload_id,
                                                              number, body)
                self._writes.count_part(len(body))
                sent = True
        except StoreError as exc:
            if self._upload_id != upload_id:  # aborted meanwhile (unlinked, failed, unmounted): it had to fail
                log.debug("%s: part %d of an aborted upload: %s", self.node.path, number, exc.message)
            else:
                self._fail(f"part {number}: {exc.message}")
        except Exception:  # noqa: BLE001 - a bug must cost this file, never the mount's nursery
            log.exception("%s: part %d failed unexpectedly", self.node.path, number)
            self._fail(f"part {number} failed unexpectedly")
        finally:
            del body
            self._part_done(buf, sent, reserved)

    def _part_done(self, buf: bytearray, sent: bool, reserved: int) -> None:
        self._slots.release()
        if sent and len(buf) == reserved:
            self._recycle(buf)
        else:
            self._writes.memory.release(reserved)
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    # -- the object out --------------------------------------------------------------------------

    async def sync(self) -> None:
        """fsync: wait until the parts sent so far are uploaded; EIO if the file can no longer be stored. It is
        not stored here: an S3 object cannot be appended to, so every later write would fail, and writers do
        write after fsync (torch.distributed.checkpoint fsyncs its metadata file before its buffered bytes
        reach it, then closes it)."""
        async with self._lock:
            await self._idle.wait()
            if self.error is not None and not self.unlinked:
                raise PathError(errno.EIO)

    async def commit(self) -> ObjectMeta | None:
        """Make the file an object under its current name (the close of its last descriptor); idempotent. EIO
        if it cannot be:
        the upload is then aborted and the file leaves the tree. None for a file unlinked while open."""
        async with self._lock:
            if self.unlinked:
                return None
            if self.stored is not None:
                return self.stored
            if self.error is None:
                try:
                    self.stored = await self._complete()
                except TimedOut as exc:
                    # The last request (the PUT, or completing the multipart upload) may yet land: after a
                    # timeout "will not be stored" was wrong as often as not.
                    self._fail(exc.message, "the bucket may or may not hold it now (close gets EIO)")
                except Exists as exc:
                    self.taken_meanwhile = True
                    self._fail(exc.message)
                except Replaced:
                    key = self.if_version[0] if self.if_version is not None else self._writes.key_of(self.node)
                    self._fail(f"another writer changed {key} (stored or deleted it) since this rewrite opened it; "
                               "storing it would replace that writer's update")
                except StoreError as exc:
                    self._fail(exc.message)
                except PathError:
                    pass
                except Exception:  # noqa: BLE001 - a bug must fail this file, not leave it for the RELEASE to store
                    log.exception("%s: storing it failed unexpectedly", self.node.path)
                    self._fail("storing it failed unexpectedly")
            if self.stored is None:
                await self.abort()
                raise PathError(errno.EIO)
            self._drop_free()
            self._writes.stored(self)
            self._writes.fill_cache(self._staged, self.stored)
            self._staged = None
            return self.stored

    async def _complete(self) -> ObjectMeta:
        writes = self._writes
        final_key = writes.key_of(self.node)
        if self._deferred:
            if self.declared > self.written:
                await writes.stage_extend(self._staged, self.declared)
                self.written = self.declared
            if self._staged is None or not self._staged.ok:
                raise StoreError("its local copy failed")
            return await self._upload_copy(final_key)
        if self.declared > self.written:
            tail = self.declared - self.written
            while tail:
                await self._append(memoryview(ZEROS)[:min(tail, len(ZEROS))])
                tail = self.declared - self.written
        if self._upload_id is None:
            n, buf = self._fill, self._buf
            # Taken out of `_buf` (whose reservation is its length: see the module's rules) before it is cut in
            # place (see _put_part); its reservation and slot go back here.
            self._buf, self._fill = None, 0
            reserved = len(buf) if buf is not None else 0
            try:
                body: bytes | bytearray = b""
                if buf is not None:
                    del buf[n:]
                    body = buf
                await writes.stage(self._staged, 0, body)
                etag = await self._last_request(final_key, lambda: put_etag(body), writes.uploads.put, final_key, body,
                                                *self._if_absent(final_key), self._if_version(final_key))
            finally:
                if buf is not None:
                    self._release(reserved)
            writes.count_part(n)
            return ObjectMeta(final_key, n, etag, time.time_ns())
        if self._fill or self._buf is not None:
            await self._send_part()
        await self._idle.wait()
        if self.error is not None:
            raise StoreError(self.error)
        assert self._key is not None
        etags = [self._etags[i] for i in range(1, self._parts + 1)]
        etag = await self._last_request(self._key, lambda: multipart_etag(etags), writes.uploads.finish, self._key,
                                        self._upload_id, etags, *self._if_absent(self._key),
                                        self._if_version(self._key))
        self._upload_id = None
        writes.unregister(self)
        meta = ObjectMeta(self._key, self.written, etag, time.time_ns())
        if self._key != final_key:
            # Renamed while it was written (safetensors renames its temp file before closing it): the
            # object was uploaded under the old name and is moved now.
            started = time.monotonic()
            try:
                meta = await writes.move_object(meta, final_key)
            except StoreError:
                # Not stored under its name (another writer created it meanwhile, or the copy failed): its
                # bytes under the old name are no file of this tree any more, so they go too.
                await writes.drop_object(self._key)
                raise
            log.info("%s: moved from %s by a server-side copy (%d bytes, %.2f s)", final_key, self._key, meta.size,
                     time.monotonic() - started)
        return meta

    async def _upload_copy(self, key: str) -> ObjectMeta:
        """A deferred file: uploaded from its local copy under its final name, --max-connections parts at
        once, each read into a buffer reserved from the budget."""
        writes, size = self._writes, self.written
        log.debug("%s: uploading %d bytes from its local copy", key, size)
        ranges, start = [], 0
        while start < size or not ranges:
            end = min(size, start + part_size(self._base, len(ranges) + 1))
            ranges.append((start, end))
            start = end
        if len(ranges) == 1:
            async with self._reserved(size):
                body = bytearray(size)
                await self._read_copy(0, body)
                etag = await self._last_request(key, lambda: put_etag(body), writes.uploads.put, key, body,
                                                *self._if_absent(key), self._if_version(key))
            writes.count_part(size)
            return ObjectMeta(key, size, etag, time.time_ns())
        self._key = key
        self._upload_id = await writes.call(writes.uploads.start, key)
        writes.register(self)

        async def one(number: int, start: int, end: int) -> None:
            await self._slots.acquire()
            if self.error is not None:
                self._slots.release()
                return
            body = await self._part_buffer(end - start)
            sent = False
            try:
                await self._read_copy(start, body)
                self._etags[number] = await writes.call(writes.uploads.put_part, key, self._upload_id,
                                                        number, body)
                writes.count_part(end - start)
                sent = True
            except StoreError as exc:
                self._fail(f"part {number}: {exc.message}")
            finally:
                self._slots.release()
                if sent:
                    self._recycle(body)
                else:
                    writes.memory.release(len(body))

        async with trio.open_nursery() as nursery:
            for number, (start, end) in enumerate(ranges, 1):
                nursery.start_soon(one, number, start, end)
        if self.error is not None:
            raise StoreError(self.error)
        etags = [self._etags[i] for i in range(1, len(ranges) + 1)]
        etag = await self._last_request(key, lambda: multipart_etag(etags), writes.uploads.finish, key,
                                        self._upload_id, etags, *self._if_absent(self._key),
                                        self._if_version(self._key))
        self._upload_id = None
        writes.unregister(self)
        return ObjectMeta(key, size, etag, time.time_ns())

    def _if_version(self, key: str | None) -> str | None:
        """`if_version` (uploads.finish) for its store under `key`: the ETag of the version a rewrite that keeps its
        bytes opened (`if_version`), where it is stored under that key. An O_TRUNC rewrite keeps nothing of it and
        replaces what is there at its close, as on a local disk."""
        return self.if_version[1] if self.if_version is not None and key == self.if_version[0] else None

    def _if_absent(self, key: str | None) -> tuple[bool, bool]:
        """`only_if_absent` and `or_plain` (uploads.finish) for its store under `key`: create-only without
        --allow-overwrite; with it, where `key` is the name it was created at with O_EXCL (unless the server refuses
        the header). That is its name still, or the old name of one renamed while written, whose upload is completed
        there before it is moved (B31): that store replaced another writer's object stored there meanwhile, and the
        move's delete then removed it. Stored under a name it was renamed to, it replaces what is there, as any rename
        does."""
        create_only = self._writes.create_only
        excl = key is not None and key == self.excl_key
        return create_only or excl, not create_only

    async def _last_request(self, key: str, expected: Callable[[], str | None], fn: Callable[..., str],
                            *args: Any) -> str:
        """The request that makes the file an object (its PUT, or the completion); its ETag, as
        `Writes.last_request` asks it (failed, it may have taken effect all the same). Marked `storing` first: a close
        cut short after this may have stored it in its abandoned thread (B154)."""
        self.storing = True
        return await self._writes.last_request(key, expected, fn, *args)

    @contextlib.asynccontextmanager
    async def _reserved(self, n: int) -> AsyncIterator[None]:
        """n bytes of the budget, held for the body of the block."""
        await self._writes.memory.reserve(n)
        try:
            yield
        finally:
            self._writes.memory.release(n)

    async def _read_copy(self, start: int, buf: bytearray) -> None:
        """Fill `buf` from the local copy at `start` (the caller holds its reservation)."""
        if not await self._writes.read_staged(self._staged, start, buf):
            raise StoreError("its local copy could not be read")

    async def rename(self, move: Callable[[], Awaitable[None]]) -> bool:
        """Renamed while open: `await move()` gives it its new name, under which it is stored. False if it was stored
        meanwhile: then it is an object to move. A commit in flight is waited for: `touch tmp && mv tmp DONE`
        renamed an empty file whose PUT (at RELEASE, after close returned) was under way, and it was stored as
        `tmp` while this mount said `DONE`."""
        async with self._lock:
            if self.stored is not None:
                return False
            if self.settled.is_set() or self.unlinked:
                # Its commit failed meanwhile (or it was unlinked): it left the tree. Moved all the same, it came back
                # as a node nothing would ever store or drop, and the name stayed EBUSY until unmount (the review).
                raise PathError(errno.ENOENT)
            await move()
            return True

    async def unlink(self) -> bool:
        """Unlinked while open (a temporary file deleted before it is closed): nothing will be stored. False
        if it was stored meanwhile (a close got there first): then it is an object to delete."""
        async with self._lock:
            if self.stored is not None:
                return False
            self.unlinked = True
            await self.abort()
            return True

    def take_upload(self) -> tuple[str, str] | None:
        """This file's upload under way, (key, upload id), handed over to be aborted without its tasks (the mount
        failed: `Writes.abort_after_failure`); None if it has none, or its own abort took it first. Parts still in
        flight then see it gone, as after `abort`."""
        if self._upload_id is None:
            return None
        assert self._key is not None
        upload_id, self._upload_id = self._upload_id, None
        return self._key, upload_id

    async def abort(self) -> None:
        """Drop the upload and its parts (at a failure, unlink, or when the mount stops); the file leaves the tree.
        Parts still in flight fail on their own (the upload is gone) and release their memory then."""
        self._drop_buffer()
        self._drop_free()
        staged, self._staged = self._staged, None
        if self._upload_id is not None:
            # Before the local copy, whose discard waits for a stalled cache disk: at unmount that wait took the
            # whole time given to aborting, and no upload was aborted (the review).
            upload_id, self._upload_id = self._upload_id, None
            assert self._key is not None
            await self._writes.abort_upload(self._key, upload_id)
            self._writes.unregister(self)
        if staged is not None:
            await self._writes.discard_staged(staged)
        self._writes.dropped(self)
