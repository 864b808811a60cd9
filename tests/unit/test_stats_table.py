"""`modelfs stats`'s table (stats_table.format_stats) from a snapshot: what each row says it counts."""

from __future__ import annotations

import re
from typing import Any

from fsmount.stats_table import format_stats

MiB = 1 << 20


def snapshot(**extra: Any) -> dict[str, Any]:
    """A snapshot as MountStats.snapshot() gives it: 24 MiB read, 16 MiB of it from chunks the cache levels
    loaded (8 MiB of those from the shared tier when there is one), 8 MiB from the origin."""
    out: dict[str, Any] = {
        "format": 1, "bucket": "models", "uptime_seconds": 5.0,
        "served_bytes": {"memory": 0, "cache": 16 * MiB, "origin": 8 * MiB}, "hit_ratio": 2 / 3,
        "origin": {"requests": 1, "bytes": 8 * MiB, "errors": 0, "metadata_requests": 3, "metadata_errors": 1,
                   "get_seconds": {"buckets": [[0.1, 1]], "count": 1, "sum": 0.05}},
        "cache_loaded_bytes": 16 * MiB, "cache_chunk_hits": 2, "egress_saved_bytes": 16 * MiB,
        "streamed_bytes": 0, "readahead_dropped": 0, "pagecache_pushed_bytes": 0, "pagecache_stored_bytes": 0,
        "pagecache_drops": 0,
        "versions_gone": 0,
        "fetches_inflight": 0,
        "cache_writes_pending": 0, "cache_writes_given_up": 0, "cache_writes_skipped": 0,
        "cache_reads_given_up": 0,
        "memory_used_bytes": 0, "memory_limit_bytes": 64 * MiB, "open_files": 0,
        "inodes": 1, "disk_cache": None, "shared_cache": None, "writes": None,
    }
    out.update(extra)
    return out


def rows(text: str) -> dict[str, str]:
    return {line[:36].strip(): line[36:].strip() for line in text.splitlines()}


def test_shared_tier_loads_are_not_called_nvme_ones() -> None:
    tier = {"bucket": "tier", "read_only": False, "claims_enabled": True, "hits": 1, "misses": 1, "hit_ratio": 0.5,
            "bytes": 8 * MiB, "claims": 1, "claim_waits": 0, "fallbacks": 0, "writes": 1, "write_errors": 0,
            "corrupt": 0, "errors": 0, "egress_saved_bytes": 8 * MiB, "trailed": 1, "trail_dropped": 0,
            "waiters_seen": 0}
    text = format_stats(snapshot(shared_cache=tier), "/models")
    assert "1 written, 1 held back behind the load (0 of those given up)\n" in text, text
    # Chunks not written while the tier failed showed in the JSON alone (a fleet tester).
    skipped = format_stats(snapshot(shared_cache={**tier, "writes_skipped": 13}), "/models")
    assert "1 written, 1 held back behind the load (0 of those given up), 13 not written (the tier failed or " \
        "refused writes)" in skipped
    # B251: just after a load, "18 written (50 after the load, 0 given up)" read as a miscount: the writes held back
    # were counted as they were queued, and the 32 still to run showed nowhere.
    loading = format_stats(snapshot(shared_cache={**tier, "writes": 18, "trailed": 50}, cache_writes_pending=32),
                           "/models")
    assert "18 written, 50 held back behind the load (0 of those given up)\n" in loading, loading
    assert rows(loading)["now"] == "0 fetches in flight, 0 open files, 32 fetched chunks still to write to the " \
        "cache levels", loading
    assert rows(text)["now"] == "0 fetches in flight, 0 open files", text
    assert "read from NVMe cache or shared tier" in text and "read from NVMe cache  " not in text
    assert "(chunks loaded from the NVMe cache: 8.00 MiB, from the shared tier: 8.00 MiB)" in text, text
    alone = format_stats(snapshot(), "/models")
    assert "(chunks loaded from the NVMe cache: 16.00 MiB)" in alone and "shared tier" not in alone, alone
    assert "origin metadata       3 HEADs and listing pages, 1 failed" in alone, alone


