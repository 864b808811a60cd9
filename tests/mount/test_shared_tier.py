"""The fleet-shared chunk tier (--shared-cache-bucket) through real FUSE mounts on a real SeaweedFS: the
origin and the tier are two buckets on one server; several daemons ("nodes") share the tier.

What is covered: a simultaneous cold start of 4 nodes costs the origin about one copy; a warmed tier
serves fresh nodes with no origin byte and its hits land in their NVMe cache; corrupt, foreign, garbage
and truncated chunk objects are never served; a tier that is down or a black hole costs time, not bytes
or errors; a tier that refuses PUTs; stale and live claims (also those of a daemon killed with -9, and
those of a daemon whose origin fetch failed); two
versions of one key and two chunk sizes never share a chunk object; --shared-cache-read-only; a tier
without conditional writes; a missing tier bucket or refused tier credentials fail the mount.

Faults sit between the daemons and the tier only (a FaultProxy in front of SeaweedFS given as
--shared-cache-endpoint-url): the origin stays direct, so the daemon's `origin.bytes` counts what the
origin sent and the proxy counts what the tier was asked. Every node's bytes are checked whole (sha256).

Chunk and claim keys are computed here with `SharedTier.chunk_key` / `claim_key` (sha256 over the
daemon's --endpoint-url string and the chunk id), so a test can tell which object belongs to which chunk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fsmount.data.identity import ChunkId
from fsmount.data.shared_tier import CLAIM_TTL_S, SharedTier
from fsmount.mount import SHARED_TIER_RETRIES
from fsmount.testing.fault_proxy import Down, Fault, FaultProxy
from tests.helpers import (
    MiB,
    Mount,
    S3Server,
    daemon_env,
    delete_bucket,
    file_digest,
    mount_stats,
    mounted,
    new_bucket,
    opened_random,
    put_objects,
    random_bytes,
    read_all_exact,
    run_modelfs,
    sha,
    via,
    wait_for,
    warning_lines,
)

pytestmark = pytest.mark.seaweedfs

CHUNK = 8 * MiB  # the daemon's default --chunk-size
KEY = "w.bin"
PREFIX = "modelfs/"  # the default --shared-cache-prefix
# The tier's warnings (daemon log lines).
CORRUPT_OBJECT = r"shared cache .*: ignoring chunk object"
UNAVAILABLE = r"shared cache .* unavailable"
NOT_ANSWERING = r"shared cache .* does not answer"
NO_CONDITIONAL_WRITES = r"shared cache .* does not support conditional writes"
WRITE_FAILED = r"shared cache .*: (writing a chunk|claiming a chunk \(a small write\)) failed"
BREAKING_CLAIM = r"shared cache .*: breaking a claim"
# Scheduling slack for timing bounds on the loaded 2-core box (FUSE round trips, 4 daemons, the proxy).
MARGIN_S = 5.0


# -- the fleet: an origin bucket holding one object, a tier bucket, and nodes mounting both --------

def n_chunks(size: int, chunk_size: int = CHUNK) -> int:
    return -(-size // chunk_size)


@dataclasses.dataclass
class Fleet:
    server: S3Server
    tmp: Path
    origin: str  # the origin bucket
    tier: str  # the tier bucket
    body: bytes = dataclasses.field(default=b"", repr=False)

    # -- the origin object --

    def put_body(self, body: bytes) -> None:
        """(Re)write the origin object with one PutObject (a new ETag if the bytes changed)."""
        put_objects(self.server, self.origin, {KEY: body})
        self.body = body

    @property
    def chunks(self) -> int:
        return n_chunks(len(self.body))

    def chunk_ids(self, chunk_size: int = CHUNK) -> list[ChunkId]:
        """The chunk ids of the object as it is now (the ETag as HEAD returns it, quotes included)."""
        etag = self.server.client().head_object(Bucket=self.origin, Key=KEY)["ETag"]
        return [ChunkId(self.origin, KEY, etag, chunk_size, i) for i in range(n_chunks(len(self.body), chunk_size))]

    # -- the tier's objects --

    def namer(self, origin_endpoint: str | None = None) -> SharedTier:
        """A SharedTier used only to name objects (no request is ever made through it)."""
        return SharedTier(None, origin=origin_endpoint or self.server.endpoint_url,  # type: ignore[arg-type]
                          prefix=PREFIX, wait=0, read_only=True, threads=1)

    def chunk_keys(self, chunk_size: int = CHUNK, origin_endpoint: str | None = None) -> list[str]:
        namer = self.namer(origin_endpoint)
        return [namer.chunk_key(c) for c in self.chunk_ids(chunk_size)]

    def claim_keys(self, chunk_size: int = CHUNK, origin_endpoint: str | None = None) -> list[str]:
        namer = self.namer(origin_endpoint)
        return [namer.claim_key(c) for c in self.chunk_ids(chunk_size)]

    def tier_keys(self) -> set[str]:
        """Every key in the tier bucket."""
        client, keys = self.server.client(), set()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.tier):
            keys.update(o["Key"] for o in page.get("Contents", []))
        return keys

    def tier_chunk_objects(self) -> set[str]:
        return {k for k in self.tier_keys() if k.startswith(PREFIX + "chunks/")}

    def tier_claim_objects(self) -> set[str]:
        return {k for k in self.tier_keys() if k.startswith(PREFIX + "claims/")}

    def get_tier_object(self, key: str) -> bytes:
        return self.server.client().get_object(Bucket=self.tier, Key=key)["Body"].read()

    def put_tier_object(self, key: str, body: bytes) -> None:
        self.server.client().put_object(Bucket=self.tier, Key=key, Body=body)

    # -- nodes --

    def tier_args(self, *more: str, endpoint: str | None = None) -> tuple[str, ...]:
        return ("--no-model-streaming", "--shared-cache-bucket", self.tier,
                "--shared-cache-endpoint-url", endpoint or self.server.endpoint_url, *more)

    def cache_dir(self, name: str) -> Path:
        return self.tmp / f"cache-{name}"

    @contextlib.contextmanager
    def node(self, name: str, *more: str, cache: bool = False, tier_endpoint: str | None = None,
             origin: S3Server | None = None, allowed: Sequence[str] = (), check_log: bool = True
             ) -> Iterator[Mount]:
        """One daemon mounting the origin bucket with the tier (through `tier_endpoint` if given), with
        its own --cache-dir if `cache`; its log may hold only the `allowed` warnings."""
        args = self.tier_args(*more, endpoint=tier_endpoint)
        if cache:
            args += ("--cache-dir", str(self.cache_dir(name)))
        with mounted(origin or self.server, self.origin, self.tmp / f"mnt-{name}", *args, allowed=tuple(allowed),
                     check_log=check_log) as m:
            yield m

    def warm(self, name: str = "warm", *more: str) -> None:
        """One node reads the object whole and unmounts (which drains its write-through): afterwards the
        tier holds every chunk of it."""
        with self.node(name, *more) as m:
            assert_exact(m, self.body)
            assert mount_stats(m.path)["origin"]["bytes"] == len(self.body)
        assert set(self.chunk_keys()) <= self.tier_chunk_objects()


@pytest.fixture
def fleet(seaweed_server: S3Server, tmp_path: Path) -> Iterator[Fleet]:
    """Two fresh buckets on SeaweedFS: the origin (empty until `put_body`) and the tier; deleted after."""
    fleet = Fleet(seaweed_server, tmp_path, new_bucket(seaweed_server, "origin"), new_bucket(seaweed_server, "tier"))
    yield fleet
    for bucket in (fleet.origin, fleet.tier):
        delete_bucket(seaweed_server, bucket)


def fleet_with(fleet: Fleet, size: int, seed: int) -> Fleet:
    fleet.put_body(random_bytes(size, seed))
    return fleet


# -- reading and counters -------------------------------------------------------------------------

def assert_exact(m: Mount, body: bytes, drop_page_cache: bool = False) -> None:
    assert file_digest(m.path / KEY, drop_page_cache=drop_page_cache) == sha(body), f"wrong bytes on {m.path}"


def read_all_at_once(mounts: Sequence[Mount], body: bytes) -> float:
    """Every mount reads the whole file, all starting at the same moment (one thread each); each must be
    exact. Seconds until the last one finished."""
    start = threading.Barrier(len(mounts))

    def read(m: Mount) -> str:
        start.wait()
        return file_digest(m.path / KEY)

    t = time.monotonic()
    with ThreadPoolExecutor(len(mounts)) as pool:
        digests = list(pool.map(read, mounts))
    elapsed = time.monotonic() - t
    assert digests == [sha(body)] * len(mounts), "a node read wrong bytes"
    return elapsed


def touch_chunks_at_once(path: Path, body: bytes, chunk_size: int = CHUNK) -> float:
    """One thread per chunk, each reading the first 4 KiB of its chunk at the same moment through an fd with
    kernel read-ahead off: every chunk is asked of the daemon at once, by one small READ each (whole-chunk
    reads would queue behind one another in the kernel's FUSE background slots while the daemon waits).
    Each block must be exact. Seconds it took."""
    offsets = range(0, len(body), chunk_size)
    start = threading.Barrier(len(offsets))

    def read(offset: int) -> bytes:
        with opened_random(path) as fd:
            start.wait()
            return os.pread(fd, 4096, offset)

    t = time.monotonic()
    with ThreadPoolExecutor(len(offsets)) as pool:
        blocks = list(pool.map(read, offsets))
    elapsed = time.monotonic() - t
    assert blocks == [body[off:off + 4096] for off in offsets], "wrong bytes"
    return elapsed


def touch_until_killed(path: Path, body: bytes) -> None:
    """touch_chunks_at_once on a mount whose daemon is about to be killed: its failure is expected."""
    with contextlib.suppress(OSError, AssertionError, threading.BrokenBarrierError):
        touch_chunks_at_once(path, body)


def timed_read(m: Mount, body: bytes) -> float:
    t = time.monotonic()
    assert_exact(m, body)
    return time.monotonic() - t


def tier_stats(m: Mount) -> dict:
    return mount_stats(m.path)["shared_cache"]


def origin_bytes(m: Mount) -> int:
    return mount_stats(m.path)["origin"]["bytes"]


def wait_writes_done(m: Mount) -> None:
    """Write-through (NVMe and tier) runs after the read returned: wait until none is pending."""
    wait_for("cache writes pending", lambda: mount_stats(m.path)["cache_writes_pending"], lambda n: n == 0)


def warnings_matching(m: Mount, pattern: str) -> list[str]:
    return [line for line in warning_lines(m.log()) if re.search(pattern, line)]


# -- 1. a simultaneous cold start ------------------------------------------------------------------

def test_four_nodes_cold_at_once_cost_the_origin_about_one_copy(fleet: Fleet) -> None:
    fleet = fleet_with(fleet, 64 * MiB + 12345, seed=1)  # 9 chunks, the last one partial
    size = len(fleet.body)
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(fleet.node(f"n{i}", cache=True)) for i in range(4)]
        read_all_at_once(nodes, fleet.body)
        for m in nodes:
            wait_writes_done(m)
        stats = [mount_stats(m.path) for m in nodes]
    per_node = [s["origin"]["bytes"] for s in stats]
    tiers = [s["shared_cache"] for s in stats]
    assert all(t["claims_enabled"] for t in tiers), tiers
    # Under a loaded CI machine, 3 of 9 chunks were fetched twice (a GET that missed just before the claimer wrote,
    # or a wait that ran out: 1.375x); without the tier it would be 4x.
    assert sum(per_node) <= 1.5 * size, (per_node, tiers)
    # Each node loaded each chunk once: from the tier, or from the origin as its claimer, or from the
    # origin after a wait that ran out. (A chunk may be claimed twice: a node whose GET missed just before
    # the claimer wrote the chunk and dropped its claim then claims it anew; the origin bound covers it.)
    assert sum(t["claims"] for t in tiers) >= fleet.chunks, tiers
    assert sum(t["hits"] + t["claims"] + t["fallbacks"] for t in tiers) == 4 * fleet.chunks, tiers
    assert sum(t["corrupt"] + t["errors"] + t["write_errors"] for t in tiers) == 0, tiers
    assert fleet.tier_chunk_objects() == set(fleet.chunk_keys())
    assert fleet.tier_claim_objects() == set()  # every claimer dropped its claim once its chunk was written


def test_a_node_alone_fills_the_tier_after_its_load_from_its_nvme_copy(fleet: Fleet) -> None:
    """With nobody else around, a node's tier writes trail its origin reads (trailing.py): every chunk is
    queued, then written from the NVMe cache once the load is done; the claims go with the writes."""
    fleet = fleet_with(fleet, 40 * MiB + 777, seed=11)
    with fleet.node("alone", cache=True) as m:
        assert_exact(m, fleet.body)
        wait_writes_done(m)
        t = tier_stats(m)
    assert t["claims"] == fleet.chunks and t["writes"] == fleet.chunks, t
    assert t["trailed"] == fleet.chunks and t["trail_dropped"] == 0 and t["write_errors"] == 0, t
    assert fleet.tier_chunk_objects() == set(fleet.chunk_keys())
    assert fleet.tier_claim_objects() == set()
    with fleet.node("fresh") as m:  # what was written back from NVMe is the model, exact
        assert_exact(m, fleet.body)
        assert origin_bytes(m) == 0 and tier_stats(m)["hits"] == fleet.chunks


def test_modelfs_prefetch_returns_once_the_tier_is_warm(fleet: Fleet) -> None:
    """The deploy pattern "prefetch on one node, then start the fleet": prefetch waits for the writes that
    trail the load, so the tier holds every chunk when it returns (the node still mounted)."""
    fleet = fleet_with(fleet, 48 * MiB + 99, seed=13)
    with fleet.node("warmer", cache=True) as m:
        res = run_modelfs("prefetch", "-q", str(m.path / KEY), timeout=120)
        assert res.returncode == 0, res.stderr
        assert fleet.tier_chunk_objects() == set(fleet.chunk_keys())
        assert mount_stats(m.path)["cache_writes_pending"] == 0
        assert tier_stats(m)["trailed"] == fleet.chunks


def test_a_node_waiting_on_trailing_claims_gets_them_written_at_once(fleet: Fleet) -> None:
    """Node A loads slowly (one connection, each origin GET delayed), so its tier writes trail. Node B
    then wants chunks A has fetched and still holds claims on: B waits, leaves its waiting marker, A finds
    it in its next listing and writes at once. B is served from the tier long before A's load ends (without
    the marker B would wait until then)."""
    chunk_size = 1 * MiB
    fleet = fleet_with(fleet, 24 * MiB, seed=12)
    with FaultProxy(fleet.server.endpoint_url) as origin_proxy:
        origin_proxy.inject(Fault.LATENCY, seconds=0.3)  # data GETs only: 24 chunks, one at a time, >= 7 s
        origin = via(origin_proxy, fleet.server)
        more = ("--chunk-size", "1M", "--shared-cache-wait", "30")
        with fleet.node("a", *more, "--max-connections", "1", cache=True, origin=origin) as a, \
                fleet.node("b", *more, origin=origin) as b:
            done: dict[str, float] = {}

            def load_a() -> None:
                assert_exact(a, fleet.body)
                done["a"] = time.monotonic()

            loader = threading.Thread(target=load_a)
            loader.start()
            try:
                wait_for("chunks trailing on A", lambda: tier_stats(a)["trailed"], lambda n: n >= 4)
                with opened_random(b.path / KEY) as fd:  # B wants A's first chunks only (backwards: no read-ahead)
                    for i in (3, 2, 1, 0):
                        assert os.pread(fd, 4096, i * chunk_size) == fleet.body[i * chunk_size:i * chunk_size + 4096]
                done["b"] = time.monotonic()
            finally:
                loader.join(120)
            ta, tb, b_origin = tier_stats(a), tier_stats(b), origin_bytes(b)
            wait_writes_done(a)
    assert "a" in done, "node A's load failed"
    assert done["b"] < done["a"] - 1.0, (done, ta, tb)
    assert tb["hits"] == 4 and tb["claim_waits"] >= 1 and tb["fallbacks"] == 0 and tb["claims"] == 0, tb
    assert b_origin == 0
    assert ta["waiters_seen"] >= 1 and ta["claim_waits"] == 0, ta
    assert fleet.tier_claim_objects() == set()
    assert not [k for k in fleet.tier_keys() if k.startswith(PREFIX + "waiting/")]  # B's marker went at unmount


# -- 2. a warmed tier serves fresh nodes, and its hits reach their NVMe cache -----------------------

def test_warm_tier_serves_fresh_nodes_without_origin_and_fills_their_nvme_cache(fleet: Fleet) -> None:
    fleet = fleet_with(fleet, 40 * MiB + 4321, seed=2)
    fleet.warm()
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(fleet.node(f"fresh{i}", cache=True)) for i in range(3)]
        read_all_at_once(nodes, fleet.body)
        for m in nodes:
            wait_writes_done(m)
            s = mount_stats(m.path)
            assert s["origin"]["bytes"] == 0, s
            assert s["shared_cache"]["hits"] == fleet.chunks, s["shared_cache"]
            assert s["shared_cache"]["bytes"] == len(fleet.body)
            assert s["shared_cache"]["claims"] == 0 and s["shared_cache"]["writes"] == 0
            assert s["disk_cache"]["writes"] == fleet.chunks, s["disk_cache"]  # the tier hits, written to NVMe
        # The same mount again with the page cache dropped: exact (from memory or NVMe), still no origin byte.
        assert_exact(nodes[0], fleet.body, drop_page_cache=True)
        assert origin_bytes(nodes[0]) == 0
    # That node remounted over its own cache dir: every chunk from NVMe, not even the tier asked.
    with fleet.node("fresh0", cache=True) as m:
        assert_exact(m, fleet.body)
        s = mount_stats(m.path)
    assert s["disk_cache"]["hits"] == fleet.chunks, s["disk_cache"]
    assert s["shared_cache"]["hits"] == 0 and s["shared_cache"]["misses"] == 0, s["shared_cache"]
    assert s["origin"]["bytes"] == 0


# -- 3. corrupt and foreign chunk objects ----------------------------------------------------------

def test_corrupt_and_foreign_chunk_objects_are_never_served(fleet: Fleet) -> None:
    fleet = fleet_with(fleet, 40 * MiB, seed=3)  # 5 chunks: 4 damaged, one intact
    fleet.warm()
    keys = fleet.chunk_keys()
    good = [fleet.get_tier_object(k) for k in keys]
    flipped = bytearray(good[0])
    flipped[-1] ^= 0x01  # one bit of the data
    fleet.put_tier_object(keys[0], bytes(flipped))
    fleet.put_tier_object(keys[1], good[2])  # a valid chunk object, of another chunk
    fleet.put_tier_object(keys[2], random_bytes(len(good[2]), seed=99))  # garbage
    fleet.put_tier_object(keys[3], good[3][:-100])  # truncated

    with fleet.node("fresh", allowed=(CORRUPT_OBJECT,)) as m:
        assert_exact(m, fleet.body)
        wait_writes_done(m)
        s = mount_stats(m.path)
    t = s["shared_cache"]
    assert t["corrupt"] == 4, t
    assert s["origin"]["bytes"] == 4 * CHUNK, s["origin"]
    assert t["hits"] == 1 and t["bytes"] == CHUNK, t
    assert len(warnings_matching(m, CORRUPT_OBJECT)) == 1, warning_lines(m.log())
    # The node wrote the chunks it fetched from the origin back over the damaged objects: another node
    # now gets every chunk from the tier.
    with fleet.node("after", "--shared-cache-read-only") as m:
        assert_exact(m, fleet.body)
        s = mount_stats(m.path)
    assert s["shared_cache"]["hits"] == fleet.chunks and s["shared_cache"]["corrupt"] == 0, s["shared_cache"]
    assert s["origin"]["bytes"] == 0


# -- 4. a tier that is down or a black hole --------------------------------------------------------

DEAD_TIER_CONNECTIONS = 4  # --max-connections: also the tier lookups in flight at once
# Requests one tier call may make: botocore's `max_attempts` counts retries (as in test_faults.py).
TIER_TRIES = SHARED_TIER_RETRIES + 1


@pytest.mark.parametrize("mode", [Down.REFUSE, Down.BLACKHOLE])
@pytest.mark.parametrize("when", ["at_mount", "after_mount"])
def test_a_dead_tier_costs_time_not_bytes(fleet: Fleet, mode: Down, when: str) -> None:
    """Refused connections, or a black hole that accepts and never answers (--shared-cache-timeout 1): the
    read is exact and quick, and only the lookups already in flight when the tier failed paid for it
    (the tier is then skipped), not each of the 32 chunks."""
    fleet = fleet_with(fleet, 32 * MiB, seed=4)
    chunks = n_chunks(len(fleet.body), MiB)
    allowed = (UNAVAILABLE, NOT_ANSWERING, NO_CONDITIONAL_WRITES)
    with FaultProxy(fleet.server.endpoint_url) as proxy:
        if when == "at_mount":
            proxy.origin_down(mode)
        with fleet.node("n", "--shared-cache-timeout", "1", "--chunk-size", "1M", "--max-connections",
                        str(DEAD_TIER_CONNECTIONS), tier_endpoint=proxy.endpoint_url, allowed=allowed) as m:
            # A tier that does not answer the probe has not refused conditional writes: claims stay on.
            assert tier_stats(m)["claims_enabled"]
            if when == "after_mount":
                proxy.origin_down(mode)
            proxy.reset_counts()
            elapsed = timed_read(m, fleet.body)
            tier_requests = proxy.counts().get("requests", 0)
            s = mount_stats(m.path)
            # Unmounting with the tier still dead must not hang either (the `mounted` helper bounds it).
    assert elapsed < 30, elapsed
    assert s["origin"]["bytes"] == len(fleet.body), s["origin"]
    t = s["shared_cache"]
    assert t["hits"] == 0 and t["writes"] == 0, t
    assert 1 <= t["errors"] <= DEAD_TIER_CONNECTIONS < chunks, t
    # A black hole sees each try of those lookups; refused connections never reach the proxy.
    assert tier_requests <= TIER_TRIES * DEAD_TIER_CONNECTIONS, tier_requests
    assert len(warnings_matching(m, UNAVAILABLE)) == 1, warning_lines(m.log())
    if when == "at_mount":
        assert len(warnings_matching(m, NOT_ANSWERING)) == 1, warning_lines(m.log())
    assert not warnings_matching(m, NO_CONDITIONAL_WRITES), warning_lines(m.log())


def test_a_dead_tier_does_not_fail_reads_with_a_short_read_timeout(fleet: Fleet) -> None:
    """B253: with --read-timeout 4 and the tier's defaults (5 s a request), a tier that became a black hole after
    the mount failed the reads in flight with EIO: their tier lookup waited out the tier's timeout, past the READ's,
    while the origin answered. A tier lookup, all its requests, now gets a quarter of --read-timeout at most (B256:
    a request an eighth)."""
    fleet = fleet_with(fleet, 8 * MiB, seed=41)
    allowed = (UNAVAILABLE,)
    with FaultProxy(fleet.server.endpoint_url) as proxy:
        with fleet.node("n", "--read-timeout", "4", "--chunk-size", "1M", "--max-connections",
                        str(DEAD_TIER_CONNECTIONS), tier_endpoint=proxy.endpoint_url, allowed=allowed) as m:
            proxy.origin_down(Down.BLACKHOLE)
            elapsed = timed_read(m, fleet.body)
            s = mount_stats(m.path)
            assert "requests time out after 0.5s and claims are waited for 0.5s at most" in m.log(), m.log()
    assert elapsed < 4 + MARGIN_S, elapsed
    assert s["origin"]["bytes"] == len(fleet.body) and not s["failed_requests"], s
    assert s["shared_cache"]["hits"] == 0 and s["shared_cache"]["errors"] >= 1, s["shared_cache"]

    # Live claims of another node on every chunk: each is waited for what is left of a quarter of --read-timeout, not
    # the --shared-cache-wait of 10 s given (the READ's EIO at 4 s, before B253).
    put_claims(fleet, time.time(), fleet.claim_keys(MiB))
    with fleet.node("w", "--read-timeout", "4", "--shared-cache-wait", "10", "--chunk-size", "1M") as m:
        timed_read(m, fleet.body)
        s = mount_stats(m.path)
    assert s["origin"]["bytes"] == len(fleet.body) and not s["failed_requests"], s
    assert s["shared_cache"]["claim_waits"] == s["shared_cache"]["fallbacks"] >= 1, s["shared_cache"]


@pytest.mark.parametrize(("fault", "piece"), [(Fault.DRIBBLE, 16), (Fault.DRIBBLE_HEAD, 2)])
def test_a_tier_sending_its_chunk_objects_slowly_does_not_hold_reads_past_its_share(fleet: Fleet, fault: Fault,
                                                                                    piece: int) -> None:
    """B315: a tier that sends a chunk object's body a few bytes at a time, each packet well within its request timeout,
    held the lookup as long as the body took: with --read-timeout 4 the READ failed with EIO while the origin
    answered. A tier request now ends, body included, within its timeout (an eighth of --read-timeout here), so the
    READ falls back to the origin within the tier's quarter, and reads exact bytes. B374: so does one whose head (status
    line and headers) comes so (`DRIBBLE_HEAD`)."""
    fleet = fleet_with(fleet, 4 * MiB, seed=43)
    with fleet.node("warm", "--chunk-size", "1M") as m:
        assert_exact(m, fleet.body)
    assert set(fleet.chunk_keys(MiB)) <= fleet.tier_chunk_objects()
    with FaultProxy(fleet.server.endpoint_url) as proxy:
        with fleet.node("n", "--read-timeout", "4", "--chunk-size", "1M", tier_endpoint=proxy.endpoint_url,
                        allowed=(UNAVAILABLE,)) as m:
            # The tier's object GETs: `piece` bytes every 0.1 s (a head of 300 bytes in 15 s at 2).
            dribble = proxy.inject(fault, seconds=0.1, after_bytes=piece, kind="gets")
            with opened_random(m.path / KEY) as fd:
                started = time.monotonic()
                assert os.pread(fd, MiB, 0) == fleet.body[:MiB]
                first = time.monotonic() - started
                read_all_exact(fd, fleet.body)
            s = mount_stats(m.path)
    assert dribble.hits >= 1
    # The lookup's quarter of --read-timeout (1 s), then the origin's GET of 1 MiB.
    assert first < 1 + MARGIN_S / 2, first
    assert s["origin"]["bytes"] == len(fleet.body) and not s["failed_requests"], s
    assert s["shared_cache"]["hits"] == 0 and s["shared_cache"]["errors"] >= 1, s["shared_cache"]


# -- 5. a tier that refuses writes -----------------------------------------------------------------



REFUSES_WRITES = r"shared cache .* refuses writes"


def test_a_tier_bucket_in_another_region_than_configured_is_written_and_read(fleet: Fleet) -> None:
    """The tier's bucket answers requests signed for another region than its own as S3 does (301 and its region; a
    proxy in front of it): botocore follows that for the mount's checks, and ranged GETs were signed for the bucket's
    region once refused, but the tier's chunk PUTs, claim DELETEs and whole-object GETs were not: such a tier was
    never written (nor read). All are signed for the bucket's region once one is refused, with one warning."""
    fleet = fleet_with(fleet, 20 * MiB + 99, seed=23)
    allowed = (r"bucket \S+ is in region eu-west-1, not us-east-1: its reads and writes are signed",)
    with FaultProxy(fleet.server.endpoint_url) as proxy:
        proxy.bucket_region("eu-west-1")  # the daemons sign for us-east-1 (their environment's region)
        with fleet.node("a", tier_endpoint=proxy.endpoint_url, allowed=allowed) as m:
            assert_exact(m, fleet.body)
        assert set(fleet.chunk_keys()) <= fleet.tier_chunk_objects()
        assert any(e.outcome == "wrong-region" for e in proxy.log()), proxy.log()
        with fleet.node("b", tier_endpoint=proxy.endpoint_url, allowed=allowed) as m:
            assert_exact(m, fleet.body)
            s = mount_stats(m.path)
    assert s["origin"]["bytes"] == 0 and s["shared_cache"]["hits"] == fleet.chunks, s
    assert fleet.tier_claim_objects() == set()


