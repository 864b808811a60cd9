"""The fleet-shared chunk tier: a cache level on an S3-compatible bucket near the nodes (S3 Express One
Zone, an OSS bucket in the region, a SeaweedFS or MinIO cluster), so that N nodes cold-starting one model
cost the origin about one copy of it.

A chunk object is a chunk file (chunk_file: a header naming bucket, key, ETag, chunk size, index, data
length and data hash, then the data) stored under `PREFIX chunks/<h>`, where h hashes the origin endpoint
with the chunk id, so two origins, two versions or two chunk sizes never share a key. Every read checks
the whole header against the chunk asked for and the data against its hash; a mismatch is counted,
logged once and taken as a miss, so a wrong byte is never served.

Simultaneous cold start: on a miss a node claims the chunk by creating `PREFIX claims/<h>` only if it is
absent (If-None-Match: *). The claimer fetches the chunk from the origin; the level stack writes it back
here, and `put` then drops the claim (`abandon` drops it when the fetch failed, so that the others need
not wait for it). The other nodes poll for the chunk object for up to `wait` seconds, then fetch it from
the origin themselves; every CLAIM_CHECK_S they also look at the claim, and once it is gone (dropped) or
older than CLAIM_TTL_S by the tier server's clock (its node died; it is broken: `_expired`) they claim the chunk
and fetch it at once. A tier
that does not honour conditional writes is found at mount (`probe_claims`) and run without claims.

Trailing writes: while no other node is seen, the level stack may hold this node's chunk writes back
until its origin GETs are done (trailing.py), so that a node loading alone is not slowed by filling the
tier. It asks `trails()`. A node that waits for another node's claim says so with a marker object,
`PREFIX waiting/<node>`, refreshed every MARKER_REFRESH_S while it waits and deleted at unmount; the
trailing node lists those markers (`look_for_waiters`) and writes at once when it finds a fresh one, as it
does when it has itself found another node's claim in the last FLEET_QUIET_S. Freshness compares a
marker's LastModified with this node's clock: clocks off by more than WAITING_FRESH_S only make a node
write at once (or trail, for at most trailing.TRAIL_MAX_S, below CLAIM_TTL_S), never a wrong byte.

Failures never reach a reader: every request has the tier client's own timeout, and every request of one
`get` begins within `begin_within` seconds of its start (a claim not looked at by then counts as live, a
wait ends, a claim won after a hit is left to go later: `_left`), so a lookup against a tier that answers,
slowly, takes at most `begin_within` and one request's timeout (the mount makes that a quarter of
--read-timeout: the origin has the rest of the READ's time); a tier that fails a
request is skipped for UNAVAILABLE_RETRY_S (one warning per episode) and reads go to the origin; a
refused PUT pauses writes for WRITE_RETRY_S (one warning per episode) while reads go on. get and put never
raise.

Threads: get, put and look_for_waiters run in the level stack's worker threads; trails() runs in the trio
thread. `_lock` guards the counters, the failure episodes, the log-once flags, `_claimed` (chunks this
node has claimed and not yet written), `_left` (claims let go while the tier was silent, or past a lookup's time for
requests, or whose DELETE failed), `_others_seen_at` and `_marker_put_at`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from fsmount.config import SHARED_TIER_FOLDERS
from fsmount.data.chunk_file import (
    HEADER_READ_BYTES,
    Corrupt,
    OtherFormat,
    encode_chunk,
    read_chunk_stream,
)
from fsmount.data.identity import ChunkId, WritableBuffer
from fsmount.data.store import AccessDenied, ListingPage, StoreError, TimedOut, TransientError, Unreachable
from fsmount.data.trailing import TRAIL_WORKERS

log = logging.getLogger(__name__)

# The folders under the prefix (named in config: a mount that would show one of them is refused).
CHUNKS, CLAIMS, WAITING = SHARED_TIER_FOLDERS
# A claim this old is taken to belong to a node that died: long enough for a slow origin GET of one
# chunk and its write to the tier, short enough that a dead node costs others seconds, not minutes.
CLAIM_TTL_S = 30.0
# How often a node waiting for another node's fetch looks for the chunk object, and for the claim.
POLL_S = 0.05
CLAIM_CHECK_S = 0.5
# After a failed request the tier is skipped this long: a down tier must not cost every chunk a timeout.
UNAVAILABLE_RETRY_S = 10.0
# What `_read` returns for a chunk object that is there but bad (not the chunk asked for, or damaged): one
# object, compared by identity.
_CORRUPT = bytearray()
# A node waiting for other nodes' claims refreshes its marker this often (one small PUT per node, not per
# chunk); a marker younger than WAITING_FRESH_S means another node is waiting now.
MARKER_REFRESH_S = 1.0
WAITING_FRESH_S = 15.0
# Having met another node's claim or marker, a node writes its chunks at once for this long.
FLEET_QUIET_S = 60.0
# After a refused PUT (full, read-only, no permission) writes pause this long.
WRITE_RETRY_S = 30.0
# Chunk PUTs at once. A PUT by the presigned path sends the engine's buffer as it is; by botocore's (a
# proxy in the environment) it joins a whole chunk object (header + data) outside the engine's memory
# budget while it is sent, which the mount subtracts from the budget either way (staging_bytes).
PUT_THREADS = 4


class ObjectStream(Protocol):
    """One GET's body (boto3_store.ObjectReader): `size` bytes to read front to back, and the object's age on the
    server's clock (store.server_age_s; None if the server did not give it)."""

    size: int
    server_age_s: float | None

    def read(self, n: int) -> bytes: ...

    def readinto(self, buffer: WritableBuffer) -> int: ...

    def __enter__(self) -> ObjectStream: ...

    def __exit__(self, *exc_info: object) -> None: ...


