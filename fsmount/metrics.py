"""What a running mount tells operators: one stats snapshot read from the live counters, served as
Prometheus text on --metrics-addr and as the JSON behind `modelfs stats` (via a virtual xattr).

It never counts on the read path beyond two thin proxies (origin GET latency, bytes loaded from cache
levels); it never raises into the mount, and it never sees or exposes credentials.

Threads: `MountStats.snapshot` runs in the HTTP thread and in the trio thread; it only reads plain
ints that the trio thread (engine, prefetcher, pusher) or a lock holder (DiskCache) write, so a
scrape may see counters a few microseconds apart, never a torn value. `LatencyHistogram` and
`CountedLevel` are written from store / disk worker threads and hold a lock for each update.
"""

from __future__ import annotations

import bisect
import dataclasses
import errno
import http.server
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from fsmount.cache_level import ChunkCache, ChunkId, WritableBuffer
from fsmount.store import ListingPage, ObjectMeta, ObjectStore

if TYPE_CHECKING:
    from fsmount.chunks import ChunkEngine
    from fsmount.disk_cache import DiskCache
    from fsmount.pagecache import PageCachePusher
    from fsmount.prefetch import ModelPrefetcher

log = logging.getLogger(__name__)

# Upper bounds (seconds) of one ranged GET of a chunk (8 MiB by default, retries included): ~10 ms
# from a same-rack server, ~0.1 s at 700 MB/s, seconds when the origin is throttling.
ORIGIN_GET_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STATS_FORMAT_VERSION = 1
# The virtual attribute of the mount root that carries the snapshot as JSON: no socket, no port, and
# the kernel's own permission check on the mountpoint. Not listed by listxattr, so `cp -a`,
# `rsync -X` and `tar --xattrs` never copy it.
STATS_XATTR = b"user.modelfs.stats"
METRICS_PATHS = ("/metrics", "/")


class MetricsAddressError(ValueError):
    """--metrics-addr is malformed or cannot be bound; the message is shown as is."""


class StatsUnavailable(Exception):
    """`modelfs stats` cannot get numbers from this path; the message says why."""


# -- the two proxies on the fetch path ----------------------------------------------------------


