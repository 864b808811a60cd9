"""The directory tree: keys become files, '/'-delimited prefixes become directories, each with an inode.

Holds the inode table (stable numbers for the mount's life, lookup counts), the TTL caches of
listings and negative lookups, the rules for keys the kernel cannot represent, and which version of an
object an open gets. It returns plain data (`Node`, `DirEntry`, `ObjectVersion`) and refuses with
`PathError(errno)`; it never reads object data and never speaks FUSE (operations does).

A file inode is one *version* of an object: (path, ETag). When an object is replaced, the path gets a
new inode at the next lookup, while handles (and the kernel's page cache) of the old inode keep the
old version; so a reader never sees two versions mixed, and the page cache is always safe to keep.

Concurrency (all methods run in the trio thread; store calls are awaited through `self._call`):
- An inode number once given to a (path, ETag) or a directory path never changes while the version is
  current (`_ino_by_path`); `_latest_file` points each path at its newest known file version. An older or
  superseded version's entries go once the kernel forgets its inode (`forget`): kept, every replaced file left
  ~330 bytes for the life of the mount (65 MiB after 200,000 checkpoint versions); it comes back as a new inode.
- `_nodes` entries are created on lookup/readdir and dropped by `forget` when the lookup count
  reaches zero (a current version's, or a directory's, kept in `_forgotten`, which answers only while the origin
  is away). Between two awaits a node's metadata may be refreshed by another task; readers
  take a snapshot (`Node.version()`) instead of reading fields across awaits.
- A HEAD of a known file runs in the task that asked it, or, for a GETATTR of a file held open, in `run`'s nursery
  behind the answer (`refresh_held`, HEADS_BEHIND at once: `_behind_now`); either way one at a time per inode
  (`_refreshing_now`), and it changes only when the version is trusted until and whether it is superseded, never its
  size or time.

Changes made through this mount (`--writable`) are tree_changes.WritableNamespace's, a subclass: files
being written (`_pending`) are listed and looked up here, and listings that land are patched with the
changes recorded in `_changes` (`_patch`); its docstring has the rules.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import cachetools
import trio

from fsmount.data import (
    AccessDenied,
    ListingPage,
    ObjectMeta,
    ObjectStore,
    ObjectVersion,
    StoreError,
    TimedOut,
    TransientError,
    Unreachable,
)

if TYPE_CHECKING:
    from fsmount.saved_names import SavedNames

log = logging.getLogger(__name__)

# FUSE_ROOT_ID: the kernel's inode number of a mount's root.
ROOT_INODE = 1
# Linux NAME_MAX.
NAME_MAX = 255
# Upper bound on directory entries held in the listing caches, over all directories. An entry holds ~400 B (its
# name, key and ETag strings, ObjectMeta, DirEntry, the dict's slot: measured with tracemalloc over 400,000 keys),
# and the listings kept for outages outlive their TTL: 200,000 is ~80 MiB, within the runtime's share of
# --memory-limit (2,000,000, estimated at 100 B each, could keep ~780 MiB beyond it; the audit). A directory of
# more is listed anew by every opendir, and still listed.
LISTING_CACHE_ENTRIES = 200_000
NEGATIVE_CACHE_ENTRIES = 100_000
# A lookup in a directory whose last listing has expired and held at most this many entries (one page of a listing,
# S3's most) lists the directory again (`_relisted`) rather than ask the name (a HEAD and a one-key listing): one
# request then answers every name of it for the TTL. Asked by name, an `os.stat` of each file of a 50-file model
# past the TTL sent 50 HEADs and 50 listings. A bigger directory's names are still asked one by one (a listing of
# 20,000 keys is 20 pages for one name).
RELIST_ENTRIES = 1000
# Paths whose newest answer's time is kept (`_latest_asked`): older answers about them are older news. Bounded, as
# paths come and go (a checkpoint rotation's); past it the oldest news is forgotten first.
LATEST_ASKED_ENTRIES = 20_000
# Current nodes the kernel forgot (`_forgotten`), kept for outages: a file found by its HEAD, not in any listing, whose
# inode the kernel dropped (memory pressure, drop_caches) was EIO at its next lookup while the origin was away (B246).
# ~300 B each (tracemalloc, its path and ETag strings included): ~3 MiB.
FORGOTTEN_NODES = 10_000
# A HEAD's answer that a file is current also holds for the requests that follow it within this long, those of the
# same system call: an open() is a LOOKUP, a GETATTR (the permission check, once the attributes are older than the TTL)
# and an OPEN. Each asking again, with `--metadata-ttl 0` a file rewritten every 50 ms was found replaced between two of
# them, at the kernel's one retry too, and the open failed with ESTALE. It matters only for a TTL below it.
ONE_CALL_S = 0.1
# While the origin is unreachable, known files keep their metadata and are re-checked this often.
STALE_RETRY = 5.0
# After a metadata request got no answer (connection refused, or nothing within --read-timeout), the next ones
# fail at once for this long (names the mount knows keep resolving) instead of each waiting out the timeout: the
# kernel sends the LOOKUPs of one directory one at a time (libfuse 3.14 never asks it for parallel directory
# operations, and pyfuse3 cannot), so ten stats of new names in one directory took ten timeouts in a row, 20
# minutes at 120 s. An origin that answers, even with an error (5xx, a cut response), fails each request
# quickly by itself and arms nothing. The cost: new names stay EIO for up to this long after the origin is back.
DOWN_FAST_FAIL_S = 5.0
# A lookup of a name the mount knows (the kernel forgot it, or its TTL has passed) waits this long at most for the
# bucket's answer, which goes on behind, and not at all while a metadata request sent earlier has waited this long for
# an answer with none come since (`_silent`); then what the mount knows is answered (`_known_first`). A frozen origin
# (it takes connections and answers nothing) held each `stat` of an `ls -l` for the whole --read-timeout (one name
# every DOWN_FAST_FAIL_S): a 20-file model took minutes. An open of it still asks (`Node.unchecked`).
KNOWN_NAME_WAIT_S = 1.0
# HEADs run behind GETATTRs of files held open (`refresh_held`) at once, at most: the rest of the mount's metadata slots
# (config.METADATA_THREADS, 8) stay for the lookups and opens that wait. One per inode held open, 1000 files read at
# once queued 1000 HEADs ahead of them, and a slot's wait counts in a request's --read-timeout.
HEADS_BEHIND = 2
# Requests that a lookup, GETATTR or listing of something known answered without (`_known_first`) leave running behind,
# at most: past it, the next such call waits for its own request, as before B1001. Uncapped, a storm of stats of
# thousands of known names on an origin slower than KNOWN_NAME_WAIT_S (but answering, so not `_silent`) left a request
# behind for each, every one queued for a metadata slot ahead of the lookups and opens that wait.
KNOWN_BEHIND = 4
# Directories in which the mount learnt that a version was replaced or deleted (`_changed_beside`), by when: bounded,
# as directories come and go; past it the oldest are forgotten first (an answer asked before such a change is then
# trusted for its TTL, as before).
DIRS_CHANGED_ENTRIES = 20_000
# Keys whose skip was already logged; bounded so a hostile bucket cannot grow it without limit.
SKIP_LOG_MEMORY = 10_000
# Skipped keys of one listing that are logged by name; the rest are one line of their count.
SKIPS_NAMED_PER_LISTING = 20

StoreCall = Callable[..., Awaitable[Any]]


class PathError(Exception):
    """A request the tree refuses; `errno` is what the reader gets."""

    def __init__(self, err: int):
        super().__init__(os.strerror(err))
        self.errno = err


@dataclasses.dataclass(slots=True)
class DirEntry:
    name: bytes
    is_dir: bool
    meta: ObjectMeta | None = None


class Listing(dict[bytes, DirEntry]):
    """A directory's entries by name, as one listing of the bucket gave them; `at` is when that listing
    began (monotonic): what it says of a file is trusted until `at` + the metadata TTL, not longer. `found_since`: what
    answers asked after it began (a lookup's, a HEAD of an inode's) found of names of its directory, by name: (when
    asked, the entry found; None: nothing there). A listing that landed after them is kept for outages with them applied
    (`Namespace._keep`); the one kept has them applied as they land (`found`), and answers such a name as of when it
    was asked (`Namespace._known_while_down`). None while there are none (most listings)."""

    __slots__ = ("at", "found_since")

    def __init__(self, at: float):
        super().__init__()
        self.at = at
        self.found_since: dict[bytes, tuple[float, DirEntry | None]] | None = None

    def found(self, name_b: bytes, entry: DirEntry | None, asked: float) -> None:
        """An answer asked at `asked` (monotonic), after this listing began, found `entry` at `name_b` (None: nothing):
        for a listing kept for outages, which answers as the newest answer said."""
        if entry is None:
            self.pop(name_b, None)
            if self.found_since is not None:
                self.found_since.pop(name_b, None)
            return
        self[name_b] = entry
        if self.found_since is None:
            self.found_since = {}
        self.found_since[name_b] = (asked, entry)


def same_version(listed: DirEntry | None, found: DirEntry | None) -> bool:
    """Whether two entries of a name say the same: nothing, a directory, or the same version of a file."""
    if listed is None or found is None:
        return listed is found
    return listed.is_dir == found.is_dir and (listed.meta.etag if listed.meta else "") == (
        found.meta.etag if found.meta else "")


@dataclasses.dataclass(slots=True)
class Node:
    ino: int
    path: str  # relative to the mount's prefix; '' for the root; no trailing '/'
    is_dir: bool
    size: int = 0
    etag: str = ""
    mtime_ns: int = 0
    lookups: int = 0
    fresh_until: float = 0.0  # monotonic time until which the version (a directory: that it is there) is trusted
    confirmed_at: float = 0.0  # monotonic time a HEAD's answer last said the version is current (ONE_CALL_S)
    # When the newest answer that found this version current was asked (monotonic; this mount's store of it: when it
    # landed): an answer about the node asked before it is older news (`_refresh`, B322). Not `_latest_asked`, which a
    # read's refusal of another version also dates (`gone`, as it lands: B350).
    current_as_of: float = 0.0
    superseded: bool = False  # the bucket now holds another version of this path
    # Answered from what the mount knew, the bucket's answer not come within KNOWN_NAME_WAIT_S (`_known_first`): an
    # open asks the bucket (a HEAD) whatever the TTL. Cleared by a HEAD's answer.
    unchecked: bool = False
    superseded_at: float = 0.0  # monotonic time it was found superseded
    writing: bool = False  # this mount is writing the file: not in the bucket until it is closed
    # Rewritten through this mount (tree_changes.begin_file), which keeps the inode: the kernel may hold pages of
    # the old version, read by descriptors opened before; the next open drops them (Operations.open).
    pages_stale: bool = False

    def version(self, prefix: str) -> ObjectVersion:
        return ObjectVersion(prefix + self.path, self.etag, self.size)

    def supersede(self) -> None:
        self.superseded, self.superseded_at = True, time.monotonic()

    def held_again(self, asked: float) -> bool:
        """The bucket holds this version again, as asked at `asked` (monotonic): current again if that was after it
        was superseded (a rollback, the same bytes uploaded again; an answer already on its way when it was
        superseded says nothing of what came after). Left superseded, every open of the path got ESTALE, the
        kernel's retry found the same inode, and so on until the kernel forgot it. Whether it was superseded."""
        if not self.superseded or asked <= self.superseded_at:
            return False
        self.superseded = False
        return True


