"""The shared tier's rules in-process, against a dict-backed client: keys, checks on read, claims (taken,
waited on, broken when stale), and how it backs off when the tier fails. The real thing, with 4 daemons
on SeaweedFS, is tests/mount/test_shared_tier.py."""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator

import pytest
import trio

from fsmount.config import StoreConfig
from fsmount.data import (
    AccessDenied,
    ChunkId,
    StoreError,
    TimedOut,
    TransientError,
    Unreachable,
    shared_tier,
)
from fsmount.data.chunk_file import encode_chunk
from fsmount.data.shared_tier import (
    CLAIM_CHECK_S,
    CLAIM_TTL_S,
    FLEET_QUIET_S,
    UNAVAILABLE_RETRY_S,
    WAITING,
    WAITING_FRESH_S,
    WRITE_RETRY_S,
    SharedTier,
)
from fsmount.data.store import ListingPage, ObjectMeta

ORIGIN = "http://origin.example:9000"
CHUNK = 1 << 20
# The tier server's clock: the real one, whatever a test does to this node's (time.time patched).
SERVER_CLOCK_NS = time.time_ns


class DictClient:
    """A tier bucket in a dict; `fail` makes every request raise it, `refuse_puts` only PUTs. A GET gives the
    object's age on the server's clock, as S3's Date and Last-Modified do, where `mtime_ns` has its PUT time."""

    bucket = "tier"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.mtime_ns: dict[str, int] = {}
        self.fail: StoreError | None = None
        self.refuse_puts: StoreError | None = None
        self.requests = 0
        self._lock = threading.Lock()

    def _request(self) -> None:
        self.requests += 1
        if self.fail is not None:
            raise self.fail

    def get_object(self, key: str) -> bytes | None:
        self._request()
        return self.objects.get(key)

    def open_object(self, key: str) -> BytesStream | None:
        blob = self.get_object(key)
        if blob is None:
            return None
        put_at = self.mtime_ns.get(key)
        return BytesStream(blob, None if put_at is None else (SERVER_CLOCK_NS() - put_at) / 1e9)

    def put_object(self, key: str, body: bytes | list, *, only_if_absent: bool = False) -> bool:
        self._request()
        body = body if isinstance(body, bytes) else b"".join(body)
        if self.refuse_puts is not None:
            raise self.refuse_puts
        with self._lock:
            if only_if_absent and key in self.objects:
                return False
            self.objects[key] = bytes(body)
            self.mtime_ns[key] = SERVER_CLOCK_NS()
            return True

    def delete_object(self, key: str) -> None:
        self._request()
        self.objects.pop(key, None)

    def list_pages(self, prefix: str) -> Iterator[ListingPage]:
        self._request()
        yield ListingPage([ObjectMeta(k, len(v), '"x"', self.mtime_ns[k]) for k, v in sorted(self.objects.items())
                           if k.startswith(prefix) and "/" not in k[len(prefix):]], [], [])


class BytesStream(io.BytesIO):
    """An object body as the tier reads it: `size`, read, readinto, a context manager."""

    def __init__(self, blob: bytes, server_age_s: float | None = None):
        super().__init__(blob)
        self.size = len(blob)
        self.server_age_s = server_age_s


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chunk(index: int = 0, etag: str = '"e1"', size: int = CHUNK) -> ChunkId:
    return ChunkId("models", "llm/model.safetensors", etag, size, index)


def data_of(cid: ChunkId) -> bytes:
    return bytes([cid.index % 251]) * 1000 + cid.etag.encode() * 10


def tier(client: DictClient, *, wait: float = 0.2, read_only: bool = False, clock: Clock | None = None,
         origin: str = ORIGIN) -> SharedTier:
    """A tier over `client`; real time unless a test steps a `Clock` (waits poll in real time)."""
    return SharedTier(client, origin=origin, prefix="modelfs/", wait=wait, read_only=read_only, threads=4,
                      clock=clock or time.monotonic)


def test_keys_separate_origins_versions_and_chunk_sizes() -> None:
    t = tier(DictClient())
    keys = {t.chunk_key(chunk()), t.chunk_key(chunk(etag='"e2"')), t.chunk_key(chunk(size=2 * CHUNK)),
            t.chunk_key(chunk(index=1)), tier(DictClient(), origin="http://other:9000").chunk_key(chunk())}
    assert len(keys) == 5
    assert all(k.startswith("modelfs/chunks/") and len(k) == len("modelfs/chunks/") + 64 for k in keys)
    assert t.claim_key(chunk()).startswith("modelfs/claims/")


def test_a_put_chunk_reads_back_and_into_the_buffer() -> None:
    client = DictClient()
    t = tier(client)
    cid = chunk()
    t.put(cid, data_of(cid))
    assert t.get(cid) == data_of(cid)
    buffer = bytearray(len(data_of(cid)))
    assert t.get(cid, buffer) is buffer and bytes(buffer) == data_of(cid)  # type: ignore[arg-type]
    assert t.stats.writes == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "garbage", "other-version"])
def test_a_damaged_or_foreign_object_is_a_miss_never_wrong_bytes(damage: str, allowed_logs: list[str]) -> None:
    allowed_logs.append("ignoring chunk object")
    client = DictClient()
    t = tier(client, read_only=True)  # read-only: a miss returns at once, no claim
    cid = chunk()
    key = t.chunk_key(cid)
    good = b"".join(encode_chunk(cid, data_of(cid)))
    client.objects[key] = {
        "flip": good[:-1] + bytes([good[-1] ^ 1]),
        "truncate": good[:-10],
        "foreign": b"".join(encode_chunk(chunk(index=7), data_of(chunk(index=7)))),
        "garbage": b"not a chunk file at all",
        "other-version": b"".join(encode_chunk(chunk(etag='"e2"'), data_of(cid))),
    }[damage]
    assert t.get(cid) is None
    assert t.stats.corrupt == 1


