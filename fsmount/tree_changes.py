"""The tree's changes made through a `--writable` mount: the namespace, told what writes.py did in the
bucket, so that this mount lists, looks up and reads it at once.

A subclass of `namespace.Namespace`, which keeps the state both use: `_pending` (the files being
written) and `_changes`/`_seq` (changes kept for listings under way). Rules (all in the trio thread):
- A file being written is a node with `writing` set, in `_pending` by path until it is closed (kept
  as (path, "") in `_ino_by_path`): it is listed and looked up on this mount only, never HEADed.
- Every other change (a file closed, a directory made, a key deleted or renamed) is applied at once
  to the parent's cached listing, and, while listings of the parent are under way (`_lists_under_way`),
  recorded in `_changes` with a sequence number: such a listing is patched with it when it lands, and a
  change is forgotten once no listing under way began before it (one that begins later finds it in the
  bucket).
- A file this mount stored shows its store time as its mtime, never the bucket's earlier Last-Modified: kept in
  `_stored_at` by (path, ETag), apart from the nodes.
"""

from __future__ import annotations

import errno
import time
from typing import Any

import cachetools

from fsmount.data import MAX_KEY_BYTES, ObjectMeta
from fsmount.namespace import DirEntry, Namespace, Node, PathError, child_name, invalid_segment_reason

# Files whose store time is kept (`_stored_at`), the most recent: a checkpoint run's, many times over.
STORED_AT_ENTRIES = 20_000

