"""With `--cache-dir`, a local copy of each file being written, so that a stored file's chunks go into the
NVMe cache and a resume on the same node reads them at local speed.

A file's chunk ids name its ETag, which the bucket gives only when the upload completes; until then its
bytes are kept in `CACHE_DIR/writes/<n>` (each part as it is sent, or each WRITE of a deferred file; with
O_DIRECT where the filesystem takes it, see `StagedFile`), and once the file is stored they are
cut into chunks and handed to the cache level with `put`, as the read path's write-through does. The
copy is removed when that is done, or when the file fails. A stored file renamed has its cached chunks put under
its new name's chunk ids (`copy_cached`: ids name the key). Its copies are removed when a mount opens it
(the cache directory's lock says no other process uses it), so a killed daemon's copies do not pile up.
It does not count against `--cache-size`: it lasts as long as a file is open. It does leave the NVMe cache's
floor of free space (`min_free_bytes`) to the rest of the node: a streamed copy that would take the disk below it
first has the cache evict its least recently used chunks for the room it lacks (`DiskCache.hold`: on a disk the
cache fills up to that floor, the newest checkpoint replaces old chunks, B680), and ends only where that does not
make the room; a deferred one is made only where its whole size fits beyond it, counting the chunks the cache can
evict for it (B730: at its first write). What a copy is about to write is held with the cache (`DiskCache.hold`), so
the cache's puts never take the same free bytes (B731); it is given back once the file shows it.

Every method blocks (disk I/O); `writes.Writes` runs them in threads. A failure of the copy (a full
disk) loses the cache fill only, never the upload: it is logged once and the file goes on without it. A
deferred file (new_file.py) is the exception, its bytes being nowhere else until close, so it is deferred
only where the disk has room for its whole size beside the other deferred copies (`promise`); elsewhere it
streams.
"""

from __future__ import annotations

import concurrent.futures
import errno
import itertools
import logging
import os
import threading
from collections.abc import Callable

from fsmount.data import (
    ALIGN,
    WRITES_DIR,
    ChunkCache,
    ChunkId,
    DiskCache,
    WritableBuffer,
    counted,
    free_bytes,
    human_size,
    new_buffer,
    pwrite_all,
    round_up,
    still_on,
    sweep_staged_writes,
)

log = logging.getLogger(__name__)

# A copy's O_DIRECT unit: the bytes gathered before a write, and read at once. 1 MiB writes ran at 1.8 GB/s
# on the dev box's disk (dd oflag=direct), as fast as 8 MiB ones; each O_DIRECT copy holds BLOCKS_PER_COPY.
BLOCK = 1 << 20
# An O_DIRECT copy holds two blocks: one gathers while the other is written by a staging thread, so that a
# WRITE is answered without waiting for the disk (the writer's next WRITE and the disk overlap).
BLOCKS_PER_COPY = 2
# At most this many copies at once write with O_DIRECT (more copies go through the page cache), so that the
# blocks' memory is bounded: the mount takes STAGING_BYTES out of --memory-limit's budget.
DIRECT_COPIES = 8
STAGING_BYTES = DIRECT_COPIES * BLOCKS_PER_COPY * BLOCK