def test_writes_have_a_row_and_failed_stores_count_as_errors() -> None:
    writes = {"files_stored": 235, "files_failed": 1, "bytes_uploaded": 3 * MiB, "parts_uploaded": 4,
              "renames": 2, "deletes": 1, "chunks_cached": 0}
    text = format_stats(snapshot(writes=writes), "/ckpt")
    assert "235 files stored (3.00 MiB in 4 parts), 1 not stored, 2 renames, 1 delete\n" in text + "\n", text
    refused = format_stats(snapshot(writes={**writes, "deletes_refused": 7}), "/ckpt")
    assert "1 delete, 7 deletes refused (they need --allow-delete)" in refused, refused
    assert text.splitlines()[-1].endswith("files not stored 1"), text
    assert "files not stored" not in format_stats(snapshot(), "/models")


def test_cache_reads_given_up_have_a_row_only_when_there_are_some() -> None:
    disk = {"hits": 2, "misses": 1, "hit_ratio": 2 / 3, "corrupt": 0, "read_errors": 0, "write_errors": 0,
            "lock_timeouts": 0, "evictions": 0, "writes": 1, "bytes_used": 16 * MiB, "max_bytes": 64 * MiB,
            "chunks": 2}
    stalled = format_stats(snapshot(disk_cache=disk, cache_reads_given_up=3), "/models")
    assert "\ncache reads           3 given up unfinished (a cache level stalled): read from the origin\n" in stalled
    assert "cache reads" not in format_stats(snapshot(disk_cache=disk), "/models")


def test_egress_saved_never_goes_down_and_failed_requests_and_retries_are_counted() -> None:
    """`modelfs_egress_saved_bytes_total` went down when a fetch loaded bytes no READ took yet (a read-ahead, a
    sparse pread): Prometheus reads a counter that goes down as a reset and counts its whole value again. And an
    origin outage that failed reads showed nowhere: no count of failed requests, nor of GETs sent again."""
    import types

    from fsmount.data import ChunkEngine
    from fsmount.stats import MountStats
    from tests.unit.fake_store import FakeStore

    store = FakeStore()
    store.get_retries = 3
    engine = ChunkEngine(store, chunk_size=MiB, memory_limit=64 * MiB, max_connections=2, read_timeout=5.0)
    failed = {"read": 2, "lookup": 1}
    stats = MountStats("models", engine, types.SimpleNamespace(streamed_bytes=0),
                       types.SimpleNamespace(pushed=0, stored_total=0), failed=lambda: failed)
    engine.stats.bytes_served_memory, engine.levels.stats.origin_bytes = 128 * MiB, 64 * MiB  # read twice
    assert stats.snapshot()["egress_saved_bytes"] == 64 * MiB
    engine.levels.stats.origin_bytes += 8 * MiB  # a chunk read ahead, no READ took it yet
    first = stats.snapshot()
    assert first["egress_saved_bytes"] == 64 * MiB  # not 56 MiB
    assert first["failed_requests"] == failed and first["origin"]["retries"] == 3
    text = format_stats(first, "/models")
    assert "errors                requests failed lookup 1 read 2, origin 0" in text, text
    assert "origin downloads      72.00 MiB in 0 GETs, 0 failed, 3 sent again" in text, text


def test_one_of_a_thing_is_not_said_in_the_plural() -> None:
    """An operator's `modelfs stats` during a load read "0 fetches in flight, 1 open files" (B265)."""
    dc = {"hits": 1, "misses": 1, "hit_ratio": 0.5, "corrupt": 0, "other_format": 0, "read_errors": 0,
          "write_errors": 0, "lock_timeouts": 0, "evictions": 1, "writes": 1, "writes_skipped": 0,
          "bytes_used": 8 * MiB, "max_bytes": 64 * MiB, "chunks": 1}
    table = format_stats(snapshot(fetches_inflight=1, open_files=1, cache_writes_pending=1, disk_cache=dc), "/models")
    text = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in table.splitlines())
    assert text["now"] == "1 fetch in flight, 1 open file, 1 fetched chunk still to write to the cache levels", text
    assert text["origin downloads"] == "8.00 MiB in 1 GET, 0 failed", text
    assert text["NVMe cache"] == "8.00 MiB of 64.00 MiB (12.5%), 1 chunk", text
    assert text["NVMe cache lookups"] == "1 hit, 1 miss (50.0% hit), 1 eviction", text
    # The shared tier's rows and the writes' took the plural too ("1 hits, 1 misses", "1 files stored"; the review).
    tier = {"bucket": "tier", "read_only": False, "claims_enabled": True, "hits": 1, "misses": 1, "hit_ratio": 0.5,
            "bytes": 8 * MiB, "claims": 1, "claim_waits": 1, "fallbacks": 1, "writes": 1, "write_errors": 0,
            "corrupt": 0, "errors": 0, "trailed": 0, "trail_dropped": 0}
    writes = {"files_stored": 1, "files_failed": 0, "bytes_uploaded": MiB, "parts_uploaded": 1, "renames": 1,
              "deletes": 1, "deletes_refused": 1}
    table = format_stats(snapshot(shared_cache=tier, writes=writes), "/models")
    text = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in table.splitlines())
    assert text["shared tier"] == "tier (claims on): 1 hit, 1 miss (50.0% hit), 8.00 MiB loaded", text
    assert text["shared tier fleet"] == ("1 chunk fetched for the fleet, 1 wait for other nodes, 1 fallback, 1 "
                                         "written, 0 held back behind the load (0 of those given up)"), text
    assert text["writes"] == ("1 file stored (1.00 MiB in 1 part), 0 not stored, 1 rename, 1 delete, 1 delete refused "
                              "(they need --allow-delete)"), text