class WritableNamespace(Namespace):
    """`max_key_bytes`: the longest key the bucket takes, in UTF-8 bytes (`Boto3Store.max_key_bytes`: S3's 1024,
    OSS's 1023). The bucket refuses a longer one only when its bytes are sent (KeyTooLongError): EIO at a write or at
    the close, which safetensors' `save_file` drops, returning as if the checkpoint were stored; so it is refused at
    its create (`child_path`)."""

    def __init__(self, *args: Any, max_key_bytes: int = MAX_KEY_BYTES, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._max_key_bytes = max_key_bytes
        # The time each file this mount stored was closed (or renamed to its name), by (path, ETag): apart from the
        # nodes, as the kernel forgets inodes meanwhile (with --metadata-ttl 0 at once). Bounded, oldest first out.
        self._stored_at: cachetools.LRUCache[tuple[str, str], int] = cachetools.LRUCache(STORED_AT_ENTRIES)

    def child_path(self, parent: Node, name_b: bytes, is_dir: bool = False) -> str:
        """The path of a new entry `name_b` of `parent`; refused (EINVAL) where the read side would skip
        the name, so that nothing this mount writes is invisible to it, and (ENAMETOOLONG) where its key, or a
        directory's marker key, is longer than a bucket takes, before anything is written."""
        name = child_name(parent, name_b, errno.EINVAL)
        if invalid_segment_reason(name) is not None or "/" in name:
            raise PathError(errno.EINVAL)
        path = self._join(parent.path, name)
        key = self.dir_key(path) if is_dir else self.key_of(path)
        if len(key.encode("utf-8", "surrogateescape")) > self._max_key_bytes:
            raise PathError(errno.ENAMETOOLONG)
        return path

    def _node_for(self, path: str, is_dir: bool, meta: ObjectMeta | None, as_of: float | None = None) -> Node:
        """As `Namespace._node_for`, but the modification time of a file this mount stored never steps back: it
        shows the time of its close until the bucket is asked again, whose Last-Modified (whole seconds, and for a
        multipart upload the time it began) is earlier. `make` and `rsync` saw a file just written go back in time."""
        node = super()._node_for(path, is_dir, meta, as_of)
        if meta is not None:
            node.mtime_ns = max(node.mtime_ns, self._stored_at.get((path, meta.etag), 0))
        return node

    def key_of(self, path: str) -> str:
        return self.prefix + path

    def dir_key(self, path: str) -> str:
        """The key of a directory's marker object (what `mkdir` creates)."""
        return self._dir_prefix(path)

    def pending(self, path: str) -> Node | None:
        return self._pending.get(path)

    def begin_file(self, path: str, node: Node | None = None) -> Node:
        """A file this mount starts writing at `path`: a new node (counted as looked up, as CREATE's
        reply is), or `node`, an existing version being replaced, which becomes the new file."""
        if node is None:
            ino = self._next_ino
            self._next_ino += 1
            node = self._nodes[ino] = Node(ino, path, False, lookups=1)
        else:
            self._ino_by_path.pop((node.path, node.etag), None)
            node.pages_stale = True
        node.size, node.etag, node.mtime_ns, node.writing, node.superseded = 0, "", time.time_ns(), True, False
        self._ino_by_path[(path, "")] = node.ino
        self._pending[path] = node
        self._negative.pop(path, None)
        return node

    def end_file(self, node: Node, meta: ObjectMeta | None) -> None:
        """The file is in the bucket as `meta` (its key may differ: renamed while written), or, with None,
        never will be: it leaves the tree."""
        self._pending.pop(node.path, None)
        self._ino_by_path.pop((node.path, ""), None)
        node.writing = False
        if meta is None:
            node.supersede()
            return
        self._stored(node, meta)

    def _stored(self, node: Node, meta: ObjectMeta) -> None:
        """`node` is the version `meta` of its path, now in the bucket."""
        node.size, node.etag, node.mtime_ns = meta.size, meta.etag, meta.mtime_ns
        self._stored_at[(node.path, meta.etag)] = meta.mtime_ns
        now = time.monotonic()
        node.fresh_until, node.current_as_of = now + self.ttl, now
        self._asked(node.path, now)
        node.superseded = False
        old = self._latest_file.get(node.path)
        if old is not None and old != node.ino and old in self._nodes:
            self._nodes[old].supersede()
        self._ino_by_path[(node.path, meta.etag)] = node.ino
        self._latest_file[node.path] = node.ino
        self._negative.pop(node.path, None)  # a rename looked the name up first, and found it missing
        parent, _, name = node.path.rpartition("/")
        self._change(parent, name, DirEntry(name.encode("utf-8", "surrogateescape"), False, meta))

    def move_pending(self, node: Node, path: str) -> None:
        """A file still being written now has the name `path`. A rewrite of a stored file (the path's latest version
        is this node) leaves its old name: gone from this mount now, from the bucket once it is stored (new_file)."""
        if self._latest_file.get(node.path) == node.ino:
            del self._latest_file[node.path]
            self._asked(node.path, time.monotonic())
            parent, _, name = node.path.rpartition("/")
            self._change(parent, name, None)
            self._negative[node.path] = True
        self._pending.pop(node.path, None)
        self._ino_by_path.pop((node.path, ""), None)
        node.path = path
        self._ino_by_path[(path, "")] = node.ino
        self._pending[path] = node
        self._negative.pop(path, None)

    def moved(self, node: Node, path: str, meta: ObjectMeta) -> None:
        """A stored file was copied to `path` as `meta` and its old key deleted."""
        # Its old name no longer leads to it: the same bytes stored again there (the same ETag) were looked up as
        # this node, whose reads go to the new key.
        if self._ino_by_path.get((node.path, node.etag)) == node.ino:
            del self._ino_by_path[(node.path, node.etag)]
        self.removed(node.path, is_dir=False)
        node.path = path
        self._stored(node, meta)

    def removed(self, path: str, *, is_dir: bool) -> None:
        """A key (or a directory's last trace) was deleted through this mount."""
        if not is_dir:
            self._asked(path, time.monotonic())
            ino = self._latest_file.pop(path, None)
            node = self._nodes.get(ino) if ino is not None else None
            if node is not None:
                node.supersede()
        parent, _, name = path.rpartition("/")
        self._change(parent, name, None)
        if is_dir:
            self._listings.pop(path, None)
            # A directory made again at the path is a new inode: given the removed one's number, it was that inode for
            # the kernel, which marks a removed directory dead and refuses every name in it (ENOENT) until it evicts
            # it, later or never while something holds it (a fuzzer).
            self._ino_by_path.pop((path, None), None)
        self._negative[path] = True

    def found_in_bucket(self, path: str, found: tuple[bool, ObjectMeta | None] | None = None,
                        asked: float | None = None) -> None:
        """The bucket holds something at `path` that this mount's answers said was free (another writer made it
        since): the path's next lookup, and its parent's next listing, ask the bucket; a listing under way no longer
        leaves it out of what it keeps for outages as a lookup found it gone before (B503). `found`, where the request
        that found it says what (a directory (True, None), a file's version (False, meta)), asked at `asked`
        (monotonic): taken as a lookup's answer would be, the newest about the path. Only dropped, the lookup's answer
        of nothing before it stayed the newest: while the origin was away `ls` showed the name (B503) and `stat` of it
        was EIO, the listing's version older news than that nothing (B651)."""
        parent, _, name = path.rpartition("/")
        self._listings.pop(parent, None)
        self._negative.pop(path, None)
        if found is None or asked is None:
            self._found_while_listed.get(parent, {}).pop(name.encode("utf-8", "surrogateescape"), None)
            return
        # As `_ask_bucket` takes a lookup's answer (the node, not counted as a lookup, is kept as one the kernel forgot:
        # it answers while the origin is away, as the path's latest version where a listing names that version too).
        self._found(path, found, asked)
        ino = self._ino_by_path.get((path, None if found[0] else found[1].etag))  # type: ignore[union-attr]
        if ino is not None and ino not in self._nodes and ino in self._forgotten:
            self._nodes[ino] = self._forgotten.pop(ino)  # the version's node kept (B246): dated, and kept again
        node = self._node_for(path, found[0], found[1], asked)
        if asked >= self._news_since(path, None if found[0] else found[1].etag):  # type: ignore[union-attr]
            self._found_in_listings(path, found, asked)  # (a listing under way keeps this, not the lookup's nothing)
        if node.lookups == 0:
            self.forget(node.ino, 0)

    def dir_moved(self, node: Node, path: str) -> None:
        """An empty directory now has the name `path` (its inode stays)."""
        old = node.path
        self._ino_by_path.pop((old, None), None)
        self._ino_by_path[(path, None)] = node.ino
        self.removed(old, is_dir=True)
        node.path = path
        parent, _, name = path.rpartition("/")
        self._change(parent, name, DirEntry(name.encode("utf-8", "surrogateescape"), True, None))
        self._negative.pop(path, None)

    def dir_added(self, path: str) -> Node:
        """A directory made through this mount (counted as looked up, as MKDIR's reply is)."""
        parent, _, name = path.rpartition("/")
        self._change(parent, name, DirEntry(name.encode("utf-8", "surrogateescape"), True, None))
        self._negative.pop(path, None)
        node = self._node_for(path, True, None, time.monotonic())
        node.lookups += 1
        return node

    def _change(self, parent: str, name: str, entry: DirEntry | None) -> None:
        """Apply one change to the cached listing of `parent` and keep it for listings under way (only for them:
        a directory written and never listed kept a record of every file, ~300 B each, for the life of the mount)."""
        self._seq += 1
        name_b = name.encode("utf-8", "surrogateescape")
        self._found(self._join(parent, name), (entry.is_dir, entry.meta) if entry is not None else None)
        if parent in self._lists_under_way:
            self._changes.setdefault(parent, {})[name_b] = (self._seq, entry)
            self._found_while_listed.get(parent, {}).pop(name_b, None)  # this change is the newer news
        for cache in (self._listings, self._last_listings):
            listing = cache.get(parent)
            if listing is None:
                continue
            if listing.found_since:
                listing.found_since.pop(name_b, None)  # what an answer found of it before this change is older news
            if entry is None:
                listing.pop(name_b, None)
            else:
                listing[name_b] = entry
        kept = self._last_listings.get(parent)
        if kept is not None:
            # Counted again (the cached listing, often the same dict, is not stored again: its TTL would restart).
            # Uncounted, a directory this mount wrote file by file and never listed again grew the listings kept past
            # LISTING_CACHE_ENTRIES, their share of the memory limit (B650).
            self._recount_kept(parent, kept)

    async def dir_is_empty(self, node: Node) -> bool:
        """Whether a directory has nothing in it but its own marker: asked of the bucket, not the cache."""
        if any(p.rpartition("/")[0] == node.path for p in self._pending):
            return False
        listing = await self._list(node.path)
        return not listing