@pytest.mark.parametrize("refused", ["after_the_probe", "at_mount"])
def test_a_tier_refusing_puts_pauses_writes_and_reads_go_on(fleet: Fleet, refused: str) -> None:
    """Credentials that may read the tier and not write it: the misses come from the origin, writes pause
    with one warning, and what is in the tier is still read from it. Refused from the start, the probe at
    mount says so, and claims stay on (it was taken for a tier without conditional writes)."""
    fleet = fleet_with(fleet, 32 * MiB, seed=5)
    in_tier = random_bytes(16 * MiB, seed=15)
    put_objects(fleet.server, fleet.origin, {"in-tier.bin": in_tier})
    with fleet.node("warm") as m:  # the tier holds in-tier.bin, not w.bin
        assert file_digest(m.path / "in-tier.bin") == sha(in_tier)
    tier_before = fleet.tier_chunk_objects()
    with FaultProxy(fleet.server.endpoint_url) as proxy:
        if refused == "at_mount":
            refusal = proxy.inject(Fault.ERROR, status=403, code="AccessDenied", kind="other", data_only=False)
        # UNAVAILABLE and NO_CONDITIONAL_WRITES are let through the log check so that the assertions below say
        # what went wrong.
        allowed = (WRITE_FAILED, UNAVAILABLE, REFUSES_WRITES, NO_CONDITIONAL_WRITES)
        with fleet.node("n", tier_endpoint=proxy.endpoint_url, allowed=allowed) as m:
            assert tier_stats(m)["claims_enabled"]
            if refused == "after_the_probe":
                refusal = proxy.inject(Fault.ERROR, status=403, code="AccessDenied", kind="other",
                                       data_only=False)
            assert_exact(m, fleet.body)  # misses: their claims and chunk PUTs are refused
            wait_writes_done(m)
            assert file_digest(m.path / "in-tier.bin") == sha(in_tier)  # reads go on
            s = mount_stats(m.path)
    t = s["shared_cache"]
    assert refusal.hits >= 1
    assert warnings_matching(m, UNAVAILABLE) == [], "a refused PUT was taken for an unavailable tier"
    assert warnings_matching(m, NO_CONDITIONAL_WRITES) == [], "a refused PUT was taken for a missing feature"
    assert len(warnings_matching(m, REFUSES_WRITES)) == (refused == "at_mount"), warning_lines(m.log())
    assert s["origin"]["bytes"] == len(fleet.body), (s["origin"], t)  # in-tier.bin from the tier
    assert t["hits"] == n_chunks(len(in_tier)), t
    assert t["write_errors"] >= 1 and t["writes"] == 0, t
    assert len(warnings_matching(m, WRITE_FAILED)) == 1, warning_lines(m.log())
    assert fleet.tier_chunk_objects() == tier_before  # nothing of w.bin got in


