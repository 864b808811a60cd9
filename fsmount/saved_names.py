"""The names a mount learnt of its bucket, kept in its cache dir (`--cache-dir`), so that a daemon started while the
origin does not answer still resolves them and serves their chunks from the NVMe cache.

What is kept, by directory of the mount (paths as namespace.py has them, '' for the root):
- the entries of the directory's last listing (`complete`: it can answer a listing), or
- for a directory never listed, the names lookups found in it (a HEAD's file, a directory), and those only.
A file is kept at the version it was last seen at (key, size, ETag, mtime): the chunks of that version are what the
NVMe cache holds under its ETag, so nothing is served that the bucket did not hold then. The namespace asks these only
where it would answer from an expired listing: while the origin does not answer (`Namespace._known_while_down`,
`Namespace._listing`). Once it answers, what it says replaces them.

One file per origin, bucket and prefix, `<cache dir>/names/<digest>.json` (0600 in a 0700 directory: key names can say
what a bucket holds), written whole (a temp file, then a rename) by `save` in a worker thread, at most every
SAVE_EVERY_S while something changed, and once more at unmount. Bounded by SAVED_ENTRIES: the directories used least
recently (a listing, a lookup, a change) go first; a directory of more than SAVED_DIR_ENTRIES is not kept (a
dataset's, not a model's). A file that cannot be read is logged and left out: the mount then knows what the origin
tells it, as without a cache dir.

Rules between tasks: every method but `save` runs in the trio thread; `save`s, in worker threads, write one at a time
(`_writing`), never an older snapshot over a newer one (`Snapshot.generation`, `_written` under `_writing`). A
directory's entries are a dict of plain tuples changed in place; `snapshot` copies each (C-level dict copies, no
encoding) so that the worker thread encodes what no task changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Protocol

from fsmount.data import NAMES_DIR, ObjectMeta, sent_etag

log = logging.getLogger(__name__)

# Entries kept over all directories: a model directory has tens; about 250 B each in memory, ~5 MiB at most. A save
# encodes them all in a worker thread, holding the GIL (so the trio thread) for ~25 ms at the bound (53 ms measured at
# 40,000): no oftener than SAVE_EVERY_S.
SAVED_ENTRIES = 20_000
SAVED_DIR_ENTRIES = 10_000
# How often changes are written while the mount runs (and once more at unmount).
SAVE_EVERY_S = 10.0
FORMAT = 1

# One entry, JSON-ready: (is_dir, key, size, etag, mtime_ns); a directory's key is "".
Saved = tuple[bool, str, int, str, int]
# What the namespace hands in and gets back: a directory (True, None), or a file and its version (False, meta).
Entry = tuple[bool, ObjectMeta | None]


@dataclasses.dataclass(slots=True)
class SavedDir:
    complete: bool  # the entries of a whole listing, not only the names lookups found
    entries: dict[str, Saved]  # by name (str, surrogate-escaped as namespace decodes keys)


class Listed(Protocol):
    """An entry of a listing as the namespace has it (namespace.DirEntry, which this module cannot import)."""

    is_dir: bool
    meta: ObjectMeta | None


def names_file(cache_dir: str, bucket: str, prefix: str, origin: str = "") -> str:
    """Its name is 32 hex digits and `.json` (cache_dir.sweep_saved_names, of `modelfs cache clear`, goes by it).
    `origin` (shared_tier.origin_identity): a bucket of the same name on another server (a typo in the endpoint, a
    staging server) is another bucket, whose names a mount started while it does not answer must not serve. AWS S3's
    is filed as its partition (`names_origin`)."""
    return _names_file(cache_dir, bucket, prefix, names_origin(origin))


def _names_file(cache_dir: str, bucket: str, prefix: str, origin: str) -> str:
    digest = hashlib.sha256(f"{origin}\0{bucket}\0{prefix}".encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return os.path.join(cache_dir, NAMES_DIR, digest + ".json")


@functools.lru_cache(maxsize=16)
def _aws_partition(region: str) -> str | None:
    """The AWS partition of `region` (aws, aws-cn, aws-us-gov, ...), as botocore's endpoint data has it; None for a name
    no partition has."""
    import botocore.session  # (botocore is boto3's; imported here, as only a mount with a cache dir asks)

    try:
        return str(botocore.session.get_session().get_partition_for_region(region))
    except Exception:  # noqa: BLE001 - an unknown region: filed by its name, as before
        return None


def names_origin(origin: str) -> str:
    """The origin the names kept are filed under: AWS S3's, with or without --endpoint-url, by its partition
    (`s3:aws`), where a bucket's name is one bucket in every region. Filed by region (`s3:us-east-1`), a --region
    changed, or one the environment gave another node, found none of them until a mount reached the bucket; an AWS
    endpoint given (`https://s3.us-west-2.amazonaws.com`) was filed apart from none (B653). Another server's (an
    S3-compatible one) as it is: a bucket of the same name there is another bucket."""
    if origin.startswith("s3:"):
        partition = _aws_partition(origin[3:])
        return f"s3:{partition}" if partition is not None else origin
    url = urllib.parse.urlsplit(origin)
    host = url.hostname or ""
    suffix = ".amazonaws.com.cn" if host.endswith(".amazonaws.com.cn") else ".amazonaws.com"
    if url.scheme not in ("http", "https") or url.port is not None or url.path or not host.endswith(suffix):
        return origin
    # S3's own endpoints only (`s3.`, `s3-external-1.`, `s3-REGION.`, `s3.REGION.`, `s3-fips.REGION.`,
    # `s3.dualstack.REGION.`): other names under amazonaws.com are other servers' too (a load balancer named `s3` is
    # `s3-1234.us-east-1.elb.amazonaws.com`, a cache `s3-cache.abc.0001.use1.cache.amazonaws.com`), whose buckets AWS's
    # names must never stand for (B670). None (`s3.amazonaws.com`) is us-east-1's, or for `.cn` the China partition.
    labels = host[:-len(suffix)].split(".")
    if labels in (["s3"], ["s3-external-1"]):
        return "s3:aws-cn" if suffix.endswith(".cn") else "s3:aws"
    if len(labels) == 1 and labels[0].startswith("s3-"):
        region = labels[0][3:]
    elif len(labels) in (2, 3) and labels[0] in ("s3", "s3-fips") and labels[1:-1] in ([], ["dualstack"]):
        region = labels[-1]
    else:
        return origin
    partition = _aws_partition(region) if region[-1:].isdigit() else None
    if partition is None or (partition == "aws-cn") != suffix.endswith(".cn"):
        return origin
    return f"s3:{partition}"


def _saved(entry: Entry) -> Saved | None:
    is_dir, meta = entry
    if is_dir:
        return (True, "", 0, "", 0)
    if meta is None or not sent_etag(meta.etag):  # a file being written, or a version no ETag pins: not kept
        return None
    return (False, meta.key, meta.size, meta.etag, meta.mtime_ns)


def _entry(saved: Saved) -> Entry:
    is_dir, key, size, etag, mtime_ns = saved
    return (True, None) if is_dir else (False, ObjectMeta(key, size, etag, mtime_ns))


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What `SavedNames.save` writes: the directories, copied, and the order it was taken in (1, 2, ...)."""
    generation: int
    dirs: dict[str, tuple[bool, dict[str, Saved]]]


