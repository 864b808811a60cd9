"""`modelfs stats MOUNTPOINT`, in the CLI process (never in the daemon): read the running daemon's
snapshot through the virtual xattr of the mount root, and print it as a table.
"""

from __future__ import annotations

import errno
import json
import os
from typing import Any

from fsmount.data import counted, human_size
from fsmount.stats import STATS_FORMAT_VERSION, STATS_XATTR, ratio

# How long `modelfs stats` waits for the daemon's answer (it comes in milliseconds from a daemon that runs).
STATS_TIMEOUT_S = 10.0


class StatsUnavailable(Exception):
    """`modelfs stats` cannot get numbers from this path; the message says why (`errno`: the error of the read of the
    stats, where one said it, for the caller to say more)."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno


class DaemonSilent(StatsUnavailable):
    """The daemon did not answer within the timeout (stopped or hung)."""


def _getxattr(mountpoint: str, timeout: float) -> bytes:
    """The stats xattr, read in a thread of its own: a daemon that is stopped (SIGSTOP) or hung never answers,
    and a getxattr waiting on it cannot be interrupted; the command then says so instead of hanging."""
    import threading

    out: list[bytes | OSError] = []

    def read() -> None:
        try:
            out.append(os.getxattr(mountpoint, STATS_XATTR.decode()))
        except OSError as exc:
            out.append(exc)

    reader = threading.Thread(target=read, daemon=True)  # left behind if it never returns
    reader.start()
    reader.join(timeout)
    if not out:
        raise DaemonSilent(f"the daemon of {mountpoint} does not answer within {timeout:g}s (stopped or hung?)")
    if isinstance(out[0], OSError):
        raise out[0]
    return out[0]


def read_stats(mountpoint: str, timeout: float = STATS_TIMEOUT_S) -> dict[str, Any]:
    """The running daemon's snapshot, through the virtual xattr of the mount root."""
    try:
        raw = _getxattr(mountpoint, timeout)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            raise StatsUnavailable(f"{mountpoint} is not the root of a modelfs mount", exc.errno) from None
        if exc.errno == errno.ENOTCONN:
            raise StatsUnavailable(f"the daemon of {mountpoint} is gone (transport endpoint is not connected); "
                                   f"its counters went with it: run `modelfs unmount {mountpoint}`, then mount "
                                   "again", errno.ENOTCONN) from None
        raise StatsUnavailable(f"cannot read stats of {mountpoint}: {exc.strerror or exc}", exc.errno) from None
    try:
        snapshot = json.loads(raw)
    except ValueError:
        raise StatsUnavailable(f"{mountpoint}: the daemon sent unreadable stats") from None
    if not isinstance(snapshot, dict) or snapshot.get("format") != STATS_FORMAT_VERSION:
        raise StatsUnavailable(f"{mountpoint}: stats format not understood (daemon of another version?)")
    return snapshot


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


def _other_format(level: dict[str, Any]) -> str:
    """A cache level's chunks of another version's format, where there are some: not damaged, but fetched again."""
    n = level.get("other_format")
    return f", {counted(n, 'chunk', 'chunks')} of another version's format (fetched again)" if n else ""