def test_a_prefetch_that_could_not_write_the_tier_says_so(fleet: Fleet) -> None:
    """"Warm once, then start the others": `modelfs prefetch` returned 0 with nothing written to a tier that
    refused the writes (or was down), so the fleet then went to the origin. It exits 1 and says why."""
    fleet = fleet_with(fleet, 24 * MiB, seed=16)
    with FaultProxy(fleet.server.endpoint_url) as proxy:
        allowed = (WRITE_FAILED, REFUSES_WRITES, UNAVAILABLE)
        with fleet.node("n", tier_endpoint=proxy.endpoint_url, allowed=allowed) as m:
            proxy.inject(Fault.ERROR, status=403, code="AccessDenied", kind="other", data_only=False)
            res = run_modelfs("prefetch", "-q", str(m.path / KEY), timeout=120)
            t = tier_stats(m)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "were not written to a cache level (the NVMe cache or the shared tier failed or refused them" \
        in res.stderr, res.stderr
    assert t["writes"] == 0 and t["write_errors"] + t["writes_skipped"] >= fleet.chunks, t


# -- 6. claims of nodes that died, and of nodes that are slow ---------------------------------------

def put_claims(fleet: Fleet, created: float, keys: Sequence[str]) -> None:
    for key in keys:
        fleet.put_tier_object(key, f"{created:.3f} deadhost 4242".encode())


