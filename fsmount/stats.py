"""What a running mount tells operators: one snapshot of the live counters as plain JSON values. The
Prometheus endpoint (prometheus.py) and `modelfs stats` (through the virtual xattr STATS_XATTR, read by
stats_table.py in the CLI process) both serve this snapshot.

It counts nothing itself and never raises into the mount. Threads: `snapshot` runs in the metrics HTTP
thread and in the trio thread; it only reads plain ints that the trio thread (engine, level stack,
streamer, pusher) or a lock holder (DiskCache, LatencyHistogram) write, so a scrape may see counters a
few microseconds apart, never a torn value.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports this module for STATS_XATTR alone, without the daemon's parts
    from fsmount.data import ChunkEngine, DiskCache, SharedTier
    from fsmount.pagecache import PageCachePusher
    from fsmount.streaming import ModelStreamer
    from fsmount.writes import Writes

STATS_FORMAT_VERSION = 1
# The virtual attribute of the mount root that carries the snapshot as JSON: no socket, no port, and
# the kernel's own permission check on the mountpoint. Not listed by listxattr, so `cp -a`,
# `rsync -X` and `tar --xattrs` never copy it.
STATS_XATTR = b"user.modelfs.stats"


def ratio(part: int, whole: int) -> float:
    return part / whole if whole > 0 else 0.0


@dataclasses.dataclass
class MountStats:
    """Where a mount's numbers live; `snapshot()` reads them all at once into plain JSON values."""

    bucket: str
    engine: ChunkEngine
    streamer: ModelStreamer
    pusher: PageCachePusher
    disk_cache: DiskCache | None = None
    shared_tier: SharedTier | None = None
    writes: Writes | None = None
    open_files: Callable[[], int] = lambda: 0
    inodes: Callable[[], int] = lambda: 0
    metadata: Callable[[], tuple[int, int]] = lambda: (0, 0)  # metadata requests sent, and those that failed
    failed: Callable[[], dict[str, int]] = dict  # FUSE requests answered with an error, by operation
    versions_gone: Callable[[], int] = lambda: 0  # READs refused because the bucket no longer holds their version
    started: float = dataclasses.field(default_factory=time.monotonic)
    # The most READ bytes served beyond everything loaded that a snapshot reported (egress saved is a counter: a
    # later snapshot never says less), and the lock of that one value (snapshots run in two threads).
    _beyond_loaded: int = 0
    _beyond_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def snapshot(self) -> dict[str, Any]:
        es, ls = self.engine.stats, self.engine.levels.stats
        served = {"memory": es.bytes_served_memory, "cache": es.bytes_served_level, "origin": es.bytes_served_origin}
        served_total = sum(served.values())
        cache_loaded = ls.loaded_bytes
        buckets, count, total = self.engine.levels.origin_latency.read()
        metadata = self.metadata()
        # READ bytes served beyond everything loaded (re-reads answered from memory): it shrank whenever a fetch
        # loaded bytes no READ took yet (read-ahead, a sparse pread), and a Prometheus counter that goes down reads
        # as a reset, its whole value counted again.
        with self._beyond_lock:
            self._beyond_loaded = max(self._beyond_loaded, served_total - ls.origin_bytes - cache_loaded)
            beyond_loaded = self._beyond_loaded
        out: dict[str, Any] = {
            "format": STATS_FORMAT_VERSION,
            "bucket": self.bucket,
            "pid": os.getpid(),  # who serves the mount (`modelfs unmount --stale` names it)
            "uptime_seconds": round(time.monotonic() - self.started, 3),
            # READ reply bytes by where their chunk was when the READ asked for it.
            "served_bytes": served,
            # Share of READ bytes that did not wait for the origin.
            "hit_ratio": ratio(served["memory"] + served["cache"], served_total),
            "origin": {
                "requests": ls.origin_requests,
                "bytes": ls.origin_bytes,
                "errors": ls.origin_errors,
                # Requests sent again within a GET (5xx, throttling, resets, refused connections) that then
                # succeeded or failed: a throttling origin shows here before it shows as errors.
                "retries": int(getattr(self.engine.levels.store, "get_retries", 0)),
                # Of "bytes", those of chunks the origin had sent before (evicted before they were read).
                "refetched_bytes": ls.origin_refetched_bytes,
                # HEADs and listing pages (lookups, `ls`), and those that failed or timed out.
                "metadata_requests": metadata[0],
                "metadata_errors": metadata[1],
                "get_seconds": {"buckets": [[b, n] for b, n in buckets[:-1]], "count": count, "sum": total},
            },
            "cache_loaded_bytes": cache_loaded,
            "cache_chunk_hits": ls.hits,
            # Bytes the origin did not send thanks to caches: chunks loaded from the cache levels that the origin had
            # not sent to this daemon (one loaded back after it did saved nothing), plus
            # READ bytes served beyond everything loaded (re-reads answered from memory). Reads that the
            # kernel page cache answers never reach the daemon, so this is a lower bound.
            "egress_saved_bytes": ls.saved_bytes + beyond_loaded,
            # FUSE requests answered with an error (EIO, EACCES, ...) because of the origin or a cache, by
            # operation ("read", "lookup", ...): what readers saw fail.
            "failed_requests": self.failed(),
            # Of those, READs refused because the bucket no longer holds the version open (replaced or deleted since
            # the mount saw it): `modelfs prefetch` opens such a file again, and only where this grew.
            "versions_gone": self.versions_gone(),
            # Bytes fetched by model streaming (safetensors files streamed in offset order at open).
            "streamed_bytes": self.streamer.streamed_bytes,
            # Read-ahead fetches dropped before they started (their reader moved on or closed).
            "readahead_dropped": es.readahead_dropped,
            "pagecache_pushed_bytes": self.pusher.pushed,
            # Every byte pushed into the page cache so far (notify_store), files since closed included.
            "pagecache_stored_bytes": self.pusher.stored_total,
            # Times a READ came for pages the kernel was believed to hold (pushed, or read whole): it dropped
            # them (memory pressure, or a drop_caches). Each drop forgets the file's pushes, so it counts once.
            "pagecache_drops": es.pagecache_drops,
            "fetches_inflight": es.fetches_inflight,
            # Fetched chunks not yet written to the cache levels (written in the background).
            "cache_writes_pending": self.engine.levels.writes_pending,
            # Fetched chunks not written to the cache levels: given up on their deadline, and not started while
            # writes stalled (a frozen or hung cache disk).
            "cache_writes_given_up": self.engine.levels.stats.writes_given_up,
            # Reads of the NVMe cache given up on their deadline (a cache disk whose reads hang): the origin served
            # those chunks, and the cache was skipped until the reads returned.
            "cache_reads_given_up": self.engine.levels.stats.reads_given_up,
            "cache_writes_skipped": es.writes_skipped,
            "memory_used_bytes": self.engine.memory.used,
            "memory_limit_bytes": self.engine.memory.limit,
            "open_files": self.open_files(),
            # Inodes the kernel holds (root included): they go when it sends FORGET.
            "inodes": self.inodes(),
            "disk_cache": None,
            "shared_cache": None,
            "writes": None,
        }
        if self.writes is not None:
            # --writable: files stored (closed and complete in the bucket) or failed, bytes and parts
            # uploaded, renames and deletes done.
            out["writes"] = dataclasses.asdict(self.writes.stats)
        if self.disk_cache is not None:
            ds = self.disk_cache.stats
            hits, misses = self.engine.levels.lookups(self.disk_cache)
            out["disk_cache"] = {
                "hits": hits, "misses": misses, "hit_ratio": ratio(hits, hits + misses),
                # Chunk files another version's format: dropped and fetched again, not a failing disk.
                "corrupt": ds.corrupt, "other_format": ds.other_format,
                "read_errors": ds.read_errors, "write_errors": ds.write_errors,
                "lock_timeouts": ds.lock_timeouts, "evictions": ds.evictions, "writes": ds.writes,
                # Chunks not written: while writes pause after a failed one (a full disk), or without room.
                "writes_skipped": ds.writes_skipped,
                "bytes_used": ds.bytes_used, "max_bytes": self.disk_cache.max_bytes, "chunks": ds.chunks,
                # What it can hold as its disk stands (its chunks and the free space beyond its floor), at most
                # max_bytes: less where --cache-size is more than the disk gives. None until measured.
                "room_bytes": self.disk_cache.room_bytes,
            }
        if self.shared_tier is not None:
            ts = self.shared_tier.stats
            hits, misses = self.engine.levels.lookups(self.shared_tier)
            loaded = self.engine.levels.loaded_bytes(self.shared_tier)
            out["shared_cache"] = {
                "bucket": self.shared_tier.client.bucket, "read_only": self.shared_tier.read_only,
                "claims_enabled": self.shared_tier.claims,
                "hits": hits, "misses": misses, "hit_ratio": ratio(hits, hits + misses), "bytes": loaded,
                "claims": ts.claims, "claim_waits": ts.claim_waits, "fallbacks": ts.fallbacks, "writes": ts.writes,
                "write_errors": ts.write_errors, "chunk_write_errors": ts.chunk_write_errors,
                "writes_skipped": ts.writes_skipped, "corrupt": ts.corrupt,
                "other_format": ts.other_format,
                "errors": ts.errors,
                # Writes held back until this node's origin reads were done (trailing.py), those given up
                # because the NVMe cache no longer held the chunk, and listings that found a node waiting.
                "trailed": self.engine.levels.trailing.queued, "trail_dropped": self.engine.levels.trailing.dropped,
                "waiters_seen": ts.waiters_seen,
                # Every byte the tier returned is one the origin did not send.
                "egress_saved_bytes": self.engine.levels.saved_bytes(self.shared_tier),
            }
        return out

    def json_bytes(self) -> bytes:
        return json.dumps(self.snapshot(), separators=(",", ":")).encode()