def format_stats(s: dict[str, Any], mountpoint: str) -> str:
    """The human table of `modelfs stats`."""
    served, origin, dc = s["served_bytes"], s["origin"], s["disk_cache"]
    get_s = origin["get_seconds"]
    mean = f"{get_s['sum'] / get_s['count']:.3f}s" if get_s["count"] else "-"
    served_total = sum(served.values())
    sc = s.get("shared_cache")
    # Chunks loaded from the cache levels: the NVMe cache's, and the shared tier's (once counted as NVMe).
    tier_loaded = sc["bytes"] if sc is not None else 0
    loaded = f"chunks loaded from the NVMe cache: {human_size(s['cache_loaded_bytes'] - tier_loaded)}"
    if sc is not None:
        loaded += f", from the shared tier: {human_size(tier_loaded)}"
    rows: list[tuple[str, str]] = [
        ("mount", f"{mountpoint} (bucket {s['bucket']}, up {_duration(s['uptime_seconds'])})"),
        ("hit ratio", f"{_percent(s['hit_ratio'])} of {human_size(served_total)} read did not wait for the origin"),
        ("read from memory", human_size(served["memory"])),
        ("read from NVMe cache" if sc is None else "read from NVMe cache or shared tier", human_size(served["cache"])),
        ("read from origin", human_size(served["origin"])),
        ("origin egress saved", f"{human_size(s['egress_saved_bytes'])} ({loaded})"),
        ("origin downloads", f"{human_size(origin['bytes'])} in {counted(origin['requests'], 'GET', 'GETs')}, "
                             f"{origin['errors']} failed"
                             + (f", {origin['retries']} sent again" if origin.get("retries") else "")),
        ("origin metadata", f"{origin['metadata_requests']} HEADs and listing pages, "
                            f"{origin['metadata_errors']} failed"),
        ("origin fetched again", human_size(origin.get("refetched_bytes", 0))),
        ("origin GET latency", f"mean {mean}, p50 {_latency_quantile(get_s['buckets'], get_s['count'], 0.5)}, "
                               f"p99 {_latency_quantile(get_s['buckets'], get_s['count'], 0.99)}"),
    ]
    if dc is None:
        rows.append(("NVMe cache", "off (no --cache-dir)"))
    else:
        # The room its disk gives, where that is less than --cache-size: "of 200 GiB" on a disk with 37 GiB free read
        # as room the cache did not have.
        room = dc.get("room_bytes")
        limit = room if room is not None and room < dc["max_bytes"] else dc["max_bytes"]
        of = human_size(limit) + (f" (the room its disk gives; --cache-size {human_size(dc['max_bytes'])})"
                                  if limit < dc["max_bytes"] else "")
        used = ratio(dc["bytes_used"], limit)
        rows += [
            ("NVMe cache", f"{human_size(dc['bytes_used'])} of {of} ({_percent(used)}), "
                           f"{counted(dc['chunks'], 'chunk', 'chunks')}"
                           + (f", {dc['writes_skipped']} not written (writes paused after a failure, or no room)"
                              if dc.get("writes_skipped") else "")),
            ("NVMe cache lookups", f"{counted(dc['hits'], 'hit', 'hits')}, {counted(dc['misses'], 'miss', 'misses')} "
                                   f"({_percent(dc['hit_ratio'])} hit), "
                                   f"{counted(dc['evictions'], 'eviction', 'evictions')}"
                                   + _other_format(dc)),
        ]
        if s.get("cache_writes_given_up") or s.get("cache_writes_skipped"):
            rows.append(("cache writes", f"{s['cache_writes_given_up']} given up unfinished, "
                                         f"{s['cache_writes_skipped']} not started (a cache level stalled)"))
        if s.get("cache_reads_given_up"):
            rows.append(("cache reads", f"{s['cache_reads_given_up']} given up unfinished (a cache level stalled): "
                                        "read from the origin"))
    if sc is not None:
        mode = "read-only" if sc["read_only"] else "claims on" if sc["claims_enabled"] else "claims off"
        rows += [
            ("shared tier", f"{sc['bucket']} ({mode}): {counted(sc['hits'], 'hit', 'hits')}, "
                            f"{counted(sc['misses'], 'miss', 'misses')} "
                            f"({_percent(sc['hit_ratio'])} hit), {human_size(sc['bytes'])} loaded"
                            + _other_format(sc)),
            ("shared tier fleet", f"{counted(sc['claims'], 'chunk', 'chunks')} fetched for the fleet, "
                                  f"{counted(sc['claim_waits'], 'wait', 'waits')} for other nodes, "
                                  f"{counted(sc['fallbacks'], 'fallback', 'fallbacks')}, {sc['writes']} written, "
                                  f"{sc['trailed']} held back behind the load ({sc['trail_dropped']} of "
                                  "those given up)"
                                  + (f", {sc['writes_skipped']} not written (the tier failed or refused writes)"
                                     if sc.get("writes_skipped") else "")),
        ]
    ws = s.get("writes")
    if ws is not None:
        parts = counted(ws["parts_uploaded"], "part", "parts")
        rows.append(("writes", f"{counted(ws['files_stored'], 'file', 'files')} stored "
                               f"({human_size(ws['bytes_uploaded'])} in {parts}), {ws['files_failed']} not stored, "
                               f"{counted(ws['renames'], 'rename', 'renames')}, "
                               f"{counted(ws['deletes'], 'delete', 'deletes')}"
                               + (f", {counted(ws['deletes_refused'], 'delete', 'deletes')} refused (they need "
                                  "--allow-delete)"
                                  if ws.get("deletes_refused") else "")))
    rows += [
        ("chunk memory", f"{human_size(s['memory_used_bytes'])} of {human_size(s['memory_limit_bytes'])}"),
        ("model streaming", f"{human_size(s['streamed_bytes'])} fetched, "
                            f"{human_size(s['pagecache_stored_bytes'])} pushed into the page cache "
                            f"({human_size(s['pagecache_pushed_bytes'])} for files still open), "
                            f"{s['pagecache_drops']} dropped by the kernel"),
        # Writes still to run: a held-back count above the written one read as a miscount without it (B251).
        ("now", f"{counted(s['fetches_inflight'], 'fetch', 'fetches')} in flight, "
                f"{counted(s['open_files'], 'open file', 'open files')}"
                + (f", {counted(s['cache_writes_pending'], 'fetched chunk', 'fetched chunks')} still to write to the "
                   "cache levels"
                   if s.get("cache_writes_pending") else "")),
    ]
    errors = [f"origin {origin['errors']}"]
    failed = s.get("failed_requests") or {}
    if failed:  # what readers saw fail, whatever failed under it
        errors.insert(0, "requests failed " + " ".join(f"{op} {n}" for op, n in sorted(failed.items())))
    if dc is not None:
        errors += [f"cache corrupt {dc['corrupt']}", f"cache read {dc['read_errors']}",
                   f"cache write {dc['write_errors']}"]
        if dc.get("lock_timeouts"):
            errors.append(f"cache stalled {dc['lock_timeouts']}")
    if sc is not None:
        errors += [f"shared tier {sc['errors']}", f"shared write {sc['write_errors']}"
                   + (f" ({sc['chunk_write_errors']} of chunks)" if sc.get("chunk_write_errors") else ""),
                   f"shared corrupt {sc['corrupt']}"]
    if ws is not None:
        errors.append(f"files not stored {ws['files_failed']}")
    rows.append(("errors", ", ".join(errors)))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