def test_stale_claims_are_broken_at_once(fleet: Fleet) -> None:
    fleet = fleet_with(fleet, 32 * MiB, seed=6)
    put_claims(fleet, time.time() - 60, fleet.claim_keys())
    time.sleep(CLAIM_TTL_S + 2)  # stale by the tier server's clock, which claims are aged by (B86), not their body
    with fleet.node("n", "--shared-cache-wait", "10") as m:
        elapsed = timed_read(m, fleet.body)
        wait_writes_done(m)
        t = tier_stats(m)
    assert elapsed < 5, elapsed  # no chunk waited out its 10 s
    assert len(re.findall(BREAKING_CLAIM, m.log())) == fleet.chunks
    assert t["claims"] == fleet.chunks and t["claim_waits"] == 0 and t["fallbacks"] == 0, t
    assert fleet.tier_chunk_objects() == set(fleet.chunk_keys())
    assert fleet.tier_claim_objects() == set()  # broken, retaken, and dropped once written


def test_live_claims_are_waited_for_up_to_the_wait_then_the_origin(fleet: Fleet) -> None:
    fleet = fleet_with(fleet, 32 * MiB, seed=7)
    put_claims(fleet, time.time(), fleet.claim_keys())
    with fleet.node("n", "--shared-cache-wait", "1") as m:
        elapsed = timed_read(m, fleet.body)
        t = tier_stats(m)
        assert origin_bytes(m) == len(fleet.body)
    assert t["claim_waits"] == fleet.chunks and t["fallbacks"] == fleet.chunks and t["claims"] == 0, t
    assert 1.0 <= elapsed < fleet.chunks * 1.0 + MARGIN_S, elapsed
    assert "breaking a claim" not in m.log()


