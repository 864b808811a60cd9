"""With `--cache-dir`, a local copy of each file being written, so that a stored file's chunks go into the
NVMe cache and a resume on the same node reads them at local speed.

A file's chunk ids name its ETag, which the bucket gives only when the upload completes; until then its
bytes are kept in `CACHE_DIR/writes/<n>` (each part as it is sent), and once the file is stored they are
cut into chunks and handed to the cache level with `put`, as the read path's write-through does. The
copy is removed when that is done, or when the file fails. The folder is emptied when a mount opens it
(the cache directory's lock says no other process uses it), so a killed daemon's copies do not pile up.
It does not count against `--cache-size`: it lasts as long as a file is open.

Every method blocks (disk I/O); `writes.Writes` runs them in threads. A failure of the copy (a full
disk) loses the cache fill only, never the upload: it is logged once and the file goes on without it.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import threading
from collections.abc import Callable

from fsmount.data import ChunkCache, ChunkId, new_buffer

log = logging.getLogger(__name__)

WRITES_DIR = "writes"


class Staging:
    """The `writes/` folder of a cache directory."""

    def __init__(self, cache_dir: str):
        self.root = os.path.join(cache_dir, WRITES_DIR)
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._names = itertools.count(1)
        self._failed_logged = False

    def open(self) -> StagedFile | None:
        path = os.path.join(self.root, str(next(self._names)))
        try:
            return StagedFile(self, os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), path)
        except OSError as exc:
            self.failed(exc)
            return None

    def failed(self, exc: OSError) -> None:
        if not self._failed_logged:
            self._failed_logged = True
            log.warning("cannot keep written files in %s (%s): they are stored, but not cached on this node",
                        self.root, exc.strerror or exc)


class StagedFile:
    """The local copy of one file being written. `ok` turns False at the first failure, which ends it.
    Thread-safe: `_lock` is held around every use of the descriptor, so `discard` (from the trio thread,
    when the file fails) never closes it under a write in a worker thread, whose number could then name
    another file."""

    def __init__(self, staging: Staging, fd: int, path: str):
        self._staging = staging
        self._fd: int | None = fd
        self._path = path
        self._lock = threading.Lock()

    @property
    def ok(self) -> bool:
        return self._fd is not None

    def extend(self, size: int) -> None:
        """The copy is `size` bytes long; what was never written reads as zeros (a hole)."""
        with self._lock:
            if self._fd is None:
                return
            try:
                os.ftruncate(self._fd, size)
                return
            except OSError as exc:
                self._staging.failed(exc)
        self.discard()

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        with self._lock:
            if self._fd is None:
                return
            try:
                view, done = memoryview(data), 0
                while done < len(view):
                    done += os.pwrite(self._fd, view[done:], offset + done)
                return
            except OSError as exc:
                self._staging.failed(exc)
        self.discard()

    def read_into(self, offset: int, buf: bytearray) -> bool:
        """Fill `buf` with the copy's bytes at `offset`; False (the copy is then gone) if it could not."""
        with self._lock:
            if self._fd is None:
                return False
            try:
                view, done = memoryview(buf), 0
                while done < len(view):
                    n = os.preadv(self._fd, [view[done:]], offset + done)
                    if n == 0:
                        raise OSError(f"{self._path} ends at {offset + done}")
                    done += n
                return True
            except OSError as exc:
                self._staging.failed(exc)
        self.discard()
        return False

    def to_cache(self, cache: ChunkCache, chunk_id: Callable[[int], ChunkId], size: int, chunk_size: int) -> int:
        """Hand every chunk of the stored file (`size` bytes) to `cache`; then the copy is gone. The number of
        chunks handed over."""
        count = 0
        # One buffer for every full chunk: page-aligned whole blocks, so the cache writes it with O_DIRECT from
        # where it is (a fresh bytes per chunk cost page faults and a copy into the cache's aligned stage).
        buf = new_buffer(min(chunk_size, size)) if size else None
        try:
            for index in range(-(-size // chunk_size)):
                start = index * chunk_size
                length = min(chunk_size, size - start)
                if buf is None or len(buf) != length:
                    buf = new_buffer(length)  # the short last chunk
                with self._lock:
                    if self._fd is None:
                        return count
                    read = os.preadv(self._fd, [buf], start)
                if read != length:
                    raise OSError(f"short read of {self._path}")
                cache.put(chunk_id(index), buf)
                count += 1
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
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self._path)
        except OSError:
            pass