def test_an_object_of_another_format_version_is_a_miss_counted_apart(caplog: pytest.LogCaptureFixture) -> None:
    """A chunk object a node of another version wrote is not damaged: a miss, not a corrupt-object warning."""
    import struct

    from fsmount.data.chunk_file import FORMAT_VERSION, PREFIX

    client = DictClient()
    t = tier(client, read_only=True)
    cid = chunk()
    good = bytearray(b"".join(encode_chunk(cid, data_of(cid))))
    fields = list(PREFIX.unpack_from(good))
    fields[1] = FORMAT_VERSION - 1
    struct.pack_into(PREFIX.format, good, 0, *fields)
    client.objects[t.chunk_key(cid)] = bytes(good)
    with caplog.at_level(logging.INFO):
        assert t.get(cid) is None
    assert (t.stats.corrupt, t.stats.other_format) == (0, 1)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("when", ["before-the-claim", "while-waiting"])
def test_a_bad_object_under_another_nodes_claim_is_read_once_not_polled(when: str, allowed_logs: list[str]) -> None:
    """A waiter read the whole bad object again every POLL_S until the claimer rewrote it (225 GETs of 8 MiB for
    3 chunks). It reads it once and goes to the origin."""
    allowed_logs.append("ignoring chunk object")
    client = DictClient()
    claimer, waiter = tier(client, wait=5.0), tier(client, wait=5.0)
    cid = chunk()
    bad = b"not a chunk file at all"
    if when == "before-the-claim":
        client.objects[waiter.chunk_key(cid)] = bad
    assert claimer.get(cid) is None and claimer.stats.claims == 1  # its claim stands, it never writes
    if when == "while-waiting":
        threading.Timer(0.2, lambda: client.objects.__setitem__(waiter.chunk_key(cid), bad)).start()
    started = time.monotonic()
    assert waiter.get(cid) is None
    assert time.monotonic() - started < 2.0  # not the whole wait
    assert waiter.stats.corrupt == 1 and waiter.stats.fallbacks == 1


def test_the_first_node_claims_the_others_wait_for_its_chunk() -> None:
    client = DictClient()
    first, second = tier(client, wait=5.0), tier(client, wait=5.0)
    cid = chunk()
    assert first.get(cid) is None and first.stats.claims == 1  # claimed: fetch it from the origin
    assert client.objects.get(first.claim_key(cid)) is not None

    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(second.get(cid)))
    waiter.start()
    time.sleep(0.2)
    assert not got  # still waiting for the claimer
    first.put(cid, data_of(cid))  # the claimer's write-through lands
    waiter.join(5)
    assert got == [data_of(cid)]
    assert second.stats.claim_waits == 1 and second.stats.fallbacks == 0 and second.stats.claims == 0
    assert first.claim_key(cid) not in client.objects  # the claim went with the write


def test_a_wait_ends_in_a_fallback_when_the_claimer_never_writes() -> None:
    client = DictClient()
    first, second = tier(client), tier(client, wait=0.3)
    cid = chunk()
    assert first.get(cid) is None
    started = time.monotonic()
    assert second.get(cid) is None
    assert 0.3 <= time.monotonic() - started < 2.0
    assert second.stats.fallbacks == 1


def test_a_claimer_whose_fetch_failed_drops_its_claim_and_the_next_node_claims_at_once() -> None:
    client = DictClient()
    first, second = tier(client, wait=30.0), tier(client, wait=30.0)
    cid, other = chunk(), chunk(index=1)
    assert first.get(cid) is None and first.stats.claims == 1
    first.abandon(cid)  # its origin fetch failed: nothing will be put
    assert first.claim_key(cid) not in client.objects
    requests = client.requests
    first.abandon(other)  # never claimed: no request
    first.abandon(cid)  # already dropped: no request
    assert client.requests == requests
    started = time.monotonic()
    assert second.get(cid) is None  # no claim to wait for: ours to fetch
    assert time.monotonic() - started < 1.0
    assert second.stats.claims == 1 and second.stats.claim_waits == 0


@pytest.mark.parametrize("end", ["dropped", "stale"])
def test_a_waiter_takes_over_a_claim_that_is_dropped_or_goes_stale_while_it_waits(end: str,
                                                                                  allowed_logs: list[str]) -> None:
    """A node waiting for another node's chunk also watches the claim: once the claimer drops it (its fetch
    failed, it was stopped) or it goes stale (the node died), the waiter claims the chunk and fetches it
    within a claim check, instead of waiting out --shared-cache-wait (it waited all of it)."""
    client = DictClient()
    claimer, waiter = tier(client, wait=60.0), tier(client, wait=60.0)
    cid = chunk()
    if end == "dropped":
        assert claimer.get(cid) is None and claimer.stats.claims == 1
        threading.Timer(1.0, claimer.abandon, (cid,)).start()
    else:  # a dead node's claim, 1 s short of stale
        key = waiter.claim_key(cid)
        client.objects[key] = f"{time.time() - CLAIM_TTL_S + 1:.3f} deadhost 1".encode()
        client.mtime_ns[key] = SERVER_CLOCK_NS() - int((CLAIM_TTL_S - 1) * 1e9)
    started = time.monotonic()
    assert waiter.get(cid) is None  # ours to fetch now
    assert 1.0 <= time.monotonic() - started < 1.0 + 2 * CLAIM_CHECK_S + 1.0
    assert waiter.stats.claim_waits == 1 and waiter.stats.claims == 1 and waiter.stats.fallbacks == 0
    assert waiter.claim_key(cid) in client.objects  # the waiter's own claim now: the others wait for it