class Staging:
    """The `writes/` folder of a cache directory."""

    def __init__(self, cache_dir: str, min_free_bytes: int = 0, cache: DiskCache | None = None):
        """`min_free_bytes`: what the copies leave free on the cache dir's filesystem (the NVMe cache's own floor,
        disk_cache.default_min_free), so that a checkpoint larger than the disk does not fill it for the node's
        other writers (its logs, the trainer's local files, the chunk cache) while it is written. `cache`: the NVMe
        cache on that disk, with which the copies hold what they are about to write (`DiskCache.hold`, thread-safe:
        under the cache's own lock, which it evicts its least recently used chunks under where the room is short)."""
        self.cache_dir = cache_dir
        self.min_free_bytes = min_free_bytes
        self.cache = cache
        self.root = os.path.join(cache_dir, WRITES_DIR)
        files, size = sweep_staged_writes(cache_dir)
        if files:
            log.info("cache dir %s: removed %s (%s) that a --writable mount left in %s/ when it was killed",
                     cache_dir, counted(files, "copy of a file", "copies of files"), human_size(size), WRITES_DIR)
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        if os.path.islink(self.root):  # never a symlink's target: open_disk_cache refuses the mount before this
            raise OSError(errno.ENOTDIR, f"{self.root} is a symlink: the copies go only in a directory of its own")
        self._dev = os.stat(self.root).st_dev
        self._names = itertools.count(1)
        self._failed_logged = False
        self._remade_logged = False
        self._direct = True  # O_DIRECT for the copies, until the filesystem refuses it
        # open() and promise() run in the trio thread, block_returned() and discard() in workers.
        self._blocks_lock = threading.Lock()
        self._blocks = 0  # copies holding their blocks (writing with O_DIRECT), at most DIRECT_COPIES
        self._promised = 0  # bytes promised to deferred copies not yet discarded (`StagedFile.promise`)
        # Where the copies' full blocks are written; a copy has at most one block there at a time.
        self.block_writer = concurrent.futures.ThreadPoolExecutor(DIRECT_COPIES, thread_name_prefix="staging")

    def open(self) -> StagedFile | None:
        path = os.path.join(self.root, str(next(self._names)))
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            try:
                fd = os.open(path, flags, 0o600)
            except FileNotFoundError:
                self._remake()
                fd = os.open(path, flags, 0o600)
        except OSError as exc:
            self.failed(exc)
            return None
        direct_fd = None
        if self._direct and self._take_block():
            try:
                direct_fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as exc:  # this copy goes through the page cache; EINVAL: every copy does
                self.block_returned()
                if exc.errno == errno.EINVAL:
                    self.direct_refused(exc)
                else:
                    log.debug("%s: no O_DIRECT descriptor (%s); this copy goes through the page cache", path, exc)
        return StagedFile(self, fd, path, direct_fd)

    def _remake(self) -> None:
        """`writes/` (or the cache dir) was removed under the mount (an operator's `rm -rf CACHE/writes`): no file
        written was kept on this node until the next mount. Made again as the disk cache makes its own (B56): 0700,
        never through a symlink, and only on the cache dir's filesystem (a cache disk unmounted lazily leaves the
        path on the root filesystem, which the copies would fill)."""
        still_on(self.root, self._dev, "the folder of the copies of written files")
        for path in (self.cache_dir, self.root):
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            if os.path.islink(path) or not os.path.isdir(path):
                raise OSError(errno.ENOTDIR, f"{path} is not a directory of its own: no copies are kept through it")
        (log.debug if self._remade_logged else log.info)(
            "%s was removed under the mount; made again for the copies of written files", self.root)
        self._remade_logged = True

    def _take_block(self) -> bool:
        with self._blocks_lock:
            if self._blocks >= DIRECT_COPIES:
                return False
            self._blocks += 1
            return True

    def block_returned(self) -> None:
        with self._blocks_lock:
            self._blocks -= 1

    def promise(self, size: int) -> bool:
        """Whether the folder's filesystem has room for `size` more bytes beside what was promised to other
        copies (counted against the room left now, so a copy's own bytes written since count twice: on the
        safe side); if so, they are promised until `unpromise`. The chunks the NVMe cache holds count as room (B730:
        on a disk the cache fills up to its floor, no pre-sized file was deferred, and `save_file`'s rename cost a
        server-side copy): they are evicted for what is short at the copy's first write (`StagedFile._make_room`, in
        a staging thread: this runs in the trio thread, which never waits for the cache's lock)."""
        try:
            st = os.statvfs(self.root)
        except OSError as exc:
            self.failed(exc)
            return False
        evictable = self.cache.evictable_bytes if self.cache is not None else 0
        with self._blocks_lock:
            if st.f_bavail * st.f_frsize - self.min_free_bytes - self._promised + evictable < size:
                return False
            self._promised += size
            return True

    def room_for(self, size: int) -> bool:
        """Whether the folder's filesystem has room for `size` more bytes of a streamed copy, beside the floor left
        free (the copy ends otherwise: B590). With the NVMe cache, the room is held with it (`DiskCache.hold`,
        beside its puts in flight and what other copies hold, deferred ones' promises included once they write) until
        the copy gives it back, and where the disk is short of it the cache evicts its least recently used chunks for
        what is short (B680: on a disk the cache filled up to the floor, no copy was kept, and no new checkpoint
        reached the cache). Without it, beside what was promised to deferred copies. A filesystem that reports a
        size of 0 (free_bytes) has room: there only ENOSPC ends a copy, as before."""
        if self.cache is not None:
            return self.cache.hold(size)
        free = free_bytes(self.root)
        with self._blocks_lock:
            return free - self.min_free_bytes - self._promised >= size

    def unpromise(self, size: int) -> None:
        with self._blocks_lock:
            self._promised -= size

    def direct_refused(self, exc: OSError) -> None:
        if self._direct:
            self._direct = False
            log.info("%s: O_DIRECT not supported here (%s); the copies of written files go through the page cache",
                     self.root, exc)

    def failed(self, exc: OSError) -> None:
        if not self._failed_logged:
            self._failed_logged = True
            log.warning("cannot keep written files in %s (%s): files written in order are stored, but not cached "
                        "on this node; a pre-sized file, whose bytes are only there until it is closed, fails",
                        self.root, exc.strerror or exc)


