"""The metrics endpoint's hold on the daemon: connections time out, are capped, and a failing accept() waits."""

from __future__ import annotations

import errno
import os
import re
import socket
import socketserver
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fsmount import prometheus
from fsmount.prometheus import MetricsServer
from tests.helpers import expects_warning


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    served = MetricsServer("127.0.0.1:0")
    served.start(stats=None)  # type: ignore[arg-type] - never scraped here
    yield served
    served.close()


def port_of(server: MetricsServer) -> int:
    return server._server.server_address[1]


def test_an_idle_metrics_connection_is_closed_by_the_daemon(server: MetricsServer) -> None:
    """A client that connects and never finishes its request held a thread and a descriptor of the daemon."""
    with socket.create_connection(("127.0.0.1", port_of(server))) as client:
        client.sendall(b"GET /metrics HTTP/1.1\r\n")  # no blank line: the request never ends
        client.settimeout(10)  # HANDLER_TIMEOUT_S and then some
        assert client.recv(1024) == b""  # closed, without an answer


def test_connections_beyond_the_cap_are_closed_at_once_and_slots_come_back(server: MetricsServer) -> None:
    port = port_of(server)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(prometheus.MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # every one accepted and holding its thread
        with socket.create_connection(("127.0.0.1", port)) as extra:
            extra.settimeout(1)  # well under HANDLER_TIMEOUT_S: closed at accept, not by the timeout
            assert extra.recv(1024) == b""
    finally:
        for c in idle:
            c.close()
    time.sleep(0.3)  # their threads end, and give their slots back
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.settimeout(5)
        client.sendall(b"GET /nothing HTTP/1.0\r\n\r\n")
        assert client.recv(1024).startswith(b"HTTP/1.0 404")


@expects_warning("metrics: cannot accept a connection")
def test_a_failing_accept_waits_before_it_is_tried_again(monkeypatch: pytest.MonkeyPatch, caplog) -> None:  # noqa: ANN001
    """At the daemon's fd limit accept() fails with EMFILE and the listening socket stays readable: the metrics
    thread went straight back to accept(), 60-95% of a core while every read of the mount failed."""
    tries: list[float] = []
    served = MetricsServer("127.0.0.1:0")

    def out_of_descriptors() -> None:
        tries.append(time.monotonic())
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(socketserver.TCPServer, "get_request", lambda self: out_of_descriptors())
    served.start(stats=None)  # type: ignore[arg-type]
    try:  # a connection waits in the backlog: the listening socket is readable all along
        with socket.create_connection(("127.0.0.1", port_of(served))):
            time.sleep(1.0)
    finally:
        served.close()
    assert 1 <= len(tries) <= 1.0 / prometheus.ACCEPT_BACKOFF_S + 2, len(tries)
    assert sum("cannot accept" in r.getMessage() for r in caplog.records) == 1  # once, not once a try


def test_the_metrics_thread_does_not_spin_when_the_daemon_is_out_of_descriptors() -> None:
    """As measured on a mount: the process at its RLIMIT_NOFILE, clients still connecting."""
    script = r'''
import os, resource, socket, time
from fsmount.prometheus import MetricsServer
from tests.helpers import expects_warning
server = MetricsServer("127.0.0.1:0"); server.start(stats=None)
port = server._server.server_address[1]
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 10, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
clients = []
for _ in range(30):  # the clients' own descriptors count too: a few are refused, the server's side fills up
    try:
        clients.append(socket.create_connection(("127.0.0.1", port), timeout=1))
    except OSError:
        break
time.sleep(0.5)
t0 = sum(os.times()[:2]); time.sleep(2); print(sum(os.times()[:2]) - t0)
os._exit(0)
'''
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    cpu = float(done.stdout.strip().splitlines()[-1])
    assert cpu < 0.5, f"the metrics thread used {cpu:.2f} s of CPU in 2 s while out of descriptors"


def exported_names(snapshot: dict) -> dict[str, str]:
    """Every metric name a scrape of `snapshot` shows (counters with their _total), and its HELP."""

    class Snapshot:
        def snapshot(self) -> dict:
            return snapshot

    return {m.name + ("_total" if m.type == "counter" else ""): m.documentation
            for m in prometheus.StatsCollector(Snapshot()).collect()}  # type: ignore[arg-type]


def readme_metric_names(exported: set[str]) -> set[str]:
    """The metric names README.md gives: `modelfs_x_{a,b}_total` spelled out, and in a row of the metrics table a
    bare `_suffix` after the row's first name read as a prefix of that name plus it (the prefix that makes an exported
    name; the longest where none does, so that it shows as missing)."""
    text = (Path(__file__).parents[2] / "README.md").read_text()
    renamed = re.search(r"^- Renamed in this version.*?(?=^- )", text, re.MULTILINE | re.DOTALL)
    assert renamed, "README's note of the renamed metrics moved"
    text = text.replace(renamed[0], "")  # the old names it gives are no longer exported
    names: set[str] = set()
    for line in text.splitlines():
        row = line.startswith("| `modelfs_")
        words = [re.sub(r"\{[a-z]+=.*\}$", "", word)  # labels: `modelfs_served_bytes_total{source=a\|b}`
                 for word in re.findall(r"`(_?[a-z][^`]*)`", line.split(" | ")[0] if row else line)]
        first = next((w for w in words if w.startswith("modelfs_")), "")
        for word in words:
            if word.startswith("modelfs_"):
                braces = re.search(r"\{([a-z_,]+)\}", word)
                names.update([word[:braces.start()] + one + word[braces.end():] for one in braces[1].split(",")]
                             if braces else [word])
            elif row and word.startswith("_"):
                parts = first.split("{")[0].rstrip("_").split("_")
                made = ["_".join(parts[:n]) + word for n in range(len(parts), 1, -1)]
                names.add(next((name for name in made if name in exported), made[0]))
    return names


def test_the_readme_metrics_table_and_the_exporter_name_the_same_metrics() -> None:
    """The README's table of metrics and what --metrics-addr serves agree both ways: `modelfs_cache_writes_pending`
    was in the stats JSON and not exported, and two HELP texts said other things than the table: origin errors
    counted "ranged GETs" where they are chunk fetches, refetched bytes left out chunks the kernel dropped (B337)."""
    from tests.unit.test_stats_table import snapshot

    dc = {"hits": 1, "misses": 1, "corrupt": 0, "other_format": 0, "read_errors": 0, "write_errors": 0,
          "lock_timeouts": 0, "evictions": 0, "writes": 1, "writes_skipped": 0, "hit_ratio": 0.5, "bytes_used": 1,
          "max_bytes": 2, "room_bytes": 2, "chunks": 1}
    tier = {name: 0 for name in ("hits", "misses", "bytes", "claims", "claim_waits", "fallbacks", "writes",
                                 "write_errors", "chunk_write_errors", "writes_skipped", "trailed", "trail_dropped",
                                 "waiters_seen", "corrupt", "other_format", "errors", "egress_saved_bytes",
                                 "hit_ratio")}
    writes = {name: 0 for name in ("files_stored", "files_failed", "bytes_uploaded", "parts_uploaded", "renames",
                                   "deletes", "deletes_refused", "chunks_cached")}
    snap = snapshot(disk_cache=dc, shared_cache=tier, writes=writes, failed_requests={"read": 1})
    snap["origin"].update(retries=0, refetched_bytes=0)
    exported = exported_names(snap)
    documented = readme_metric_names(set(exported))
    assert sorted(set(exported) - documented) == [], "exported, not in README's table"
    assert sorted(documented - set(exported)) == [], "in README's table, not exported"
    assert exported["modelfs_origin_errors_total"].startswith("Chunk fetches that failed after their retries")
    assert "dropped by the kernel" in exported["modelfs_origin_refetched_bytes_total"]


# Numbers of the stats snapshot a scrape leaves out, and why: what Prometheus says itself or another metric gives.
NOT_EXPORTED = {
    ("format",): "the JSON's version",
    ("pid",): "the daemon, for `modelfs unmount --stale`",
    ("uptime_seconds",): "Prometheus has the target's up and its own scrape times",
    ("cache_chunk_hits",): "the sum of modelfs_disk_cache_hits and modelfs_shared_cache_hits",
}
# Numbers of the snapshot whose metric is not named by their path, and those one metric gives with labels.
EXPORTED_AS = {
    ("served_bytes",): "modelfs_served_bytes",
    ("failed_requests",): "modelfs_failed_requests",
    ("disk_cache", "bytes_used"): "modelfs_disk_cache_used_bytes",
    ("disk_cache", "max_bytes"): "modelfs_disk_cache_size_bytes",
    ("origin", "get_seconds"): "modelfs_origin_get_seconds",
}


def numbers(tree: dict, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every number in a snapshot, a section of EXPORTED_AS taken as one."""
    for key, value in tree.items():
        if (*path, key) in EXPORTED_AS:
            yield (*path, key)
        elif isinstance(value, dict):
            yield from numbers(value, (*path, key))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield (*path, key)


def test_every_number_of_the_stats_snapshot_is_exported(tmp_path: Path) -> None:
    """A real mount's snapshot, every section present (NVMe cache, shared tier, writes): each of its numbers is a
    metric. The tier's writes_skipped, chunk_write_errors and other_format, and the inodes the kernel holds, were in
    `modelfs stats --json` only: a fleet whose tier refused writes showed nothing on its dashboards."""
    import types

    from fsmount.data import ChunkEngine, DiskCache, SharedTier
    from fsmount.stats import MountStats
    from fsmount.writes import WriteStats
    from tests.unit.fake_store import FakeStore
    from tests.unit.test_shared_tier import DictClient

    with DiskCache(tmp_path / "cache", 1 << 30, min_free_bytes=0) as disk:
        tier = SharedTier(DictClient(), origin="http://origin", prefix="modelfs/", wait=1.0, read_only=False,
                          threads=2)
        engine = ChunkEngine(FakeStore(), chunk_size=1 << 20, memory_limit=64 << 20, max_connections=2,
                             read_timeout=5.0, levels=[disk, tier])
        stats = MountStats("models", engine, types.SimpleNamespace(streamed_bytes=0),
                           types.SimpleNamespace(pushed=0, stored_total=0), disk_cache=disk, shared_tier=tier,
                           writes=types.SimpleNamespace(stats=WriteStats()), failed=lambda: {"read": 1})
        snap = stats.snapshot()
    exported = exported_names(snap)
    base = {name.removesuffix("_total") for name in exported}
    missing = [path for path in numbers(snap) if path not in NOT_EXPORTED
               and EXPORTED_AS.get(path, "modelfs_" + "_".join(path)) not in base]
    assert missing == [], "numbers of the snapshot no metric gives"
    assert snap["shared_cache"] is not None and snap["disk_cache"] is not None and snap["writes"] is not None