def test_a_waiter_that_wins_a_claim_just_after_the_chunk_landed_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The claimer writes the chunk and drops its claim between two looks of a waiter: the waiter's claim
    check then succeeds, but the chunk is there, so it reads it and lets its claim go (no origin fetch)."""
    client = DictClient()
    claimer, waiter = tier(client, wait=60.0), tier(client, wait=60.0)
    cid = chunk()
    assert claimer.get(cid) is None
    reads = 0
    real_read = waiter._read

    def read(c: ChunkId, buffer: object) -> object:
        nonlocal reads
        reads += 1
        if reads == 2:  # the first look of the wait finds nothing; then the chunk lands, the claim goes
            claimer.put(cid, data_of(cid))
            return None
        return real_read(c, buffer) if reads > 2 else None

    waiter._read = read  # type: ignore[method-assign]
    monkeypatch.setattr(shared_tier, "CLAIM_CHECK_S", 0.0)  # a claim check after every look
    assert waiter.get(cid) == data_of(cid)
    assert waiter.claim_key(cid) not in client.objects and waiter.stats.fallbacks == 0
    assert waiter.stats.claims == 0  # a hit, not a claim: each chunk load counts as one of the two


@pytest.mark.parametrize("server_dates", [True, False])
def test_a_stale_claim_of_a_dead_node_is_broken_and_taken_over(server_dates: bool, allowed_logs: list[str]) -> None:
    """Aged by the server's Date and Last-Modified, or where it gives none by the time in the claim's body."""
    client = DictClient()
    t = tier(client, wait=30.0)
    cid = chunk()
    client.objects[t.claim_key(cid)] = f"{time.time() - CLAIM_TTL_S - 5:.3f} deadhost 1".encode()
    if server_dates:
        client.mtime_ns[t.claim_key(cid)] = SERVER_CLOCK_NS() - int((CLAIM_TTL_S + 5) * 1e9)
    started = time.monotonic()
    assert t.get(cid) is None  # a miss at once: ours to fetch, no waiting
    assert time.monotonic() - started < 1.0
    assert t.stats.claims == 1 and t.stats.claim_waits == 0


@pytest.mark.parametrize("skew", ["waiter ahead", "dead claimer ahead"])
def test_claim_ages_go_by_the_tier_server_s_clock_not_the_nodes(skew: str, monkeypatch: pytest.MonkeyPatch,
                                                                 allowed_logs: list[str]) -> None:
    """Nodes' clocks an hour apart (one stepped at boot, a VM resumed after days): a node ahead of a live claimer
    waits for its claim (it broke it at once and fetched the chunk from the origin too), and a claim a dead node
    with a clock ahead left in the tier long ago is broken at once (it was waited out, --shared-cache-wait per
    chunk, and never broken)."""
    client = DictClient()
    claimer, waiter = tier(client), tier(client, wait=0.5)
    cid = chunk()
    real_time = time.time
    if skew == "waiter ahead":
        assert claimer.get(cid) is None and claimer.stats.claims == 1  # a live claim, just made
        held = client.objects[claimer.claim_key(cid)]
        monkeypatch.setattr(time, "time", lambda: real_time() + 3600)  # this node's clock is an hour ahead
        assert waiter.get(cid) is None
        assert waiter.stats.claim_waits == 1 and waiter.stats.fallbacks == 1 and waiter.stats.claims == 0
        assert client.objects[claimer.claim_key(cid)] == held  # the claimer's still: not broken
    else:
        key = waiter.claim_key(cid)
        client.objects[key] = f"{real_time() + 3600:.3f} deadhost 1".encode()  # its clock was an hour ahead
        client.mtime_ns[key] = SERVER_CLOCK_NS() - int((CLAIM_TTL_S + 60) * 1e9)  # made long ago, by the server
        started = time.monotonic()
        assert waiter.get(cid) is None  # ours to fetch, at once
        assert time.monotonic() - started < 0.4
        assert waiter.stats.claims == 1 and waiter.stats.claim_waits == 0
        assert b"deadhost" not in client.objects[key]


def test_an_unavailable_tier_is_skipped_for_a_while(allowed_logs: list[str]) -> None:
    allowed_logs.append("unavailable")
    client = DictClient()
    clock = Clock()
    t = tier(client, clock=clock)
    client.fail = Unreachable("connection refused")
    assert t.get(chunk()) is None and t.stats.errors == 1
    asked = client.requests
    client.fail = None
    assert t.get(chunk(index=1)) is None and t.put(chunk(index=1), data_of(chunk(index=1))) is None
    assert client.requests == asked  # skipped: not one request while the pause lasts
    clock.now += UNAVAILABLE_RETRY_S + 1
    t.put(chunk(index=2), data_of(chunk(index=2)))
    assert t.get(chunk(index=2)) == data_of(chunk(index=2))


def test_refused_puts_pause_writes_and_reads_go_on(allowed_logs: list[str]) -> None:
    allowed_logs.append("writing a chunk failed")
    client = DictClient()
    clock = Clock()
    t = tier(client, clock=clock)
    client.objects[t.chunk_key(chunk(index=5))] = b"".join(encode_chunk(chunk(index=5), data_of(chunk(index=5))))
    client.refuse_puts = StoreError("PUT: AccessDenied")
    t.put(chunk(), data_of(chunk()))
    t.put(chunk(index=1), data_of(chunk(index=1)))
    assert t.stats.write_errors == 1  # the second was not even tried
    assert t.get(chunk(index=5)) == data_of(chunk(index=5))  # reads go on
    client.refuse_puts = None
    clock.now += WRITE_RETRY_S + 1
    t.put(chunk(index=1), data_of(chunk(index=1)))
    assert t.stats.writes == 1


def claiming_node(n: int = 4) -> tuple[DictClient, Clock, SharedTier, list[ChunkId]]:
    """A node on a tier that has claimed `n` chunks it missed (to fetch them from the origin)."""
    client, clock = DictClient(), Clock()
    t = tier(client, clock=clock)
    cids = [chunk(index=i) for i in range(n)]
    for cid in cids:
        assert t.get(cid) is None  # a miss: this node claims the chunk to fetch it
    return client, clock, t, cids


def test_claims_of_a_tier_that_stopped_answering_are_left_to_expire(allowed_logs: list[str]) -> None:
    """A tier that turns into a black hole after this node claimed its chunks: once a write has failed, the
    claims are not DELETEd one after another (each DELETE waited out the tier's timeout, and the unmount's
    drain of writes ran past its bound); they expire on their own. A failed DELETE pauses writes too."""
    allowed_logs.append("failed .*writes pause")
    client, clock, t, cids = claiming_node()
    assert t.stats.claims == 4
    client.fail = TimedOut("PUT: TimeoutError: timed out")  # what a black hole gives (no answer)
    t.put(cids[0], data_of(cids[0]))  # the PUT fails: writes pause
    requests = client.requests
    for cid in cids[1:]:
        t.put(cid, data_of(cid))
    assert client.requests == requests  # neither a PUT nor a DELETE was sent
    assert all(t.claim_key(cid) in client.objects for cid in cids)  # left to expire (CLAIM_TTL_S)

    client.fail = None
    clock.now += WRITE_RETRY_S + 1
    t2 = tier(client, clock=clock)
    for cid in cids:
        client.objects.pop(t2.claim_key(cid), None)
    assert t2.get(cids[0]) is None and t2.get(cids[1]) is None  # two fresh claims
    client.fail = TimedOut("DELETE: TimeoutError: timed out")
    t2.abandon(cids[0])  # its DELETE fails: writes pause, and the next claim is not sent a DELETE
    requests = client.requests
    t2.abandon(cids[1])
    assert client.requests == requests and t2.stats.write_errors == 1


def test_read_only_never_writes_nor_claims() -> None:
    client = DictClient()
    t = tier(client, read_only=True)
    assert t.get(chunk()) is None
    t.put(chunk(), data_of(chunk()))
    assert client.objects == {} and t.stats.claims == 0


def test_a_tier_that_ignores_conditional_creates_runs_without_claims(allowed_logs: list[str]) -> None:
    allowed_logs.append("does not support conditional writes")

    class IgnoresConditions(DictClient):
        def put_object(self, key: str, body: bytes, *, only_if_absent: bool = False) -> bool:
            return super().put_object(key, body)

    t = tier(IgnoresConditions())
    t.probe_claims()
    assert not t.claims
    assert t.get(chunk()) is None and t.stats.claims == 0
    good = tier(DictClient())
    good.probe_claims()
    assert good.claims and good.client.objects == {}  # type: ignore[attr-defined]


def test_a_probe_refused_for_permission_leaves_claims_on_and_says_so(caplog: pytest.LogCaptureFixture,
                                                                    allowed_logs: list[str]) -> None:
    """A 403 is a permission, not a tier without conditional writes: claims stay on for when it is granted."""
    allowed_logs.append("refuses writes")
    client = DictClient()
    client.fail = AccessDenied("access denied to bucket 'tier' (AccessDenied)")
    t = tier(client)
    t.probe_claims()
    assert t.claims
    assert "refuses writes" in caplog.text and "does not support conditional writes" not in caplog.text


def test_a_tier_that_takes_puts_but_refuses_deletes_runs_without_claims(caplog: pytest.LogCaptureFixture,
                                                                         allowed_logs: list[str]) -> None:
    """Credentials with s3:PutObject and not s3:DeleteObject: the node claimed every chunk, could drop none, and the
    other node waited on each claim then fetched the chunk itself (22 origin GETs for 13 chunks), while the warning
    said this node "only reads" the tier."""
    allowed_logs.append("refuses deletes")

    class RefusesDeletes(DictClient):
        def delete_object(self, key: str) -> None:
            raise AccessDenied("access denied to bucket 'tier' (AccessDenied)")

    t = tier(RefusesDeletes())
    t.probe_claims()
    assert not t.claims
    assert "refuses deletes" in caplog.text and "only reads" not in caplog.text
    assert t.get(chunk()) is None and t.stats.claims == 0  # a miss goes to the origin at once, claiming nothing


def test_a_probe_the_tier_does_not_answer_leaves_claims_on() -> None:
    client = DictClient()
    client.fail = Unreachable("connection refused")
    t = tier(client)
    t.probe_claims()
    assert t.claims  # no answer is not a refusal: the tier is tried again as reads go


@pytest.mark.parametrize("failing", ["second_put", "delete"])
def test_a_probe_cut_short_by_a_5xx_leaves_no_probe_in_the_tier(failing: str) -> None:
    """The probe's first create landed, then its second create or its delete got a 503: the probe object stayed in
    the tier for good, a key nothing ever looks at again."""

    class FailsOnce(DictClient):
        failed = False

        def _once(self) -> None:
            if not self.failed:
                self.failed = True
                raise TransientError("503 SlowDown")

        def put_object(self, key: str, body: bytes | list, *, only_if_absent: bool = False) -> bool:
            if failing == "second_put" and key in self.objects:
                self._once()
            return super().put_object(key, body, only_if_absent=only_if_absent)

        def delete_object(self, key: str) -> None:
            if failing == "delete":
                self._once()
            super().delete_object(key)

    client = FailsOnce()
    t = tier(client)
    t.probe_claims()
    assert client.failed and t.claims
    assert client.objects == {}


def test_a_refused_claim_pauses_writes_not_reads(caplog: pytest.LogCaptureFixture, allowed_logs: list[str]) -> None:
    """A refused claim is said as one (it was worded as a refused chunk write, which none had been)."""
    allowed_logs.append(r"claiming a chunk \(a small write\) failed")
    client = DictClient()
    t = tier(client)
    held = chunk(index=3)
    client.objects[t.chunk_key(held)] = b"".join(encode_chunk(held, data_of(held)))
    client.refuse_puts = StoreError("PUT: AccessDenied")
    assert t.get(chunk()) is None  # the claim was refused: a miss, for the origin
    assert t.stats.write_errors == 1 and t.stats.errors == 0
    assert t.get(held) == data_of(held)  # reads go on
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
        f"{t}: claiming a chunk (a small write) failed (PUT: AccessDenied); reads go on, writes pause for "
        f"{shared_tier.WRITE_RETRY_S:g}s at a time (chunks fetched meanwhile are not written to the tier)"]


# -- trailing writes: who may hold its writes back, and how a waiting node says so -----------------

def markers(client: DictClient) -> list[str]:
    return [k for k in client.objects if k.startswith("modelfs/" + WAITING)]


def test_a_node_alone_trails_until_it_meets_another_nodes_claim() -> None:
    client, shift = DictClient(), [0.0]

    def clock() -> float:  # real time (a wait polls in it), moved on by the test
        return time.monotonic() + shift[0]

    first, second = tier(client), tier(client, wait=0.2, clock=clock)  # type: ignore[arg-type]
    assert first.trails() and second.trails()
    assert first.get(chunk()) is None  # claimed: no other node met
    assert first.trails()
    assert second.get(chunk()) is None  # waited on first's claim (then fell back)
    assert not second.trails() and first.trails()
    shift[0] += FLEET_QUIET_S + 1
    assert second.trails()
    assert not tier(client, read_only=True).trails()


def test_a_waiting_node_leaves_a_marker_that_makes_a_trailing_node_write_at_once() -> None:
    client = DictClient()
    claimer, waiter, bystander = tier(client), tier(client, wait=0.3), tier(client)
    assert claimer.get(chunk()) is None
    assert not claimer.look_for_waiters() and claimer.trails()
    assert waiter.get(chunk()) is None
    assert claimer.get(chunk(index=1)) is None
    assert waiter.get(chunk(index=1)) is None and waiter.stats.claim_waits == 2
    assert len(markers(client)) == 1  # one marker per node, refreshed, not one per chunk
    assert claimer.look_for_waiters() and not claimer.trails()
    assert claimer.stats.waiters_seen == 1
    assert not waiter.look_for_waiters()  # its own marker is not another node's
    assert bystander.look_for_waiters()
    waiter.drop_claims()  # unmount
    assert markers(client) == []
    assert not tier(client).look_for_waiters()


def test_a_stale_marker_of_a_dead_waiter_is_not_a_waiting_node() -> None:
    client = DictClient()
    key = "modelfs/" + WAITING + "dead-node"
    client.put_object(key, b"gone 1")
    client.mtime_ns[key] -= int((WAITING_FRESH_S + 1) * 1e9)
    trailing = tier(client)
    assert not trailing.look_for_waiters() and trailing.trails()
    client.mtime_ns[key] += int(2 * 1e9)  # refreshed: fresh again
    assert trailing.look_for_waiters() and not trailing.trails()


def test_a_failing_marker_listing_is_no_waiter(allowed_logs: list[str]) -> None:
    client = DictClient()
    trailing = tier(client)
    client.fail = Unreachable("tier down")
    assert not trailing.look_for_waiters() and trailing.trails()


def test_one_origin_spelled_two_ways_is_one_origin_to_the_tier() -> None:
    """Nodes given `http://h:9000/` and `http://h:9000` (or a region from --region and one from the environment)
    hashed different origins into their chunk keys and shared nothing, silently."""
    from fsmount.data import origin_identity

    same = {origin_identity(url, "r") for url in ("http://h:9000", "http://h:9000/", "HTTP://H:9000", "http://h:9000//")}
    assert same == {"http://h:9000"}
    assert origin_identity("http://h:80/", "r") == origin_identity("http://h", "r") == "http://h"
    assert origin_identity("https://h:443", "r") == "https://h"
    assert origin_identity("http://[::1]:9000/", "r") == "http://[::1]:9000"
    assert origin_identity(None, "us-east-1") == "s3:us-east-1"
    distinct = {origin_identity(u, "r") for u in ("http://h:9000", "https://h:9000", "http://h:9001", "http://h:9000/a")}
    assert len(distinct) == 4


def test_a_read_only_node_that_finds_a_bad_object_claims_nothing(allowed_logs: list[str]) -> None:
    """--shared-cache-read-only never writes the tier: a bad object sent it to the origin with a claim it then
    never dropped (and with read-only credentials, a refused claim paused "writes" and failed prefetch)."""
    allowed_logs.append("ignoring chunk object")
    client = DictClient()
    t = tier(client, read_only=True)
    cid = chunk()
    client.objects[t.chunk_key(cid)] = b"not a chunk file at all"
    assert t.get(cid) is None
    assert t.stats.claims == 0 and t.claim_key(cid) not in client.objects and t.stats.write_errors == 0


def test_claims_left_while_the_tier_was_silent_go_once_it_answers_or_at_unmount(allowed_logs: list[str]) -> None:
    """Claims let go while the tier did not answer were left to expire, and forgotten: they stayed in the tier bucket
    for good (a tester: 11 of them 520 s after a 12 s black hole, the node unmounted cleanly). They go once a write
    succeeds again, or at unmount; not one another node made again after breaking ours, stale."""
    allowed_logs.append("failed .*writes pause")
    client, clock, t, cids = claiming_node()
    client.fail = TimedOut("PUT: TimeoutError: timed out")
    for cid in cids[:3]:
        t.put(cid, data_of(cid))  # the first fails, the others are skipped: all three claims left
    client.fail = None
    client.objects[t.claim_key(cids[2])] = b"1.000 another-node 42"  # broken (stale) and claimed by another node
    clock.now += WRITE_RETRY_S + 1
    t.put(cids[3], data_of(cids[3]))  # the tier answers: a write succeeds
    assert [t.claim_key(cid) in client.objects for cid in cids] == [False, False, True, False]
    assert not t._left  # noqa: SLF001

    assert t.get(chunk(index=9)) is None  # claimed, then the tier goes silent before its write
    client.fail = TimedOut("PUT: TimeoutError: timed out")
    t.put(chunk(index=8), data_of(chunk(index=8)))
    t.abandon(chunk(index=9))
    assert t.claim_key(chunk(index=9)) in client.objects
    client.fail = None
    clock.now += WRITE_RETRY_S + 1
    assert t.drop_claims() == 0 and t.claim_key(chunk(index=9)) not in client.objects


def test_claims_left_while_the_tier_was_silent_go_at_an_unmount_soon_after_it_answers_again(
        allowed_logs: list[str]) -> None:
    """The tier stopped answering (a black hole), came back, and the node unmounted within UNAVAILABLE_RETRY_S of
    the silence: its claims let go meanwhile stayed in the tier bucket for good (no request was tried at unmount while
    the node still counted the tier silent; found by test_tier_fuzz.py). At unmount one request tells whether
    the tier answers: it does, so they all go; a tier still silent costs that one request, not one per claim."""
    allowed_logs.append("unavailable|failed .*writes pause")
    client, clock, t, cids = claiming_node()
    client.fail = TimedOut("GET: TimeoutError: timed out")
    assert t.get(chunk(index=9)) is None  # the tier goes silent: skipped for UNAVAILABLE_RETRY_S
    for cid in cids:
        t.abandon(cid)  # the fetches cut short: the claims are left, not each sent a DELETE that waits a timeout
    assert all(t.claim_key(cid) in client.objects for cid in cids)
    client.fail = None  # the tier answers again; the node unmounts at once
    assert t.drop_claims() == 0
    assert [t.claim_key(cid) in client.objects for cid in cids] == [False] * len(cids)

    client, clock, t, cids = claiming_node()
    client.fail = TimedOut("GET: TimeoutError: timed out")
    assert t.get(chunk(index=9)) is None
    for cid in cids:
        t.abandon(cid)
    requests = client.requests
    assert t.drop_claims() == 0  # still silent: one request tried, then the rest left to expire
    assert client.requests == requests + 1
    assert all(t.claim_key(cid) in client.objects for cid in cids)

    # Claims still held at unmount (fetches it cut short) are let go while the tier counts as silent: they go too.
    client, clock, t, cids = claiming_node()
    client.fail = TimedOut("GET: TimeoutError: timed out")
    assert t.get(chunk(index=9)) is None
    client.fail = None
    assert t.drop_claims() == len(cids)
    assert [t.claim_key(cid) in client.objects for cid in cids] == [False] * len(cids)


@pytest.mark.parametrize("failure", [TransientError("DELETE: server error SlowDown"),
                                     Unreachable("DELETE: connection refused")])
def test_a_claim_whose_delete_failed_goes_once_the_tier_answers_or_at_unmount(allowed_logs: list[str],
                                                                              failure: StoreError) -> None:
    """A claim's DELETE that failed (a 503, the connection cut as the tier went down) forgot the claim: it stayed in the
    tier bucket for good, though the node unmounted cleanly once the tier answered again (found by test_tier_fuzz.py,
    where the chunk's PUT was cut, then its claim's DELETE refused). It is kept with the claims left while the tier
    was silent: dropped once a write succeeds, or at unmount."""
    allowed_logs.append("failed .*writes pause")
    client, clock, t, cids = claiming_node(2)
    client.fail = failure
    t.abandon(cids[0])  # the fetch failed; dropping its claim fails too
    t.abandon(cids[1])
    assert all(t.claim_key(cid) in client.objects for cid in cids)
    client.fail = None
    assert t.drop_claims() == 0
    assert [t.claim_key(cid) in client.objects for cid in cids] == [False, False]


def test_a_claim_whose_create_landed_but_got_no_answer_is_dropped_once_the_tier_answers_or_at_unmount(
        allowed_logs: list[str]) -> None:
    """The conditional create of a claim reached the tier, but its answer was cut (a connection reset as the tier went
    down): the node took it for a failed request and forgot the claim, which stayed in the tier bucket for good under
    this node's name, and other nodes waited --shared-cache-wait for that chunk until it was 30 s old (found by
    test_tier_fuzz.py). It is dropped once a write succeeds, or at unmount, if it is this node's."""
    allowed_logs.append("unavailable")

    class CutAnswers(DictClient):
        cut = False

        def put_object(self, key: str, body: bytes | list, *, only_if_absent: bool = False) -> bool:
            created = super().put_object(key, body, only_if_absent=only_if_absent)
            if self.cut:
                raise TransientError("PUT: ConnectionResetError: [Errno 104] Connection reset by peer")
            return created

    client, clock = CutAnswers(), Clock()
    t = tier(client, clock=clock)
    x, y = chunk(index=0), chunk(index=1)
    client.cut = True
    assert t.get(x) is None  # claimed, but the answer lost: the origin it is
    assert t.claim_key(x) in client.objects
    client.cut = False
    clock.now += UNAVAILABLE_RETRY_S + 1
    client.objects[t.claim_key(y)] = b"%.3f another-node 42" % time.time()  # another node's: never dropped by this one
    t.put(y, data_of(y))  # a write succeeds
    assert t.claim_key(x) not in client.objects and t.claim_key(y) in client.objects

    client.cut = True
    assert t.get(chunk(index=2)) is None
    client.cut = False
    assert t.drop_claims() == 0  # at unmount
    assert t.claim_key(chunk(index=2)) not in client.objects


