"""The FUSE request handlers: a thin pyfuse3 adapter over the namespace, the handles and the engine.

Handlers only translate: arguments in, replies out, and every failure into `FUSEError` in one place
(`_fuse_errors`). No semantics live here, and nothing but `FUSEError` ever leaves a handler.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pyfuse3

from fsmount.chunks import ChunkEngine
from fsmount.handles import OpenFile
from fsmount.metrics import STATS_XATTR
from fsmount.namespace import DirEntry, Namespace
from fsmount.pagecache import PageCachePusher
from fsmount.prefetch import ModelPrefetcher
from fsmount.store import StoreError

log = logging.getLogger(__name__)

T = TypeVar("T")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC | os.O_CREAT


def _fuse_errors(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., Coroutine[Any, Any, T]]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except StoreError as exc:
            log.warning("%s failed: %s", fn.__name__, exc.message)
            raise pyfuse3.FUSEError(exc.errno) from None
        except Exception:  # noqa: BLE001 - a bug must cost one request, never the mount
            log.exception("%s failed unexpectedly", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def _read_only(name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    async def handler(self: Operations, *args: Any) -> Any:
        raise pyfuse3.FUSEError(errno.EROFS)

    handler.__name__ = name
    return handler


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, namespace: Namespace, engine: ChunkEngine, prefetcher: ModelPrefetcher,
                 pusher: PageCachePusher, *, max_readahead: int, stats: Callable[[], bytes] | None = None):
        super().__init__()
        self.stats = stats
        self.ns = namespace
        self.engine = engine
        self.prefetcher = prefetcher
        self.pusher = pusher
        self.max_readahead = max_readahead
        self._files: dict[int, OpenFile] = {}
        self._dirs: dict[int, tuple[int, list[DirEntry]]] = {}  # fh -> (inode, snapshot at opendir)
        self._next_fh = 1

    def _new_fh(self) -> int:
        fh = self._next_fh
        self._next_fh += 1
        return fh

    @property
    def open_files(self) -> int:
        return len(self._files)

    # -- metadata ------------------------------------------------------------------------------

    @_fuse_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = await self.ns.lookup(parent_inode, name)
        return self.ns.attributes(node)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        try:
            for ino, count in inode_list:
                self.ns.forget(ino, count)
        except Exception:  # noqa: BLE001 - forget must never raise
            log.exception("forget failed")

    @_fuse_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = await self.ns.refresh(self.ns.node(inode))
        return self.ns.attributes(node)

    @_fuse_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = 1 << 20
        st.f_namemax = 255
        return st

    @_fuse_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        # The stats of `modelfs stats`; deliberately not listed by listxattr (see metrics.STATS_XATTR).
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
        node = self.ns.node(inode)
        if not node.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        fh = self._new_fh()
        self._dirs[fh] = (inode, await self.ns.listing(node))
        return fh

    @_fuse_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        if fh not in self._dirs:
            raise pyfuse3.FUSEError(errno.EBADF)
        inode, entries = self._dirs[fh]
        parent = self.ns.node(inode)
        for i in range(start_id, len(entries)):
            node = self.ns.entry_node(parent, entries[i])
            if not pyfuse3.readdir_reply(token, entries[i].name, self.ns.attributes(node), i + 1):
                # The kernel did not take it; a node created just for it must not linger.
                if node.lookups == 0:
                    self.ns.forget(node.ino, 0)
                return
            node.lookups += 1

    @_fuse_errors
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    # -- files ---------------------------------------------------------------------------------

    @_fuse_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        node = self.ns.node(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        node = await self.ns.refresh(node)
        if node.superseded:
            # The bucket holds a newer version: ESTALE makes the kernel look the path up again
            # (LOOKUP_REVAL) and open the new version's inode instead.
            raise pyfuse3.FUSEError(errno.ESTALE)
        version = node.version(self.ns.prefix)
        # An inode is one object version (namespace.py), so its cached pages are always valid.
        keep_cache = True
        fh = self._new_fh()
        self._files[fh] = OpenFile(fh, inode, version, self.engine, self.max_readahead)
        self.prefetcher.opened(inode, version)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache)

    def _window_cap(self) -> int:
        # Under many open files, each gets a share of memory so read-ahead cannot evict itself.
        return max(self.engine.chunk_size, self.engine.memory_limit // (2 * max(1, len(self._files))))

    @_fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        handle = self._files.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        if not self.pusher.enabled:
            return await handle.read(off, size, self._window_cap())
        with self.pusher.reading(handle.ino, off, off + size):
            return await handle.read(off, size, self._window_cap())

    @_fuse_errors
    async def release(self, fh: int) -> None:
        handle = self._files.pop(fh, None)
        if handle is not None:
            handle.close()
            self.prefetcher.closed(handle.version)

    @_fuse_errors
    async def flush(self, fh: int) -> None:
        return None

    @_fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        return None  # nothing is ever dirty

    @_fuse_errors
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        if mode & os.W_OK:
            raise pyfuse3.FUSEError(errno.EROFS)
        return True

    # -- everything that would write -----------------------------------------------------------

    setattr = _read_only("setattr")
    mknod = _read_only("mknod")
    mkdir = _read_only("mkdir")
    unlink = _read_only("unlink")
    rmdir = _read_only("rmdir")
    symlink = _read_only("symlink")
    rename = _read_only("rename")
    link = _read_only("link")
    create = _read_only("create")
    write = _read_only("write")
    setxattr = _read_only("setxattr")
    removexattr = _read_only("removexattr")