T = TypeVar("T")


@dataclasses.dataclass(eq=False)
class _InFlight(Generic[T]):
    """One request to the bucket in flight, which other tasks wanting the same answer wait for."""
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    result: T | None = None
    error: Exception | None = None


async def at_once(calls: dict[str, Callable[[], Awaitable[Any]]]) -> dict[str, Any]:
    """Await the calls concurrently: each one's result under its name, or its failure under name + "_error". Kept,
    not raised: a nursery would wrap a failure in an ExceptionGroup, and the handlers map plain StoreErrors to
    errno."""
    results: dict[str, Any] = {}

    async def ask(name: str, call: Callable[[], Awaitable[Any]]) -> None:
        try:
            results[name] = await call()
        except Exception as exc:  # noqa: BLE001
            results[name + "_error"] = exc

    async with trio.open_nursery() as nursery:
        for name, call in calls.items():
            nursery.start_soon(ask, name, call)
    return results


async def _shared(table: dict[str, _InFlight[T]], key: str, make: Callable[[], Awaitable[T]]) -> T:
    """`await make()`, or the result (or error) of the one for `key` already in flight in `table`. If that one
    was cancelled (its FUSE request interrupted), the next waiter asks."""
    while (flight := table.get(key)) is not None:
        await flight.done.wait()
        if flight.error is not None:
            raise flight.error
        if flight.result is not None:
            return flight.result
    flight = table[key] = _InFlight()
    return await _fly(table, key, flight, make)


async def _fly(table: dict[str, _InFlight[T]], key: str, flight: _InFlight[T], make: Callable[[], Awaitable[T]]) -> T:
    """`await make()` as `flight`, registered in `table` under `key` by the caller, for the tasks that wait for it."""
    try:
        flight.result = await make()
        return flight.result
    except Exception as exc:
        flight.error = exc
        raise
    finally:
        del table[key]
        flight.done.set()


def listing_page(pages: Iterator[ListingPage], prefix: str) -> ListingPage | None:
    """The next page of a listing of `prefix`, None after the last (a store call of its own: its name and the
    prefix are in its timeout error)."""
    return next(pages, None)


