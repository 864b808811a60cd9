"""What `--writable` lets a mount change, and the rules it follows: new files (each a `new_file.NewFile`),
directories, deletes and renames, each done in the bucket first and then told to the namespace.

The rules (README "Writing checkpoints"):
- Without `--allow-overwrite` nothing replaces an existing key: a create or a file's rename checks the bucket (HEAD)
  first, and an open with O_TRUNC or a rename onto an existing file fails with EPERM. The file's final PUT or
  completion is create-only too, so a key another mount stored meanwhile is not replaced: that close
  gets EIO and stores nothing. A rename's copy is create-only as well: CopyObject has no create-only
  form, so without --allow-overwrite every copy is a multipart upload of UploadPartCopy parts (one, for
  a small file) whose completion is create-only.
- A create (the kernel's answer to O_CREAT of a name this mount said was free) that finds a file in the bucket (another
  writer stored it since) opens that file as an OPEN with its flags would, or fails with EEXIST for O_EXCL: it asks
  the bucket unless --allow-overwrite lets it replace the file and it truncates.
- A name the bucket holds as the other kind is refused, asked at the create, mkdir or rename (another mount may have
  made it since this one listed): a file where a directory is (EISDIR; it would never be seen, a name that is both is
  shown as the directory), a directory where a file is (EEXIST, ENOTDIR; it would hide the file). So is a mkdir
  where a directory is (EEXIST), and a RENAME_NOREPLACE onto anything there (EEXIST).
- Without `--allow-delete` nothing is deleted: unlink and rmdir fail with EPERM, and so does renaming a
  file or directory this mount did not write (a rename deletes the old key or marker).
- A rename is a server-side copy and then a delete of the old key (If-Match on the version copied), not atomic:
  for a moment both names exist in the bucket. Renaming a file still being written only renames it in this
  mount; the object is stored under its final name at close (moved by a copy if its upload had begun under the
  old one). A directory with anything in it is not renamed (EXDEV); one renamed onto an empty directory replaces it
  (with --allow-overwrite: its marker is put at the other's key), ENOTEMPTY onto one with anything in it.
- One writer per file: opening a file that is being written fails with EBUSY, for reading or writing.
- Unlinking a file that is being written needs no `--allow-delete` (nothing of it is in the bucket yet):
  its upload is aborted, and what its handles still write goes nowhere, as on a local disk. A rewrite (O_TRUNC)
  of a stored file is the exception: the object it replaces is in the bucket until the rewrite is stored, so an
  unlink deletes it (with `--allow-delete`, first), and so does a rename (with it, unless this mount wrote it).
  So is a file being written that was renamed onto a stored one: it replaces that object the same way.
- A rename of a file whose commit is in flight waits for it (`NewFile.rename`): then it moves the stored object,
  or gets ENOENT if the commit failed.
- A name a file was renamed away from while it was written, once its upload had begun there, is busy (EBUSY) for
  new files and renames onto it until that file is stored: its upload is completed under that key, then moved.

Rules between tasks (all in the trio thread): `_open` holds the files with an upload under way (for
aborting at unmount); `_written` the inodes of files this mount stored and of directories it made; `_kinds_refused`
the kinds of file already refused with a warning (`refuse_kind`). Store calls
run in threads under `_limiter` (`--max-connections`), given up after `--read-timeout`.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import trio

from fsmount.config import StoreConfig, cleanup_command
from fsmount.data import (
    COPY_OBJECT_MAX,
    MAX_PART_SIZE,
    MAX_PARTS,
    UNREACHABLE_RETRY_S,
    ChunkCache,
    ChunkId,
    DiskCache,
    MemoryBudget,
    ObjectMeta,
    ObjectVersion,
    StoreError,
    TimedOut,
    Unreachable,
    Uploads,
    multipart_etag,
    put_etag,
    sent_etag,
    wait_to_retry,
    within,
)
from fsmount.namespace import Node, PathError, at_once
from fsmount.new_file import NewFile
from fsmount.tree_changes import WritableNamespace
from fsmount.write_staging import StagedFile, Staging, copy_cached

log = logging.getLogger(__name__)

# Renames copy objects above this size as parallel UploadPartCopy parts (at least this big each, at most
# --max-connections at once); a single CopyObject copies at one stream's speed.
COPY_PART_MIN = 64 * 1024 * 1024
# How long an open waits for the RELEASE of a file whose last descriptor was just closed (Writes.settle):
# the kernel sends it asynchronously right after close(2), within milliseconds.
RELEASE_WAIT_S = 1.0
# One abort (a failed file, a failed copy) waits this long for the store, then leaves the parts to
# `modelfs cleanup`. At unmount, how long aborting the uploads of files still open may take in all, and
# how long stored files may take to reach the NVMe cache.
ABORT_TIMEOUT_S = 10.0
ABORT_ALL_S = 15.0
CACHE_FILL_S = 30.0
# Threads for the local copies of files being written (--cache-dir): one large sequential write each.
STAGING_THREADS = 2
# linux/fs.h renameat2 flags.
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


@dataclasses.dataclass
class WriteStats:
    files_stored: int = 0
    files_failed: int = 0
    bytes_uploaded: int = 0
    parts_uploaded: int = 0
    renames: int = 0
    deletes: int = 0
    chunks_cached: int = 0  # chunks of stored files put into the NVMe cache
    # Unlinks, rmdirs and renames refused for want of --allow-delete: a trainer's checkpoint rotation deletes with
    # rmtree(ignore_errors=True), so its checkpoints pile up in the bucket with nothing said but one log line.
    deletes_refused: int = 0


class Writes:
    def __init__(self, namespace: WritableNamespace, uploads: Uploads, memory: MemoryBudget, *, part_size: int,
                 max_connections: int, timeout: float, allow_overwrite: bool, allow_delete: bool, origin: StoreConfig,
                 cache: tuple[ChunkCache, str, Callable[[ObjectVersion, int], ChunkId], int] | None = None,
                 cache_min_free: int = 0, cache_room: Callable[[int], int] | None = None):
        """`origin`: how the mount reaches its bucket (what the `modelfs cleanup` its warnings advise needs).
        `cache`: with --cache-dir, (the NVMe level, the cache dir, the engine's chunk_id, chunk size): stored files
        go into it (write_staging), whose copies of files being written leave `cache_min_free` bytes free on its
        disk, and hold what they are about to write with the level where it is a `DiskCache` (`DiskCache.hold`, which
        evicts its oldest chunks for their room); `cache_room`, the level's `DiskCache.keep_free`, says there is one."""
        self.ns = namespace
        self.uploads = uploads
        self._origin = origin
        self.memory = memory
        self.part_size = part_size
        # Part buffers one file may hold: the one filling, and one per connection uploading.
        self.parts_per_file = max_connections + 1
        self.allow_overwrite = allow_overwrite
        # A file's final PUT or completion is create-only (If-None-Match: *) unless overwriting is allowed:
        # the HEAD at create is not atomic, and another mount may store the key while this one writes it.
        self.create_only = not allow_overwrite
        self.allow_delete = allow_delete
        self._delete_refusal_logged = False
        self._kinds_refused: set[str] = set()
        self.stats = WriteStats()
        self._timeout = timeout
        self._max_connections = max_connections
        self._limiter = trio.CapacityLimiter(max_connections)
        self._nursery: trio.Nursery | None = None
        self._files: dict[int, NewFile] = {}  # inode -> the file being written
        self._open: set[NewFile] = set()
        self._written: set[int] = set()
        level = cache[0] if cache is not None and cache_room is not None and isinstance(cache[0], DiskCache) else None
        self._staging = Staging(cache[1], cache_min_free, level) if cache is not None else None
        self._cache = cache
        self._staging_limiter = trio.CapacityLimiter(STAGING_THREADS)
        self._fills = 0  # cache fills running (of stored files, and of renamed ones: `recache`)
        self._fills_done = trio.Event()
        self._filling: dict[ObjectVersion, trio.Event] = {}  # a stored version's fill, set when it has ended
        memory.add_reclaimer(self._release_idle_buffers)
        uploads.on_unknown_upload = self._unknown_upload

    def _unknown_upload(self, key: str) -> None:
        """An upload of `key` the server may have begun that this mount never heard of (the answer to its start was
        lost and botocore began it again, or the answer was cut short): left in the bucket, billed, unless named.
        Any thread."""
        log.warning("an upload of %s may have begun in the bucket that this mount never heard of (the answer to its "
                    "start was lost or cut short); once the file is stored or failed, `%s` removes it", key,
                    cleanup_command(self._origin, [key]))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The nursery of part uploads, open for the mount's life."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    # -- for NewFile -----------------------------------------------------------------------------

    def _release_idle_buffers(self) -> None:
        """The budget's reclaimer: every file's recycled part buffers back to the budget (no await)."""
        for new in self._files.values():
            new.release_free()

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One store request in a thread, given up after --read-timeout. An endpoint that refuses connections (a
        server restarting: the request never reached it) is tried again with backoff within that time, as a
        demanded read is (levels.UNREACHABLE_RETRY_S): a 20 s restart lost the checkpoint being written."""
        what = getattr(fn, "__name__", "request").lstrip("_")  # a private helper named as its request
        deadline = trio.current_time() + self._timeout
        backoff = UNREACHABLE_RETRY_S
        refused: Unreachable | None = None
        with trio.move_on_at(deadline):
            while True:
                try:
                    # Its tries end at the deadline too: abandoned, botocore's retries went on (`within`).
                    until = time.monotonic() + (deadline - trio.current_time())
                    return await trio.to_thread.run_sync(within, until, fn, *args, limiter=self._limiter,
                                                         abandon_on_cancel=True)
                except Unreachable as exc:
                    refused = exc
                    backoff = await wait_to_retry(exc, backoff, deadline, what)
                refused = None  # a try under way when the time ran out: that one may have reached the bucket
        if refused is not None:
            # The time ran out between tries, all refused: the request never reached the bucket (not "timed out",
            # which tells the caller the bucket may hold it).
            raise refused
        raise TimedOut(f"{what} timed out after {self._timeout:g}s")

    async def last_request(self, key: str, expected: Callable[[], str | None], fn: Callable[..., str],
                           *args: Any) -> str:
        """The request that makes an object of `key` (a new file's PUT or completion; a rename's completion of its copy
        in parts, or its PUT of an empty object; a directory's marker, by mkdir or a rename); its ETag. Failed, it may
        have taken effect all the same: the server stored the object and its answer was lost, so botocore sent it again
        and that found the key, its own (412 to a create-only request), or the upload already completed (NoSuchUpload);
        or the answer was cut short (a 200 with no body or no ETag). The close, or the rename, said EIO for an object
        the bucket held whole (a trainer's retry of the save then got EPERM; a rename left the file under both names,
        B163, B164). So the bucket is asked: a key that holds exactly this object (`expected`: its ETag, None where it
        cannot be told) is the object stored."""
        try:
            return await self.call(fn, *args)
        except (Unreachable, TimedOut):
            # Never reached the bucket; or given up on at --read-timeout, when asking too would take the close past
            # its bound (the request may land later: the warning says so).
            raise
        except StoreError as exc:
            etag = expected()
            try:
                meta = await self.call(self.uploads.head, key) if etag is not None else None
            except StoreError:
                meta = None
            if meta is None or meta.etag != etag:
                raise exc from None
            log.info("%s: %s, but the bucket holds this object whole: stored", key, exc.message)
            return meta.etag

    def stage_open(self) -> StagedFile | None:
        return self._staging.open() if self._staging is not None else None

    async def stage(self, staged: StagedFile | None, offset: int, data: bytes | bytearray | memoryview) -> None:
        if staged is not None and staged.ok:
            await trio.to_thread.run_sync(staged.write, offset, data, limiter=self._staging_limiter)

    async def stage_extend(self, staged: StagedFile | None, size: int) -> None:
        if staged is not None and staged.ok:
            await trio.to_thread.run_sync(staged.extend, size, limiter=self._staging_limiter)

    async def discard_staged(self, staged: StagedFile) -> None:
        """Drop a local copy, in a thread of its own: it waits for a write of the copy in flight, which a stalled
        cache disk holds (done in the trio thread, an unlink of a file being written, or an unmount, froze every
        FUSE request until the disk answered). Given up on cancel: the thread ends when the disk answers."""
        await trio.to_thread.run_sync(staged.discard, abandon_on_cancel=True)

    async def read_staged(self, staged: StagedFile | None, offset: int, buf: bytearray) -> bool:
        """Fill `buf` from a local copy at `offset`; False if it failed (or there is none)."""
        if staged is None or not staged.ok:
            return False
        return await trio.to_thread.run_sync(staged.read_into, offset, buf, limiter=self._staging_limiter)

    def fill_cache(self, staged: StagedFile | None, meta: ObjectMeta) -> None:
        """In the background: a stored file's chunks from its local copy into the NVMe cache."""
        if staged is None or not staged.ok or self._cache is None:
            return
        cache, _, chunk_id, chunk_size = self._cache
        version = ObjectVersion(meta.key, meta.etag, meta.size)
        done = self._filling[version] = trio.Event()

        async def fill() -> None:
            try:
                cached = await trio.to_thread.run_sync(
                    staged.to_cache, cache, lambda i: chunk_id(version, i), meta.size, chunk_size,
                    limiter=self._staging_limiter, abandon_on_cancel=True)
                self.stats.chunks_cached += cached  # after the await: fills run side by side
            finally:
                done.set()
                if self._filling.get(version) is done:
                    del self._filling[version]

        self._spawn_fill(fill)

    def recache(self, old: ObjectVersion, new: ObjectVersion) -> None:
        """In the background: a renamed file's chunks in the NVMe cache under its new name, after its own fill if
        that is still running. A chunk id names the key, so the crash-safe `save(f.tmp); os.replace(f.tmp, f)` left
        every chunk under `f.tmp`, and a resume on the same node read `f` from the origin (a fleet tester). The old
        ids' chunks stay until the cache evicts them, as any unread chunk does."""
        if self._cache is None:
            return
        cache, _, chunk_id, chunk_size = self._cache
        filled = self._filling.get(old)

        async def copy() -> None:
            if filled is not None:
                await filled.wait()
            cached = await trio.to_thread.run_sync(
                copy_cached, cache, lambda i: chunk_id(old, i), lambda i: chunk_id(new, i), old.size, chunk_size,
                limiter=self._staging_limiter, abandon_on_cancel=True)
            self.stats.chunks_cached += cached

        self._spawn_fill(copy)

    def _spawn_fill(self, fill: Callable[[], Awaitable[None]]) -> None:
        """Run a cache fill in the writes' nursery, counted for `drain_cache_fills`."""
        async def counted() -> None:
            try:
                await fill()
            finally:
                self._fills -= 1
                if self._fills == 0:
                    self._fills_done.set()
                    self._fills_done = trio.Event()

        self._fills += 1
        self.spawn(counted)

    async def drain_cache_fills(self) -> None:
        """At unmount: let stored files reach the NVMe cache (bounded)."""
        with trio.move_on_after(CACHE_FILL_S):
            while self._fills:
                await self._fills_done.wait()
        if self._fills:
            log.warning("%d written files did not reach the cache within %g s", self._fills, CACHE_FILL_S)

    async def abort_upload(self, key: str, upload_id: str) -> bool:
        """Abort a multipart upload, bounded by ABORT_TIMEOUT_S and shielded from cancellation (an unmount
        must still abort); False, with a warning, if it could not be (`modelfs cleanup` removes it)."""
        reason = await self._cleanup(self.uploads.abort, key, upload_id)
        if reason is not None:
            log.warning("the upload of %s could not be aborted (%s); `%s` removes it", key, reason,
                        cleanup_command(self._origin, [key]))
        return reason is None

    async def drop_object(self, key: str) -> None:
        """Delete an object this mount stored that no file of the tree holds any more (a file renamed while
        written whose move failed), bounded and shielded like `abort_upload`; a warning if it stays."""
        reason = await self._cleanup(self.uploads.delete, key)
        if reason is not None:
            log.warning("%s could not be deleted (%s); it is left in the bucket", key, reason)

    async def _cleanup(self, fn: Callable[..., Any], *args: Any) -> str | None:
        """One cleanup request, at most ABORT_TIMEOUT_S, shielded; None once done, else why not."""
        reason = f"no answer in {ABORT_TIMEOUT_S:g} s"
        with trio.move_on_after(ABORT_TIMEOUT_S, shield=True):
            try:
                await self.call(fn, *args)
                return None
            except StoreError as exc:
                reason = exc.message
        return reason

    def spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run `fn(*args)` in the writes' nursery; an exception it lets out is logged, and goes no further
        (it would take the mount's nursery down with it)."""
        assert self._nursery is not None

        async def guarded() -> None:
            try:
                await fn(*args)
            except Exception:  # noqa: BLE001 - one file's task, never the mount
                log.exception("a background write task failed")

        self._nursery.start_soon(guarded)

    def key_of(self, node: Node) -> str:
        return self.ns.key_of(node.path)

    def register(self, new: NewFile) -> None:
        self._open.add(new)

    def unregister(self, new: NewFile) -> None:
        self._open.discard(new)

    def count_part(self, n: int) -> None:
        self.stats.parts_uploaded += 1
        self.stats.bytes_uploaded += n

    def stored(self, new: NewFile) -> None:
        assert new.stored is not None
        self._files.pop(new.node.ino, None)
        self._written.add(new.node.ino)
        self.ns.end_file(new.node, new.stored)
        new.settled.set()
        self.stats.files_stored += 1
        log.info("stored %s (%d bytes)", new.stored.key, new.stored.size)

    def dropped(self, new: NewFile) -> None:
        if self._files.get(new.node.ino) is new:
            del self._files[new.node.ino]
            self.ns.end_file(new.node, None)
            new.settled.set()
            if not new.unlinked:
                self.stats.files_failed += 1

    # -- files -----------------------------------------------------------------------------------

    def writing(self, node: Node) -> NewFile | None:
        return self._files.get(node.ino)

    def busy(self, path: str, new: NewFile | None, what: str) -> NoReturn:
        """EBUSY for `what` (an open to read it, to write it, a rename onto it) of the file `new` this mount is
        writing at `path`, said in the log: a resume that opened a shard before its writer's last close got EBUSY
        with nothing in the log, even at debug level (B880). At info level, not a warning: it is what README says
        and writers meet it routinely (a `cp` beside a saver, a child that inherited the descriptor); once per file,
        the others at debug level (a reader that polls until the file is stored)."""
        said = new is not None and new.busy_said
        log.log(logging.DEBUG if said else logging.INFO,
                "%s: %s fails with EBUSY: this mount is writing it, and it is stored (and can be opened) at its last "
                "close%s", path or "/", what, "" if said else " (further refusals of it are logged at debug level)")
        if new is not None:
            new.busy_said = True
        raise PathError(errno.EBUSY)

    async def settle(self, node: Node) -> None:
        """Before an open or a stat of a file being written: if its last descriptor looks closed (closed while empty,
        nothing written since), wait up to RELEASE_WAIT_S, once, for the RELEASE that stores it. An empty file is
        stored at RELEASE, not at FLUSH (a shell's `> file` closes a first descriptor before it writes), and
        the kernel sends RELEASE after close(2) returned: without this wait `open(p, "w").close();
        open(p)` would get EBUSY."""
        new = self._files.get(node.ino) if node.writing else None
        if new is not None and new.closed_empty:
            with trio.move_on_after(RELEASE_WAIT_S) as waited:
                await new.settled.wait()
            if waited.cancelled_caught:
                # Another descriptor holds it (`exec 9>lock`, a dup): no RELEASE comes, and the next stat or open
                # does not wait for one again until a descriptor of it is closed (each `ls -l` of a lock file held
                # so took a second).
                new.closed_empty = False

    async def _in_bucket(self, path: str, *, file: bool, directory: bool) -> tuple[bool, bool]:
        """Whether the bucket holds a file at `path`, and a directory (any key under `path/`), each asked only if
        wanted, at once and not cached: another mount may have made either since this one listed the parent. A
        name that is both is shown as the directory (namespace._ask_bucket), so a file made beside a directory of
        its name would be stored and never seen, and a directory made beside a file would hide it."""
        calls: dict[str, Callable[[], Awaitable[Any]]] = {}
        if file:
            calls["file"] = lambda: self.call(self.uploads.head, self.ns.key_of(path))
        if directory:
            # Its listing answered cut short is asked once more, within the one deadline of `call` (B221).
            calls["directory"] = lambda: self.call(self.uploads.has_children, self.ns.dir_key(path))
        asked = time.monotonic()
        found = await at_once(calls)
        for failed in ("file_error", "directory_error"):
            if failed in found:
                raise found[failed]
        is_file, is_dir = found.get("file") is not None, bool(found.get("directory"))
        if is_dir or (is_file and directory):
            # Another writer made it since this mount found the name free: this mount then shows what is there (the
            # directory, where both are, as a lookup does), as of this answer (B651).
            self.ns.found_in_bucket(path, (True, None) if is_dir else (False, found["file"]), asked)
        elif is_file:
            self.ns.found_in_bucket(path)  # a directory of its name, not asked for, would win: looked up again
        return is_file, is_dir

    def _refuse_beside(self, path: str, is_dir: bool, err: int) -> NoReturn:
        """`err` for a file where the bucket holds a directory of its name (it would be stored and never seen), or
        a directory where it holds a file (it would hide the file); this mount shows what is there (`_in_bucket`)."""
        log.warning("%s: a %s of that name is in the bucket (made since this mount listed its directory)", path,
                    "directory" if is_dir else "file")
        raise PathError(err)

    async def create(self, parent: Node, name: bytes,
                     flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> NewFile | None:
        """A new file at `name` (the kernel sends CREATE for a name it holds no entry of), or None where the bucket
        holds a file there that another writer stored since this mount found the name free: the caller opens that
        file as an OPEN with `flags` would (a touch of an empty one, a rewrite with O_TRUNC, ...), as O_CREAT without
        O_EXCL does on a local disk. Before, such a create was EPERM, or with --allow-overwrite replaced the object
        with only what was written (an appender's `open(p, "a")` lost the file's bytes)."""
        path = self.ns.child_path(parent, name)
        pending = self.ns.pending(path)
        if pending is not None:
            if flags & os.O_EXCL:
                raise PathError(errno.EEXIST)
            self.busy(path, self._files.get(pending.ino), "an open to write it")
        self._not_an_upload_of_another(path)
        # The HEAD goes with the directory's listing: without --allow-overwrite nothing may replace a key, and with it
        # only a create that truncates may, without asking (an O_EXCL create must fail on a file that is there).
        head = not self.allow_overwrite or not flags & os.O_TRUNC or bool(flags & os.O_EXCL)
        is_file, is_dir = await self._in_bucket(path, file=head, directory=True)
        if is_dir:  # as a local disk answers: O_EXCL (and mknod) EEXIST, the name being there; else EISDIR
            self._refuse_beside(path, True, errno.EEXIST if flags & os.O_EXCL else errno.EISDIR)
        if is_file:  # (looked up again, it is found, `_in_bucket`: a rename onto it refused as such)
            if flags & os.O_EXCL:
                raise PathError(errno.EEXIST)
            return None
        new = self._start(self.ns.begin_file(path))
        if flags & os.O_EXCL:
            new.excl_key = self.key_of(new.node)  # the HEAD above is not atomic: its store is create-only
        return new

    async def open_existing(self, node: Node, flags: int) -> NewFile | None:
        """An open for writing of a stored file: only a whole rewrite (O_TRUNC, or an empty file, appended to or
        not). Without --allow-overwrite, one of an empty file that does not append is a touch (None: opened as for
        reading, so nothing is stored at its close, and its writes fail with EPERM, `refuse_write`): lock files are
        opened so (filelock, under `hf_hub_download(local_dir=...)`: O_RDWR of the empty lock file its first lock
        stored), and so are markers.
        A rewrite without O_TRUNC, which keeps nothing of the file only because it is empty (an append, `r+b`), asks
        the bucket first whether it still is, whatever the TTL: another writer may have stored bytes at the key since
        this mount listed it, and the rewrite replaced them unseen (an appender's `open(p, "ab")` of a log another node
        had written since: B299). The bucket holding another version (or none), the inode is superseded and the
        open ESTALE: the kernel looks the path up again and opens what the bucket holds now (with bytes, refused as
        any file with bytes is). Its store at close is then If-Match on the version it opened (`NewFile.if_version`):
        bytes another writer stored (or a delete) between this open and its close fail the close with EIO, and are
        kept (a server that refuses If-Match itself gets the plain store, one warning). An O_TRUNC rewrite keeps
        nothing of the old version and replaces whatever is there at its close, as on a local disk."""
        if node.is_dir:
            raise PathError(errno.EISDIR)
        if self.allow_overwrite and node.size == 0 and not flags & os.O_TRUNC:
            # First: the checks below hold after this await (two appenders at once, both past a check made before it,
            # both started a file of one inode).
            node = await self.ns.refresh(node, opening=True, force=True)
            if node.superseded:
                raise PathError(errno.ESTALE)
        if node.writing:
            self.busy(node.path, self._files.get(node.ino), "an open to write it")
        self._not_an_upload_of_another(node.path)
        if not self.allow_overwrite and node.size == 0 and not flags & os.O_APPEND:
            return None  # (an appender is a writer: a logger opened so lost every record, each write a warning)
        if flags & os.O_APPEND and not flags & os.O_TRUNC and node.size > 0:
            # The flag would not let it append either, so the warning says what would work. (An append to an empty
            # file writes it whole from its start, a rewrite: with the flag it is one, below; and so is one that
            # truncates, B300.)
            log.warning("%s: appending to an existing file is not supported (S3 objects cannot be appended to); only "
                        "whole rewrites (O_TRUNC) are%s", node.path,
                        "" if self.allow_overwrite else ", and one needs --allow-overwrite")
            raise PathError(errno.EOPNOTSUPP if self.allow_overwrite else errno.EPERM)
        if not self.allow_overwrite:
            # `touch` of a stored file opens it for writing without O_TRUNC, then sets its times by path: it
            # replaces nothing, so it is not worth a warning (it still gets EPERM, as any such open does).
            log.log(logging.WARNING if flags & (os.O_TRUNC | os.O_APPEND) else logging.INFO,
                    "%s exists; replacing it needs --allow-overwrite%s", node.path,
                    "" if flags & os.O_TRUNC or node.size == 0 else ", and only whole rewrites (O_TRUNC) are supported")
            raise PathError(errno.EPERM)
        if not (flags & os.O_TRUNC or node.size == 0):
            # `touch` of a stored file opens it this way too, then sets its times by path (and succeeds): a
            # warning at each one was noise.
            log.info("%s: only whole rewrites (O_TRUNC) of existing files are supported", node.path)
            raise PathError(errno.EOPNOTSUPP)
        path = node.path
        etag = sent_etag(node.etag)
        new = self._start(self.ns.begin_file(path, node))
        new.replaces, new.replaced = path, node
        if not flags & os.O_TRUNC and etag:
            # It keeps the bytes of the version it opened (none: it is empty), so it is stored only over that
            # version: bytes another writer stored under the key since this open were replaced at its close (B308).
            new.if_version = (self.ns.key_of(path), etag)
        return new

    def refuse_truncate(self, node: Node, size: int) -> NoReturn:
        """A truncate of a stored file (`truncate -s`, an `ftruncate` through a descriptor that does not write it):
        EOPNOTSUPP, and a warning that says what works instead (it was said nowhere, even at debug level: B881)."""
        if node.is_dir:
            raise PathError(errno.EOPNOTSUPP)
        log.warning("%s: a truncate of a stored file (to %d bytes from %d) is not supported: S3 objects cannot be "
                    "changed in place; rewrite it whole (an open with O_TRUNC%s)", node.path, size, node.size,
                    "" if self.allow_overwrite else ", which needs --allow-overwrite")
        raise PathError(errno.EOPNOTSUPP)

    def refuse_kind(self, what: str, parent_inode: int, name: bytes) -> None:
        """Say why a symlink, a hard link, a FIFO (`what`) made at `name` in `parent_inode` is refused (the caller's
        EPERM): S3 has none. It was said nowhere, even at debug level (B883: `ln -s step-100 latest`). At info level
        for the first of each kind, the others at debug level: not a warning, since healthy tools probe for links and
        carry on without them (git links each new object file and renames it where link fails, huggingface_hub tries a
        symlink to choose its cache layout, conda hard-links and copies instead), and their jobs' logs got a warning
        for what they handle (B980). The set holds at most the three kinds."""
        try:
            path = self.ns.child_path(self.ns.node(parent_inode), name)
        except PathError:
            path = name.decode(errors="replace")
        said = what in self._kinds_refused
        self._kinds_refused.add(what)
        log.log(logging.DEBUG if said else logging.INFO,
                "%s: %s are not supported (S3 has none): EPERM%s", path, what,
                "" if said else " (further ones are logged at debug level)")

    def refuse_write(self, node: Node) -> None:
        """A write through a touch of an empty stored file (`open_existing`): EPERM, as its open was before."""
        log.warning("%s exists; replacing it needs --allow-overwrite", node.path)
        raise PathError(errno.EPERM)

    def _not_an_upload_of_another(self, path: str, node: Node | None = None) -> None:
        """EBUSY while a file renamed away from `path` as it was written (not `node`) has its multipart upload under
        `path`'s key: an upload cannot be renamed, so at its close it is completed there, copied to the file's name,
        and that key deleted. A file stored under the name meanwhile (a log rotated while written, and a new one
        created) was overwritten by that completion and deleted by the move (with --allow-overwrite), or failed the
        renamed file's close (create-only)."""
        key = self.ns.key_of(path)
        for new in self._files.values():
            if new.upload_key == key and new.node is not node:
                log.warning("%s: %s, renamed from it while it was written, still uploads under this name until it is "
                            "closed: busy until then", path or "/", new.node.path)
                raise PathError(errno.EBUSY)

    def _start(self, node: Node) -> NewFile:
        new = NewFile(self, node, self.part_size)
        self._files[node.ino] = new
        return new

    async def abort_all(self) -> None:
        """At unmount: the uploads of files never closed are aborted."""
        files = list(self._files.values())
        self._not_stored(files, "stopped")
        # All at once: each abort waits up to ABORT_TIMEOUT_S, shielded, so one after another N stalled ones took N
        # times that, past the stop's budget (a helper's reading).
        with trio.move_on_after(ABORT_ALL_S):
            async with trio.open_nursery() as nursery:
                for new in files:
                    nursery.start_soon(new.abort)
        if self._open:
            keys = sorted({key for new in self._open if (key := new.upload_key) is not None})
            log.warning("%d uploads could not be aborted at unmount; `%s` removes them", len(self._open),
                        cleanup_command(self._origin, keys))

    @staticmethod
    def _not_stored(files: list[NewFile], end: str) -> None:
        """The warning for each file still being written as the mount ended (`end`: "stopped", "failed"). One whose
        close was cut short once its last request was sent may be stored all the same, that request landing in its
        abandoned thread before the end's abort: said so, not "not stored" (B154)."""
        for new in files:
            if new.unlinked:
                continue
            if new.storing:
                log.warning("%s was being stored when the mount %s (its close was cut short): the bucket may or may "
                            "not hold it (%d bytes written)", new.node.path, end, new.written)
            else:
                log.warning("%s was still being written when the mount %s: it is not stored (%d bytes written; its "
                            "upload is aborted)", new.node.path, end, new.written)

    async def abort_after_failure(self) -> None:
        """Where a task of the mount failed (or the loop did): the uploads of files still open, aborted straight
        through the store, each in a thread of its own, all within ABORT_ALL_S (B147). Not through `abort_all`: a
        file's abort there goes through `call`, whose limiter the abandoned threads of its parts may hold (the writes'
        tasks are cancelled with the mount's nursery, and a part's request goes on in its thread), and it discards
        the local copy first in line behind a stalled cache disk's writes; the next mount of the cache dir removes
        those copies. A part that lands after the abort fails (the upload is gone). A file whose own abort was under
        way keeps it (shielded, bounded, with its own warning)."""
        self._not_stored(list(self._files.values()), "failed")
        taken = [(new, upload) for new in list(self._open) if (upload := new.take_upload()) is not None]
        if not taken:
            return
        threads = trio.CapacityLimiter(len(taken))  # none of them waits for a thread another task left behind
        # upload id -> (key, why it is not aborted yet)
        left = {upload_id: (key, f"no answer in {ABORT_ALL_S:g} s") for _, (key, upload_id) in taken}

        async def abort(new: NewFile, key: str, upload_id: str) -> None:
            try:
                await trio.to_thread.run_sync(within, time.monotonic() + ABORT_ALL_S, self.uploads.abort, key,
                                              upload_id, limiter=threads, abandon_on_cancel=True)
            except Exception as exc:  # noqa: BLE001 - one upload left, said below; the mount's own error goes out
                left[upload_id] = (key, exc.message if isinstance(exc, StoreError) else repr(exc))
                return
            del left[upload_id]
            self.unregister(new)

        with trio.move_on_after(ABORT_ALL_S):
            async with trio.open_nursery() as nursery:
                for new, (key, upload_id) in taken:
                    nursery.start_soon(abort, new, key, upload_id)
        for key, reason in sorted(left.values()):
            log.warning("the upload of %s could not be aborted after the mount's failure (%s); `%s` removes it", key,
                        reason, cleanup_command(self._origin, [key]))

    # -- directories and names -------------------------------------------------------------------

    async def mkdir(self, parent: Node, name: bytes) -> Node:
        path = self.ns.child_path(parent, name, is_dir=True)
        is_file, is_dir = await self._in_bucket(path, file=True, directory=True)
        if is_file:
            self._refuse_beside(path, False, errno.EEXIST)
        if is_dir:
            # Made by another writer since this mount found the name free: EEXIST, as a local mkdir of an existing
            # directory (a `mkdir` taken as a lock by two nodes: both got it, the second putting the marker again).
            raise PathError(errno.EEXIST)
        # Its answer cut short or lost, the marker may be stored all the same: the bucket is asked (B167), as a
        # directory's rename does (B164). Failed for that, the directory was made and the retry got EEXIST.
        marker = self.ns.dir_key(path)
        await self.last_request(marker, lambda: put_etag(b""), self.uploads.put, marker, b"")
        node = self.ns.dir_added(path)
        self._written.add(node.ino)  # its marker: a rename deletes it, which needs no --allow-delete then
        return node

    async def unlink(self, node: Node) -> None:
        if node.is_dir:
            raise PathError(errno.EISDIR)
        new = self._files.get(node.ino) if node.writing else None
        if new is not None and new.replaces is not None:
            # A rewrite: dropping its upload left the object it replaces, which came back with its old bytes (the
            # audit). That object goes first: should its delete fail, the rewrite is still there (the review).
            if not self.allow_delete:
                self._refuse_delete(node.path)
            await self.call(self.uploads.delete, self.ns.key_of(new.replaces))
            self.stats.deletes += 1
            replaced, new.replaces, new.replaced = new.replaces, None, None
            self.ns.removed(replaced, is_dir=False)
        if new is not None and await new.unlink():
            return
        if not self.allow_delete:
            self._refuse_delete(node.path)
        await self.call(self.uploads.delete, self.ns.key_of(node.path))
        self.ns.removed(node.path, is_dir=False)
        self.stats.deletes += 1

    def _refuse_delete(self, path: str) -> NoReturn:
        """EPERM, said once in the log: a trainer's checkpoint rotation (shutil.rmtree) failed with EPERM and
        no hint why, where a refused overwrite names its flag."""
        log.log(logging.DEBUG if self._delete_refusal_logged else logging.WARNING,
                "deleting %s needs --allow-delete%s", path or "/",
                "" if self._delete_refusal_logged else " (further refusals are logged at debug level)")
        self._delete_refusal_logged = True
        self.stats.deletes_refused += 1
        raise PathError(errno.EPERM)

    async def rmdir(self, node: Node) -> None:
        if not self.allow_delete:
            self._refuse_delete(node.path)
        if not node.is_dir:
            raise PathError(errno.ENOTDIR)
        if not node.path:
            raise PathError(errno.EBUSY)
        if not await self.ns.dir_is_empty(node):
            raise PathError(errno.ENOTEMPTY)
        # The marker mkdir made, if any; SeaweedFS also keeps an emptied directory until this delete.
        await self.call(self.uploads.delete, self.ns.dir_key(node.path))
        self.stats.deletes += 1
        self.ns.removed(node.path, is_dir=True)

    async def rename(self, node: Node, new_parent: Node, new_name: bytes, target: Node | None, flags: int) -> None:
        if flags & RENAME_EXCHANGE:
            raise PathError(errno.EINVAL)
        path = self.ns.child_path(new_parent, new_name, is_dir=node.is_dir)
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise PathError(errno.EEXIST)
            if target.is_dir != node.is_dir:
                raise PathError(errno.EISDIR if target.is_dir else errno.ENOTDIR)
            if target.writing:
                self.busy(path, self._files.get(target.ino), f"a rename of {node.path or '/'} onto it")
            if not self.allow_overwrite:
                log.warning("rename onto %s: replacing it needs --allow-overwrite", path)
                raise PathError(errno.EPERM)
            # A directory replaces an empty one, as rename(2) does (`mv new old` of two empty run directories was
            # EISDIR): its marker is put where the other's was.
            if target.is_dir and not await self.ns.dir_is_empty(target):
                raise PathError(errno.ENOTEMPTY)
        else:
            # A name this mount knows nothing at: a file, or directory, of the other kind that another mount made
            # there would hide, or be hidden by, what is renamed. With RENAME_NOREPLACE (`mv -n`) one of the same kind
            # is asked for too: it was replaced, with --allow-overwrite, where it must be left (EEXIST).
            # Without --allow-overwrite a file's rename asks for a file there too: found at the create-only copy's
            # completion instead, it was EIO, where a rename onto a name this mount knows is EPERM.
            noreplace = bool(flags & RENAME_NOREPLACE)
            is_file, is_dir = await self._in_bucket(path, file=node.is_dir or noreplace or not self.allow_overwrite,
                                                    directory=not node.is_dir or noreplace)
            if noreplace and (is_file or is_dir):
                raise PathError(errno.EEXIST)
            if is_file and not node.is_dir:
                log.warning("rename onto %s: replacing it needs --allow-overwrite", path)
                raise PathError(errno.EPERM)
            if is_file or is_dir:
                self._refuse_beside(path, is_dir, errno.EISDIR if is_dir else errno.ENOTDIR)
        if not node.is_dir:
            self._not_an_upload_of_another(path, node)
        new = self._files.get(node.ino) if node.writing else None

        async def move_pending() -> None:
            assert new is not None
            theirs_left = None  # the old name, where another writer's object stays (B371)
            if new.replaces is not None:
                # The rename deletes the object the rewrite replaces: unchecked, `rm` of the new name (which deletes
                # nothing of the bucket) then removed any object with --allow-overwrite alone (the review).
                self._check_rename_deletes(new.replaced or node)
                # A rewrite (O_TRUNC) renamed before its close: its upload goes to the new name, and the old object
                # would stay, its old bytes back under the old name after the TTL (the audit). It goes now, as its
                # bytes went at the open for any other file system.
                key = self.ns.key_of(new.replaces)
                if new.if_version is not None and new.if_version[0] == key:
                    # A rewrite that keeps the version it opened: only that version goes. Deleted plain, what another
                    # writer stored under the old name since the open went with it, unseen (B371).
                    if await self.call(self.uploads.delete_version, key, new.if_version[1]):
                        new.if_version = None  # the version it kept is deleted: stored as a rename stores
                    else:
                        # Kept on: an upload begun under the old key is completed there only over that version (the
                        # close EIO, the other writer's object left); stored under the new name, it has no effect.
                        log.warning("rename of %s: another writer stored %s since this rewrite opened it: its object "
                                    "is left under the old name", new.replaces, key)
                        theirs_left = new.replaces
                else:
                    await self.call(self.uploads.delete, key)
                if new.replaced is not node:  # a file it was renamed onto (a rewrite's own node moves below)
                    self.ns.removed(new.replaces, is_dir=False)
                new.replaces = new.replaced = None
            self.ns.move_pending(node, path)
            if theirs_left is not None:
                self.ns.found_in_bucket(theirs_left)
            if new.if_version is not None and new.if_version[0] == self.ns.key_of(path):
                new.if_version = None  # renamed back to its name: it replaces what is there, as any rename does
            if target is not None:
                # Renamed onto a stored file, which it now is in this mount: that object stays in the bucket until this
                # one is stored under the name, and goes as a rewrite's does if this one is renamed away or unlinked
                # first (its old bytes came back under the name, after an `rm` that had returned 0: a fuzzer).
                new.replaces, new.replaced = path, target

        if node.is_dir:
            await self._rename_dir(node, path, replaces=target is not None)
        elif new is not None and await new.rename(move_pending):
            pass
        else:
            self._check_rename_deletes(node)
            old = ObjectMeta(self.ns.key_of(node.path), node.size, node.etag, node.mtime_ns)
            meta = await self.move_object(old, self.ns.key_of(path))
            self.ns.moved(node, path, meta)
            self.recache(ObjectVersion(old.key, old.etag, old.size), ObjectVersion(meta.key, meta.etag, meta.size))
        self.stats.renames += 1

    def _check_rename_deletes(self, node: Node) -> None:
        """EPERM for a rename that deletes an object this mount did not write, without --allow-delete."""
        if node.ino not in self._written and not self.allow_delete:
            log.warning("rename of %s: a %s this mount did not write needs --allow-delete", node.path,
                        "directory" if node.is_dir else "file")
            self.stats.deletes_refused += 1
            raise PathError(errno.EPERM)

    async def _rename_dir(self, node: Node, path: str, *, replaces: bool) -> None:
        """`replaces`: an empty directory is at `path` (its marker, if any, is the key put here)."""
        if not await self.ns.dir_is_empty(node):
            log.warning("rename of %s: a directory with anything in it is not renamed (EXDEV)", node.path)
            raise PathError(errno.EXDEV)
        # Its marker is deleted below: another's needs --allow-delete, as a file's does (a fuzzer: it went without).
        self._check_rename_deletes(node)
        # Its answer cut short or lost, the marker may be stored all the same: the bucket is asked (B164).
        marker = self.ns.dir_key(path)
        await self.last_request(marker, lambda: put_etag(b""), self.uploads.put, marker, b"")
        await self.call(self.uploads.delete, self.ns.dir_key(node.path))
        if replaces:
            self.ns.removed(path, is_dir=True)
        self.ns.dir_moved(node, path)

    async def move_object(self, meta: ObjectMeta, key: str) -> ObjectMeta:
        """Copy an object to `key` on the server, then delete the old key if it still holds that object (another
        mount may have stored a file under the old name meanwhile: the unconditional delete removed it); the new
        object's metadata. Without --allow-overwrite the copy is create-only (`Exists` if another writer stored `key`
        meanwhile; the old key is then left as it is, for the caller to decide)."""
        # The version copied and deleted as a request may pin it: none for one the server gave no ETag for, whose tag
        # (`store.version_tag`) no server knows (its DELETE was refused as another writer's, and both names stayed).
        meta = dataclasses.replace(meta, etag=sent_etag(meta.etag))
        if self.create_only and meta.size == 0:
            # Nothing to copy. Its answer cut short or lost, the PUT may be done all the same: the bucket is asked.
            etag = await self.last_request(key, lambda: put_etag(b""), self.uploads.put, key, b"", True)
        elif self.create_only or meta.size > COPY_OBJECT_MAX or (
                meta.size > COPY_PART_MIN and self._max_connections > 1):
            etag = await self._copy_in_parts(meta, key)
        else:
            etag = await self.call(self.uploads.copy, meta.key, meta.etag, key)
        try:
            if meta.etag:
                if not await self.call(self.uploads.delete_version, meta.key, meta.etag):
                    log.warning("%s was copied to %s; another writer has stored a new %s since: it is left as it is",
                                meta.key, key, meta.key)
            else:  # a server that gives no ETag: nothing to ask for
                await self.call(self.uploads.delete, meta.key)
        except StoreError as exc:
            # The object is under its new name: the rename is done, and a leftover is no reason to fail it. Failed,
            # the caller got EIO for a file stored all the same (a retry of the rename then found the name taken;
            # a close of a file renamed while written: a trainer retrying the save got EPERM).
            log.warning("%s was copied to %s, but could not be deleted (%s): it is left in the bucket", meta.key, key,
                        exc.message)
        return ObjectMeta(key, meta.size, etag, time.time_ns())

    async def _copy_in_parts(self, meta: ObjectMeta, key: str) -> str:
        size = min(MAX_PART_SIZE, max(COPY_PART_MIN, math.ceil(meta.size / self._max_connections),
                                      math.ceil(meta.size / MAX_PARTS)))
        ranges = [(start, min(start + size, meta.size)) for start in range(0, meta.size, size)]
        upload_id = await self.call(self.uploads.start, key)
        etags: dict[int, str] = {}
        failures: list[StoreError] = []

        async def one(number: int, start: int, end: int) -> None:
            try:
                etags[number] = await self.call(self.uploads.copy_part, key, upload_id, number, meta.key,
                                                meta.etag, start, end)
            except StoreError as exc:
                failures.append(exc)

        finished = False
        try:
            async with trio.open_nursery() as nursery:
                for number, (start, end) in enumerate(ranges, 1):
                    nursery.start_soon(one, number, start, end)
            if failures:
                raise failures[0]
            parts = [etags[i] for i in range(1, len(ranges) + 1)]
            # Its answer cut short or lost, the copy may be made all the same: the bucket is asked (B163).
            etag = await self.last_request(key, lambda: multipart_etag(parts), self.uploads.finish, key, upload_id,
                                           parts, self.create_only)
            finished = True
            return etag
        finally:
            if not finished:
                await self.abort_upload(key, upload_id)