def test_chunks_of_another_format_and_the_tier_s_chunk_write_errors_are_shown_where_there_are_some() -> None:
    """The shared tier's `chunk_write_errors` and the cache levels' `other_format` reached Prometheus (B390) and the
    JSON, not the table: chunk objects the tier refused and refused claims or markers both read "shared write 5"
    (B494)."""
    dc = {"hits": 1, "misses": 1, "hit_ratio": 0.5, "corrupt": 0, "other_format": 0, "read_errors": 0,
          "write_errors": 0, "lock_timeouts": 0, "evictions": 0, "writes": 1, "bytes_used": 8 * MiB,
          "max_bytes": 64 * MiB, "chunks": 1}
    tier = {"bucket": "tier", "read_only": False, "claims_enabled": True, "hits": 1, "misses": 1, "hit_ratio": 0.5,
            "bytes": 8 * MiB, "claims": 1, "claim_waits": 0, "fallbacks": 0, "writes": 1, "write_errors": 0,
            "chunk_write_errors": 0, "corrupt": 0, "other_format": 0, "errors": 0, "trailed": 0, "trail_dropped": 0}
    quiet = format_stats(snapshot(disk_cache=dc, shared_cache=tier), "/models")
    assert "format" not in quiet and "of chunks" not in quiet, quiet
    table = format_stats(snapshot(disk_cache={**dc, "other_format": 2},
                                  shared_cache={**tier, "write_errors": 5, "chunk_write_errors": 3,
                                                "other_format": 1}), "/models")
    text = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in table.splitlines())
    assert text["NVMe cache lookups"] == ("1 hit, 1 miss (50.0% hit), 0 evictions, 2 chunks of another version's "
                                          "format (fetched again)"), text
    assert text["shared tier"] == ("tier (claims on): 1 hit, 1 miss (50.0% hit), 8.00 MiB loaded, 1 chunk of another "
                                   "version's format (fetched again)"), text
    assert "shared write 5 (3 of chunks), shared corrupt 0" in text["errors"], text


def test_a_cache_whose_disk_gives_less_than_cache_size_is_shown_against_that_room() -> None:
    """A new user's `modelfs stats` read "NVMe cache 1.00 GiB of 200.00 GiB" where the mount's log said its disk left
    room for 37 GiB: the cache never holds more than that, so the row says the room and where --cache-size stands.
    Room unknown, or at least --cache-size, reads as before."""
    dc = {"hits": 1, "misses": 1, "hit_ratio": 0.5, "corrupt": 0, "other_format": 0, "read_errors": 0,
          "write_errors": 0, "lock_timeouts": 0, "evictions": 0, "writes": 1, "writes_skipped": 0,
          "bytes_used": 8 << 30, "max_bytes": 200 << 30, "chunks": 1024}

    def row(**disk: Any) -> str:
        table = format_stats(snapshot(disk_cache={**dc, **disk}), "/models")
        return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in table.splitlines())["NVMe cache"]

    assert row(room_bytes=32 << 30) == ("8.00 GiB of 32.00 GiB (the room its disk gives; --cache-size 200.00 GiB) "
                                        "(25.0%), 1024 chunks")
    assert row(room_bytes=200 << 30) == row(room_bytes=None) == row() == "8.00 GiB of 200.00 GiB (4.0%), 1024 chunks"