def invalid_segment_reason(name: str) -> str | None:
    """Why a path segment cannot be a file name here, or None if it can."""
    if name == "":
        return "empty path segment"
    if name in (".", ".."):
        return f"'{name}' path segment"
    if "\x00" in name:
        return "NUL byte in name"
    if len(name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        return f"name longer than {NAME_MAX} bytes"
    return None


def child_name(parent: Node, name_b: bytes, undecodable: int) -> str:
    """A name in directory `parent` as text; ENOTDIR if `parent` is a file, `undecodable` if not UTF-8."""
    if not parent.is_dir:
        raise PathError(errno.ENOTDIR)
    try:
        return name_b.decode("utf-8")
    except UnicodeDecodeError:
        raise PathError(undecodable) from None


class Namespace:
    def __init__(self, store: ObjectStore, call: StoreCall, *, prefix: str, ttl: float,
                 saved: SavedNames | None = None):
        self._store = store
        # Names learnt by this mount and its predecessors, kept in the cache dir (saved_names.py): told what
        # listings and lookups find, asked only where an expired listing would be (the origin does not answer).
        self.saved = saved
        self._ask = call
        # Until when metadata requests fail at once (DOWN_FAST_FAIL_S), and why; only `_call` touches them, in
        # the trio thread.
        self._down_until = self._down_since = 0.0
        self._down_error: type[StoreError] = TransientError
        self._down_reason = ""
        # Metadata requests under way, by a number of `_call`'s own: when each was sent (monotonic); and when the last
        # answer of any came (`_silent`).
        self._unanswered: dict[int, float] = {}
        self._calls = 0
        self._answered_at = 0.0
        self.prefix = prefix
        self.ttl = ttl
        self._next_ino = ROOT_INODE + 1
        # (path, None) for a directory, (path, etag) for one version of a file.
        self._ino_by_path: dict[tuple[str, str | None], int] = {("", None): ROOT_INODE}
        self._latest_file: dict[str, int] = {}
        # When the newest answer about each path's current version was asked (monotonic): an answer asked before it
        # (a listing begun earlier, a directory handle's snapshot) is older news of that path (`_node_for`). Apart
        # from the nodes, as the kernel forgets inodes meanwhile.
        self._latest_asked: cachetools.LRUCache[str, float] = cachetools.LRUCache(LATEST_ASKED_ENTRIES)
        # A read's refusal of a version (`gone`), by path: (its ETag, when it landed, the path's newest date but that
        # one). Dated as it lands in `_latest_asked` (when its GET was sent is not known here), it is news of that
        # version alone: an answer that found another one, or nothing, is older news only against the dates before
        # (B652).
        self._refusals: cachetools.LRUCache[str, tuple[str, float, float]] = cachetools.LRUCache(LATEST_ASKED_ENTRIES)
        self._nodes: dict[int, Node] = {ROOT_INODE: Node(ROOT_INODE, "", True, lookups=1)}
        # Nodes of current versions (and directories) the kernel forgot, by inode number: what `_known_while_down`
        # answers a lookup of them from while the origin is away. Never served while it answers.
        self._forgotten: cachetools.LRUCache[int, Node] = cachetools.LRUCache(FORGOTTEN_NODES)
        self._listings: cachetools.TTLCache[str, Listing] = cachetools.TTLCache(
            maxsize=LISTING_CACHE_ENTRIES, ttl=ttl, getsizeof=lambda entries: max(1, len(entries)))
        self._negative: cachetools.TTLCache[str, bool] = cachetools.TTLCache(NEGATIVE_CACHE_ENTRIES, ttl)
        # When the mount last learnt that a version in a directory was replaced or deleted, by directory path
        # (`_changed_beside`): an answer about a file of it asked before is not trusted past that (`_trusted_from`).
        self._dirs_changed: cachetools.LRUCache[str, float] = cachetools.LRUCache(DIRS_CHANGED_ENTRIES)
        self._skips_logged: cachetools.LRUCache[str, bool] = cachetools.LRUCache(SKIP_LOG_MEMORY)
        self._hidden_logged: cachetools.LRUCache[str, bool] = cachetools.LRUCache(SKIP_LOG_MEMORY)
        self._stale_logged = False
        self._denied_logged = False  # a HEAD of a known file refused (`refresh`) was logged as a warning
        # The same listing dicts as `_listings`, kept past their TTL for outages (no extra copies, but for a listing
        # that an answer about one of its names raced: `_keep`).
        # Sized as stored: one that a name is added to or dropped from is stored anew (`_recount_kept`).
        self._last_listings: cachetools.LRUCache[str, Listing] = cachetools.LRUCache(
            maxsize=LISTING_CACHE_ENTRIES, getsizeof=lambda entries: max(1, len(entries)))
        # Changes made through this mount (see the module's rules).
        self._pending: dict[str, Node] = {}
        # Listings being made, by directory path, and names being asked of the bucket (HEAD and a listing), by
        # path: a task that wants one already in flight waits for it (`_shared`) instead of sending the same
        # requests again (8 `ls` of a 20,000-key directory at once sent each page 8 times; a stat storm sent
        # a name's HEAD for every process whose cached entry had expired). Set and removed by the task asking,
        # around its awaits; a listing is kept (`_keep`) by that task alone, as it lands (`_list_and_keep`).
        self._listing_now: dict[str, _InFlight[Listing]] = {}
        self._resolving_now: dict[str, _InFlight[Node]] = {}
        self._refreshing_now: dict[str, _InFlight[Node]] = {}  # HEADs of known files (`refresh`), by inode number
        # Where the HEADs of files held open that a GETATTR does not wait for run (`refresh_held`): set by `run` alone,
        # for the mount's life; None before and after (then a GETATTR waits for its HEAD, as every other call does).
        self._behind: trio.Nursery | None = None
        # Inodes whose HEAD runs in `_behind` (at most HEADS_BEHIND): added by `refresh_held` as it starts one, removed
        # by that task as it ends.
        self._behind_now: set[int] = set()
        # Requests of `_known_first` under way in `_behind` (at most KNOWN_BEHIND): counted up by `_known_first` as it
        # starts one, down by that task as it ends (`_fly_behind`).
        self._known_behind = 0
        self._changes: dict[str, dict[bytes, tuple[int, DirEntry | None]]] = {}
        self._seq = 0
        # The `_seq` at which each listing under way began, by directory path (`_list`): which changes they need.
        self._lists_under_way: dict[str, list[int]] = {}
        # What answers found of names while a listing of their directory was under way, by directory path, then name:
        # (when that answer was asked, monotonic; the entry it found, None for nothing there). A listing begun before
        # keeps them, not what it says of those names, in what it keeps for outages (`Listing.found_since`, `_keep`).
        # Set by `_found_in_listings`, dropped with the last listing under way of the directory (`_list`), or a name's
        # record by a newer change through this mount or a create that found the name taken (tree_changes).
        self._found_while_listed: dict[str, dict[bytes, tuple[float, DirEntry | None]]] = {}

    # -- inode table ---------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One metadata request through the mount's store call, failing at once (the same error again) within
        DOWN_FAST_FAIL_S of one that got no answer (Unreachable, TimedOut)."""
        now = time.monotonic()
        if now < self._down_until:
            raise self._down_error(f"not asked: the origin did not answer {now - self._down_since:.1f}s ago "
                                   f"({self._down_reason}); it is asked again in {self._down_until - now:.1f}s")
        self._calls += 1
        call = self._calls
        self._unanswered[call] = now
        try:
            result = await self._ask(fn, *args)
        except (Unreachable, TimedOut) as exc:
            self._down_since = time.monotonic()
            self._down_until = self._down_since + DOWN_FAST_FAIL_S
            self._down_error, self._down_reason = type(exc), exc.message
            raise
        except StoreError:
            self._answered_at = time.monotonic()
            raise
        finally:
            del self._unanswered[call]
        self._answered_at = time.monotonic()
        self._down_until = 0.0
        if self._stale_logged:  # the outage that `_log_stale` told of is over
            log.info("origin answers again: metadata is asked of it as before")
            self._stale_logged = False
        return result

    def _silent(self) -> bool:
        """A metadata request has waited KNOWN_NAME_WAIT_S for its answer, and no request has been answered since it
        was sent: the origin takes requests and answers none (frozen), or is slower than that."""
        now = time.monotonic()
        return any(now - sent >= KNOWN_NAME_WAIT_S and sent > self._answered_at for sent in self._unanswered.values())

    @property
    def inode_count(self) -> int:
        """Inodes the kernel holds (its lookup count is above zero), the root included."""
        return len(self._nodes)

    def node(self, ino: int) -> Node:
        try:
            return self._nodes[ino]
        except KeyError:
            raise PathError(errno.ENOENT) from None

    def _node_for(self, path: str, is_dir: bool, meta: ObjectMeta | None, as_of: float | None = None) -> Node:
        """The node of a directory, or of the file version `meta` (asked of the bucket at `as_of`, monotonic;
        now if None): known for `ttl` from then, or for longer if a later answer said so. A directory is known to
        be there for `ttl` from `as_of`, and from nothing if None (its parent, by name alone)."""
        if not is_dir and meta is None:
            raise ValueError("a file node needs its object metadata")
        key = (path, None if is_dir else meta.etag)  # type: ignore[union-attr]
        ino = self._ino_by_path.get(key)
        if ino is None:
            ino = self._next_ino
            self._next_ino += 1
            self._ino_by_path[key] = ino
        node = self._nodes.get(ino)
        if node is None:
            node = self._nodes[ino] = Node(ino, path, is_dir)
            self._forgotten.pop(ino, None)  # an answer of the bucket's (or a listing's) is newer
        if is_dir and as_of is not None:
            node.fresh_until = max(node.fresh_until, as_of + self.ttl)
        if meta is not None:
            # A node is one version (path, ETag), whose mtime never steps back: a name a predecessor kept
            # (saved_names.py) may be dated later than the bucket's answer (a file it wrote, dated its close; a
            # listing's milliseconds that a daemon before B270 kept), and the bucket's answer came after it (B295).
            node.size, node.etag, node.mtime_ns = meta.size, meta.etag, max(node.mtime_ns, meta.mtime_ns)
            at = time.monotonic() if as_of is None else as_of
            if self._latest_file.get(path) != ino and at < self._news_since(path, meta.etag):  # type: ignore[union-attr]
                # An answer older than the newest one about the path (a listing begun before that HEAD, or a directory
                # handle's snapshot): this version was replaced since. Taken as current, the path went back to the old
                # size and bytes, and to the old inode number (the audit).
                if not node.superseded:
                    node.supersede()
                return node
            if at >= self._trusted_from(path):
                node.fresh_until = max(node.fresh_until, at + self.ttl)
            node.current_as_of = max(node.current_as_of, at)
            self._asked(path, at)
            self._latest_file[path] = ino
            node.held_again(at)
        return node

    def _asked(self, path: str, at: float) -> None:
        """Something was learnt of `path`'s current version as of `at` (monotonic)."""
        latest = self._latest_asked.get(path, 0.0)
        if at > latest:
            self._latest_asked[path] = at
            return
        refusal = self._refusals.get(path)
        if refusal is not None and refusal[1] == latest and at > refusal[2]:
            self._refusals[path] = (refusal[0], refusal[1], at)  # the newest date but the refusal's (`_news_since`)

    def _news_since(self, path: str, etag: str | None) -> float:
        """When the newest answer about `path` was asked, for an answer that found the version `etag` (None: nothing, or
        a directory): one asked before it is older news. A read's refusal that landed last (`gone`) counts only against
        the version refused: a lookup asked after that GET was sent, and landing after its 412, that found the new
        version was taken for older news (B652)."""
        latest = self._latest_asked.get(path, 0.0)
        refusal = self._refusals.get(path)
        if refusal is not None and refusal[1] == latest and refusal[0] != etag:
            return refusal[2]
        return latest

    def forget(self, ino: int, count: int) -> None:
        node = self._nodes.get(ino)
        if node is None or ino == ROOT_INODE:
            return
        node.lookups -= count
        if node.lookups <= 0:
            del self._nodes[ino]
            latest = self._latest_file.get(node.path) == ino
            if not node.is_dir and (node.superseded or not latest):  # an old version (see the module's rules)
                if self._ino_by_path.get((node.path, node.etag)) == ino:
                    del self._ino_by_path[(node.path, node.etag)]
                if latest:
                    del self._latest_file[node.path]
            elif not node.writing and (node.is_dir or node.etag):
                node.lookups = 0
                self._forgotten[ino] = node

    def forget_all(self) -> None:
        """At unmount: the kernel forgets everything."""
        for ino in list(self._nodes):
            if ino != ROOT_INODE:
                del self._nodes[ino]
        self._forgotten.clear()

    # -- versions ------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Runs the HEADs that `refresh_held` does not wait for, until cancelled (the mount's end)."""
        async with trio.open_nursery() as nursery:
            self._behind = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._behind = None

    def _asks_head(self, node: Node, force: bool = False) -> bool:
        """Whether `refresh` of this node asks the bucket a HEAD (its version is past the TTL)."""
        now = time.monotonic()
        fresh = now < node.fresh_until and not force
        return not (node.is_dir or node.writing or fresh or now < node.confirmed_at + ONE_CALL_S)

    async def refresh_held(self, node: Node) -> Node:
        """The attributes of a file that a descriptor holds open (a GETATTR), at once: its HEAD past the TTL runs
        behind the answer, shared with the opens and GETATTRs of the inode that wait for one (`refresh`), and the
        answer's attributes time out at once until it lands (operations `_attributes`). An answer is never changed by
        that HEAD: a version replaced or deleted keeps its attributes for the descriptors open on it (`refresh`), and
        a version's size and time are its ETag's. Waited for, the kernel's GETATTR before a READ of a file whose
        attributes were past the TTL (it asks one then) held the read for the HEAD's `--read-timeout` before the
        READ's own fetch had its own: two timeouts for one pread from a slow origin."""
        if self._behind is None or not self._asks_head(node):
            return await self.refresh(node)
        # One at a time per inode, HEADS_BEHIND in all: one not started now is asked at a later GETATTR (the kernel
        # asks one before each read while the answer's attributes have timed out), or by an open, which waits for it.
        if (node.ino not in self._behind_now and str(node.ino) not in self._refreshing_now
                and len(self._behind_now) < HEADS_BEHIND):
            self._behind_now.add(node.ino)
            self._behind.start_soon(self._refresh_behind, node)
        return node

    async def refresh_known(self, node: Node) -> Node:
        """The attributes of a file the kernel asks for (a GETATTR, a `stat` past the TTL), not held open: its HEAD is
        waited for KNOWN_NAME_WAIT_S at most (none while the origin is `_silent`), going on behind; then what is known
        is answered, timing out at once (operations `_attributes`). An open waits for its HEAD (`refresh`). On a
        frozen origin, each `stat` of an `ls -l` past the TTL waited its HEAD's --read-timeout (B1002)."""
        if self._behind is None or not self._asks_head(node):
            return await self.refresh(node)
        try:
            answered = await self._known_first(self._refreshing_now, str(node.ino), lambda: self._refresh(node))
        except AccessDenied as exc:
            return self._denied(node, exc)
        return node if answered is None else answered

    async def _refresh_behind(self, node: Node) -> None:
        try:
            await self.refresh(node)
        except Exception as exc:  # noqa: BLE001 - a failure here must not end the mount; the next GETATTR asks again
            log.debug("%s: the HEAD behind a GETATTR of a file held open failed: %s", node.path, exc)
        finally:
            self._behind_now.discard(node.ino)

    async def refresh(self, node: Node, *, opening: bool = False, force: bool = False) -> Node:
        """Make a file node's size/etag at most `ttl` old (HEAD). A key replaced or deleted in the bucket leaves
        the node as it was, superseded: descriptors open on it keep their attributes (an fstat, and the GETATTR
        the kernel sends before a read once attributes are old) and read what is cached of it, as those of an
        unlinked file do; opens of it get ESTALE, and the path's next lookup what the bucket holds now. (A
        deletion answered ENOENT here: read() and fstat() on a file held open failed with ENOENT.)
        A HEAD refused (AccessDenied: credentials expired or rotated, a policy changed since the mount) leaves a
        known version's attributes as they were too, and asked again next time, as a local file's descriptor
        outlives a chmod: fstat() and read() of pages the kernel held failed with EACCES. Not for an open
        (`opening`), which is refused. `force`: asked within the TTL too (a rewrite that counts on the file being
        empty, `Writes.open_existing`)."""
        if not self._asks_head(node, force or (opening and node.unchecked)):
            return node
        try:
            # Opens of one file at once (8 ranks and a shard) share one HEAD, as lookups of one name do.
            return await _shared(self._refreshing_now, str(node.ino), lambda: self._refresh(node))
        except AccessDenied as exc:
            if opening or not node.etag:
                raise
            return self._denied(node, exc)

    def _denied(self, node: Node, exc: AccessDenied) -> Node:
        """A HEAD of a known file refused (`refresh`): it keeps its attributes, asked again next time."""
        if not node.etag:
            raise exc
        log.log(logging.DEBUG if self._denied_logged else logging.WARNING, "%s; %s keeps its attributes for "
                "the descriptors open on it%s", exc.message, node.path,
                "" if self._denied_logged else " (further such refusals are logged at debug level)")
        self._denied_logged = True
        return node

    async def _refresh(self, node: Node) -> Node:
        asked = time.monotonic()
        try:
            meta = await self._call(self._store.head, self.prefix + node.path)
        except (Unreachable, TransientError) as exc:
            if not node.etag:
                raise
            # The origin is down or overloaded: keep serving the version we know (its chunks may
            # all be cached), and ask again a little later rather than on every call.
            self._log_stale(exc)
            node.fresh_until = time.monotonic() + min(self.ttl, STALE_RETRY)
            return node
        if meta is None and not node.etag:
            # Never stored (a new file that failed, or was unlinked while written): descriptors still open on it keep
            # its attributes, as those of a deleted file do (fstat and lseek(SEEK_END) of them got ENOENT); its name
            # is gone from the kernel, and an open of the inode gets ESTALE, then ENOENT at its lookup.
            node.supersede()
            return node
        if ((meta is None or meta.etag != node.etag) and not node.superseded and asked < node.current_as_of
                and self._latest_file.get(node.path) == node.ino):
            # Asked before the newest answer about the path, which found this version current (a lookup's HEAD sent
            # after it): older news, which supersedes nothing. Taken as the bucket's word, opens of the current file
            # were ESTALE for the TTL (B322; B306's rule). Only an answer that found this version: a read of an older
            # one refused since (`gone`) is no such answer, and this one's news of a newer version was lost (B350).
            return node
        node.fresh_until = time.monotonic() + self.ttl if asked >= self._trusted_from(node.path) else 0.0
        self._asked(node.path, asked)
        if meta is None or meta.etag != node.etag:
            self._supersede(node)
            self._changed_beside(node.path, node.current_as_of)
            # Kept as it was, a remount while the origin is away served the version this HEAD found gone.
            found = (False, meta) if meta is not None else None
            self._found(node.path, found, asked)
            if asked >= self._news_since(node.path, meta.etag if meta is not None else None):
                self._found_in_listings(node.path, found, asked)
            return node
        if node.held_again(asked):
            self._latest_file[node.path] = node.ino
        if not node.superseded:
            node.current_as_of = max(node.current_as_of, asked)
        node.confirmed_at = time.monotonic()
        node.unchecked = False
        return node

    def _supersede(self, node: Node) -> None:
        """The bucket holds another version of this path (or none): this inode stays the old version, and the
        path's next lookup gets a new inode. The parent's listing still names the old version, so it goes too."""
        node.supersede()
        self._listings.pop(node.path.rpartition("/")[0], None)

    def gone(self, version: ObjectVersion) -> tuple[tuple[int, bytes] | None, list[tuple[int, bytes]]]:
        """The bucket no longer holds `version`: a GET pinned to its ETag was refused (412: replaced) or found
        nothing (404: deleted). Its inode is superseded at once, whatever the TTL, so the next open of it gets
        ESTALE and the kernel looks the path up again; the parent's listing, which names it, goes too. The
        kernel's entries to drop, (parent inode, name): the path's, if the kernel knows the parent, and those of the
        files beside it where this is news of a change in their directory (`_changed_beside`)."""
        if not version.key.startswith(self.prefix):
            return None, []
        path = version.key[len(self.prefix):]
        # Dated as it lands, against this version (`_news_since`): an answer asked before that finds it is older news.
        # (Where the newest date is a refusal of another version, that one's date stays the one to be newer than.)
        landed, latest, refusal = time.monotonic(), self._latest_asked.get(path, 0.0), self._refusals.get(path)
        before = refusal[2] if refusal is not None and refusal[1] == latest and refusal[0] == version.etag else latest
        self._asked(path, landed)
        self._refusals[path] = (version.etag, landed, before)
        ino = self._ino_by_path.get((path, version.etag))
        node = self._nodes.get(ino) if ino is not None else None
        if node is not None and not node.writing:
            self._supersede(node)
        if ino is not None:
            self._forgotten.pop(ino, None)
        self._listings.pop(path.rpartition("/")[0], None)  # also when the kernel has forgotten the inode
        news = self._changed_beside(path, node.current_as_of if node is not None else latest)
        if self.saved is not None:
            self.saved.gone(path, version.etag)
        self._negative.pop(path, None)
        return self.kernel_entry(path), self._kernel_entries_beside(path) if news else []

    def _changed_beside(self, path: str, known_as_of: float) -> bool:
        """The mount learnt that the version it knew of `path` is no longer the bucket's (a read's 412 or 404, a HEAD):
        the other files of its directory are asked again at their next open (a HEAD each), whatever the TTL, and the
        names found missing there looked up again. A model's shards are pushed together: kept for the TTL (for good
        with `forever`), the shards whose chunks were cached kept opening as the old revision while the others opened
        as the new one, and a reload after the read that found the push loaded a model of two revisions. Descriptors
        open keep their version; the kernel's entries of those files go (`gone`).

        Only news does this: a change of a version the mount had found current (`known_as_of`, when it was last
        asked) after the directory's last such change. The others are the same push found file by file, which that
        change already made be asked again: each swept every node the mount holds, so a reload after a push of a
        10,000-file directory cost 10,000 sweeps of them all. Whether it was news."""
        parent = path.rpartition("/")[0]
        if known_as_of < self._dirs_changed.get(parent, 0.0):
            return False
        now = time.monotonic()
        self._dirs_changed[parent] = now
        for node in self._nodes.values():
            if not (node.is_dir or node.writing or node.superseded) and node.path.rpartition("/")[0] == parent:
                node.fresh_until = min(node.fresh_until, now)
                node.confirmed_at = 0.0
        for missing in [p for p in self._negative if p.rpartition("/")[0] == parent]:
            self._negative.pop(missing, None)
        return True

    def _trusted_from(self, path: str) -> float:
        """An answer about the file `path` asked before this (monotonic) is not trusted past now: the mount learnt of a
        change in its directory since (`_changed_beside`)."""
        return self._dirs_changed.get(path.rpartition("/")[0], 0.0)

    def _kernel_entries_beside(self, path: str) -> list[tuple[int, bytes]]:
        """The kernel's entries, (parent inode, name), of the other files of `path`'s directory it holds, for it to
        drop after `gone`: their attributes were given for the TTL (for good with `forever`), and a `stat` showed the
        old revision's size after an open had found the new one."""
        parent = path.rpartition("/")[0]
        parent_ino = self._ino_by_path.get((parent, None))
        if parent_ino is None or parent_ino not in self._nodes:
            return []
        names = {node.path.rpartition("/")[2] for node in self._nodes.values()
                 if not node.is_dir and node.path != path and node.path.rpartition("/")[0] == parent}
        return [(parent_ino, name.encode("utf-8", "surrogateescape")) for name in sorted(names)]

    def kernel_entry(self, path: str) -> tuple[int, bytes] | None:
        """The kernel's entry of `path`, (parent inode, name), for it to drop; None if the kernel does not know the
        parent."""
        parent, _, name = path.rpartition("/")
        parent_ino = self._ino_by_path.get((parent, None))
        if parent_ino is None or parent_ino not in self._nodes:
            return None
        return parent_ino, name.encode("utf-8", "surrogateescape")

    async def open_file(self, ino: int) -> ObjectVersion:
        """The version an open of this inode reads: its own, refreshed. ESTALE when the bucket now holds
        another version, which makes the kernel look the path up again (LOOKUP_REVAL) and open the new
        version's inode instead."""
        node = self.node(ino)
        if node.is_dir:
            raise PathError(errno.EISDIR)
        node = await self.refresh(node, opening=True)
        if node.superseded:
            raise PathError(errno.ESTALE)
        return node.version(self.prefix)

    async def open_dir(self, ino: int) -> tuple[list[DirEntry], float]:
        """The entries a directory handle lists from opendir to releasedir, and when their listing began
        (for `entry_node`)."""
        node = self.node(ino)
        if not node.is_dir:
            raise PathError(errno.ENOTDIR)
        return await self._listing(node)

    # -- names ---------------------------------------------------------------------------------

    def _skip(self, key: str | bytes, reason: str, skipped: list[int], *, prefix: bool = False) -> None:
        """Log once that a key (or, `prefix`, every key under a common prefix of a listing) is not shown: the
        first SKIPS_NAMED_PER_LISTING of a listing by name, the others in `_skips_counted` (`skipped[0]` counts
        them all, for this listing)."""
        skipped[0] += 1
        shown = key if isinstance(key, str) else repr(key)
        if skipped[0] > SKIPS_NAMED_PER_LISTING or shown in self._skips_logged:
            return
        self._skips_logged[shown] = True
        log.warning("skipping %s %r: %s (the kernel cannot represent it)", "keys under" if prefix else "key", shown,
                    reason)

    def _skips_counted(self, prefix: str, skipped: int) -> None:
        """One line for the keys of a listing skipped beyond those named, when their number changes. A
        directory of 12,000 such keys logged every one at every listing (the memory of keys logged holds
        SKIP_LOG_MEMORY), 14 MB of log in 10 s."""
        unnamed = skipped - SKIPS_NAMED_PER_LISTING
        if unnamed <= 0 or self._skips_logged.get(prefix) == unnamed:
            return
        self._skips_logged[prefix] = unnamed
        log.warning("skipping %d more keys under %r that the kernel cannot represent (not named one by one)",
                    unnamed, prefix)

    def _hidden(self, key: str, hidden: list[int] | None = None) -> None:
        """Log once that the file `key` is not shown because keys under `key/` make its name a directory, which wins.
        Without it, a file that was in the bucket was missing from `ls`, `cp -r` and `modelfs prefetch` with no word
        anywhere of why (B570). A listing's (`hidden[0]` counts them) are named as its skipped keys are: the first
        SKIPS_NAMED_PER_LISTING, the rest in `_hiddens_counted` (a directory of more than SKIP_LOG_MEMORY of them
        logged each one at every listing, B632)."""
        if hidden is not None:
            hidden[0] += 1
            if hidden[0] > SKIPS_NAMED_PER_LISTING:
                return
        if key in self._hidden_logged:
            return
        self._hidden_logged[key] = True
        log.info("key %r is not shown: keys under %r make its name a directory, which wins over the file (rename "
                 "one of them in the bucket to see both)", key, key + "/")

    def _hiddens_counted(self, prefix: str, hidden: int) -> None:
        """One line for the files of a listing hidden by directories beyond those named, when their number changes."""
        unnamed = hidden - SKIPS_NAMED_PER_LISTING
        if unnamed <= 0 or self._hidden_logged.get(prefix) == unnamed:
            return
        self._hidden_logged[prefix] = unnamed
        log.info("%d more keys under %r are not shown (not named one by one): keys under each one's name make it a "
                 "directory, which wins over the file", unnamed, prefix)

    @staticmethod
    def _join(parent: str, name: str) -> str:
        return f"{parent}/{name}" if parent else name

    def _dir_prefix(self, path: str) -> str:
        return self.prefix + path + "/" if path else self.prefix

    async def lookup(self, parent_ino: int, name_b: bytes) -> Node:
        """Resolve one name; increments the lookup count of the returned node."""
        node = await self.resolve(parent_ino, name_b)
        held = self._nodes.get(node.ino)
        if held is None:
            # A FORGET took it while this lookup waited for another's answer (`_shared`): the kernel holds it again
            # once this reply arrives. (Counted on the removed node, the kernel's next OPEN or GETATTR of it got
            # ENOENT.) Its version is known by its number again, unless a newer lookup gave it another meanwhile.
            self._nodes[node.ino] = node
            self._ino_by_path.setdefault((node.path, None if node.is_dir else node.etag), node.ino)
            self._forgotten.pop(node.ino, None)  # (`_known_while_down` answers from those)
        elif held is not node:
            node = held  # forgotten and made again meanwhile: the one the table has is current
        node.lookups += 1
        return node

    async def resolve(self, parent_ino: int, name_b: bytes) -> Node:
        """Resolve one name (ENOENT if there is none) without counting a lookup."""
        parent = self.node(parent_ino)
        name = child_name(parent, name_b, errno.ENOENT)
        if name == ".":
            node = parent
        elif name == "..":
            node = self.parent_of(parent)
        else:
            if invalid_segment_reason(name) is not None:
                # The kernel passes names up to 1024 bytes: a longer one than any file here can have is "File
                # name too long", as on a local file system.
                raise PathError(errno.ENAMETOOLONG if len(name_b) > NAME_MAX else errno.ENOENT)
            node = await self._resolve(parent, name_b, name)
        return node

    def parent_of(self, node: Node) -> Node:
        """The directory holding `node` (the root's is the root)."""
        parent_path = node.path.rpartition("/")[0]
        return self._node_for(parent_path, True, None)

    async def _resolve(self, parent: Node, name_b: bytes, name: str) -> Node:
        path = self._join(parent.path, name)
        pending = self._pending.get(path)
        if pending is not None:
            return pending
        listing = self._listings.get(parent.path)
        if listing is not None:
            entry = listing.get(name_b)
            if entry is None:
                raise PathError(errno.ENOENT)
            node = self._node_for(path, entry.is_dir, entry.meta, listing.at)
            if not node.superseded:
                return node
            # The listing began before this version was replaced (it was under way when the mount learnt so, and
            # landed after): it no longer says what the bucket holds. Answered from it, every open of the path got
            # ESTALE, and the kernel's retry the same inode, for the TTL (for good with `forever`).
            self._listings.pop(parent.path, None)
            self.forget(node.ino, 0)  # made for this answer only, if the kernel does not hold it
        if path in self._negative:
            raise PathError(errno.ENOENT)
        if self._behind is None or not self._knows(path):
            return await _shared(self._resolving_now, path, lambda: self._ask_bucket(path))
        answered = await self._known_first(self._resolving_now, path, lambda: self._ask_bucket(path))
        if answered is not None:
            return answered
        known = self._known_while_down(path, TimedOut(f"no answer within {KNOWN_NAME_WAIT_S:g}s"), {}, waiting=True)
        if known is None:
            return await _shared(self._resolving_now, path, lambda: self._ask_bucket(path))
        return known

    def _knows(self, path: str) -> bool:
        """Whether the mount may answer `path` from what it knows while the origin does not answer (a node, a name of
        the last listing of its directory, one a predecessor kept): `_known_while_down` decides which, if any."""
        parent, _, name = path.rpartition("/")
        listing = self._last_listings.get(parent)
        return ((path, None) in self._ino_by_path or path in self._latest_file
                or (listing is not None and name.encode("utf-8", "surrogateescape") in listing)
                or (self.saved is not None and self.saved.entry(path) is not None))

    async def _known_first(self, table: dict[str, _InFlight[T]], key: str,
                           make: Callable[[], Awaitable[T]]) -> T | None:
        """`make()`, shared in `table` (the one in flight for `key`, or one started now in `run`'s nursery), waited for
        KNOWN_NAME_WAIT_S at most, and not at all while the origin is `_silent` (none is started then); None if it has
        not answered by then: the caller answers what the mount knows, and the request goes on behind, its answer
        changing the tree as every answer does when it lands. With KNOWN_BEHIND already under way, it is waited for, as
        any other request is."""
        silent = self._silent()
        flight = table.get(key)
        if flight is None and not silent and self._behind is not None:
            if self._known_behind >= KNOWN_BEHIND:
                return await _shared(table, key, make)
            # In the table and counted now, before any other task runs: two GETATTRs of one file at once each started
            # a HEAD, and the second's, its entry dropped by the first's end, never told its waiters (an open hung).
            flight = table[key] = _InFlight()
            self._known_behind += 1
            self._behind.start_soon(self._fly_behind, table, key, flight, make)
        if flight is None:
            return None
        with trio.move_on_after(0.0 if silent else KNOWN_NAME_WAIT_S):
            await flight.done.wait()
        if flight.error is not None:
            raise flight.error
        return flight.result  # None: not come yet, or cancelled (the mount ends)

    async def _fly_behind(self, table: dict[str, _InFlight[T]], key: str, flight: _InFlight[T],
                          make: Callable[[], Awaitable[T]]) -> None:
        """`make()` in `run`'s nursery as `flight`, put in `table` and counted in `_known_behind` by `_known_first`."""
        try:
            await _fly(table, key, flight, make)
        except Exception as exc:  # noqa: BLE001 - kept for those waiting for it; it must not end the mount
            log.debug("%s: a request that went on behind its caller failed: %s", key, exc)
        finally:
            self._known_behind -= 1

    async def _ask_bucket(self, path: str) -> Node:
        """What the bucket holds at `path` (HEAD and a one-key listing at once): a file, a directory, or ENOENT."""
        key = self.prefix + path
        # A small directory listed before is listed again instead: its listing answers both, as of when it began.
        relisted = await self._relisted(path)
        if relisted is not None:
            asked, results = relisted
        else:
            asked = time.monotonic()  # what the answers say is true as of when they were asked (see _node_for)
            results = await at_once({"meta": lambda: self._call(self._store.head, key),
                                     "dir": lambda: self._call(self._store.has_children, key + "/")})
        if results.get("dir"):  # a key that is both a file and a prefix: the directory wins (whatever the HEAD said)
            if results.get("meta") is not None:
                self._hidden(key)
            self._found(path, (True, None), asked)
            if asked >= self._news_since(path, None):
                self._found_in_listings(path, (True, None), asked)
            return self._node_for(path, True, None, asked)
        for name in ("meta_error", "dir_error"):
            if name in results:
                known = self._known_while_down(path, results[name], results)
                if known is not None:
                    return known
                raise results[name]
        if results["meta"] is not None:
            self._found(path, (False, results["meta"]), asked)
            node = self._node_for(path, False, results["meta"], asked)
            if not node.superseded:
                node.confirmed_at = time.monotonic()
            if asked >= self._news_since(path, results["meta"].etag):  # (`_node_for` dated it, unless newer news)
                self._found_in_listings(path, (False, results["meta"]), asked)
            return node
        self._found(path, None, asked)
        if asked >= self._news_since(path, None):
            # Not when a newer answer about the path is known (a HEAD of its inode, this mount's write of it): cached,
            # this older one made the path ENOENT for the TTL, a file the newest answer found there (B307).
            self._negative[path] = True
            self._found_in_listings(path, None, asked)
        raise PathError(errno.ENOENT)

    async def _relisted(self, path: str) -> tuple[float, dict[str, Any]] | None:
        """What a new listing of `path`'s directory says of it, as `_ask_bucket`'s answers (when it began, and what the
        HEAD and the one-key listing would say), where the directory's last listing has expired and was small
        (RELIST_ENTRIES). None: asked by name instead (the directory not listed before, or bigger; TTL 0, where an open
        asks its own HEAD; the listing failed, whose errors the asking by name then has, and answers in an outage; or
        it began before a newer answer about the path, or a change learnt in its directory)."""
        parent, _, name = path.rpartition("/")
        kept = self._last_listings.get(parent)
        if self.ttl <= 0 or kept is None or len(kept) > RELIST_ENTRIES:
            return None
        try:
            listing = await self._list_shared(parent)
        except StoreError:
            return None
        name_b = name.encode("utf-8", "surrogateescape")
        entry = listing.get(name_b)
        if entry is None and name_b in kept:
            # Gone since the listing before, which now is no longer the one kept (`_found_in_listings` compares with
            # that): dated, as the lookup by name dates it, or a directory handle's snapshot of the listing before
            # handed the deleted version out as current (B383).
            self._asked(path, listing.at)
        meta = entry.meta if entry is not None and not entry.is_dir else None
        # Nor one begun before the mount learnt of a change beside the path (`_trusted_from`): shared with a listing
        # under way then, a lookup took the version it named as just confirmed, and the open after it asked no HEAD
        # (the old revision of a pushed model, B1260).
        if listing.at < max(self._news_since(path, meta.etag if meta is not None else None), self._trusted_from(path)):
            return None
        return listing.at, {"meta": meta, "dir": entry is not None and entry.is_dir}

    def _found_in_listings(self, path: str, found: tuple[bool, ObjectMeta | None] | None, asked: float) -> None:
        """An answer asked at `asked` (monotonic), the newest about `path` (a lookup's, a HEAD of its inode's), found
        there a directory (True, None), a file's version (False, meta) or nothing (None): the listings of its directory
        begun before no longer say what the bucket holds of it where they say otherwise."""
        parent, _, name = path.rpartition("/")
        name_b = name.encode("utf-8", "surrogateescape")
        entry = DirEntry(name_b, *found) if found is not None else None
        # A listing of the directory begun before this answer that says otherwise of the name is older news of it.
        # Undated, one under way brought a file found gone back when it landed, looked up and kept in the names kept as
        # the version found deleted; one that landed first answered the name from the cache for the TTL (B351). So is
        # the last listing kept, if it names the file: a directory handle's snapshot of it handed the kernel the
        # version found deleted as current, by readdirplus (B383). Dated only then: every ENOENT dated (an
        # `import`'s probes of sys.path) evicted the dates of files that older answers need (`LATEST_ASKED_ENTRIES`);
        # a path dated before is dated again (`in` leaves the LRU order as it is, and adds no date).
        # (A version found is dated by `_node_for` or `_refresh`.)
        listing = self._listings.get(parent)
        if listing is not None and listing.at < asked and not same_version(listing.get(name_b), entry):
            self._listings.pop(parent, None)
        kept = self._last_listings.get(parent)
        # The listing kept for outages (the same dict as the one just dropped, or an expired one) answers `ls` and
        # lookups only while the origin is away: as this answer said, as the names kept do (`_found`). Left as it was,
        # a file deleted by another writer came back in `ls` and `stat` once the origin was away (B381; found by a HEAD
        # of its inode, B450); one replaced was EIO where the kernel had forgotten it (B500), one created was missing
        # from `ls` (B501).
        said_otherwise = kept is not None and kept.at < asked and not same_version(kept.get(name_b), entry)
        if kept is not None and said_otherwise:
            kept.found(name_b, entry, asked)
            # Uncounted, the names lookups added grew the listings kept past LISTING_CACHE_ENTRIES, their share of the
            # memory limit (B521).
            self._recount_kept(parent, kept)
        if entry is None and (said_otherwise or parent in self._lists_under_way or path in self._latest_asked):
            # Dated too where an answer about the path was: undated, an older HEAD of its inode landing after found a
            # version there, which the listing kept (and the names kept) took over this newer nothing (B520).
            self._asked(path, asked)
        if parent in self._lists_under_way:
            self._found_while_listed.setdefault(parent, {})[name_b] = (asked, entry)

    def _recount_kept(self, parent: str, kept: Listing) -> None:
        """The listing kept for outages of `parent`, `kept`, had names added or dropped: stored again, as cachetools
        counts a listing's size when it is stored (or dropped if now too big, as `_keep` keeps none such). Only that
        cache: it has no TTL to restart, where storing the cached listing again (`_listings`) would restart its TTL."""
        if self._last_listings.get(parent) is not kept:
            return
        if len(kept) <= LISTING_CACHE_ENTRIES:
            self._last_listings[parent] = kept
        else:
            del self._last_listings[parent]

    def _found(self, path: str, entry: tuple[bool, ObjectMeta | None] | None, asked: float | None = None) -> None:
        """What the bucket (or a change through this mount) says is at `path` now, for the names kept: a directory
        (True, None), a file's version (False, meta), or nothing; as asked at `asked` (monotonic; now if None)."""
        if asked is not None and asked < self._news_since(path, entry[1].etag if entry is not None and entry[1] else
                                                          None):
            # Asked before the newest answer about the path (a HEAD of the held inode, this mount's own write): older
            # news, which changes nothing that answer would contradict. It supersedes no node the kernel holds (B306),
            # drops no node kept of one it forgot (B323: while the origin was away, the name the newest answer found
            # was EIO), and keeps no name (B324: a remount while the origin was away served the older version).
            return
        if self.saved is not None:
            self.saved.found(path, entry)
        for ino in (self._ino_by_path.get((path, None)), self._latest_file.get(path)):
            forgotten = self._forgotten.get(ino) if ino is not None else None
            node = forgotten if forgotten is not None else self._nodes.get(ino) if ino is not None else None
            if node is None or not (entry is None or entry[0] != node.is_dir or
                                    (entry[1] is not None and entry[1].etag != node.etag)):
                continue
            if forgotten is not None:
                del self._forgotten[ino]
            elif not node.is_dir and not node.writing and not node.superseded:
                # A file the kernel holds (a descriptor open on it), found gone by a lookup: superseded, as a HEAD of
                # the inode finding so makes it (`refresh`). Left current, it was kept once the kernel forgot it, and
                # while the origin was away its name resolved as the version found gone (B304).
                node.supersede()
        latest = self._latest_file.get(path) if entry is None else None
        if latest is not None and not (latest in self._nodes and self._nodes[latest].writing):
            # No version is the path's latest now: `_node_for` takes an older answer (a listing begun before this one)
            # as news against every version. Left, a listing under way brought back the version found deleted, the
            # kernel having forgotten it: `stat` found it for the TTL (B380).
            del self._latest_file[path]

    def _known_while_down(self, path: str, exc: BaseException, answered: dict[str, Any], *,
                          waiting: bool = False) -> Node | None:
        """While the origin is unreachable, a name the mount already knows keeps resolving: as what the request of
        `_ask_bucket` that did answer says, if one did (`answered`). Unchecked, a throttled listing beside a HEAD that
        found the file deleted answered it from the names a predecessor kept, origin up. `waiting`: the bucket's answer
        is still to come (`_known_first`): nothing logged, and the node unchecked."""
        if not isinstance(exc, (Unreachable, TransientError)):
            return None

        def agrees(is_dir: bool, etag: str) -> bool:
            # The one-key listing, answered, found nothing under the path (a directory it would have answered); the
            # HEAD says which file is there, if any.
            if is_dir:
                return "dir" not in answered
            return "meta" not in answered or (answered["meta"] is not None and answered["meta"].etag == etag)

        # A listing of the directory begun after the newest answer about the path is newer news than a node the
        # kernel forgot: that listing decides (below). Answered from the node, a file deleted, replaced or made a
        # directory since, as `ls` had said, resolved as the version the mount learnt was gone (B247).
        listing = self._last_listings.get(path.rpartition("/")[0])
        listed_since = listing is not None and listing.at > self._latest_asked.get(path, 0.0)
        for ino in (self._ino_by_path.get((path, None)), self._latest_file.get(path)):
            # One the kernel holds, or one it forgot (B246: a file found by its HEAD, its inode dropped since).
            node = self._nodes.get(ino) if ino is not None else None
            if node is None and ino is not None and not listed_since:
                node = self._forgotten.get(ino)
            # Not a version found replaced (a 412, a HEAD) while the kernel still holds it: its open is ESTALE, and so
            # was the kernel's retry, answered the same way (ESTALE reached the reader).
            if (node is not None and not node.superseded and (node.is_dir or node.etag)
                    and agrees(node.is_dir, node.etag)):
                break
        else:
            # A name of the last listing of its directory that the kernel has forgotten (a file read an hour ago,
            # its dentry dropped since): `ls` showed it, and its chunks may all be in the NVMe cache.
            # Else one a predecessor of this daemon knew (saved_names.py: a remount while the origin is away).
            parent, _, name = path.rpartition("/")
            name_b = name.encode("utf-8", "surrogateescape")
            listing = self._last_listings.get(parent)
            entry = listing.get(name_b) if listing is not None else None
            kept = self.saved.entry(path) if entry is None and self.saved is not None else None
            if entry is not None:
                # As of the answer that found it after the listing began, if one did (`Listing.found`): as of the
                # listing, a version a HEAD found replacing the one listed was older news than that HEAD (B500).
                news = listing.found_since.get(name_b) if listing.found_since else None  # type: ignore[union-attr]
                is_dir, meta = entry.is_dir, entry.meta
                as_of = news[0] if news is not None else listing.at  # type: ignore[union-attr]
            elif kept is not None:
                (is_dir, meta), as_of = kept, 0.0  # older news than anything this process learns
            else:
                return None
            if not (is_dir or meta) or not agrees(is_dir, meta.etag if meta is not None else ""):
                return None
            node = self._node_for(path, is_dir, meta, as_of)
            if node.superseded:
                self.forget(node.ino, 0)
                return None
        if waiting:
            node.unchecked = not node.is_dir
        else:
            self._log_stale(exc)
        node.fresh_until = time.monotonic() + min(self.ttl, STALE_RETRY)
        return node

    def _log_stale(self, exc: StoreError) -> None:
        if not self._stale_logged:
            log.warning("origin unavailable (%s); serving cached metadata until it returns", exc.message)
            self._stale_logged = True

    # -- listings ------------------------------------------------------------------------------

    async def listing(self, node: Node) -> list[DirEntry]:
        """Entries of a directory, from the TTL cache or one paginated delimited listing."""
        return (await self._listing(node))[0]

    async def _listing(self, node: Node) -> tuple[list[DirEntry], float]:
        """`listing`, and when that listing began (monotonic)."""
        cached = self._listings.get(node.path)
        kept = self._last_listings.get(node.path)
        if cached is None:
            try:
                if kept is None or self._behind is None:
                    cached = await self._list_shared(node.path)
                else:
                    # An expired listing is answered after KNOWN_NAME_WAIT_S at most, the listing going on behind
                    # (B1002).
                    cached = await self._known_first(self._listing_now, node.path,
                                                     lambda: self._list_and_keep(node.path))
                    if cached is None:
                        return self._with_pending(node.path, kept), kept.at
            except (Unreachable, TransientError) as exc:
                # An expired listing beats none while the origin is away; one a predecessor of this daemon made
                # (saved_names.py) beats none too.
                cached = self._last_listings.get(node.path)
                if cached is None:
                    cached = self._saved_listing(node.path)
                if cached is None:
                    raise
                self._log_stale(exc)
                return self._with_pending(node.path, cached), cached.at
        return self._with_pending(node.path, cached), cached.at

    def _saved_listing(self, path: str) -> Listing | None:
        """The listing of `path` the names kept hold (a predecessor's), as of 0.0: older than anything this process
        learns; kept with the expired ones from then on."""
        kept = self.saved.listing(path) if self.saved is not None else None
        if kept is None:
            return None
        listing = Listing(0.0)
        for name, (is_dir, meta) in kept.items():
            name_b = name.encode("utf-8", "surrogateescape")
            listing[name_b] = DirEntry(name_b, is_dir, meta)
        self._last_listings[path] = listing
        return listing

    def _keep(self, path: str, entries: Listing) -> None:
        """Cache a directory's listing, unless it alone is bigger than the whole cache (cachetools refuses
        it: such a directory is listed anew by every opendir, and still listed)."""
        if len(entries) <= LISTING_CACHE_ENTRIES:
            self._listings[path] = entries
            self._last_listings[path] = entries
            if entries.found_since:
                # Kept for outages as the answers asked since it began said (names found gone left out, B381; a newer
                # version or a name found, B500, B501), as `_found_in_listings` patches one kept before; cached whole,
                # as B351 leaves it (a copy: one listing's state, while the origin answers). The copy costs a
                # listing's entries again, for a listing a change by another writer raced only.
                kept = self._last_listings[path] = Listing(entries.at)
                kept.update(entries)
                for name_b, (asked, entry) in entries.found_since.items():
                    kept.found(name_b, entry, asked)
        if self.saved is not None:
            # A name some answer asked after this listing began told of keeps what that answer said (B325).
            self.saved.listed(path, entries,
                              lambda name, etag: self._news_since(self._join(path, name), etag) > entries.at)

    def _with_pending(self, path: str, entries: dict[bytes, DirEntry]) -> list[DirEntry]:
        """A directory's entries and the files being written in it (which no listing has yet)."""
        out = list(entries.values())
        for pending in self._pending.values():
            parent, _, name = pending.path.rpartition("/")
            name_b = name.encode("utf-8", "surrogateescape")
            if parent == path and name_b not in entries:
                out.append(DirEntry(name_b, False, None))
        return out

    async def files_beside(self, node: Node) -> list[tuple[int | None, ObjectVersion]]:
        """Files in the same directory as `node`, by name: (inode if the kernel knows it, version)."""
        parent_path = node.path.rpartition("/")[0]
        entries = self._listings.get(parent_path)
        if entries is None:
            entries = await self._list_shared(parent_path)
        out = []
        for name_b in sorted(entries):
            entry = entries[name_b]
            if entry.is_dir or entry.meta is None:
                continue
            version = ObjectVersion(entry.meta.key, entry.meta.etag, entry.meta.size)
            out.append((self.kernel_ino(version), version))
        return out

    def kernel_ino(self, version: ObjectVersion) -> int | None:
        """The inode of this object version if the kernel has looked it up (and not forgotten it), else None."""
        if not version.key.startswith(self.prefix):
            return None
        ino = self._ino_by_path.get((version.key[len(self.prefix):], version.etag))
        known = self._nodes.get(ino) if ino is not None else None
        return ino if known is not None and known.lookups > 0 else None

    async def _list_shared(self, path: str) -> Listing:
        """`_list`, kept (`_keep`), or the one of the same directory already in flight."""
        return await _shared(self._listing_now, path, lambda: self._list_and_keep(path))

    async def _list_and_keep(self, path: str) -> Listing:
        """`_list`, kept by the task that ran it, as it lands. Kept again by each task that had waited for it, as it
        woke, the listing came back over what an answer that landed in between had found: a name found gone was back in
        `ls` while the origin was away (B502)."""
        entries = await self._list(path)
        self._keep(path, entries)
        return entries

    async def _list(self, path: str) -> Listing:
        started = self._seq
        under_way = self._lists_under_way.setdefault(path, [])
        under_way.append(started)
        try:
            entries = await self._list_pages(path)
            found = self._found_while_listed.get(path)
        except BaseException:
            if under_way == [started]:
                self._changes.pop(path, None)  # kept for this listing alone, which failed
            raise
        finally:
            under_way.remove(started)
            if not under_way:
                del self._lists_under_way[path]
                self._found_while_listed.pop(path, None)
        self._patch(path, entries, started)
        if found:
            # After `_patch`: a change through this mount since such an answer is newer news (tree_changes `_change`).
            entries.found_since = {name_b: (asked, entry) for name_b, (asked, entry) in found.items()
                                   if asked > entries.at and not same_version(entries.get(name_b), entry)} or None
        for name_b, entry in entries.items():
            if not entry.is_dir:
                self._refresh_known(self._join(path, name_b.decode("utf-8")), entry.meta, entries.at)
        return entries

    async def _list_pages(self, path: str) -> Listing:
        """Every page of one delimited listing of `path`, as the bucket gives it."""
        prefix = self._dir_prefix(path)
        skipped, hidden = [0], [0]
        # One call per page, so each page gets the store call's timeout; a failure on any page fails the
        # whole listing (nothing partial is cached or served).
        pages = self._store.list_pages(prefix)
        entries = Listing(time.monotonic())
        page: ListingPage | None = None
        # Stops at the last page: one more call would only end the iterator, yet count as a metadata request.
        while not (page and page.last) and (page := await self._call(listing_page, pages, prefix)) is not None:
            for raw in page.undecodable:
                self._skip(raw, "not valid UTF-8", skipped)
            for meta in page.objects:
                if not meta.key.startswith(prefix):
                    self._skip(meta.key, "outside the prefix listed", skipped)
                    continue
                name = meta.key[len(prefix):]
                if name == "":
                    continue  # the directory's own marker object ("dir/")
                reason = invalid_segment_reason(name)
                if reason:
                    self._skip(meta.key, reason, skipped)
                    continue
                name_b = name.encode("utf-8", "surrogateescape")
                if name_b not in entries:  # a directory of the same name wins
                    entries[name_b] = DirEntry(name_b, False, meta)
            for sub in page.prefixes:
                if not sub.startswith(prefix):
                    self._skip(sub, "outside the prefix listed", skipped, prefix=True)
                    continue
                name = sub[len(prefix):-1]
                reason = invalid_segment_reason(name)
                if reason:
                    self._skip(sub, reason, skipped, prefix=True)
                    continue
                name_b = name.encode("utf-8", "surrogateescape")
                file = entries.get(name_b)
                if file is not None and file.meta is not None:
                    self._hidden(file.meta.key, hidden)
                entries[name_b] = DirEntry(name_b, True, None)
        self._skips_counted(prefix, skipped[0])
        self._hiddens_counted(prefix, hidden[0])
        return entries

    def _refresh_known(self, path: str, meta: ObjectMeta | None, as_of: float) -> None:
        """A listing also refreshes file nodes the kernel already knows."""
        ino = self._ino_by_path.get((path, meta.etag)) if meta is not None else None
        if ino is not None and ino in self._nodes and meta is not None:
            self._node_for(path, False, meta, as_of)

    def entry_node(self, parent: Node, entry: DirEntry, as_of: float) -> Node:
        """The node for an entry of a listing begun at `as_of` (readdirplus); then `entry_taken` or
        `entry_refused` by the kernel."""
        path = self._join(parent.path, entry.name.decode("utf-8"))
        pending = self._pending.get(path) if not entry.is_dir else None
        if pending is not None:
            # Being written now, also where the listing names the stored version it replaces (an O_TRUNC rewrite, a
            # file renamed onto it): handed to the kernel as an inode of its own, that version read its old bytes
            # and took a second writer while the first went on (a fuzzer).
            return pending
        if entry.meta is None and not entry.is_dir:
            # Closed since the directory was opened: once stored, it is the same node; dropped, it is gone
            # (ENOENT, which readdir skips).
            ino = self._latest_file.get(path)
            node = self._nodes.get(ino) if ino is not None else None
            if node is None or node.superseded or node.writing:
                raise PathError(errno.ENOENT)
            return node
        return self._node_for(path, entry.is_dir, entry.meta, as_of)

    def entry_taken(self, node: Node) -> None:
        """The kernel took a readdirplus entry: it counts as a lookup."""
        node.lookups += 1

    def entry_refused(self, node: Node) -> None:
        """The kernel did not take the entry; a node created just for it must not linger."""
        if node.lookups == 0:
            self.forget(node.ino, 0)

    def _patch(self, path: str, entries: dict[bytes, DirEntry], started: int) -> None:
        """A listing of `path` that began at sequence `started` has landed: apply the changes made since. A change
        is forgotten once no listing under way began before it (those that begin later find it in the bucket):
        one made before this listing is still needed by one that began earlier (an `ls` under way while an
        `rmdir` checked the directory: the file just stored was ENOENT for the TTL; the audit)."""
        under_way = self._lists_under_way.get(path)
        changes = self._changes.get(path) if under_way else self._changes.pop(path, None)
        if not changes:
            return
        needed_after = min(under_way) if under_way else None
        for name_b, (seq, entry) in list(changes.items()):
            if seq > started:
                if entry is None:
                    entries.pop(name_b, None)
                else:
                    entries[name_b] = entry
            if needed_after is not None and seq <= needed_after:
                del changes[name_b]
        if under_way and not changes:
            del self._changes[path]