@contextlib.contextmanager
def claiming_node(fleet: Fleet, origin_proxy: FaultProxy, *more: str) -> Iterator[Mount]:
    """Node "a" on the origin through `origin_proxy`, whose data GETs stall, with a reader touching every
    chunk: yields once A holds a claim on each, for the test to stop A. Afterwards A is killed if it still
    runs, the reader is joined (it must not hang) and the mount detached (a dead mount answers ENOTCONN)."""
    claim_keys = set(fleet.claim_keys(origin_endpoint=origin_proxy.endpoint_url))
    origin_proxy.inject(Fault.STALL, seconds=60)  # data GETs only
    with fleet.node("a", *more, origin=via(origin_proxy, fleet.server), check_log=False) as a:
        reader = threading.Thread(target=touch_until_killed, args=(a.path / KEY, fleet.body), daemon=True)
        try:
            reader.start()
            wait_for("claims of node A", fleet.tier_claim_objects, lambda keys: keys == claim_keys)
            yield a
        finally:  # with its GETs stalled A would not exit on unmount
            if a.proc.poll() is None:
                os.kill(a.proc.pid, signal.SIGKILL)
            a.proc.wait(10)
            reader.join(30)
            subprocess.run(["fusermount3", "-uz", str(a.path)], check=False, capture_output=True)
        assert not reader.is_alive(), "a reader of the stopped mount hangs"