def test_a_tier_that_answered_one_request_with_an_error_still_drops_this_node_s_claims(allowed_logs: list[str]) -> None:
    """One tier GET refused (a 503 SlowDown) made the tier "down" for 10 s, and a claim this node dropped then was left
    to expire: every other node waited --shared-cache-wait for it and then fetched the chunk from the origin (the
    audit). Left to expire only while the tier does not answer at all (its DELETEs would each wait a timeout)."""
    allowed_logs.append("unavailable")
    client = DictClient()
    a = tier(client)
    x, y = chunk(0), chunk(1)
    assert a.get(x) is None and x in a._claimed  # noqa: SLF001 - A claims x and fetches it from the origin
    client.fail = TransientError("GET: server error SlowDown")
    assert a.get(y) is None  # refused: the tier is "down" for reads a while
    client.fail = None
    a.put(x, data_of(x))  # the write is skipped meanwhile, and the claim dropped
    assert a.claim_key(x) not in client.objects
    b = tier(client, wait=5.0)
    started = time.monotonic()
    assert b.get(x) is None and time.monotonic() - started < 1.0  # no wait for a claim: B fetches it itself
    # A tier that does not answer at all: the claim is left to expire, not asked with a DELETE that waits a timeout.
    c = tier(client)
    z = chunk(2)
    assert c.get(z) is None and z in c._claimed  # noqa: SLF001
    client.fail = TimedOut("GET: TimeoutError: timed out")
    assert c.get(y) is None
    requests = client.requests
    c.abandon(z)
    assert client.requests == requests and c.claim_key(z) in client.objects


