"""The FUSE request handlers: the one place that speaks FUSE, a thin pyfuse3 adapter over the namespace,
the handles and the engine.

Handlers only translate: arguments in, replies (EntryAttributes built from the namespace's plain nodes)
out, and every failure into `FUSEError` in one place (`_fuse_errors`). No semantics live here: which
version an open reads and when it is stale are the namespace's rules, what a writable mount may change
is writes.py's. Nothing but `FUSEError` ever leaves a handler. Without `--writable` every request that
would change something fails with EROFS.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import functools
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import cachetools
import pyfuse3
import trio

from fsmount import holders
from fsmount.data import ChunkEngine, NotFound, PreconditionFailed, StoreError
from fsmount.handles import OpenFile
from fsmount.namespace import DirEntry, Namespace, Node, PathError
from fsmount.new_file import NewFile
from fsmount.pagecache import SETTLE_WAIT_S, PageCachePusher
from fsmount.stats import STATS_XATTR
from fsmount.streaming import ModelStreamer
from fsmount.writes import Writes

log = logging.getLogger(__name__)

T = TypeVar("T")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT
# A listing starts with '.' and '..' (`ls -a`, and programs that count on them), then the directory's entries.
DOT_ENTRIES = 2


# How long a READ that found its version gone (or a close whose file could not be stored) waits for the kernel to
# drop the name's entry before it answers EIO. The wait is what orders the two: sent asynchronously, a stat right
# after the EIO could still find the entry (with `--metadata-ttl forever`, for good) and see a deleted file (a
# clean-clone run). Bounded because the kernel takes the directory's lock first, which a lookup or listing of that
# directory may hold meanwhile.
INVALIDATE_WAIT_S = 2.0
# Threads dropping kernel entries at once, at most (`_drop_entry`).
DROP_THREADS = 4
# How long the stop waits for the calls into the FUSE session still under way in worker threads (SessionCalls)
# before it closes the session; as long again once it aborted the connection for them.
SESSION_CALLS_S = 2.0


# What statfs reports for a writable mount (in 1 MiB blocks): a bucket has no size.
UNLIMITED_BLOCKS = 1 << 40
UNLIMITED_FILES = 1 << 32


# Failure messages logged as warnings in the last REPEAT_QUIET_S. The kernel sends a failed READ again at once,
# and the READs of one stalled file fail together with the same message: a repeat goes to debug. Only the trio
# thread touches it.
REPEAT_QUIET_S = 10.0
REPEATS_KEPT = 64
_warned: cachetools.TTLCache[str, None] = cachetools.TTLCache(REPEATS_KEPT, REPEAT_QUIET_S)


# FUSE requests answered with an error from a StoreError (the origin's, a cache's), by handler: the one daemon of
# this process counts them here, and `modelfs stats` shows them (MountStats.failed). Trio thread only.
FAILED: collections.Counter[str] = collections.Counter()


# Durations in a failure's message ("did not answer 0.3s ago ... asked again in 4.7s"): a repeat is the same message
# with other seconds. Compared as written, no two lookups failed at once during an outage were repeats: two loaders
# polling through a 4 s restart logged 22 warnings (a tester).
_SECONDS = re.compile(r"\d+(?:\.\d+)?s\b")


def _log_failure(handler: str, exc: StoreError) -> None:
    """One warning per failure: not for an error a failed fetch already logged, nor a message just logged."""
    message = f"{handler} failed: {exc.message}"
    repeat = _SECONDS.sub("Ns", message)
    if exc.reported or repeat in _warned:
        log.debug("%s", message)
        return
    exc.reported = True
    _warned[repeat] = None
    log.warning("%s", message)


def _invalidate_pages(ino: int) -> None:
    """Drop the kernel's cached pages and attributes of an inode (blocking: run it in a worker thread)."""
    try:
        pyfuse3.invalidate_inode(ino, attr_only=False)
    except OSError as exc:  # ENOENT: the kernel holds nothing of it
        log.debug("dropping the cached pages of inode %d: %s", ino, exc)


def _invalidate_entry(parent: int, name: bytes) -> None:
    """Drop the kernel's entry of `name` in directory `parent` (blocking: run it in a worker thread, never in the
    trio thread, which must go on answering the requests the kernel may be waiting on)."""
    try:
        pyfuse3.invalidate_entry(parent, name)
    except OSError as exc:  # ENOENT: the kernel holds no such entry
        log.debug("dropping the kernel's entry of %r: %s", name, exc)