class TierClient(Protocol):
    """What the tier needs of a store client (boto3_store.Boto3Store has it). Blocking; StoreErrors."""

    bucket: str

    def open_object(self, key: str) -> ObjectStream | None: ...

    def get_object(self, key: str) -> bytes | None: ...

    def put_object(self, key: str, body: bytes | Sequence[bytes | WritableBuffer], *,
                   only_if_absent: bool = False) -> bool: ...

    def delete_object(self, key: str) -> None: ...

    def list_pages(self, prefix: str) -> Iterator[ListingPage]: ...


def origin_identity(endpoint_url: str | None, region: str) -> str:
    """What names the origin in chunk keys: nodes that give the same endpoint in different spellings (a trailing
    slash, the default port, the host's case) share the tier. They shared nothing: `http://h:9000/` and
    `http://h:9000` are one origin, and so are an AWS region given with --region and one from the environment."""
    if not endpoint_url:
        return f"s3:{region}"
    url = urllib.parse.urlsplit(endpoint_url)
    scheme, host = url.scheme.lower(), (url.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"  # an IPv6 literal
    port = "" if url.port is None or (scheme, url.port) in (("http", 80), ("https", 443)) else f":{url.port}"
    return f"{scheme}://{host}{port}{url.path.rstrip('/')}"


@dataclasses.dataclass
class TierStats:
    """What only the tier sees (its hits, misses and bytes are the level stack's to count)."""

    claims: int = 0  # chunks this node claimed, so fetched from the origin for the fleet
    claim_waits: int = 0  # misses that found another node's claim and waited for its chunk
    fallbacks: int = 0  # waits that ended without the chunk: fetched from the origin after all
    writes: int = 0
    write_errors: int = 0  # refused or failed writes of any kind: chunks, claims, markers
    chunk_write_errors: int = 0  # of those, chunk objects not written
    writes_skipped: int = 0  # chunks not written because the tier was failing or refusing writes then
    corrupt: int = 0  # chunk objects that failed the identity or checksum check
    other_format: int = 0  # chunk objects of another version's format (replaced, as corrupt ones are)
    errors: int = 0  # requests that failed (the tier was then skipped for a while)
    waiters_seen: int = 0  # listings of the waiting markers that found another node waiting


class SharedTier:
    def __init__(self, client: TierClient, *, origin: str, prefix: str, wait: float, read_only: bool,
                 threads: int, begin_within: float = math.inf, clock: Callable[[], float] = time.monotonic):
        self.client = client
        self.origin = origin
        self.prefix = prefix
        self.wait = wait
        # No request of one get begins later than this after the get began: each of them, one after another (a read,
        # a claim, a marker, the polls and claim checks of a wait), took up to the client's timeout, and against a
        # tier that answered slowly their sum passed the READ's --read-timeout while the origin answered.
        self.begin_within = begin_within
        self.read_only = read_only
        self.claims = not read_only
        self.threads = threads  # the level stack runs this many lookups at once (network, not disk)
        self.put_threads = min(threads, PUT_THREADS)
        self.stats = TierStats()
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until: float | None = None
        self._writes_paused_until: float | None = None
        # Until when the tier is believed not to answer at all (its latest failure got no answer: Unreachable,
        # TimedOut), as opposed to answering with an error: claims are then left to expire (`_release`).
        self._silent_until = -math.inf
        self._corrupt_logged = False
        self._other_format_logged = False
        self._claimed: set[ChunkId] = set()
        # Claims let go while the tier did not answer, left to expire (`_release`): deleted once it answers again (after
        # the next write that succeeds) or at unmount. Forgotten, they stayed in the tier bucket for good: nobody reads
        # a rotated checkpoint's chunks again (a tester: 11 left, 520 s after a 12 s black hole).
        self._left: set[ChunkId] = set()
        self._owner = f"{socket.gethostname()} {os.getpid()}"
        node = hashlib.sha256(f"{self._owner} {time.time_ns()}".encode()).hexdigest()[:32]
        self._marker_key = prefix + WAITING + node
        self._marker_put_at: float | None = None  # None: this node has no waiting marker in the tier
        self._others_seen_at: float | None = None  # when this node last met another node's claim or marker

    def staging_bytes(self, chunk_size: int) -> int:
        """The most memory chunk objects being written hold outside the engine's budget (a read goes
        straight into the engine's buffer and holds none), with the buffers trailing writes read their
        chunks back into from the NVMe cache."""
        trailing = 0 if self.read_only else TRAIL_WORKERS * chunk_size
        return self.put_threads * (chunk_size + HEADER_READ_BYTES) + trailing

    def __str__(self) -> str:
        return f"shared cache {self.client.bucket}/{self.prefix}"

    # -- names ---------------------------------------------------------------------------------

    def _hash(self, chunk: ChunkId) -> str:
        h = hashlib.sha256()
        for part in (self.origin, chunk.digest()):
            data = part.encode("utf-8", "surrogateescape")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

    def chunk_key(self, chunk: ChunkId) -> str:
        return self.prefix + CHUNKS + self._hash(chunk)

    def claim_key(self, chunk: ChunkId) -> str:
        return self.prefix + CLAIMS + self._hash(chunk)

    # -- at mount ------------------------------------------------------------------------------

    def probe_claims(self) -> None:
        """Find out whether the tier honours If-None-Match: * (a second create of one key must fail);
        if not, or if it refuses the header, claims are off for this mount (one warning)."""
        if self.read_only:
            return
        key = f"{self.prefix}{CLAIMS}probe-{os.getpid()}-{time.time_ns()}"
        first = False
        try:
            first = self.client.put_object(key, b"probe", only_if_absent=True)
            second = self.client.put_object(key, b"probe", only_if_absent=True)
            if not self._probe_delete(key):
                return
        except (Unreachable, TransientError):
            # Not an answer: claims stay on, and the tier is tried as reads go. A probe the tier took a moment ago is
            # deleted once more (it was left in the tier for good: nothing else ever looks at its key).
            if first:
                with contextlib.suppress(StoreError):
                    self.client.delete_object(key)
            return
        except AccessDenied as exc:
            # A permission, not a missing feature: writes (claims included) fail and pause as they go, and
            # resume once the permission is there, claims with them.
            log.warning("%s refuses writes (%s): this node only reads it until it allows them; give the "
                        "credentials s3:PutObject and s3:DeleteObject on it, or pass --shared-cache-read-only",
                        self, exc.message)
            return
        except StoreError as exc:
            first, second = False, True
            reason = exc.message
        else:
            reason = "a second conditional create of one key succeeded"
        if first and not second:
            return
        self.claims = False
        log.warning("%s does not support conditional writes (%s): running without claims, so nodes that "
                    "start together may each fetch a chunk from the origin", self, reason)

    def _probe_delete(self, key: str) -> bool:
        """Delete the probe's key; False (claims off, one warning) if the tier refuses deletes. A claim this node
        cannot drop holds the other nodes up for --shared-cache-wait on every chunk it claimed, and each fetches
        it from the origin after all (22 origin GETs for 13 chunks on two nodes, measured); its chunk writes
        then pause too."""
        try:
            self.client.delete_object(key)
        except AccessDenied as exc:
            self.claims = False
            log.warning("%s refuses deletes (%s): running without claims, since a claim this node could not drop "
                        "would hold the other nodes up; give the credentials s3:DeleteObject on it", self, exc.message)
            return False
        return True

    # -- ChunkCache ----------------------------------------------------------------------------

    def get(self, chunk: ChunkId, buffer: WritableBuffer | None = None) -> bytes | WritableBuffer | None:
        if self._down():
            return None
        until = self._clock() + self.begin_within  # no request of this lookup begins past it
        data = self._read(chunk, buffer)
        if data is _CORRUPT:
            # A bad object: waiting for another node's claim would read the whole of it again every POLL_S
            # (225 GETs of 8 MiB for 3 chunks, measured) until that node rewrites it. The origin it is.
            if self.claims and not self._writes_paused() and self._in_time(until):  # never on a read-only node
                self._claim(chunk, until)  # ours if nobody holds it: this node's put then rewrites the object
            with self._lock:
                self.stats.fallbacks += 1
            return None
        if data is not None or not self.claims or self._down() or self._writes_paused():
            return data
        if not self._in_time(until):
            return None  # unclaimed, as on a tier without claims: the put writes it all the same
        claimed = self._claim(chunk, until)
        if claimed is not False:
            return None  # ours to fetch from the origin (True), or the tier failed (None)
        with self._lock:
            self.stats.claim_waits += 1
            self._others_seen_at = self._clock()
        if self._in_time(until):
            self._mark_waiting()
        deadline = min(self._clock() + self.wait, until)
        next_check = self._clock() + CLAIM_CHECK_S
        while self._clock() < deadline and not self._down():
            time.sleep(max(0.0, min(POLL_S, deadline - self._clock())))
            if not self._in_time(until):
                break
            data = self._read(chunk, buffer)
            if data is _CORRUPT:
                break  # written, but bad: not read again every POLL_S; the origin it is
            if data is not None:
                return data
            if self._clock() < next_check or not self._in_time(until):
                continue
            # The claim may be gone (its node's fetch failed, or the node stopped) or stale (the node died):
            # then this node claims the chunk and fetches it, instead of waiting out `wait` for nothing.
            claimed = self._claim(chunk, until)
            if claimed:
                # The claimer may have written it just before it let go.
                data = self._read(chunk, buffer) if self._in_time(until) else None
                if data is None or data is _CORRUPT:
                    return None  # ours to fetch from the origin
                # A hit after all: this claim fetches nothing, so it is not counted. Dropped now, or with no time left
                # for a request, later (`_left`: the chunk is there, so it holds nobody up meanwhile).
                self._release(chunk, in_time=self._in_time(until))
                with self._lock:
                    self.stats.claims -= 1
                return data
            if claimed is None:
                break
            if self._in_time(until):
                self._mark_waiting()
            next_check = self._clock() + CLAIM_CHECK_S
        with self._lock:
            self.stats.fallbacks += 1
        return None

    def put(self, chunk: ChunkId, data: bytes | WritableBuffer) -> None:
        if self.read_only:
            return
        try:
            if self._writes_paused() or self._down():
                with self._lock:
                    self.stats.writes_skipped += 1
                return
            try:
                self.client.put_object(self.chunk_key(chunk), encode_chunk(chunk, data))
            except StoreError as exc:
                with self._lock:
                    self.stats.chunk_write_errors += 1
                self._write_failed(exc)
                return
            with self._lock:
                self.stats.writes += 1
                self._writes_paused_until = None
                # One claimed again since is dropped when its own write or failure lets it go.
                left, self._left = self._left - self._claimed, set()
            for other in left:  # the tier answers again: claims left while it was silent go now
                self._drop(other, if_mine=True)
        finally:
            self._release(chunk)

    def abandon(self, chunk: ChunkId) -> None:
        """The chunk will not be put (this node's origin fetch failed): drop our claim on it, if any."""
        self._release(chunk)

    def drop_claims(self) -> int:
        """At unmount: drop every claim this node still holds (fetches cut short), so that other nodes need
        not wait for them until they are CLAIM_TTL_S old, and its waiting marker. How many claims there were."""
        with self._lock:
            held = list(self._claimed)
            marked, self._marker_put_at = self._marker_put_at is not None, None
        for chunk in held:
            self._release(chunk)  # while the tier counts as silent: into `_left`, tried below
        with self._lock:
            left, self._left = self._left, set()
        # Tried even while the tier counts as silent: it may answer again without this node having asked it since (a
        # black hole of a few seconds just before the unmount), and skipped, those claims stayed in the bucket for
        # good. The first that gets no answer ends it: the rest are left to expire, not each a timeout.
        silent = self._clock() < self._silent_until
        for chunk in left:
            if not self._drop(chunk, if_mine=True) and silent:
                break
        if marked:
            try:
                self.client.delete_object(self._marker_key)
            except StoreError as exc:  # it goes stale on its own
                log.debug("%s: dropping this node's waiting marker failed: %s", self, exc)
        return len(held)

    # -- trailing writes -----------------------------------------------------------------------

    def trails(self) -> bool:
        """Whether this node's chunk writes may trail its origin reads: no other node has been seen lately
        (none may be waiting for them). Cheap: no request."""
        if self.read_only:
            return False
        with self._lock:
            return self._others_seen_at is None or self._clock() - self._others_seen_at > FLEET_QUIET_S

    def look_for_waiters(self) -> bool:
        """List the waiting markers; True (and trails() turns False) if another node's is fresh. A tier
        that fails the listing answers False: its writes would fail too."""
        try:
            pages = list(self.client.list_pages(self.prefix + WAITING))
        except StoreError as exc:
            log.debug("%s: listing waiting markers failed: %s", self, exc)
            return False
        fresh_after = time.time_ns() - int(WAITING_FRESH_S * 1e9)
        for page in pages:
            for marker in page.objects:
                if marker.key != self._marker_key and marker.mtime_ns >= fresh_after:
                    with self._lock:
                        self._others_seen_at = self._clock()
                        self.stats.waiters_seen += 1
                    return True
        return False

    # -- internals -----------------------------------------------------------------------------

    def _read(self, chunk: ChunkId, buffer: WritableBuffer | None) -> bytes | WritableBuffer | None:
        """The chunk's bytes, None if the tier does not hold it (or failed), or _CORRUPT if what it holds is bad."""
        key = self.chunk_key(chunk)
        try:
            stream = self.client.open_object(key)
            if stream is None:
                return None
            with stream:
                # Straight into the engine's buffer: no copy of the chunk outside the memory budget.
                stored, data = read_chunk_stream(stream.read, stream.readinto, stream.size, buffer)
            if stored != chunk:
                raise Corrupt(f"it holds {stored}")
        except StoreError as exc:
            self._failed(exc)
            return None
        except OtherFormat as why:  # written by a node of another version: not damaged, not usable here either
            with self._lock:
                self.stats.other_format += 1
                first, self._other_format_logged = not self._other_format_logged, True
            (log.info if first else log.debug)(
                "%s: chunk objects another version of modelfs wrote (%s) are fetched again and replaced", self, why)
            return _CORRUPT
        except Corrupt as why:
            with self._lock:
                self.stats.corrupt += 1
                first, self._corrupt_logged = not self._corrupt_logged, True
            (log.warning if first else log.debug)(
                "%s: ignoring chunk object %s for chunk %d of %r (%s)%s", self, key, chunk.index, chunk.key, why,
                "; further ones are logged at debug level and counted" if first else "")
            return _CORRUPT
        return data

    def _held_claim(self, key: str) -> tuple[bytes, float | None] | None:
        """The claim's body and its age on the server's clock, None if there is no claim."""
        stream = self.client.open_object(key)
        if stream is None:
            return None
        with stream:
            return stream.read(stream.size), stream.server_age_s

    def _claim(self, chunk: ChunkId, until: float) -> bool | None:
        """True: this node claimed the chunk. False: another node holds a claim, live or not looked at before
        `until` (no request begins past it). None: the tier failed the request."""
        key = self.claim_key(chunk)
        for attempt in range(2):  # a second try only after breaking a stale claim
            try:
                if attempt and not self._in_time(until):
                    return False
                if self.client.put_object(key, f"{time.time():.3f} {self._owner}".encode(), only_if_absent=True):
                    with self._lock:
                        self._claimed.add(chunk)
                        self.stats.claims += 1
                    return True
                if not self._in_time(until):
                    return False
                held = self._held_claim(key)
                if held is None or not _expired(*held) or not self._in_time(until):
                    return False
                log.info("%s: breaking a claim older than %gs on chunk %d of %r (%s)", self, CLAIM_TTL_S,
                         chunk.index, chunk.key, held[0][:100].decode("utf-8", "replace"))
                self.client.delete_object(key)
            except (Unreachable, TransientError) as exc:
                self._failed(exc)
                # The create may have landed with its answer lost (a connection reset): forgotten, the claim stayed in
                # the tier under this node's name. Dropped with those left while the tier was silent, if it is ours.
                with self._lock:
                    self._left.add(chunk)
                return None
            except StoreError as exc:  # refused (no write permission, full): as a refused chunk write
                self._write_failed(exc, "claiming a chunk (a small write)")
                return None
        return False

    def _mark_waiting(self) -> None:
        """Tell trailing nodes that this one waits for a claimed chunk (at most one PUT per MARKER_REFRESH_S)."""
        with self._lock:
            if self._marker_put_at is not None and self._clock() - self._marker_put_at < MARKER_REFRESH_S:
                return
            self._marker_put_at = self._clock()
        try:
            self.client.put_object(self._marker_key, self._owner.encode())
        except StoreError as exc:  # the claimer then writes at its own pace (TRAIL_MAX_S at most)
            log.debug("%s: writing this node's waiting marker failed: %s", self, exc)

    def _release(self, chunk: ChunkId, in_time: bool = True) -> None:
        """Drop this node's claim on `chunk`, if it holds one; not `in_time` (a lookup with no time left for a
        request), or while the tier is silent, later (`_left`)."""
        with self._lock:
            if chunk not in self._claimed:
                return
            self._claimed.discard(chunk)
        with self._lock:
            silent = self._clock() < self._silent_until
            if silent or not in_time:
                # Left to expire (CLAIM_TTL_S), and deleted once the tier answers (`_left`): against a tier that
                # stopped answering, each DELETE waited out the tier's timeout, one claim after another, and held the
                # unmount's drain of writes past its bound. A tier that answered with an error (one 503 SlowDown) is
                # still asked: left, each claim held every other node up for --shared-cache-wait, then sent it to the
                # origin (the audit).
                self._left.add(chunk)
                return
        self._drop(chunk)

    def _drop(self, chunk: ChunkId, if_mine: bool = False) -> bool:
        """DELETE this node's claim on `chunk`; with `if_mine`, only if the claim there is still this node's (one left
        while the tier was silent may have been broken since, being stale, and made again by another node). False if
        the tier failed the request."""
        key = self.claim_key(chunk)
        try:
            if if_mine:
                held = self.client.get_object(key)
                if held is None or held.split(b" ", 1)[-1] != self._owner.encode():
                    return True
            self.client.delete_object(key)
        except StoreError as exc:
            log.debug("%s: dropping the claim on chunk %d of %r failed: %s", self, chunk.index, chunk.key, exc)
            self._write_failed(exc, "dropping a claim")
            # Dropped again with those left while the tier was silent (once a write succeeds, or at unmount): forgotten,
            # the claim stayed in the tier bucket for good, and held other nodes up until it was CLAIM_TTL_S old.
            with self._lock:
                self._left.add(chunk)
            return False
        return True

    def _in_time(self, until: float) -> bool:
        """Whether a request of a lookup whose requests begin before `until` may begin now."""
        return self._clock() < until

    def _down(self) -> bool:
        with self._lock:
            if self._down_until is None:
                return False
            if self._clock() < self._down_until:
                return True
        return False  # the pause is over: the next request tries the tier again

    def _note_silence(self, exc: StoreError, pause: float) -> None:
        """Called with the lock held: a failure that got no answer makes the tier silent for `pause`."""
        if isinstance(exc, (Unreachable, TimedOut)):
            self._silent_until = self._clock() + pause

    def _failed(self, exc: StoreError) -> None:
        with self._lock:
            self._note_silence(exc, UNAVAILABLE_RETRY_S)
            self.stats.errors += 1
            first = self._down_until is None or self._clock() >= self._down_until + UNAVAILABLE_RETRY_S
            self._down_until = self._clock() + UNAVAILABLE_RETRY_S
        (log.warning if first else log.debug)(
            "%s unavailable (%s): reading from the origin, trying the tier again in %gs", self, exc.message,
            UNAVAILABLE_RETRY_S)

    def _writes_paused(self) -> bool:
        with self._lock:
            return self._writes_paused_until is not None and self._clock() < self._writes_paused_until

    def _write_failed(self, exc: StoreError, what: str = "writing a chunk") -> None:
        with self._lock:
            self._note_silence(exc, WRITE_RETRY_S)
            self.stats.write_errors += 1
            first = self._writes_paused_until is None
            self._writes_paused_until = self._clock() + WRITE_RETRY_S
        if first:
            log.warning("%s: %s failed (%s); reads go on, writes pause for %gs at a time (chunks fetched meanwhile are "
                        "not written to the tier)", self, what, exc.message, WRITE_RETRY_S)


def _expired(claim: bytes, server_age_s: float | None) -> bool:
    """Whether a claim is older than CLAIM_TTL_S: by the tier server's clock (its answer's Date less the claim's
    Last-Modified), which is one clock for every node. Compared with this node's clock, the creation time a claim's
    body starts with (epoch seconds on the claimer's clock) made a node whose clock was a minute or more ahead of the
    claimer's (a clock stepped at boot, a VM resumed, a wrong RTC) break every live claim it met and fetch the chunk
    from the origin too, and one behind it never break a dead node's claims. The body's time is only used where the
    server gives no Date or Last-Modified; there an unreadable one counts as expired."""
    if server_age_s is not None:
        return server_age_s > CLAIM_TTL_S
    try:
        created = float(claim.split(b" ", 1)[0])
    except ValueError:
        return True
    return time.time() - created > CLAIM_TTL_S