class LatencyHistogram:
    """Cumulative-bucket histogram of durations; thread-safe."""

    def __init__(self, bounds: Sequence[float] = ORIGIN_GET_BUCKETS):
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)  # last slot: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        slot = bisect.bisect_left(self.bounds, seconds)
        with self._lock:
            self._counts[slot] += 1
            self._sum += seconds

    def read(self) -> tuple[list[tuple[float, int]], int, float]:
        """([(upper bound, cumulative count)...] ending with +Inf, count, sum)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            running += n
            cumulative.append((bound, running))
        return cumulative, running, total


class TimedStore:
    """An ObjectStore that times each `get_range` (the chunk engine's only origin call)."""

    def __init__(self, store: ObjectStore, latency: LatencyHistogram):
        self._store = store
        self._latency = latency
        self.bucket = store.bucket

    def check_bucket(self, prefix: str) -> None:
        self._store.check_bucket(prefix)

    def head(self, key: str) -> ObjectMeta | None:
        return self._store.head(key)

    def list_pages(self, prefix: str) -> Iterator[ListingPage]:
        return self._store.list_pages(prefix)

    def has_children(self, prefix: str) -> bool:
        return self._store.has_children(prefix)

    def get_range(self, key: str, etag: str, start: int, end: int) -> bytes:
        started = time.monotonic()
        try:
            return self._store.get_range(key, etag, start, end)
        finally:
            self._latency.observe(time.monotonic() - started)


class CountedLevel:
    """A ChunkCache that counts the bytes it returns: each of them is a byte the origin did not send."""

    def __init__(self, level: ChunkCache):
        self._level = level
        self._lock = threading.Lock()
        self.loaded_bytes = 0

    def get(self, chunk: ChunkId, buffer: WritableBuffer | None = None) -> bytes | WritableBuffer | None:
        data = self._level.get(chunk, buffer)
        if data is not None:
            with self._lock:
                self.loaded_bytes += len(data)
        return data

    def put(self, chunk: ChunkId, data: bytes | WritableBuffer) -> None:
        self._level.put(chunk, data)


# -- the snapshot ---------------------------------------------------------------------------------


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole > 0 else 0.0


@dataclasses.dataclass
class MountStats:
    """Where a mount's numbers live; `snapshot()` reads them all at once into plain JSON values."""

    bucket: str
    engine: ChunkEngine
    prefetcher: ModelPrefetcher
    pusher: PageCachePusher
    origin_latency: LatencyHistogram
    levels: Sequence[CountedLevel] = ()
    disk_cache: DiskCache | None = None
    open_files: Callable[[], int] = lambda: 0
    inodes: Callable[[], int] = lambda: 0
    started: float = dataclasses.field(default_factory=time.monotonic)

    def snapshot(self) -> dict[str, Any]:
        es = self.engine.stats
        served = {"memory": es.bytes_served_memory, "cache": es.bytes_served_level, "origin": es.bytes_served_origin}
        served_total = sum(served.values())
        cache_loaded = sum(level.loaded_bytes for level in self.levels)
        buckets, count, total = self.origin_latency.read()
        out: dict[str, Any] = {
            "format": STATS_FORMAT_VERSION,
            "bucket": self.bucket,
            "uptime_seconds": round(time.monotonic() - self.started, 3),
            # READ reply bytes by where their chunk was when the READ asked for it.
            "served_bytes": served,
            # Share of READ bytes that did not wait for the origin.
            "hit_ratio": _ratio(served["memory"] + served["cache"], served_total),
            "origin": {
                "requests": es.origin_requests,
                "bytes": es.origin_bytes,
                "errors": es.origin_errors,
                "get_seconds": {"buckets": [[b, n] for b, n in buckets[:-1]], "count": count, "sum": total},
            },
            "cache_loaded_bytes": cache_loaded,
            "cache_chunk_hits": es.level_hits,
            # Bytes the origin did not send thanks to caches: chunks loaded from the cache levels, plus
            # READ bytes served beyond everything loaded (re-reads answered from memory). Reads that the
            # kernel page cache answers never reach the daemon, so this is a lower bound.
            "egress_saved_bytes": cache_loaded + max(0, served_total - es.origin_bytes - cache_loaded),
            "prefetched_bytes": self.prefetcher.prefetched_bytes,
            "prefetch_dropped": es.prefetch_dropped,
            "pagecache_pushed_bytes": self.pusher.pushed,
            "fetches_inflight": es.fetches_inflight,
            # Fetched chunks not yet written to the cache levels (written in the background).
            "cache_writes_pending": self.engine.writes_pending,
            "memory_used_bytes": self.engine.memory_used,
            "memory_limit_bytes": self.engine.memory_limit,
            "open_files": self.open_files(),
            # Inodes the kernel holds (root included): they go when it sends FORGET.
            "inodes": self.inodes(),
            "disk_cache": None,
        }
        if self.disk_cache is not None:
            ds = self.disk_cache.stats
            out["disk_cache"] = {
                "hits": ds.hits, "misses": ds.misses, "hit_ratio": _ratio(ds.hits, ds.hits + ds.misses),
                "corrupt": ds.corrupt, "read_errors": ds.read_errors, "write_errors": ds.write_errors,
                "evictions": ds.evictions, "writes": ds.writes, "bytes_used": ds.bytes_used,
                "max_bytes": self.disk_cache.max_bytes, "chunks": ds.chunks,
            }
        return out

    def json_bytes(self) -> bytes:
        return json.dumps(self.snapshot(), separators=(",", ":")).encode()


# -- Prometheus -----------------------------------------------------------------------------------


class StatsCollector:
    """A prometheus_client collector that turns one snapshot into metric families at scrape time."""

    def __init__(self, stats: MountStats):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats.snapshot()
        served = CounterMetricFamily("modelfs_served_bytes", "Bytes of READ replies by where the chunk was "
                                     "(memory LRU, cache levels i.e. NVMe, origin)", labels=["source"])
        for source, n in s["served_bytes"].items():
            served.add_metric([source], n)
        yield served
        yield GaugeMetricFamily("modelfs_hit_ratio", "Share of READ bytes served without waiting for the origin",
                                value=s["hit_ratio"])
        origin = s["origin"]
        yield CounterMetricFamily("modelfs_origin_requests", "Ranged GETs sent to the origin",
                                  value=origin["requests"])
        yield CounterMetricFamily("modelfs_origin_bytes", "Bytes downloaded from the origin", value=origin["bytes"])
        yield CounterMetricFamily("modelfs_origin_errors", "Ranged GETs that failed after retries",
                                  value=origin["errors"])
        latency = origin["get_seconds"]
        buckets = [(_le(b), n) for b, n in latency["buckets"]] + [("+Inf", latency["count"])]
        yield HistogramMetricFamily("modelfs_origin_get_seconds", "Duration of one ranged GET of a chunk, "
                                    "retries included", buckets=buckets, sum_value=latency["sum"])
        yield CounterMetricFamily("modelfs_cache_loaded_bytes", "Bytes of chunks loaded from the cache levels",
                                  value=s["cache_loaded_bytes"])
        yield CounterMetricFamily("modelfs_egress_saved_bytes", "Bytes the origin did not send thanks to caches "
                                  "(lower bound)", value=s["egress_saved_bytes"])
        yield CounterMetricFamily("modelfs_prefetched_bytes", "Bytes fetched by the model-aware prefetch",
                                  value=s["prefetched_bytes"])
        yield CounterMetricFamily("modelfs_prefetch_dropped", "Queued read-ahead fetches dropped unstarted",
                                  value=s["prefetch_dropped"])
        yield GaugeMetricFamily("modelfs_pagecache_pushed_bytes", "Bytes pushed into the kernel page cache for "
                                "files still open", value=s["pagecache_pushed_bytes"])
        yield GaugeMetricFamily("modelfs_fetches_inflight", "Chunk fetches running now",
                                value=s["fetches_inflight"])
        yield GaugeMetricFamily("modelfs_memory_used_bytes", "Chunk bytes held or reserved in memory",
                                value=s["memory_used_bytes"])
        yield GaugeMetricFamily("modelfs_memory_limit_bytes", "--memory-limit", value=s["memory_limit_bytes"])
        yield GaugeMetricFamily("modelfs_open_files", "Open file handles", value=s["open_files"])
        dc = s["disk_cache"]
        if dc is not None:
            for name in ("hits", "misses", "corrupt", "read_errors", "write_errors", "evictions", "writes"):
                yield CounterMetricFamily(f"modelfs_disk_cache_{name}", f"NVMe chunk cache {name.replace('_', ' ')}",
                                          value=dc[name])
            yield GaugeMetricFamily("modelfs_disk_cache_hit_ratio", "NVMe chunk cache hits / lookups",
                                    value=dc["hit_ratio"])
            yield GaugeMetricFamily("modelfs_disk_cache_used_bytes", "Bytes of chunk files in the NVMe cache",
                                    value=dc["bytes_used"])
            yield GaugeMetricFamily("modelfs_disk_cache_size_bytes", "--cache-size in bytes", value=dc["max_bytes"])
            yield GaugeMetricFamily("modelfs_disk_cache_chunks", "Chunk files in the NVMe cache", value=dc["chunks"])


def _le(bound: float) -> str:
    return repr(float(bound))


def parse_metrics_addr(text: str) -> tuple[str, int]:
    """'HOST:PORT', '[::1]:PORT' or ':PORT' (every interface) -> (host, port)."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not port_text.isdigit():
        raise MetricsAddressError(f"invalid --metrics-addr {text!r}: use HOST:PORT, e.g. 127.0.0.1:9478")
    port = int(port_text)
    if port > 65535:
        raise MetricsAddressError(f"invalid --metrics-addr {text!r}: port out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - the http.server naming
        if self.path.split("?", 1)[0] not in METRICS_PATHS:
            self.send_error(404)
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the http.server signature
        log.debug("metrics: %s %s", self.address_string(), format % args)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    registry: CollectorRegistry

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A broken scrape (client gone, collector bug) costs that scrape, never the mount.
        log.debug("metrics request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Binds at construction (a pre-flight check: a port in use fails the mount before it starts),
    serves from a daemon thread once `start()` is called, and stops with `close()`."""

    def __init__(self, addr: str):
        host, port = parse_metrics_addr(addr)
        server_class = _Server6 if ":" in host else _Server
        try:
            self._server: _Server = server_class((host, port), _Handler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsAddressError(f"--metrics-addr {addr}: address already in use") from None
            raise MetricsAddressError(f"--metrics-addr {addr}: {exc.strerror or exc}") from None
        self._server.registry = CollectorRegistry(auto_describe=False)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else host
        return f"http://{shown}:{port}/metrics"

    def start(self, stats: MountStats) -> None:
        self._server.registry.register(StatsCollector(stats))
        self._thread = threading.Thread(target=self._server.serve_forever, name="modelfs-metrics", daemon=True)
        self._thread.start()
        log.info("metrics on %s", self.url)

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


# -- `modelfs stats` (runs in the CLI process, never in the daemon) --------------------------------


def read_stats(mountpoint: str) -> dict[str, Any]:
    """The running daemon's snapshot, through the virtual xattr of the mount root."""
    try:
        raw = os.getxattr(mountpoint, STATS_XATTR.decode())
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            raise StatsUnavailable(f"{mountpoint} is not the root of a modelfs mount") from None
        if exc.errno == errno.ENOTCONN:
            raise StatsUnavailable(f"the daemon of {mountpoint} is gone (transport endpoint is not connected)") \
                from None
        raise StatsUnavailable(f"cannot read stats of {mountpoint}: {exc.strerror or exc}") from None
    try:
        snapshot = json.loads(raw)
    except ValueError:
        raise StatsUnavailable(f"{mountpoint}: the daemon sent unreadable stats") from None
    if not isinstance(snapshot, dict) or snapshot.get("format") != STATS_FORMAT_VERSION:
        raise StatsUnavailable(f"{mountpoint}: stats format not understood (daemon of another version?)")
    return snapshot


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _percent(ratio: float) -> str:
    return f"{100 * ratio:.1f}%"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _latency_quantile(buckets: list[list[float]], count: int, q: float) -> str:
    """The bucket bound under which a fraction q of the GETs finished ('> last bound' beyond it)."""
    if count == 0:
        return "-"
    for bound, n in buckets:
        if n >= q * count:
            return f"<= {bound:g}s"
    return f"> {buckets[-1][0]:g}s" if buckets else "-"


def format_stats(s: dict[str, Any], mountpoint: str) -> str:
    """The human table of `modelfs stats`."""
    served, origin, dc = s["served_bytes"], s["origin"], s["disk_cache"]
    get_s = origin["get_seconds"]
    mean = f"{get_s['sum'] / get_s['count']:.3f}s" if get_s["count"] else "-"
    served_total = sum(served.values())
    rows: list[tuple[str, str]] = [
        ("mount", f"{mountpoint} (bucket {s['bucket']}, up {_duration(s['uptime_seconds'])})"),
        ("hit ratio", f"{_percent(s['hit_ratio'])} of {_size(served_total)} read did not wait for the origin"),
        ("read from memory", _size(served["memory"])),
        ("read from NVMe cache", _size(served["cache"])),
        ("read from origin", _size(served["origin"])),
        ("origin egress saved", f"{_size(s['egress_saved_bytes'])} (chunks loaded from the NVMe cache: "
                                f"{_size(s['cache_loaded_bytes'])})"),
        ("origin downloads", f"{_size(origin['bytes'])} in {origin['requests']} GETs, {origin['errors']} failed"),
        ("origin GET latency", f"mean {mean}, p50 {_latency_quantile(get_s['buckets'], get_s['count'], 0.5)}, "
                               f"p99 {_latency_quantile(get_s['buckets'], get_s['count'], 0.99)}"),
    ]
    if dc is None:
        rows.append(("NVMe cache", "off (no --cache-dir)"))
    else:
        used = _ratio(dc["bytes_used"], dc["max_bytes"])
        rows += [
            ("NVMe cache", f"{_size(dc['bytes_used'])} of {_size(dc['max_bytes'])} ({_percent(used)}), "
                           f"{dc['chunks']} chunks"),
            ("NVMe cache lookups", f"{dc['hits']} hits, {dc['misses']} misses ({_percent(dc['hit_ratio'])} hit), "
                                   f"{dc['evictions']} evictions"),
        ]
    rows += [
        ("memory", f"{_size(s['memory_used_bytes'])} of {_size(s['memory_limit_bytes'])}"),
        ("prefetched", f"{_size(s['prefetched_bytes'])}; page cache holds {_size(s['pagecache_pushed_bytes'])} "
                       f"pushed for open files"),
        ("now", f"{s['fetches_inflight']} fetches in flight, {s['open_files']} open files"),
    ]
    errors = [f"origin {origin['errors']}"]
    if dc is not None:
        errors += [f"cache corrupt {dc['corrupt']}", f"cache read {dc['read_errors']}",
                   f"cache write {dc['write_errors']}"]
    rows.append(("errors", ", ".join(errors)))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