class SlowTierClient(DictClient):
    """A tier that answers every request, slowly: each takes SLOW_SHARE of the timeout the mount gives its client
    (`mount.open_shared_tier` builds it in place of the Boto3Store)."""

    SLOW_SHARE = 0.6

    def __init__(self, cfg: StoreConfig, **_: object) -> None:
        super().__init__()
        self.bucket = cfg.bucket
        self.endpoint_url = self.configured_endpoint_url = cfg.endpoint_url
        self.delay = self.SLOW_SHARE * cfg.read_timeout

    def check_bucket(self, prefix: str) -> None:
        return None

    def _request(self) -> None:
        time.sleep(self.delay)
        super()._request()


async def test_a_lookup_in_a_tier_that_answers_slowly_ends_within_its_share_of_the_read_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """B256: B253 bounded each tier request, and a wait for another node's claim, by a quarter of --read-timeout, but
    one lookup makes several in a row (the read, the claim and a look at the claim held, the marker, the polls and
    claim checks of the wait, a read after a claim won): against a tier answering each a little under its timeout
    with another node's claim held, they added up past --read-timeout (4 s), and the READ failed while the origin
    answered. The lookup now ends within the quarter, and the chunk comes from the origin well within the read's
    time."""
    from types import SimpleNamespace

    from fsmount import mount
    from fsmount.config import MountConfig, SharedCacheConfig
    from fsmount.data.levels import LevelStack

    from .fake_store import FakeStore

    read_timeout = 4.0
    monkeypatch.setattr(mount, "Boto3Store", SlowTierClient)
    cfg = MountConfig(store=StoreConfig(bucket="models", endpoint_url=ORIGIN, read_timeout=read_timeout),
                      mountpoint="/mnt", shared_cache=SharedCacheConfig(bucket="tier",
                                                                        endpoint_url="http://tier.example:9000"))
    origin = SimpleNamespace(endpoint_url=ORIGIN, configured_endpoint_url=ORIGIN, region="us-east-1")
    t = mount.open_shared_tier(cfg, origin)  # type: ignore[arg-type]
    client = t.client
    assert isinstance(client, SlowTierClient) and t.claims
    store = FakeStore("models")
    data = bytes(range(256)) * (CHUNK // 256)
    store.put("llm/model.safetensors", data)
    cid = ChunkId("models", "llm/model.safetensors", store.etags["llm/model.safetensors"], CHUNK, 0)
    key = t.claim_key(cid)
    client.objects[key] = f"{time.time():.3f} otherhost 1".encode()  # another node's, live
    client.mtime_ns[key] = SERVER_CLOCK_NS()
    stack = LevelStack(store, [t], max_connections=4, chunk_size=CHUNK)
    started = time.monotonic()
    with trio.fail_after(read_timeout):  # the READ's time: EIO past it
        got, hit = await stack.load(cid, CHUNK, None, lambda: started + read_timeout)
    elapsed = time.monotonic() - started
    assert hit is None and bytes(got) == data  # the origin's bytes
    assert elapsed < read_timeout / mount.TIER_SHARE_OF_READ_TIMEOUT + 0.5, elapsed
    assert t.stats.claim_waits == t.stats.fallbacks == 1 and t.stats.errors == 0, t.stats


class TimedClient(DictClient):
    """A tier whose every request takes `step` seconds of a `Clock`; `begun` holds when each began. `before` runs
    before each request (the test's other node acting at a moment of the lookup)."""

    def __init__(self, clock: Clock, step: float) -> None:
        super().__init__()
        self.clock, self.step = clock, step
        self.begun: list[float] = []
        self.before: list[object] = []

    def _request(self) -> None:
        self.begun.append(self.clock.now)
        for act in self.before:
            act()  # type: ignore[operator]
        self.clock.now += self.step
        super()._request()


@pytest.mark.parametrize("path", ["claimed", "live-claim", "stale-claim", "claim-won-after-the-chunk-landed"])
def test_every_request_of_a_lookup_begins_within_its_time(monkeypatch: pytest.MonkeyPatch, path: str,
                                                          allowed_logs: list[str]) -> None:
    """B256: whichever way a lookup goes (a claim of its own; a wait for a live claim; a stale claim broken; a claim
    won in a wait just after the claimer wrote the chunk and let go), no request of it begins past `begin_within`, so
    it ends within that and one request. A claim won past that time after a hit is not dropped then, nor left in the
    tier for good: it goes with the next write that succeeds."""
    allowed_logs.append("breaking a claim older than")
    monkeypatch.setattr(shared_tier, "CLAIM_CHECK_S", 0.0)  # a claim check after every look
    clock = Clock()
    client = TimedClient(clock, step=1.0)
    t = SharedTier(client, origin=ORIGIN, prefix="modelfs/", wait=30.0, read_only=False, threads=4,
                   begin_within=6.5, clock=clock)
    cid, other = chunk(), chunk(index=1)
    key = t.claim_key(cid)
    if path != "claimed":
        client.objects[key] = b"%.3f otherhost 1" % time.time()
        age = CLAIM_TTL_S + 5 if path == "stale-claim" else 0
        client.mtime_ns[key] = SERVER_CLOCK_NS() - int(age * 1e9)
    if path == "claim-won-after-the-chunk-landed":
        def land() -> None:  # the claimer's put, and its claim dropped, just before the waiter's claim check
            if clock.now == 1005.0:
                client.objects[t.chunk_key(cid)] = b"".join(encode_chunk(cid, data_of(cid)))
                del client.objects[key]
        client.before.append(land)
    started = clock.now
    got = t.get(cid)
    assert client.begun and max(client.begun) < started + 6.5, client.begun
    assert clock.now <= started + 6.5 + 1.0
    if path == "claim-won-after-the-chunk-landed":
        # read 1000, claim 1001 (another's), look at it 1002, marker 1003; a wait: read 1004, claim 1005 (won), read
        # 1006: a hit, at 1007, past the lookup's time for requests: its claim left to drop later.
        assert got == data_of(cid) and t.stats.claims == 0 and key in client.objects
        t.put(other, data_of(other))  # a write that succeeds: the claims left go
        assert key not in client.objects
    elif path == "live-claim":
        assert got is None and t.stats.claim_waits == t.stats.fallbacks == 1
    else:
        assert got is None and t.stats.claims == 1 and cid in t._claimed  # noqa: SLF001 - ours to fetch


class QuickTierClient(SlowTierClient):
    """A tier as the mount builds it that answers at once; `cfg` is the StoreConfig the mount gave it."""

    SLOW_SHARE = 0.0

    def __init__(self, cfg: StoreConfig, **kwargs: object) -> None:
        super().__init__(cfg, **kwargs)
        self.cfg = cfg


@pytest.mark.parametrize(("read_timeout", "timeout", "wait", "begin_within"), [
    (120.0, 5.0, 5.0, 25.0),  # the defaults: a request and a wait as given, as before B256
    (40.0, 5.0, 5.0, 5.0),  # the shortest --read-timeout that keeps both as given
    (20.0, 2.5, 2.5, 2.5),
    (4.0, 0.5, 0.5, 0.5),
])
def test_the_mount_gives_a_lookup_a_quarter_of_the_read_timeout(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, read_timeout: float, timeout: float,
        wait: float, begin_within: float) -> None:
    """B256: `mount.open_shared_tier` gives a tier request at most an eighth of --read-timeout and the lookup's
    requests the rest of the quarter to begin in; with the default --read-timeout (120 s) and the tier's defaults
    (5 s each) a request and a wait are as given, and nothing is said."""
    from types import SimpleNamespace

    from fsmount import mount
    from fsmount.config import MountConfig, SharedCacheConfig

    monkeypatch.setattr(mount, "Boto3Store", QuickTierClient)
    cfg = MountConfig(store=StoreConfig(bucket="models", endpoint_url=ORIGIN, read_timeout=read_timeout),
                      mountpoint="/mnt", shared_cache=SharedCacheConfig(bucket="tier",
                                                                        endpoint_url="http://tier.example:9000"))
    origin = SimpleNamespace(endpoint_url=ORIGIN, configured_endpoint_url=ORIGIN, region="us-east-1")
    with caplog.at_level(logging.INFO, logger="fsmount.mount"):
        t = mount.open_shared_tier(cfg, origin)  # type: ignore[arg-type]
    client = t.client
    assert isinstance(client, QuickTierClient)
    assert (client.cfg.connect_timeout, client.cfg.read_timeout, t.wait, t.begin_within) == (
        timeout, timeout, wait, begin_within)
    assert timeout + begin_within == read_timeout / mount.TIER_SHARE_OF_READ_TIMEOUT
    said = [r.getMessage() for r in caplog.records if "a lookup takes at most" in r.getMessage()]
    assert bool(said) == (read_timeout < 40), said