class SavedNames:
    def __init__(self, cache_dir: str, bucket: str, prefix: str, origin: str = ""):
        self.path = names_file(cache_dir, bucket, prefix, origin)
        # Where a daemon before B653 filed them (by region, or by the AWS endpoint given): read once if there is none
        # here, so that a daemon upgraded while the origin is away still starts.
        self._before = None if names_origin(origin) == origin else (_names_file(cache_dir, bucket, prefix, origin),
                                                                     origin)
        self._writing = threading.Lock()  # `save`'s, across worker threads
        self._taken = 0  # snapshots taken (trio thread): each one's generation
        self._written = 0  # the generation of the snapshot in the file (under `_writing`)
        self.bucket, self.prefix, self.origin = bucket, prefix, names_origin(origin)
        self._dirs: dict[str, SavedDir] = {}  # least recently used first (`_used`)
        self._count = 0
        self.dirty = False

    def __len__(self) -> int:
        return len(self._dirs)

    def load(self) -> None:
        """What the file holds (at startup, before anything is learnt); nothing if it is missing or unreadable."""
        path, origin = self.path, self.origin
        if self._before is not None and not os.path.exists(path):
            path, origin = self._before
        try:
            with open(path, "rb") as f:
                doc = json.load(f)
            if doc.get("format") != FORMAT or doc.get("bucket") != self.bucket or doc.get("prefix") != self.prefix \
                    or doc.get("origin", "") != origin:
                raise ValueError("not this mount's")
            dirs = {str(path): SavedDir(bool(complete), {str(name): (bool(e[0]), str(e[1]), int(e[2]), str(e[3]),
                                                                     int(e[4])) for name, e in entries.items()})
                    for path, (complete, entries) in doc["dirs"].items()}
        except FileNotFoundError:
            return
        except Exception as exc:  # noqa: BLE001 - a damaged file costs its names, never the mount (every mount loads it)
            log.warning("the names kept in %s cannot be read (%s): left out", path, exc)
            return
        self._dirs = dirs
        self._count = sum(len(d.entries) for d in dirs.values())
        self._trim()

    # -- what the namespace learnt ------------------------------------------------------------------

    def listed(self, path: str, entries: Mapping[bytes, Listed],
               newer: Callable[[str, str | None], bool] | None = None) -> None:
        """A whole listing of the directory `path` landed (entries by name). One too big to keep costs no pass over
        it (a 200,000-name listing cost 0.4 s of the trio thread). `newer(name)`: whether an answer about that name
        asked after this listing began is known; its kept entry (or its absence) is that newer news, and stays as it
        is, in or out of the listing (B325: the listing's older version was kept over it)."""
        if len(entries) > SAVED_DIR_ENTRIES:
            self._drop(path)
            return
        old = self._dirs.get(path)
        kept = {}
        left_out = 0
        for name_b, entry in entries.items():
            name = name_b.decode("utf-8", "surrogateescape")
            if newer is not None and newer(name, None if entry.is_dir or entry.meta is None else entry.meta.etag):
                saved = old.entries.get(name) if old is not None else None
                if saved is None and old is not None and old.complete:
                    # Nothing kept of it in a whole listing: that newer answer found it gone (`found` drops the name
                    # and leaves the listing whole; every other way a name goes unkept marks it not whole, `gone` too).
                    # Counted as left out, a remount while the origin was away failed `ls` of the directory (B382).
                    continue
            else:
                saved = _saved((entry.is_dir, entry.meta))
            if saved is not None:
                kept[name] = saved
            else:
                left_out += 1
        if old is not None and newer is not None:
            for name, was in old.entries.items():
                if name not in kept and name.encode("utf-8", "surrogateescape") not in entries and newer(name, None):
                    kept[name] = was  # found after this listing began
        complete = not left_out  # a name left out (no ETag, or gone by newer news): never served as the whole listing
        if old is not None and old.complete == complete and old.entries == kept:
            self._used(path)  # as it was: nothing to write (a listing every TTL of an unchanged directory)
            return
        self._put(path, SavedDir(complete, kept))

    def found(self, path: str, entry: Entry | None) -> None:
        """What a lookup (or a change made through this mount) says of `path`: this entry, or nothing there."""
        parent, _, name = path.rpartition("/")
        old = self._dirs.get(parent)
        saved = _saved(entry) if entry is not None else None
        if old is None:
            if saved is not None:
                self._put(parent, SavedDir(False, {name: saved}))
            return
        if saved is None and entry is not None and old.complete:
            old.complete = False  # there, but not kept (no ETag): the listing kept is no longer the whole directory
        elif old.entries.get(name) == saved:
            self._used(parent)
            return
        if saved is None:
            if old.entries.pop(name, None) is not None:
                self._count -= 1
        elif len(old.entries) < SAVED_DIR_ENTRIES or name in old.entries:
            self._count += name not in old.entries
            old.entries[name] = saved
        else:  # a directory at its bound: the same
            old.complete = False
        self._used(parent)
        self.dirty = True
        self._trim()

    def _used(self, path: str) -> None:
        """`path` is now the directory used most recently: the last that the bound drops. A model's directory, listed
        unchanged at every TTL, counted as unused, and went first while a dataset's came and went. The order is
        written at the next save."""
        self._dirs[path] = self._dirs.pop(path)

    def gone(self, path: str, etag: str) -> None:
        """A read found the version `etag` of `path` gone from the bucket (replaced or deleted; which is not known):
        its entry goes, and the listing kept of its directory is no longer the whole of it. So too where nothing is
        kept of the name: `listed` takes a name missing from a whole listing for one found gone, where this read says
        only that some version is gone (a listing under way that names a newer one was kept whole without it)."""
        parent, _, name = path.rpartition("/")
        old = self._dirs.get(parent)
        kept = old.entries.get(name) if old is not None else None
        if old is None or (kept is not None and kept[3] != etag) or (kept is None and not old.complete):
            return
        if kept is not None:
            del old.entries[name]
            self._count -= 1
        old.complete = False
        self.dirty = True

    def _put(self, path: str, saved: SavedDir) -> None:
        self._drop(path)
        self._dirs[path] = saved
        self._count += len(saved.entries)
        self.dirty = True
        self._trim()

    def _drop(self, path: str) -> None:
        old = self._dirs.pop(path, None)
        if old is not None:
            self._count -= len(old.entries)
            self.dirty = True

    def _trim(self) -> None:
        while self._count > SAVED_ENTRIES and self._dirs:
            self._drop(next(iter(self._dirs)))

    # -- what the namespace asks while the origin is away ---------------------------------------------

    def listing(self, path: str) -> dict[str, Entry] | None:
        """The last whole listing of `path` kept, by name."""
        saved = self._dirs.get(path)
        if saved is None or not saved.complete:
            return None
        return {name: _entry(entry) for name, entry in saved.entries.items()}

    def entry(self, path: str) -> Entry | None:
        """The entry kept for `path`: of its directory's listing, or of a lookup."""
        parent, _, name = path.rpartition("/")
        saved = self._dirs.get(parent)
        entry = saved.entries.get(name) if saved is not None else None
        return _entry(entry) if entry is not None else None

    # -- the file ----------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """What `save` writes, copied (trio thread), with its generation; clears `dirty`."""
        self.dirty = False
        self._taken += 1
        return Snapshot(self._taken, {path: (d.complete, dict(d.entries)) for path, d in self._dirs.items()})

    def save(self, snapshot: Snapshot) -> None:
        """Write a snapshot (a worker thread): a temp file, then a rename, so a crash leaves the old file or the
        new one; nothing if the file holds a newer one already. Raises OSError (a full disk, a removed cache dir)."""
        doc = {"format": FORMAT, "bucket": self.bucket, "prefix": self.prefix, "origin": self.origin,
               "dirs": snapshot.dirs}
        data = json.dumps(doc, separators=(",", ":")).encode()
        # One write of the temp file at a time: a save given up on (its thread abandoned: the loop's, cancelled as a
        # task of the mount failed) may still be writing when the end's save starts (B140). And never an older
        # snapshot over a newer one: each encodes its own before the lock, which is not first come first served, so
        # the abandoned one could write after the end's, the daemon exiting with the older names (B148).
        with self._writing:
            if snapshot.generation <= self._written:
                return
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            tmp = self.path + ".tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    os.fsync(f.fileno())  # so a power loss leaves the old file or the new one, not an empty one (XFS)
                os.replace(tmp, self.path)
                self._written = snapshot.generation
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