class StagedFile:
    """The local copy of one file being written. `ok` turns False at the first failure, which ends it.
    Thread-safe: `_lock` is held around every use of the descriptors and of the blocks, so `discard` (from the
    trio thread, when the file fails) never closes them under a write in a worker thread, whose number could
    then name another file. The one exception is a full block handed to `Staging.block_writer`: from then
    until `_pending` is waited for (`_wait_written`, under `_lock`), that block (`_spare`) and its range of
    the file are the staging thread's. Everything that reads the file, writes to it other than by continuing
    the gathered bytes, reuses the spare, or closes a descriptor waits for it first, so the copy's bytes are
    always those of the last write to each offset, and a failure of that write ends the copy there.

    The copy bypasses the page cache (O_DIRECT) where the filesystem allows it, as the NVMe cache's chunk
    files do: a checkpoint's bytes would otherwise take their size in page cache (evicting a node's model
    pages), fresh pages that cost first-touch faults. Writes arrive in order, mostly (a deferred file's
    WRITEs; a streamed file's parts, a few at once): bytes that continue the ones before gather in `_block`
    (page-aligned, BLOCK bytes from an aligned offset) and go out a whole block at a time. A write elsewhere
    sends what was gathered first; a partial block waits for the next write and is sent through the page
    cache when the copy is read (`_settle`). A full block is written in the background while the other one
    gathers, so the writer's next WRITE does not wait for the disk (the write phase of a 1.72 GB `save_file`
    spent 1.5-2.9 s of its 3.6-4.4 s on this copy's blocks, measured by leaving them out). The first
    EINVAL from O_DIRECT turns it off for the staging folder (one info line) and the copy goes on through the
    page cache."""

    def __init__(self, staging: Staging, fd: int, path: str, direct_fd: int | None):
        self._staging = staging
        self._fd: int | None = fd
        self._direct_fd = direct_fd
        self._path = path
        self._lock = threading.Lock()
        self._block = new_buffer(BLOCK) if direct_fd is not None else None  # gathering
        self._spare = new_buffer(BLOCK) if direct_fd is not None else None  # the block written last
        self._pending: concurrent.futures.Future[None] | None = None  # the spare's write, until waited for
        self._pending_at = 0  # the file offset of that write
        # The file offset of _block's first byte (a multiple of ALIGN while it gathers); _block_at + _gathered is
        # always where a write continues the ones before.
        self._block_at = 0
        self._gathered = 0  # bytes in _block, not yet in the file
        self._promised = 0  # what `promise` reserved for this copy on the disk
        self._held = 0  # what this copy holds with the NVMe cache (`DiskCache.hold`): bytes not yet in the file
        self._promise_held = False  # a deferred copy's promise is held with the cache (from its first write)
        self._end = 0  # where the bytes written so far end (what the copy takes on the disk, holes aside)
        self.error: OSError | None = None  # what ended it, if a write or an extend failed

    @property
    def ok(self) -> bool:
        return self._fd is not None

    def promise(self, size: int) -> bool:
        """Whether the disk has room for this copy to grow to `size` bytes (a deferred file, whose bytes are
        nowhere else until close); the room stays promised to it until it is discarded. Called again (another
        extending ftruncate before the first write), the promise becomes `size` (two added up leaked the first)."""
        if self._fd is None:
            return False
        if size <= self._promised:
            self._staging.unpromise(self._promised - size)
        elif not self._staging.promise(size - self._promised):
            return False
        self._promised = size
        return True

    def extend(self, size: int) -> None:
        """The copy is `size` bytes long; what was never written reads as zeros (a hole)."""
        with self._lock:
            if self._fd is None:
                return
            try:
                self._settle()
                os.ftruncate(self._fd, size)
                self._rehold()
                return
            except OSError as exc:
                self.error = exc
                self._staging.failed(exc)
        self.discard()

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        with self._lock:
            if self._fd is None:
                return
            try:
                with memoryview(data) as view:
                    end = offset + view.nbytes
                    self._make_room(end)
                    self._write(offset, view.cast("B") if view.format != "B" else view)
                    self._end = max(self._end, end)
                    self._rehold()
                return
            except OSError as exc:
                self.error = exc
                self._staging.failed(exc)
        self.discard()

    def _make_room(self, end: int) -> None:
        """ENOSPC where growing a streamed copy to `end` would take its disk below the floor left free, even once the
        NVMe cache evicted its oldest chunks for it (`Staging.room_for`; one statvfs per part where there is room: a
        streamed file's copy is written a part at a time, and the cache is asked only where the room is short). Not a
        deferred copy's: its room was promised beyond the floor, and its bytes are nowhere else until close, so ending
        it there failed the file with ENOSPC on a disk that had room, when it was written past the size it was promised;
        only ENOSPC ends it, as before B590. Its first write holds what it was promised with the NVMe cache, which
        evicts for what is short (B730: the promise counted the cache's chunks as room), whether or not that makes the
        room: the cache's puts then leave it what they find (B731)."""
        cache = self._staging.cache
        if self._promised:
            if cache is not None and not self._promise_held:
                self._promise_held = True
                outstanding = max(0, self._promised - self._end)
                cache.hold(outstanding, must=True)
                self._held += outstanding
            return
        grow = end - self._end
        if grow > 0:
            if not self._staging.room_for(grow):
                raise OSError(errno.ENOSPC, f"less than {human_size(self._staging.min_free_bytes)} would be left free "
                              "on its filesystem, which the cache leaves to the rest of the node")
            if cache is not None:
                self._held += grow

    def _rehold(self) -> None:
        """Give back to the NVMe cache what this copy holds beyond the bytes not yet in its file: those gathered
        and the block a staging thread may still be writing, and a deferred copy's promise not yet written. A
        deferred copy gives back a block at a time at least (one cache lock per WRITE otherwise), on the safe side."""
        if not self._held:
            return
        target = self._gathered + (BLOCK if self._pending is not None else 0)
        if self._promised:
            target += max(0, self._promised - self._end)
        give = self._held - target
        if give > 0 and (give >= BLOCK or not self._promised or not target):
            assert self._staging.cache is not None
            self._staging.cache.unhold(give)
            self._held -= give

    def _write(self, offset: int, view: memoryview) -> None:
        if self._block is None:
            pwrite_all(self._fd, view, offset)
            return
        if offset != self._block_at + self._gathered:
            self._settle()  # not a continuation: what was gathered, and the block being written, go first
        if not self._gathered:
            head = min(len(view), -offset % ALIGN)
            if head:  # up to the next aligned offset, where a block can start
                pwrite_all(self._fd, view[:head], offset)
                view, offset = view[head:], offset + head
            self._block_at = offset
        while view and self._block is not None:
            take = min(len(view), BLOCK - self._gathered)
            self._block[self._gathered:self._gathered + take] = view[:take]
            self._gathered += take
            view = view[take:]
            if self._gathered == BLOCK:
                self._send_block()
        if view:  # O_DIRECT was refused meanwhile
            pwrite_all(self._fd, view, self._block_at + self._gathered)

    def _send_block(self) -> None:
        """The whole gathered block to a staging thread, to be written with O_DIRECT; the spare gathers next,
        once its own write is done."""
        self._wait_written()
        if self._block is None:  # the write before was refused O_DIRECT: this block went with it, see there
            return
        assert self._spare is not None and self._direct_fd is not None
        self._pending = self._staging.block_writer.submit(_write_block, self._direct_fd, self._block, self._block_at)
        self._pending_at = self._block_at
        self._block, self._spare = self._spare, self._block
        self._block_at += BLOCK
        self._gathered = 0

    def _wait_written(self) -> None:
        """Wait for the block a staging thread is writing. Its failure is raised here, except EINVAL (O_DIRECT
        refused): then that block and what is gathered go through the page cache, and so does the rest."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except OSError as exc:
            del pending  # the future holds the exception, whose traceback holds this frame: no cycle
            if exc.errno != errno.EINVAL or self._spare is None:
                raise
            self._staging.direct_refused(exc)
            with memoryview(self._spare) as block:
                pwrite_all(self._fd, block, self._pending_at)
            self._settle()
            self._end_direct()

    def _settle(self) -> None:
        """The block being written into the file, and what was gathered, through the page cache (a partial
        block is no O_DIRECT write)."""
        self._wait_written()
        if self._gathered and self._block is not None:
            with memoryview(self._block) as block:
                pwrite_all(self._fd, block[:self._gathered], self._block_at)
            self._block_at += self._gathered
            self._gathered = 0

    def _end_direct(self) -> None:
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None
        if self._block is not None and self._spare is not None:
            for block in (self._block, self._spare):
                try:
                    block.close()
                except BufferError:
                    # A failed write's traceback still holds a view of it (pwrite_all's slice, kept alive by
                    # the exception until it is collected): the map is unmapped when that view goes.
                    pass
            self._block = self._spare = None
            self._staging.block_returned()

    def _pread(self, offset: int, view: memoryview, view_aligned: bool = False) -> None:
        """Fill `view` from the copy at `offset`. With O_DIRECT when `offset` is aligned: straight into `view`
        if it is page-aligned whole blocks (`view_aligned`), else through `_block` a block at a time;
        otherwise (or once refused) through the page cache."""
        self._settle()
        done = 0
        while done < len(view):
            at = offset + done
            if self._block is not None and at % ALIGN == 0:
                try:
                    if view_aligned and (len(view) - done) % ALIGN == 0:
                        n = os.preadv(self._direct_fd, [view[done:]], at)
                    else:
                        want = min(BLOCK, round_up(len(view) - done))
                        with memoryview(self._block) as block:
                            n = min(os.preadv(self._direct_fd, [block[:want]], at), len(view) - done)
                            view[done:done + n] = block[:n]
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._staging.direct_refused(exc)
                    self._end_direct()
                    continue
            else:
                n = os.preadv(self._fd, [view[done:]], at)
            if n == 0:
                raise OSError(f"{self._path} ends at {at}")
            done += n

    def read_into(self, offset: int, buf: bytearray) -> bool:
        """Fill `buf` with the copy's bytes at `offset`; False (the copy is then gone) if it could not."""
        with self._lock:
            if self._fd is None:
                return False
            try:
                with memoryview(buf) as view:
                    self._pread(offset, view)
                self._rehold()
                return True
            except OSError as exc:
                self._staging.failed(exc)
        self.discard()
        return False

    def to_cache(self, cache: ChunkCache, chunk_id: Callable[[int], ChunkId], size: int, chunk_size: int) -> int:
        """Hand every chunk of the stored file (`size` bytes) to `cache`; then the copy is gone. The number of
        chunks handed over. Last chunk first, the copy cut short (ftruncate) after each one: a chunk's bytes are in
        the cache before they leave the copy, and the disk has them back for the next put (B732: the whole copy
        stayed until the end, so on a disk the cache fills to its floor, the puts of a file larger than about half
        the cache's older chunks evicted the file's own first chunks, and the cache kept only its tail). So the first
        chunk is the most recently used: where the cache still holds too little, it keeps the file's head."""
        count = 0
        # One buffer for every full chunk: page-aligned whole blocks, so the cache writes it with O_DIRECT from
        # where it is (a fresh bytes per chunk cost page faults and a copy into the cache's aligned stage).
        full = new_buffer(min(chunk_size, size)) if size else None
        try:
            for index in reversed(range(-(-size // chunk_size))):
                start = index * chunk_size
                length = min(chunk_size, size - start)
                assert full is not None
                buf = full if len(full) == length else new_buffer(length)  # the short last chunk
                with self._lock:
                    if self._fd is None:
                        return count
                    with memoryview(buf) as view:
                        self._pread(start, view, view_aligned=True)  # new_buffer: an anonymous map
                    self._rehold()
                cache.put(chunk_id(index), buf)
                count += 1
                with self._lock:
                    if self._fd is None:
                        return count
                    os.ftruncate(self._fd, start)
            return count
        except OSError as exc:
            self._staging.failed(exc)
            return count
        finally:
            self.discard()

    def discard(self) -> None:
        with self._lock:
            if self._fd is None:
                return
            if self._pending is not None:  # not closed under the staging thread's write; its failure is moot
                concurrent.futures.wait([self._pending])
                self._pending = None
            os.close(self._fd)
            self._fd = None
            self._end_direct()
            self._staging.unpromise(self._promised)
            self._promised = 0
            if self._held:
                assert self._staging.cache is not None
                self._staging.cache.unhold(self._held)
                self._held = 0
        try:
            os.unlink(self._path)
        except OSError:
            pass


def _write_block(fd: int, block: WritableBuffer, offset: int) -> None:
    """In a staging thread: one full block into a copy with O_DIRECT."""
    with memoryview(block) as view:
        pwrite_all(fd, view, offset)


def copy_cached(cache: ChunkCache, old_id: Callable[[int], ChunkId], new_id: Callable[[int], ChunkId], size: int,
                chunk_size: int) -> int:
    """Put each chunk of a `size`-byte file that `cache` holds under `old_id(i)` under `new_id(i)` too (a stored file
    renamed: chunk ids name the key); a chunk it does not hold is skipped. The number of chunks put. Blocks (disk
    I/O): run it in a thread."""
    count = 0
    buf: WritableBuffer | None = None
    for index in range(-(-size // chunk_size)):
        length = min(chunk_size, size - index * chunk_size)
        if buf is None or len(buf) != length:
            buf = new_buffer(length)  # one for every full chunk, one for the short last one
        data = cache.get(old_id(index), buf)
        if data is not None:
            cache.put(new_id(index), data)
            count += 1
    return count