def test_claims_of_a_node_killed_mid_fetch_cost_others_one_wait(fleet: Fleet) -> None:
    """Node A claims every chunk, its origin GETs stall (a proxy between A and the origin), and it is killed
    with -9: its claims stay, fresh. Node B (the same origin endpoint, so the same tier keys) waits
    --shared-cache-wait for them, once for all chunks at the same time, then reads from the origin."""
    fleet = fleet_with(fleet, 32 * MiB, seed=8)
    wait_s = 2.0
    with FaultProxy(fleet.server.endpoint_url) as origin_proxy:
        origin = via(origin_proxy, fleet.server)
        with claiming_node(fleet, origin_proxy) as a:
            log_before_kill = a.log()
            os.kill(a.proc.pid, signal.SIGKILL)
        assert a.proc.returncode == -signal.SIGKILL
        assert warning_lines(log_before_kill) == []
        assert fleet.tier_chunk_objects() == set()
        origin_proxy.clear()

        with fleet.node("b", "--shared-cache-wait", str(wait_s), origin=origin) as b:
            t0 = time.monotonic()
            touch_chunks_at_once(b.path / KEY, fleet.body)  # every chunk asked at once: one wait for all
            assert_exact(b, fleet.body)
            elapsed = time.monotonic() - t0
            wait_writes_done(b)
            s = mount_stats(b.path)
    t = s["shared_cache"]
    assert wait_s <= elapsed < wait_s + MARGIN_S, elapsed
    assert t["claim_waits"] == fleet.chunks and t["fallbacks"] == fleet.chunks, t
    assert s["origin"]["bytes"] == len(fleet.body)
    assert t["writes"] == fleet.chunks
    assert fleet.tier_chunk_objects() == set(fleet.chunk_keys(origin_endpoint=origin_proxy.endpoint_url))