class SessionCalls:
    """The calls into the FUSE session (pyfuse3.invalidate_*) that worker threads make, which the loop may stop
    waiting for: a drop of a kernel entry waits for the directory's lock, which a request in flight may hold, and is
    given up on after INVALIDATE_WAIT_S, its thread left to end on its own. pyfuse3.close frees the session and closes
    its descriptor whatever such a thread does in it: a call still in libfuse as the stop closed the session read
    freed memory, or wrote its message to whatever file took the descriptor's number (B124). `end`, before the close,
    makes every later call a no-op and waits, bounded, for those under way. The drops that cannot wait go to one
    thread of this mount's, in order (pyfuse3's invalidate_entry_async has a thread of its own that nothing can wait
    for), which outlives a call that fails. Shared between the trio thread and the workers: every field under `_cond`
    (but `_failure_logged`, the queue's thread's alone)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0  # calls under way
        self._ending = False
        self._queued: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self._worker: threading.Thread | None = None
        self._failure_logged = False  # the queue's thread's own: a call of it failed unexpectedly (logged once)

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` in this thread, unless the session is ending (blocking: in a worker thread)."""
        with self._cond:
            if self._ending:
                return
            self._running += 1
        try:
            fn(*args)
        finally:
            self._done()

    def queue(self, fn: Callable[..., None], *args: Any) -> None:
        """`fn(*args)` in the queue's thread, after those queued before; for a caller that cannot wait."""
        with self._cond:
            if self._ending:
                return
            self._queued.append((fn, args))
            self._cond.notify_all()
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve_queue, name="fuse-notify", daemon=True)
                self._worker.start()

    def end(self, timeout: float) -> bool:
        """No call starts from now on (those queued are dropped); whether none is under way, within `timeout`."""
        with self._cond:
            self._ending = True
            self._queued.clear()
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._running == 0, timeout)

    def _serve_queue(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued or self._ending)
                if self._ending:
                    return
                fn, args = self._queued.popleft()
                self._running += 1  # with the pop, under the lock: `end` cannot miss it
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one failed call must not end the thread every later drop waits for
                # An OSError the call took itself; anything else ended this thread, and the drops queued after it
                # were never run, held until the stop (B126).
                log.log(logging.DEBUG if self._failure_logged else logging.ERROR,
                        "a call into the FUSE session failed unexpectedly (later ones are logged at debug level)",
                        exc_info=True)
                self._failure_logged = True
            finally:
                self._done()

    def _done(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()


async def _drop_entry(entry: tuple[int, bytes], threads: trio.CapacityLimiter, calls: SessionCalls) -> None:
    """Have the kernel drop the entry (parent inode, name) before the request under way is answered: at most
    INVALIDATE_WAIT_S, in one of `threads`. A thread given up on keeps its token until the kernel lets it go: on
    trio's shared limiter, 40 of them stuck on a busy directory's lock held up every other thread of the mount (the
    review). With none free, the drop is queued to `calls`'s thread, unordered with the answer."""
    if threads.available_tokens == 0:
        calls.queue(_invalidate_entry, *entry)
        return
    with trio.move_on_after(INVALIDATE_WAIT_S):
        await trio.to_thread.run_sync(calls.call, _invalidate_entry, *entry, limiter=threads, abandon_on_cancel=True)


def _fuse_errors(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., Coroutine[Any, Any, T]]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except PathError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        except StoreError as exc:
            FAILED[fn.__name__] += 1
            _log_failure(fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except Exception:  # noqa: BLE001 - a bug must cost one request, never the mount
            log.exception("%s failed unexpectedly", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def _unsupported(name: str, what: str, new_at: int) -> Callable[..., Coroutine[Any, Any, Any]]:
    """What no mount does (S3 has no such thing): EROFS on a read-only mount, EPERM on a writable one, said in the
    log (`Writes.refuse_kind`). The handler's arguments `new_at` and the next are the new name's directory and name."""
    async def handler(self: Operations, *args: Any) -> Any:
        if self.writes is None:
            raise pyfuse3.FUSEError(errno.EROFS)
        self.writes.refuse_kind(what, args[new_at], args[new_at + 1])
        raise pyfuse3.FUSEError(errno.EPERM)

    handler.__name__ = name
    return _fuse_errors(handler)


def _writable(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., Coroutine[Any, Any, T]]:
    """A handler that changes the tree: EROFS unless the mount is --writable."""
    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> T:
        if self.writes is None:
            raise pyfuse3.FUSEError(errno.EROFS)
        return await fn(self, *args)

    return _fuse_errors(wrapper)


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who owns every file and directory of the mount, and their permission bits."""

    uid: int
    gid: int
    file_mode: int
    dir_mode: int


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, namespace: Namespace, engine: ChunkEngine, streamer: ModelStreamer,
                 pusher: PageCachePusher, *, max_readahead: int, owner: Owner, kernel_window: int = 0,
                 stats: Callable[[], bytes] | None = None, writes: Writes | None = None):
        super().__init__()
        self.writes = writes
        self.stats = stats
        self.ns = namespace
        self.engine = engine
        self.streamer = streamer
        self.pusher = pusher
        self.max_readahead = max_readahead
        self.kernel_window = kernel_window  # the kernel's read-ahead window on this mount (read_ahead_kb)
        self.owner = owner
        self._mount_time_ns = time.time_ns()
        self._files: dict[int, OpenFile] = {}
        # Handles of `_files` by inode (a GETATTR of an inode held open does not wait for its HEAD: `getattr`); counted
        # at open and release, the only places a handle is added or removed (a rewrite's swap keeps its inode).
        self._held: collections.Counter[int] = collections.Counter()
        # fh -> (inode, snapshot at opendir, when its listing began)
        self._dirs: dict[int, tuple[int, list[DirEntry], float]] = {}
        self._dirs_read: set[int] = set()  # directory handles that had a readdir (a later one at 0 is a rewind)
        self._writers: dict[int, NewFile] = {}  # fh -> the file it writes
        self._next_fh = 1
        self._drop_threads = trio.CapacityLimiter(DROP_THREADS)
        self.session_calls = SessionCalls()  # ended by the stop before it closes the session
        # READs refused because the bucket no longer holds the version open (`Namespace.gone`): counted in the trio
        # thread, read by the stats snapshot's threads (an int, read whole).
        self.versions_gone = 0
        # This mount's device number (st_dev), set once it answers: which of a process's descriptors are on it
        # (holders.py). Inode numbers alone repeat across mounts.
        self.device: int | None = None
        # Threads (their ids, as FUSE requests name them) of this daemon that open files through the mount to
        # ask the page cache what it holds (mount.Daemon.resident): their opens start no stream. Added and
        # discarded by those threads themselves (one set operation each, atomic under the GIL); read here.
        self.probes: set[int] = set()

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    @property
    def open_files(self) -> int:
        return self.readers + self.writers

    @property
    def writers(self) -> int:
        """Files open for writing."""
        return len(self._writers)

    @property
    def readers(self) -> int:
        """Handles open for reading: each may have a kernel window of READs requested."""
        return len(self._files)

    # -- metadata ------------------------------------------------------------------------------

    def _attributes(self, node: Node) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = node.ino
        attr.generation = 0
        # What the kernel may keep without asking: a file's version, or that a directory is there, only for what is
        # left of the TTL of the answer that said so (it may come from a listing made a while ago, or a directory
        # handle's), so that a stat sees a change within one TTL, not two; a version the bucket no longer holds not
        # at all (a directory handle opened before the change names it: its stat showed the old size for good with
        # `forever`).
        timeout = self.ns.ttl
        if node.superseded and not node.is_dir:
            timeout = 0.0
        elif not node.writing and node.ino != pyfuse3.ROOT_INODE:
            timeout = min(timeout, max(0.0, node.fresh_until - time.monotonic()))
        attr.entry_timeout = attr.attr_timeout = timeout
        if node.writing:
            # Its size and time are those of its last write until it is stored, then the stored version's: kept,
            # the attributes a SETATTR answered (a `touch -d`, a writer's futime) showed its create time after its
            # close, and its stored time a TTL later (for good with `forever`), nothing done to it meanwhile.
            attr.attr_timeout = 0.0
        if node.is_dir:
            attr.st_mode = stat.S_IFDIR | self.owner.dir_mode
            attr.st_nlink = 2
            attr.st_size = 0
            mtime = self._mount_time_ns
        else:
            attr.st_mode = stat.S_IFREG | self.owner.file_mode
            attr.st_nlink = 1
            attr.st_size = node.size
            mtime = node.mtime_ns or self._mount_time_ns
        attr.st_uid = self.owner.uid
        attr.st_gid = self.owner.gid
        attr.st_blksize = 1 << 20
        attr.st_blocks = (attr.st_size + 511) // 512
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = mtime
        return attr

    @_fuse_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attributes(await self.ns.lookup(parent_inode, name))

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        try:
            for ino, count in inode_list:
                self.ns.forget(ino, count)
        except Exception:  # noqa: BLE001 - forget must never raise
            log.exception("forget failed")

    @_fuse_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        await self._settle(inode)  # an empty file closed: stored at its RELEASE, just sent
        node = self.ns.node(inode)
        if self._held[inode]:
            # Held open, its descriptors read the version they opened whatever the bucket holds now: the kernel's
            # GETATTR before their READs (attributes past the TTL) is answered at once (Namespace.refresh_held).
            return self._attributes(await self.ns.refresh_held(node))
        # Not held: its HEAD past the TTL is waited for a second at most, going on behind (Namespace.refresh_known).
        return self._attributes(await self.ns.refresh_known(node))

    @_fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = 1 << 20
        st.f_namemax = 255
        if self.writes is not None:
            # A bucket has no size: report room to spare (1 EiB, 2^32 files), or a writer that checks free
            # space first (shutil.disk_usage, df) refuses to save a checkpoint at all.
            st.f_blocks = st.f_bfree = st.f_bavail = UNLIMITED_BLOCKS
            st.f_files = st.f_ffree = st.f_favail = UNLIMITED_FILES
        return st

    @_fuse_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        # The stats of `modelfs stats`; deliberately not listed by listxattr (see stats.STATS_XATTR).
        if name == STATS_XATTR and inode == pyfuse3.ROOT_INODE and self.stats is not None:
            return self.stats()
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    @_fuse_errors
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return []

    @_fuse_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        raise pyfuse3.FUSEError(errno.EINVAL)

    # -- directories ---------------------------------------------------------------------------

    @_fuse_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        entries, listed_at = await self.ns.open_dir(inode)
        fh = self._new_fh()
        self._dirs[fh] = (inode, entries, listed_at)
        return fh

    @_fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        if fh not in self._dirs:
            raise pyfuse3.FUSEError(errno.EBADF)
        inode, entries, listed_at = self._dirs[fh]
        if start_id == 0 and fh in self._dirs_read and time.monotonic() - listed_at >= self.ns.ttl:
            # rewinddir() of a handle whose listing is older than the TTL: POSIX has it see the directory as it
            # is now (it kept the entries of its opendir for good). Not its first readdir: with TTL 0 that
            # listed every directory twice.
            entries, listed_at = await self.ns.open_dir(inode)
            self._dirs[fh] = (inode, entries, listed_at)
        self._dirs_read.add(fh)
        parent = self.ns.node(inode)
        # Positions: 0 is '.', 1 is '..', 2 + i is entries[i]; a reply's next_id is the position after it.
        # The kernel takes no lookup of '.' and '..' (libfuse's rule for readdirplus), so they count none here.
        for pos, name, node in ((0, b".", parent), (1, b"..", self.ns.parent_of(parent))):
            if start_id <= pos and not pyfuse3.readdir_reply(token, name, self._attributes(node), pos + 1):
                return
        for i in range(max(0, start_id - DOT_ENTRIES), len(entries)):
            try:
                node = self.ns.entry_node(parent, entries[i], listed_at)
            except PathError:
                # Gone since opendir (a file being written that was dropped). Skipped: an error here would
                # end the listing, and glibc's readdir reports ENOENT as the end of the directory.
                continue
            if not pyfuse3.readdir_reply(token, entries[i].name, self._attributes(node), DOT_ENTRIES + i + 1):
                self.ns.entry_refused(node)
                return
            self.ns.entry_taken(node)

    @_fuse_errors
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)
        self._dirs_read.discard(fh)

    # -- files ---------------------------------------------------------------------------------

    @_fuse_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        await self._settle(inode)
        if flags & WRITE_FLAGS:
            if self.writes is None:
                raise pyfuse3.FUSEError(errno.EROFS)
            node = self.ns.node(inode)
            old = node.version(self.ns.prefix)
            new = await self.writes.open_existing(node, flags)
            if new is not None:
                # Its stream would push the old bytes into the pages of what is now the new file; a push already
                # copying is waited for, so the kernel's truncate at this open's reply drops what it stored.
                self.streamer.rewritten(old)
                if not await self.pusher.settled(inode):
                    log.info("inode %d: a page-cache push still copying after %.0f s at its rewrite's open", inode,
                             SETTLE_WAIT_S)
                return await self._writer_handle(new, ctx)
            # A touch of an empty file (writes.py): a reader's handle, whose WRITEs get EPERM.
        elif (node := self.ns.node(inode)).writing:
            assert self.writes is not None  # readable once it is closed and stored
            self.writes.busy(node.path, self.writes.writing(node), "an open to read it")
        version = await self.ns.open_file(inode)
        # A GET that found this version gone (404, 412) superseded its inode (Namespace.gone), and only an answer of
        # the bucket's since makes one current: the version was uploaded again (the same bytes, the same ETag). The
        # engine's memory of the refusal, kept GONE_FOR_S to spare the other chunks' GETs, no longer holds (it
        # answered EIO to the new open's reads).
        self.engine.current_again(version)
        fh = self._new_fh()
        probe = ctx.pid in self.probes
        self._files[fh] = OpenFile(fh, inode, version, self.engine, self.max_readahead,
                                   direct=bool(flags & os.O_DIRECT), kernel_window=self.kernel_window,
                                   streamed=not probe)
        self._held[inode] += 1
        if not probe:
            self.streamer.opened(inode, version)
        # An inode is one object version (namespace.py), so its cached pages are always valid; except after a
        # rewrite through this mount, which keeps the inode: what descriptors of the old version read while it was
        # written went into its pages, so the first open after it drops them.
        node = self.ns.node(inode)
        keep_cache = not node.pages_stale
        node.pages_stale = False
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache)

    def _window_cap(self) -> int:
        # Read-ahead of all open files together keeps within half the chunk memory left beside the chunks
        # their kernel windows are READing (each file a share, so read-ahead cannot evict itself); model
        # streams keep within the other half (streaming.STREAM_MEMORY_SHARE). Without the kernel windows
        # counted, a budget of a few chunks evicted chunks fetched ahead before their READs came.
        files = max(1, self.readers)
        return max(self.engine.chunk_size, self.pusher.beside_readers(self.engine.memory.limit, files) // (2 * files))

    async def _writer_handle(self, new: NewFile, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        """A descriptor that writes is opened with direct I/O: the writer's bytes come to `write` straight from
        its buffer, not first copied into page-cache pages of the file (a checkpoint's size of fresh pages,
        dropped once it is stored; a plain writer's 1.72 GB write phase took 1.8-2.6 s instead of 3.6-4.2, and 1.3-1.5 s
        with write_staging's background block writes too, measured).
        So it reads nothing back from the page cache either (EBUSY until the file is stored, as for every
        handle), and a shared mmap of it is refused (ENODEV) instead of faulting on its first touch. A write()
        above the kernel's request size (1 MiB) still arrives as WRITEs one after the other; only asynchronous
        I/O with O_DIRECT (io_submit) sends its pieces at once, queued in offset order, and NewFile.write takes
        its lock before its first await, so they are appended in that order."""
        if new.opener is None:
            new.opener = await trio.to_thread.run_sync(holders.thread_group, ctx.pid)
        fh = self._new_fh()
        self._writers[fh] = new
        new.handles += 1
        return pyfuse3.FileInfo(fh=fh, direct_io=True)

    @_fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        while True:
            handle = self._files.get(fh)
            if handle is None:
                # A handle that writes a file cannot read it back before it is stored.
                raise pyfuse3.FUSEError(errno.EBUSY if fh in self._writers else errno.EBADF)
            if self.writes is None:  # read-only: nothing is rewritten through this mount
                return await self._read(handle, off, size)
            if self._rewritten(handle):
                continue
            try:
                data = await self._read(handle, off, size)
            except StoreError:
                # Its GET went to the old key after a rename through this mount had moved the file (one queued
                # behind others, or the READ asked while the rename ran): the handle follows it there.
                if self._rewritten(handle):
                    continue
                raise
            # A reply goes into the inode's pages: none of the old version once the rewrite is stored.
            if self._rewritten(handle):
                continue
            if len(data) < size and not handle.direct and self.ns.node(handle.ino).writing:
                # This mount rewrites the inode (O_TRUNC keeps it) and the handle reads the old version, shorter
                # than the kernel asked for. The kernel zero-fills the rest of the READ's pages and keeps them;
                # its size of the file is the writer's (each WRITE's reply extends it), so those zeros were read
                # as bytes, by this read (a WRITE answered while the READ was out: the size is not cut back) or
                # by a later one or an mmap once the writer went past them: a 1-byte read of a file rewritten in
                # place gave a zero that no version held (the crowd test). EIO puts no page in the cache.
                log.debug("inode %d: a READ of the old version, short at %d + %d, while this mount rewrites it",
                          handle.ino, off, len(data))
                raise pyfuse3.FUSEError(errno.EIO)
            return data

    def _rewritten(self, handle: OpenFile) -> bool:
        """Whether the handle's inode was rewritten through this mount (O_TRUNC keeps the inode) and stored as
        another version: the handle then reads the new one, as a descriptor of a local file does (README). Its
        old version's bytes, replied into the inode's pages, were what the next open read (a new user's
        checkpoint rewritten beside an evaluator: an open after the store read old bytes in the middle of new)."""
        node, pinned = self.ns.node(handle.ino), handle.version
        # Renamed through this mount, it is the same bytes under another key (with the same ETag where the copy kept
        # it): the handle follows it, as a descriptor of a local file does (it read the deleted old key: EIO). Field by
        # field: this runs twice per READ, and a node.version() built for it cost ~1 us each time.
        if node.writing or not node.etag or (node.etag == pinned.etag and node.size == pinned.size
                                             and pinned.key == self.ns.prefix + node.path):
            return False  # its own version, still being rewritten, or a rewrite that failed (the bucket holds the old)
        if self._files.get(handle.fh) is not handle:
            return True  # another READ of this descriptor, in flight with this one, gave it the new version
        handle.close()
        if handle.streamed:
            self.streamer.closed(handle.version)
            handle.streamed = False
        self._files[handle.fh] = OpenFile(handle.fh, handle.ino, node.version(self.ns.prefix), self.engine,
                                          self.max_readahead, direct=handle.direct,
                                          kernel_window=self.kernel_window, streamed=False)
        return True

    async def _read(self, handle: OpenFile, off: int, size: int) -> bytes | memoryview:
        if not handle.direct and self.engine.kernel_lacks(handle.version, off, off + size):
            self.streamer.dropped(handle.version)
        cap = self._window_cap()
        if cap < self.max_readahead and self.streamer.streaming(handle.version):
            # Memory holds less than a whole window per reader, and the model stream fetches this file in offset
            # order: it is the file's read-ahead. A handle's own went past the reader's tensor into tensors a loader
            # in name order (safe_open) wants later, and they were evicted before their READs came: a 1 GiB model
            # at --memory-limit 256M was fetched 1.34-1.37 times, now once, with `cat` and `load_file` unchanged
            # (bench/RESULTS.md). With room, read-ahead stays: there the model is fetched once either way.
            cap = 0
        try:
            if not self.pusher.enabled:
                return await handle.read(off, size, cap)
            with self.pusher.reading(handle.ino, off, off + size):
                return await handle.read(off, size, cap)
        except (PreconditionFailed, NotFound) as exc:
            # The bucket no longer holds this version (replaced or deleted): this handle gets EIO (it never
            # mixes versions), and the next open of the path gets the bucket's current one, TTL or not.
            self.versions_gone += 1
            entry, beside = self.ns.gone(handle.version)
            if entry is not None:  # so that a stat, too, looks the name up again (the TTL may be forever)
                await _drop_entry(entry, self._drop_threads, self.session_calls)
            for other in beside:  # the files beside it, asked again too (Namespace.gone)
                self.session_calls.queue(_invalidate_entry, *other)
            # The rule that explains a file opened after a push, as the old version (B752), said as a rule: the
            # version read may be the kernel's from long ago (`forever`), one kept while the origin was away, or
            # this mount's own write.
            raise StoreError(f"{exc.message}; new opens get what the bucket holds now (an open within --metadata-ttl "
                             "of the listing or HEAD that found a version may open that version)") from None

    @_fuse_errors
    async def release(self, fh: int) -> None:
        handle = self._files.pop(fh, None)
        if handle is not None:
            self._held[handle.ino] -= 1
            if not self._held[handle.ino]:
                del self._held[handle.ino]
            handle.close()
            if handle.streamed:
                self.streamer.closed(handle.version)
        new = self._writers.pop(fh, None)
        if new is not None:
            new.handles -= 1
            if new.handles == 0 and new.stored is None:
                # The last descriptor is gone and nothing stored the file: it was never written (a flush
                # stores only a file with bytes in it), or its last close was not seen as the last (below).
                await self._commit(new)

    @_fuse_errors
    async def flush(self, fh: int) -> None:
        new = self._writers.get(fh)
        # Every close(2) of a descriptor flushes, in every process that holds one: dup()s, a forked child's
        # exit, a subprocess's close-on-exec. A shell's `> file` opens the file, dup2()s it onto stdout and
        # closes the first descriptor before anything is written. So a flush stores the file (and close(2)
        # reports whether it was stored) once bytes were written and no other descriptor of it is left in the
        # opener's process tree (holders.py); otherwise, and for a file never written, the last descriptor's
        # flush or RELEASE stores it. (Storing at the first flush cut files short: `(echo a; /bin/true;
        # echo b) > f` stored "a", and a DataLoader's workers forked beside an open file stored it as they exited,
        # failing the writes that came after with EIO.)
        # A file that failed (an out-of-order write) can never be stored: its close says so, empty or not.
        if new is not None:
            if new.size == 0 and new.error is None:
                new.closed_empty = True
            elif new.stored is None and new.error is None and await self._held_elsewhere(new):
                return
            else:
                await self._commit(new)

    async def _commit(self, new: NewFile) -> None:
        """Store the file; once a rewrite of a stored file is stored, drop what the kernel holds of the inode's
        pages: descriptors of the old version read old bytes into them while the new file was written, and read
        them from there after the store, no READ asked (the next open drops them too: Operations.open). A file that
        could not be stored left the tree: the kernel's entry of its name goes, which it kept for the TTL (a fuzzer:
        `stat` found a new file after its close had failed with EIO; the name is what the bucket holds)."""
        try:
            await new.commit()
        finally:
            node = new.node
            if node.pages_stale and not node.writing and node.etag:
                # From a worker thread: the kernel waits for pages that READs queued to this loop hold. Abandoned at a
                # stop's cancellation: a READ it cut short keeps its page locked until the connection ends, and the
                # handler held the loop, and the daemon, for good; the call stays counted in `session_calls`, whose
                # end at the stop aborts the connection past SESSION_CALLS_S (B124, B141).
                await trio.to_thread.run_sync(self.session_calls.call, _invalidate_pages, node.ino,
                                              abandon_on_cancel=True)
            elif new.stored is None and not new.unlinked and self.ns.pending(node.path) is None:
                entry = self.ns.kernel_entry(node.path)
                if entry is not None:
                    await _drop_entry(entry, self._drop_threads, self.session_calls)

    async def _settle(self, inode: int) -> None:
        """Before a stat or an open: writes.settle, unless the empty file just closed is still held in its opener's
        tree (`exec 9>lock`, whose script's commands each close the copy they inherited as they exit): no RELEASE
        comes then, and each stat or open after such a close waited a second for one."""
        if self.writes is None:
            return
        node = self.ns.node(inode)
        new = self.writes.writing(node)
        if new is not None and new.closed_empty and await self._held_elsewhere(new):
            new.closed_empty = False  # its next close (FLUSH) is looked at again
        await self.writes.settle(node)

    async def _held_elsewhere(self, new: NewFile) -> bool:
        if new.opener is None:
            return False
        name = new.node.path.rpartition("/")[2]
        pid = await trio.to_thread.run_sync(holders.holder, new.opener, self.device, new.node.ino, name)
        if pid is None:
            return False
        log.debug("%s: a descriptor was closed, but process %d still holds one: stored at the last close",
                  new.node.path, pid)
        return True

    @_fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        new = self._writers.get(fh)
        if new is not None:
            await new.sync()

    @_fuse_errors
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        if mode & os.W_OK and self.writes is None:
            raise pyfuse3.FUSEError(errno.EROFS)
        return True

    # -- changes (--writable; writes.py has the rules) -----------------------------------------

    @_writable
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        assert self.writes is not None
        new = await self.writes.create(self.ns.node(parent_inode), name, flags)
        if new is not None:
            return await self._writer_handle(new, ctx), self._attributes(new.node)
        # Another writer stored a file at the name since this mount found it free: opened as it is (writes.create).
        # CREATE's reply counts as a lookup, counted before the open: a node the kernel forgot, kept for an outage
        # (B246), is in the inode table again for it (resolved alone, the open of it was ENOENT, B303).
        node = await self.ns.lookup(parent_inode, name)
        try:
            # As the kernel's OPEN of a name it knows: without O_CREAT and O_EXCL (`flock(1)` opens O_RDONLY|O_CREAT).
            info = await self.open(node.ino, flags & ~(os.O_CREAT | os.O_EXCL), ctx)
        except BaseException:
            self.ns.forget(node.ino, 1)  # the kernel got no entry
            raise
        return info, self._attributes(node)

    @_writable
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        new = self._writers.get(fh)
        if new is None:
            handle = self._files.get(fh)
            if handle is None:
                raise pyfuse3.FUSEError(errno.EBADF)
            self.writes.refuse_write(self.ns.node(handle.ino))  # the kernel sends WRITEs only where opened to write
        return await new.write(off, buf)

    @_writable
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        assert self.writes is not None
        node = self.ns.node(inode)
        if fields.update_size:
            new = self.writes.writing(node)
            if new is not None:
                new.truncate(attr.st_size)
            elif attr.st_size != node.size or node.is_dir:
                self.writes.refuse_truncate(node, attr.st_size)
        # Modes, owners and times are not stored in the bucket: accepted and left as they are.
        return self._attributes(node)

    @_writable
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        assert self.writes is not None
        if await self._child(parent_inode, name) is not None:
            raise pyfuse3.FUSEError(errno.EEXIST)
        return self._attributes(await self.writes.mkdir(self.ns.node(parent_inode), name))

    async def _child(self, parent_inode: int, name: bytes) -> Node | None:
        try:
            return await self.ns.resolve(parent_inode, name)
        except PathError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise

    async def _existing(self, parent_inode: int, name: bytes) -> Node:
        node = await self._child(parent_inode, name)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    @_writable
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        assert self.writes is not None
        await self.writes.unlink(await self._existing(parent_inode, name))

    @_writable
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        assert self.writes is not None
        await self.writes.rmdir(await self._existing(parent_inode, name))

    @_writable
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        assert self.writes is not None
        node = await self._existing(parent_inode_old, name_old)
        target = await self._child(parent_inode_new, name_new)
        await self.writes.rename(node, self.ns.node(parent_inode_new), name_new, target, flags)

    @_writable
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        """A regular file (`mknod(p, S_IFREG)`, as a local disk makes one) is made as `open(O_CREAT|O_EXCL)` and
        its close make one: an empty object; EEXIST where another writer stored the key between the two (its PUT is
        create-only), as where one had before. FIFOs, sockets and devices: EPERM (S3 has none)."""
        assert self.writes is not None
        if not stat.S_ISREG(mode):
            self.writes.refuse_kind("FIFOs, sockets and device files", parent_inode, name)
            raise pyfuse3.FUSEError(errno.EPERM)
        new = await self.writes.create(self.ns.node(parent_inode), name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        assert new is not None  # O_EXCL: a file stored there is EEXIST
        try:
            await self._commit(new)
        except BaseException as exc:
            self.ns.forget(new.node.ino, 1)  # counted as looked up (begin_file); a failed MKNOD gives no entry
            if isinstance(exc, PathError) and new.taken_meanwhile:
                raise pyfuse3.FUSEError(errno.EEXIST) from None
            raise
        return self._attributes(new.node)

    # -- what no mount does (S3 has no such things) --------------------------------------------

    symlink = _unsupported("symlink", "symlinks", 0)  # (parent_inode, name, target, ctx)
    link = _unsupported("link", "hard links", 1)  # (inode, new_parent_inode, new_name, ctx)

    @_writable
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        # Not supported, in the words tools expect: `cp -a` and `mv` carry on without ACLs and xattrs after
        # ENOTSUP, but fail (exit 1) after EPERM.
        raise pyfuse3.FUSEError(errno.ENOTSUP)

    @_writable
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise pyfuse3.FUSEError(errno.ENOTSUP)
