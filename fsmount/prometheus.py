"""The Prometheus endpoint of a mount (--metrics-addr): an HTTP server in a daemon thread that turns one
stats snapshot into metric families at each scrape.

It binds before the mount starts (a port in use is a pre-flight error), never raises into the mount, and
never exposes credentials.
"""

from __future__ import annotations

import errno
import http.server
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from fsmount.stats import MountStats

log = logging.getLogger(__name__)

METRICS_PATHS = ("/metrics", "/")
# How long a connection may sit between two reads or writes before it is closed. A scraper sends its request at once
# and the answer takes milliseconds (a full snapshot is ~20 KB); a client that connects and never finishes its request
# (a port scanner, a scraper gone behind a NAT) held a thread and a descriptor of the daemon for good otherwise.
HANDLER_TIMEOUT_S = 5.0
# Connections served at once; one beyond is closed at once. A node has a Prometheus pair and an operator's curl at
# most; each connection is a thread and a descriptor the mount's reads also need (at the fd limit every read of the
# mount failed EIO).
MAX_CONNECTIONS = 8
# The pause after accept() fails (EMFILE at the fd limit): the listening socket stays readable, and socketserver went
# straight back to accept(): the metrics thread spun 60-95% of a core. 0.2 s is 5 tries a second, no CPU to speak of.
ACCEPT_BACKOFF_S = 0.2


class MetricsAddressError(ValueError):
    """--metrics-addr is malformed or cannot be bound; the message is shown as is."""