def test_a_node_whose_origin_fetch_fails_drops_its_claims_at_once(fleet: Fleet) -> None:
    """Node A claims chunks, then the origin refuses its GETs (403 through a proxy): its reader gets EIO
    and A drops its claims, so node B, started while A is still mounted, claims and fetches every chunk
    itself without waiting for A (before, A's fresh claims made B wait --shared-cache-wait per chunk)."""
    fleet = fleet_with(fleet, 32 * MiB, seed=12)
    with FaultProxy(fleet.server.endpoint_url) as origin_proxy:
        origin = via(origin_proxy, fleet.server)
        refused = origin_proxy.inject(Fault.ERROR, status=403, code="AccessDenied")  # data GETs only
        with fleet.node("a", origin=origin, allowed=["fetching chunk .* failed", "read failed"]) as a:
            with pytest.raises(OSError):
                (a.path / KEY).read_bytes()
            claimed = tier_stats(a)["claims"]
            assert claimed >= 1 and refused.hits >= 1
            wait_for("claims of node A", fleet.tier_claim_objects, lambda keys: keys == set(), timeout=10)
            origin_proxy.clear()
            with fleet.node("b", "--shared-cache-wait", "10", origin=origin) as b:
                elapsed = timed_read(b, fleet.body)
                wait_writes_done(b)
                t = tier_stats(b)
    assert elapsed < MARGIN_S, elapsed  # no chunk waited for a claim of A's
    assert t["claims"] == fleet.chunks and t["claim_waits"] == 0 and t["fallbacks"] == 0, t
    assert fleet.tier_chunk_objects() == set(fleet.chunk_keys(origin_endpoint=origin_proxy.endpoint_url))
    assert fleet.tier_claim_objects() == set()


def test_a_node_stopped_mid_fetch_drops_its_claims(fleet: Fleet) -> None:
    """Node A claims every chunk, its origin GETs stall, and it is stopped with SIGTERM (systemd's stop): its
    readers fail at --read-timeout, it exits, and it leaves no claim behind (those of failed fetches are
    dropped at once, those of fetches the unmount cut short at unmount), so no other node waits for them.
    A node killed with -9 cannot: test_claims_of_a_node_killed_mid_fetch_cost_others_one_wait."""
    fleet = fleet_with(fleet, 32 * MiB, seed=13)
    with FaultProxy(fleet.server.endpoint_url) as origin_proxy:
        with claiming_node(fleet, origin_proxy, "--read-timeout", "5") as a:
            a.proc.send_signal(signal.SIGTERM)
            a.proc.wait(30)
        assert a.proc.returncode == 0, a.log()[-3000:]
        assert fleet.tier_claim_objects() == set()


# -- 7. versions and chunk sizes never share a chunk object ----------------------------------------

def test_new_version_and_other_chunk_size_never_hit_old_chunk_objects(fleet: Fleet) -> None:
    fleet = fleet_with(fleet, 24 * MiB, seed=9)
    fleet.warm("v1")
    v1_keys = set(fleet.chunk_keys())
    fleet.put_body(random_bytes(len(fleet.body), seed=10))  # same size, other bytes: a new ETag
    assert set(fleet.chunk_keys()).isdisjoint(v1_keys)

    with fleet.node("v2") as m:
        assert_exact(m, fleet.body)
        wait_writes_done(m)
        s = mount_stats(m.path)
    assert s["origin"]["bytes"] == len(fleet.body), s["origin"]
    assert s["shared_cache"]["hits"] == 0 and s["shared_cache"]["corrupt"] == 0, s["shared_cache"]

    with fleet.node("4m", "--chunk-size", "4M") as m:
        assert_exact(m, fleet.body)
        wait_writes_done(m)
        s = mount_stats(m.path)
    assert s["origin"]["bytes"] == len(fleet.body), s["origin"]
    assert s["shared_cache"]["hits"] == 0 and s["shared_cache"]["corrupt"] == 0, s["shared_cache"]
    assert fleet.tier_chunk_objects() == v1_keys | set(fleet.chunk_keys()) | set(fleet.chunk_keys(4 * MiB))


# -- 8. --shared-cache-read-only ------------------------------------------------------------------

def test_read_only_node_never_writes_and_uses_a_warm_tier(fleet: Fleet) -> None:
    fleet = fleet_with(fleet, 24 * MiB, seed=11)
    with fleet.node("ro-cold", "--shared-cache-read-only") as m:
        assert_exact(m, fleet.body)
        wait_writes_done(m)
        t = tier_stats(m)
        assert origin_bytes(m) == len(fleet.body)
    assert t["read_only"] and not t["claims_enabled"], t
    assert t["misses"] == fleet.chunks and t["writes"] == 0 and t["claims"] == 0, t
    assert fleet.tier_keys() == set()  # no chunk, no claim, no probe

    fleet.warm()
    with fleet.node("ro-warm", "--shared-cache-read-only") as m:
        assert_exact(m, fleet.body)
        s = mount_stats(m.path)
    assert s["origin"]["bytes"] == 0
    assert s["shared_cache"]["hits"] == fleet.chunks, s["shared_cache"]


# -- 9. a tier without conditional writes ----------------------------------------------------------

def test_a_tier_without_conditional_writes_runs_without_claims(fleet: Fleet) -> None:
    fleet = fleet_with(fleet, 24 * MiB, seed=12)
    with FaultProxy(fleet.server.endpoint_url) as proxy:
        probe = proxy.inject(Fault.ERROR, status=501, code="NotImplemented", kind="other", data_only=False, times=1)
        with fleet.node("n", tier_endpoint=proxy.endpoint_url, allowed=(NO_CONDITIONAL_WRITES,)) as m:
            assert probe.hits == 1
            assert_exact(m, fleet.body)
            wait_writes_done(m)
            t = tier_stats(m)
    assert not t["claims_enabled"], t
    assert t["claims"] == 0 and t["writes"] == fleet.chunks and t["write_errors"] == 0, t
    assert len(warnings_matching(m, NO_CONDITIONAL_WRITES)) == 1
    assert fleet.tier_chunk_objects() == set(fleet.chunk_keys())
    assert fleet.tier_claim_objects() == set()


# -- 10. bad tier settings fail the mount ----------------------------------------------------------

def mount_must_fail(fleet: Fleet, mountpoint: Path, env: dict[str, str], *args: str, code: int | None = None) -> str:
    """`modelfs mount` (backgrounding) with `args`: it must fail within a few seconds (with exit status `code` where
    given), leave nothing mounted, and say why on stderr (returned)."""
    mountpoint.mkdir()
    t = time.monotonic()
    res = run_modelfs("mount", fleet.origin, str(mountpoint), "--endpoint-url", fleet.server.endpoint_url, *args,
                      env=env, timeout=60)
    elapsed = time.monotonic() - t
    if os.path.ismount(mountpoint):  # it should not have mounted: never left behind, whatever the assertions say
        run_modelfs("unmount", str(mountpoint))
    assert res.returncode != 0 and code in (None, res.returncode), res
    assert elapsed < 10, elapsed
    assert not os.path.ismount(mountpoint)
    assert "Traceback" not in res.stderr, res.stderr
    return res.stderr


def test_missing_tier_bucket_fails_the_mount(fleet: Fleet) -> None:
    fleet = fleet_with(fleet, MiB, seed=13)
    env = daemon_env(fleet.server)
    stderr = mount_must_fail(fleet, fleet.tmp / "mnt-flag", env, "--shared-cache-bucket", "no-such-tier-bucket",
                             "--shared-cache-endpoint-url", fleet.server.endpoint_url)
    assert "--shared-cache-bucket:" in stderr and "does not exist" in stderr, stderr
    assert "(the endpoint URL has a path" not in stderr, stderr
    # B252: the tier's bucket put in its endpoint URL as well (a path-style URL) was told only that it does not exist.
    stderr = mount_must_fail(fleet, fleet.tmp / "mnt-path", env, "--shared-cache-bucket", fleet.tier,
                             "--shared-cache-endpoint-url", f"{fleet.server.endpoint_url}/{fleet.tier}")
    assert f"bucket '{fleet.tier}' does not exist (the endpoint URL has a path, /{fleet.tier}: the bucket is " \
        "--shared-cache-bucket, a path inside it --shared-cache-prefix)" in stderr, stderr
    # The fstab form of the same options.
    stderr = mount_must_fail(fleet, fleet.tmp / "mnt-o", env, "-o",
                             f"shared_cache_bucket=no-such-tier-bucket,"
                             f"shared_cache_endpoint_url={fleet.server.endpoint_url}")
    assert "--shared-cache-bucket:" in stderr and "does not exist" in stderr, stderr


def test_refused_tier_credentials_fail_the_mount(fleet: Fleet) -> None:
    fleet = fleet_with(fleet, MiB, seed=14)
    credentials = fleet.tmp / "credentials"
    credentials.write_text(f"[tier]\naws_access_key_id = {fleet.server.env['AWS_ACCESS_KEY_ID']}\n"
                           "aws_secret_access_key = wrong-tier-secret\n")
    env = {**daemon_env(fleet.server), "AWS_SHARED_CREDENTIALS_FILE": str(credentials),
           "AWS_CONFIG_FILE": str(fleet.tmp / "no-config")}
    stderr = mount_must_fail(fleet, fleet.tmp / "mnt", env, "--shared-cache-bucket", fleet.tier,
                             "--shared-cache-endpoint-url", fleet.server.endpoint_url,
                             "--shared-cache-profile", "tier")
    assert "--shared-cache-bucket:" in stderr and "access denied" in stderr, stderr
    assert "wrong-tier-secret" not in stderr


def test_a_tier_inside_the_mounted_bucket_is_refused_however_its_endpoint_is_spelled(fleet: Fleet) -> None:
    """The same server given once with a trailing slash and capitals, or once from the AWS configuration: the check
    compared the option strings, so the mount came up with the tier's chunk objects among its files, and a
    prefetch of its root wrote chunk objects of them in turn (13 became 38, a fleet tester). Refused, it exited 1,
    "starting again may", where the same refusal of the same spelling exits 2: the systemd unit started it again every
    RestartSec for good (B1061)."""
    fleet = fleet_with(fleet, MiB, seed=15)
    url = fleet.server.endpoint_url
    env = daemon_env(fleet.server)
    for n, (tier_endpoint, more_env) in enumerate([(url, {}), (url.replace("http://", "HTTP://") + "/", {}),
                                                   (None, {"AWS_ENDPOINT_URL_S3": url})]):
        args = ("--shared-cache-bucket", fleet.origin) + (
            ("--shared-cache-endpoint-url", tier_endpoint) if tier_endpoint else ())
        stderr = mount_must_fail(fleet, fleet.tmp / f"mnt-{n}", {**env, **more_env}, *args, code=2)
        assert "lies inside what the mount shows" in stderr, stderr


def test_a_mount_right_after_an_unmount_waits_for_the_old_daemon_to_finish_writing(fleet: Fleet) -> None:
    """`modelfs unmount X && modelfs mount X` (a restart script) failed "cache dir ... is in use" while the old
    daemon, unmounted, still wrote its last chunks to the shared tier: the node did not come up (a fleet tester).
    The old daemon says in the cache dir's lock file that it is draining, and the new one waits for it."""
    from fsmount.data.cache_dir import acquire_dir_lock, release_dir_lock

    fleet = fleet_with(fleet, 4 * CHUNK, seed=16)
    cache = fleet.cache_dir("restart")
    mountpoint = fleet.tmp / "mnt-restart"
    mountpoint.mkdir()
    env = daemon_env(fleet.server)
    with FaultProxy(fleet.server.endpoint_url) as slow_tier:
        slow_tier.inject(Fault.LATENCY, seconds=0.5, data_only=False)  # the tier's writes take seconds to drain
        args = ("--endpoint-url", fleet.server.endpoint_url, *fleet.tier_args(endpoint=slow_tier.endpoint_url),
                "--cache-dir", str(cache))
        try:
            assert run_modelfs("mount", fleet.origin, str(mountpoint), *args, env=env).returncode == 0
            assert file_digest(mountpoint / KEY) == sha(fleet.body)
            assert run_modelfs("unmount", str(mountpoint)).returncode == 0
            res = run_modelfs("mount", fleet.origin, str(mountpoint), *args, env=env, timeout=180)
            assert res.returncode == 0, res.stderr
            assert file_digest(mountpoint / KEY) == sha(fleet.body)
        finally:
            if os.path.ismount(mountpoint):
                run_modelfs("unmount", str(mountpoint))
            release_dir_lock(acquire_dir_lock(str(cache)))  # the last daemon is done (it too drains first)