class StatsCollector:
    """A prometheus_client collector that turns one snapshot into metric families at scrape time."""

    def __init__(self, stats: MountStats):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats.snapshot()
        served = CounterMetricFamily("modelfs_served_bytes", "Bytes of READ replies by where the chunk was "
                                     "(memory LRU, cache levels: the NVMe cache and the shared tier, origin)",
                                     labels=["source"])
        for source, n in s["served_bytes"].items():
            served.add_metric([source], n)
        yield served
        yield GaugeMetricFamily("modelfs_hit_ratio", "Share of READ bytes served without waiting for the origin",
                                value=s["hit_ratio"])
        origin = s["origin"]
        yield CounterMetricFamily("modelfs_origin_requests", "Ranged GETs sent to the origin",
                                  value=origin["requests"])
        yield CounterMetricFamily("modelfs_origin_bytes", "Bytes downloaded from the origin", value=origin["bytes"])
        yield CounterMetricFamily("modelfs_origin_errors", "Chunk fetches that failed after their retries "
                                  "(read-ahead and streaming ones included)", value=origin["errors"])
        yield CounterMetricFamily("modelfs_origin_retries", "Ranged GETs sent again within a fetch after a transient "
                                  "failure (5xx, throttling, resets, refused connections)", value=origin["retries"])
        failed = CounterMetricFamily("modelfs_failed_requests", "FUSE requests answered with an error because of the "
                                     "origin or a cache, by operation", labels=["op"])
        for op, n in sorted(s["failed_requests"].items()):
            failed.add_metric([op], n)
        yield failed
        yield CounterMetricFamily("modelfs_versions_gone", "READs refused because the bucket no longer holds the "
                                  "version open (replaced or deleted since the mount saw it)", value=s["versions_gone"])
        yield CounterMetricFamily("modelfs_origin_metadata_requests", "HEADs and listing pages sent to the origin",
                                  value=origin["metadata_requests"])
        yield CounterMetricFamily("modelfs_origin_metadata_errors", "Metadata requests that failed or timed out",
                                  value=origin["metadata_errors"])
        yield CounterMetricFamily("modelfs_origin_refetched_bytes", "Of the origin's bytes, those of chunks it "
                                  "had sent before (evicted from memory, or dropped by the kernel, before every "
                                  "READ that wanted them came)", value=origin["refetched_bytes"])
        latency = origin["get_seconds"]
        buckets = [(_le(b), n) for b, n in latency["buckets"]] + [("+Inf", latency["count"])]
        yield HistogramMetricFamily("modelfs_origin_get_seconds", "Duration of one ranged GET of a chunk, "
                                    "retries included", buckets=buckets, sum_value=latency["sum"])
        yield CounterMetricFamily("modelfs_cache_loaded_bytes", "Bytes of chunks loaded from the cache levels",
                                  value=s["cache_loaded_bytes"])
        yield CounterMetricFamily("modelfs_egress_saved_bytes", "Bytes the origin did not send thanks to caches "
                                  "(lower bound)", value=s["egress_saved_bytes"])
        yield CounterMetricFamily("modelfs_streamed_bytes", "Bytes fetched by model streaming (safetensors "
                                  "files streamed in offset order when opened)", value=s["streamed_bytes"])
        yield CounterMetricFamily("modelfs_readahead_dropped", "Queued read-ahead fetches dropped unstarted",
                                  value=s["readahead_dropped"])
        yield CounterMetricFamily("modelfs_pagecache_stored_bytes", "Bytes pushed into the kernel page cache "
                                  "so far (notify_store)", value=s["pagecache_stored_bytes"])
        yield CounterMetricFamily("modelfs_pagecache_drops", "READs that found the kernel had dropped pages "
                                  "it was believed to hold (pushed or read whole)", value=s["pagecache_drops"])
        yield GaugeMetricFamily("modelfs_pagecache_pushed_bytes", "Bytes pushed into the kernel page cache for "
                                "files still open", value=s["pagecache_pushed_bytes"])
        yield GaugeMetricFamily("modelfs_fetches_inflight", "Chunk fetches running now",
                                value=s["fetches_inflight"])
        yield GaugeMetricFamily("modelfs_cache_writes_pending", "Fetched chunks still to be written to the cache "
                                "levels (written in the background)", value=s["cache_writes_pending"])
        yield CounterMetricFamily("modelfs_cache_writes_given_up", "Cache writes given up on their deadline "
                                  "(a stalled cache disk)", value=s["cache_writes_given_up"])
        yield CounterMetricFamily("modelfs_cache_reads_given_up", "Cache reads given up on their deadline (a cache "
                                  "disk whose reads hang): served by the origin", value=s["cache_reads_given_up"])
        yield CounterMetricFamily("modelfs_cache_writes_skipped", "Fetched chunks not written to the cache "
                                  "levels while cache writes stall", value=s["cache_writes_skipped"])
        yield GaugeMetricFamily("modelfs_memory_used_bytes", "Chunk bytes held or reserved in memory",
                                value=s["memory_used_bytes"])
        yield GaugeMetricFamily("modelfs_memory_limit_bytes", "Chunk memory: --memory-limit less the runtime's share",
                                value=s["memory_limit_bytes"])
        yield GaugeMetricFamily("modelfs_open_files", "Open file handles", value=s["open_files"])
        yield GaugeMetricFamily("modelfs_inodes", "Inodes the kernel holds (root included): they go when it sends "
                                "FORGET", value=s["inodes"])
        dc = s["disk_cache"]
        if dc is not None:
            for name in ("hits", "misses", "corrupt", "other_format", "read_errors", "write_errors", "lock_timeouts",
                         "evictions", "writes", "writes_skipped"):
                yield CounterMetricFamily(f"modelfs_disk_cache_{name}", f"NVMe chunk cache {name.replace('_', ' ')}",
                                          value=dc[name])
            yield GaugeMetricFamily("modelfs_disk_cache_hit_ratio", "NVMe chunk cache hits / lookups",
                                    value=dc["hit_ratio"])
            yield GaugeMetricFamily("modelfs_disk_cache_used_bytes", "Bytes of chunk files in the NVMe cache",
                                    value=dc["bytes_used"])
            yield GaugeMetricFamily("modelfs_disk_cache_size_bytes", "--cache-size in bytes", value=dc["max_bytes"])
            if dc.get("room_bytes") is not None:
                yield GaugeMetricFamily("modelfs_disk_cache_room_bytes", "Bytes the NVMe cache can hold as its disk "
                                        "stands (its chunks and the free space beyond its floor), at most --cache-size",
                                        value=dc["room_bytes"])
            yield GaugeMetricFamily("modelfs_disk_cache_chunks", "Chunk files in the NVMe cache", value=dc["chunks"])
        wr = s.get("writes")
        if wr is not None:
            for name, what in (("files_stored", "files written through the mount and stored in the bucket"),
                               ("files_failed", "files written through the mount that were not stored"),
                               ("bytes_uploaded", "bytes uploaded by writes"),
                               ("parts_uploaded", "upload parts (and single PUTs) sent"),
                               ("renames", "renames done"), ("deletes", "files deleted"),
                               ("deletes_refused", "unlinks, rmdirs and renames refused without --allow-delete"),
                               ("chunks_cached", "chunks of stored files put into the NVMe cache")):
                yield CounterMetricFamily(f"modelfs_writes_{name}", f"Writes: {what}", value=wr[name])
        sc = s["shared_cache"]
        if sc is not None:
            for name, what in (("hits", "chunks found in the shared tier"),
                               ("misses", "chunk lookups the shared tier did not answer"),
                               ("bytes", "bytes loaded from the shared tier (what it saved the origin is in "
                                         "modelfs_shared_cache_egress_saved_bytes: not chunks this daemon had "
                                         "fetched before)"),
                               ("claims", "chunks this node claimed and fetched from the origin for the fleet"),
                               ("claim_waits", "misses that waited for another node's fetch"),
                               ("fallbacks", "waits that ended without the chunk (then fetched from the origin)"),
                               ("writes", "chunk objects written to the shared tier"),
                               ("write_errors", "writes the shared tier refused or that failed (chunks, claims, "
                                                "waiting markers)"),
                               ("chunk_write_errors", "of those, chunk objects not written"),
                               ("writes_skipped", "chunks not written because the tier was failing or refusing writes "
                                                  "then"),
                               ("trailed", "chunk writes held back until this node's origin reads were done"),
                               ("trail_dropped", "trailing chunk writes given up (the NVMe cache no longer held "
                                                 "the chunk)"),
                               ("waiters_seen", "listings of waiting markers that found another node waiting"),
                               ("corrupt", "chunk objects that failed the identity or checksum check"),
                               ("other_format", "chunk objects of another version's format (replaced, as corrupt "
                                                "ones are)"),
                               ("errors", "shared-tier requests that failed"),
                               ("egress_saved_bytes", "bytes loaded from the shared tier that the origin had not "
                                                      "sent to this daemon (its share of modelfs_egress_saved_bytes)")):
                yield CounterMetricFamily(f"modelfs_shared_cache_{name}", f"Shared tier: {what}", value=sc[name])
            yield GaugeMetricFamily("modelfs_shared_cache_hit_ratio", "Shared tier: hits / lookups",
                                    value=sc["hit_ratio"])


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
    timeout = HANDLER_TIMEOUT_S  # set on the socket by StreamRequestHandler.setup

    def do_GET(self) -> None:  # noqa: N802 - the http.server naming
        self._answer(with_body=True)

    def do_HEAD(self) -> None:  # noqa: N802 - a health check's HEAD got 501
        self._answer(with_body=False)

    def _answer(self, with_body: bool) -> None:
        if self.path.split("?", 1)[0] not in METRICS_PATHS:
            self.send_error(404)
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the http.server signature
        log.debug("metrics: %s %s", self.address_string(), format % args)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    registry: CollectorRegistry

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._accept_failing = False

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            request = super().get_request()
        except OSError as exc:
            if not self._accept_failing:
                self._accept_failing = True
                log.warning("metrics: cannot accept a connection (%s); trying again every %g s", exc.strerror or exc,
                            ACCEPT_BACKOFF_S)
            time.sleep(ACCEPT_BACKOFF_S)
            raise
        self._accept_failing = False
        return request

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            log.debug("metrics: %d connections open, closing the one from %s", MAX_CONNECTIONS, client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: it would have given the slot back
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

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
